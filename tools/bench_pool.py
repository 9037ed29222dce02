#!/usr/bin/env python3
"""Draft pool benchmark: τ of the draft model alone vs model + lookup (merged) vs lookup alone.

Greedy, local (the target in this process, step by step, no drafting ahead), 1 llama.cpp thread
per model, one fixed tree shape for every config. Two workloads:
- single-turn: a sample of Spec-Bench (one prompt from each of --categories) plus --humaneval
  HumanEval problems (as tools/bench_local.py loads them);
- multi-turn / agentic / editing (MULTI_TURN below): code edits that copy most of the given code,
  follow-up turns that quote an earlier answer, JSON tool calls after a tool result.
Every run gets a fresh lookup index (no answer of another config or prompt leaks into it).
The pool's own overhead (merge, bookkeeping) is reported as a fraction of the experts' drafting time.

  python tools/bench_pool.py --max-tokens 64 --markdown
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

from edgespec.edge.drafting import Drafter, TreeShape
from edgespec.edge.pool import DraftPool, LookupExpert, ModelExpert, TemplateExpert
from edgespec.runtime.llama import LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_local import add_model_args, decode, load_prompts, local_pair, machine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("model", "model+lookup", "lookup")
EXTRA_CONFIGS = ("model+lookup-skip",)   # --configs: the model is not asked when the lookup promises >= 2 tokens

CSV_CODE = '''def parse_rows(lines):
    items = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            raise ValueError(f"bad row: {line!r}")
        name, qty, price = fields
        items.append({"name": name, "qty": int(qty), "price": float(price)})
    return items
'''

STACK_CODE = '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def size(self):
        return len(self.items)
'''

BUGGY_CODE = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    out = []
    for i in range(len(values) - window):
        chunk = values[i:i + window]
        out.append(sum(chunk) / window)
    return out
'''

FIZZ_ANSWER = '''Here is a FizzBuzz function:

```python
def fizzbuzz(n):
    for i in range(1, n + 1):
        if i % 15 == 0:
            print("FizzBuzz")
        elif i % 3 == 0:
            print("Fizz")
        elif i % 5 == 0:
            print("Buzz")
        else:
            print(i)
```

It checks 15 first so that numbers divisible by both 3 and 5 print "FizzBuzz".'''

CACHE_ANSWER = ('An LRU cache keeps the most recently used items and evicts the least recently used one when it is '
                'full. In Python you can build one with collections.OrderedDict: on every get, move the key to the '
                'end with move_to_end; on every put, insert the key at the end, and if the cache is over capacity, '
                'remove the first item with popitem(last=False). Both operations are O(1).')

TOOLS_SYSTEM = '''You are an assistant that can call tools. To call a tool, answer with
<tool_call>
{"name": <tool-name>, "arguments": <args-json-object>}
</tool_call>
Tools:
- get_weather(city: string, unit: "celsius" | "fahrenheit"): current weather of a city
- search_files(pattern: string, directory: string): files whose name matches a glob pattern
- read_file(path: string): the contents of a file'''

MULTI_TURN: list[tuple[str, list[dict[str, str]]]] = [
    ("edit-rename", [{"role": "user", "content": "Rewrite this function with the variable `items` renamed to "
                      "`records`. Change nothing else and show the whole function.\n\n```python\n" + CSV_CODE + "```"}]),
    ("edit-docstrings", [{"role": "user", "content": "Add a one-line docstring to every method of this class. "
                          "Show the complete class.\n\n```python\n" + STACK_CODE + "```"}]),
    ("edit-bugfix", [{"role": "user", "content": "This function skips the last window. Fix the bug and show the "
                      "corrected function.\n\n```python\n" + BUGGY_CODE + "```"}]),
    ("followup-quote", [{"role": "user", "content": "Write a FizzBuzz function in Python."},
                        {"role": "assistant", "content": FIZZ_ANSWER},
                        {"role": "user", "content": "Change it to return a list of strings instead of printing. "
                         "Show the full function."}]),
    ("followup-summary", [{"role": "user", "content": "How do I build an LRU cache in Python?"},
                          {"role": "assistant", "content": CACHE_ANSWER},
                          {"role": "user", "content": "Repeat your explanation as a bulleted list, keeping your "
                           "wording."}]),
    ("tool-call", [{"role": "system", "content": TOOLS_SYSTEM},
                   {"role": "user", "content": "What's the weather in Paris, in celsius?"}]),
    ("tool-followup", [{"role": "system", "content": TOOLS_SYSTEM},
                       {"role": "user", "content": "Find the Python files in src and show me the first one."},
                       {"role": "assistant", "content": '<tool_call>\n{"name": "search_files", "arguments": '
                        '{"pattern": "*.py", "directory": "src"}}\n</tool_call>'},
                       {"role": "user", "content": "<tool_response>\n[\"src/app.py\", \"src/util.py\"]\n"
                        "</tool_response>"}]),
    ("tool-then-edit", [{"role": "system", "content": TOOLS_SYSTEM},
                        {"role": "user", "content": "Show me src/util.py with the function `parse_rows` renamed to "
                         "`load_rows`."},
                        {"role": "assistant", "content": '<tool_call>\n{"name": "read_file", "arguments": '
                         '{"path": "src/util.py"}}\n</tool_call>'},
                        {"role": "user", "content": "<tool_response>\n" + CSV_CODE + "</tool_response>"}]),
]


def make_drafter(config: str, drafter: Drafter, model: LlamaModel) -> Drafter | DraftPool:
    if config == "model":
        return drafter
    experts = [LookupExpert(), TemplateExpert.for_model(model)]   # fresh index: nothing from other runs
    if config.startswith("model+lookup"):
        experts.insert(0, ModelExpert.around("draft", drafter))
    return DraftPool(experts, skip_models_at=2.0 if config.endswith("-skip") else None)


def summarize(rows: list[dict], configs: list[str], header: str) -> str:
    """The markdown for docs/BENCHMARKS.md, from the per-run rows (also those of a partial run)."""
    def total(select) -> dict[str, float]:
        chosen = [r for r in rows if select(r)]
        out = {k: sum(r[k] for r in chosen) for k in ("steps", "accepted", "drafted")}
        for k in ("draft_ms_per_step", "verify_ms_per_step"):
            out[k] = sum(r[k] * r["steps"] for r in chosen) / max(out["steps"], 1)
        out["tau"] = 1 + out["accepted"] / out["steps"] if out["steps"] else 0.0
        out["runs"] = len(chosen)
        return out

    lines = [header, "", "| set | config | runs | τ (incl. bonus) | accepted/drafted | draft ms/step | verify ms/step | steps |",
             "|---|---|---|---|---|---|---|---|"]
    for kind in ("single-turn", "multi-turn"):
        for name in configs:
            v = total(lambda r: r["set"] == kind and r["config"] == name)
            if v["steps"]:
                acc = f"{v['accepted'] / v['drafted']:.2f}" if v["drafted"] else "—"
                lines.append(f"| {kind} | {name} | {v['runs']} | {v['tau']:.2f} | {acc} | {v['draft_ms_per_step']:.0f} | "
                             f"{v['verify_ms_per_step']:.0f} | {v['steps']} |")
    items = list(dict.fromkeys(r["item"] for r in rows))
    lines += ["", "Per item, τ (" + " / ".join(configs) + "): " + "; ".join(
        f"{item} " + " / ".join(f"{total(lambda r: r['item'] == item and r['config'] == n)['tau']:.2f}" for n in configs)
        for item in items)]
    for name in configs:
        pool_rows = [r for r in rows if r["config"] == name and "pool_s" in r]
        if pool_rows:
            pool_s, expert_s = sum(r["pool_s"] for r in pool_rows), sum(r["expert_s"] for r in pool_rows)
            lines += ["", f"Pool overhead ({name}): {1000 * pool_s:.0f} ms of merging and bookkeeping for "
                          f"{1000 * expert_s:.0f} ms of expert drafting ({100 * pool_s / max(expert_s, 1e-9):.1f} %)."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--spec-bench", type=Path, default=REPO / "tools" / "data" / "spec_bench_questions.jsonl")
    ap.add_argument("--categories", default="coding,extraction,math_reasoning,rag,summarization,writing")
    ap.add_argument("--humaneval", type=int, default=2)
    ap.add_argument("--multi-turn", type=int, default=len(MULTI_TURN), help="how many of the multi-turn items")
    ap.add_argument("--sets", default="single-turn,multi-turn")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS + EXTRA_CONFIGS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--report", type=Path, help="only print the markdown of a saved --json (e.g. of a partial run)")
    args = ap.parse_args()
    if args.report:
        print(summarize(json.loads(args.report.read_text()), args.configs.split(","), f"Rows: {args.report}"))
        return 0

    shape = TreeShape(budget=args.budget, max_depth=6, branching=4, width=4)
    draft_model, drafter, verifier = local_pair(args.draft, args.target, shape)

    wanted = set(args.categories.split(","))
    single = [(c, [{"role": "user", "content": p}]) for c, p in
              load_prompts(args.spec_bench, 10_000, args.humaneval, args.seed) if c in wanted or c == "humaneval"]
    seen: set[str] = set()
    single = [(c, m) for c, m in single if c == "humaneval" or not (c in seen or seen.add(c))]
    multi = MULTI_TURN[:args.multi_turn]
    # The two sets alternate, so a run stopped early still measured both.
    sets = args.sets.split(",")
    workload = [item for pair in itertools.zip_longest([("single-turn", c, m) for c, m in single],
                                                       [("multi-turn", c, m) for c, m in multi])
                for item in pair if item is not None and item[0] in sets]
    configs = args.configs.split(",")
    rows = []
    started = time.time()
    for kind, label, messages in workload:
        prompt = draft_model.chat_tokens(messages)
        outputs = {}
        for name in configs:   # configs interleaved per prompt: a partial run stays comparable
            source = make_drafter(name, drafter, draft_model)
            outputs[name], stats = decode(source, verifier, shape, draft_model, prompt, args.max_tokens)
            extra = {}
            if isinstance(source, DraftPool):
                extra = {"pool_s": source.overhead.seconds, "expert_s": source.overhead.expert_seconds,
                         "merged_steps": source.merged_steps, "skipped_model": source.skipped_model_proposals,
                         "experts": {n: s.as_dict() for n, s in source.stats().items()}}
            row = {"set": kind, "item": label, "config": name, "prompt_tokens": len(prompt), "tau": stats.tau,
                   "steps": stats.steps, "tokens": stats.tokens, "drafted": stats.drafted, "accepted": stats.accepted,
                   "draft_ms_per_step": 1000 * stats.draft_seconds / max(stats.steps, 1),
                   "verify_ms_per_step": 1000 * stats.verify_seconds / max(stats.steps, 1), **extra}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.json:   # after every run: a run stopped early keeps what it measured
                args.json.write_text(json.dumps(rows, indent=1))
        same = len({tuple(o) for o in outputs.values()}) == 1
        if not same:
            print(f"note: outputs differ between configs on {label} (near-tie numerics?)", file=sys.stderr)
    minutes = (time.time() - started) / 60
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.markdown:
        print(summarize(rows, configs, f"Machine: {machine()}; draft={args.draft}, target={args.target}; greedy, local, "
                        f"1 thread per model; tree budget {args.budget} (depth {shape.max_depth}, branching "
                        f"{shape.branching}, width {shape.width}) for every config; max {args.max_tokens} new tokens; "
                        f"{minutes:.0f} min."))
    drafter.close()
    verifier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
