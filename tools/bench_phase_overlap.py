"""What a kernel boundary costs a weight stream, and whether one persistent kernel with grid barriers does better.

The go/no-go measurement for the megakernel lead of issue 9 (docs/BENCHMARKS.md, "Where issue 9 stands"): at
1 x 64 the verify step streams the weights through ~9 dependent kernels a layer, each paying a ramp and a tail.
This script streams the same bytes (the Qwen2.5-1.5B block matrices, bf16, 28 layers: wqkv, wo, gate/up, down
in that order, optionally with `--gaps` empty phases a layer standing for the norms, RoPE, attention and merge)
in four ways, each captured in a CUDA graph and replayed:

- `one`: a single kernel streams every byte (the ceiling: no boundary at all);
- `kernels`: one kernel per phase, plain launches; `kernels_pdl`: the same with programmatic dependent launch
  (the product's way, pdl.py), and `kernels_pdl_l2` asking L2 for each program's first tile before its wait;
- `persistent`: one kernel of one program per SM, a grid barrier (an arrival counter) after every phase;
  `persistent_pref`: the same, each program loading its first tile of the next weight phase into registers
  before the barrier (what Triton can say; shared-memory staging across the barrier it cannot);
- `dataflow_S` (Gluon, sm_90+): the persistent kernel's phases and barriers, but each program's weight tiles come
  through a ring of S shared-memory slots that a producer warp fills by TMA without waiting for any barrier: the
  weights never depend on the previous phase, so HBM keeps streaming while the consumer warps wait. This is the
  staging the megakernel lead needs, which Triton cannot say and Gluon can.

Every program streams an equal share of a phase (in tiles of BLOCK elements), sums it in float32 and stores the sum
before the phase ends, so a phase's loads are complete at its end as a matmul's would be. The persistent kernel
assumes all its programs are resident at once (one per SM, nothing else running): run it on an idle GPU only.

    python3 tools/bench_phase_overlap.py --gaps 0,5 --out phase_overlap.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from edgespec.verifier.torch.pdl import gdc_enter, prefetch_l2

try:   # Gluon (Triton >= 3.5): explicit shared memory, TMA, mbarriers and warp specialization
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:   # pragma: no cover - an older Triton: the dataflow variants are skipped
    gluon = None

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_verify import captured, cuda_ms, report  # noqa: E402 - the GPU benchmarks' graph timing, output

LAYER = {"wqkv": 2048 * 1536, "wo": 1536 * 1536, "w13": 17920 * 1536, "w2": 1536 * 8960}   # elements


@triton.jit
def _share(n, p, NP):
    """Program p's equal share [lo, hi) of a phase's n elements (64-element, 128-byte aligned bounds), as the
    product's small-rows matmuls give every SM an equal share: no program idles while others finish."""
    lines = n.to(tl.int64) // 64   # (in 64 bits: lines * NP passes 2**31 for the one-phase stream)
    lo = (lines * p // NP) * 64
    hi = tl.where(p == NP - 1, n.to(tl.int64), (lines * (p + 1) // NP) * 64)
    return tl.multiple_of(lo, 64), tl.multiple_of(hi, 64)   # (every n is a multiple of 64: 16-byte vector loads)


@triton.jit
def _stream(W, base, n, p, NP, first, BLOCK: tl.constexpr):
    """Program p's share of phase elements [base, base + n), in tiles of BLOCK from tile `first` on."""
    lo, hi = _share(n, p, NP)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(first, tl.cdiv(hi - lo, BLOCK)):
        idx = lo + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(W + base + idx, mask=idx < hi, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _phase_kernel(W, base, n, Out, slot, BLOCK: tl.constexpr, GDC: tl.constexpr, L2: tl.constexpr):
    p = tl.program_id(0)
    NP = tl.num_programs(0)
    if L2:   # the first tile's 128-byte lines asked of L2 before the wait (the product's PREFETCH_TILES = 1)
        lo, hi = _share(n, p, NP)
        at = lo + tl.arange(0, BLOCK * 2 // 128) * 64
        prefetch_l2(W + base, at, at < hi, GDC)
    gdc_enter(GDC)
    acc = _stream(W, base, n, p, NP, 0, BLOCK)
    tl.store(Out + slot * NP + p, tl.sum(acc))


@triton.jit
def _grid_barrier(Ctr, NP):
    """All NP programs arrive before any leaves; the counter only grows, so graph replays need no reset."""
    tl.debug_barrier()
    arrive = tl.atomic_add(Ctr, 1)
    target = (arrive // NP + 1) * NP
    cur = tl.load(Ctr, volatile=True)
    while cur < target:
        cur = tl.load(Ctr, volatile=True)
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(W, Bases, Sizes, Next, Out, Ctr, n_phases, BLOCK: tl.constexpr, PREF: tl.constexpr):
    p = tl.program_id(0)
    NP = tl.num_programs(0)
    pre = tl.zeros([BLOCK], tl.float32)
    pre_for = tl.load(Next + n_phases - 1)   # -1 (the last phase has no next one), as an int32 value
    for ph in range(0, n_phases):
        base = tl.multiple_of(tl.load(Bases + ph), 64)   # (every phase is whole 64-element lines)
        n = tl.multiple_of(tl.load(Sizes + ph), 64)
        mine = pre_for == ph
        acc = _stream(W, base, n, p, NP, mine.to(tl.int32), BLOCK) + tl.where(mine, pre, 0.0)
        tl.store(Out + ph * NP + p, tl.sum(acc))
        if PREF:   # the next weight phase's first tile into registers, consumed after the barrier(s)
            nxt = tl.load(Next + ph)
            if (nxt >= 0) & (nxt != pre_for):
                nb = tl.multiple_of(tl.load(Bases + nxt), 64)
                nn = tl.multiple_of(tl.load(Sizes + nxt), 64)
                lo, hi = _share(nn, p, NP)
                idx = lo + tl.arange(0, BLOCK)
                pre = tl.load(W + nb + idx, mask=idx < hi, other=0.0).to(tl.float32)
                pre_for = nxt
        _grid_barrier(Ctr, NP)


DF_COLS = 128   # a dataflow tile is DF_ROWS x 128 elements of the weight stream viewed as [elements / 128, 128]

if gluon is not None:
    @gluon.jit
    def _df_share(Tiles, ph, p, NP):
        """Program p's equal share [lo, hi) of phase ph's tiles (whole tiles; shares differ by one at most)."""
        n = gl.load(Tiles + ph)
        return n * p // NP, n * (p + 1) // NP

    @gluon.jit
    def _df_producer(desc, ring, ready, empty, Tiles, Bases, n_phases, p, NP, TR: gl.constexpr, SLOTS: gl.constexpr):
        """One warp: every phase's share of tiles into the ring by TMA, as fast as slots free up; it never waits
        for a phase barrier (weights do not depend on the previous phase's result)."""
        i = 0
        for ph in range(n_phases):
            lo, hi = _df_share(Tiles, ph, p, NP)
            base = gl.load(Bases + ph)
            for t in range(lo, hi):
                s = i % SLOTS
                mbarrier.wait(empty.index(s), ((i // SLOTS) & 1) ^ 1)   # (a fresh barrier passes parity 1)
                mbarrier.expect(ready.index(s), desc.block_type.nbytes)
                tma.async_copy_global_to_shared(desc, [(base + t) * TR, 0], ready.index(s), ring.index(s))
                i += 1

    @gluon.jit
    def _df_consumer(ring, ready, empty, Tiles, Out, Ctr, n_phases, p, NP, TR: gl.constexpr, COLS: gl.constexpr,
                     SLOTS: gl.constexpr):
        """The default warps: per phase, sum the program's tiles from the ring, store the sum, then the grid
        barrier (the persistent kernel's counter) before the next phase."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        i = 0
        for ph in range(n_phases):
            lo, hi = _df_share(Tiles, ph, p, NP)
            acc = gl.zeros([TR, COLS], gl.float32, layout)
            for t in range(lo, hi):
                s = i % SLOTS
                mbarrier.wait(ready.index(s), (i // SLOTS) & 1)
                acc += ring.index(s).load(layout).to(gl.float32)
                mbarrier.arrive(empty.index(s), count=1)
                i += 1
            gl.store(Out + ph * NP + p, gl.sum(gl.sum(acc, 1), 0))
            gl.thread_barrier()
            arrive = gl.atomic_add(Ctr, 1, sem="acq_rel", scope="gpu")
            if ph + 1 < n_phases:   # (the counter only grows: replays need no reset)
                target = (arrive // NP + 1) * NP
                cur = gl.load(Ctr, volatile=True)
                while cur < target:
                    cur = gl.load(Ctr, volatile=True)
            gl.thread_barrier()

    @gluon.jit
    def _dataflow_kernel(desc, Tiles, Bases, Out, Ctr, n_phases, TR: gl.constexpr, COLS: gl.constexpr,
                         SLOTS: gl.constexpr):
        p = gl.program_id(0)
        NP = gl.num_programs(0)
        ring = gl.allocate_shared_memory(desc.dtype, [SLOTS, TR, COLS], desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(SLOTS):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        gl.warp_specialize([
            (_df_consumer, (ring, ready, empty, Tiles, Out, Ctr, n_phases, p, NP, TR, COLS, SLOTS)),
            (_df_producer, (desc, ring, ready, empty, Tiles, Bases, n_phases, p, NP, TR, SLOTS)),
        ], [1], [24])


def dataflow_descriptor(w: torch.Tensor, rows: int):
    """The TMA descriptor of the stream w viewed as [elements / DF_COLS, DF_COLS] in tiles of rows x DF_COLS."""
    view = w[: w.numel() // DF_COLS * DF_COLS].view(-1, DF_COLS)
    layout = gl.NVMMASharedLayout.get_default_for([rows, DF_COLS], gl.bfloat16)
    return TensorDescriptor.from_tensor(view, [rows, DF_COLS], layout)


def phases(layers: int, gaps: int) -> list[tuple[str, int]]:
    """(name, elements) in stream order: each layer's four matrices, `gaps` empty phases after wqkv (RoPE,
    attention, merge) and before gate/up (the norm), split as the step's kernels are."""
    out = []
    for _ in range(layers):
        out.append(("wqkv", LAYER["wqkv"]))
        out += [("gap", 0)] * max(0, gaps - 1)
        out.append(("wo", LAYER["wo"]))
        out += [("gap", 0)] * min(1, gaps)
        out += [("w13", LAYER["w13"]), ("w2", LAYER["w2"])]
    return out


def run(gaps: int, args: argparse.Namespace, w: torch.Tensor, sms: int) -> dict:
    plan = phases(args.layers, gaps)
    sizes = [n for _, n in plan]
    bases = [sum(sizes[:i]) for i in range(len(sizes))]
    nxt, later = [-1] * len(plan), -1
    for i in range(len(plan) - 1, -1, -1):
        nxt[i] = later
        if sizes[i]:
            later = i
    dev = w.device
    t_bases, t_sizes, t_next = (torch.tensor(v, dtype=torch.int32, device=dev) for v in (bases, sizes, nxt))
    out = torch.zeros(len(plan) * sms, dtype=torch.float32, device=dev)
    ctr = torch.zeros(1, dtype=torch.int32, device=dev)
    total = sum(sizes)
    common = {"BLOCK": args.block, "num_warps": args.warps, "num_stages": args.stages}

    def one():
        _phase_kernel[(sms,)](w, 0, total, out, 0, GDC=False, L2=False, **common)

    def kernels(pdl: bool, l2: bool):
        def go():
            for i, (b, n) in enumerate(zip(bases, sizes)):
                extra = {"GDC": 1, "launch_pdl": True} if pdl else {"GDC": False}
                _phase_kernel[(sms,)](w, b, n, out, i, L2=l2 and n > 0, **extra, **common)
        return go

    def persistent(pref: int):
        def go():
            _persistent_kernel[(sms,)](w, t_bases, t_sizes, t_next, out, ctr, len(plan), PREF=pref, **common)
        return go

    df_tile = args.df_rows * DF_COLS   # the dataflow variants' phases in tiles, shared by every ring depth
    t_tiles, t_tbase = (torch.tensor([v // df_tile for v in vals], dtype=torch.int32, device=dev)
                        for vals in (sizes, bases))

    def dataflow(slots: int):
        if any(n % df_tile for n in sizes):
            raise ValueError(f"phases are not whole {args.df_rows} x {DF_COLS} tiles")
        desc = dataflow_descriptor(w, args.df_rows)

        def go():
            _dataflow_kernel[(sms,)](desc, t_tiles, t_tbase, out, ctr, len(plan), TR=args.df_rows, COLS=DF_COLS,
                                     SLOTS=slots, num_warps=4)
        return go

    variants = {"one": one, "kernels": kernels(False, False), "kernels_pdl": kernels(True, False),
                "kernels_pdl_l2": kernels(True, True), "persistent": persistent(0), "persistent_pref": persistent(1)}
    if gluon is not None and torch.cuda.get_device_capability(dev)[0] >= 9:
        variants.update({f"dataflow_{n}": dataflow(n) for n in map(int, args.df_slots.split(","))})
    want = torch.stack([w[b:b + n].double().sum() for b, n in zip(bases, sizes)])
    res = {"gaps": gaps, "phases": len(plan), "bytes": total * w.element_size(), "ms": {}, "sums_ok": {}}
    for name, fn in variants.items():
        if name.startswith(("persistent", "dataflow")) and args.no_persistent:
            continue
        t0 = time.time()
        try:
            res["ms"][name] = cuda_ms(captured([fn]).replay, 3, args.iters)   # median of single replays
            # every byte summed once (the weights are positive: a skipped or doubled tile shows)
            got = out.view(len(plan), sms).double().sum(1)
            got, ref = (got[:1], want.sum()[None]) if name == "one" else (got, want)
            res["sums_ok"][name] = bool(torch.allclose(got, ref, rtol=1e-4, atol=1.0))
        except Exception as exc:  # noqa: BLE001 - report and go on
            res["ms"][name] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"[gaps {gaps}] {name}: {res['ms'][name]} ms, sums ok {res['sums_ok'].get(name)} "
              f"({time.time() - t0:.1f} s)", flush=True)
    res["tb_per_s"] = {k: res["bytes"] / (v * 1e-3) / 1e12 for k, v in res["ms"].items() if isinstance(v, float)}
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--gaps", default="0,5", help="empty phases per layer, comma-separated runs")
    p.add_argument("--block", type=int, default=16384, help="elements a program loads per tile (no cp.async pipelining here: one tile in flight per program)")
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-persistent", action="store_true", help="skip the grid-barrier kernels")
    p.add_argument("--df-rows", type=int, default=32, help="rows of 128 elements in a dataflow tile (one TMA)")
    p.add_argument("--df-slots", default="8,24", help="ring slots of the dataflow variants, comma-separated")
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    total = sum(n for _, n in phases(args.layers, 0))   # the same bytes whatever the gaps
    w = torch.rand(total + args.block, dtype=torch.bfloat16, device=dev)   # positive (the sums check)
    result = {"device": torch.cuda.get_device_name(dev), "sms": sms, "triton": triton.__version__,
              "torch": torch.__version__, "args": vars(args),
              "runs": [run(int(g), args, w, sms) for g in args.gaps.split(",")]}
    report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
