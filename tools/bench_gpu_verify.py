#!/usr/bin/env python3
"""One GPU run for the torch verifier: checks, the tree-attention kernel against SDPA, the verify
step of the engine the service uses, and HF transformers measured side by side in the same run.

    python tools/bench_gpu_verify.py --out results.json            # everything, on a CUDA GPU
    python tools/bench_gpu_verify.py --device cpu --small          # smoke test of the script

Sections (each prints a table; everything goes to --out as JSON):
1. ceilings: device-to-device copy bandwidth and a bf16 matrix product, measured here;
2. checks: the Triton kernel against the torch reference (bf16, relative error) and the engine's
   device decisions with CUDA graphs against accept_greedy on eager logits (tiny float32 model);
   compaction between graph steps; fused.GEMV_ROPE against the separate RoPE launch, tree_ops.move_rows
   against index_copy_, the kernel with TREE_SPLIT=1 against float64, steps with programmatic
   dependent launch (pdl.PDL) against plain launches, bit for bit (--checks);
3. attention: tree of 64 nodes, 64 query / 8 KV heads, d 128, bf16, paged (block 16): the Triton
   kernel, the torch reference (gather + masked SDPA), and SDPA with no mask over contiguous K/V
   (flash, cuDNN: less work than a tree kernel must do), against the roofline floor. Kernels are
   timed back to back in a CUDA graph (kernel_ms: the verify step runs them so); the Triton default
   and the SDPA kernels also one eager call at a time (`*_percall_ms`, the method before 2026-12-02);
4. step: `Engine.verify` (the call TorchBackend.verify_many makes) for B sessions x T tree nodes at
   a fixed context, random weights of the Qwen2.5-Coder-1.5B shape: host packing, one H2D copy,
   the forward + acceptance + compaction replayed as a CUDA graph, one small D2H copy, lengths
   updated. `step_ms` is host wall time per call (what a request pays), each step's tree blocks
   reserved beforehand as a previous step's trim leaves them in serving (`step_allocating_ms`: each
   step allocating them, as every step_ms before 2026-12-04 was timed); `replay_ms` the graph alone
   (CUDA events). The same cells with HF transformers (Qwen2ForCausalLM, sdpa, DynamicCache:
   forward of T tokens + argmax to the host + crop back), measured in this run.
   With --small-rows-matmul off,on the step cells run with cuBLAS and with fused.linear_rows for
   the block matmuls (B*T <= 64), side by side.
5. capacity: 1, 8, 32 concurrent sessions through the service's batch worker, trees of T nodes
   against T = 1 (cloud-only AR): requests/s, mean batch, latency (bench_capacity's docstring).
6. matmuls: the four block matrices of the 1.5B shape (wqkv, wo, w13, w2) at 1/16/64 rows,
   cuBLAS (F.linear) against fused.linear_rows in the form the forward uses it, each call in a CUDA
   graph over rotating weight copies (none stays in L2), against the byte floor; bf16 error of
   both against float32; 512 rows with cuBLAS only; wo and w2 also on cuBLAS in K slices (fused.linear_split_k,
   --matmul-split-k). --matmul-sweep times candidate block configs too
   and (--matmul-pick) puts the fastest into fused.LINEAR_ROWS_TABLE for the step section.
   --top2-configs times fused.argmax_top2's chunk configs (BLOCKwWARPS) at --top2-rows rows.
7. mixed: a prompt chunk of T tokens riding in a step of B trees of T nodes (what the service does
   with a Sync that arrives while trees are verified) against the step and a separate chunk.
Medians over --iters after --warmup. Weights are random: timings only.
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from edgespec.common.acceptance import accept_greedy  # noqa: E402
from edgespec.common.tree import TokenTree  # noqa: E402
from edgespec.verifier.torch import knobs as kernel_knobs  # noqa: E402
from edgespec.verifier.torch.engine import Engine, TreeStep, bucket  # noqa: E402
from edgespec.verifier.torch.model import ModelConfig, TransformerLM  # noqa: E402
from edgespec.verifier.torch.tree_attention import TorchPagedAttention, ancestor_mask  # noqa: E402


def log(*args) -> None:
    print(*args, flush=True)


def attention_knobs(**values: int) -> contextlib.AbstractContextManager:
    """Kernel knobs set for the body, then put back (edgespec.verifier.torch.knobs.override): the
    attention kernel's (BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES, TARGET_PROGRAMS, TREE_SPLIT, ...),
    fused.py's (GEMV_ROPE, ...) or tree_ops.py's (MOVE_ROWS_KERNEL)."""
    return kernel_knobs.override(values)


@contextlib.contextmanager
def matmul_table(spec: str):
    """A variant's "%NxKrROWS=C.BK.S.W.ST+..." part: fused.LINEAR_ROWS_TABLE entries set for the body (the
    graphs captured inside keep the configs), then put back. Each entry goes into the [N x K] weight's list in
    row-bound order, replacing one with the same bound, so it serves the row counts above the next smaller bound
    up to ROWS; "=cublas" sets None (F.linear)."""
    from edgespec.verifier.torch import fused

    before = {k: list(v) for k, v in fused.LINEAR_ROWS_TABLE.items()}
    try:
        for item in filter(None, spec.split("+")):
            shape, rows, cfg = re.fullmatch(r"(\d+x\d+)r(\d+)=([\d.]+|cublas)", item).groups()
            n, k = (int(v) for v in shape.split("x"))
            entry = None if cfg == "cublas" else tuple(int(v) for v in cfg.split("."))
            old = [e for e in fused.LINEAR_ROWS_TABLE.get((n, k), []) if e[0] != int(rows)]
            fused.LINEAR_ROWS_TABLE[(n, k)] = sorted(old + [(int(rows), entry)], key=lambda e: e[0])
        yield
    finally:
        fused.LINEAR_ROWS_TABLE.clear()
        fused.LINEAR_ROWS_TABLE.update(before)


def knob_values(spec: str) -> dict[str, int]:
    """A variant's "KNOB=V:KNOB=V" suffix (after "!") as {knob: value}; "" -> {}."""
    return kernel_knobs.parse(spec)


def replayed_graph(engine: Engine, B: int, T: int):  # noqa: ANN201 - a torch.cuda.CUDAGraph
    """The CUDA graph the engine captured for B sequences x T tree nodes (the first of its modes)."""
    st = next(v for k, v in engine._static.items() if k[:2] == (bucket(B), bucket(T)))
    return next(iter(st.graph.values()))[0]


def random_parents(n: int, rng: np.random.Generator) -> list[int]:
    return [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, n)]  # bushy but deep-ish


def random_tree(root: int, n: int, vocab_size: int, rng: np.random.Generator) -> TokenTree:
    """A tree of n nodes under `root` with distinct consecutive drafted tokens (none repeats a
    sibling): random weights accept ~nothing, so its shape and size are what costs."""
    parents = np.array(random_parents(n, rng))
    drafted = (int(rng.integers(0, vocab_size)) + np.arange(n - 1)) % vocab_size
    return TokenTree(tokens=np.concatenate(([root], drafted)), parents=parents)


def interleaved_ms(fns: list, warmup: int, iters: int) -> list[float]:
    """cuda_ms of each of `fns` (graph replays, say), their runs interleaved round-robin (the first to
    run rotates each round): the GPU's drift over a process (clocks, heat, the host) then weighs on
    every variant alike. One after the other, identical graphs differed by up to 2.7 % in a run
    (H200, 2026-12-02), as much as the knob effects being judged."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in fns]
    for i in range(iters):
        for k in range(len(fns)):
            j = (i + k) % len(fns)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fns[j]()
            b.record()
            b.synchronize()
            times[j].append(a.elapsed_time(b))
    return [statistics.median(t) for t in times]


def cuda_ms(fn, warmup: int, iters: int) -> float:
    """Median device time of fn() (CUDA events around each call, a sync between calls)."""
    return interleaved_ms([fn], warmup, iters)[0]


def report(result: dict, out: str | None) -> None:
    """The GPU micro-benchmarks' ending: the result as indented JSON on stdout and, with --out, in that file."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text)


def captured(calls: list):  # noqa: ANN201 - a torch.cuda.CUDAGraph
    """`calls` captured back to back in one CUDA graph (each run twice first: compile, cuBLAS handles)."""
    for f in calls[:2]:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    return g


def kernel_ms(fn, iters: int, calls: int = 20) -> float:
    """Milliseconds per call of `calls` back-to-back calls replayed as one CUDA graph: the kernels'
    own time, as a verify step (itself a graph) sees them. cuda_ms around one eager call also counts
    the Python launch path (about 0.1 ms for the Triton kernel's wrapper on the GPU host), which a
    graph never pays."""
    return graph_us([fn] * calls, iters) / 1000


def wall_ms(fn, warmup: int, iters: int, reset: Callable[[], None] | None = None) -> float:
    """Median host wall time of fn(); `reset` (untimed) runs after each call."""
    times = []
    for i in range(warmup + iters):
        t = time.perf_counter()
        fn()
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1000)
        if reset is not None:
            reset()
    return statistics.median(times)


# -- 1. ceilings ------------------------------------------------------------------------------
def ceilings() -> dict:
    x = torch.empty(2 * 1024 ** 3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = cuda_ms(lambda: y.copy_(x), 3, 10)
    bw = 2 * x.numel() * 2 / (ms / 1000)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = cuda_ms(lambda: a @ b, 3, 10)
    flops = 2 * 8192 ** 3 / (ms / 1000)
    return {"copy_bytes_per_s": bw, "bf16_flop_per_s": flops}


# -- 2. checks --------------------------------------------------------------------------------
def check_kernel() -> dict:
    from edgespec.verifier.torch.triton_attention import TritonPagedAttention

    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    rng = np.random.default_rng(0)
    for B, T, ctx_len, Hq, Hkv in ((1, 1, 1000, 12, 2), (3, 64, 700, 12, 2), (2, 64, 4096, 64, 8), (4, 128, 333, 12, 2)):
        bs, D = 16, 128
        nb = -(-(ctx_len + T) // bs)
        cache = torch.randn(2, (B * nb + 8) * bs, Hkv, D, generator=g, device="cuda", dtype=torch.bfloat16)
        tables = torch.from_numpy(rng.permutation(np.arange(1, B * nb + 1)).reshape(B, nb)).cuda()
        ctx = torch.tensor([ctx_len - 17 * b for b in range(B)], device="cuda")
        anc = torch.stack([torch.from_numpy(ancestor_mask(random_parents(T, rng))) for _ in range(B)]).cuda()
        q = torch.randn(B, T, Hq, D, generator=g, device="cuda", dtype=torch.bfloat16)
        ref = TorchPagedAttention(tables, ctx, anc, bs, Hq // Hkv)(q.double(), cache.double())
        got = TritonPagedAttention(tables, ctx, anc, bs, Hq // Hkv)(q, cache).double()
        err = float((got - ref).norm() / ref.norm())
        out[f"B{B}_T{T}_ctx{ctx_len}_H{Hq}/{Hkv}"] = err
    return out


def check_engine(attention: str) -> dict:
    """Tiny float32 model, CUDA graphs: device decisions vs accept_greedy on eager logits."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = TransformerLM.random(ModelConfig.tiny("qwen2"), dtype=torch.float32, device="cuda", seed=1)
    engine = Engine(model, num_blocks=256, block_size=16, cuda_graphs=True, attention=attention)
    rng = np.random.default_rng(1)
    seqs = []
    for n in (40, 77, 5):
        s = engine.new_sequence()
        engine.prefill(s, rng.integers(0, 512, size=n).tolist())
        seqs.append(s)
    checked = mismatches = accepted = 0
    for _ in range(12):
        steps, refs = [], []
        for s in seqs:
            n = int(rng.integers(1, 20))
            parents = random_parents(n, rng)
            tokens = rng.integers(0, 512, size=n).tolist()
            # make the first-child chain follow the eager argmax so paths get accepted
            for i in range(1, n):
                if parents[i] == i - 1 and rng.random() < 0.8:
                    tokens[i] = int(engine.logits(s, tokens, parents)[i - 1].argmax())
            logits = engine.logits(s, tokens, parents).cpu().numpy()
            refs.append(accept_greedy(TokenTree(tokens=np.array(tokens), parents=np.array(parents)),
                                      logits.argmax(-1)))
            steps.append(TreeStep(s, tokens, parents))
        for d, ref in zip(engine.verify(steps), refs):
            checked += 1
            accepted += len(d.path)
            mismatches += (d.path, d.next_token) != (ref.path, ref.next_token)
    return {"attention": attention, "steps": checked, "mismatches": mismatches, "accepted_nodes": accepted,
            "captures": engine.stats["captures"], "replays": engine.stats["replays"]}


def check_rope_in_matmul(knob: str = "GEMV_ROPE", context: int = 300) -> dict:
    """fused.GEMV_ROPE (RoPE and the cache writes in the one-row wqkv GEMV) or fused.ROWS_ROPE (the same in
    _linear_rows_kernel, here a 16-token chain) against the separate launch: random bf16 weights of the
    Qwen2.5-1.5B shape, the step's forward after a prefill, eager. Equal up to how the compiler contracts
    the rotation's multiply-adds in each kernel."""
    from edgespec.verifier.torch import fused

    model = TransformerLM.random(ModelConfig.qwen2_1_5b(), dtype=torch.bfloat16, device="cuda", seed=4,
                                 max_positions=context + 64)
    prefix = np.random.default_rng(4).integers(0, 151936, size=context).tolist()
    tokens = [17] if knob == "GEMV_ROPE" else [17 + 3 * i for i in range(16)]
    out = []
    try:
        for on in (0, 1):
            with kernel_knobs.override({knob: on}):
                used = fused.rope_in_matmul_fits(len(tokens), model.layers[0].wqkv.weight, model.config.head_dim)
                engine = Engine(model, num_blocks=-(-context // 16) + 8, block_size=16, cuda_graphs=False)
                seq = engine.new_sequence()
                engine.prefill(seq, prefix)
                out.append((engine.logits(seq, tokens, list(range(-1, len(tokens) - 1))).float(),
                            engine.cache.flat.float().clone()))
                del engine
    finally:
        model.fused_ops = False
    (l0, c0), (l1, c1) = out
    return {"used": used or "no table fit",
            "max_logit_diff": float((l0 - l1).abs().max()),
            "same_argmax": bool((l0.argmax(-1) == l1.argmax(-1)).all()),
            "max_cache_diff": float((c0 - c1).abs().max())}


def check_move_rows() -> dict:
    """tree_ops.move_rows (MOVE_ROWS_KERNEL) against move_rows_torch on the GPU: 8 trees of 64 nodes whose
    accepted paths skip nodes, bf16 cache of the Qwen2.5-1.5B shape (the barrier between its loads and
    stores is what the interpreter cannot show)."""
    from edgespec.verifier.torch import tree_ops

    rng = np.random.default_rng(5)
    B, T, bs, NB = 8, 64, 16, 72
    tables = torch.from_numpy(rng.permutation(np.arange(1, B * NB + 1)).reshape(B, NB)).cuda()
    ctx = torch.from_numpy(rng.integers(100, 1000, B)).cuda()
    path = torch.zeros(B, T, dtype=torch.int64)
    k = torch.from_numpy(rng.integers(1, 40, (B, 1)))
    for b in range(B):
        nodes = np.sort(rng.choice(np.arange(1, T), size=int(k[b]), replace=False))
        path[b, 1:1 + len(nodes)] = torch.from_numpy(nodes)
    src, dst = tree_ops.compaction_slots(tables, ctx, path.cuda(), k.cuda(), torch.ones(B, dtype=torch.bool).cuda(), bs)
    flat = torch.randn(28, 2, (B * NB + 1) * bs, 2, 128, device="cuda", dtype=torch.bfloat16)
    want = flat.clone()
    tree_ops.move_rows_torch(want, src, dst)
    tree_ops.move_rows(flat, src, dst, T)
    return {"moved_rows": int((src != dst).sum()), "equal": bool(torch.equal(flat, want))}


def same_steps_under(settings: list[dict[str, int]], context: int = 300) -> dict:
    """The same verify steps through CUDA graphs under each knob setting, against the first: random bf16 weights of
    the Qwen2.5-1.5B shape, B x T = 1 x 1, 4 x 16, 1 x 64, three rounds each. For knobs that change when kernels
    run, never what they compute, so logits and decisions must be bit-identical."""
    model = TransformerLM.random(ModelConfig.qwen2_1_5b(), dtype=torch.bfloat16, device="cuda", seed=6,
                                 max_positions=context + 256)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 151936, size=context - 37 * i).tolist() for i in range(4)]
    rounds = [(B, [(rng.integers(0, 151936, size=T).tolist(), random_parents(T, rng)) for _ in range(B)])
              for B, T in ((1, 1), (4, 16), (1, 64)) for _ in range(3)]
    runs = []
    for knob_values in settings:
        with kernel_knobs.override(knob_values):
            engine = Engine(model, num_blocks=4 * (-(-(context + 256) // 16)) + 8, block_size=16, cuda_graphs=True)
            seqs = [engine.new_sequence() for _ in prompts]
            for s, p in zip(seqs, prompts):
                engine.prefill(s, p)
            decided, logits = [], []
            for B, trees in rounds:
                ds = engine.verify([TreeStep(s, t, par) for s, (t, par) in zip(seqs, trees)])
                decided.append([(d.path, d.next_token) for d in ds])
                got = engine.last_logits()
                logits.append(torch.cat([got[b, :len(t)] for b, (t, _) in enumerate(trees)]).float().clone())
            runs.append((decided, logits, engine.stats["captures"]))
            del engine
    (d0, l0, _), *others = runs
    return {"steps": len(rounds), "settings": settings, "captures": [c for _, _, c in runs],
            "same_decisions": all(d == d0 for d, _, _ in others),
            "bit_identical_logits": all(torch.equal(a, b) for _, l1, _ in others for a, b in zip(l0, l1)),
            "max_logit_diff": max(float((a - b).abs().max()) for _, l1, _ in others for a, b in zip(l0, l1))}


def check_pdl() -> dict:
    """pdl.PDL (programmatic dependent launch) against plain launches, with the next kernel's launch at each
    place pdl.TRIGGER can put it, and with the attention's reads before its wait (EARLY_INDEX, PREFETCH_KEYS):
    the kernels are the same code with a wait at their start; a kernel reading before its producer's writes
    are visible would show here."""
    return same_steps_under([{"PDL": 0}] + [{"PDL": 1 << 20, "TRIGGER": t} for t in (0, 1, 2)]
                            + [{"PDL": 1 << 20, "EARLY_INDEX": 1}, {"PDL": 1 << 20, "PREFETCH_KEYS": 128}])


def check_l2_warm() -> dict:
    """fused.L2_WARM (a side stream asks L2 for the next weights while attention runs) against none, at every
    row count, also with the main chain captured above the warming's priority (WARM_BELOW_MAIN): the graphs fork
    and rejoin, the warming reads weights only."""
    return same_steps_under([{"L2_WARM": 0}] + [{"L2_WARM": mb, "L2_WARM_ROWS": 1 << 20} for mb in (8, 32)]
                            + [{"L2_WARM_ROWS": 1 << 20, "WARM_BELOW_MAIN": 1}])


def check_compaction() -> dict:
    """Compaction between CUDA-graph steps: two engines on the same tiny float32 model run the same
    steps; one compacts the cache before every step (threshold 0, checked every call), after short
    sequences were closed so the pool is fragmented. Block ids change under the captured graphs
    (the tables are inputs of each replay), so the decisions and the logits must not."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = TransformerLM.random(ModelConfig.tiny("qwen2"), dtype=torch.float32, device="cuda", seed=5)
    engines = [Engine(model, num_blocks=256, block_size=16, cuda_graphs=True, compact_threshold=t, compact_check_every=1)
               for t in (0.0, 1.0)]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 512, size=int(n)).tolist() for n in rng.integers(20, 90, size=6)]
    seqs = []
    for e in engines:
        ss = []
        for p in prompts:
            ss.append(e.new_sequence())
            e.prefill(ss[-1], p)
        for s in ss[::2]:
            s.close()   # holes in the pool
        seqs.append(ss[1::2])
    steps = checked = mismatches = moved = under_graphs = 0
    max_diff = 0.0
    for _ in range(24):
        trees = [(rng.integers(0, 512, size=n).tolist(), random_parents(n, rng)) for n in rng.integers(1, 12, size=3)]
        out = []
        filler = rng.integers(0, 512, size=int(rng.integers(20, 60))).tolist()
        for e, ss in zip(engines, seqs):
            done = e.between_steps()
            moved += done.moved if done else 0
            under_graphs += bool(done) and e.stats["captures"] > 0
            temp = e.new_sequence()      # blocks below this step's new ones, freed after it: a hole
            e.prefill(temp, filler)
            ds = e.verify([TreeStep(s, t, p) for s, (t, p) in zip(ss, trees)])
            logits = e.last_logits()   # real nodes only: padding rows read slots no tree owns
            out.append(([(d.path, d.next_token) for d in ds],
                        torch.cat([logits[b, :len(t)] for b, (t, _) in enumerate(trees)]).clone()))
            temp.close()
        steps += 1
        checked += len(trees)
        mismatches += out[0][0] != out[1][0]
        max_diff = max(max_diff, float((out[0][1] - out[1][1]).abs().max()))
    return {"steps": steps, "trees": checked, "mismatched_steps": mismatches, "blocks_moved": moved,
            "compactions": engines[0].stats["compactions"], "compactions_after_a_capture": under_graphs,
            "captures": engines[0].stats["captures"],
            "max_logit_diff": max_diff}


# -- 3. attention kernels ---------------------------------------------------------------------
def bench_attention(shapes, tree: int, warmup: int, iters: int, ceil: dict,
                    configs: str = "0x0w4s0,64x64w4s3,64x32w4s2,128x32w4s2", heads: tuple[int, int] = (64, 8)
                    ) -> list[dict]:
    """The tree attention kernel against maskless SDPA at each shape (B, L) or (B, L, T): T tree nodes
    (`tree` where the shape names none) over L context keys, `heads` (query, KV). A config is
    "BMxBNwWARPSsSTAGES[/SPLITS][!KNOB=V]" (0x0: the kernel's own choice; /SPLITS pins the key splits,
    else the split policy picks them)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from edgespec.verifier.torch.triton_attention import TritonPagedAttention

    rows = []
    (Hq, Hkv), D, bs = heads, 128, 16
    rng = np.random.default_rng(3)
    for shape in shapes:
        B, L, T = (*shape, tree)[:3]
        nb = -(-(L + T) // bs)
        cache = torch.randn(2, (B * nb + 1) * bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
        tables = torch.from_numpy(rng.permutation(np.arange(1, B * nb + 1)).reshape(B, nb)).cuda()
        ctx = torch.full((B,), L, device="cuda")
        anc = torch.stack([torch.from_numpy(ancestor_mask(random_parents(T, rng))) for _ in range(B)]).cuda()
        q = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16)
        N = L + T
        kv_bytes = 2 * B * N * Hkv * D * 2
        flops = 4 * B * Hq * T * N * D
        floor = max(kv_bytes / ceil["copy_bytes_per_s"], flops / ceil["bf16_flop_per_s"]) * 1000
        row = {"batch": B, "context": L, "tree": T, "heads": f"{Hq}/{Hkv}", "floor_ms": floor,
               "hbm_floor_ms": kv_bytes / ceil["copy_bytes_per_s"] * 1000,
               "compute_floor_ms": flops / ceil["bf16_flop_per_s"] * 1000}
        graphs = {}   # config -> 20 calls in one graph; all captured first, then timed interleaved
        for i, cfg in enumerate(configs.split(",")):   # "BMxBNwWARPSsSTAGES[/SPLITS][!KNOB=V:KNOB=V]" (docstring)
            spec, _, extra = cfg.partition("!")
            spec, _, splits = spec.partition("/")
            tile, _, rest = spec.partition("w")
            bm, bn = (int(v) for v in tile.split("x"))
            warps, stages = (int(v) for v in rest.split("s"))
            knobs = knob_values(extra)
            try:
                with attention_knobs(BLOCK_M=bm, BLOCK_N=bn, NUM_WARPS=warps, NUM_STAGES=stages, **knobs):
                    att = TritonPagedAttention(tables, ctx, anc, bs, Hq // Hkv, int(splits) if splits else None)
                    graphs[cfg] = captured([lambda: att(q, cache)] * 20)
                    if i == 0:   # one call at a time from Python, as before 2026-12-02
                        row["triton_percall_ms"] = cuda_ms(lambda: att(q, cache), warmup, iters)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile: report, go on
                row[f"triton_{cfg}"] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
        if graphs:
            times = interleaved_ms([g.replay for g in graphs.values()], 3, iters)
            for cfg, ms in zip(graphs, times):
                row[f"triton_{cfg}_ms"] = ms / 20
            row["triton_ms"], row["triton_config"] = min((ms / 20, cfg) for cfg, ms in zip(graphs, times))
        del graphs
        ref = TorchPagedAttention(tables, ctx, anc, bs, Hq // Hkv)
        try:
            row["torch_paged_ms"] = cuda_ms(lambda: ref(q, cache), warmup, iters)
        except Exception as exc:  # noqa: BLE001
            row["torch_paged"] = f"error: {type(exc).__name__}"
        k = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qh = q.transpose(1, 2).contiguous()
        for name, backend in (("sdpa_flash_nomask_ms", SDPBackend.FLASH_ATTENTION),
                              ("sdpa_cudnn_nomask_ms", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel([backend]):
                    def sdpa() -> torch.Tensor:
                        return torch.nn.functional.scaled_dot_product_attention(qh, k, v, enable_gqa=True)
                    row[name] = kernel_ms(sdpa, iters)
                    row[name.replace("_ms", "_percall_ms")] = cuda_ms(sdpa, warmup, iters)
            except Exception:  # noqa: BLE001 - GQA not taken by this kernel: repeat K/V per head
                kr, vr = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
                try:
                    with sdpa_kernel([backend]):
                        row[name] = kernel_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qh, kr, vr),
                                              iters)
                    row[name.replace("_ms", "_kv_repeated")] = True
                except Exception as exc:  # noqa: BLE001
                    row[name.replace("_ms", "")] = f"error: {type(exc).__name__}: {str(exc)[:100]}"
                del kr, vr
        torch.cuda.empty_cache()
        rows.append(row)
        log("[attn]", json.dumps({k2: (round(v2, 4) if isinstance(v2, float) else v2) for k2, v2 in row.items()}))
    return rows


def bench_top2(rows_list: list[int], configs: str, iters: int, ceil: dict | None, vocab: int = 151936) -> list[dict]:
    """fused.argmax_top2 (the greedy step's argmax and margin over the bf16 logits) per chunk config
    "BLOCKwWARPS", each as 20 calls in one graph, timed round-robin; checked against torch's. The floor
    is one read of the logits at this run's copy ceiling (none when the ceilings section is skipped)."""
    from edgespec.verifier.torch import fused

    out = []
    for rows in rows_list:
        logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
        ref_arg = logits.float().argmax(-1)
        row: dict = {"rows": rows}
        if ceil:
            row["floor_us"] = rows * vocab * 2 / ceil["copy_bytes_per_s"] * 1e6
        graphs = {}
        for cfg in configs.split(","):
            block, warps = (int(v) for v in cfg.split("w"))
            arg, _ = fused.argmax_top2(logits, block, warps)
            row[f"{cfg}_argmax_equal"] = bool(torch.equal(arg, ref_arg))
            graphs[cfg] = captured([lambda b=block, w=warps: fused.argmax_top2(logits, b, w)] * 20)
        times = interleaved_ms([g.replay for g in graphs.values()], 3, iters)
        for cfg, ms in zip(graphs, times):
            row[f"{cfg}_us"] = ms / 20 * 1000
        out.append(row)
        log("[top2]", json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}))
        del graphs
    return out


# -- 6. small-rows matmuls --------------------------------------------------------------------
MATMULS = {"wqkv": (2048, 1536, True), "wo": (1536, 1536, False), "w13": (17920, 1536, False),
           "w2": (1536, 8960, False)}
MATMUL_CANDIDATES = {   # 2+ rows (and w13 at any rows): (COLS per program, BLOCK_K, SPLIT, num_warps, num_stages)
    "wqkv": [(16, 128, 1, 4, 4), (16, 128, 1, 4, 6), (32, 128, 1, 4, 4), (16, 256, 1, 4, 3)],
    "wo": [(48, 64, 4, 4, 4), (48, 64, 4, 4, 6), (48, 128, 4, 4, 3), (32, 128, 2, 4, 4)],
    "w13": [(68, 128, 1, 8, 3), (68, 64, 1, 8, 6), (68, 128, 1, 8, 4), (34, 64, 1, 4, 6), (34, 128, 1, 4, 3)],   # linear_silu
    "w2": [(128, 64, 11, 8, 4), (128, 64, 11, 8, 6), (128, 128, 11, 8, 4), (64, 64, 6, 4, 6)],
}
GEMV_CANDIDATES = {   # one row only: fused._gemv_kernel (persistent, GEMV_PROGRAMS_PER_SM programs per SM)
    "wqkv": [(8, 512, 1, 8, 3), (8, 512, 1, 4, 3), (8, 256, 1, 4, 3)],
    "wo": [(8, 256, 2, 4, 3), (8, 512, 2, 4, 3), (8, 256, 1, 4, 3)],
    "w13": [(16, 512, 1, 4, 3), (8, 512, 1, 4, 3), (32, 512, 1, 4, 3)],
    "w2": [(16, 256, 5, 4, 3), (16, 512, 5, 4, 3), (8, 256, 7, 4, 3)],
}


def graph_us(calls: list, iters: int) -> float:
    """Microseconds per call: all `calls` captured back to back in one CUDA graph, replayed (on the
    CPU, for a smoke test: one eager pass, host time)."""
    if not torch.cuda.is_available():
        for f in calls[:2]:
            f()
        t = time.perf_counter()
        for f in calls:
            f()
        return (time.perf_counter() - t) * 1e6 / len(calls)
    g = captured(calls)
    ms = cuda_ms(g.replay, 3, iters)
    del g
    return ms * 1000 / len(calls)


def weight_copies(nbytes: int) -> int:
    """How many copies of an `nbytes` weight a matmul timing rotates through: 256 MiB in all (2 to 64 copies),
    more than L2 holds, so every call reads its weight from HBM as the forward does."""
    return max(2, min(64, -(-256 * 2 ** 20 // nbytes)))


def bench_matmuls(args, ceil: dict | None) -> dict:
    """cuBLAS vs fused.linear_rows per block matrix and row count (module docstring, section 6).
    The Triton form is what _forward_fused runs: wqkv with its bias; wo and w2 leaving float32
    split-K partials for add_rmsnorm (no reduce launch); w13 as linear_silu, SiLU*up its epilogue (its
    cuBLAS column is F.linear alone; cublas_silu_us adds the silu_mul launch it needs), so w2 takes
    SiLU*up as input. Rows > 1 (and w13): the balanced default (COLS 0 in the record) and
    MATMUL_CANDIDATES; one row: the GEMV's table config and GEMV_CANDIDATES."""
    from edgespec.verifier.torch import fused

    bw = ceil["copy_bytes_per_s"] if ceil else 4.2e12
    rows_list = [int(r) for r in args.matmul_rows.split(",")]
    split_ks = [int(p) for p in args.matmul_split_k.split(",") if p]
    out = {"rows": [], "sweep": [], "bytes_per_s_for_floor": bw}
    dev = args.device
    g = torch.Generator(device=dev).manual_seed(11)
    for name, (n, k, has_bias) in MATMULS.items():
        wbytes = n * k * 2
        copies = weight_copies(wbytes)
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(k) for _ in range(copies)]
        b = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 if has_bias else None
        pair = name == "w13"
        n_out = n // 2 if pair else n
        for rows in rows_list:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=g)
            nbytes = wbytes + rows * k * 2 + rows * n_out * 2 + (n * 2 if has_bias else 0)
            row = {"matrix": name, "N": n, "K": k, "rows": rows, "weight_copies": copies,
                   "floor_us": nbytes / bw * 1e6}
            row["cublas_us"] = graph_us([lambda w=w: F.linear(x, w, b) for w in ws], args.iters)
            # the same product the other way round (W @ x^T: cuBLAS sees M = N, N = rows and may pick other kernels)
            row["cublas_wx_us"] = graph_us([lambda w=w: torch.mm(w, x.t()) for w in ws], args.iters)
            if pair:
                row["cublas_silu_us"] = graph_us([lambda w=w: fused.silu_mul(F.linear(x, w)) for w in ws], args.iters)
                ref = fused.silu_mul_torch(F.linear(x.float(), ws[0].float()))
                row["cublas_max_abs_err"] = float((fused.silu_mul(F.linear(x, ws[0])).float() - ref).abs().max())
            else:
                ref = F.linear(x.float(), ws[0].float(), None if b is None else b.float())
                row["cublas_max_abs_err"] = float((F.linear(x, ws[0], b).float() - ref).abs().max())
            if name in ("wo", "w2"):   # cuBLAS with K in slices, float32 partials for add_rmsnorm (fused.linear_split_k)
                for parts in split_ks:
                    if k % parts == 0:
                        row[f"cublas_split{parts}_us"] = graph_us(
                            [lambda w=w, p=parts: fused.linear_split_k(x, w, p) for w in ws], args.iters)
                        got = fused.linear_split_k(x, ws[0], parts).sum(0)
                        row[f"cublas_split{parts}_max_abs_err"] = float((got - ref).abs().max())
            if rows <= fused.LINEAR_ROWS_MAX:
                gemv = rows == 1 and not pair
                cfgs = [None] + ((GEMV_CANDIDATES[name] if gemv else MATMUL_CANDIDATES[name])
                                 if args.matmul_sweep else [])
                for cfg in cfgs:
                    try:
                        if pair:
                            calls = [lambda w=w: fused.linear_silu(x, w, config=cfg) for w in ws]
                            y = fused.linear_silu(x, ws[0], config=cfg)
                        elif name in ("wo", "w2"):
                            calls = [lambda w=w: fused.linear_rows_partials(x, w, config=cfg) for w in ws]
                            y = fused.linear_rows_partials(x, ws[0], config=cfg).sum(0)
                        else:
                            calls = [lambda w=w: fused.linear_rows(x, w, b, config=cfg) for w in ws]
                            y = fused.linear_rows(x, ws[0], b, config=cfg)
                        us = graph_us(calls, args.iters)
                        err = float((y.float() - ref).abs().max())
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile: report, go on
                        out["sweep"].append({"matrix": name, "rows": rows, "config": cfg,
                                             "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                        continue
                    if cfg is None:
                        row["config"] = fused.linear_rows_config(rows, n, k, pair=pair, can_split=name in ("wo", "w2"),
                                                                 device=x.device)
                        row["triton_us"], row["triton_max_abs_err"] = us, err
                        row["triton_GBps"] = nbytes / (us / 1e6) / 1e9
                        if not fused._table_entry(rows, n, k)[1] and not gemv:   # the balanced default, as a candidate
                            out["sweep"].append({"matrix": name, "rows": rows, "config": row["config"], "us": us,
                                                 "max_abs_err": err})
                    else:
                        out["sweep"].append({"matrix": name, "rows": rows, "config": cfg, "us": us, "max_abs_err": err})
            row["cublas_GBps"] = nbytes / (row["cublas_us"] / 1e6) / 1e9
            out["rows"].append(row)
            log("[matmul]", json.dumps({k2: (round(v2, 3) if isinstance(v2, float) else v2) for k2, v2 in row.items()}))
        del ws
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if args.matmul_sweep:   # per row bound: the fastest config, or None where cuBLAS is faster
        picks = {}
        for name, (n, k, _) in MATMULS.items():
            base = {r["rows"]: r.get("cublas_silu_us", r["cublas_us"]) for r in out["rows"] if r["matrix"] == name}
            err = {r["rows"]: r["cublas_max_abs_err"] for r in out["rows"] if r["matrix"] == name}
            # a config must also be as accurate as cuBLAS (within 4x its error against float32)
            got = [r for r in out["sweep"] if r["matrix"] == name and "us" in r
                   and r["max_abs_err"] <= 4 * err[r["rows"]] + 1e-6]
            for bound, rs in ((1, (1,)), (16, (16,)), (64, (64,))):   # one row runs its own (GEMV) path
                rs = [x for x in rs if x in rows_list]
                score = {}
                for r in got:
                    if r["rows"] in rs:
                        score.setdefault(tuple(r["config"]), []).append(r["us"])
                full = {cfg: sum(v) for cfg, v in score.items() if len(v) == len(rs)}
                if full and rs:
                    best = min(full, key=full.get)
                    picks.setdefault((n, k), []).append((bound, best if full[best] < sum(base[x] for x in rs) else None))
        out["picked_table"] = {f"{n}x{k}": v for (n, k), v in picks.items()}
        log("[matmul] fastest configs per row bound (None: cuBLAS):", json.dumps(out["picked_table"]))
        for r in out["sweep"]:
            log("[matmul sweep]", json.dumps({k2: (round(v2, 3) if isinstance(v2, float) else v2) for k2, v2 in r.items()}))
        if args.matmul_pick:
            fused.LINEAR_ROWS_TABLE.update(picks)
    for r in out["rows"]:   # whether _forward_fused uses linear_rows here (with the table the steps run)
        r["in_forward"] = fused.linear_rows_wins(r["rows"], r["N"], r["K"])
    return out


# -- 4. verify step ---------------------------------------------------------------------------
def fill(engine: Engine, n: int, context: int) -> list:
    c = engine.model.config
    seqs = []
    for _ in range(n):
        s = engine.new_sequence()
        for start in range(0, context, 256):
            m = min(256, context - start)
            s.append(torch.randn(c.n_layer, 2, m, c.n_head_kv, c.head_dim, device=engine.device,
                                 dtype=engine.model.dtype))
        seqs.append(s)
    return seqs


def small_rows_values(spec: str) -> list[int | None]:
    """--small-rows-matmul: "off,on" -> [0, 64]; "" -> [None] (the engine's default)."""
    return [{"off": 0, "on": 64}[v] if v in ("off", "on") else int(v) for v in spec.split(",")] if spec else [None]


def bench_steps(args, config: ModelConfig, dtype, ceil: dict | None) -> list[dict]:
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    trees = [int(t) for t in args.trees.split(",")]
    model = TransformerLM.random(config, dtype=dtype, device=device, max_positions=args.context + 256)
    rows = []
    attentions = args.attention.split(",")
    per_seq = -(-(args.context + max(trees)) // 16) + 2
    small_values = small_rows_values(args.small_rows_matmul)
    kept: list[tuple[str, Engine]] = []   # every variant's engine and graphs, for the interleaved replays
    for variant, small in [(v, s) for v in attentions for s in small_values]:
        name = variant if len(small_values) == 1 else f"{variant}+srm{small}"
        variant, _, extra = variant.partition("!")    # triton!KNOB=V:KNOB=V: any class knob, e.g. !NUM_WARPS=8
        variant, _, table = variant.partition("%")    # triton%2048x1536r64=16.128.1.4.3: small-rows matmul configs
        variant, _, tiles = variant.partition("#")    # triton#BMxBN: pinned attention tiles
        variant, _, policy = variant.partition("@")   # triton@P:K: TARGET_PROGRAMS P, MIN_SPLIT_KEYS K
        attention, _, unfused = variant.partition("-")
        knobs = {}
        if policy:
            knobs["TARGET_PROGRAMS"], knobs["MIN_SPLIT_KEYS"] = (int(v) for v in policy.split(":"))
        if tiles:
            knobs["BLOCK_M"], knobs["BLOCK_N"] = (int(v) for v in tiles.split("x"))
        items = extra.split(":")   # !BLAS=cublaslt: torch's preferred BLAS library for the variant, not a kernel knob
        blas = next((kv.partition("=")[2] for kv in items if kv.startswith("BLAS=")), "default")
        knobs.update(knob_values(":".join(kv for kv in items if not kv.startswith("BLAS="))))
        engine = Engine(model, num_blocks=max(batches) * per_seq + 8, block_size=16, attention=attention,
                        cuda_graphs=device.type == "cuda" and not args.no_graph,
                        fused=False if unfused == "unfused" else None, small_rows_matmul=small)
        before = torch.backends.cuda.preferred_blas_library() if device.type == "cuda" else None
        try:
            if device.type == "cuda" and blas != "default":
                torch.backends.cuda.preferred_blas_library(blas)
            with attention_knobs(**knobs), matmul_table(table):
                _steps(engine, args, config, batches, trees, name, ceil, rows)
            if engine.cuda_graphs:
                kept.append((name, engine))
        except Exception as exc:  # noqa: BLE001 - report, go on with the next variant
            rows.append({"attention": name, "error": f"{type(exc).__name__}: {exc}"[:600]})
            log("[step] failed:", rows[-1])
        finally:
            if before is not None:
                torch.backends.cuda.preferred_blas_library(before)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if len(kept) > 1:
        interleaved_replays(kept, rows, args.warmup, args.iters)
    model.fused_ops = False
    return rows


def _steps(engine: Engine, args, config: ModelConfig, batches, trees, attention: str, ceil: dict | None,
           rows: list) -> None:
    rng = np.random.default_rng(0)
    for B in batches:
        seqs = fill(engine, B, args.context)
        for T in trees:
            steps = []
            for s in seqs:   # int64 arrays, as TorchBackend passes a wire tree's tokens and parents
                steps.append(TreeStep(s, rng.integers(0, config.vocab_size, size=T), np.array(random_parents(T, rng))))

            def step() -> None:
                engine.verify(steps)

            def reset(keep_blocks: bool = True) -> None:   # the next step at the same context again (untimed)
                for s in seqs:
                    s.truncate(args.context)
                    if keep_blocks:   # as in serving, where a step's trim keeps the next tree's blocks as spares
                        s.reserve(args.context + T)

            row = {"attention": attention, "batch": B, "tree": T, "context": args.context}
            t0 = time.perf_counter()
            step()
            reset()
            row["first_step_s"] = round(time.perf_counter() - t0, 2)   # includes the graph capture
            row["attention_launch"] = attention_launch(engine, B, T, args.context)
            row["step_ms"] = wall_ms(step, args.warmup, args.iters, reset)
            # each step allocating its tree's blocks (truncate alone: how step_ms was timed before 2026-12-04)
            row["step_allocating_ms"] = wall_ms(step, args.warmup, args.iters, lambda: reset(keep_blocks=False))
            if engine.cuda_graphs:
                row["replay_ms"] = cuda_ms(replayed_graph(engine, B, T).replay, args.warmup, args.iters)
                row["host"] = host_split(engine, step, reset, args.iters)
            if ceil:
                w = config.n_params * 2
                row["floor_ms"] = 1000 * max(w / ceil["copy_bytes_per_s"],
                                             2 * config.n_params * B * T / ceil["bf16_flop_per_s"])
            rows.append(row)
            log("[step]", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
        for s in seqs:
            s.close()


def host_split(engine: Engine, step: Callable[[], None], reset: Callable[[], None], iters: int) -> dict[str, float]:
    """Where a step's wall time goes beyond its graph (medians, ms): `pack` (the host staging buffers
    filled; their copy to the device is the graph's first node), `launch` (the graph's replay call), `gpu_wait` (from there until the device is
    done) and `rest` (the wall time less those: checks, reserving and trimming blocks, reading the
    decisions back). The engine's methods are wrapped for these steps only."""
    pack, run = engine._pack, engine._run
    parts: dict[str, list[float]] = {"pack": [], "launch": [], "gpu_wait": [], "wall": []}

    def timed_pack(*a) -> None:
        t = time.perf_counter()
        pack(*a)
        parts["pack"].append(time.perf_counter() - t)

    def timed_run(*a) -> torch.Tensor:
        t0 = time.perf_counter()
        out = run(*a)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        parts["launch"].append(t1 - t0)
        parts["gpu_wait"].append(time.perf_counter() - t1)
        return out

    engine._pack, engine._run = timed_pack, timed_run
    try:
        for _ in range(iters):
            t = time.perf_counter()
            step()
            parts["wall"].append(time.perf_counter() - t)
            reset()
    finally:
        del engine._pack, engine._run   # the instance attributes: the methods show through again
    out = {k + "_ms": 1000 * statistics.median(v) for k, v in parts.items()}
    out["rest_ms"] = 1000 * statistics.median(
        w - p - la - g for w, p, la, g in zip(parts["wall"], parts["pack"], parts["launch"], parts["gpu_wait"]))
    return out


def interleaved_replays(variants: list[tuple[str, Engine]], rows: list[dict], warmup: int, iters: int) -> None:
    """Each step cell's graphs of every variant replayed round-robin (interleaved_ms); the result goes
    into the cell's row as `replay_rr_ms`, which tools/pick_knobs.py prefers to `replay_ms` (timed one
    variant after the other, minutes apart)."""
    cells = sorted({(r["batch"], r["tree"]) for r in rows if "replay_ms" in r})
    for B, T in cells:
        named = [(name, replayed_graph(e, B, T)) for name, e in variants]
        for (name, _), ms in zip(named, interleaved_ms([g.replay for _, g in named], warmup, iters)):
            for r in rows:
                if r.get("attention") == name and (r["batch"], r["tree"]) == (B, T):
                    r["replay_rr_ms"] = ms
        log("[step rr]", B, T, {name: round(r["replay_rr_ms"], 4) for name, _ in named for r in rows
                                if r.get("attention") == name and (r["batch"], r["tree"]) == (B, T)})


def attention_launch(engine: Engine, B: int, T: int, context: int) -> list[int] | None:
    """The tree-attention kernel's (BLOCK_M, BLOCK_N, stages, splits, warps, merge rows) in a step of B
    trees of T nodes at `context`, with the knobs in effect (None for another attention): tools/pick_knobs.py
    does not count a cell that an attention knob launches as the default does (its difference there is the
    run's noise)."""
    cls = engine.attention_cls
    if cls.__name__ != "TritonPagedAttention":
        return None
    c = engine.model.config
    bs = engine.cache.block_size
    att = cls.__new__(cls)   # launch_config needs only the table width and a split count
    att.max_keys, att.nsplit = engine._table_blocks(-(-(context + T) // bs)) * bs, None
    launch = att.launch_config(bucket(B), bucket(T) * c.group, c.n_head_kv)
    return [*launch, cls.NUM_WARPS, cls.merge_rows(bucket(B) * bucket(T)) if launch[3] > 1 else 0]   # (0: no merge)


def bench_mixed(args, config: ModelConfig, dtype, ceil: dict | None) -> list[dict]:
    """Prefill riding in a verify step (TreeStep.prefill_chunk, what the service does with a Sync that
    arrives while trees are verified) against the two forwards it replaces: B trees of T nodes at
    the context, and a separate eager chunk of T prompt tokens for one more session. Also a Sync
    alone: its T-token chunk as a step of its own (prefill rows, a replayed graph) against an eager
    chunk of 4 T tokens (the backend's prefill_chunk)."""
    device = torch.device(args.device)
    model = TransformerLM.random(config, dtype=dtype, device=device, max_positions=args.context + 256)
    rng = np.random.default_rng(1)
    rows = []
    T = 64 if not args.small else 4
    for B in [int(b) for b in args.mixed_batches.split(",")]:
        per_seq = -(-(args.context + 5 * T) // 16) + 2
        engine = Engine(model, num_blocks=(B + 1) * per_seq + 8, block_size=16,
                        cuda_graphs=device.type == "cuda" and not args.no_graph)
        seqs = fill(engine, B + 1, args.context)
        trees = [TreeStep(s, rng.integers(0, config.vocab_size, size=T).tolist(), random_parents(T, rng))
                 for s in seqs[:B]]
        late = seqs[B]
        chunk = rng.integers(0, config.vocab_size, size=T).tolist()

        long_chunk = rng.integers(0, config.vocab_size, size=4 * T).tolist()

        def rewind() -> None:
            for s in seqs:
                s.truncate(args.context)

        def verified(steps: list[TreeStep]) -> Callable[[], None]:
            """One verify step of `steps` (trees and/or prefill rows), then back to the context."""
            return lambda: (engine.verify(steps), rewind())

        def eager(tokens: list[int]) -> Callable[[], None]:
            """One eager prefill forward of `tokens` for the late session, then back to the context."""
            def run() -> None:
                engine.append(late, tokens)
                torch.cuda.synchronize() if device.type == "cuda" else None
                rewind()
            return run

        row = {"trees": B, "tree": T, "chunk": T, "context": args.context,
               "bucket_alone": bucket(B), "bucket_mixed": bucket(B + 1), "long_chunk": 4 * T}
        for name, fn in (("verify_ms", verified(trees)), ("prefill_ms", eager(chunk)),
                         ("mixed_ms", verified(trees + [TreeStep.prefill_chunk(late, chunk)])),
                         # a Sync with no tree beside it: as the service runs it on CUDA, and as it ran before
                         ("prefill_step_ms", verified([TreeStep.prefill_chunk(late, chunk)])),
                         ("prefill_eager_long_ms", eager(long_chunk))):
            row[name] = wall_ms(fn, args.warmup, args.iters)
        row["separate_ms"] = row["verify_ms"] + row["prefill_ms"]
        row["mixed_over_separate"] = round(row["mixed_ms"] / row["separate_ms"], 3)
        rows.append(row)
        log("[mixed]", json.dumps(row))
        for s in seqs:
            s.close()
    return rows


class RecordedTrees:
    """Trees a real drafter made (tools/bench_tau.py --record-trees: the 0.5B draft + lookup pool on
    real prompts), replayed by one capacity client: at context length `at`, while the session's
    committed tokens still follow the recorded target answer, send the tree recorded there cut to
    its first `budget` nodes (parents precede children, so a prefix is a tree). Where no tree was
    recorded at `at` (a smaller budget accepts fewer tokens, so the session stops between the
    recorded steps), the last recorded tree before `at` is re-rooted at the node that holds the
    committed path since then: the part of that draft which still applies, as a drafter's tree for
    this context (shallower than a fresh draft, so small budgets are, if anything, undersold).
    Otherwise (the GPU target chose another token at a near-tie, or past the recording) send a
    root-only tree. At the
    end of the recorded answer the session rewinds to its prompt (a sync to a prefix of what the
    cache holds: no prefill). Acceptance is the GPU target's own: tokens/s here are real.

    With `rejoin`, a session that leaves the recording is put back on it: its context is synced to
    the recording up to and including the token the GPU target disagreed on (its K/V for the
    agreed prefix stay cached). The step still counts as the tokens it produced; every later tree
    is the one the drafter made for that context. This stands in for a drafter that drafts on the
    GPU target's own context, which is what the edge does in service."""

    def __init__(self, item: dict, budget: int, rejoin: bool = False) -> None:
        self.prompt = list(item["prompt"])
        self.full = self.prompt + list(item["answer"])
        self.trees = {t["at"]: t for t in item["trees"]}
        self.recorded_at = sorted(self.trees)
        self.budget = budget
        self.rejoin = rejoin
        self.on_track = True
        self.recorded_steps = self.rerooted_steps = self.steps = self.rejoins = 0

    def next_tree(self, committed: list[int]) -> TokenTree:
        at = len(committed)
        self.steps += 1
        rec = self.trees.get(at) or self._rerooted(at) if self.on_track and self.budget > 1 else None
        if rec is None:
            return TokenTree(tokens=np.array([committed[-1]]), parents=np.array([-1]))
        self.recorded_steps += 1
        self.rerooted_steps += at not in self.trees
        n = min(self.budget, len(rec["tokens"]))
        return TokenTree(tokens=np.array(rec["tokens"][:n]), parents=np.array(rec["parents"][:n]))

    def _rerooted(self, at: int) -> dict | None:
        """The subtree of the last tree recorded before `at` under the node reached by following the
        answer's tokens from its root to `at` (None where the draft did not hold that path): its nodes
        in recorded order (parents still precede children), renumbered."""
        i = bisect.bisect_left(self.recorded_at, at) - 1
        if i < 0:
            return None
        rec = self.trees[self.recorded_at[i]]
        tokens, parents = rec["tokens"], rec["parents"]
        node = 0
        for token in self.full[self.recorded_at[i]:at]:
            node = next((c for c in range(node + 1, len(tokens)) if parents[c] == node and tokens[c] == token), None)
            if node is None:
                return None
        index = {node: 0}
        for c in range(node + 1, len(tokens)):
            if parents[c] in index:
                index[c] = len(index)
        keep = list(index)
        return {"tokens": [tokens[c] for c in keep], "parents": [-1] + [index[parents[c]] for c in keep[1:]]}

    def after(self, at: int, tokens: list[int]) -> list[int] | None:
        """Track the answer; the context to sync the session to (None: carry on as committed): the
        prompt at the end of the answer, or with `rejoin` the recording up to a disagreement."""
        if at + len(tokens) >= len(self.full) - 1:
            self.on_track = True
            return self.prompt
        if self.on_track and tokens != self.full[at:at + len(tokens)]:
            if not self.rejoin:
                self.on_track = False
                return None
            self.rejoins += 1
            agreed = next(i for i, (a, b) in enumerate(zip(tokens, self.full[at:])) if a != b)
            return self.full[:at + agreed + 1]
        return None


def bench_capacity(args, config: ModelConfig, dtype, model: TransformerLM | None = None,
                   trace: list[dict] | None = None) -> list[dict]:
    """Server throughput: N concurrent sessions, each a thread that sends its next tree as soon as
    the last one is answered, through the service's batch worker (BatchWorker + verify_many, the
    code SessionRegistry runs for every Verify; gRPC is not in this loop). Trees of T nodes
    (T = 1: cloud-only AR decoding, one token per request).

    Random weights (default) accept ~nothing, so the measured rates are requests/s (tokens/s of
    speculation = requests/s x tau). With `model` (real weights) and `trace` (RecordedTrees items),
    each session replays a real prompt's recorded trees and tokens/s are measured directly."""
    import threading

    from edgespec.common.sampling import SamplingParams
    from edgespec.verifier.torch.backend import TorchBackend
    from edgespec.verifier.torch.batching import BatchWorker

    device = torch.device(args.device)
    longest = max((len(it["prompt"]) + len(it["answer"]) for it in trace), default=0) if trace else 0
    n_ctx = max(args.context + 4096, longest + 256)   # room for the tokens a fast cell commits
    if model is None:
        model = TransformerLM.random(config, dtype=dtype, device=device, max_positions=n_ctx)
    sizes = [int(n) for n in args.capacity_sessions.split(",")]
    trees = [int(t) for t in args.capacity_trees.split(",")]
    backend = TorchBackend.from_model(model, n_ctx=n_ctx, max_nodes=max(max(trees), 2), max_depth=32,
                                      max_sessions=max(sizes))
    # every (batch, tree) bucket captured before the first row: a bucket's first capture (Triton compiling
    # its kernels for the shape) takes seconds, and the warm-up below cannot see one in progress; caught in
    # a measured window it stalls every session (the sixteenth session's 1-session rows)
    backend.engine.warmup(range(1, max(sizes) + 1), range(1, max(trees) + 1), sampled=False)

    engine_lock = threading.Lock()

    def run_batch(jobs) -> None:  # noqa: ANN001
        with engine_lock:
            results = backend.verify_many([j.payload for j in jobs])
        for job, result in zip(jobs, results):
            if isinstance(result, BaseException):
                job.error = result
            else:
                job.result = result

    worker = BatchWorker(run_batch, max_batch=max(sizes))
    rng = np.random.default_rng(7)
    rows = []
    for n in sizes:
        for T in trees:
            sessions, sources = [], []
            for i in range(n):
                s = backend.open_session()
                if trace:
                    sources.append(RecordedTrees(trace[i % len(trace)], T, rejoin=args.capacity_rejoin))
                    s.sync(sources[-1].prompt)
                else:
                    s.sync(rng.integers(0, config.vocab_size, size=args.context).tolist())
                sessions.append(s)
            stop = threading.Event()
            counts = [[0, 0, 0.0] for _ in range(n)]   # requests, tokens, latency sum
            measuring = threading.Event()
            errors = []

            def client(i: int) -> None:
                s = sessions[i]
                r = np.random.default_rng(i)
                step = 0
                while not stop.is_set():
                    if trace:
                        tree = sources[i].next_tree(s.committed)
                    else:
                        tree = random_tree(s.committed[-1], T, config.vocab_size, r)
                    at = len(s.committed)
                    t0 = time.perf_counter()
                    job = worker.submit((s, tree, SamplingParams(), step))
                    if job.error is not None:
                        errors.append(repr(job.error))
                        return
                    step += 1
                    if measuring.is_set():
                        counts[i][0] += 1
                        counts[i][1] += len(job.result.tokens)
                        counts[i][2] += time.perf_counter() - t0
                    resync = sources[i].after(at, list(job.result.tokens)) if trace else None
                    if resync is not None:
                        with engine_lock:   # a sync must not overlap a batch's step (compaction)
                            s.sync(resync)   # a prefix of what the cache holds, plus one token: no prefill

            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
            for t in threads:
                t.start()
            # warm up until no new CUDA graph was captured for a while (each new bucket costs seconds)
            time.sleep(args.capacity_warmup_s)
            deadline = time.perf_counter() + 30
            while time.perf_counter() < deadline:
                before = backend.engine.stats["captures"]
                time.sleep(1.5)
                if backend.engine.stats["captures"] == before:
                    break
            b0 = (worker.stats.batches, worker.stats.jobs)
            captured_before = backend.engine.stats["captures"]
            measuring.set()
            t0 = time.perf_counter()
            time.sleep(args.capacity_s)
            measuring.clear()
            captured_during = backend.engine.stats["captures"] - captured_before
            elapsed = time.perf_counter() - t0
            b1 = (worker.stats.batches, worker.stats.jobs)
            stop.set()
            for t in threads:
                t.join(timeout=30)
            req = sum(c[0] for c in counts)
            row = {"sessions": n, "tree": T, "weights": "real" if trace else "random",
                   "requests_per_s": req / elapsed, "tokens_per_s": sum(c[1] for c in counts) / elapsed,
                   "tokens_per_request": sum(c[1] for c in counts) / max(1, req),
                   "mean_batch": (b1[1] - b0[1]) / max(1, b1[0] - b0[0]),
                   "mean_latency_ms": 1000 * sum(c[2] for c in counts) / max(1, req), "errors": errors[:3],
                   "captures_total": backend.engine.stats["captures"],
                   # a capture inside the measured window (a bucket first reached late) stalls every
                   # session for its duration: such a row measures the capture, not the service
                   "captures_measured": captured_during}
            if trace:
                row["recorded_tree_share"] = sum(x.recorded_steps for x in sources) / max(1, sum(x.steps for x in sources))
                row["rerooted_tree_share"] = sum(x.rerooted_steps for x in sources) / max(1, sum(x.steps for x in sources))
                row["rejoin"] = bool(args.capacity_rejoin)
                row["rejoins_per_step"] = sum(x.rejoins for x in sources) / max(1, sum(x.steps for x in sources))
            rows.append(row)
            log("[capacity]", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
            for s in sessions:
                s.close()
    worker.close()
    return rows


def critical_path(kernels: list[tuple[str, float, float]], steps: int, layers: int,
                  beside: frozenset[str] = frozenset({"_l2_warm_kernel"}), skip: int = 1) -> dict:
    """Where a replayed step's time goes when its kernels overlap (with PDL a kernel starts early and waits in
    griddepcontrol.wait, so its duration says little): `kernels` (name, start, end in us) of `steps` replays,
    the kernels of `beside` (side-stream warming) set apart. Each main-chain kernel, in start order, is charged
    what it adds to the chain's end (its end minus the latest end before it in its step; 0 when it ends inside
    an earlier one). Charges are summed per label and averaged over the replays: a label is the kernel's name
    and which of its launches in a layer it is (`_linear_rows_kernel#2`: the third of the layer's), from its
    launch count per step over `layers` layers; launches beyond whole layers come first (`#pre`: the first
    RMSNorm before layer 0's). The first `skip` replays are left out: under the profiler the first one waits
    ~0.3-0.5 ms between its input copy and its first kernel (CUPTI starting up; H100, thirty-fifth session).
    `middle_layer`: the first kept replay's kernels of layer `layers // 2` in start order (label, start and end
    from the layer's first start, charge), to see which node sits between which (a memset before a GEMM, say)."""
    main = sorted((k for k in kernels if k[0] not in beside), key=lambda k: k[1])
    if not main or len(main) % steps:
        raise ValueError(f"{len(main)} main-chain kernels do not split into {steps} replays")
    if not 0 <= skip < steps:
        raise ValueError(f"cannot leave out {skip} of {steps} replays")
    per_step = len(main) // steps
    charged: dict[str, float] = {}
    busy: dict[str, float] = {}
    spans = []
    kept = steps - skip
    for r in range(skip, steps):
        step = main[r * per_step:(r + 1) * per_step]
        counts: dict[str, int] = {}
        for name, _, _ in step:
            counts[name] = counts.get(name, 0) + 1
        seen: dict[str, int] = {}
        chain_end = step[0][1]
        middle = []
        for name, start, end in step:
            k = seen.get(name, 0)
            seen[name] = k + 1
            per_layer, extra = divmod(counts[name], layers)
            if not per_layer:
                label = name if counts[name] == 1 else f"{name}#{k}"
            else:
                label = f"{name}#pre" if k < extra else f"{name}#{(k - extra) % per_layer}"
                if r == skip and k >= extra and (k - extra) // per_layer == layers // 2:
                    middle.append((label, start, end, max(0.0, end - chain_end)))
            charged[label] = charged.get(label, 0.0) + max(0.0, end - chain_end) / kept
            busy[label] = busy.get(label, 0.0) + (end - start) / kept
            chain_end = max(chain_end, end)
        spans.append(chain_end - step[0][1])
        if r == skip:   # the first kept replay's ends, where a step's fixed costs are (copies in, prepare, accept)
            t0 = step[0][1]
            ends = [(n[:40], round(a - t0, 2), round(b - t0, 2)) for n, a, b in step[:8] + step[-6:]]
            m0 = middle[0][1] if middle else 0.0
            layer = [(n[:60], round(a - m0, 2), round(b - m0, 2), round(c, 2)) for n, a, b, c in middle]
    side = [k for k in kernels if k[0] in beside and k[1] >= main[skip * per_step][1]]
    return {"span_us": sum(spans) / kept, "kernels_per_step": per_step, "replays": kept,
            "chain_us": {k: round(v, 2) for k, v in sorted(charged.items(), key=lambda kv: -kv[1])},
            "busy_us": {k: round(v, 2) for k, v in busy.items()},
            "beside_us": round(sum(e - s for _, s, e in side) / kept, 2), "first_replay_ends": ends,
            "middle_layer": layer}


def profile_steps(args, config: ModelConfig, dtype) -> list[dict]:
    """Where a replayed step's time goes: each kernel's mean time per step (CUPTI through
    torch.profiler, 20 replays) for a few (B, T) cells, the gap (replay time minus the sum of
    kernel times: launch and dependency stalls between graph nodes), and each kernel's share of the
    step's critical path (critical_path: with PDL the kernels overlap, so their times do not add up)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(args.device)
    model = TransformerLM.random(config, dtype=dtype, device=device, max_positions=args.context + 256)
    small = small_rows_values(args.small_rows_matmul)[-1]
    engine = Engine(model, num_blocks=8 * (-(-(args.context + 128) // 16) + 2) + 8, block_size=16,
                    attention="triton", cuda_graphs=True, small_rows_matmul=small)
    rng = np.random.default_rng(0)
    rows = []
    for B, T in [tuple(int(x) for x in cell.split("x")) for cell in args.profile_cells.split(",")]:
        seqs = fill(engine, B, args.context)
        steps = [TreeStep(s, rng.integers(0, config.vocab_size, size=T).tolist(), random_parents(T, rng)) for s in seqs]

        def step() -> None:
            engine.verify(steps)
            for s in seqs:
                s.truncate(args.context)

        step()
        graph = replayed_graph(engine, B, T)
        replay = cuda_ms(graph.replay, 10, 50)
        n = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                graph.replay()
            torch.cuda.synchronize()
        kernels = {}
        timeline = []
        for e in prof.events():
            if e.device_type.name == "CUDA" and e.device_time_total > 0:
                k = kernels.setdefault(e.name[:90], [0.0, 0])
                k[0] += e.device_time_total / n
                k[1] += 1 / n
                timeline.append((e.name[:90], e.time_range.start, e.time_range.end))
        total_us = sum(v[0] for v in kernels.values())
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
        row = {"batch": B, "tree": T, "small_rows_matmul": small, "replay_ms": replay, "kernel_sum_ms": total_us / 1000,
               "kernels_per_step": round(sum(v[1] for v in kernels.values()), 1),
               "top": [{"name": k, "us_per_step": round(v[0], 2), "launches_per_step": round(v[1], 1)} for k, v in top]}
        try:
            row["critical_path"] = critical_path(timeline, n, config.n_layer)
        except ValueError as exc:   # a replay with a kernel more or less than the others: no per-step chain
            row["critical_path"] = {"error": str(exc)}
        rows.append(row)
        log("[profile]", json.dumps({k: v for k, v in row.items() if k not in ("top", "critical_path")}))
        for t in row["top"]:
            log(f"    {t['us_per_step']:9.2f} us  x{t['launches_per_step']:<6} {t['name']}")
        path = row["critical_path"]
        log(f"[critical path] {B}x{T}: span {path.get('span_us', math.nan):.1f} us, beside {path.get('beside_us')} us")
        for label, us in list(path.get("chain_us", {}).items())[:16]:
            log(f"    {us:9.2f} us on the chain, {path['busy_us'][label]:9.2f} us busy  {label}")
        for name, start, end in path.get("first_replay_ends", []):
            log(f"    {start:9.2f} -> {end:9.2f} us  {name}")
        for name, start, end, charge in path.get("middle_layer", []):
            log(f"    layer {config.n_layer // 2}: {start:8.2f} -> {end:8.2f} us (+{charge:6.2f})  {name}")
        for s in seqs:
            s.close()
    return rows


def bench_hf(args, config: ModelConfig) -> list[dict]:
    """HF transformers at the same shape, same run: forward of T tokens over a context of
    args.context in a DynamicCache, argmax to the host, crop the cache back."""
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    hf_config = Qwen2Config(vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.d_ff,
                            num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                            num_key_value_heads=config.n_head_kv, max_position_embeddings=args.context + 512,
                            rope_theta=config.rope_theta, tie_word_embeddings=True, torch_dtype=torch.bfloat16)
    hf_config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(hf_config).to(torch.bfloat16).eval()
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        ctx_ids = torch.randint(0, config.vocab_size, (B, args.context), device="cuda")
        with torch.no_grad():
            cache = DynamicCache()
            model(ctx_ids, past_key_values=cache, use_cache=True)
        for T in [int(t) for t in args.trees.split(",")]:
            ids = torch.randint(0, config.vocab_size, (B, T), device="cuda")

            def step() -> None:
                with torch.no_grad():
                    out = model(ids, past_key_values=cache, use_cache=True)
                    out.logits.argmax(-1).cpu()
                cache.crop(args.context)

            rows.append({"batch": B, "tree": T, "hf_ms": wall_ms(step, max(3, args.warmup // 3), args.iters)})
            log("[hf]", json.dumps(rows[-1]))
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny model, context 64 (smoke test, any device)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--trees", default="1,16,64,128")
    p.add_argument("--attention", default="triton,torch",
                   help="engine variants to time: triton, torch, and either with -unfused (no fused.py kernels); "
                        "triton@P:K sets the key-split policy (about P programs, >= K keys per split), "
                        "triton#MxN pins the attention tiles (both: triton@P:K#MxN), %%NxKrROWS=C.BK.S.W.ST+... sets small-rows "
                        "matmul configs (fused.LINEAR_ROWS_TABLE), a last !KNOB=V:KNOB=V sets "
                        "other TritonPagedAttention knobs (triton!NUM_WARPS=8), and !BLAS=cublaslt picks torch's BLAS library")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--skip", default="",
                   help="comma-separated sections to skip: ceilings,checks,attention,matmuls,step,mixed,hf,capacity")
    p.add_argument("--checks", default="kernel,engine,compaction,gemv_rope,rows_rope,move_rows,tree_split,pdl,l2_warm",
                   help="which checks the checks section runs")
    p.add_argument("--small-rows-matmul", default="",
                   help="step cells with these Engine small_rows_matmul values, comma-separated: off (0), on (64) "
                        "or a row bound; empty: the engine's default. --profile-cells profiles the last one")
    p.add_argument("--matmul-rows", default="1,16,64,512")
    p.add_argument("--matmul-split-k", default="2,3,4",
                   help="K slices for wo and w2 on cuBLAS as one batched GEMM (fused.linear_split_k), where K divides")
    p.add_argument("--matmul-sweep", action="store_true", help="time MATMUL_CANDIDATES block configs too")
    p.add_argument("--matmul-pick", action="store_true",
                   help="with --matmul-sweep: the fastest configs replace fused.LINEAR_ROWS_TABLE's for the step")
    p.add_argument("--attention-shapes", default="8x4096,32x2048,8x32768",
                   help="BxL (64 tree nodes) or BxLxT, comma-separated")
    p.add_argument("--attention-heads", default="64/8", help="query/KV heads of the attention shapes")
    p.add_argument("--attention-configs", default="0x0w4s0,64x64w4s3,64x32w4s2,128x32w4s2",
                   help="Triton tile configurations to time: BMxBNwWARPSsSTAGES, comma-separated (0: the kernel's own choice)")
    p.add_argument("--top2-configs", default="", help="time argmax_top2 chunk configs BLOCKwWARPS (comma-separated)")
    p.add_argument("--top2-rows", default="16,64,512")
    p.add_argument("--mixed-batches", default="1,7,8", help="trees per step in the mixed prefill section")
    p.add_argument("--capacity-sessions", default="1,8,32")
    p.add_argument("--capacity-trees", default="1,16,32")
    p.add_argument("--capacity-s", type=float, default=4.0, help="measured seconds per capacity cell")
    p.add_argument("--capacity-warmup-s", type=float, default=4.0)
    p.add_argument("--out", default=None, help="write all results here (JSON)")
    p.add_argument("--capacity-rejoin", action="store_true",
                   help="put a session that leaves its recorded answer back on it (RecordedTrees docstring)")
    p.add_argument("--model", help="a GGUF target: capacity with real weights (needs --capacity-trace)")
    p.add_argument("--capacity-trace", help="comma-separated JSON-lines files of recorded trees "
                                            "(tools/bench_tau.py --record-trees) that capacity clients replay")
    p.add_argument("--profile-cells", default="",
                   help="BxT cells to profile kernel by kernel (e.g. 1x1,1x64,8x64); empty: no profile")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        log("no CUDA device visible to torch")
        return 2
    if args.small:
        args.context, args.batches, args.trees, args.warmup, args.iters = 64, "1,2", "1,4", 1, 3
        args.capacity_sessions, args.capacity_trees, args.capacity_s, args.capacity_warmup_s = "1,3", "1,4", 1.0, 0.5
        if not cuda:
            args.attention = "torch"
    result: dict = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "cuda": torch.version.cuda, "argv": sys.argv[1:], "kernel_knobs_from_env": kernel_knobs.FROM_ENV,
        "kernel_knobs": kernel_knobs.current(), "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}}
    try:
        import triton
        result["meta"]["triton"] = triton.__version__
    except ImportError:
        pass
    ceil = None
    if cuda and "ceilings" not in skip:
        ceil = result["ceilings"] = ceilings()
        log("[ceilings]", json.dumps(ceil))
    checks = set(args.checks.split(","))
    if cuda and "checks" not in skip and "kernel" in checks:
        result["kernel_check_rel_err"] = check_kernel()
        log("[check] triton kernel vs float64 reference, relative error:", json.dumps(result["kernel_check_rel_err"]))
    if cuda and "checks" not in skip and "tree_split" in checks:   # the kernel with the tree's keys in a split of their own
        with attention_knobs(TREE_SPLIT=1):
            result["tree_split_check_rel_err"] = check_kernel()
        log("[check] TREE_SPLIT=1 kernel vs float64 reference:", json.dumps(result["tree_split_check_rel_err"]))
    if cuda and "checks" not in skip and "engine" in checks:
        result["engine_checks"] = []
        for a in ("triton", "torch"):
            try:
                result["engine_checks"].append(check_engine(a))
            except Exception as exc:  # noqa: BLE001 - report, go on
                result["engine_checks"].append({"attention": a, "error": f"{type(exc).__name__}: {exc}"[:600]})
        log("[check] engine with CUDA graphs vs accept_greedy on eager logits:", json.dumps(result["engine_checks"]))
    for name, check, what in (("compaction", check_compaction, "compaction between graph steps vs none"),
                              ("gemv_rope", check_rope_in_matmul, "RoPE in the one-row wqkv GEMV vs its own launch"),
                              ("rows_rope", lambda: check_rope_in_matmul("ROWS_ROPE"),
                               "RoPE in the 16-row wqkv matmul vs its own launch"),
                              ("move_rows", check_move_rows, "the compaction copy kernel vs index_copy_"),
                              ("pdl", check_pdl, "programmatic dependent launch vs plain launches"),
                              ("l2_warm", check_l2_warm, "the next weights warmed into L2 beside attention vs not")):
        if cuda and "checks" not in skip and name in checks:
            try:
                result[f"{name}_check"] = check()
            except Exception as exc:  # noqa: BLE001 - report, go on
                result[f"{name}_check"] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
            log(f"[check] {what}:", json.dumps(result[f"{name}_check"]))
    if cuda and ceil and "attention" not in skip:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.attention_shapes.split(",")]
        heads = tuple(int(h) for h in args.attention_heads.split("/"))
        result["attention"] = bench_attention(shapes, 64, args.warmup, args.iters, ceil, args.attention_configs, heads)
    if cuda and args.top2_configs:
        result["top2"] = bench_top2([int(r) for r in args.top2_rows.split(",")], args.top2_configs, args.iters, ceil)
    if cuda and not args.small and "matmuls" not in skip:
        result["matmuls"] = bench_matmuls(args, ceil)
    config = ModelConfig.tiny("qwen2") if args.small else ModelConfig.qwen2_1_5b()
    dtype = torch.bfloat16 if cuda else torch.float32
    if "step" not in skip:
        result["step"] = bench_steps(args, config, dtype, ceil)
    if "mixed" not in skip:
        result["mixed"] = bench_mixed(args, config, dtype, ceil)
    if cuda and not args.small and "hf" not in skip:
        try:
            result["hf"] = bench_hf(args, config)
        except Exception as exc:  # noqa: BLE001 - report, keep the rest
            result["hf_error"] = f"{type(exc).__name__}: {exc}"[:400]
            log("[hf] failed:", result["hf_error"])
    if "capacity" not in skip:
        result["capacity"] = bench_capacity(args, config, dtype)
    if cuda and args.profile_cells:   # last: once the profiler (CUPTI) has run, every later graph launch costs
        # more on the host (H200, 2026-12-02: the replay call took 0.18-0.26 ms after it, 0.01-0.10 ms without)
        result["profile"] = profile_steps(args, config, dtype)
    if args.model and args.capacity_trace:
        from edgespec.verifier.torch import gguf_weights

        trace = [json.loads(line) for path in args.capacity_trace.split(",") for line in open(path)]
        t0 = time.perf_counter()
        real = gguf_weights.load_model(args.model, dtype=torch.bfloat16, device=args.device, max_positions=8192)
        log(f"[capacity] real weights {args.model} loaded in {time.perf_counter() - t0:.1f} s; {len(trace)} recorded answers")
        result["capacity_real"] = bench_capacity(args, real.config, torch.bfloat16, real, trace)
    result["meta"]["params"] = config.n_params
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    log(summary(result))
    return 0


def summary(result: dict) -> str:
    lines = []
    hf = {(r["batch"], r["tree"]): r["hf_ms"] for r in result.get("hf", [])}
    for m in result.get("matmuls", {}).get("rows", []):
        lines.append(f"matmul {m['matrix']} rows {m['rows']}: cuBLAS {m['cublas_us']:.2f} us, linear_rows "
                     f"{m.get('triton_us', math.nan):.2f} us {m.get('config', '')}, floor {m['floor_us']:.2f} us, "
                     f"err {m['cublas_max_abs_err']:.3g} / {m.get('triton_max_abs_err', math.nan):.3g}, "
                     f"in forward: {m.get('in_forward')}")
    if result.get("step"):
        lines.append("| attention | B | T | step ms | graph replay ms | floor ms | step/floor | HF ms | step/HF |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in result["step"]:
            if "error" in r:
                lines.append(f"| {r['attention']} | error: {r['error'][:200]} |")
                continue
            f, h = r.get("floor_ms"), hf.get((r["batch"], r["tree"]))
            lines.append(f"| {r['attention']} | {r['batch']} | {r['tree']} | {r['step_ms']:.3f} | "
                         f"{r.get('replay_ms', math.nan):.3f} | {f or math.nan:.3f} | "
                         f"{(r['step_ms'] / f) if f else math.nan:.2f} | {h or math.nan:.2f} | "
                         f"{(r['step_ms'] / h) if h else math.nan:.3f} |")
    cap = {(r["sessions"], r["tree"]): r for r in result.get("capacity", [])}
    for (n, T), r in sorted(cap.items()):
        ar = cap.get((n, 1))
        need = f", tau needed for 2.5x AR tokens/s: {2.5 * ar['requests_per_s'] / r['requests_per_s']:.2f}" if ar and T > 1 else ""
        lines.append(f"capacity {n} sessions, T={T}: {r['requests_per_s']:.1f} requests/s, mean batch "
                     f"{r['mean_batch']:.1f}, latency {r['mean_latency_ms']:.2f} ms{need}")
    real = {(r["sessions"], r["tree"]): r for r in result.get("capacity_real", [])}
    for (n, T), r in sorted(real.items()):
        ar = real.get((n, 1))
        vs = f", {r['tokens_per_s'] / ar['tokens_per_s']:.2f}x the AR tokens/s" if ar and T > 1 else ""
        lines.append(f"capacity, real weights + recorded trees, {n} sessions, budget {T}: {r['tokens_per_s']:.0f} "
                     f"tokens/s ({r['tokens_per_request']:.2f} per request, {r['requests_per_s']:.0f} requests/s, "
                     f"mean batch {r['mean_batch']:.1f}, recorded trees {r.get('recorded_tree_share', 0):.2f}){vs}")
    for r in result.get("attention", []):
        lines.append(f"attention B={r['batch']} L={r['context']}: triton {r.get('triton_ms', math.nan):.4f} "
                     f"({r.get('triton_config')}), torch paged {r.get('torch_paged_ms', math.nan):.4f}, "
                     f"cuDNN no-mask {r.get('sdpa_cudnn_nomask_ms', math.nan):.4f}, flash no-mask "
                     f"{r.get('sdpa_flash_nomask_ms', math.nan):.4f}, floor {r['floor_ms']:.4f} ms (graph-replayed); "
                     f"one eager call: triton {r.get('triton_percall_ms', math.nan):.4f}, cuDNN "
                     f"{r.get('sdpa_cudnn_nomask_percall_ms', math.nan):.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
