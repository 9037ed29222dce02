"""The persistent Gluon MLP kernel (edgespec/verifier/torch/gluon_mlp.py) against what the verify step runs now at
<= 64 token rows (fused.linear_silu, then fused.linear_rows_partials for down): checks, then timings.

Checks, at each row count: the kernel's partials summed against the float32 reference (`mlp_partials_torch`) and
against the product's path, two launches bit-identical (the flags and epochs carry over), and the SiLU*up
activations against fused.linear_silu's. Timings: `--layers` MLPs of distinct random weights (the
Qwen2.5-1.5B shape, bf16) back to back in one CUDA graph per variant, graphs replayed round-robin; the floor
is their weight bytes at the copy ceiling measured in the same run. GPU (sm_90) only.

    PYTHONPATH=. python3 tools/bench_gluon_mlp.py --rows 16,64 --out gluon_mlp.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

from edgespec.verifier.torch import fused, gluon_mlp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_verify import captured, interleaved_ms  # noqa: E402 - the GPU benchmarks' graph timing


def product(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The step's MLP at <= 64 rows today: gate/up with SiLU*up in its epilogue, then down's partials."""
    return fused.linear_rows_partials(fused.linear_silu(x, w13), w2)


def checks(rows: int, w13: torch.Tensor, w2: torch.Tensor, mlp: gluon_mlp.GluonMLP) -> dict:
    x = (torch.randn(rows, w13.shape[1], device=w13.device) * 0.5).to(torch.bfloat16)
    ref = gluon_mlp.mlp_partials_torch(x, w13, w2).sum(0)
    first = mlp(x)
    torch.cuda.synchronize()
    second = mlp(x)
    torch.cuda.synchronize()
    ours = first.sum(0)
    theirs = product(x, w13, w2).sum(0)
    args, _ = mlp.arguments(x)
    gluon_mlp._mlp_kernel[(mlp.programs,)](*args, **mlp.constexprs(), num_warps=4)
    act = args[6]
    torch.cuda.synchronize()
    scale = ref.abs().max().item()
    return {"rows": rows, "partials": first.shape[0],
            "rel_err_vs_reference": (ours - ref).abs().max().item() / scale,
            "rel_err_product_vs_reference": (theirs - ref).abs().max().item() / scale,
            "repeat_identical": bool(torch.equal(first, second)),
            "act_max_diff_vs_linear_silu": (act.float() - fused.linear_silu(x, w13).float()).abs().max().item()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="16,64")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--configs", default=f"{gluon_mlp.B_COLS}x{gluon_mlp.K_SLICE}b{gluon_mlp.SLOTS_B}h{gluon_mlp.SLOTS_H}",
                   help="B tile configs, comma-separated: B_COLSxK_SLICEbSLOTS_BhSLOTS_H (the first is checked)")
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    f, h = 8960, 1536
    weights = [((torch.randn(2 * f, h, device=dev) * 0.02).to(torch.bfloat16),
                (torch.randn(h, f, device=dev) * 0.02).to(torch.bfloat16)) for _ in range(args.layers)]
    configs = {}
    for c in args.configs.split(","):
        b_cols, rest = c.split("x")
        k_slice, rest = rest.split("b")
        slots_b, slots_h = rest.split("h")
        configs[c] = [gluon_mlp.GluonMLP(a, b, b_cols=int(b_cols), k_slice=int(k_slice), slots_b=int(slots_b),
                                         slots_h=int(slots_h)) for a, b in weights]
    mlps = next(iter(configs.values()))
    res: dict = {"device": torch.cuda.get_device_name(dev), "triton": triton.__version__, "torch": torch.__version__,
                 "args": vars(args), "checks": [], "ms": {}}
    t0 = time.time()
    for rows in map(int, args.rows.split(",")):
        for r in sorted({1, rows}):
            res["checks"].append(checks(r, *weights[0], mlps[0]))
            print("check", res["checks"][-1], f"({time.time() - t0:.1f} s)", flush=True)
    src, dst = (torch.empty(1 << 29, dtype=torch.uint8, device=dev) for _ in range(2))
    copy_ms = interleaved_ms([lambda: dst.copy_(src)], 3, 10)[0]
    res["copy_tb_s"] = 2 * (1 << 29) / (copy_ms * 1e-3) / 1e12   # read + write bytes a second
    w_bytes = sum(a.numel() * 2 + b.numel() * 2 for a, b in weights)
    for rows in map(int, args.rows.split(",")):
        x = (torch.randn(rows, h, device=dev) * 0.5).to(torch.bfloat16)
        graphs = {"product": captured([lambda a=a, b=b: product(x, a, b) for a, b in weights])}
        for name, ms_ in configs.items():
            graphs[f"gluon {name}"] = captured([lambda m=m: m(x) for m in ms_])
        ms = interleaved_ms([g.replay for g in graphs.values()], 3, args.iters)
        floor = w_bytes / (res["copy_tb_s"] * 1e12) * 1e3
        res["ms"][str(rows)] = {**dict(zip(graphs, ms)), "floor": floor}
        print(f"rows {rows}: " + ", ".join(f"{k} {v:.4f} ms ({w_bytes / (v * 1e-3) / 1e12:.2f} TB/s)"
                                           for k, v in zip(graphs, ms)) + f"; floor {floor:.4f}", flush=True)
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
