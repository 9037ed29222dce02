#!/usr/bin/env python3
"""Where a drafting decode's time goes: llama_decode alone vs the whole level of Drafter.grow.

A level is one decode_frontier (KV sequence copies, the batch, llama_decode, the logits copied
out) plus the _expand of each decoded row (softmax over the vocabulary, ranking the children).
Per --threads it grows a chain (one row per decode) and an 8-wide tree (8 rows per decode) from
the same prompts, greedily, and prints per level the median llama_decode time, the median whole
level and the share that is not llama_decode. `--variants` times the children's ranking both
ways, interleaved back to back in this process: `full-sort` is the full stable sort of the
vocabulary the drafter used before, `top-k` is sampling.top_tokens. Every variant must draft the
same trees (greedy, target-sample with top-p, rejection): the run fails otherwise.

  python tools/bench_draft_decode.py --threads 1,2 --reps 5
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable

import llama_cpp as C
import numpy as np

import edgespec.common.sampling as sampling_module
import edgespec.edge.drafting as drafting_module
from edgespec.common import modelstore
from edgespec.common.sampling import AcceptanceRule, SamplingParams
from edgespec.edge.drafting import Draft, Drafter, TreeShape
from edgespec.runtime.llama import ContextConfig, LlamaModel

SHAPES = {"chain": TreeShape(budget=6, max_depth=6, branching=1, width=1),
          "wide8": TreeShape(budget=64, max_depth=4, branching=8, width=8)}
PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain binary search in three sentences.",
    "What are the main causes of inflation? Answer briefly.",
]
GREEDY = SamplingParams()
CHECKED = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=1),
           SamplingParams(temperature=0.8, top_p=0.95, seed=1, rule=AcceptanceRule.REJECTION)]


def _full_sort(p: np.ndarray, k: int) -> np.ndarray:
    """The ranking the drafter and the nucleus cut used before top_tokens."""
    return np.argsort(-p, kind="stable")[:k]


VARIANTS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "full-sort": _full_sort, "top-k": sampling_module.top_tokens}


class Probe:
    """Times one Drafter's levels: llama_decode, decode_frontier and the rows' _expand."""

    def __init__(self, drafter: Drafter) -> None:
        self.raw: list[float] = []
        self.levels: list[list[float]] = []   # per level: [llama_decode s, decode_frontier s, _expand s]
        self.open = False                     # a level is being expanded (not the root after sync)
        frontier, expand = drafter.ctx.decode_frontier, drafter._expand
        decode = getattr(C.llama_decode, "untimed", C.llama_decode)

        def timed_decode(*args):  # noqa: ANN002, ANN202 - llama_decode's own signature
            start = time.perf_counter()
            rc = decode(*args)
            self.raw.append(time.perf_counter() - start)
            return rc

        timed_decode.untimed = decode

        def timed_frontier(*args):  # noqa: ANN002, ANN202
            self.raw.clear()
            start = time.perf_counter()
            logits = frontier(*args)
            self.levels.append([sum(self.raw), time.perf_counter() - start, 0.0])
            self.open = True
            return logits

        def timed_expand(*args):  # noqa: ANN002, ANN202
            start = time.perf_counter()
            added = expand(*args)
            if self.open:
                self.levels[-1][2] += time.perf_counter() - start
            return added

        C.llama_decode = timed_decode
        drafter.ctx.decode_frontier = timed_frontier
        drafter._expand = timed_expand

    def grow(self, drafter: Drafter, committed: list[int], shape: TreeShape, sampling: SamplingParams) -> Draft:
        self.open = False
        return drafter.grow(committed, shape, sampling, step=0)


def use(variant: str) -> None:
    """Rank children (and cut nuclei) with `variant` from now on."""
    drafting_module.top_tokens = sampling_module.top_tokens = VARIANTS[variant]


def same(a: Draft, b: Draft) -> bool:
    t, u = a.tree, b.tree
    return all(np.array_equal(x, y) for x, y in [(t.tokens, u.tokens), (t.parents, u.parents), (a.scores, b.scores),
                                                  (t.q_tokens, u.q_tokens), (t.q_weights, u.q_weights)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="draft", help="manifest name or GGUF path (default: the draft model)")
    ap.add_argument("--threads", default="1,2", help="llama.cpp threads, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default="full-sort,top-k")
    args = ap.parse_args()
    variants = args.variants.split(",")
    model = LlamaModel(modelstore.resolve(args.draft, fetch_missing=False))
    prompts = [model.chat_tokens([{"role": "user", "content": p}]) for p in PROMPTS]
    print(f"{model.path.name}, vocabulary {model.n_vocab}, variants {variants}")
    failures = 0
    for threads in [int(t) for t in args.threads.split(",")]:
        drafter = Drafter(model, ContextConfig(n_ctx=2048, max_tree_nodes=64, n_threads=threads))
        probe = Probe(drafter)
        drafts: dict[tuple, Draft] = {}
        for v in variants:   # identical trees, every sampling; also warms the context up
            use(v)
            for i, prompt in enumerate(prompts):
                for name, shape in SHAPES.items():
                    for j, sampling in enumerate(CHECKED):
                        draft = probe.grow(drafter, prompt, shape, sampling)
                        first = drafts.setdefault((i, name, j), draft)
                        if not same(first, draft):
                            failures += 1
                            print(f"DIFFERENT DRAFT: {v} prompt {i} {name} sampling {j}")
        levels: dict[tuple[str, str], list[list[float]]] = defaultdict(list)
        for rep in range(args.reps):
            for prompt in prompts:
                for name, shape in SHAPES.items():
                    for v in variants if rep % 2 == 0 else variants[::-1]:
                        use(v)
                        probe.levels.clear()
                        probe.grow(drafter, prompt, shape, GREEDY)
                        levels[name, v] += probe.levels
        drafter.close()
        print(f"\n{threads} thread(s), {args.reps} reps x {len(prompts)} prompts; per level, medians in ms")
        print(f"{'shape':7} {'variant':10} {'levels':>6} {'llama_decode':>12} {'whole':>8} {'expand':>7} {'not decode':>10}")
        for name in SHAPES:
            whole = {}
            for v in variants:
                rows = np.array(levels[name, v]) * 1e3
                raw, frontier, expand = (float(np.median(rows[:, c])) for c in range(3))
                total = float(np.median(rows[:, 1] + rows[:, 2]))
                whole[v] = total
                print(f"{name:7} {v:10} {len(rows):6d} {raw:12.2f} {total:8.2f} {expand:7.2f} "
                      f"{statistics.median((rows[:, 1] + rows[:, 2] - rows[:, 0]) / (rows[:, 1] + rows[:, 2])):10.1%}")
            if len(variants) == 2:
                print(f"{name:7} whole level {variants[1]} / {variants[0]}: {whole[variants[1]] / whole[variants[0]]:.3f}")
    use("top-k")
    print("\ndrafts identical across variants" if not failures else f"\n{failures} drafts differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
