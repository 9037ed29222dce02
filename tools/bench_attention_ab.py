"""A/B of two tree-attention kernels in one process: this package's TritonPagedAttention against the one in
another module (an older copy of triton_attention.py, say), on the target's own step shapes and on the
BASELINES.md shapes, with both graphs replayed round-robin (bench_gpu_verify.interleaved_ms), so that the
GPU's drift over the process weighs on both alike. CUDA only.

    git show HEAD~1:edgespec/verifier/torch/triton_attention.py > old_attention.py
    PYTHONPATH=. python3 tools/bench_attention_ab.py --against old_attention --out ab.json

Step shapes: Qwen2.5-1.5B heads (12/2, d 128), context 1024, block tables as wide as the engine pads them
with CUDA graphs (128 blocks), 28 calls (one per layer) per graph. BASELINES shapes: 64/8 heads, T = 64,
tables as wide as the context needs, 20 calls per graph. Reports µs per call and the largest difference
between the two kernels' outputs.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention_tiles import inputs  # noqa: E402
from bench_gpu_verify import captured, interleaved_ms  # noqa: E402

STEP_CELLS = [(1, 1), (1, 16), (1, 64), (8, 16), (8, 64)]
BASELINES = [(8, 4096), (32, 2048), (8, 32768)]


def shapes() -> list[tuple[str, int, int, int, int, int, int, int]]:
    """(label, query heads, KV heads, B, context, T, calls per graph, table width in blocks)."""
    out = [(f"step {b}x{t}", 12, 2, b, 1024, t, 28, 128) for b, t in STEP_CELLS]
    return out + [(f"base {b}x{ctx}", 64, 8, b, ctx, 64, 20, -(-(ctx + 64) // 16)) for b, ctx in BASELINES]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="module holding the other TritonPagedAttention")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--out", default="attention_ab.json")
    args = ap.parse_args()
    kernels = {"this": importlib.import_module("edgespec.verifier.torch.triton_attention").TritonPagedAttention,
               "against": importlib.import_module(args.against).TritonPagedAttention}
    rng = np.random.default_rng(0)
    rows = []
    for label, hq, hkv, B, ctx_len, T, calls, width in shapes():
        q, cache, tables, ctx, anc = inputs(B, T, ctx_len, (hq, hkv), rng, width)
        atts = {name: cls(tables, ctx, anc, 16, hq // hkv) for name, cls in kernels.items()}
        diff = float((atts["this"](q, cache).float() - atts["against"](q, cache).float()).abs().max())
        graphs = {name: captured([lambda a=a, c=cache: a(q, c)] * calls) for name, a in atts.items()}
        ms = interleaved_ms([g.replay for g in graphs.values()], 5, args.rounds)
        row = {"shape": label, **{f"{name}_us": 1000 * t / calls for name, t in zip(graphs, ms)},
               "max_abs_diff": diff}
        row["this_over_against"] = row["this_us"] / row["against_us"]
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        rows.append(row)
        del graphs, atts, cache
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"against": args.against, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
