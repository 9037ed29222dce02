#!/usr/bin/env python3
"""Experiment (issue 9, twentieth session): the small-rows matmuls with TMA tile loads.

fused._linear_rows_kernel loads its weight tiles through pointers (cp.async); at 64 token rows it streams
the weights at 2.6-3.0 TB/s (gate/up 18.6 us, w2 10.4 us a call on the H200, thirteenth session), where the
floor is ~4.3. In the nineteenth session TMA tiles made a 512-row GEMM 2.8x faster than its pointer-load
form. This script times a TMA form of the same products, one program per BN output columns (and K slice),
against what the forward runs now and cuBLAS, each call in a CUDA graph over rotating weight copies:

    python tools/bench_tma_rows.py --out tma_rows.json          # on the GPU
    TRITON_INTERPRET=1 python tools/bench_tma_rows.py --check   # the kernel against torch, on the CPU

Products (Qwen2.5-1.5B): gate/up with SiLU*up as its epilogue (fused.linear_silu), w2 and wo leaving
float32 K-slice partials for add_rmsnorm (fused.linear_rows_partials).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from edgespec.verifier.torch import fused  # noqa: E402


@triton.jit
def _rows_tma_kernel(x_desc, w_desc, O, rows, n_out, k_split, K_TILES: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, RP: tl.constexpr, PAIR: tl.constexpr, STAGES: tl.constexpr):
    """out^T [BN, rows] for output columns pid0 * BN.. and K slice pid1: W tiles [BN, BK] and x tiles [RP, BK]
    by TMA (rows past `rows` and K past the end come back as zeros). PAIR: W is gate/up [2 n_out, K], the
    up rows n_out further on, and the output silu(gate) * up [rows, n_out]; else float32 partials
    [SPLIT, rows, n_out]."""
    n0 = tl.program_id(0) * BN
    split = tl.program_id(1)
    k_lo = split * k_split
    acc = tl.zeros([BN, RP], tl.float32)
    acc_up = tl.zeros([BN, RP], tl.float32)
    for it in tl.range(0, K_TILES, num_stages=STAGES):
        k = k_lo + it * BK
        xt = x_desc.load([0, k])
        acc = tl.dot(w_desc.load([n0, k]), xt.T, acc)
        if PAIR:
            acc_up = tl.dot(w_desc.load([n_out + n0, k]), xt.T, acc_up)
    r = tl.arange(0, RP)
    c = n0 + tl.arange(0, BN)
    ok = (r < rows)[None, :] & (c < n_out)[:, None]
    if PAIR:   # gate and up rounded as a matmul writes them, then SiLU*up (fused._silu_times, as silu_mul)
        dt = O.dtype.element_ty
        y = fused._silu_times(acc.to(dt), acc_up.to(dt))
        tl.store(O + r[None, :] * n_out + c[:, None], y.to(dt), mask=ok)
    else:
        tl.store(O + (split * rows + r[None, :]) * n_out + c[:, None], acc, mask=ok)


def rows_tma(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int, int, int], pair: bool,
             w_desc: TensorDescriptor | None = None) -> torch.Tensor:
    """cfg (BN, BK, SPLIT, warps, stages). pair: silu(x @ gate^T) * (x @ up^T) [rows, n/2]; else float32
    partials [SPLIT, rows, n] of x @ w^T."""
    bn, bk, split, warps, stages = cfg
    rows, k = x.shape
    n_out = w.shape[0] // 2 if pair else w.shape[0]
    rp = max(16, triton.next_power_of_2(rows))
    k_split, split = fused.k_slices(k, split, bk)
    x_desc = TensorDescriptor.from_tensor(x, [rp, bk])
    w_desc = w_desc or TensorDescriptor.from_tensor(w, [bn, bk])
    out = (torch.empty(rows, n_out, dtype=x.dtype, device=x.device) if pair
           else torch.empty(split, rows, n_out, dtype=torch.float32, device=x.device))
    _rows_tma_kernel[(triton.cdiv(n_out, bn), split)](x_desc, w_desc, out, rows, n_out, k_split,
                                                      K_TILES=k_split // bk, BN=bn, BK=bk, RP=rp, PAIR=pair,
                                                      STAGES=stages, num_warps=warps)
    return out


MATRICES = {"w13": (17920, 1536), "w2": (1536, 8960), "wo": (1536, 1536)}
CANDIDATES = {   # (BN, BK, SPLIT, warps, stages)
    "w13": [(64, 64, 1, 4, 4), (64, 128, 1, 4, 3), (64, 64, 1, 4, 6), (32, 128, 1, 4, 4), (32, 64, 1, 4, 6),
            (128, 64, 1, 8, 4), (64, 128, 1, 8, 4)],
    "w2": [(64, 128, 6, 4, 4), (64, 128, 5, 4, 4), (64, 64, 6, 4, 6), (128, 128, 11, 8, 3), (64, 256, 5, 4, 3),
           (32, 128, 4, 4, 4), (64, 128, 7, 4, 4)],
    "wo": [(64, 128, 6, 4, 3), (64, 64, 6, 4, 4), (32, 128, 3, 4, 3), (64, 128, 4, 4, 3), (128, 128, 12, 8, 1)],
}


def reference(x: torch.Tensor, w: torch.Tensor, pair: bool) -> torch.Tensor:
    """What rows_tma's output should be, from fused.py's torch references (partials summed)."""
    return fused.linear_silu_torch(x, w).float() if pair else fused.linear_rows_partials_torch(x, w).sum(0)


def check_products(name: str, product, cases) -> str:
    """product(x, w, cfg, pair) (the pair's SiLU*up, or float32 partials) against torch in float32 on the small
    shapes `cases` ((pair, (n, k), rows, cfg), ...); returns the device it ran on (the CPU under the interpreter)."""
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    g = torch.Generator(device=dev).manual_seed(1)
    for pair, (n, k), rows, cfg in cases:
        x = torch.randn(rows, k, generator=g, device=dev)
        w = torch.randn(n, k, generator=g, device=dev) / math.sqrt(k)
        y = product(x, w, cfg, pair)
        err = float(((y.float() if pair else y.sum(0)) - reference(x, w, pair)).abs().max())
        print(f"{name} pair={pair} n={n} k={k} rows={rows} cfg={cfg}: max abs err {err:.2e}")
        assert err < (1e-4 if dev == "cpu" else 3e-2), err   # the GPU multiplies float32 as tf32
    return dev


def check() -> None:
    """The kernel against torch in float32 on small shapes (the CPU interpreter)."""
    check_products("tma", rows_tma, ((True, (96, 80), 5, (16, 32, 1, 4, 2)), (False, (48, 200), 7, (16, 32, 3, 4, 2)),
                                     (False, (40, 64), 16, (32, 16, 2, 4, 2))))


def rows_bench_args(doc: str, check_kernels) -> argparse.Namespace | None:
    """The small-rows matmul experiments' command line (this script's, bench_weight_tiles.py's): the kernels are
    checked first; None when --check asked for nothing more."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only check the kernels (works in the interpreter)")
    p.add_argument("--rows", default="16,64")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out")
    args = p.parse_args()
    check_kernels()
    return None if args.check else args


def main() -> int:
    args = rows_bench_args(__doc__, check)
    if args is None:
        return 0
    from bench_gpu_verify import graph_us, weight_copies   # noqa: E402 - tools/ is on sys.path as a script

    g = torch.Generator(device="cuda").manual_seed(2)
    out = []
    for name, (n, k) in MATRICES.items():
        pair = name == "w13"
        copies = weight_copies(n * k * 2)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / math.sqrt(k) for _ in range(copies)]
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
            ref = reference(x, ws[0], pair)
            floor_us = n * k * 2 / 4.3e12 * 1e6
            rec = {"matrix": name, "rows": rows, "floor_us_4.3TBps": floor_us,
                   "cublas_us": graph_us([lambda w=w: F.linear(x, w) for w in ws], args.iters)}
            if pair:
                rec["current_us"] = graph_us([lambda w=w: fused.linear_silu(x, w) for w in ws], args.iters)
            else:
                rec["current_us"] = graph_us([lambda w=w: fused.linear_rows_partials(x, w) for w in ws], args.iters)
            rec["tma"] = []
            for cfg in CANDIDATES[name]:
                try:
                    descs = [TensorDescriptor.from_tensor(w, list(cfg[:2])) for w in ws]
                    y = rows_tma(x, ws[0], cfg, pair)
                    err = float(((y.float() if pair else y.sum(0)) - ref).abs().max())
                    us = graph_us([lambda w=w, d=d: rows_tma(x, w, cfg, pair, d) for w, d in zip(ws, descs)],
                                  args.iters)
                    rec["tma"].append({"config": cfg, "us": us, "max_abs_err": err, "TBps": n * k * 2 / us / 1e6})
                except Exception as exc:  # noqa: BLE001 - a config that does not compile: report, go on
                    rec["tma"].append({"config": cfg, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(json.dumps(rec), flush=True)
            out.append(rec)
        del ws
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "triton": triton.__version__, "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
