"""Which cuBLAS calls of a many-row verify step put a memset in front of their GEMM, and what the
alternatives cost (issue 9, 8 x 64 = 512 rows: the H200 profile charged 29 memsets a step 66 us on the
chain). Each variant is 28 calls on 28 weight copies captured in one CUDA graph (as in a step): graph
replay time (median of 30, CUDA events) and the kernels and memsets one replay runs (torch.profiler).

    python3 tools/probe_cublas_memsets.py [--rows 512] [--out probe.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# cuBLAS's own workspace unless the caller names one: importing bench_gpu_verify imports the engine, whose
# CUBLAS_WORKSPACE would otherwise apply (:4096:8 is torch's default on Hopper, the GPUs this probe is for)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_verify import captured, cuda_ms  # noqa: E402 - the GPU benchmarks' graph capture and timing


def kernels_of(g: torch.cuda.CUDAGraph) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    names: dict[str, int] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            names[e.name[:70]] = names.get(e.name[:70], 0) + 1
    return names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="512")
    ap.add_argument("--out", default="")
    ap.add_argument("--only", default="", help="run the variants whose name contains this")
    args = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    d, f, q, layers = 1536, 8960, 2048, 28
    w13 = [torch.randn(2 * f, d, device=dev, dtype=bf) * 0.02 for _ in range(layers)]
    wqkv = [torch.randn(q, d, device=dev, dtype=bf) * 0.02 for _ in range(layers)]
    bqkv = [torch.randn(q, device=dev, dtype=bf) * 0.02 for _ in range(layers)]
    wo = [torch.randn(d, d, device=dev, dtype=bf) * 0.02 for _ in range(layers)]
    w2 = [torch.randn(d, f, device=dev, dtype=bf) * 0.02 for _ in range(layers)]
    head = torch.randn(151936, d, device=dev, dtype=bf) * 0.02
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        h = torch.randn(rows, d, device=dev, dtype=bf)
        act = torch.randn(rows, f, device=dev, dtype=bf)
        h2 = h.expand(2, rows, d)
        zero_bias = torch.zeros(2 * f, device=dev, dtype=bf)
        out = torch.empty(rows, 2 * f, device=dev, dtype=bf)

        def pieces(n: int) -> list:
            step = rows // n
            return [torch.mm(h[i:i + step], w.t(), out=out[i:i + step]) for w in w13 for i in range(0, rows, step)]

        def lt(fn):
            def run():
                torch.backends.cuda.preferred_blas_library("cublaslt")
                try:
                    return fn()
                finally:
                    torch.backends.cuda.preferred_blas_library("default")
            return run

        variants = {
            "gate/up F.linear": lambda: [F.linear(h, w) for w in w13],
            "gate/up F.linear + zero bias": lambda: [F.linear(h, w, zero_bias) for w in w13],
            "gate/up 2 row halves": lambda: pieces(2),
            "gate/up 4 row quarters": lambda: pieces(4),
            "gate/up F.linear, cublaslt preferred": lt(lambda: [F.linear(h, w) for w in w13]),
            "gate/up mm(h, w.T)": lambda: [torch.mm(h, w.t()) for w in w13],
            "gate/up bmm of 2 halves": lambda: [torch.bmm(h2, w.view(2, f, d).transpose(1, 2)) for w in w13],
            "gate/up mm(w, h.T) (transposed out)": lambda: [torch.mm(w, h.t()) for w in w13],
            "wqkv F.linear + bias": lambda: [F.linear(h, w, b) for w, b in zip(wqkv, bqkv)],
            "wqkv F.linear, bias apart": lambda: [F.linear(h, w).add_(b) for w, b in zip(wqkv, bqkv)],
            "wo F.linear": lambda: [F.linear(h, w) for w in wo],
            "w2 F.linear": lambda: [F.linear(act, w) for w in w2],
            "LM head float32 out (x1)": lambda: torch.mm(h, head.t(), out_dtype=torch.float32),
        }
        for name, fn in variants.items():
            if args.only not in name:
                continue
            g = captured([fn])
            ms = cuda_ms(g.replay, 5, 30)
            ks = kernels_of(g)
            memsets = sum(n for k, n in ks.items() if "emset" in k)
            row = {"rows": rows, "variant": name, "replay_ms": round(ms, 4), "memsets": memsets, "kernels": ks}
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), "|",
                  "; ".join(f"{k} x{n}" for k, n in ks.items()), flush=True)
            del g
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "env": {k: v for k, v in os.environ.items() if "CUBLAS" in k or "BLAS" in k}, "rows": results},
                      fh, indent=1)


if __name__ == "__main__":
    main()
