"""The Gluon kernels of the GPU benchmarks (tools/bench_phase_overlap.py's dataflow stream, tools/bench_gluon_mlp.py's
persistent MLP) compiled for sm_90 on the CPU, so a Triton upgrade that breaks them fails here and not on the GPU
host; plus the MLP's host-side schedule and float32 reference. Their timings come from the benchmarks (GPU only)."""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

import bench_gluon_mlp as mlp  # noqa: E402
import bench_phase_overlap as overlap  # noqa: E402
from edgespec.verifier.torch import fused  # noqa: E402


@functools.cache
def _compiled() -> dict[str, str]:
    """{kernel: PTX}, compiled in a child process without TRITON_INTERPRET (tests/conftest.py sets it, and an
    interpreted function cannot be compiled)."""
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ptx(kernel, args: dict, constexprs: dict) -> str:
    """PTX of a Gluon kernel for sm_90, its arguments typed as the JIT would (pointers 16-byte aligned)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sig = {name: mangle_type(value) for name, value in args.items()}
    names = [p.name for p in kernel.params]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    sig.update({name: "constexpr" for name in constexprs})
    compiled = triton.compile(GluonASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    assert compiled.metadata.shared <= 227 * 1024   # one program per SM fits
    return compiled.asm["ptx"]


def _compile_all() -> dict[str, str]:
    """The child's work: both kernels at the shapes the benchmarks run (Qwen2.5-1.5B's MLP, 132 programs)."""
    w = torch.zeros(1 << 16, dtype=torch.bfloat16)
    i32, f32 = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.float32)
    found = {"dataflow": _ptx(overlap._dataflow_kernel,
                              {"desc": overlap.dataflow_descriptor(w, 32), "Tiles": i32, "Bases": i32, "Out": f32,
                               "Ctr": i32, "n_phases": 4}, {"TR": 32, "COLS": overlap.DF_COLS, "SLOTS": 8})}
    f, h = 8960, 1536
    for b_cols, k_slice in ((mlp.B_COLS, mlp.K_SLICE), (64, 896)):
        m = mlp.GluonMLP(torch.zeros(2 * f, h, dtype=torch.bfloat16), torch.zeros(h, f, dtype=torch.bfloat16),
                         programs=132, b_cols=b_cols, k_slice=k_slice)
        args, out = m.arguments(torch.zeros(64, h, dtype=torch.bfloat16))
        assert out.shape == (f // k_slice, 64, h)
        names = [p.name for p in mlp._mlp_kernel.params if not p.is_constexpr]
        found[f"mlp {b_cols}x{k_slice}"] = _ptx(mlp._mlp_kernel, dict(zip(names, args)), m.constexprs())
    return found


def test_dataflow_stream_kernel_compiles_with_tma_producer_and_grid_counter():
    ptx = _compiled()["dataflow"]
    assert "cp.async.bulk.tensor" in ptx          # the producer's TMA loads
    assert "mbarrier.try_wait" in ptx             # slots handed over by mbarriers
    assert "setmaxnreg" in ptx                    # warp-specialized: the producer warp gives up registers
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)   # the grid counter, acquire-release at GPU scope


@pytest.mark.parametrize("config", [f"{mlp.B_COLS}x{mlp.K_SLICE}", "64x896"])
def test_mlp_kernel_compiles_with_wgmma_tma_and_flags(config):
    ptx = _compiled()[f"mlp {config}"]
    for needed in ("cp.async.bulk.tensor", "wgmma.mma_async", "mbarrier.try_wait", "cp.async.cg", "setmaxnreg"):
        assert needed in ptx, needed
    assert re.search(r"atom\.global\.gpu\.release\.exch", ptx)   # an A tile's flag, released at GPU scope
    assert re.search(r"(ld|atom)\.global\.gpu\.acquire", ptx)     # a B tile's wait on the flags, acquiring


def test_mlp_schedule_runs_every_tile_once_a_before_b_and_balances_bytes():
    programs, f, h = 132, 8960, 1536
    wide, tail = mlp.a_tiles(f, programs)
    assert (wide, tail) == (132, 16)
    a_bytes = [4 * mlp.A_COLS * h] * wide + [4 * mlp.A_TAIL * h] * tail
    b_cols, slices, b_bytes = h // mlp.B_COLS, f // mlp.K_SLICE, 2 * mlp.B_COLS * mlp.K_SLICE
    table, count = mlp.schedule(a_bytes, b_cols, slices, b_bytes, programs)
    lists = [table[p, :count[p]].tolist() for p in range(programs)]
    assert sorted(t for tiles in lists for t in tiles) == list(range(len(a_bytes) + b_cols * slices))
    n_a = len(a_bytes)
    for tiles in lists:   # A tiles first: a B tile's wait never blocks an A tile of its own program
        kinds = [t >= n_a for t in tiles]
        assert kinds == sorted(kinds)
    load = [sum(a_bytes[t] if t < n_a else b_bytes for t in tiles) for tiles in lists]
    assert max(load) <= sum(load) / programs + max(a_bytes)   # the greedy bound: the mean plus one tile
    with pytest.raises(ValueError):
        mlp.a_tiles(8960 + 16, programs)   # columns left that no 32-column tile fits


def test_mlp_reference_partials_sum_to_the_step_path():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    w13 = torch.randn(2 * 256, 64, generator=g) * 0.1
    w2 = torch.randn(64, 256, generator=g) * 0.1
    parts = mlp.mlp_partials_torch(x, w13, w2, k_slice=64)
    assert parts.shape == (4, 5, 64)
    want = fused.linear_rows_partials_torch(fused.linear_silu_torch(x, w13), w2).sum(0)
    torch.testing.assert_close(parts.sum(0), want, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
