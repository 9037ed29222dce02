"""Tree attention over the paged KV cache as a Triton kernel (CUDA), same interface as
tree_attention.TorchPagedAttention (the reference it is checked against).

One program handles one (sequence, KV head) pair, one tile of query rows and one split of the keys.
Query rows are the G query heads of that KV head times the T tree tokens (row r = t * G + g), so each
K/V tile is read once per group and the matrix products are G*T rows tall (GQA-aware). Keys are the
sequence's cache positions 0..ctx+T-1, read through the block table (no gather into a contiguous
copy, no concatenation); the tree part is masked with packed ancestor bits ([B, T, ceil(T/32)]
int32, bit j of row t: node j is t or an ancestor of t). Long contexts are split over several
programs (flash-decoding); a second small kernel merges the splits with their log-sum-exp. The
query tiles of one (sequence, KV head) are adjacent programs, so its K/V is read from HBM about once
and then from L2; in the key loop each tile's block ids are loaded one tile ahead, so its K/V loads
wait on no table load.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from edgespec.verifier.torch import pdl
from edgespec.verifier.torch.fused import launch_fitting
from edgespec.verifier.torch.pdl import gdc_enter, gdc_release, prefetch_l2
from edgespec.verifier.torch.tree_ops import pack_ancestor_bits


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _blocks(Tables, b, n_tables, j0, end, BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
            OFF32: tl.constexpr):
    """The cache block of each key j0..j0+BLOCK_N-1 (0 past `end` when MASKED); int32 with OFF32 (every
    element offset into the layer's cache fits: the address arithmetic below stays 32-bit)."""
    j = j0 + tl.arange(0, BLOCK_N)
    if MASKED:
        blk = tl.load(Tables + b * n_tables + j // BS, mask=j < end, other=0)
    else:
        blk = tl.load(Tables + b * n_tables + j // BS)
    if OFF32:
        blk = blk.to(tl.int32)
    return blk


@triton.jit
def _tree_bits(Bits, b, t, row_ok, rel0, rel, in_tree, T, W, BLOCK_N: tl.constexpr):
    """[rows, keys] 0/1: key `rel` (tree node index, valid where in_tree) is query row t's ancestor or t.
    A tile of BLOCK_N keys spans at most ceil(BLOCK_N / 32) + 1 words of a row's packed bits: each is loaded
    once per row and picked per key (a load per (row, key) cost ~4x the instructions of the whole
    unmasked tile: docs/BENCHMARKS.md, 2026-12-02)."""
    w_lo = tl.maximum(rel0, 0) // 32
    row_words = Bits + (b * T + t) * W
    widx = tl.where(in_tree, rel >> 5, -1)   # rel // 32 where it matters (rel >= 0)
    word = tl.load(row_words + w_lo, mask=row_ok & (w_lo < W), other=0)
    picked = tl.where((widx == w_lo)[None, :], word[:, None], 0)
    for k in tl.static_range(1, (BLOCK_N + 31) // 32 + 1):
        word = tl.load(row_words + w_lo + k, mask=row_ok & (w_lo + k < W), other=0)
        picked = tl.where((widx == w_lo + k)[None, :], word[:, None], picked)
    return (picked >> (rel & 31)[None, :]) & 1


@triton.jit
def _prefetch_context(KV, Tables, b, h, n_tables, start, stop, kv_stride_kv, H_KV: tl.constexpr, D: tl.constexpr,
                      BS: tl.constexpr, KEYS: tl.constexpr, LINE_ELEMS: tl.constexpr, GDC: tl.constexpr):
    """Ask L2 for the K and V lines of keys start..start+KEYS-1 (below `stop`) of KV head h: issued before
    the PDL wait, so the key loop's first loads hit L2 instead of waiting on HBM. A prefetch changes no value."""
    j = start + tl.arange(0, KEYS)
    ok = j < stop
    blk = tl.load(Tables + b * n_tables + j // BS, mask=ok, other=0)
    row = ((blk * BS + j % BS) * H_KV + h) * D   # the key's K row, in elements (64-bit: the offsets are not hot)
    lines = tl.arange(0, D // LINE_ELEMS) * LINE_ELEMS
    offsets = row[:, None] + lines[None, :]
    prefetch_l2(KV, offsets, ok[:, None], GDC)   # (prefetch_l2's where broadcasts the key mask over the lines)
    prefetch_l2(KV + kv_stride_kv, offsets, ok[:, None], GDC)


@triton.jit
def _tile(q, KV, blk, Bits, m_i, l_i, acc, b, h, t, row_ok, d, ctx, j0, end, qk_scale, kv_stride_kv, T, W,
          H_KV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One key tile of online softmax: keys j0..j0+BLOCK_N-1, in cache blocks `blk` (_blocks). Tiles
    wholly inside the context (MASKED=False) need no mask at all: every key there is visible."""
    j = j0 + tl.arange(0, BLOCK_N)
    if MASKED:
        key_ok = j < end
    slot = blk * BS + j % BS
    k_ptr = KV + (slot * H_KV + h)[:, None] * D + d[None, :]
    if MASKED:
        k = tl.load(k_ptr, mask=key_ok[:, None], other=0.0)
        v = tl.load(k_ptr + kv_stride_kv, mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptr)
        v = tl.load(k_ptr + kv_stride_kv)
    s = tl.dot(q, tl.trans(k))   # unscaled: the scale rides in the exp2's FMA below (one instruction, not two)
    if MASKED:
        rel = j - ctx
        in_tree = (rel >= 0) & (rel < T) & key_ok
        bit = _tree_bits(Bits, b, t, row_ok, j0 - ctx, rel, in_tree, T, W, BLOCK_N)
        visible = (((j < ctx) | (j == 0)) & key_ok)[None, :] | (bit != 0)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)   # the row maxima in the scaled (log2) units
    if MASKED:   # a row may see no key of this tile (its maximum stays -inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:        # every key visible: the maximum is finite (exp2(-inf) = 0 for a first tile's m_i)
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * qk_scale - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _tree_attn_split(Q, KV, Tables, Ctx, Bits, Acc, M, L, O,
                     sm_scale, kv_stride_kv, n_tables, T, G, W, MT,
                     MAX_TILES: tl.constexpr, INTERPRET: tl.constexpr, H_Q: tl.constexpr, H_KV: tl.constexpr,
                     D: tl.constexpr, BS: tl.constexpr,
                     NSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     M_FIRST: tl.constexpr, TREE_SPLIT: tl.constexpr, OFF32: tl.constexpr, GDC: tl.constexpr,
                     EARLY_INDEX: tl.constexpr, PREFETCH_KEYS: tl.constexpr, LINE_ELEMS: tl.constexpr):
    if not EARLY_INDEX:
        gdc_enter(GDC)
    if M_FIRST:   # the query tiles of one (sequence, KV head) side by side: they read the same K/V
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(2)
    else:
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(2)
    pid_s = tl.program_id(1)
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    ctx = tl.load(Ctx + b).to(tl.int32)   # key indices in 32 bits: half the index instructions of int64
    n_keys = ctx + T
    if TREE_SPLIT:   # the last split takes the tree's keys alone; the others share the context's
        per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), NSPLIT - 1)
        start = tl.where(pid_s == NSPLIT - 1, ctx, pid_s * per_split * BLOCK_N)
        end = tl.where(pid_s == NSPLIT - 1, n_keys, tl.minimum(start + per_split * BLOCK_N, ctx))
    else:
        per_split = tl.cdiv(tl.cdiv(n_keys, BLOCK_N), NSPLIT)
        start = pid_s * per_split * BLOCK_N
        end = tl.minimum(start + per_split * BLOCK_N, n_keys)

    if EARLY_INDEX:
        # Before the PDL wait, what no kernel of this step writes (EARLY_INDEX): the lengths and block tables
        # are the host's copies, the context's K/V older steps' (this step's tree rows lie past ctx). The wait
        # then leads straight to the query load; PREFETCH_KEYS asks L2 for the split's first context keys
        blk_first = _blocks(Tables, b, n_tables, start, end, BS, BLOCK_N, True, OFF32)
        if PREFETCH_KEYS:
            _prefetch_context(KV, Tables, b, h, n_tables, start, tl.minimum(end, ctx), kv_stride_kv,
                              H_KV, D, BS, PREFETCH_KEYS, LINE_ELEMS, GDC)
        gdc_enter(GDC)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * T
    t = rows // G
    g = rows % G
    d = tl.arange(0, D)
    q_ptr = Q + ((b * T + t) * H_Q + h * G + g)[:, None] * D + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp2 below
    if INTERPRET:  # the CPU interpreter (tests) loops only to a host int: the bucket's maximum
        for it in range(0, MAX_TILES):
            j0 = start + it * BLOCK_N
            if j0 >= end:   # past the split's keys (a whole tile masked off would change nothing): done
                break
            if j0 + BLOCK_N <= tl.minimum(end, ctx):  # a Python branch when interpreted
                blk = _blocks(Tables, b, n_tables, j0, end, BS, BLOCK_N, False, OFF32)
                m_i, l_i, acc = _tile(q, KV, blk, Bits, m_i, l_i, acc, b, h, t, row_ok, d, ctx, j0, end, qk_scale,
                                      kv_stride_kv, T, W, H_KV, D, BS, BLOCK_N, False)
            else:
                blk = _blocks(Tables, b, n_tables, j0, end, BS, BLOCK_N, True, OFF32)
                m_i, l_i, acc = _tile(q, KV, blk, Bits, m_i, l_i, acc, b, h, t, row_ok, d, ctx, j0, end, qk_scale,
                                      kv_stride_kv, T, W, H_KV, D, BS, BLOCK_N, True)
    else:
        # tiles wholly inside the context first (no masks), then the rest (context tail + tree)
        plain = tl.maximum(tl.minimum(end, ctx) - start, 0) // BLOCK_N
        # each tile's block ids are loaded one tile early: its K/V loads need not wait for them (H200,
        # 2026-12-01: 1.69 -> 1.36 ms at 8 x 32768, 0.36 -> 0.30 at 8 x 4096 against a load per tile)
        if EARLY_INDEX:
            blk = blk_first
        else:
            blk = _blocks(Tables, b, n_tables, start, end, BS, BLOCK_N, True, OFF32)
        for it in range(0, plain):
            j0 = start + it * BLOCK_N
            ahead = _blocks(Tables, b, n_tables, j0 + BLOCK_N, end, BS, BLOCK_N, True, OFF32)
            m_i, l_i, acc = _tile(q, KV, blk, Bits, m_i, l_i, acc, b, h, t, row_ok, d, ctx, j0, end, qk_scale,
                                  kv_stride_kv, T, W, H_KV, D, BS, BLOCK_N, False)
            blk = ahead
        for it in range(plain, tl.cdiv(end - start, BLOCK_N)):
            j0 = start + it * BLOCK_N
            blk = _blocks(Tables, b, n_tables, j0, end, BS, BLOCK_N, True, OFF32)
            m_i, l_i, acc = _tile(q, KV, blk, Bits, m_i, l_i, acc, b, h, t, row_ok, d, ctx, j0, end, qk_scale,
                                  kv_stride_kv, T, W, H_KV, D, BS, BLOCK_N, True)
    gdc_release(GDC)
    if NSPLIT == 1:   # one split: normalise and write the output here (no merge launch)
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        o_ptr = O + ((b * T + t) * H_Q + h * G + g)[:, None] * D + d[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        base = (pid_bh * NSPLIT + pid_s) * MT + rows
        tl.store(M + base, m_i, mask=row_ok)
        tl.store(L + base, l_i, mask=row_ok)
        tl.store(Acc + base[:, None] * D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _tree_attn_merge(Acc, M, L, O, T, G, MT,
                     H_Q: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr,
                     SPLITS_P2: tl.constexpr, ROWS: tl.constexpr, GDC: tl.constexpr):
    """One program per (sequence, KV head) and ROWS query rows: every split's partial result is loaded in
    one go (no loop of dependent loads: a merge is latency-bound, not bandwidth-bound)."""
    gdc_enter(GDC)
    pid_bh = tl.program_id(0)
    row = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    row_ok = row < MT
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    sp = tl.arange(0, SPLITS_P2)
    ok = row_ok[:, None] & (sp < NSPLIT)[None, :]
    d = tl.arange(0, D)
    base = (pid_bh * NSPLIT + sp)[None, :] * MT + row[:, None]                       # [ROWS, SPLITS]
    m = tl.load(M + base, mask=ok, other=float("-inf"))
    l_ = tl.load(L + base, mask=ok, other=0.0)
    acc = tl.load(Acc + base[:, :, None] * D + d[None, None, :], mask=ok[:, :, None], other=0.0)   # [ROWS, SPLITS, D]
    m_max = tl.max(m, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max[:, None])
    out = tl.sum(w[:, :, None] * acc, 1) / tl.maximum(tl.sum(w * l_, 1), 1e-30)[:, None]
    t = row // G
    g = row % G
    tl.store(O + ((b * T + t) * H_Q + h * G + g)[:, None] * D + d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])


class TritonPagedAttention:
    """Same constructor and call as TorchPagedAttention; the split count is fixed per shape bucket
    (tables' width), so the launch is CUDA-graph safe (lengths are read on the device)."""

    BLOCK_M = 0      # 0: chosen from the number of query rows (tile_config); benchmarks may pin them
    BLOCK_N = 0
    NUM_WARPS = 4
    NUM_STAGES = 0   # 0: chosen with the key tile (tile_config)
    LONG_SPLIT_KEYS = 1024  # a split of at least this many keys gets 64-key tiles and 3 stages
    TARGET_PROGRAMS = 384   # key splits aim at about this many programs (~3 waves of the H200's 132 SMs) ...
    MIN_SPLIT_KEYS = 128    # ... but give each split at least this many keys (fewer partials to write and merge)
    FEW_ROWS_SPLIT_KEYS = 32  # ... except for a 16-row query tile (T = 1 or 2): down to one key tile per split.
                              # A few rows are a latency-bound chain of tile loads; at context 1024 (12/2 heads)
                              # 32 splits took 5.95 us a layer against 7.97 for 8 (H200, 2026-12-01)
    M_FIRST = 1             # program ids put a (sequence, KV head)'s query tiles next to each other (shared K/V
                            # in L2): 0.82 -> 0.67 ms at 32 x 2048, 3-4 % at 8 x 4096 and 8 x 32768 (H200, 2026-12-01)
    M_TILE_FIT = 0          # 1: past 32 query rows, 32-row tiles where they pad fewer rows than 64-row ones (T = 16 at
                            # 6 query heads per KV head: 96 rows in 3 tiles, where 2 tiles of 64 compute 32 padding rows).
                            # Off: on the H200 (2026-12-03, docs/BENCHMARKS.md fourteenth session, replays round-robin)
                            # 1 x 16 -0.6 % (noise), 8 x 16 +5.6 %
    MERGE_ROWS = 8          # query rows a merge program takes (a power of two) in steps of MERGE_ROWS_FROM token rows
    MERGE_ROWS_FROM = 512   # or more (fewer: one row a program). At 8 x 64 one row a program is 6 144 one-warp
                            # programs a layer. H200, 2026-12-04 (docs/BENCHMARKS.md twenty-second session), replays
                            # round-robin: 8 rows at every row count made 8 x 64 1.4 % faster but 1 x 1 2.6 %, 4 x 1
                            # 6.7 % and 1 x 64 0.6 % slower (a program holds SPLITS x ROWS partial rows: T = 1 has 32
                            # splits)
    TREE_SPLIT = 0          # 1: one more split that takes the tree's (masked) keys alone, so that the context's
                            # programs run unmasked tiles only and the tree tile's unpipelined loads overlap them.
                            # Off: on the H200 (2026-12-02, docs/BENCHMARKS.md ninth session) steps were up to 4.6 %
                            # slower (8 x 16) and the BASELINES shapes 10-33 % slower with the default tiles; only
                            # 8 x 32768 with 128 x 64 tiles, 8 warps, 3 stages gained (4 %).

    EARLY_INDEX = 0         # 1: with PDL, each split program reads the sequence's length and its first block ids before
                            # the wait for the kernel before it (RoPE / wqkv), not after: neither is written in the step
    PREFETCH_KEYS = 0       # with PDL, ask L2 for the K/V lines of each split's first PREFETCH_KEYS context keys before
                            # that wait (a power of two; 0: none; implies EARLY_INDEX). The context's K/V is HBM-cold
                            # by then (a step streams ~3 GB of weights through L2), and at 1 x 64 a split is 2-3 key
                            # tiles whose loads wait on HBM one after another

    def tile_config(self, rows: int, split_keys: int) -> tuple[int, int, int]:
        """(BLOCK_M, BLOCK_N, stages) for `rows` query rows per (sequence, KV head) and about
        `split_keys` keys per program. 64-row tiles for tall query groups, short ones for a handful
        of rows (T = 1: G rows). Measured on the H200 (docs/BENCHMARKS.md, 2026-12-01): at the
        Qwen2.5-1.5B shape (context 1024, 128-256 keys per split) 64 x 32 tiles with 2 stages were
        the fastest of 88 configurations; on long splits (BASELINES.md shapes: 2k-32k keys in one
        program) 64 x 32 was 1.2-1.5x slower than 64 x 64 with 3 stages, the fastest there but
        one (128 x 32 at 32 x 2048)."""
        bm = self.BLOCK_M or min(64, max(16, triton.next_power_of_2(rows)))
        if not self.BLOCK_M and self.M_TILE_FIT and rows > 32 and -(-rows // 32) * 32 < -(-rows // bm) * bm:
            bm = 32
        long = split_keys >= self.LONG_SPLIT_KEYS
        bn = self.BLOCK_N or (64 if long or bm < 64 else 32)
        stages = self.NUM_STAGES or (3 if long else 2)
        return bm, bn, stages

    def __init__(self, tables: torch.Tensor, ctx_lens: torch.Tensor, anc: torch.Tensor, block_size: int,
                 group: int, nsplit: int | None = None) -> None:
        self._setup(tables, ctx_lens, pack_ancestor_bits(anc), block_size, group, nsplit)

    @classmethod
    def packed(cls, tables: torch.Tensor, ctx_lens: torch.Tensor, bits: torch.Tensor, block_size: int,
               group: int) -> "TritonPagedAttention":
        """The same from ancestor bits already packed (tree_ops.prepare's output): no packing launches."""
        self = cls.__new__(cls)
        self._setup(tables, ctx_lens, bits, block_size, group, None)
        return self

    def _setup(self, tables: torch.Tensor, ctx_lens: torch.Tensor, bits: torch.Tensor, block_size: int,
               group: int, nsplit: int | None) -> None:
        self.tables = tables.contiguous()
        self.ctx = ctx_lens.contiguous()
        self.bits = bits.contiguous()
        self.block_size = block_size
        self.group = group
        self.max_keys = tables.shape[1] * block_size
        self.nsplit = nsplit

    def splits(self, B: int, h_kv: int, m_tiles: int, block_m: int) -> int:
        """Enough programs to fill the GPU (TARGET_PROGRAMS), but >= MIN_SPLIT_KEYS keys per split
        (FEW_ROWS_SPLIT_KEYS for 16-row tiles); at most 32 splits."""
        if self.nsplit:
            return self.nsplit
        want = math.ceil(self.TARGET_PROGRAMS / max(1, B * h_kv * m_tiles))
        most = max(1, self.max_keys // (self.FEW_ROWS_SPLIT_KEYS if block_m <= 16 else self.MIN_SPLIT_KEYS))
        return int(max(1, min(want, most, 32)))

    @classmethod
    def merge_rows(cls, token_rows: int) -> int:
        """Query rows a merge program takes in a step of `token_rows` (B * T) token rows (MERGE_ROWS)."""
        return cls.MERGE_ROWS if token_rows >= cls.MERGE_ROWS_FROM else 1

    def launch_config(self, B: int, rows: int, h_kv: int) -> tuple[int, int, int, int]:
        """(BLOCK_M, BLOCK_N, stages, splits) for B sequences of `rows` query rows per KV head."""
        block_m = self.tile_config(rows, 0)[0]
        ns = self.splits(B, h_kv, triton.cdiv(rows, block_m), block_m) + (1 if self.TREE_SPLIT else 0)
        _, block_n, stages = self.tile_config(rows, self.max_keys // ns)
        return block_m, block_n, stages, ns

    def __call__(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        B, T, Hq, D = q.shape
        Hkv = cache.shape[2]
        G = Hq // Hkv
        q = q.contiguous()
        MT = G * T
        block_m, block_n, stages, ns = self.launch_config(B, MT, Hkv)
        m_tiles = triton.cdiv(MT, block_m)
        out = torch.empty_like(q)
        parts = ns if ns > 1 else 0   # one split writes `out` itself
        acc = torch.empty(B * Hkv, parts, MT, D, dtype=torch.float32, device=q.device)
        m = torch.empty(B * Hkv, parts, MT, dtype=torch.float32, device=q.device)
        l_ = torch.empty_like(m)
        W = self.bits.shape[2]
        grid = (m_tiles, ns, B * Hkv) if self.M_FIRST else (B * Hkv, ns, m_tiles)
        gdc = pdl.launch_args(q.device, B * T)
        early = bool(gdc["GDC"] and (self.EARLY_INDEX or self.PREFETCH_KEYS))   # only where there is a wait
        prefetch = triton.next_power_of_2(self.PREFETCH_KEYS) if early and self.PREFETCH_KEYS else 0
        launch_fitting(   # (fewer stages where a smaller GPU's shared memory cannot hold the tiles' pipeline)
            _tree_attn_split, grid, q, cache, self.tables, self.ctx, self.bits, acc, m, l_, out,
            1.0 / math.sqrt(D), cache.stride(0), self.tables.shape[1], T, G, W, MT,
            # (the interpreter's loop bound: a context split's tiles, or the tree's T keys in a split of their own)
            MAX_TILES=max(triton.cdiv(triton.cdiv(self.max_keys + T, block_n), max(1, ns - self.TREE_SPLIT)),
                          triton.cdiv(T, block_n) if self.TREE_SPLIT else 0) + 1 if INTERPRET else 0,
            INTERPRET=INTERPRET, H_Q=Hq, H_KV=Hkv, D=D, BS=self.block_size, NSPLIT=ns, BLOCK_M=block_m, BLOCK_N=block_n,
            M_FIRST=bool(self.M_FIRST), TREE_SPLIT=bool(self.TREE_SPLIT), OFF32=cache.numel() < 2 ** 31,
            EARLY_INDEX=early, PREFETCH_KEYS=prefetch, LINE_ELEMS=128 // cache.element_size(),
            num_warps=self.NUM_WARPS, num_stages=stages, **gdc)
        if ns > 1:
            rows = self.merge_rows(B * T)
            _tree_attn_merge[(B * Hkv, triton.cdiv(MT, rows))](
                acc, m, l_, out, T, G, MT, H_Q=Hq, H_KV=Hkv, D=D, NSPLIT=ns, SPLITS_P2=triton.next_power_of_2(ns),
                ROWS=rows, num_warps=max(1, min(4, rows // 2)), **gdc)
        return out
