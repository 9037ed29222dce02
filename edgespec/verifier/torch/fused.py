"""Fused small ops for the GPU forward (Triton): at one token per sequence a step is ~45 tiny
kernels per layer when each torch op is its own launch, which costs more than the weights take to
read. These kernels cut a layer to ten launches: add+RMSNorm, QKV matmul, RoPE+cache write,
attention (2), output matmul, add+RMSNorm, gate/up matmul, SiLU*up, down matmul.

Each function here has a torch reference with the same signature (`*_torch`), used on the CPU (where
the float32 path must stay the exact reference) and by the tests, which run the Triton versions in
Triton's CPU interpreter against them. All arithmetic is float32; outputs are rounded once to the
model dtype.

`linear_rows` / `linear_rows_partials`: a skinny matmul for few rows (B*T <= 64), where cuBLAS picks
split-K kernels that take 3-5x the time the weight bytes need. Each program owns BLOCK_N output
columns and streams its weight rows once; where N / BLOCK_N gives too few programs to fill the GPU,
K is split across programs too and the float32 partials [SPLIT, rows, N] are summed by whoever
reads them next: add_rmsnorm (wo and w2 feed the residual add), so a split costs no extra launch.
One row (a verify step of one token) is a GEMV with its own persistent kernel (_gemv_kernel): a
fixed grid of programs that each stream several (column block, K slice) units with the next tile's
loads always in flight. Block sizes come from a static table per weight shape (LINEAR_ROWS_TABLE),
not triton.autotune (autotuning inside a CUDA-graph capture would run the candidates into the graph).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from edgespec.verifier.torch import pdl

try:
    import triton
    import triton.language as tl

    from edgespec.verifier.torch.pdl import gdc_enter, prefetch_l2
except ImportError:  # pragma: no cover - CPU installs without triton use the torch versions
    triton = None


# -- torch references -----------------------------------------------------------------------------
def add_rmsnorm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); x [rows, d] is updated in place. residual may be
    float32 matmul partials [S, rows, d] (linear_rows_partials): summed and rounded to x's dtype
    first, i.e. exactly the matmul's output."""
    if residual is not None:
        if residual.ndim == 3:
            residual = residual.sum(0).to(x.dtype)
        x += residual
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype), x


def rope_store_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                     slots: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    """qkv [rows, (Hq + 2 Hkv) * D]; cos, sin [rows, D/2] float32; cache [2, S, Hkv, D]. Writes the
    rotated K and the V rows into the cache slots; returns the rotated q [rows, Hq, D]."""
    rows = qkv.shape[0]
    D = cache.shape[-1]
    x = qkv.view(rows, n_head + 2 * n_head_kv, D)
    qk = x[:, :n_head + n_head_kv].float()
    x1, x2 = qk.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    qk = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(qkv.dtype)
    cache[0].index_copy_(0, slots, qk[:, n_head:])
    cache[1].index_copy_(0, slots, x[:, n_head + n_head_kv:])
    return qk[:, :n_head]


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2F] (gate; up) -> silu(gate) * up [rows, F]."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def linear_rows_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      silu: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias), x [rows, K]; with silu, x is a gate/up tensor [rows, 2K] and the
    input is silu_mul(x)."""
    return F.linear(silu_mul_torch(x) if silu else x, weight, bias)


def linear_rows_partials_torch(x: torch.Tensor, weight: torch.Tensor, *, silu: bool = False) -> torch.Tensor:
    """float32 partial sums [S, rows, N] of x @ weight.T (S = 1 here) whose sum over S is the product
    before rounding; add_rmsnorm takes them as its residual."""
    x = silu_mul_torch(x) if silu else x
    return (x.float() @ weight.float().t())[None]


def argmax_top2_torch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, V] -> (argmax [rows] int64, the first index of the maximum; top-2 margin [rows]:
    the largest minus the second largest value, 0 when the maximum occurs twice)."""
    top2 = logits.topk(2, dim=-1).values
    return logits.argmax(-1), top2[..., 0] - top2[..., 1]


# -- Triton kernels -------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _add_rmsnorm_kernel(X, R, W, Y, eps, N, rows, HAS_R: tl.constexpr, R_PARTS: tl.constexpr,
                            BLOCK: tl.constexpr, GDC: tl.constexpr, LINES: tl.constexpr):
        """R_PARTS > 0: R is float32 partials [R_PARTS, rows, N], summed and rounded to X's dtype
        (the matmul output they stand for) before the add."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        if GDC:   # the weight's lines into L2 while the previous kernel ends
            at = tl.arange(0, LINES) * (BLOCK // LINES)
            prefetch_l2(W, at, at < N, GDC)
        gdc_enter(GDC)
        x = tl.load(X + row * N + cols, mask=ok, other=0.0)
        if HAS_R:
            if R_PARTS > 0:
                r = tl.zeros([BLOCK], tl.float32)
                for p in tl.static_range(R_PARTS):
                    r += tl.load(R + (p * rows + row) * N + cols, mask=ok, other=0.0)
                r = r.to(x.dtype).to(tl.float32)
            else:
                r = tl.load(R + row * N + cols, mask=ok, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) + r).to(x.dtype)
            tl.store(X + row * N + cols, x, mask=ok)
        h = x.to(tl.float32)
        var = tl.sum(h * h, 0) / N
        y = h * (1.0 / tl.sqrt(var + eps)) * tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotate_and_store(x1, x2, c, s, head, d, row, slot, KC, VC, QO, v_offset, mask,
                          H_Q: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr):
        """The two halves (x1, x2; float32) of head `head` at offset d in the half (any broadcastable
        shapes): RoPE on the q and k heads, v heads as they are; q to row `row` of QO [rows, H_Q, D], k
        and v to cache slot `slot`. Shared by rope_store's kernel and the GEMV's RoPE epilogue."""
        rotate = head < H_Q + H_KV
        o1 = tl.where(rotate, x1 * c - x2 * s, x1).to(QO.dtype.element_ty)
        o2 = tl.where(rotate, x2 * c + x1 * s, x2).to(QO.dtype.element_ty)
        dst = tl.where(head < H_Q, QO + (row * H_Q + head) * D,
                       tl.where(head < H_Q + H_KV, KC + (slot * H_KV + head - H_Q) * D,
                                VC + v_offset + (slot * H_KV + head - H_Q - H_KV) * D)) + d
        tl.store(dst, o1, mask=mask)
        tl.store(dst + D // 2, o2, mask=mask)

    @triton.jit
    def _rope_store_kernel(QKV, Cos, Sin, Slots, KC, VC, QO, v_offset,
                           H_Q: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr,
                           GDC: tl.constexpr):
        """One program per token row and HEADS of its heads at once ([HEADS, D/2] tiles): RoPE on the
        q and k heads, q to QO, k and v to their cache slot. (A program per (row, head) left 8192
        one-warp programs at 512 rows: 6 us per layer on the H200 for 2 MB; all heads of a row in one
        program made the one-row step's 28 calls 14 us slower, so few rows split their heads.)"""
        gdc_enter(GDC)
        row = tl.program_id(0)
        head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        half = tl.arange(0, D // 2)
        ok = (head < H_Q + 2 * H_KV)[:, None]
        src = QKV + (row * (H_Q + 2 * H_KV) + head)[:, None] * D + half[None, :]
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + D // 2, mask=ok, other=0.0).to(tl.float32)
        c = tl.load(Cos + row * (D // 2) + half)[None, :]
        s = tl.load(Sin + row * (D // 2) + half)[None, :]
        _rotate_and_store(x1, x2, c, s, head[:, None], half[None, :], row, tl.load(Slots + row), KC, VC, QO,
                          v_offset, ok, H_Q, H_KV, D)

    @triton.jit
    def _silu_times(gate, up):
        """silu(gate) * up in float32: the one formula behind silu_mul and the matmuls that take gate/up."""
        g = gate.to(tl.float32)
        return g / (1.0 + tl.exp(-g)) * up.to(tl.float32)

    @triton.jit
    def _silu_mul_kernel(GU, O, F_: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
        gdc_enter(GDC)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < F_
        y = _silu_times(tl.load(GU + row * 2 * F_ + cols, mask=ok, other=0.0),
                        tl.load(GU + row * 2 * F_ + F_ + cols, mask=ok, other=0.0))
        tl.store(O + row * F_ + cols, y.to(O.dtype.element_ty), mask=ok)

    @triton.jit
    def _linear_rows_kernel(X, W, Bias, O, rows, N, K, k_split, x_stride, K_TILES: tl.constexpr,
                            HAS_BIAS: tl.constexpr, SILU: tl.constexpr, PARTIALS: tl.constexpr,
                            EVEN: tl.constexpr, IEEE: tl.constexpr, ROWS_P: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr):
        """out^T [BLOCK_N, rows] = W[BLOCK_N, k-slice] @ x^T[k-slice, rows] for output columns
        pid0 * BLOCK_N.. and the K slice [pid1 * k_split, +k_split). Each weight element is read
        once by one program; x (rows padded to ROWS_P >= 16 for tl.dot) is small and comes from L2.
        (One row takes _gemv_kernel instead.) SILU: X is gate/up [rows, 2K]; the input is
        silu(gate) * up, rounded to W's dtype (what silu_mul writes). PARTIALS: write float32
        [SPLIT, rows, N]; else add the bias, round, write O [rows, N]. EVEN: N % BLOCK_N == 0 and
        every slice is whole BLOCK_K tiles inside K."""
        gdc_enter(GDC)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        r = tl.arange(0, ROWS_P)
        kk = tl.arange(0, BLOCK_K)
        n_ok = n < N
        r_ok = r < rows
        k_lo = split * k_split
        w_ptr = W + n[:, None] * K + kk[None, :]
        x_ptr = X + r[None, :] * x_stride + kk[:, None]
        acc = tl.zeros((BLOCK_N, ROWS_P), tl.float32)
        for it in range(0, K_TILES):  # k_split // BLOCK_K
            k0 = k_lo + it * BLOCK_K
            if EVEN:
                w = tl.load(w_ptr + k0)
                xm = r_ok[None, :]
            else:
                k_ok = (k0 + kk < K) & (k0 + kk < k_lo + k_split)
                w = tl.load(w_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                xm = r_ok[None, :] & k_ok[:, None]
            if SILU:
                xt = _silu_times(tl.load(x_ptr + k0, mask=xm, other=0.0),
                                 tl.load(x_ptr + K + k0, mask=xm, other=0.0)).to(w.dtype)
            else:
                xt = tl.load(x_ptr + k0, mask=xm, other=0.0)
            if IEEE:
                acc = tl.dot(w, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
        ok = n_ok[:, None] & r_ok[None, :]
        if PARTIALS:
            tl.store(O + (split * rows + r[None, :]) * N + n[:, None], acc, mask=ok)
        else:
            if HAS_BIAS:
                acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(O + r[None, :] * N + n[:, None], acc.to(O.dtype.element_ty), mask=ok)

    @triton.jit
    def _gemv_unit(N, K, k_split, units, it, pid, progs, ITERS: tl.constexpr, K_TILES: tl.constexpr,
                   SPLIT: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   ROPE_D: tl.constexpr):
        """Where _gemv_kernel's flat iteration `it` reads and writes: output columns n, input positions k,
        their masks, the K slice (part) and the tile within it (kt). ROPE_D > 0 (a head size): column j of
        a unit is output d + (j % 2) * ROPE_D / 2 of its head, d = j // 2 within the head, so the two
        halves RoPE rotates together come out of one program, side by side."""
        nn = tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        u = pid + (it // K_TILES) * progs
        kt = it % K_TILES
        part = u % SPLIT
        n = (u // SPLIT) * BLOCK_N + nn
        if ROPE_D > 0:
            n = (n // ROPE_D) * ROPE_D + (n % ROPE_D) // 2 + (n % 2) * (ROPE_D // 2)
        k = part * k_split + kt * BLOCK_K + kk
        unit_ok = (u < units) & (it < ITERS)
        if EVEN:
            n_ok = (nn >= 0) & unit_ok
            k_ok = kk >= 0
        else:
            n_ok = (n < N) & unit_ok
            k_ok = (k < K) & (kt * BLOCK_K + kk < k_split)
        return n, n_ok, k, k_ok & unit_ok, part, kt

    @triton.jit
    def _gemv_tile(X, W, N, K, k_split, units, it, pid, progs, ITERS: tl.constexpr, K_TILES: tl.constexpr,
                   SPLIT: tl.constexpr, SILU: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, ROPE_D: tl.constexpr):
        """Loads of _gemv_kernel's flat iteration `it`: the weight tile, the input slice (gate and up
        with SILU; else x twice), and where the tile's sums go (_gemv_unit)."""
        n, n_ok, k, x_ok, part, kt = _gemv_unit(N, K, k_split, units, it, pid, progs, ITERS, K_TILES, SPLIT, EVEN,
                                                BLOCK_N, BLOCK_K, ROPE_D)
        w = tl.load(W + n[:, None] * K + k[None, :], mask=n_ok[:, None] & x_ok[None, :], other=0.0)
        g = tl.load(X + k, mask=x_ok, other=0.0)
        if SILU:
            up = tl.load(X + K + k, mask=x_ok, other=0.0)
        else:
            up = g
        return w, g, up, n, n_ok, part, kt

    @triton.jit
    def _rope_store_pairs(out, n, ok, Cos, Sin, Slots, KC, VC, QO, v_offset, H_Q: tl.constexpr,
                          H_KV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        """_gemv_kernel's epilogue with ROPE_D: the one row's q/k/v outputs `out` (columns n, pairs of
        halves side by side, _gemv_unit) rounded as the matmul writes them, then what rope_store's kernel
        does with them (_rotate_and_store), without its launch."""
        x1, x2 = tl.split(tl.reshape(out.to(QO.dtype.element_ty).to(tl.float32), [BLOCK_N // 2, 2]))
        n1, _ = tl.split(tl.reshape(n, [BLOCK_N // 2, 2]))
        ok1, _ = tl.split(tl.reshape(ok.to(tl.int32), [BLOCK_N // 2, 2]))
        head = n1 // D
        d = n1 % D
        c = tl.load(Cos + d, mask=ok1 != 0, other=0.0)
        s = tl.load(Sin + d, mask=ok1 != 0, other=0.0)
        _rotate_and_store(x1, x2, c, s, head, d, 0, tl.load(Slots), KC, VC, QO, v_offset, ok1 != 0, H_Q, H_KV, D)

    @triton.jit
    def _gemv_kernel(X, W, Bias, O, N, K, k_split, units, Cos, Sin, Slots, KC, VC, v_offset,
                     ITERS: tl.constexpr, K_TILES: tl.constexpr,
                     SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, PARTIALS: tl.constexpr,
                     EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     ROPE_D: tl.constexpr, H_Q: tl.constexpr, H_KV: tl.constexpr, GDC: tl.constexpr,
                     LINES: tl.constexpr):
        """One row: out[n] = W[n, :] . x, persistent. A work unit is BLOCK_N output columns times one of
        SPLIT K slices; program p takes units p, p + P, p + 2P, ... in ONE flat loop over (unit, K
        tile), loading iteration it + 1's tiles before it sums iteration it's: a program always has a
        tile in flight, also from one unit into the next, and every SM streams weights until the
        matrix is done (a program per unit leaves a partial last wave: w2 ran 168 programs on 132
        SMs). ITERS = ceil(units / P) * K_TILES for every program; one short of a unit in its last
        round masks that round off. u = column block * SPLIT + slice, so partials [SPLIT, 1, N] are
        written in place: no atomics, the same sums every run. ROPE_D > 0 (wqkv, one token): no O
        row; _rope_store_pairs rotates and stores q (to O, [H_Q, D]) and k, v (to the cache). With GDC
        the first tile's weight lines (LINES per row) are asked of L2 before the wait (pdl.py)."""
        pid = tl.program_id(0)
        progs = tl.num_programs(0)
        if GDC:
            n0, n_ok0, _, _, part0, _ = _gemv_unit(N, K, k_split, units, 0, pid, progs, ITERS, K_TILES, SPLIT, EVEN,
                                                   BLOCK_N, BLOCK_K, ROPE_D)
            k0 = part0 * k_split + tl.arange(0, LINES) * (BLOCK_K // LINES)
            prefetch_l2(W, n0[:, None] * K + k0[None, :], n_ok0[:, None] & (k0 < K)[None, :], GDC)
        gdc_enter(GDC)
        acc = tl.zeros([BLOCK_N], tl.float32)
        w, g, up, n, n_ok, part, kt = _gemv_tile(X, W, N, K, k_split, units, 0, pid, progs, ITERS, K_TILES, SPLIT,
                                                 SILU, EVEN, BLOCK_N, BLOCK_K, ROPE_D)
        for it in range(0, ITERS):
            w1, g1, up1, n1, n_ok1, part1, kt1 = _gemv_tile(X, W, N, K, k_split, units, it + 1, pid, progs, ITERS,
                                                            K_TILES, SPLIT, SILU, EVEN, BLOCK_N, BLOCK_K, ROPE_D)
            if SILU:   # silu(gate) * up, rounded to the weights' dtype as silu_mul writes it
                x = _silu_times(g, up).to(w.dtype).to(tl.float32)
            else:
                x = g.to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
            last = kt == K_TILES - 1
            if PARTIALS:
                tl.store(O + part * N + n, acc, mask=n_ok & last)
            else:
                out = acc
                if HAS_BIAS:
                    out += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)
                if ROPE_D > 0:
                    _rope_store_pairs(out, n, n_ok & last, Cos, Sin, Slots, KC, VC, O, v_offset, H_Q, H_KV, ROPE_D,
                                      BLOCK_N)
                else:
                    tl.store(O + n, out.to(O.dtype.element_ty), mask=n_ok & last)
            acc = tl.where(last, 0.0, acc)
            w, g, up, n, n_ok, part, kt = w1, g1, up1, n1, n_ok1, part1, kt1

    @triton.jit
    def _sum_partials_kernel(P, Bias, O, rows, N, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK: tl.constexpr, GDC: tl.constexpr):
        gdc_enter(GDC)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        acc = tl.zeros([BLOCK], tl.float32)
        for p in tl.static_range(PARTS):
            acc += tl.load(P + (p * rows + row) * N + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(Bias + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(O + row * N + cols, acc.to(O.dtype.element_ty), mask=ok)

    @triton.jit
    def _top2_chunks_kernel(X, Val, Idx, Second, V, CHUNKS, BLOCK: tl.constexpr, GDC: tl.constexpr):
        """Stage 1 of argmax + top-2: each program reduces one BLOCK-wide chunk of one row to (its
        maximum, the first index of it, the runner-up). Many programs per row: one program reading
        a whole 600 KB row of a 152k vocabulary alone took 49 us on the H200."""
        gdc_enter(GDC)
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        idx = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + row.to(tl.int64) * V + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        cm = tl.max(x, 0)
        ci = tl.min(tl.where(x == cm, idx, V), 0)          # first index of the chunk's maximum
        c2 = tl.max(tl.where(idx == ci, float("-inf"), x), 0)
        out = row * CHUNKS + chunk
        tl.store(Val + out, cm)
        tl.store(Idx + out, ci)
        tl.store(Second + out, c2)

    @triton.jit
    def _top2_merge_kernel(Val, Idx, Second, Arg, Margin, CHUNKS, CHUNKS_P2: tl.constexpr, GDC: tl.constexpr):
        """Stage 2: the row's maximum over the chunks (ties: the earliest chunk, so the first index),
        and the runner-up: the best of the other chunks' maxima and the winning chunk's runner-up."""
        gdc_enter(GDC)
        row = tl.program_id(0)
        c = tl.arange(0, CHUNKS_P2)
        ok = c < CHUNKS
        val = tl.load(Val + row * CHUNKS + c, mask=ok, other=float("-inf"))
        m1 = tl.max(val, 0)
        win = tl.min(tl.where(val == m1, c, CHUNKS_P2), 0)
        others = tl.max(tl.where(c == win, float("-inf"), val), 0)
        second = tl.max(tl.where(c == win, tl.load(Second + row * CHUNKS + c, mask=ok, other=float("-inf")),
                                 float("-inf")), 0)
        idx = tl.max(tl.where(c == win, tl.load(Idx + row * CHUNKS + c, mask=ok, other=0), 0), 0)
        tl.store(Arg + row, idx.to(tl.int64))
        tl.store(Margin + row, m1 - tl.maximum(others, second))


def argmax_top2(logits: torch.Tensor, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    rows, V = logits.shape
    chunks = triton.cdiv(V, block)
    val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    second = torch.empty_like(val)
    gdc = pdl.launch_args(logits.device, rows)
    _top2_chunks_kernel[(rows, chunks)](logits, val, idx, second, V, chunks, BLOCK=block, num_warps=8, **gdc)
    arg = torch.empty(rows, dtype=torch.int64, device=logits.device)
    margin = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _top2_merge_kernel[(rows,)](val, idx, second, arg, margin, chunks, CHUNKS_P2=triton.next_power_of_2(chunks),
                                num_warps=1, **gdc)
    return arg, margin


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x.shape
    y = torch.empty_like(x)
    parts = residual.shape[0] if residual is not None and residual.ndim == 3 else 0
    block = triton.next_power_of_2(n)
    _add_rmsnorm_kernel[(rows,)](x, x if residual is None else residual, weight, y, eps, n, rows,
                                 HAS_R=residual is not None, R_PARTS=parts, BLOCK=block, num_warps=8,
                                 LINES=pdl.lines(block, weight), **pdl.launch_args(x.device, rows))
    return y, x


# -- the small-rows matmul ------------------------------------------------------------------------
LINEAR_ROWS_MAX = 64
# (N, K) -> [(max rows, (BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages) or None), ...]: the first row
# bound that holds; None: cuBLAS is faster there, the forward keeps F.linear. The four Qwen2.5-1.5B
# matrices: wqkv [2048 x 1536] (+ bias), wo [1536 x 1536], w13 [17920 x 1536], w2 [1536 x 8960]
# (w2 taking gate/up, SiLU*up applied as it loads). SPLIT only where N / BLOCK_N alone leaves SMs
# idle (132 on an H200). One row runs the persistent GEMV (_gemv_kernel), picked on the H200 on
# 2026-12-01 (docs/BENCHMARKS.md, seventh session; 28 weight copies per CUDA graph), us per call in
# one call: wqkv 4.85 vs cuBLAS 5.60, wo 3.95 vs 4.73 for the earlier one-program-per-tile GEMV, w2 +
# SiLU*up 10.73 vs 10.98 (and 5 partials for the next norm to sum, not 14), w13 17.9 vs cuBLAS 17.2
# (stays on cuBLAS); loading the next tile ahead then took wqkv 4.70 -> 4.27, wo 3.93 -> 3.45, w2
# 10.18 -> 10.03 in another call.
# 16 rows (tools/bench_gpu_verify.py --matmul-sweep, 2026-12-01 17:44 UTC): wo 4.24 vs 5.31; at 64
# rows none wins.
LINEAR_ROWS_TABLE: dict[tuple[int, int], list[tuple[int, tuple[int, int, int, int, int] | None]]] = {
    (2048, 1536): [(1, (8, 512, 1, 8, 3)), (64, None)],
    (1536, 1536): [(1, (8, 256, 2, 4, 3)), (16, (32, 128, 2, 4, 4)), (64, None)],
    (17920, 1536): [(64, None)],
    (1536, 8960): [(1, (16, 256, 5, 4, 3)), (64, None)],
}


def _table_entry(rows: int, n: int, k: int) -> tuple[bool, tuple[int, int, int, int, int] | None]:
    for bound, cfg in LINEAR_ROWS_TABLE.get((n, k), ()):
        if rows <= bound:
            return True, cfg
    return False, None


def linear_rows_wins(rows: int, n: int, k: int) -> bool:
    """Whether the forward should use linear_rows for an [n x k] weight at `rows` rows: only where
    LINEAR_ROWS_TABLE has a measured config (untuned shapes keep cuBLAS)."""
    return rows <= LINEAR_ROWS_MAX and _table_entry(rows, n, k)[1] is not None


def linear_rows_config(rows: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages) for an [n x k] weight at `rows` rows: the
    table's entry, else about two programs per SM of a 132-SM GPU from 16- or 32-column blocks, K
    split into whole tiles as far as needed."""
    cfg = _table_entry(rows, n, k)[1]
    if cfg is not None:
        return cfg
    block_n = 32 if n >= 32 * 132 // 2 else 16
    block_k = min(128, max(16, triton.next_power_of_2(k)))
    tiles = -(-k // block_k)
    split = max(1, min(tiles // 4, -(-264 // -(-n // block_n))))
    return block_n, block_k, split, 4, 3


GEMV_PROGRAMS_PER_SM = 4   # the one-row GEMV's persistent grid (H200, 2026-12-01: the best config of each
                           # matrix with 4 / 2 / 1 per SM: wqkv 4.86 / 4.85 / 5.56 us, wo 3.95 / 4.22, w13 17.9 / 20.3)


def _gemv_programs(device: torch.device) -> int:
    """GEMV_PROGRAMS_PER_SM programs for every SM of `device` (4 SMs stand in for the interpreter)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return GEMV_PROGRAMS_PER_SM * sms


def _linear_rows_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool,
                        partials: bool, cfg: tuple[int, int, int, int, int] | None) -> torch.Tensor:
    """One row: the persistent GEMV (_gemv_kernel); more: _linear_rows_kernel. A K split writes float32
    partials, returned as they are (partials) or summed, with the bias, by one more launch."""
    rows = x.shape[0]
    n, k = weight.shape
    if not 0 < rows <= LINEAR_ROWS_MAX:
        raise ValueError(f"linear_rows takes 1..{LINEAR_ROWS_MAX} rows, got {rows}")
    if x.shape[1] != (2 * k if silu else k) or not x.is_contiguous() or not weight.is_contiguous() \
            or n * k >= 2 ** 31:
        raise ValueError(f"linear_rows: x {tuple(x.shape)} against weight {tuple(weight.shape)} (contiguous)")
    block_n, block_k, split, warps, stages = cfg or linear_rows_config(rows, n, k)
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_split)
    even = n % block_n == 0 and k % k_split == 0
    to_partials = partials or split > 1
    if to_partials:
        out = torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    has_bias = bias is not None and not to_partials
    gdc = pdl.launch_args(x.device, rows)
    if rows == 1:
        units = triton.cdiv(n, block_n) * split
        progs = min(units, _gemv_programs(x.device))
        _gemv_kernel[(progs,)](x, weight, x if bias is None else bias, out, n, k, k_split, units, x, x, x, x, x, 0,
                               ITERS=triton.cdiv(units, progs) * (k_split // block_k), K_TILES=k_split // block_k,
                               SPLIT=split, HAS_BIAS=has_bias, SILU=silu, PARTIALS=to_partials, EVEN=even,
                               BLOCK_N=block_n, BLOCK_K=block_k, ROPE_D=0, H_Q=0, H_KV=0,
                               num_warps=warps, num_stages=stages, LINES=pdl.lines(block_k, weight), **gdc)
    else:
        _linear_rows_kernel[(triton.cdiv(n, block_n), split)](
            x, weight, x if bias is None else bias, out, rows, n, k, k_split, x.shape[1], K_TILES=k_split // block_k,
            HAS_BIAS=has_bias, SILU=silu, PARTIALS=to_partials, EVEN=even, IEEE=weight.dtype == torch.float32,
            ROWS_P=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, num_stages=stages, **gdc)
    if partials or split == 1:
        return out
    summed = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    blk = min(1024, triton.next_power_of_2(n))
    _sum_partials_kernel[(rows, triton.cdiv(n, blk))](out, out if bias is None else bias, summed, rows, n,
                                                     PARTS=split, HAS_BIAS=bias is not None, BLOCK=blk, num_warps=4,
                                                     **gdc)
    return summed


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu: bool = False,
                config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [rows <= 64, K] (float32 accumulation, output in x's dtype);
    silu: x is gate/up [rows, 2K] and the input is silu_mul(x). A split-K config adds one small
    launch that sums the partials; linear_rows_partials leaves that to the reader."""
    return _linear_rows_launch(x, weight, bias, silu, False, config)


def linear_rows_partials(x: torch.Tensor, weight: torch.Tensor, *, silu: bool = False,
                         config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """float32 partials [SPLIT, rows, N] of x @ weight.T (no bias) for add_rmsnorm's residual."""
    return _linear_rows_launch(x, weight, None, silu, True, config)


ROPE_ROWS_ALL_HEADS = 16   # from this many token rows on, one rope_store program takes all of a row's heads


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
               slots: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    rows = qkv.shape[0]
    D = cache.shape[-1]
    q = torch.empty(rows, n_head, D, dtype=qkv.dtype, device=qkv.device)
    heads = n_head + 2 * n_head_kv
    per_program = triton.next_power_of_2(heads) if rows >= ROPE_ROWS_ALL_HEADS else min(2, triton.next_power_of_2(heads))
    _rope_store_kernel[(rows, triton.cdiv(heads, per_program))](
        qkv, cos, sin, slots, cache, cache, q, cache.stride(0), H_Q=n_head, H_KV=n_head_kv, D=D, HEADS=per_program,
        num_warps=4 if per_program * D >= 2048 else 1, **pdl.launch_args(qkv.device, rows))
    return q


GEMV_ROPE = 0   # 1: a one-token step's wqkv GEMV also does RoPE and the cache writes (linear_rope_store): one
                # launch a layer fewer. Off: on the H200 (2026-12-02, docs/BENCHMARKS.md ninth session) the
                # 1 x 1 replay went 1.517 -> 1.504 ms (-0.9 %, the epilogue takes back most of what the launch cost)


def gemv_rope_fits(rows: int, weight: torch.Tensor, head_dim: int) -> bool:
    """Whether linear_rope_store can serve this matmul: GEMV_ROPE on, one row, and a table config
    whose column blocks pair within heads (even BLOCK_N dividing head_dim) with K unsplit."""
    if not GEMV_ROPE or rows != 1 or not linear_rows_wins(rows, *weight.shape):
        return False
    block_n, _, split, _, _ = linear_rows_config(rows, *weight.shape)
    return split == 1 and block_n % 2 == 0 and head_dim % block_n == 0 and weight.shape[0] % head_dim == 0


def linear_rope_store_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                            sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, n_head: int,
                            n_head_kv: int) -> torch.Tensor:
    """rope_store_torch(F.linear(x, weight, bias), ...): the reference of linear_rope_store."""
    return rope_store_torch(F.linear(x, weight, bias), cos, sin, cache, slots, n_head, n_head_kv)


def linear_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, n_head: int,
                      n_head_kv: int) -> torch.Tensor:
    """rope_store(linear_rows(x, weight, bias), ...) for one row in one launch (gemv_rope_fits): the
    GEMV's epilogue rotates q and k and writes q [1, n_head, D] (returned) and k, v to the cache slot."""
    n, k = weight.shape
    D = cache.shape[-1]
    if x.shape != (1, k) or n != (n_head + 2 * n_head_kv) * D:
        raise ValueError(f"linear_rope_store: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"{n_head}+2*{n_head_kv} heads of {D}")
    block_n, block_k, split, warps, stages = linear_rows_config(1, n, k)
    if split != 1 or block_n % 2 or D % block_n:
        raise ValueError(f"linear_rope_store: config {(block_n, block_k, split)} does not pair within heads of {D}")
    q = torch.empty(1, n_head, D, dtype=x.dtype, device=x.device)
    units = n // block_n
    progs = min(units, _gemv_programs(x.device))
    k_tiles = triton.cdiv(k, block_k)
    _gemv_kernel[(progs,)](x, weight, x if bias is None else bias, q, n, k, k_tiles * block_k, units, cos, sin, slots,
                           cache, cache, cache.stride(0), ITERS=triton.cdiv(units, progs) * k_tiles, K_TILES=k_tiles,
                           SPLIT=1, HAS_BIAS=bias is not None, SILU=False,
                           PARTIALS=False, EVEN=k % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, ROPE_D=D,
                           H_Q=n_head, H_KV=n_head_kv, num_warps=warps, num_stages=stages,
                           LINES=pdl.lines(block_k, weight), **pdl.launch_args(x.device, 1))
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, two_f = gate_up.shape
    f = two_f // 2
    out = torch.empty(rows, f, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(f, block))](gate_up, out, F_=f, BLOCK=block, num_warps=4,
                                                    **pdl.launch_args(gate_up.device, rows))
    return out
