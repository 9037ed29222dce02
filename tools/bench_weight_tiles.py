#!/usr/bin/env python3
"""Experiment (issue 9, thirty-second session): the small-rows matmuls over a tile-contiguous weight copy.

At 64 token rows fused._linear_rows_kernel streams its weights at ~2.9 TB/s (gate/up 19.1 us, w2 10.4 us a call on
the H200, twentieth session), against a 4.24 TB/s copy ceiling; TMA tile loads (bench_tma_rows.py) were no faster.
Both read, per K step, 64-128 byte pieces of 100+ weight rows that lie K * 2 bytes apart. This script asks two
questions in one run, each call in a CUDA graph over rotating weight copies (more than L2 holds):
- what a plain stream over the same bytes takes (one contiguous chunk a program): the ceiling for that size;
- whether the same kernel reading a copy laid out tile by tile (each program's [rows, BLOCK_K] tile of each K
  step contiguous, made once at load time) gets nearer to it.

    python tools/bench_weight_tiles.py --out tiles.json          # on the GPU
    TRITON_INTERPRET=1 python tools/bench_weight_tiles.py --check   # the kernels against torch, on the CPU
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_tma_rows import MATRICES, check_products, reference, rows_bench_args  # noqa: E402 - the same products and checks
from edgespec.verifier.torch import fused  # noqa: E402


@triton.jit
def _stream_kernel(W, O, n, per_prog: tl.constexpr, BLOCK: tl.constexpr):
    """Sums program p's contiguous chunk [p * per_prog, +per_prog) of W (float32 out): a read-only stream."""
    p = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    lo = p * per_prog
    for i in range(0, per_prog, BLOCK):
        offs = lo + i + tl.arange(0, BLOCK)
        acc += tl.load(W + offs, mask=(offs < n) & (i + tl.arange(0, BLOCK) < per_prog), other=0.0).to(tl.float32)
    tl.store(O + p, tl.sum(acc))


def stream(w: torch.Tensor, programs: int, out: torch.Tensor, block: int = 4096) -> torch.Tensor:
    n = w.numel()
    per = triton.cdiv(triton.cdiv(n, programs), block) * block
    _stream_kernel[(programs,)](w, out, n, per, BLOCK=block, num_warps=8, num_stages=4)
    return out


@triton.jit
def _rows_tiled_kernel(X, WT, O, rows, N, K, k_split, x_stride, K_TILES: tl.constexpr, SPLIT: tl.constexpr,
                       COLS: tl.constexpr, R_MAIN: tl.constexpr, R_TAIL: tl.constexpr, PAIR: tl.constexpr,
                       PARTIALS: tl.constexpr, ROWS_P: tl.constexpr, BLOCK_K: tl.constexpr):
    """fused._linear_rows_kernel's product (no SiLU input, bias or RoPE) with the weight read from tiled(): program
    p's K step `it` of slice `split` is one contiguous [R_MAIN + R_TAIL, BLOCK_K] block, zero-padded."""
    p = tl.program_id(0)
    split = tl.program_id(1)
    r = tl.arange(0, ROWS_P)
    kk = tl.arange(0, BLOCK_K)
    r_ok = r < rows
    k_lo = split * k_split
    _, col_main, ok_main = fused._rows_of(p, 0, R_MAIN, COLS, N, PAIR, 0)
    tile = (R_MAIN + R_TAIL) * BLOCK_K
    base = WT + (p * SPLIT + split).to(tl.int64) * K_TILES * tile
    w_main = base + tl.arange(0, R_MAIN)[:, None] * BLOCK_K + kk[None, :]
    acc_main = tl.zeros((R_MAIN, ROWS_P), tl.float32)
    if R_TAIL > 0:
        _, col_tail, ok_tail = fused._rows_of(p, R_MAIN, R_TAIL, COLS, N, PAIR, 0)
        w_tail = base + (R_MAIN + tl.arange(0, R_TAIL))[:, None] * BLOCK_K + kk[None, :]
        acc_tail = tl.zeros((R_TAIL, ROWS_P), tl.float32)
    x_ptr = X + r[None, :] * x_stride + kk[:, None]
    for it in range(0, K_TILES):
        k0 = k_lo + it * BLOCK_K
        xt = tl.load(x_ptr + k0, mask=r_ok[None, :] & (k0 + kk < K)[:, None], other=0.0)
        acc_main = tl.dot(tl.load(w_main + it * tile), xt, acc_main)
        if R_TAIL > 0:
            acc_tail = tl.dot(tl.load(w_tail + it * tile), xt, acc_tail)
    fused._rows_store(acc_main, col_main, ok_main, O, O, split, r, r_ok, rows, N, O, O, O, O, O, 0,
                      False, PAIR, PARTIALS, R_MAIN, ROWS_P, 0, 0, 0)
    if R_TAIL > 0:
        fused._rows_store(acc_tail, col_tail, ok_tail, O, O, split, r, r_ok, rows, N, O, O, O, O, O, 0,
                          False, PAIR, PARTIALS, R_TAIL, ROWS_P, 0, 0, 0)


def _geometry(n: int, k: int, cfg: tuple[int, int, int, int, int], pair: bool) -> dict:
    cols, block_k, split, _, _ = cfg
    n_out = n // 2 if pair else n
    k_split, split = fused.k_slices(k, split, block_k)
    r_main, r_tail = fused._row_tiles((2 if pair else 1) * cols)
    return dict(n_out=n_out, k_split=k_split, split=split, k_tiles=k_split // block_k, r_main=r_main, r_tail=r_tail,
                programs=triton.cdiv(n_out, cols))


def tiled(w: torch.Tensor, cfg: tuple[int, int, int, int, int], pair: bool) -> torch.Tensor:
    """The weight [n, k] as [programs, SPLIT * K_TILES, R_MAIN + R_TAIL, BLOCK_K]: the rows each program reads (in
    fused._rows_of's order: gate/up interleaved for a pair) and each K step's tile contiguous; padding is zero."""
    n, k = w.shape
    cols, block_k = cfg[0], cfg[1]
    g = _geometry(n, k, cfg, pair)
    rows_per = g["r_main"] + g["r_tail"]
    local = torch.arange(rows_per, device=w.device)
    p = torch.arange(g["programs"], device=w.device)[:, None]
    if pair:
        col = p * cols + local // 2
        ok = (local < 2 * cols) & (col < g["n_out"])
        idx = col + (local % 2) * g["n_out"]
    else:
        col = p * cols + local
        ok = (local < cols) & (col < n)
        idx = col
    k_pad = g["split"] * g["k_split"]
    src = torch.nn.functional.pad(w, (0, k_pad - k))
    picked = src[idx.clamp(max=n - 1)] * ok[..., None].to(w.dtype)          # [programs, rows_per, k_pad]
    return picked.view(g["programs"], rows_per, k_pad // block_k, block_k).permute(0, 2, 1, 3).contiguous()


def rows_tiled(x: torch.Tensor, wt: torch.Tensor, n: int, k: int, cfg: tuple[int, int, int, int, int],
               pair: bool) -> torch.Tensor:
    """pair: silu(x @ gate^T) * (x @ up^T) [rows, n/2]; else float32 partials [SPLIT, rows, n]."""
    rows = x.shape[0]
    g = _geometry(n, k, cfg, pair)
    out = (torch.empty(rows, g["n_out"], dtype=x.dtype, device=x.device) if pair
           else torch.empty(g["split"], rows, n, dtype=torch.float32, device=x.device))
    _rows_tiled_kernel[(g["programs"], g["split"])](
        x, wt, out, rows, g["n_out"], k, g["k_split"], x.stride(0), K_TILES=g["k_tiles"], SPLIT=g["split"],
        COLS=cfg[0], R_MAIN=g["r_main"], R_TAIL=g["r_tail"], PAIR=pair, PARTIALS=not pair,
        ROWS_P=max(16, triton.next_power_of_2(rows)), BLOCK_K=cfg[1], num_warps=cfg[3], num_stages=cfg[4])
    return out


def check() -> None:
    """The tiled kernel and the stream against torch on small shapes (float32; the CPU interpreter)."""
    dev = check_products("tiled", lambda x, w, cfg, pair: rows_tiled(x, tiled(w, cfg, pair), *w.shape, cfg, pair),
                         ((True, (96, 80), 5, (12, 32, 1, 4, 2)), (False, (48, 200), 7, (20, 32, 3, 4, 2)),
                          (False, (40, 64), 16, (16, 16, 2, 4, 2))))
    w = torch.randn(1000, 37, generator=torch.Generator(device=dev).manual_seed(3), device=dev)
    out = torch.empty(3, device=dev)
    err = abs(float(stream(w, 3, out, block=256).sum()) - float(w.sum()))
    print(f"stream: abs err {err:.2e}")
    assert err < 1e-2, err


# (COLS, BLOCK_K, SPLIT, warps, stages) tried for the tiled form at 64 rows beside the forward's own
OTHER_CONFIGS = {"w13": [(68, 128, 1, 8, 4), (34, 64, 1, 4, 6)], "w2": [(128, 128, 11, 8, 4), (64, 64, 6, 4, 6)],
                 "wo": [(48, 128, 4, 4, 4), (96, 64, 8, 8, 4)]}


def main() -> int:
    args = rows_bench_args(__doc__, check)
    if args is None:
        return 0
    from bench_gpu_verify import graph_us, weight_copies

    g = torch.Generator(device="cuda").manual_seed(2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for name, (n, k) in MATRICES.items():
        pair = name == "w13"
        nbytes = n * k * 2
        copies = weight_copies(nbytes)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / math.sqrt(k) for _ in range(copies)]
        sink = torch.empty(8 * sms, device="cuda")
        rec0 = {"matrix": name, "bytes": nbytes, "copies": copies, "stream": {}}
        for per_sm in (1, 2, 4, 8):
            us = graph_us([lambda w=w, m=per_sm: stream(w, m * sms, sink) for w in ws], args.iters)
            rec0["stream"][f"{per_sm}_per_sm"] = {"us": us, "TBps": nbytes / us / 1e6}
        print(json.dumps(rec0), flush=True)
        out.append(rec0)
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
            cfg = fused.linear_rows_config(rows, n, k, pair=pair, can_split=not pair, device=x.device)
            ref = reference(x, ws[0], pair)
            now = (lambda w: fused.linear_silu(x, w)) if pair else (lambda w: fused.linear_rows_partials(x, w))
            rec = {"matrix": name, "rows": rows, "config": cfg, "floor_us_4.3TBps": nbytes / 4.3e12 * 1e6,
                   "current_us": graph_us([lambda w=w: now(w) for w in ws], args.iters)}
            wts = [tiled(w, cfg, pair) for w in ws]
            y = rows_tiled(x, wts[0], n, k, cfg, pair)
            rec["tiled_max_abs_err"] = float(((y.float() if pair else y.sum(0)) - ref).abs().max())
            rec["tiled_us"] = graph_us([lambda wt=wt: rows_tiled(x, wt, n, k, cfg, pair) for wt in wts], args.iters)
            rec["other_configs"] = []
            for other in OTHER_CONFIGS[name] if rows == 64 else ():   # the tiled form may want other tiles
                try:
                    wts = [tiled(w, other, pair) for w in ws]
                    us = graph_us([lambda wt=wt: rows_tiled(x, wt, n, k, other, pair) for wt in wts], args.iters)
                    rec["other_configs"].append({"config": other, "tiled_us": us})
                except Exception as exc:  # noqa: BLE001 - a config that does not fit: report, go on
                    rec["other_configs"].append({"config": other, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            rec["current_again_us"] = graph_us([lambda w=w: now(w) for w in ws], args.iters)
            rec["tiled_TBps"] = nbytes / rec["tiled_us"] / 1e6
            rec["current_TBps"] = nbytes / rec["current_us"] / 1e6
            print(json.dumps(rec), flush=True)
            out.append(rec)
            del wts
        del ws
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "triton": triton.__version__, "sms": sms, "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
