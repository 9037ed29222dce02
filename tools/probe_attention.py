#!/usr/bin/env python3
"""Tree attention at the verify step's own shapes (Qwen2.5-1.5B: 12/2 heads, d 128, block 16):
one kernel's time per tile config and split count, graph-timed, for ncu or a sweep.

    python tools/probe_attention.py --cells 8x64,1x64,1x16 --out sweep.json
    ncu --clock-control none -k regex:_tree_attn -c 4 python tools/probe_attention.py --once 8x64
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from edgespec.verifier.torch import knobs  # noqa: E402
from edgespec.verifier.torch.tree_attention import ancestor_mask  # noqa: E402
import importlib  # noqa: E402
from tools.bench_gpu_verify import graph_us, random_parents  # noqa: E402

HQ, HKV, D, BS = 12, 2, 128, 16


def inputs(B: int, T: int, ctx: int, rng: np.random.Generator):
    nb = -(-(ctx + T) // BS) + 1
    cache = torch.randn(2, (B * nb + 1) * BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.from_numpy(rng.permutation(np.arange(1, B * nb + 1)).reshape(B, nb)).cuda()
    lens = torch.full((B,), ctx, device="cuda")
    anc = torch.stack([torch.from_numpy(ancestor_mask(random_parents(T, rng))) for _ in range(B)]).cuda()
    q = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    return q, cache, tables, lens, anc


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cells", default="8x64,1x64,1x16,8x16")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--configs", default="0x0w4s0")
    p.add_argument("--splits", default="0")
    p.add_argument("--once", default="", help="one cell, the default config, three calls (for ncu)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variants", default="", help="comma-separated knob sets 'K=V:K=V' timed at the default tiles")
    p.add_argument("--module", default="edgespec.verifier.torch.triton_attention",
                   help="where TritonPagedAttention comes from (an older copy for an A/B in one process)")
    p.add_argument("--out")
    a = p.parse_args()
    TritonPagedAttention = importlib.import_module(a.module).TritonPagedAttention
    rng = np.random.default_rng(0)
    if a.once:
        B, T = (int(v) for v in a.once.split("x"))
        q, cache, tables, lens, anc = inputs(B, T, a.ctx, rng)
        att = TritonPagedAttention(tables, lens, anc, BS, HQ // HKV)
        for _ in range(3):
            att(q, cache)
        torch.cuda.synchronize()
        print("launch", att.launch_config(B, T * HQ // HKV, HKV))
        return 0
    rows = []
    for cell in a.cells.split(","):
        B, T = (int(v) for v in cell.split("x"))
        q, cache, tables, lens, anc = inputs(B, T, a.ctx, rng)
        ref = None
        jobs = [(cfg, ns, "") for cfg in a.configs.split(",") for ns in (int(v) for v in a.splits.split(","))]
        jobs += [("0x0w4s0", 0, v) for v in a.variants.split(",") if v]
        for cfg, ns, variant in jobs:
            tile, _, rest = cfg.partition("w")
            bm, bn = (int(v) for v in tile.split("x"))
            warps, stages = (int(v) for v in rest.split("s"))
            row = {"cell": cell, "config": cfg, "splits": ns, "variant": variant, "module": a.module}
            values = {"BLOCK_M": bm, "BLOCK_N": bn, "NUM_WARPS": warps, "NUM_STAGES": stages, **knobs.parse(variant)}
            own = {k: v for k, v in values.items() if hasattr(TritonPagedAttention, k)}
            before = {k: getattr(TritonPagedAttention, k) for k in own}
            try:   # the class's own constants set on it (an older module's class too), the rest as knobs
                for k, v in own.items():
                    setattr(TritonPagedAttention, k, v)
                with knobs.override({k: v for k, v in values.items() if k not in own}):
                    att = TritonPagedAttention(tables, lens, anc, BS, HQ // HKV, nsplit=ns or None)
                    row["launch"] = att.launch_config(B, T * HQ // HKV, HKV)
                    out = att(q, cache)
                    if ref is None:
                        ref = out.float()
                    row["max_diff"] = float((out.float() - ref).abs().max())
                    row["us"] = graph_us([lambda: att(q, cache)] * 20, a.iters)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile: say so, go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            finally:
                for k, v in before.items():
                    setattr(TritonPagedAttention, k, v)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
