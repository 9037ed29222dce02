"""Sweep the Triton tree-attention tiles at the target model's own shape, as a verify step uses them.

bench_gpu_verify.py's `attention` section times the kernel on the BASELINES.md shapes (64/8 heads,
long contexts); this one times it where the step spends it: the Qwen2.5-1.5B heads (12/2, d 128),
context 1024, B sessions x T tree tokens, 28 calls (one per layer) captured in one CUDA graph. For
each cell it reports the kernel's default (TritonPagedAttention.launch_config) and every
(BLOCK_M, BLOCK_N, warps, stages, splits) in the grid, fastest first, with the largest difference
from the default's output. CUDA only.

    PYTHONPATH=. python3 tools/bench_attention_tiles.py --cells 8x64,1x64,1x1 --out sweep.json
    PYTHONPATH=. python3 tools/bench_attention_tiles.py --grid quick --out sweep.json
    PYTHONPATH=. python3 tools/bench_attention_tiles.py --grid none --variants TREE_SPLIT=1,MIN_SPLIT_KEYS=64 --out v.json

--variants times knob sets (knobs.py names) at the default tiles (an A/B against an older copy of the kernel:
tools/bench_attention_ab.py); --once BxT runs the default three times and exits, for a profiler:

    ncu --clock-control none -k regex:_tree_attn -c 2 python3 tools/bench_attention_tiles.py --once 8x64
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_verify import attention_knobs, knob_values, random_parents  # noqa: E402

from edgespec.verifier.torch.tree_attention import ancestor_mask  # noqa: E402
from edgespec.verifier.torch.triton_attention import TritonPagedAttention  # noqa: E402

LAYERS = 28


def per_step_us(fn, reps: int = 30) -> float:
    """Microseconds for LAYERS back-to-back calls replayed as one CUDA graph (best of 3 x reps)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # compile and warm outside the capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best * 1000


GRIDS = {   # (BLOCK_M, BLOCK_N, warps, stages, splits) candidates; BLOCK_M None: by the number of rows
    "full": (None, [32, 64, 128], [4, 8], [2, 3], [1, 2, 4, 8]),
    "quick": ([64], [32, 64], [4], [1, 2], [4, 8]),   # tall cells; T = 1 (a few rows) takes 16-row tiles
    "none": ([], [], [], [], []),                     # the default (and --variants) only
}


@contextlib.contextmanager
def class_knobs(cls: type, values: dict[str, int]) -> Iterator[None]:
    """Knobs for the body: those `cls` has set on it (an older module's class too), the rest by name."""
    own = {k: v for k, v in values.items() if hasattr(cls, k)}
    before = {k: getattr(cls, k) for k in own}
    try:
        for k, v in own.items():
            setattr(cls, k, v)
        with attention_knobs(**{k: v for k, v in values.items() if k not in own}):
            yield
    finally:
        for k, v in before.items():
            setattr(cls, k, v)


def inputs(B: int, T: int, context: int, heads: tuple[int, int], rng: np.random.Generator,
           width: int | None = None) -> tuple:
    """(q, cache, block tables, context lengths, ancestor masks) of B random trees of T nodes. `width`: block
    tables that wide, the blocks past the sequence's own the null block (as the engine pads them); default:
    four real blocks past the tree."""
    hq, hkv = heads
    D, bs = 128, 16
    blocks = -(-(context + T) // bs) + (0 if width else 4)
    cache = torch.randn(2, (B * blocks + 1) * bs, hkv, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.zeros(B, max(width or 0, blocks), dtype=torch.int64)
    tables[:, :blocks] = torch.from_numpy(rng.permutation(np.arange(1, B * blocks + 1)).reshape(B, blocks))
    tables = tables.cuda()
    ctx = torch.full((B,), context, device="cuda")
    anc = torch.stack([torch.from_numpy(ancestor_mask(random_parents(T, rng))) for _ in range(B)]).cuda()
    q = torch.randn(B, T, hq, D, device="cuda", dtype=torch.bfloat16)
    return q, cache, tables, ctx, anc


def sweep(cls: type, B: int, T: int, context: int, heads: tuple[int, int], rng: np.random.Generator,
          grid: str = "full", variants: tuple[str, ...] = ()) -> dict:
    hq, hkv = heads
    bs = 16
    q, cache, tables, ctx, anc = inputs(B, T, context, heads, rng)
    rows = T * hq // hkv
    default = cls(tables, ctx, anc, bs, hq // hkv)
    bm0, bn0, stages0, splits0 = default.launch_config(B, rows, hkv)
    cell = {"batch": B, "tree": T, "context": context,
            "default": [bm0, bn0, default.NUM_WARPS, stages0, splits0],
            "default_us": per_step_us(lambda: default(q, cache))}
    reference = default(q, cache).float()
    tiles_m, tiles_n, warp_counts, stage_counts, split_counts = GRIDS[grid]
    tiles = [16] if rows <= 16 else (tiles_m or ([32, 64] if rows <= 96 else [64, 128]))
    jobs = [({"BLOCK_M": bm, "BLOCK_N": bn, "NUM_WARPS": warps, "NUM_STAGES": stages}, splits)
            for bm, bn, warps, stages, splits in itertools.product(tiles, tiles_n, warp_counts, stage_counts,
                                                                   split_counts)
            if not (bm * bn >= 128 * 128 and warps == 4)]
    jobs += [(knob_values(v), None) for v in variants]
    results = []
    for values, splits in jobs:
        key = {"config": [values["BLOCK_M"], values["BLOCK_N"], values["NUM_WARPS"], values["NUM_STAGES"], splits]} \
            if splits else {"variant": values}
        try:
            with class_knobs(cls, values):
                att = cls(tables, ctx, anc, bs, hq // hkv, nsplit=splits)
                us = per_step_us(lambda: att(q, cache))
                diff = (att(q, cache).float() - reference).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile: note it, go on
            results.append({**key, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            continue
        results.append({**key, "us": us, "max_diff": diff})
    cell["results"] = sorted((r for r in results if "us" in r), key=lambda r: r["us"]) + \
        [r for r in results if "us" not in r]
    return cell


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="8x64,1x64,1x1", help="BxT, comma-separated")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--heads", default="12/2", help="query/KV heads (Qwen2.5-1.5B: 12/2)")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="full")
    ap.add_argument("--variants", default="", help="knob sets 'K=V:K=V', comma-separated, at the default tiles")
    ap.add_argument("--once", default="", help="BxT: run the default three times and exit (for ncu)")
    ap.add_argument("--out", default="attention_tiles.json")
    args = ap.parse_args()
    heads = tuple(int(h) for h in args.heads.split("/"))
    cls = TritonPagedAttention
    rng = np.random.default_rng(3)
    if args.once:
        B, T = (int(v) for v in args.once.split("x"))
        q, cache, tables, ctx, anc = inputs(B, T, args.context, heads, rng)
        att = cls(tables, ctx, anc, 16, heads[0] // heads[1])
        for _ in range(3):
            att(q, cache)
        torch.cuda.synchronize()
        print("launch (BLOCK_M, BLOCK_N, stages, splits):", att.launch_config(B, T * heads[0] // heads[1], heads[1]))
        return 0
    variants = tuple(v for v in args.variants.split(",") if v)
    cells = []
    for spec in args.cells.split(","):
        B, T = (int(v) for v in spec.split("x"))
        cell = sweep(cls, B, T, args.context, heads, rng, args.grid, variants)
        cells.append(cell)
        best = cell["results"][0] if cell["results"] else None
        print(json.dumps({"batch": B, "tree": T, "default": cell["default"], "default_us": round(cell["default_us"], 1),
                          "best": best}), flush=True)
    Path(args.out).write_text(json.dumps({"heads": args.heads, "layers": LAYERS, "cells": cells}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
