#!/usr/bin/env python3
"""The verifier's ≤ 64-row kernels launched once each at the Qwen2.5-1.5B step's shapes, for Nsight Compute.

Why: a step's CUPTI profile (bench_gpu_verify.py --profile-cells) says how long each kernel takes, not why. Run under
`ncu --profile-from-start off ...`: only the launches between cudaProfilerStart and Stop are profiled (compilation
and warm-up launches are not). Random bf16 weights and K/V; one copy of each matrix (ncu flushes L2 between kernels).

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy python3 tools/ncu_kernels.py matmuls 16,64
    ncu --profile-from-start off --section SpeedOfLight python3 tools/ncu_kernels.py attention 1,64

matmuls ROWS: gate/up (linear_silu), w2 and wo (float32 K-slice partials), wqkv (+ bias), in that order, per row count.
attention T: the tree attention (split kernel, then merge) for B 1, context 1024, 12/2 heads, the 2048-key table
bucket, one random tree of T nodes.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@contextmanager
def profiled() -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def once(launches: Callable[[], None], label: str) -> None:
    """Compile and warm outside the profiled range, then one profiled run."""
    for _ in range(3):
        launches()
    with profiled():
        launches()
    print(label, flush=True)


def matmuls(rows_list: list[int]) -> None:
    from edgespec.verifier.torch import fused

    torch.manual_seed(0)
    w = {name: torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02
         for name, shape in (("w13", (17920, 1536)), ("w2", (1536, 8960)), ("wo", (1536, 1536)), ("wqkv", (2048, 1536)))}
    bias = torch.randn(2048, device="cuda", dtype=torch.bfloat16) * 0.02
    for rows in rows_list:
        x = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)

        def launches() -> None:
            fused.linear_rows_partials(fused.linear_silu(x, w["w13"]), w["w2"])
            fused.linear_rows_partials(x, w["wo"])
            fused.linear_rows(x, w["wqkv"], bias)
        once(launches, f"matmuls at {rows} rows")


def attention(trees: list[int]) -> None:
    from edgespec.verifier.torch.tree_attention import ancestor_mask
    from edgespec.verifier.torch.triton_attention import TritonPagedAttention

    rng = np.random.default_rng(0)
    bs, D, Hq, Hkv, context, width = 16, 128, 12, 2, 1024, 128
    for T in trees:
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, T)]
        nb = -(-(context + T) // bs)
        cache = torch.randn(2, (nb + 1) * bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
        tables = torch.zeros(1, width, dtype=torch.int64, device="cuda")
        tables[0, :nb] = torch.from_numpy(rng.permutation(np.arange(1, nb + 1))).cuda()
        att = TritonPagedAttention(tables, torch.full((1,), context, device="cuda"),
                                   torch.from_numpy(ancestor_mask(parents))[None].cuda(), bs, Hq // Hkv)
        q = torch.randn(1, T, Hq, D, device="cuda", dtype=torch.bfloat16)
        once(lambda: att(q, cache), f"attention at T {T}: (BLOCK_M, BLOCK_N, stages, splits) "
                                    f"{att.launch_config(1, T * Hq // Hkv, Hkv)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("matmuls", "attention"))
    ap.add_argument("counts", help="comma-separated token rows (matmuls) or tree sizes (attention)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    counts = [int(v) for v in args.counts.split(",")]
    (matmuls if args.what == "matmuls" else attention)(counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
