#!/usr/bin/env python3
"""Explain where a bench_link mode's greedy output left cloud-only AR, with the target's own numbers.

Greedy speculation on llama.cpp is lossless up to floating point: the verifier computes a node's
logits inside a batch of tree rows, and a different batch shape changes them slightly. A divergence
is explained when, at the position where the outputs first differ, the two tokens are a near-tie:
the top two in every shape, their order flipping with the batch shape or their gap no larger than
how far one logit moves between shapes (the verdict in each report). The context's K/V come from one
prefill here (one for each shape), not from the run's own steps: a shape of its own again. This tool recomputes that
position's logits in the verifier's own llama.cpp context (1 thread) as a 1-row step (AR) and as
row j of chains of 2 and 5 rows (speculative steps), and, where the run recorded its trees (bench_link's
per-step trace), as the deciding row of the very tree whose step chose the mode's token (the run's own
shape: `own_step`), and prints both tokens' logits and their margin for each. With
`--backend torch` the rows come from the torch verifier's own steps instead (TorchBackend on
`--device`, e.g. the GPU verifier of tools/gpu_run.sh e2e: each shape a verify step, graph-replayed
where the backend uses CUDA graphs, its logits read back as the step saw them).

    .venv/bin/python tools/explain_divergence.py RESULTS.json --mode chain4 --prompt 1 [--json out.json]
    .venv/bin/python tools/explain_divergence.py RESULTS.json --all --json out.json   # every divergence
    python tools/explain_divergence.py RESULTS.json --mode adaptive --prompt 2 --backend torch --device cuda

RESULTS.json: bench_link.py --json output (its prompts are rebuilt from its meta: --humaneval and
--spec counts as recorded in its command).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_link import first_difference, prompt_set  # noqa: E402

from edgespec.cli.bench import read_results  # noqa: E402
from edgespec.common import modelstore  # noqa: E402
from edgespec.runtime.llama import ContextConfig, LlamaModel, TreeContext  # noqa: E402

SHAPES = [(0, 1), (0, 2), (1, 2), (0, 5), (1, 5), (2, 5), (3, 5), (4, 5)]   # (row of the deciding node, rows)


class Tree(NamedTuple):
    """One verified tree: the context before its root, its tokens (root first) and parents, the row to read."""

    context: list[int]
    tokens: list[int]
    parents: list[int]
    row: int


def chain(context: list[int], tokens: list[int], row: int) -> Tree:
    """A chain of `tokens` (root first) after `context`, read at `row`."""
    return Tree(context, tokens, list(range(-1, len(tokens) - 1)), row)


def llama_rows(target: str, trees: list[Tree], device: str) -> Iterator[np.ndarray]:
    """Each tree decoded in the llama.cpp verifier's context (1 thread) after a prefill of its whole context: its
    row's logits. (A context grown from another shape's, or cut back to, holds K/V that other batch shapes
    computed: a row 0.2 logits away from the same tree's after a fresh prefill, Qwen 1.5B on this CPU.)"""
    model = LlamaModel(target)
    ctx = TreeContext(model, ContextConfig(n_ctx=4096, n_threads=1, max_tree_nodes=128))
    try:
        for t in trees:
            ctx.truncate(0)
            ctx.sync(t.context)
            logits, _ = ctx.decode_tree(t.tokens, t.parents)
            ctx.drop_branches()
            yield logits[t.row]
    finally:
        ctx.close()
        model.close()


def torch_rows(target: str, trees: list[Tree], device: str) -> Iterator[np.ndarray]:
    """Each tree as one verify step of the torch verifier (its root the last synced token): the row's
    float32 logits as that step computed them (Engine.last_logits)."""
    from edgespec.common.sampling import SamplingParams
    from edgespec.common.tree import TokenTree
    from edgespec.verifier.torch.backend import TorchBackend

    backend = TorchBackend(target, device=device, warmup=False)   # a few shapes: graphs captured as they come
    for t in trees:
        s = backend.open_session()
        try:
            s.sync(t.context + t.tokens[:1])
            s.verify(TokenTree(tokens=np.array(t.tokens), parents=np.array(t.parents)), SamplingParams(), 0)
            yield backend.engine.last_logits()[0, t.row].float().cpu().numpy()
        finally:
            s.close()


def own_step(trace: list[dict], prompt: list[int], output: list[int], k: int) -> Tree | None:
    """The tree whose step committed output token k, as the run sent it, and the row that chose that token: the
    root's for the step's first token, else the row of the accepted node before it. None where the trace has no
    trees (runs recorded before they were kept) or does not reach k."""
    produced = 0
    for step in trace:
        n = step["accepted"] + 1   # the accepted path and the target's own token after it
        if produced <= k < produced + n:
            if "tree" not in step:
                return None
            offset = k - produced
            path = sorted(step["obs"]["accepted"])   # drafted nodes on the path (node i + 1 of the tree)
            row = 0 if offset == 0 else path[offset - 1] + 1
            context = prompt + output[:produced]
            tokens = step["tree"]["tokens"]
            if tokens[0] != context[-1]:
                raise ValueError(f"the trace's tree at token {produced} is not rooted at the committed context")
            return Tree(context[:-1], tokens, step["tree"]["parents"], row)
        produced += n
    return None


def run_trace(res: dict, prompt_name: str, rtt: float, mode: str) -> list[dict]:
    """The step trace bench_link kept for a prompt's run in a mode and condition ([] where it kept none)."""
    for run in res["meta"].get("runs", []):
        if (run["prompt"], run["rtt_ms"], run["mode"]) == (prompt_name, rtt, mode):
            return run.get("trace") or []
    return []


def divergences(res: dict, modes: list[str] | None, prompt: int | None, rtt: float | None) -> list[tuple]:
    """(rtt, mode, prompt index, first differing position) where a mode's output left AR's of the same RTT."""
    cells = {(c["rtt_ms"], c["mode"]): c for c in res["cells"]}
    out = []
    for (r, mode), cell in cells.items():
        if mode == "ar" or (modes and mode not in modes) or (rtt is not None and r != rtt) or (r, "ar") not in cells:
            continue
        for i, (ar, other) in enumerate(zip(cells[(r, "ar")]["outputs"], cell["outputs"])):
            k = first_difference(ar, other)   # a length difference alone has no token to explain
            if k is not None and k < min(len(ar), len(other)) and (prompt is None or i == prompt):
                out.append((r, mode, i, k, ar, other))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--mode", help="the mode to explain (default: every mode but ar)")
    ap.add_argument("--prompt", type=int, help="index of the prompt in the run (default: every prompt)")
    ap.add_argument("--rtt", type=float, help="the cells of this RTT (default: the run's first; --all: every RTT)")
    ap.add_argument("--all", action="store_true", help="every divergence of every RTT, mode and prompt")
    ap.add_argument("--target", help="target GGUF (default: the manifest's target)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--backend", choices=("llama", "torch"), default="llama",
                    help="whose numerics: the llama.cpp verifier's (default) or the torch verifier's")
    ap.add_argument("--device", default="cuda", help="with --backend torch")
    args = ap.parse_args()
    res = read_results(args.results)
    command = res["meta"]["command"]
    count = {k: int(m.group(1)) if (m := re.search(rf"--{k} (\d+)", command)) else 2 for k in ("humaneval", "spec")}
    named = prompt_set(Path(__file__).resolve().parent / "data" / "spec_bench_questions.jsonl",
                       count["humaneval"], count["spec"])
    rtt = None if args.all else (args.rtt if args.rtt is not None else res["meta"]["rtts_ms"][0])
    found = divergences(res, [args.mode] if args.mode else None, args.prompt, rtt)
    if not found:
        print("no divergence")
        if args.json:
            args.json.write_text(json.dumps([], indent=1))
        return 0
    target = args.target or modelstore.model_path(modelstore.load_manifest().defaults["target"])
    model = LlamaModel(target, vocab_only=args.backend == "torch")   # torch: the tokenizer only
    reports, trees, shapes_of = [], [], []
    for r, mode, i, k, ar, other in found:
        name, text = named[i]
        prompt = model.chat_tokens([{"role": "user", "content": text}] if isinstance(text, str) else text)
        out = {"rtt_ms": r, "mode": mode, "prompt": name, "position": k, "ar_token": ar[k], "mode_token": other[k],
               "backend": args.backend, "ar_text": model.detokenize([ar[k]]),
               "mode_text": model.detokenize([other[k]]), "rows": []}
        shapes = [(j, rows, False) for j, rows in SHAPES if k - 1 - j >= 0]   # the deciding node (context to ar[k-1]) is row j
        trees += [chain(prompt + ar[:k - 1 - j], ar[k - 1 - j:k - 1 - j + rows], j) for j, rows, _ in shapes]
        own = own_step(run_trace(res, name, r, mode), prompt, other, k)
        if own is not None:   # the run's own tree, after the mode's own context (equal to AR's before k)
            shapes.append((own.row, len(own.tokens), True))
            trees.append(own)
        reports.append(out)
        shapes_of.append(shapes)
    model.close()
    rows_of = torch_rows if args.backend == "torch" else llama_rows
    computed = rows_of(target, trees, args.device)
    for out, shapes, (r, mode, i, k, ar, other) in zip(reports, shapes_of, found):
        print(f"{out['prompt']} at {r:g} ms: {mode} differs from AR at token {k}: AR {out['ar_text']!r}, "
              f"{mode} {out['mode_text']!r}")
        for (j, rows, own), row in zip(shapes, computed):
            row = row.astype(np.float64)
            top2 = np.sort(row)[-2:]
            cell = {"rows": rows, "row": j, "argmax": int(row.argmax()), "logit_ar": round(float(row[ar[k]]), 4),
                    "logit_mode": round(float(row[other[k]]), 4),
                    "ar_minus_mode": round(float(row[ar[k]] - row[other[k]]), 4),
                    "top2_gap": round(float(top2[1] - top2[0]), 4), **({"own_step": True} if own else {})}
            out["rows"].append(cell)
            print(cell, flush=True)
        # explained by numerics: the two tokens are the top two in every shape, and their gap is no larger
        # than how far one logit moves between shapes here (the measured spread), e.g. the order flips
        rows_ = out["rows"]
        gaps = [abs(c["ar_minus_mode"]) for c in rows_]
        spread = max((max(c[key] for c in rows_) - min(c[key] for c in rows_) for key in ("logit_ar", "logit_mode")),
                     default=0.0)
        out["top_two_everywhere"] = all(c["argmax"] in (out["ar_token"], out["mode_token"])
                                        and abs(c["top2_gap"] - abs(c["ar_minus_mode"])) < 1e-9 for c in rows_)
        out["order_flips"] = len({c["ar_minus_mode"] > 0 for c in rows_}) > 1
        out["logit_spread"] = round(spread, 4)
        out["explained"] = bool(rows_) and out["top_two_everywhere"] and (out["order_flips"] or max(gaps) <= spread)
        print({k: out[k] for k in ("top_two_everywhere", "order_flips", "logit_spread", "explained")}, flush=True)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
