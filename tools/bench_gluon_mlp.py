"""A persistent Gluon kernel (sm_90) for the MLP block at <= 64 token rows, against what the verify step runs
there now (fused.linear_silu, then fused.linear_rows_partials for down): checks, then timings. Not adopted: in the
twenty-third session (docs/BENCHMARKS.md) it was correct but 16-19 % slower than the step's two kernels; it stays
here, with its checks, as the first working piece of the megakernel lead of issue 9.

The kernel: at 1 x 64 the verify step streams each layer's weights through separate kernels, and every kernel
boundary costs the weight stream a ramp and a tail. The weights never depend on the step's data, so nothing forces
HBM to idle at a boundary: one warp of every program (the producer) streams its share of both matrices into shared
memory by TMA, waiting only for free slots, while a warpgroup (the consumer) waits only for the activations it
needs. Each program runs a list of tiles (`schedule`, balanced by bytes on the host):
- A tile a: SiLU*up of A_COLS (or A_TAIL) output columns of gate/up: x [rows, H] @ gate/up rows -> act[:, cols]
  (bf16, a scratch tensor), then a flag set to this launch's epoch;
- B tile (n, s): b_cols output columns of down over K slice s of the F activations: act[:, slice] @ w2 rows ->
  float32 partials [F / k_slice, rows, H], which add_rmsnorm sums (as it sums linear_rows_partials').
Every program runs its A tiles before its B tiles; a B tile first waits for the flags of the A tiles that wrote
its slice (a spin on global memory), then reads act by cp.async (the generic proxy the A tiles wrote it through).
Rows past `rows` are zero (TMA fills them; cp.async masks them). All programs must be resident at once (one per
SM: the shared memory takes most of an SM), or a waiting B tile could starve an A tile. Flags and epochs persist
between launches (and graph replays): each program bumps its own epoch on entry, so flags from an earlier launch
are always older than the current one.

Checks, at each row count: the kernel's partials summed against the float32 reference (`mlp_partials_torch`) and
against the product's path, two launches bit-identical, and the SiLU*up activations against fused.linear_silu's.
Timings: `--layers` MLPs of distinct random weights (the Qwen2.5-1.5B shape, bf16) back to back in one CUDA graph
per variant, graphs replayed round-robin; the floor is their weight bytes at the copy rate measured in the run.
tests/test_gluon_kernels.py compiles the kernel for sm_90 on the CPU.

    PYTHONPATH=. python3 tools/bench_gluon_mlp.py --rows 16,64 --configs 128x640b4h4,64x896b8h3 --out gluon_mlp.json
"""
from __future__ import annotations

import argparse
import heapq
import sys
import time
from pathlib import Path

import torch
import triton

from edgespec.verifier.torch import fused

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - a Triton without Gluon
    gluon = None

A_COLS = 64       # output columns of gate/up an A tile owns (wgmma N), one such tile a program at most ...
A_TAIL = 32       # ... and tiles this wide for the columns left over (TMA boxes are powers of two)
BLOCK_K = 64      # K per TMA tile and per wgmma (128 bytes of bf16: one swizzled row)
ROWS = 64         # the wgmma's M: token rows, padded
SLOTS_A = 5       # ring slots of gate, up and x tiles (24 KB each)
# The B tiles' default shape and rings: the best of five on the H200 (2026-12-04, twenty-third session): 128
# output columns of down over 640 of K (14 partials), 4 weight slots of 16 KB, 4 activation tiles in flight
B_COLS = 128
K_SLICE = 640
SLOTS_B = 4
SLOTS_H = 4


def mlp_partials_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, k_slice: int = K_SLICE
                       ) -> torch.Tensor:
    """The reference: float32 partials [F / k_slice, rows, H] of silu_mul(x @ w13.T) @ w2.T, one per K slice
    of down (gate/up rounded to x's dtype, SiLU*up rounded once, as fused.linear_silu)."""
    act = fused.linear_silu_torch(x, w13).float()
    f = act.shape[1]
    return torch.stack([act[:, s:s + k_slice] @ w2[:, s:s + k_slice].float().t() for s in range(0, f, k_slice)])


def a_tiles(f: int, programs: int, tail: int = A_TAIL) -> tuple[int, int]:
    """(wide, tail): A tiles of A_COLS columns, at most one a program, then A_TAIL-column tiles for the rest of
    the F columns (TMA boxes and wgmma widths are powers of two; 8960 = 132 x 64 + 16 x 32 on an H200)."""
    wide = min(f // A_COLS, programs)
    rest = f - wide * A_COLS
    if rest % tail:
        raise ValueError(f"GluonMLP: F = {f} is not {wide} x {A_COLS} + a multiple of {tail}")
    return wide, rest // tail


def schedule(a_bytes: list[int], n_b_cols: int, n_slices: int, b_bytes: int, programs: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles per program, A tiles before B tiles: ([programs, most] int32 tile ids, [programs] counts). Each
    tile goes to the program with the fewest bytes so far (A tiles in id order, then B tiles slice by slice,
    so the slices whose A tiles end last are read last). A tile ids 0.., B tile (n, s) len(a_bytes) + s *
    n_b_cols + n."""
    tiles: list[list[int]] = [[] for _ in range(programs)]
    heap = [(0, p) for p in range(programs)]
    n_a = len(a_bytes)
    jobs = [(a, a_bytes[a]) for a in range(n_a)]
    jobs += [(n_a + s * n_b_cols + n, b_bytes) for s in range(n_slices) for n in range(n_b_cols)]
    for tile, size in jobs:
        load, p = heapq.heappop(heap)
        tiles[p].append(tile)
        heapq.heappush(heap, (load + size, p))
    return tile_table(tiles)


def tile_table(tiles: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-program tile lists as the kernel reads them: ([programs, most] int32 ids, -1 padded; [programs] counts)."""
    table = torch.full((len(tiles), max(1, max(map(len, tiles)))), -1, dtype=torch.int32)
    for p, t in enumerate(tiles):
        table[p, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return table, torch.tensor([len(t) for t in tiles], dtype=torch.int32)


if gluon is not None:
    @gluon.jit
    def _produce_a(gate_d, up_d, x_d, ring_a, ring_x, ready_a, empty_a, ia, col, AC: gl.constexpr,
                   K_TILES_A: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS_A: gl.constexpr):
        """An A tile's gate, up and x tiles (AC columns from `col`), one ring slot per K step; returns the count."""
        for k in range(K_TILES_A):
            s = ia % SLOTS_A
            mbarrier.wait(empty_a.index(s), ((ia // SLOTS_A) & 1) ^ 1)   # (a fresh barrier passes parity 1)
            bar = ready_a.index(s)
            mbarrier.expect(bar, 2 * gate_d.block_type.nbytes + x_d.block_type.nbytes)
            tma.async_copy_global_to_shared(gate_d, [col, k * BLOCK_K], bar, ring_a.index(2 * s).slice(0, AC))
            tma.async_copy_global_to_shared(up_d, [col, k * BLOCK_K], bar, ring_a.index(2 * s + 1).slice(0, AC))
            tma.async_copy_global_to_shared(x_d, [0, k * BLOCK_K], bar, ring_x.index(s))
            ia += 1
        return ia

    @gluon.jit
    def _producer(gate_d, up_d, gate_tail_d, up_tail_d, x_d, w2_d, ring_a, ring_x, ready_a, empty_a, ring_b,
                  ready_b, empty_b, Sched, Count, p, N_A: gl.constexpr, N_WIDE: gl.constexpr, N_BC: gl.constexpr,
                  K_TILES_A: gl.constexpr, K_TILES_B: gl.constexpr, A_COLS: gl.constexpr, A_TAIL: gl.constexpr,
                  B_COLS: gl.constexpr, BLOCK_K: gl.constexpr, K_SLICE: gl.constexpr, SLOTS_A: gl.constexpr,
                  SLOTS_B: gl.constexpr, MOST: gl.constexpr):
        """One warp: the program's weight tiles (and x's, which the previous kernel wrote) into the rings, in
        tile order, waiting only for free slots."""
        ia = 0
        ib = 0
        for j in range(gl.load(Count + p)):
            tile = gl.load(Sched + p * MOST + j)
            if tile < N_WIDE:
                ia = _produce_a(gate_d, up_d, x_d, ring_a, ring_x, ready_a, empty_a, ia, tile * A_COLS, A_COLS,
                                K_TILES_A, BLOCK_K, SLOTS_A)
            elif tile < N_A:
                ia = _produce_a(gate_tail_d, up_tail_d, x_d, ring_a, ring_x, ready_a, empty_a, ia,
                                N_WIDE * A_COLS + (tile - N_WIDE) * A_TAIL, A_TAIL, K_TILES_A, BLOCK_K, SLOTS_A)
            else:
                sl = (tile - N_A) // N_BC
                n = (tile - N_A) % N_BC
                for k in range(K_TILES_B):
                    s = ib % SLOTS_B
                    mbarrier.wait(empty_b.index(s), ((ib // SLOTS_B) & 1) ^ 1)
                    mbarrier.expect(ready_b.index(s), w2_d.block_type.nbytes)
                    tma.async_copy_global_to_shared(w2_d, [n * B_COLS, sl * K_SLICE + k * BLOCK_K], ready_b.index(s),
                                                    ring_b.index(s))
                    ib += 1

    @gluon.jit
    def _consume_a(ring_a, ring_x, ready_a, empty_a, Act, Flags, ia, tile, col, rows, epoch, AC: gl.constexpr,
                   K_TILES_A: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr, SLOTS_A: gl.constexpr):
        """An A tile: gate and up over K, SiLU*up into Act[:, col : col + AC], then its flag; returns the count."""
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, AC, 16])
        g = gl.zeros([ROWS, AC], gl.float32, acc_l)
        u = gl.zeros([ROWS, AC], gl.float32, acc_l)
        prev = 0
        for k in range(K_TILES_A):   # each step's two wgmmas run while the next step waits for its tiles
            s = ia % SLOTS_A
            mbarrier.wait(ready_a.index(s), (ia // SLOTS_A) & 1)
            xs = ring_x.index(s)
            g = warpgroup_mma(xs, ring_a.index(2 * s).slice(0, AC).permute((1, 0)), g, is_async=True)
            u = warpgroup_mma(xs, ring_a.index(2 * s + 1).slice(0, AC).permute((1, 0)), u, is_async=True)
            g, u = warpgroup_mma_wait(num_outstanding=2, deps=(g, u))   # the previous step's pair is done ...
            mbarrier.arrive(empty_a.index(prev), count=1, pred=k > 0)    # ... so its slot is free
            prev = s
            ia += 1
        g, u = warpgroup_mma_wait(num_outstanding=0, deps=(g, u))
        mbarrier.arrive(empty_a.index(prev), count=1)
        # SiLU*up of gate/up rounded to bf16 first (fused._silu_times' formula), rounded once more
        gf = g.to(gl.bfloat16).to(gl.float32)
        y = gf / (1.0 + gl.exp(-gf)) * u.to(gl.bfloat16).to(gl.float32)
        r = gl.arange(0, ROWS, gl.SliceLayout(1, acc_l))
        c = col + gl.arange(0, AC, gl.SliceLayout(0, acc_l))
        gl.store(Act + r[:, None] * F + c[None, :], y.to(gl.bfloat16), mask=(r < rows)[:, None] & (c < F)[None, :])
        gl.thread_barrier()   # every warp's stores before the flag (released at GPU scope)
        gl.atomic_xchg(Flags + tile, epoch, sem="release", scope="gpu")
        return ia

    @gluon.jit
    def _consumer(ring_a, ring_x, ready_a, empty_a, ring_b, ready_b, empty_b, h_ring, Act, Out, Flags, Epoch, Sched,
                  Count, p, rows, N_A: gl.constexpr, N_WIDE: gl.constexpr, N_BC: gl.constexpr,
                  K_TILES_A: gl.constexpr, K_TILES_B: gl.constexpr, A_COLS: gl.constexpr, A_TAIL: gl.constexpr,
                  B_COLS: gl.constexpr, BLOCK_K: gl.constexpr, K_SLICE: gl.constexpr, F: gl.constexpr,
                  H: gl.constexpr, ROWS: gl.constexpr, SLOTS_A: gl.constexpr, SLOTS_B: gl.constexpr,
                  SLOTS_H: gl.constexpr, MOST: gl.constexpr, FLAGS_P: gl.constexpr, WAIT: gl.constexpr):
        """One warpgroup: the tiles' wgmmas and epilogues; the only waits on other programs are a B tile's
        flags."""
        acc_b: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, B_COLS, 16])
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])   # a [64, 64] bf16 tile, 16-byte pieces
        flag_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        epoch = gl.load(Epoch + p) + 1
        gl.store(Epoch + p, epoch)
        wide_cols: gl.constexpr = N_WIDE * A_COLS
        ia = 0
        ib = 0
        for j in range(gl.load(Count + p)):
            tile = gl.load(Sched + p * MOST + j)
            if tile < N_WIDE:
                ia = _consume_a(ring_a, ring_x, ready_a, empty_a, Act, Flags, ia, tile, tile * A_COLS, rows, epoch,
                                A_COLS, K_TILES_A, F, ROWS, SLOTS_A)
            elif tile < N_A:
                ia = _consume_a(ring_a, ring_x, ready_a, empty_a, Act, Flags, ia, tile,
                                wide_cols + (tile - N_WIDE) * A_TAIL, rows, epoch, A_TAIL, K_TILES_A, F, ROWS,
                                SLOTS_A)
            else:
                sl = (tile - N_A) // N_BC
                n = (tile - N_A) % N_BC
                k0 = sl * K_SLICE
                k1 = k0 + K_SLICE - 1
                a_lo = gl.where(k0 < wide_cols, k0 // A_COLS, N_WIDE + (k0 - wide_cols) // A_TAIL)
                a_hi = gl.where(k1 < wide_cols, k1 // A_COLS, N_WIDE + (k1 - wide_cols) // A_TAIL)
                # the A tiles that wrote the slice, all polled at once: one flag at a time cost an L2 round trip
                # each (~1 us) even when every flag was already set
                fa = a_lo + gl.arange(0, FLAGS_P, flag_l)
                f_ok = fa <= a_hi
                zero = gl.zeros([FLAGS_P], gl.int32, flag_l)
                if WAIT:
                    seen = gl.atomic_add(Flags + fa, zero, mask=f_ok, sem="acquire", scope="gpu")
                    while gl.min(gl.where(f_ok, seen, epoch), 0) < epoch:
                        seen = gl.atomic_add(Flags + fa, zero, mask=f_ok, sem="acquire", scope="gpu")
                r = gl.arange(0, ROWS, gl.SliceLayout(1, ld))
                cc = gl.max_contiguous(gl.multiple_of(gl.arange(0, BLOCK_K, gl.SliceLayout(0, ld)), BLOCK_K), BLOCK_K)
                h_ptr = Act + r[:, None] * F + (k0 + cc)[None, :]
                h_ok = (r < rows)[:, None] & (cc < BLOCK_K)[None, :]
                for k in gl.static_range(SLOTS_H - 1):   # the first activation tiles in flight
                    async_copy.async_copy_global_to_shared(h_ring.index(k), h_ptr + k * BLOCK_K, h_ok,
                                                           cache_modifier=".cg")
                    async_copy.commit_group()
                acc = gl.zeros([ROWS, B_COLS], gl.float32, acc_b)
                prev = 0
                for k in range(K_TILES_B):
                    async_copy.wait_group(SLOTS_H - 2)   # tile k has landed (this thread's copies)
                    gl.thread_barrier()                  # ... and every thread's
                    fence_async_shared()                 # generic-proxy writes before the wgmma's async reads
                    s = ib % SLOTS_B
                    mbarrier.wait(ready_b.index(s), (ib // SLOTS_B) & 1)
                    acc = warpgroup_mma(h_ring.index(k % SLOTS_H), ring_b.index(s).permute((1, 0)), acc,
                                        is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))   # step k - 1's wgmma is done ...
                    mbarrier.arrive(empty_b.index(prev), count=1, pred=k > 0)   # ... its weight slot is free
                    prev = s
                    ib += 1
                    gl.thread_barrier()                  # ... and, in every warp, its activation slot (k - 1)
                    nxt = k + SLOTS_H - 1
                    async_copy.async_copy_global_to_shared(h_ring.index(nxt % SLOTS_H), h_ptr + nxt * BLOCK_K,
                                                           h_ok & (nxt < K_TILES_B), cache_modifier=".cg")
                    async_copy.commit_group()
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty_b.index(prev), count=1)
                async_copy.wait_group(0)
                gl.thread_barrier()
                ro = gl.arange(0, ROWS, gl.SliceLayout(1, acc_b))
                co = n * B_COLS + gl.arange(0, B_COLS, gl.SliceLayout(0, acc_b))
                gl.store(Out + (sl * rows + ro[:, None]) * H + co[None, :], acc, mask=(ro < rows)[:, None])

    @gluon.jit
    def _mlp_kernel(gate_d, up_d, gate_tail_d, up_tail_d, x_d, w2_d, Act, Out, Flags, Epoch, Sched, Count, rows,
                    N_A: gl.constexpr, N_WIDE: gl.constexpr, N_BC: gl.constexpr, K_TILES_A: gl.constexpr,
                    K_TILES_B: gl.constexpr, A_COLS: gl.constexpr, A_TAIL: gl.constexpr, B_COLS: gl.constexpr,
                    BLOCK_K: gl.constexpr, K_SLICE: gl.constexpr, F: gl.constexpr, H: gl.constexpr,
                    ROWS: gl.constexpr, SLOTS_A: gl.constexpr, SLOTS_B: gl.constexpr, SLOTS_H: gl.constexpr,
                    MOST: gl.constexpr, FLAGS_P: gl.constexpr, WAIT: gl.constexpr):
        p = gl.program_id(0)
        ring_a = gl.allocate_shared_memory(gl.bfloat16, [2 * SLOTS_A, A_COLS, BLOCK_K], gate_d.layout)  # gate 2s, up 2s+1
        ring_x = gl.allocate_shared_memory(gl.bfloat16, [SLOTS_A, ROWS, BLOCK_K], x_d.layout)
        ring_b = gl.allocate_shared_memory(gl.bfloat16, [SLOTS_B, B_COLS, BLOCK_K], w2_d.layout)
        h_ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS_H, ROWS, BLOCK_K], x_d.layout)
        ready_a = gl.allocate_shared_memory(gl.int64, [SLOTS_A, 1], mbarrier.MBarrierLayout())
        empty_a = gl.allocate_shared_memory(gl.int64, [SLOTS_A, 1], mbarrier.MBarrierLayout())
        ready_b = gl.allocate_shared_memory(gl.int64, [SLOTS_B, 1], mbarrier.MBarrierLayout())
        empty_b = gl.allocate_shared_memory(gl.int64, [SLOTS_B, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(SLOTS_A):
            mbarrier.init(ready_a.index(s), count=1)
            mbarrier.init(empty_a.index(s), count=1)
        for s in gl.static_range(SLOTS_B):
            mbarrier.init(ready_b.index(s), count=1)
            mbarrier.init(empty_b.index(s), count=1)
        gl.warp_specialize([
            (_consumer, (ring_a, ring_x, ready_a, empty_a, ring_b, ready_b, empty_b, h_ring, Act, Out, Flags, Epoch,
                         Sched, Count, p, rows, N_A, N_WIDE, N_BC, K_TILES_A, K_TILES_B, A_COLS, A_TAIL, B_COLS,
                         BLOCK_K, K_SLICE, F, H, ROWS, SLOTS_A, SLOTS_B, SLOTS_H, MOST, FLAGS_P, WAIT)),
            (_producer, (gate_d, up_d, gate_tail_d, up_tail_d, x_d, w2_d, ring_a, ring_x, ready_a, empty_a, ring_b,
                         ready_b, empty_b, Sched, Count, p, N_A, N_WIDE, N_BC, K_TILES_A, K_TILES_B, A_COLS, A_TAIL,
                         B_COLS, BLOCK_K, K_SLICE, SLOTS_A, SLOTS_B, MOST)),
        ], [1], [40])


class GluonMLP:
    """One layer's MLP for x [rows <= 64, H] bf16 as float32 partials [F / k_slice, rows, H] (add_rmsnorm's
    residual input). Descriptors, the schedule and the flags are built once per weight pair. b_cols, k_slice
    and the ring depths are the B tiles' shape (benchmarks sweep them; shared memory must stay <= 227 KB)."""

    _state: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}   # (flags, epochs) per device

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, programs: int | None = None, *, b_cols: int = B_COLS,
                 k_slice: int = K_SLICE, slots_b: int = SLOTS_B, slots_h: int = SLOTS_H, wait: bool = True,
                 only: str = "", a_tail: int = A_TAIL, slots_a: int = SLOTS_A) -> None:
        if gluon is None:
            raise RuntimeError("GluonMLP needs Triton with Gluon (>= 3.5)")
        two_f, h = w13.shape
        f = two_f // 2
        if w2.shape != (h, f) or w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16 \
                or f % k_slice or k_slice % BLOCK_K or h % b_cols or h % BLOCK_K:
            raise ValueError(f"GluonMLP: w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} (bf16, F a multiple of "
                             f"{k_slice}, H of {b_cols})")
        self.f, self.h = f, h
        self.b_cols, self.k_slice, self.slots_b, self.slots_h = b_cols, k_slice, slots_b, slots_h
        self.wait = wait and only != "b"   # False: B tiles skip their flags (wrong results; timing only)
        dev = w13.device
        self.programs = programs or fused._sms(dev)
        self.x_layout = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_K], gl.bfloat16)
        wide_l = gl.NVMMASharedLayout.get_default_for([A_COLS, BLOCK_K], gl.bfloat16)
        self.a_tail, self.slots_a = a_tail, slots_a
        tail_l = gl.NVMMASharedLayout.get_default_for([a_tail, BLOCK_K], gl.bfloat16)
        desc = TensorDescriptor.from_tensor
        self.descs = (desc(w13[:f], [A_COLS, BLOCK_K], wide_l), desc(w13[f:], [A_COLS, BLOCK_K], wide_l),
                      desc(w13[:f], [a_tail, BLOCK_K], tail_l), desc(w13[f:], [a_tail, BLOCK_K], tail_l))
        self.w2_d = desc(w2, [b_cols, BLOCK_K], gl.NVMMASharedLayout.get_default_for([b_cols, BLOCK_K], gl.bfloat16))
        self.n_wide, n_tail = a_tiles(f, self.programs, a_tail)
        self.n_a = self.n_wide + n_tail
        self.n_bc = h // b_cols
        self.slices = f // k_slice
        sched, count = schedule([4 * A_COLS * h] * self.n_wide + [4 * a_tail * h] * n_tail, self.n_bc, self.slices,
                                2 * b_cols * k_slice, self.programs)
        if only:   # the benchmark's timing of one phase alone: the other phase's tiles left out of every list
            sched, count = tile_table([[t for t in sched[p, :count[p]].tolist() if (t < self.n_a) == (only == "a")]
                                       for p in range(self.programs)])
        self.sched, self.count = sched.to(dev), count.to(dev)
        if dev not in self._state:
            self._state[dev] = (torch.zeros(4096, dtype=torch.int32, device=dev),
                                torch.zeros(self.programs, dtype=torch.int32, device=dev))
        self.flags, self.epochs = self._state[dev]
        if self.n_a > self.flags.numel() or self.programs > self.epochs.numel():
            raise ValueError(f"GluonMLP: {self.n_a} A tiles and {self.programs} programs, state for "
                             f"{self.flags.numel()} and {self.epochs.numel()}")

    def constexprs(self) -> dict[str, int]:
        """The kernel's compile-time arguments."""
        return dict(N_A=self.n_a, N_WIDE=self.n_wide, N_BC=self.n_bc, K_TILES_A=self.h // BLOCK_K,
                    K_TILES_B=self.k_slice // BLOCK_K, A_COLS=A_COLS, A_TAIL=self.a_tail, B_COLS=self.b_cols,
                    BLOCK_K=BLOCK_K, K_SLICE=self.k_slice, F=self.f, H=self.h, ROWS=ROWS, SLOTS_A=self.slots_a,
                    SLOTS_B=self.slots_b, SLOTS_H=self.slots_h, MOST=self.sched.shape[1],
                    FLAGS_P=max(32, triton.next_power_of_2(self.k_slice // self.a_tail + 2)),   # a slice's A tiles
                    WAIT=self.wait)

    def arguments(self, x: torch.Tensor) -> tuple[tuple, torch.Tensor]:
        """(the kernel's runtime arguments, the partials they fill) for x."""
        rows = x.shape[0]
        if not 0 < rows <= ROWS or x.shape[1] != self.h or not x.is_contiguous():
            raise ValueError(f"GluonMLP: x {tuple(x.shape)}: 1..{ROWS} contiguous rows of {self.h}")
        x_d = TensorDescriptor.from_tensor(x, [ROWS, BLOCK_K], self.x_layout)
        act = torch.empty(rows, self.f, dtype=x.dtype, device=x.device)
        out = torch.empty(self.slices, rows, self.h, dtype=torch.float32, device=x.device)
        return (*self.descs, x_d, self.w2_d, act, out, self.flags, self.epochs, self.sched, self.count, rows), out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        args, out = self.arguments(x)
        _mlp_kernel[(self.programs,)](*args, **self.constexprs(), num_warps=4)
        return out


# -- the benchmark ---------------------------------------------------------------------------------------
def product(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The step's MLP at <= 64 rows today: gate/up with SiLU*up in its epilogue, then down's partials."""
    return fused.linear_rows_partials(fused.linear_silu(x, w13), w2)


def checks(rows: int, w13: torch.Tensor, w2: torch.Tensor, mlp: GluonMLP) -> dict:
    x = (torch.randn(rows, w13.shape[1], device=w13.device) * 0.5).to(torch.bfloat16)
    ref = mlp_partials_torch(x, w13, w2).sum(0)
    args, first = mlp.arguments(x)   # launched by hand to read its SiLU*up scratch (act) afterwards
    act = args[6]
    _mlp_kernel[(mlp.programs,)](*args, **mlp.constexprs(), num_warps=4)
    torch.cuda.synchronize()
    second = mlp(x)
    torch.cuda.synchronize()
    ours = first.sum(0)
    theirs = product(x, w13, w2).sum(0)
    scale = ref.abs().max().item()
    return {"rows": rows, "partials": first.shape[0],
            "rel_err_vs_reference": (ours - ref).abs().max().item() / scale,
            "rel_err_product_vs_reference": (theirs - ref).abs().max().item() / scale,
            "repeat_identical": bool(torch.equal(first, second)),
            "act_max_diff_vs_linear_silu": (act.float() - fused.linear_silu(x, w13).float()).abs().max().item()}


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gpu_verify import captured, interleaved_ms, report   # the GPU benchmarks' graph timing, output

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="16,64")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--configs", default=f"{B_COLS}x{K_SLICE}b{SLOTS_B}h{SLOTS_H}",
                   help="configs, comma-separated: B_COLSxK_SLICEbSLOTS_BhSLOTS_H[tA_TAIL][aSLOTS_A][!nowait|!a|!b] "
                        "(the first is checked; !nowait: B tiles skip their flags; !a, !b: one phase's tiles alone; "
                        "timing only)")
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    f, h = 8960, 1536
    weights = [((torch.randn(2 * f, h, device=dev) * 0.02).to(torch.bfloat16),
                (torch.randn(h, f, device=dev) * 0.02).to(torch.bfloat16)) for _ in range(args.layers)]
    configs = {}
    for c in args.configs.split(","):
        shape, _, flag = c.partition("!")
        shape, _, slots_a = shape.partition("a")
        shape, _, a_tail = shape.partition("t")
        b_cols, rest = shape.split("x")
        k_slice, rest = rest.split("b")
        slots_b, slots_h = rest.split("h")
        configs[c] = [GluonMLP(a, b, b_cols=int(b_cols), k_slice=int(k_slice), slots_b=int(slots_b),
                               slots_h=int(slots_h), wait=flag != "nowait", only=flag if flag in ("a", "b") else "",
                               a_tail=int(a_tail or A_TAIL), slots_a=int(slots_a or SLOTS_A))
                      for a, b in weights]
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
        act = fused.linear_silu(x, weights[0][0])
        graphs = {"product": captured([lambda a=a, b=b: product(x, a, b) for a, b in weights]),
                  "product gate/up": captured([lambda a=a: fused.linear_silu(x, a) for a, _ in weights]),
                  "product down": captured([lambda b=b: fused.linear_rows_partials(act, b) for _, b in weights])}
        for name, ms_ in configs.items():
            graphs[f"gluon {name}"] = captured([lambda m=m: m(x) for m in ms_])
        ms = interleaved_ms([g.replay for g in graphs.values()], 3, args.iters)
        floor = w_bytes / (res["copy_tb_s"] * 1e12) * 1e3
        res["ms"][str(rows)] = {**dict(zip(graphs, ms)), "floor": floor}
        print(f"rows {rows}: " + ", ".join(f"{k} {v:.4f} ms ({w_bytes / (v * 1e-3) / 1e12:.2f} TB/s)"
                                           for k, v in zip(graphs, ms)) + f"; floor {floor:.4f}", flush=True)
    report(res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
