#!/usr/bin/env python3
"""Explain where a bench_link mode's greedy output left cloud-only AR, with the target's own numbers.

Greedy speculation on llama.cpp is lossless up to floating point: the verifier computes a node's
logits inside a batch of tree rows, and a different batch shape changes them slightly. A divergence
is explained when, at the position where the outputs first differ, the two tokens are a near-tie
whose order flips with the batch shape. This tool recomputes that position's logits in the
verifier's own llama.cpp context (1 thread) as a 1-row step (AR) and as row j of chains of 2 and 5
rows (speculative steps), and prints both tokens' logits and their margin for each.

    .venv/bin/python tools/explain_divergence.py RESULTS.json --mode chain4 --prompt 1 [--json out.json]

RESULTS.json: bench_link.py --json output (its prompts are rebuilt from its meta: --humaneval and
--spec counts as recorded in its command).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_link import prompt_set  # noqa: E402

from edgespec.common import modelstore  # noqa: E402
from edgespec.runtime.llama import ContextConfig, LlamaModel, TreeContext  # noqa: E402

SHAPES = [(0, 1), (0, 2), (1, 2), (0, 5), (1, 5), (2, 5), (3, 5), (4, 5)]   # (row of the deciding node, rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--prompt", type=int, required=True, help="index of the prompt in the run")
    ap.add_argument("--target", help="target GGUF (default: the manifest's target)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = json.loads(args.results.read_text())
    command = res["meta"]["command"]
    count = {k: int(m.group(1)) if (m := re.search(rf"--{k} (\d+)", command)) else 2 for k in ("humaneval", "spec")}
    named = prompt_set(Path(__file__).resolve().parent / "data" / "spec_bench_questions.jsonl",
                       count["humaneval"], count["spec"])
    cells = {(c["rtt_ms"], c["mode"]): c for c in res["cells"]}
    rtt = res["meta"]["rtts_ms"][0]
    ar, other = cells[(rtt, "ar")]["outputs"][args.prompt], cells[(rtt, args.mode)]["outputs"][args.prompt]
    k = next((i for i, (a, b) in enumerate(zip(ar, other)) if a != b), None)
    if k is None:
        print("no divergence")
        return 0
    model = LlamaModel(args.target or modelstore.model_path(modelstore.load_manifest().defaults["target"]))
    name, text = named[args.prompt]
    prompt = model.chat_tokens([{"role": "user", "content": text}] if isinstance(text, str) else text)
    ctx = TreeContext(model, ContextConfig(n_ctx=4096, n_threads=1))
    out = {"prompt": name, "position": k, "ar_token": ar[k], "mode_token": other[k],
           "ar_text": model.detokenize([ar[k]]), "mode_text": model.detokenize([other[k]]), "rows": []}
    print(f"{name}: {args.mode} differs from AR at token {k}: AR {out['ar_text']!r}, {args.mode} {out['mode_text']!r}")
    for j, rows in SHAPES:
        start = k - 1 - j                    # the deciding node (the context up to ar[k-1]) is row j
        ctx.sync(prompt + ar[:start])
        logits, _ = ctx.decode_tree(ar[start:start + rows], list(range(-1, rows - 1)))
        ctx.drop_branches()
        row = logits[j].astype(np.float64)
        top2 = np.sort(row)[-2:]
        r = {"rows": rows, "row": j, "argmax": int(row.argmax()), "logit_ar": round(float(row[ar[k]]), 4),
             "logit_mode": round(float(row[other[k]]), 4), "ar_minus_mode": round(float(row[ar[k]] - row[other[k]]), 4),
             "top2_gap": round(float(top2[1] - top2[0]), 4)}
        out["rows"].append(r)
        print(r, flush=True)
    ctx.close()
    model.close()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
