"""Grammar / JSON-schema constraints (common/constraints.py): what the mask costs and what it does
to an answer.

1. Building the llguidance token list of a model (once per model) and compiling a schema.
2. The mask per tree node: `TokenConstraint.allowed` walking a valid JSON answer token by token
   (consume one token + compute the mask, as the decoder's next step does) and jumping between two
   branches of a tree (rollback + consume + mask, as drafting and acceptance do), p50/p95.
3. End to end: `EdgeSession.chat` with and without `response_format` (local verification, a fixed
   chain so both runs draft the same shape): tokens/s, τ, and how many answers parse and validate.

    .venv/bin/python tools/bench_grammar.py --draft test --target test --prompts 6 --max-tokens 64 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_local import add_model_args  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "remote": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "remote"],
    "additionalProperties": False,
}
SAMPLE = {"name": "Alice Smith", "age": 34, "languages": ["Python", "Rust", "Go"], "remote": True}
PROMPTS = [
    "Describe a software engineer named Alice as JSON.",
    "Give me a JSON record for a data scientist called Bob who works from home.",
    "Create a JSON profile of a junior web developer named Carla.",
    "Return a JSON object describing Dmitri, a 45-year-old embedded systems engineer.",
    "Describe a fictional game developer as JSON.",
    "Write a JSON entry for an engineer named Eve who knows C and Python.",
    "A JSON profile for Farid, a DevOps engineer.",
    "JSON for a retired COBOL programmer named Grace.",
]


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 4), "p95": round(ordered[int(0.95 * (len(ordered) - 1))], 4),
            "n": len(ordered)}


def mask_costs(model_path: str) -> dict:
    import jsonschema  # noqa: F401 - fail early when the dev extra is missing

    from edgespec.common.constraints import Grammar, TokenConstraint
    from edgespec.runtime.llama import LlamaModel

    model = LlamaModel(model_path)
    try:
        started = time.perf_counter()
        vocab = model.grammar_vocab()
        build_s = time.perf_counter() - started
        started = time.perf_counter()
        grammar = Grammar.json_schema(SCHEMA)
        constraint = TokenConstraint(grammar=grammar).placed(0).bind(vocab)
        compile_s = time.perf_counter() - started
        answer = model.tokenize(json.dumps(SAMPLE), add_special=False, parse_special=False)
        walk = []
        for n in range(len(answer) + 1):
            t = time.perf_counter()
            allowed = constraint.allowed(answer[:n])
            walk.append((time.perf_counter() - t) * 1000)
            assert n == len(answer) or allowed[answer[n]], f"the sample answer is refused at token {n}"
        # Two branches that share a prefix, asked alternately: every call rolls back and consumes.
        branch_a = answer
        branch_b = model.tokenize(json.dumps({**SAMPLE, "name": "Bob"}), add_special=False, parse_special=False)
        jumps = []
        for n in range(2, min(len(branch_a), len(branch_b))):
            for branch in (branch_a, branch_b):
                t = time.perf_counter()
                constraint.allowed(branch[:n])
                jumps.append((time.perf_counter() - t) * 1000)
        return {"model": Path(model_path).name, "vocab": model.n_vocab, "vocab_build_s": round(build_s, 3),
                "schema_compile_ms": round(compile_s * 1000, 3), "answer_tokens": len(answer),
                "mask_walk_ms": percentiles(walk[1:]), "mask_jump_ms": percentiles(jumps)}
    finally:
        model.close()


def end_to_end(draft: str, target: str, prompts: list[str], max_tokens: int, chain: int, threads: int) -> dict:
    import jsonschema

    from edgespec.edge.drafting import TreeShape
    from edgespec.edge.session import EdgeSession

    response_format = {"type": "json_schema", "json_schema": {"name": "engineer", "schema": SCHEMA}}
    rows = {"free": [], "json_schema": []}
    with EdgeSession(draft, target, local=True, n_ctx=2048, tree=TreeShape.chain(chain),
                     draft_threads=threads, target_threads=threads) as session:
        session.chat("Warm up.", max_tokens=4)
        session.draft_model.grammar_vocab()   # built once per model: not part of a request
        for prompt in prompts:
            for mode in rows:   # interleaved, so load drift hits both modes alike
                session.reset_stats()
                started = time.perf_counter()
                text = session.chat(prompt, max_tokens=max_tokens,
                                    response_format=response_format if mode == "json_schema" else None)
                wall = time.perf_counter() - started
                s = session.stats
                try:
                    jsonschema.validate(json.loads(text), SCHEMA)
                    valid = True
                except (ValueError, jsonschema.ValidationError):
                    valid = False
                rows[mode].append({"tokens": s.tokens, "wall_s": wall, "steps": s.steps, "tau": s.tau,
                                   "valid": valid, "finish": session.finish_reason})
                print(f"{mode:12s} {s.tokens:4d} tokens {wall:7.2f} s tau {s.tau:.2f} valid {valid} "
                      f"{session.finish_reason}: {text[:70]!r}", file=sys.stderr, flush=True)
    out = {}
    for mode, runs in rows.items():
        tokens, wall, steps = (sum(r[k] for r in runs) for k in ("tokens", "wall_s", "steps"))
        out[mode] = {"answers": len(runs), "tokens": tokens, "wall_s": round(wall, 2),
                     "tokens_per_s": round(tokens / wall, 3), "tau": round(tokens / max(steps, 1), 3),
                     "valid_json": sum(r["valid"] for r in runs), "stopped": sum(r["finish"] == "stop" for r in runs)}
    return out


def main() -> int:
    from edgespec.common import modelstore

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p, "test", "test", threads=1)
    p.add_argument("--mask-models", default="test,target", help="models whose mask cost is measured (comma list)")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chain", type=int, default=4)
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = {"load_before": os.getloadavg()}
    report["mask"] = [mask_costs(str(modelstore.resolve(name))) for name in args.mask_models.split(",") if name]
    print(json.dumps(report["mask"], indent=1), file=sys.stderr)
    if not args.skip_e2e:
        report["e2e"] = {"draft": args.draft, "target": args.target, "chain": args.chain, "max_tokens": args.max_tokens,
                         **end_to_end(str(modelstore.resolve(args.draft)), str(modelstore.resolve(args.target)),
                                      (PROMPTS * 4)[:args.prompts], args.max_tokens, args.chain, args.threads)}
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
