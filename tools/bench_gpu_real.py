#!/usr/bin/env python3
"""Real weights through the torch verifier on a GPU: greedy speculative output vs the same
backend's target-only greedy output, and step times with the real model.

    python tools/bench_gpu_real.py --model target.gguf --prompts prompts.json --out real.json

prompts.json: a list of token-id lists (chat-templated prompts, tokenized where llama.cpp runs;
the GPU host has no tokenizer). For each prompt:
1. target-only: root-only trees, one token per `verify` (the backend's own AR decoding), recording
   each step's top-2 logit margin;
2. speculative: trees whose nodes follow the target-only continuation for up to `--depth` levels,
   each level with a wrong sibling and, at random, a wrong token that ends the path early (so paths
   of every length get accepted and rejected); the output must equal target-only token for token.
   At a divergence the tree step's own logits row for the deciding node (the engine's static
   output of that very step) is compared with the target-only step's own top logits at the same
   position (recorded in that step): it is explained by numerics when each row's argmax is the
   token that path emitted and the other path's token is a runner-up there (the gaps are reported).
Step times: median `verify` wall time of the target-only and the speculative steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from edgespec.common.sampling import SamplingParams  # noqa: E402
from edgespec.common.tree import TokenTree  # noqa: E402
from edgespec.verifier.torch.backend import TorchBackend  # noqa: E402

GREEDY = SamplingParams()


TOP = 8   # the target-only step's own top logits kept per position, to explain a divergence there


def median_ms(times: list[float]) -> float | None:
    """Median step time past the first step (which may capture a graph); None when there is no other step."""
    return 1000 * statistics.median(times[1:]) if len(times) > 1 else None


def target_only(backend: TorchBackend, prompt: list[int], n: int) -> tuple[list[int], list[float], list[float], list]:
    """Target-only greedy tokens, margins and step times, and each step's own top-TOP (ids, logits)."""
    s = backend.open_session()
    s.sync(prompt)
    out, margins, times, tops = [], [], [], []
    while len(out) < n:
        tree = TokenTree(tokens=np.array([s.committed[-1]]), parents=np.array([-1]))
        t = time.perf_counter()
        r = s.verify(tree, GREEDY, len(out))
        times.append(time.perf_counter() - t)
        top = backend.engine.last_logits()[0, 0].float().topk(TOP)
        tops.append((top.indices.tolist(), top.values.tolist()))
        out += r.tokens
        margins += r.margins
    s.close()
    return out[:n], margins[:n], times, tops[:n]


def row_at(backend: TorchBackend, b: int, node: int) -> np.ndarray:
    return backend.engine.last_logits()[b, node].float().cpu().numpy()


def explain(backend: TorchBackend, prompt: list[int], ref: list[int], got: list[int], j: int,
            tree_row: np.ndarray, own_top: tuple[list[int], list[float]]) -> dict:
    """At the first divergence j: the tree step's own logits row for the deciding node (tree_row)
    against the target-only step's own top logits at that position (own_top, recorded in that very
    step), and the same position recomputed target-only after a fresh sync (its context K/V then
    come from prefill rows, not from single-token steps: another batch shape again)."""
    s = backend.open_session()
    s.sync(prompt + ref[:j])
    s.verify(TokenTree(tokens=np.array([s.committed[-1]]), parents=np.array([-1])), GREEDY, 0)
    again = row_at(backend, 0, 0)
    s.close()
    a, b = ref[j], got[j]
    ids, values = own_top
    own = dict(zip(ids, values))
    return {"target_only_token": a, "tree_token": b,
            "tree_row_argmax": int(tree_row.argmax()), "tree_row_gap": float(tree_row[b] - tree_row[a]),
            "own_row_argmax": ids[0], "own_row_gap": float(own[a] - own[b]) if b in own else None,
            "recomputed_row_argmax": int(again.argmax()), "recomputed_row_gap": float(again[a] - again[b]),
            "row_max_abs_diff": float(np.abs(tree_row - again).max()),
            "explained": bool(tree_row.argmax() == b and ids[0] == a and b in own)}


def speculative(backend: TorchBackend, prompt: list[int], ref: list[int], tops: list, depth: int,
                rng: np.random.Generator) -> tuple[list[int], list[float], int, int, dict | None]:
    s = backend.open_session()
    s.sync(prompt)
    out, times, steps, accepted = [], [], 0, 0
    vocab = backend.info.vocab_size
    while len(out) < len(ref):
        tokens, parents, node = [s.committed[-1]], [-1], 0
        for d, t in enumerate(ref[len(out):len(out) + depth]):
            wrong = (t + 1 + d) % vocab
            right = t if rng.random() > 0.15 else (t + 7) % vocab   # sometimes the draft is wrong here
            tokens += [wrong, right] if d % 2 else [right, wrong]
            parents += [node, node]
            node = len(tokens) - (1 if d % 2 else 2)
            if right != t:
                break
        tree = TokenTree(tokens=np.array(tokens), parents=np.array(parents))
        t0 = time.perf_counter()
        r = s.verify(tree, GREEDY, steps)
        times.append(time.perf_counter() - t0)
        before = len(out)
        out += r.tokens
        steps += 1
        accepted += len(r.path)
        if out[:len(ref)] != ref[:len(out)]:  # diverged: the deciding node's row from this very step
            j = next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)
            deciding = ([0, *r.path])[j - before]
            tree_row = row_at(backend, 0, deciding)
            s.close()
            return out[:len(ref)], times, steps, accepted, explain(backend, prompt, ref, out, j, tree_row, tops[j])
    s.close()
    return out[:len(ref)], times, steps, accepted, None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    started = time.perf_counter()
    backend = TorchBackend(args.model, device=args.device, n_ctx=2048, max_nodes=64, max_sessions=4)
    load_s = time.perf_counter() - started
    prompts = json.loads(Path(args.prompts).read_text())
    rng = np.random.default_rng(0)
    rows = []
    for i, prompt in enumerate(prompts):
        ref, margins, t_ar, tops = target_only(backend, prompt, args.tokens)
        got, t_spec, steps, accepted, why = speculative(backend, prompt, ref, tops, args.depth, rng)
        first = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        row = {"prompt": i, "prompt_tokens": len(prompt), "tokens": len(ref), "equal": got == ref,
               "first_divergence": first, "margin_there": None if first is None else margins[first],
               "smallest_margin": min(margins), "spec_steps": steps, "accepted": accepted,
               "tau": len(got) / max(1, steps),
               "ar_step_ms": median_ms(t_ar), "spec_step_ms": median_ms(t_spec),
               "ref_head": ref[:12], "divergence": why}
        rows.append(row)
        print("[real]", json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    result = {"model": str(args.model), "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "backend": backend.info.backend, "extra": backend.info.extra,
              "load_s": round(load_s, 1), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"load {load_s:.1f} s; equal on {sum(r['equal'] for r in rows)}/{len(rows)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
