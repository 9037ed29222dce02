"""Collect verifier step logs for tools/distill.py: decode prompts through a real verifier
(`edgespec verifier serve --log-dir`), split into a training and a held-out half by prompt.

    .venv/bin/python tools/collect_steplogs.py --out DIR [--prompts prompts.json] [--max-tokens 48] \\
        [--chain 4] [--draft draft] [--target target]

Writes DIR/logs_train and DIR/logs_heldout (even / odd prompts) and DIR/stats_{train,heldout}.json
(per prompt: tokens, target steps, drafted and accepted nodes, as the edge measured them). The
default prompts are 20 prose/chat requests (the domain where the draft accepts least).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PROSE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a walk through an autumn forest in the morning.",
    "Write a heartfelt letter to an old friend you have not seen in years.",
    "Explain to a child why the sky is blue, in a friendly tone.",
    "Write a travel diary entry about a rainy day in Lisbon.",
    "Describe your perfect weekend in the countryside.",
    "Write a fairy tale about a fox and a clever crow.",
    "Write a motivational speech for a graduating class.",
    "Describe the feeling of the first snow of winter.",
    "Tell me about the history of tea in a few paragraphs.",
    "Write a poem about the sea at night.",
    "Summarise the plot of a novel about a family moving to a new country.",
    "Describe a busy market in Marrakech.",
    "Write a thank-you note to a teacher who changed your life.",
    "Explain what makes a good friend.",
    "Describe the sounds of a city waking up.",
    "Write a short review of an imaginary Italian restaurant.",
    "Tell a bedtime story about a sleepy dragon.",
    "Describe a thunderstorm over the mountains.",
    "Write a diary entry from the point of view of a cat.",
]


def main() -> int:
    from grpc_helpers import ServerProcess   # a real `edgespec verifier serve` child on loopback

    from edgespec import EdgeSession, TreeShape
    from edgespec.common import modelstore

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, default=None, help="JSON list of prompts (default: 20 prose prompts)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--chain", type=int, default=4)
    ap.add_argument("--draft", default="draft")
    ap.add_argument("--target", default="target")
    args = ap.parse_args()
    prompts = json.loads(args.prompts.read_text()) if args.prompts else PROSE
    draft = modelstore.resolve(args.draft, progress=False)
    target = modelstore.resolve(args.target, progress=False)
    for half, subset in (("train", prompts[0::2]), ("heldout", prompts[1::2])):
        srv = ServerProcess(target, "--n-ctx", "1024", "--log-dir", str(args.out / f"logs_{half}"), timeout_s=300)
        started, stats = time.time(), []
        try:
            with EdgeSession(draft, target, verifier=srv.address, n_ctx=1024, tree=TreeShape.chain(args.chain),
                             fallback=False, draft_threads=1) as session:
                for prompt in subset:
                    session.reset_stats()
                    session.chat(prompt, max_tokens=args.max_tokens)
                    s = session.stats
                    stats.append({"prompt": prompt, "tokens": s.tokens, "steps": s.steps, "drafted": s.drafted,
                                  "accepted": s.accepted})
                    print(half, stats[-1], f"{time.time() - started:.0f}s", flush=True)
        finally:
            srv.stop()
        (args.out / f"stats_{half}.json").write_text(json.dumps(stats, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
