#!/usr/bin/env python3
"""Drafting ahead until the answer arrives (`old`) against the planner's stop rule (`new`, Decoder._ahead_stop).

The real decoder with the planner, its ladder cut to one shape (default tree16) so both modes draft the same kind
of tree; the draft model and the target (llama.cpp, one thread each) on this machine, the target behind a fixed
delay reported as network time, as a remote link's round trip would be. Modes alternate, `--rounds` times each,
over prose prompts (where trees drafted ahead seldom come true). Per run: tokens/s, τ, steps, trees drafted ahead
that were used, and per tree step the wall time and `late_ms` (how long the answer waited for drafting ahead to
stop). Greedy outputs can differ between runs: llama.cpp's logits move with the batch shape (docs/BENCHMARKS.md).

    python tools/bench_ahead_stop.py --delay 0.1 --max-tokens 40 --rounds 3
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "What are the main causes of inflation? Answer in a paragraph.",
           "Describe the water cycle to a ten-year-old."]


class DelayedVerifier:
    """A local verifier whose answers come `delay` seconds later, reported as network time."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def sync(self, context) -> None:
        self.inner.sync(context)

    def verify(self, context, tree, sampling, step):
        from edgespec.edge.planner import BYTES_PER_MESSAGE, BYTES_PER_NODE

        threading.Event().wait(self.delay)
        result = self.inner.verify(context, tree, sampling, step)
        return dataclasses.replace(result, network_s=self.delay, bytes_up=BYTES_PER_MESSAGE + BYTES_PER_NODE * (len(tree) - 1))

    def close(self) -> None:
        self.inner.close()


def one_run(draft_model, target_model, shape, mode: str, prompts: list[list[int]], args) -> dict:
    from edgespec.common.sampling import SamplingParams
    from edgespec.edge.decoder import Decoder, SessionStats
    from edgespec.edge.drafting import Drafter
    from edgespec.edge.planner import Planner
    from edgespec.runtime.llama import ContextConfig
    from edgespec.runtime.tree_verifier import LocalVerifier

    config = ContextConfig(n_ctx=1024, max_tree_nodes=64, n_threads=1)
    drafter = Drafter(draft_model, config)
    verifier = DelayedVerifier(LocalVerifier(target_model, config), args.delay)
    stats = SessionStats()
    decoder = Decoder(drafter, verifier, stats, None, draft_model.is_end_of_generation, pipelined=True)
    try:
        decoder.planner = Planner(ladder=(shape,), last_choice=0)
        if mode == "old":   # drafting ahead stops at the answer only
            decoder._ahead_stop = lambda answered, *_: answered
        stats.trace = []
        for prompt in prompts:
            for _ in decoder.run(prompt, args.max_tokens, SamplingParams()):
                pass
    finally:
        decoder.close()
        verifier.close()
        drafter.close()
    trees = [r for r in stats.trace if r["nodes"]]
    return {"mode": mode, "tok_s": stats.tokens / stats.seconds, "tau": stats.tau, "steps": stats.steps,
            "prepared_hits": stats.prepared_hits, "tree_step_ms": float(np.mean([r["wall_ms"] for r in trees])),
            "late_ms": float(np.mean([r["late_ms"] for r in trees]))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delay", type=float, default=0.1, help="seconds added to each verify answer (default 0.1)")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode, alternating")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from edgespec.common import modelstore
    from edgespec.edge.drafting import TreeShape
    from edgespec.runtime.llama import LlamaModel

    shape = TreeShape(budget=16, max_depth=6, branching=4, width=4)
    draft_model = LlamaModel(modelstore.resolve("draft", progress=False))
    target_model = LlamaModel(modelstore.resolve("target", progress=False))
    prompts = [draft_model.chat_tokens([{"role": "user", "content": text}]) for text in PROMPTS]
    runs = []
    for _ in range(args.rounds):
        for mode in ("old", "new"):
            runs.append(one_run(draft_model, target_model, shape, mode, prompts, args))
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in runs[-1].items()}), flush=True)
    for mode in ("old", "new"):
        mine = [r for r in runs if r["mode"] == mode]
        print(f"{mode}: tokens/s {np.mean([r['tok_s'] for r in mine]):.3f}, tree step "
              f"{np.mean([r['tree_step_ms'] for r in mine]):.1f} ms, late {np.mean([r['late_ms'] for r in mine]):.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                         "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
