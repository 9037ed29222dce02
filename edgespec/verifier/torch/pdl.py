"""Programmatic dependent launch (PDL, compute capability 9.0 and newer) for the verifier's Triton kernels.

A one-token verify step is ~260 kernels of 2-6 us inside one CUDA graph; much of each is ramp-up
(programs scheduled, first loads in flight) and tail, not bytes moved. With PDL a kernel may start
while the one before it in the stream is still finishing: its programs become resident, ask L2 for
data no earlier kernel writes (weights, prefetch_l2), and then wait (griddepcontrol.wait) until the
previous kernel has finished and its writes are visible. Every kernel here waits before it reads
anything an earlier kernel writes and before it writes anything (so no earlier kernel can read a value
it overwrites), then lets the next kernel launch (griddepcontrol.launch_dependents): one kernel of
lookahead, never a chain of waiting grids (knob TRIGGER can move that launch later: measured slower).
Kernels that are not Triton's (cuBLAS, torch ops) launch as before; a wait behind one of them simply
waits for it to end.

Knob PDL (edgespec.verifier.torch.knobs): the most token rows (B * T of a step) whose kernels launch
with PDL; 0 launches everything as before. On the H200 (2026-12-02, docs/BENCHMARKS.md tenth session)
PDL on every launch made the graph replay 11 % faster at 1 x 1, 5-6 % at 1 x 16 and 8 x 1, but 4 %
slower at 1 x 64, 9 % at 8 x 16 and 17 % at 8 x 64 (why was not profiled): few rows are latency,
which PDL hides, many are not. Hence a row bound: 16 until the twenty-first session re-measured
1 x 64 with the kernels of the time (-2.9 %) and moved it to 64, the most rows the small-rows matmuls
serve. Past them the matmuls are cuBLAS's, and Triton kernels launched with PDL behind them made
8 x 64 22 % slower (measured, not profiled; likely cuBLAS lets the next kernel launch early and its
waiting programs take SMs that the GEMM's later waves need); launched with PDL only behind our own
kernels there (attention after RoPE, its merge), 8 x 64 was still 2.1 % slower. The wait is compiled
in only where PDL is used (GDC), so the CPU interpreter and older GPUs run the same kernels unchanged.
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton never launch these kernels
    triton = None

PDL = 64  # H200, 2026-12-02, replay against PDL = 0 in one process (docs/BENCHMARKS.md tenth session): 1 x 1
          # -11.6 %, 1 x 16 -5.5 %, 8 x 1 -6.2 %, 1 x 64 / 8 x 16 / 8 x 64 (no PDL there) within 1.3 %; the
          # steps bit-identical to plain launches. 64 since the twenty-first session (2026-12-04, replays round-robin
          # against 16): 1 x 64 -2.9 %, the other cells within 0.3 % (up to 64 rows every matmul but wqkv was ours,
          # and wqkv too since the twenty-fourth session; past them they are cuBLAS's, and Triton kernels launched
          # with PDL behind them made 8 x 64 22 % slower)
TRIGGER = 0  # where a kernel launched with PDL lets the next one launch: 0 at its start, right after its wait (the
             # next kernel's programs then sit on SMs, waiting, while this one still has programs to place); 1 once
             # its main loop is done (gdc_release in the matmul and attention kernels; the others at their exit);
             # 2 only at its exit. Where the trigger sits never changes what a kernel computes: the next kernel
             # still waits for this one to finish. On the H200 (2026-12-03, docs/BENCHMARKS.md fourteenth session,
             # replays round-robin) 1 and 2 were slower than 0 wherever PDL is on (1 x 1 +8 / +10 %, 1 x 16 +4 / +7 %)
             # and did not rescue PDL past 16 rows (8 x 64 +20 % with PDL = 512): the early trigger is the gain


@functools.lru_cache(maxsize=None)
def triton_has_pdl() -> bool:
    """This Triton can launch with PDL (3.3+: the gdc instructions and the launch_pdl option); with an
    older one every kernel launches as before."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


_MIN_DRIVER = 12030  # CUDA 12.3: the first driver that captures PDL launches into a CUDA graph


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    """GPU `index` has PDL (compute capability 9.0+), its driver captures it into graphs, and Triton can
    launch with it."""
    driver = getattr(torch._C, "_cuda_getDriverVersion", None)   # a CUDA build of torch has it
    return (triton_has_pdl() and torch.cuda.get_device_capability(index)[0] >= 9
            and (driver is None or driver() >= _MIN_DRIVER))


def launch_args(device: torch.device, rows: int) -> dict[str, int | bool]:
    """Keyword arguments for a Triton launch on `device` serving `rows` token rows: GDC, the kernels'
    constexpr that compiles the wait in, and launch_pdl, Triton's launch option; both on only for
    0 < rows <= PDL on a GPU that has PDL."""
    on = 0 < rows <= PDL and device.type == "cuda" and _supported(device.index or 0)
    return {"GDC": gdc_mode(), "launch_pdl": True} if on else {"GDC": False}


def gdc_mode() -> int:
    """The kernels' GDC constexpr with PDL on: 1 + TRIGGER (1: trigger at the start, 2: at gdc_release,
    3: at exit)."""
    if TRIGGER not in (0, 1, 2):
        raise ValueError(f"pdl.TRIGGER is 0, 1 or 2, not {TRIGGER}")
    return 1 + TRIGGER


def lines(elements: int, weight: torch.Tensor) -> int:
    """How many 128-byte lines `elements` consecutive entries of `weight` span (a power of two for a
    power-of-two count; at least 1): prefetch_l2's LINES for one row of a weight tile."""
    return max(1, elements * weight.element_size() // 128)


if triton is not None:
    @triton.jit
    def gdc_enter(GDC: tl.constexpr):
        """Wait for the previous kernel (its writes visible), then (GDC 1: TRIGGER 0) let the next one launch.
        Called before a kernel's first read of activations, cache or any buffer an earlier kernel writes."""
        if GDC:
            tl.extra.cuda.gdc_wait()
            if GDC == 1:
                tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def gdc_release(GDC: tl.constexpr):
        """With TRIGGER 1 (GDC 2), let the next kernel launch: called where a kernel's main loop is done and
        only its epilogue is left."""
        if GDC == 2:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(Base, offsets, mask, GDC: tl.constexpr):
        """Ask L2 for the 128-byte lines at Base + offsets (one offset per line; masked-off ones ask for
        Base's): issued before gdc_enter for data no earlier kernel writes (weights), so those bytes come
        from HBM while the previous kernel finishes and the loads after the wait hit L2."""
        if GDC:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [Base + tl.where(mask, offsets, 0)],
                                      dtype=tl.int32, is_pure=False, pack=1)
