"""Programmatic dependent launch (pdl.py): every Triton kernel of the verifier's forward, compiled for
an H100/H200 (sm_90) with the launch path the forward uses, carries the wait and the early launch
with PDL on (or the launch where knob TRIGGER puts it), and nothing touches memory before the wait but
L2 prefetches of weights: no store (a kernel that still runs may read what this one overwrites) and no
load (with knobs EARLY_INDEX / PREFETCH_KEYS the attention also reads the host's lengths and block tables and
prefetches older context K/V first: tested on its own). Triton's own compiler and ptxas run on this CPU
machine; the launches are intercepted (no GPU here), so the arguments are exactly those the wrappers pass.

The compile runs in a child process without TRITON_INTERPRET (tests/conftest.py sets it for the
interpreter tests, and an interpreted kernel cannot be compiled)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from edgespec.verifier.torch import knobs, pdl  # noqa: E402

# global-memory reads in PTX: plain loads and the asynchronous copies of pipelined loops
LOADS = ("ld.global", "cp.async")
# kernels whose programs ask L2 for their first weight lines before the wait
PREFETCH = {"_add_rmsnorm_kernel", "_gemv_kernel", "_linear_rows_kernel"}
# kernels that run beside the forward on a side stream (fused.L2_WARM), never with PDL
BESIDE = {"_l2_warm_kernel"}


def test_pdl_is_a_knob_and_stays_off_without_a_gpu_that_has_it():
    import torch

    assert knobs.parse("PDL=16") == {"PDL": 16}
    with knobs.override({"PDL": 16}):
        assert pdl.PDL == 16
        assert pdl.launch_args(torch.device("cpu"), 1) == {"GDC": False}
    with knobs.override({"PDL": 0}):
        assert pdl.launch_args(torch.device("cpu"), 1) == {"GDC": False}
    assert pdl.triton_has_pdl()   # the pinned Triton (constraints/ci.txt) has it: the GPU host runs the same


def _probe(gdc: int, kernel_knobs: str = "") -> dict[str, dict]:
    """Compile every forward kernel as launched with GDC = `gdc` (0: PDL off; 1 + pdl.TRIGGER), with the
    kernel knobs `kernel_knobs` ("NAME=V,...") set in the child."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[knobs.ENV] = kernel_knobs
    out = subprocess.run([sys.executable, __file__, str(int(gdc))], capture_output=True, text=True, timeout=600,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_forward_kernel_waits_before_touching_what_earlier_kernels_write():
    found = _probe(1)
    assert set(found) == {"_add_rmsnorm_kernel", "_gemv_kernel", "_linear_rows_kernel", "_sum_partials_kernel",
                          "_rope_store_kernel", "_silu_mul_kernel", "_top2_chunks_kernel", "_top2_merge_kernel",
                          "_tree_attn_split", "_tree_attn_merge"} | BESIDE
    for name, seen in found.items():
        if name in BESIDE:
            continue
        assert seen["launch_pdl"], name
        assert seen["wait"] == 1 and seen["launch_dependents"] == 1, (name, seen)
        assert seen["stores_before_wait"] == 0 and seen["loads_before_wait"] == 0, (name, seen)
        # the weights' lines are on their way to L2 while the previous kernel finishes
        assert (seen["prefetches_before_wait"] > 0) == (name in PREFETCH), (name, seen)


def test_early_index_and_context_prefetch_read_only_what_no_kernel_of_the_step_writes():
    """TritonPagedAttention.EARLY_INDEX / PREFETCH_KEYS: the split kernel reads the sequence's length and its
    first block ids (the host's copies) before the wait, and with PREFETCH_KEYS asks L2 for context K/V lines
    (older steps' rows; a prefetch changes no value); still no store before the wait. The other kernels are
    as without the knobs."""
    plain = _probe(1)
    early = _probe(1, "EARLY_INDEX=1")
    prefetched = _probe(1, "PREFETCH_KEYS=128")
    for name in plain:
        if name == "_tree_attn_split":
            continue
        assert early[name] == plain[name] == prefetched[name], name
    base, e, p = plain["_tree_attn_split"], early["_tree_attn_split"], prefetched["_tree_attn_split"]
    assert base["loads_before_wait"] == 0 and base["prefetches"] == 0, base
    for seen in (e, p):
        assert seen["wait"] == 1 and seen["launch_dependents"] == 1 and seen["stores_before_wait"] == 0, seen
        # the length, then the first tile's block ids (one load each in every thread's share of them)
        assert 2 <= seen["loads_before_wait"] <= 8, seen
    assert e["prefetches"] == 0, e
    assert p["prefetches_before_wait"] == p["prefetches"] > 0, p   # K and V lines, all before the wait
    assert p["loads_before_wait"] > e["loads_before_wait"], p         # + the prefetched keys' block ids


def test_a_late_trigger_moves_the_launch_after_the_main_loop():
    """TRIGGER 1: the matmul and attention kernels let the next kernel launch once their main loop is done
    (after the wait, after their last weight/key load of the loop); the other kernels at their exit (no
    instruction). TRIGGER 2: every kernel at its exit."""
    with knobs.override({"TRIGGER": 1}):
        assert pdl.gdc_mode() == 2
    with knobs.override({"TRIGGER": 2}):
        assert pdl.gdc_mode() == 3
    with knobs.override({"TRIGGER": 3}), pytest.raises(ValueError, match="TRIGGER"):
        pdl.gdc_mode()
    released = {"_linear_rows_kernel", "_tree_attn_split"}
    for name, seen in _probe(2).items():
        if name in BESIDE:
            continue
        assert seen["wait"] == 1 and seen["stores_before_wait"] == 0 and seen["loads_before_wait"] == 0, (name, seen)
        assert seen["launch_dependents"] == (name in released), (name, seen)
        if name in released:
            assert seen["launch_after_wait"] and seen["loads_after_launch"] < seen["loads_after_wait"], (name, seen)


def test_with_pdl_off_the_kernels_compile_without_it():
    for name, seen in _probe(0).items():
        assert not seen["launch_pdl"] and seen["wait"] == 0 and seen["launch_dependents"] == 0, (name, seen)
        assert seen["prefetches"] == 0, (name, seen)


def test_the_l2_warm_kernel_only_prefetches():
    """fused.warm_l2 compiles (ptxas accepts the bulk prefetch for sm_90) to one bulk L2 prefetch per row and
    thread and nothing else that touches memory: it cannot change a value the forward computes."""
    for gdc in (0, 1):
        seen = _probe(gdc)["_l2_warm_kernel"]
        assert not seen["launch_pdl"] and seen["wait"] == 0 and seen["launch_dependents"] == 0, seen
        assert seen["bulk_prefetches"] == 1 and seen["stores"] == 0, seen
        assert seen["loads_after_wait"] == seen["loads_before_wait"] == 0, seen
        assert seen["all_loads"] == seen["bulk_prefetches"], seen


# -- the child: run the wrappers on CPU tensors, compile each launch for sm_90, read its PTX --------------
def _compile_launches(gdc: int) -> dict[str, dict]:
    import inspect

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from edgespec.verifier.torch import fused, triton_attention
    from edgespec.verifier.torch.tree_ops import pack_ancestor_bits

    types = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float16: "*fp16", torch.int64: "*i64",
             torch.int32: "*i32", torch.bool: "*i1"}
    found: dict[str, dict] = {}

    class Recorder:
        """Stands in for a kernel: `kernel[grid](*args, **kw)` compiles instead of launching."""

        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return self.compile

        def compile(self, *args, **kw):
            fn = self.kernel
            options = {k: kw.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kw}
            bound = inspect.signature(fn.fn).bind(*args, **kw).arguments
            signature, constexprs, attrs = {}, {}, {}
            for i, p in enumerate(fn.params):
                value = bound[p.name]
                if p.is_constexpr:
                    signature[p.name] = "constexpr"
                    constexprs[p.name] = value
                elif isinstance(value, torch.Tensor):
                    signature[p.name] = types[value.dtype]
                elif isinstance(value, bool):
                    signature[p.name] = "i1"
                elif isinstance(value, int):
                    signature[p.name] = "i32" if abs(value) < 2 ** 31 else "i64"
                else:
                    signature[p.name] = "fp32"
                # what a launch specializes on: 16-byte aligned pointers, integers divisible by 16
                aligned = value.data_ptr() % 16 == 0 if isinstance(value, torch.Tensor) else (
                    isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0)
                if aligned and not p.is_constexpr:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32), options=options)
            # instructions without their guard predicate ("@%p1 ld.global..." counts as a load too)
            lines = [re.sub(r"^@!?%\w+\s+", "", ln.strip()) for ln in compiled.asm["ptx"].splitlines()]
            waits = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
            launches = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents")]
            before = lines[:waits[0]] if waits else []
            after_wait = lines[waits[0]:] if waits else []
            after_launch = lines[launches[0]:] if launches else []
            found[fn.__name__] = {
                "launch_pdl": bool(options.get("launch_pdl", False)),
                "wait": len(waits),
                "launch_dependents": len(launches),
                "loads_before_wait": sum(ln.startswith(LOADS) for ln in before),
                "prefetches_before_wait": sum(ln.startswith("prefetch.global.L2") for ln in before),
                "prefetches": sum(ln.startswith("prefetch.global.L2") for ln in lines),
                "bulk_prefetches": sum(ln.startswith("cp.async.bulk.prefetch.L2") for ln in lines),
                "all_loads": sum(ln.startswith(LOADS) for ln in lines),
                "stores": sum(ln.startswith(("st.global", "red.", "atom.")) for ln in lines),
                "stores_before_wait": sum(ln.startswith(("st.global", "red.", "atom.")) for ln in before),
                "launch_after_wait": bool(waits and launches and launches[0] > waits[0]),
                "loads_after_wait": sum(ln.startswith(LOADS) for ln in after_wait),
                "loads_after_launch": sum(ln.startswith(LOADS) for ln in after_launch),
            }

    for module in (fused, triton_attention):
        for name, value in list(vars(module).items()):
            if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith(("_kernel", "_split", "_merge")):
                setattr(module, name, Recorder(value))
    pdl.launch_args = lambda device, rows: {"GDC": gdc, "launch_pdl": True} if gdc else {"GDC": False}

    bf = torch.bfloat16
    d, f, heads, kv_heads, hd = 1536, 8960, 12, 2, 128
    x = torch.zeros(1, d, dtype=bf)
    fused.add_rmsnorm(x, torch.zeros(5, 1, d), torch.ones(d, dtype=bf), 1e-6)              # + split-K partials
    fused.linear_rows(x, torch.zeros(2048, d, dtype=bf), torch.zeros(2048, dtype=bf))      # one row: the GEMV
    fused.linear_rows(torch.zeros(16, d, dtype=bf), torch.zeros(d, d, dtype=bf),           # rows + summed partials
                      config=(32, 128, 2, 4, 4))
    fused.linear_silu(torch.zeros(16, d, dtype=bf), torch.zeros(2 * 136, d, dtype=bf))    # gate/up, SiLU*up epilogue
    cache = torch.zeros(2, 64, kv_heads, hd, dtype=bf)
    ang = torch.zeros(1, hd // 2)
    fused.rope_store(torch.zeros(1, (heads + 2 * kv_heads) * hd, dtype=bf), ang.cos(), ang.sin(), cache,
                     torch.zeros(1, dtype=torch.int64), heads, kv_heads)
    ang16 = torch.zeros(16, hd // 2)   # 16 rows: RoPE in _linear_rows_kernel's epilogue
    fused.linear_rope_store(torch.zeros(16, d, dtype=bf), torch.zeros((heads + 2 * kv_heads) * hd, d, dtype=bf),
                            torch.zeros((heads + 2 * kv_heads) * hd, dtype=bf), ang16.cos(), ang16.sin(), cache,
                            torch.zeros(16, dtype=torch.int64), heads, kv_heads)
    fused.silu_mul(torch.zeros(16, 2 * f, dtype=bf))
    fused.warm_l2(torch.zeros(2 * 136, d, dtype=bf), 5)   # beside the forward: the next weights into L2
    fused.argmax_top2(torch.zeros(2, 151936))
    T, bs = 16, 16
    anc = torch.eye(T, dtype=torch.bool)[None]
    attn = triton_attention.TritonPagedAttention.packed(torch.zeros(1, 4, dtype=torch.int64),
                                                        torch.zeros(1, dtype=torch.int64), pack_ancestor_bits(anc),
                                                        bs, heads // kv_heads)
    attn.nsplit = 2
    attn(torch.zeros(1, T, heads, hd, dtype=bf), cache)
    return found


if __name__ == "__main__":
    print(json.dumps(_compile_launches(int(sys.argv[1]))))
