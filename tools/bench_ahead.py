#!/usr/bin/env python3
"""Drafting ahead vs drafting at the step (issue 10): tau, tok/s and the trees actually sent.

Local mode on this machine, one llama.cpp thread per model. `at-step` drafts every tree after the
verifier's answer (the decoder unpipelined); `ahead` drafts the next tree while the current one is
verified (pipelined, the target on the verify thread), as remote mode always does. Per mode it prints
tau and tok/s, and, split by steps whose tree was prepared ahead and steps drafted at the step, the
mean nodes, depth and accepted tokens of the trees sent. `--target draft` verifies with the draft
model itself: a verifier faster than the drafter (the GPU host's case), where the answer arrives
before a prepared tree is grown.

  python tools/bench_ahead.py --shape tree16 --max-tokens 48
  python tools/bench_ahead.py --target draft --modes ahead
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from edgespec.common.sampling import SamplingParams
from edgespec.edge.drafting import TreeShape
from edgespec.edge.session import EdgeSession

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_local import add_model_args  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"tree16": TreeShape(budget=16, max_depth=6, branching=4, width=4), "chain4": TreeShape.chain(4)}
PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain binary search in three sentences.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "What are the main causes of inflation? Answer briefly.",
]


def run_mode(session: EdgeSession, ahead: bool, prompts: list[str], max_tokens: int) -> dict:
    """Decode every prompt greedily; returns the session's figures and per-step tree records."""
    decoder = session.decoder
    decoder.pipelined = ahead
    steps: list[tuple[bool, int, int, int]] = []   # (prepared, nodes, depth, accepted) per step
    record = type(decoder)._record

    def recording(draft, result, *args) -> None:   # noqa: ANN001 - the decoder's own signature
        prepared = decoder.stats.prepared_hits > sum(s[0] for s in steps)
        steps.append((prepared, len(draft.tree) - 1, int(draft.tree.depths.max()), len(result.path)))
        record(decoder, draft, result, *args)

    decoder._record = recording
    session.reset_stats()
    try:
        for prompt in prompts:
            tokens = session.draft_model.chat_tokens([{"role": "user", "content": prompt}])
            for _ in session.generate_tokens(tokens, max_tokens, SamplingParams()):
                pass
    finally:
        del decoder._record
    s = session.stats
    out = {"tau": s.tau, "tok_s": s.tokens_per_second, "steps": s.steps, "tokens": s.tokens}
    for name, prepared in (("prepared", True), ("at_step", False)):
        rows = np.array([x[1:] for x in steps if x[0] == prepared], float).reshape(-1, 3)
        out[name] = {"steps": len(rows), **({"nodes": rows[:, 0].mean(), "depth": rows[:, 1].mean(),
                                             "tau": 1 + rows[:, 2].mean()} if len(rows) else {})}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--shape", default="tree16", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=2, help=f"the first N of {len(PROMPTS)} built-in prompts")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--modes", default="at-step,ahead")
    args = ap.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}; draft={args.draft} target={args.target} {args.shape}, "
          f"{args.prompts} prompts x {args.max_tokens} tokens, greedy, 1 thread per model", flush=True)
    session = EdgeSession(args.draft, args.target, local=True, tree=SHAPES[args.shape], n_ctx=2048,
                          draft_threads=1, target_threads=1)
    print("| mode | steps | τ | tok/s | prepared steps: nodes / depth / τ | at-step steps: nodes / depth / τ |")
    print("|---|---|---|---|---|---|")
    try:
        for mode in args.modes.split(","):
            r = run_mode(session, mode == "ahead", PROMPTS[: args.prompts], args.max_tokens)
            cells = [f"{r[k]['steps']}: {r[k]['nodes']:.1f} / {r[k]['depth']:.2f} / {r[k]['tau']:.2f}"
                     if r[k]["steps"] else "0" for k in ("prepared", "at_step")]
            print(f"| {mode} | {r['steps']} | {r['tau']:.2f} | {r['tok_s']:.2f} | {cells[0]} | {cells[1]} |", flush=True)
    finally:
        session.close()
    print(f"load after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
