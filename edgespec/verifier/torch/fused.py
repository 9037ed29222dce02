"""Fused small ops for the GPU forward (Triton): at one token per sequence a step is ~45 tiny
kernels per layer when each torch op is its own launch, which costs more than the weights take to
read. These kernels cut a layer to eight launches at up to 64 token rows: add+RMSNorm, QKV matmul
with RoPE and the cache writes in its epilogue (a separate rope_store launch for one row), attention
(2), output matmul, add+RMSNorm, gate/up matmul with SiLU*up in its epilogue (linear_silu), down matmul.

Each function here has a torch reference with the same signature (`*_torch`), used on the CPU (where
the float32 path must stay the exact reference) and by the tests, which run the Triton versions in
Triton's CPU interpreter against them. All arithmetic is float32; outputs are rounded once to the
model dtype.

`linear_rows` / `linear_rows_partials` / `linear_silu` / `linear_rope_store`: a skinny matmul for few
rows (B*T <= 64), where cuBLAS picks kernels that take 1.5-5x the time the weight bytes need. Each
program owns COLS output columns (any count: every SM gets an equal share of the weight, one program
per SM) and streams its weight rows once; where the columns alone give too few programs, K is split
across programs too and the float32 partials [SPLIT, rows, N] are summed by whoever reads them next:
add_rmsnorm (wo and w2 feed the residual add), so a split costs no extra launch. One row (a verify
step of one token) is a GEMV with its own persistent kernel (_gemv_kernel): a fixed grid of programs
that each stream several (column block, K slice) units with the next tile's loads always in flight.
Configs come from a static table per weight shape (LINEAR_ROWS_TABLE), not triton.autotune
(autotuning inside a CUDA-graph capture would run the candidates into the graph).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from edgespec.verifier.torch import pdl

try:
    import triton
    import triton.language as tl

    from edgespec.verifier.torch.pdl import gdc_enter, gdc_release, prefetch_l2
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


def linear_silu_torch(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul(x @ gate_up.T): gate/up rounded to x's dtype, then SiLU*up (linear_silu's reference)."""
    return silu_mul_torch(F.linear(x, gate_up))


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
    def _rows_of(p, R_LO: tl.constexpr, R: tl.constexpr, COLS: tl.constexpr, N, PAIR: tl.constexpr,
                 ROPE_D: tl.constexpr):
        """Tile rows R_LO..R_LO+R-1 of program p of _linear_rows_kernel: the weight row each loads, the
        output column it feeds, and whether it exists. PAIR: rows alternate gate (weight row c) and up
        (weight row c + N) of output column c, so each SiLU*up pair sits in one program, side by side.
        ROPE_D > 0 (a head size): rows alternate output d and d + ROPE_D / 2 of a head, the two values
        RoPE rotates together (as _gemv_unit orders them)."""
        local = R_LO + tl.arange(0, R)
        if PAIR:
            col = p * COLS + local // 2
            ok = (local < 2 * COLS) & (col < N)
            return col + (local % 2) * N, col, ok
        col = p * COLS + local
        ok = (local < COLS) & (col < N)
        if ROPE_D > 0:
            col = (col // ROPE_D) * ROPE_D + (col % ROPE_D) // 2 + (col % 2) * (ROPE_D // 2)
        return col, col, ok

    @triton.jit
    def _row_pairs(acc, col, ok, R: tl.constexpr, ROWS_P: tl.constexpr):
        """A tile whose rows come in pairs (PAIR: gate, up; ROPE_D: d, d + D/2) split into the first and
        second row of each pair [R/2, ROWS_P], with the first row's output column and validity [R/2]."""
        first, second = tl.split(tl.permute(tl.reshape(acc, [R // 2, 2, ROWS_P]), (0, 2, 1)))
        c, _ = tl.split(tl.reshape(col, [R // 2, 2]))
        c_ok, _ = tl.split(tl.reshape(ok.to(tl.int32), [R // 2, 2]))
        return first, second, c, c_ok != 0

    @triton.jit
    def _rows_store(acc, col, ok, O, Bias, split, r, r_ok, rows, N, Cos, Sin, Slots, KC, VC, v_offset,
                    HAS_BIAS: tl.constexpr, PAIR: tl.constexpr, PARTIALS: tl.constexpr, R: tl.constexpr,
                    ROWS_P: tl.constexpr, ROPE_D: tl.constexpr, H_Q: tl.constexpr, H_KV: tl.constexpr):
        """_linear_rows_kernel's epilogue for one tile [R, ROWS_P] (output columns x token rows). ROPE_D:
        the q/k/v outputs rounded as the matmul writes them, then what rope_store's kernel does with them
        (_rotate_and_store): q to O [rows, H_Q, D], k and v to each token row's cache slot."""
        if ROPE_D > 0:
            if HAS_BIAS:
                acc += tl.load(Bias + col, mask=ok, other=0.0).to(tl.float32)[:, None]
            x1, x2, c, c_ok = _row_pairs(acc.to(O.dtype.element_ty).to(tl.float32), col, ok, R, ROWS_P)
            m = c_ok[:, None] & r_ok[None, :]
            d = (c % ROPE_D)[:, None]
            cs = tl.load(Cos + r[None, :] * (ROPE_D // 2) + d, mask=m, other=0.0)
            sn = tl.load(Sin + r[None, :] * (ROPE_D // 2) + d, mask=m, other=0.0)
            slot = tl.load(Slots + r, mask=r_ok, other=0)[None, :]
            _rotate_and_store(x1, x2, cs, sn, (c // ROPE_D)[:, None], d, r[None, :], slot, KC, VC, O, v_offset, m,
                              H_Q, H_KV, ROPE_D)
        elif PAIR:   # gate and up rounded as a matmul writes them, then silu(gate) * up as silu_mul writes it
            gate, up, c, c_ok = _row_pairs(acc, col, ok, R, ROWS_P)
            dt = O.dtype.element_ty
            y = _silu_times(gate.to(dt), up.to(dt))
            tl.store(O + r[None, :] * N + c[:, None], y.to(dt), mask=c_ok[:, None] & r_ok[None, :])
        elif PARTIALS:
            tl.store(O + (split * rows + r[None, :]) * N + col[:, None], acc, mask=ok[:, None] & r_ok[None, :])
        else:
            if HAS_BIAS:
                acc += tl.load(Bias + col, mask=ok, other=0.0).to(tl.float32)[:, None]
            tl.store(O + r[None, :] * N + col[:, None], acc.to(O.dtype.element_ty), mask=ok[:, None] & r_ok[None, :])

    @triton.jit
    def _linear_rows_kernel(X, W, Bias, O, rows, N, K, k_split, x_stride, Cos, Sin, Slots, KC, VC, v_offset,
                            K_TILES: tl.constexpr, COLS: tl.constexpr, R_MAIN: tl.constexpr, R_TAIL: tl.constexpr,
                            HAS_BIAS: tl.constexpr, SILU: tl.constexpr, PAIR: tl.constexpr, PARTIALS: tl.constexpr,
                            EVEN_K: tl.constexpr, IEEE: tl.constexpr, ROWS_P: tl.constexpr,
                            BLOCK_K: tl.constexpr, GDC: tl.constexpr, LINES: tl.constexpr, SPAN: tl.constexpr,
                            ROPE_D: tl.constexpr, H_Q: tl.constexpr, H_KV: tl.constexpr):
        """out^T [cols, rows] = W[cols, k-slice] @ x^T[k-slice, rows] for program pid0's COLS output
        columns (any count: the GPU's SMs get an equal share, not whole power-of-two blocks, whose last
        wave left most of them idle: 280 blocks of gate/up on 132 SMs) and the K slice [pid1 * k_split,
        +k_split). The share is a power-of-two tile of R_MAIN rows plus one of R_TAIL (0: none) for the
        rest, both fed by the same x tile. Each weight element is read once by one program; x (rows padded to ROWS_P >= 16 for
        tl.dot) comes from L2. SILU: X is gate/up [rows, 2K] and the input is silu(gate) * up (what
        silu_mul writes). PAIR: W is gate/up stacked [2N, K] and the output silu(gate) * up [rows, N]
        (no gate/up tensor, no silu_mul launch). PARTIALS: float32 [SPLIT, rows, N]; else the bias is
        added and O [rows, N] written. ROPE_D > 0 (wqkv): no O [rows, N]; the epilogue rotates q and k and
        writes q to O [rows, H_Q, D], k and v to the cache (_rows_store). EVEN_K: every slice is whole BLOCK_K
        tiles inside K. With GDC the weight lines of the slice's first SPAN elements (LINES per row of the
        main tile) are asked of L2 before the wait (pdl.py, PREFETCH_TILES)."""
        p = tl.program_id(0)
        split = tl.program_id(1)
        r = tl.arange(0, ROWS_P)
        kk = tl.arange(0, BLOCK_K)
        r_ok = r < rows
        k_lo = split * k_split
        w_main, col_main, ok_main = _rows_of(p, 0, R_MAIN, COLS, N, PAIR, ROPE_D)
        if GDC:
            at = k_lo + tl.arange(0, LINES) * (SPAN // LINES)
            prefetch_l2(W, w_main[:, None] * K + at[None, :], ok_main[:, None] & (at < K)[None, :], GDC)
        gdc_enter(GDC)
        w_main = W + w_main[:, None] * K + kk[None, :]
        acc_main = tl.zeros((R_MAIN, ROWS_P), tl.float32)
        if R_TAIL > 0:
            w_tail, col_tail, ok_tail = _rows_of(p, R_MAIN, R_TAIL, COLS, N, PAIR, ROPE_D)
            w_tail = W + w_tail[:, None] * K + kk[None, :]
            acc_tail = tl.zeros((R_TAIL, ROWS_P), tl.float32)
        x_ptr = X + r[None, :] * x_stride + kk[:, None]
        for it in range(0, K_TILES):  # k_split // BLOCK_K
            k0 = k_lo + it * BLOCK_K
            if EVEN_K:
                k_ok = kk >= 0
            else:
                k_ok = (k0 + kk < K) & (it * BLOCK_K + kk < k_split)
            xm = r_ok[None, :] & k_ok[:, None]
            if SILU:
                xt = _silu_times(tl.load(x_ptr + k0, mask=xm, other=0.0),
                                 tl.load(x_ptr + K + k0, mask=xm, other=0.0)).to(W.dtype.element_ty)
            else:
                xt = tl.load(x_ptr + k0, mask=xm, other=0.0)
            w = tl.load(w_main + k0, mask=ok_main[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc_main = tl.dot(w, xt, acc_main, input_precision="ieee")
            else:
                acc_main = tl.dot(w, xt, acc_main)
            if R_TAIL > 0:
                w = tl.load(w_tail + k0, mask=ok_tail[:, None] & k_ok[None, :], other=0.0)
                if IEEE:
                    acc_tail = tl.dot(w, xt, acc_tail, input_precision="ieee")
                else:
                    acc_tail = tl.dot(w, xt, acc_tail)
        gdc_release(GDC)
        _rows_store(acc_main, col_main, ok_main, O, Bias, split, r, r_ok, rows, N, Cos, Sin, Slots, KC, VC, v_offset,
                    HAS_BIAS, PAIR, PARTIALS, R_MAIN, ROWS_P, ROPE_D, H_Q, H_KV)
        if R_TAIL > 0:
            _rows_store(acc_tail, col_tail, ok_tail, O, Bias, split, r, r_ok, rows, N, Cos, Sin, Slots, KC, VC,
                        v_offset, HAS_BIAS, PAIR, PARTIALS, R_TAIL, ROWS_P, ROPE_D, H_Q, H_KV)

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


TOP2_BLOCK = 2048   # logits per program of _top2_chunks_kernel. H200, 2026-12-04 (docs/BENCHMARKS.md eighteenth
TOP2_WARPS = 2      # session; bf16 logits of the 152k vocabulary, graphs round-robin): 2048 with 2 warps was the
                    # fastest of 7 configs at 16, 64 and 512 rows (4.0 / 9.1 / 53.0 us against 4096 with 8 warps'
                    # 4.7 / 10.7 / 70.0); 512-logit chunks were the slowest (15.3 us at 64 rows)


def argmax_top2(logits: torch.Tensor, block: int | None = None, warps: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (first index of the maximum) and its margin over the runner-up, in two launches
    (chunks of TOP2_BLOCK logits, then one merge per row)."""
    block, warps = block or TOP2_BLOCK, warps or TOP2_WARPS
    rows, V = logits.shape
    chunks = triton.cdiv(V, block)
    val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    second = torch.empty_like(val)
    gdc = pdl.launch_args(logits.device, rows)
    _top2_chunks_kernel[(rows, chunks)](logits, val, idx, second, V, chunks, BLOCK=block, num_warps=warps, **gdc)
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
# (N, K) -> [(max rows, config or None), ...]: the first row bound that holds; None: cuBLAS is faster
# there, the forward keeps F.linear. A config is (BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages) for
# one row (the persistent GEMV, _gemv_kernel) and (COLS, BLOCK_K, SPLIT, num_warps, num_stages) for
# more (_linear_rows_kernel: COLS output columns per program). The four Qwen2.5-1.5B matrices: wqkv
# [2048 x 1536] (+ bias), wo [1536 x 1536], w13 [17920 x 1536] (gate/up: run as linear_silu, its
# SiLU*up the epilogue), w2 [1536 x 8960] (taking gate/up and applying SiLU*up as it loads where w13
# is cuBLAS's). The GEMV configs were picked on the H200 on 2026-12-01 (docs/BENCHMARKS.md, seventh
# session; 28 weight copies per CUDA graph), us per call in one call: wqkv 4.85 vs cuBLAS 5.60, wo 3.95
# vs 4.73 for the earlier one-program-per-tile GEMV, w2 + SiLU*up 10.73 vs 10.98, w13 17.9 vs cuBLAS
# 17.2 (stays on cuBLAS); loading the next tile ahead then took wqkv 4.70 -> 4.27, wo 3.93 -> 3.45, w2
# 10.18 -> 10.03 in another call. 16 rows (tools/bench_gpu_verify.py --matmul-sweep, 2026-12-01 17:44
# UTC, power-of-two column blocks): wo 4.24 vs 5.31; at 64 rows none won.
LINEAR_ROWS_TABLE: dict[tuple[int, int], list[tuple[int, tuple[int, int, int, int, int] | None]]] = {
    (2048, 1536): [(1, (8, 512, 1, 8, 3)), (16, (16, 128, 1, 4, 6)), (64, (16, 128, 1, 4, 4))],
    (1536, 1536): [(1, (8, 256, 2, 4, 3)), (16, (32, 128, 2, 4, 4)), (64, (48, 64, 4, 4, 6))],
    (17920, 1536): [(64, (68, 64, 1, 8, 6))],
    (1536, 8960): [(1, (16, 256, 5, 4, 3)), (64, (128, 64, 11, 8, 8))],
}
# wqkv at 17-64 rows and w2's 8 stages: the twenty-fourth session (H200, 2026-12-04, docs/BENCHMARKS.md; steps' graph
# replays round-robin, tools/bench_gpu_verify.py variants with '%' table entries). wqkv there was cuBLAS's (5.88 us
# alone against 6.76 for linear_rows, thirteenth session), but cuBLAS cannot launch with PDL, so each layer's chain
# broke twice, and RoPE took a launch of its own. On linear_rows, with RoPE in its epilogue and L2 warming up to 64
# rows (L2_WARM_ROWS), 1 x 64 went 1.834 -> 1.757 ms (-4.2 %; each change alone -1.4 / -0.7 %); 128-wide K tiles
# with 4 stages (against the balanced 64 x 4) took it to 1.717, and w2 with 8 stages (against 6) to 1.690 (-7.9 %
# in all; 4 x 16 -7.3 %, 1 x 16 -0.7 %, the other cells within 0.5 %). Deeper wqkv, wo or gate/up pipelines, other
# wo splits and 70-column gate/up tiles were within noise or slower.
# 2-64 rows and gate/up: picked on the H200 on 2026-12-02 (docs/BENCHMARKS.md thirteenth session), us per call in
# one call (tools/bench_gpu_verify.py --matmul-sweep) against cuBLAS: wqkv 16 rows 4.68 vs 5.25 (64: 6.76 vs 5.88,
# cuBLAS); wo 64 rows 4.52 vs 5.03 (16: the earlier entry, 3.21); gate/up + SiLU*up 64 rows 18.63 vs cuBLAS +
# silu_mul 21.53; w2 on SiLU*up 64 rows 10.42 vs 12.22 (16 rows, where gate/up stays on cuBLAS, w2 applies SiLU*up
# as it loads). In the steps, round-robin (Engine small_rows_matmul 1 against 64): 1 x 16 -10.3 %, 8 x 1 -10.7 %,
# 1 x 64 -2.8 %; gate/up as linear_silu at 1 and 16 rows was slower there than cuBLAS (+1.2 %, +2.3 %).
SMALL_ROWS_AUTO = 0   # 1: where LINEAR_ROWS_TABLE says cuBLAS (None; no Qwen2.5-1.5B entry since the twenty-fourth
                      # session), run linear_rows with balanced_config instead
                      # (and the gate/up matrix as linear_silu): for benchmarks that A/B the balanced shares.
                      # Off: on the H200 (2026-12-02) the steps were 4-23 % slower with every matrix on it
LINEAR_SILU_ROWS = 1    # gate/up runs as linear_silu (where the table has a config) from this many rows on, F.linear
                        # below. On the H200 (2026-12-02, round-robin steps) it first lost at 1 and 16 rows (+1.2 %,
                        # +2.3 %) with a config that let several programs share an SM (likely, not profiled: an SM
                        # given two equal shares while PDL overlaps kernels is the tail), and won at 64 (-13 % against
                        # w2's SiLU load). With the table's configs, whose shared memory fits one program per SM, it
                        # won at 1 x 1, 1 x 16 and 8 x 1 too (-1.5 / -3.3 / -3.8 %)


def _table_entry(rows: int, n: int, k: int) -> tuple[bool, tuple[int, int, int, int, int] | None]:
    for bound, cfg in LINEAR_ROWS_TABLE.get((n, k), ()):
        if rows <= bound:
            return True, cfg
    return False, None


def linear_rows_wins(rows: int, n: int, k: int) -> bool:
    """Whether the forward should use linear_rows (linear_silu for the gate/up matrix) for an [n x k]
    weight at `rows` rows: where LINEAR_ROWS_TABLE has a measured config (untuned shapes keep cuBLAS),
    or, with SMALL_ROWS_AUTO, wherever the table has the shape at all."""
    if rows > LINEAR_ROWS_MAX:
        return False
    listed, cfg = _table_entry(rows, n, k)
    return cfg is not None or (listed and bool(SMALL_ROWS_AUTO))


def _sms(device: torch.device | None) -> int:
    """Streaming multiprocessors of `device` (4 stand in for the CPU interpreter)."""
    if device is None or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def balanced_config(rows: int, n_out: int, k: int, *, sms: int, pair: bool = False, can_split: bool = True,
                    block_k: int = 64) -> tuple[int, int, int, int, int]:
    """(COLS, BLOCK_K, SPLIT, num_warps, num_stages) for _linear_rows_kernel: about one program per SM,
    each with an equal share of the weight (COLS output columns of one K slice; any count, not a power
    of two). SPLIT > 1 (float32 partials for the reader to sum) only where can_split; it is picked by a
    byte count per program: its weight bytes, plus 0.3x its x bytes (they come from L2, the weights from
    HBM), plus the partials' write and read spread over the SMs."""
    tiles = triton.cdiv(k, block_k)
    best = None
    for split in range(1, (min(16, tiles) if can_split else 1) + 1):
        cols = triton.cdiv(n_out, max(1, sms // split))
        if (2 if pair else 1) * cols > 256:   # the tile's registers: more programs instead (several waves)
            cols = 128 if pair else 256
        slice_tiles = triton.cdiv(tiles, split)
        parts = triton.cdiv(tiles, slice_tiles)
        w_bytes = (2 if pair else 1) * cols * slice_tiles * block_k * 2
        x_bytes = slice_tiles * block_k * rows * 2
        part_bytes = 2 * parts * rows * n_out * 4 / sms if parts > 1 else 0
        cost = w_bytes + 0.3 * x_bytes + part_bytes
        if best is None or cost < best[0]:
            best = (cost, cols, parts)
    _, cols, split = best
    w_rows = (2 if pair else 1) * cols
    return cols, block_k, split, 8 if w_rows > 64 else 4, 4


def _row_tiles(w_rows: int) -> tuple[int, int]:
    """(R_MAIN, R_TAIL): power-of-two tiles (>= 16 rows: tl.dot's least) covering a program's w_rows
    weight rows: the largest power of two that fits, and one more for the rest (0: none)."""
    main = max(16, 1 << (w_rows.bit_length() - 1))
    rest = w_rows - main
    return main, (0 if rest <= 0 else max(16, triton.next_power_of_2(rest)))


def linear_rows_config(rows: int, n: int, k: int, *, pair: bool = False, can_split: bool = True,
                       device: torch.device | None = None) -> tuple[int, int, int, int, int]:
    """The config of an [n x k] weight at `rows` rows: the table's entry; else, for one row (the GEMV:
    BLOCK_N, BLOCK_K, SPLIT, warps, stages) about two programs per SM from 16- or 32-column blocks, K
    split into whole tiles as far as needed; for more rows (and pair: the gate/up matrix, any rows)
    balanced_config (COLS, BLOCK_K, SPLIT, warps, stages)."""
    cfg = _table_entry(rows, n, k)[1]
    if cfg is not None:
        return cfg
    if rows > 1 or pair:
        return balanced_config(rows, n // 2 if pair else n, k, sms=_sms(device), pair=pair, can_split=can_split)
    block_n = 32 if n >= 32 * 132 // 2 else 16
    block_k = min(128, max(16, triton.next_power_of_2(k)))
    tiles = -(-k // block_k)
    split = max(1, min(tiles // 4, -(-264 // -(-n // block_n))))
    return block_n, block_k, split, 4, 3


PREFETCH_TILES = 1   # with PDL, the first K tiles of its slice (a power of two; each row of its main tile) that a
                     # _linear_rows_kernel program asks L2 for before it waits for the kernel before it. More lost on
                     # the H200 (2026-12-04, replays round-robin): 4 tiles 1 x 16 +2.7 %, 8 x 1 +1.3 %, 1 x 64 -0.3 %;
                     # 16 tiles up to +7.9 %
GEMV_PROGRAMS_PER_SM = 4   # the one-row GEMV's persistent grid (H200, 2026-12-01: the best config of each
                           # matrix with 4 / 2 / 1 per SM: wqkv 4.86 / 4.85 / 5.56 us, wo 3.95 / 4.22, w13 17.9 / 20.3)


def _gemv_programs(device: torch.device) -> int:
    """GEMV_PROGRAMS_PER_SM programs for every SM of `device`."""
    return GEMV_PROGRAMS_PER_SM * _sms(device)


def k_slices(k: int, split: int, block_k: int) -> tuple[int, int]:
    """(keys a K slice, slices) for a config asking for `split` slices of K: each slice whole BLOCK_K tiles, so
    fewer slices where the rounding leaves the last ones empty."""
    per_slice = -(-k // split)                       # ceil(k / split)
    k_split = -(-per_slice // block_k) * block_k     # rounded up to whole tiles
    return k_split, -(-k // k_split)


class _Rope(NamedTuple):
    """Where linear_rope_store's epilogue reads RoPE's tables and writes q, k and v (rope_store's arguments)."""

    cos: torch.Tensor
    sin: torch.Tensor
    cache: torch.Tensor
    slots: torch.Tensor
    n_head: int
    n_head_kv: int


def _linear_rows_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool,
                        partials: bool, cfg: tuple[int, int, int, int, int] | None, pair: bool = False,
                        rope: _Rope | None = None) -> torch.Tensor:
    """One row: the persistent GEMV (_gemv_kernel); more, or pair: _linear_rows_kernel. A K split writes
    float32 partials, returned as they are (partials) or summed, with the bias, by one more launch. With
    rope, the epilogue rotates and stores (linear_rope_store) and q [rows, n_head, D] is returned."""
    rows = x.shape[0]
    n, k = weight.shape
    n_out = n // 2 if pair else n
    if not 0 < rows <= LINEAR_ROWS_MAX:
        raise ValueError(f"linear_rows takes 1..{LINEAR_ROWS_MAX} rows, got {rows}")
    if x.shape[1] != (2 * k if silu else k) or not x.is_contiguous() or not weight.is_contiguous() \
            or n * k >= 2 ** 31 or (pair and (n % 2 or silu or partials or bias is not None)):
        raise ValueError(f"linear_rows: x {tuple(x.shape)} against weight {tuple(weight.shape)} (contiguous)"
                         + (" as a gate/up pair (even rows, no bias, no partials)" if pair else ""))
    gemv = rows == 1 and not pair
    cols, block_k, split, warps, stages = cfg or linear_rows_config(rows, n, k, pair=pair, can_split=partials,
                                                                    device=x.device)
    k_split, split = k_slices(k, split, block_k)
    if pair and split > 1:
        raise ValueError(f"linear_silu: config {cfg} splits K; SiLU needs whole sums")
    D = rope.cache.shape[-1] if rope else 0
    if rope and (split != 1 or cols % 2 or (gemv and D % cols)):
        raise ValueError(f"linear_rope_store: config {(cols, block_k, split)} does not pair within heads of {D}")
    to_partials = partials or split > 1
    if rope:
        out = torch.empty(rows, rope.n_head, D, dtype=x.dtype, device=x.device)
        epilogue = (rope.cos, rope.sin, rope.slots, rope.cache, rope.cache, rope.cache.stride(0))
    else:
        out = (torch.empty(split, rows, n, dtype=torch.float32, device=x.device) if to_partials
               else torch.empty(rows, n_out, dtype=x.dtype, device=x.device))
        epilogue = (x, x, x, x, x, 0)   # no RoPE: placeholders
    common = dict(HAS_BIAS=bias is not None and not to_partials, SILU=silu, PARTIALS=to_partials, BLOCK_K=block_k,
                  ROPE_D=D, H_Q=rope.n_head if rope else 0, H_KV=rope.n_head_kv if rope else 0, num_warps=warps,
                  num_stages=stages, **pdl.launch_args(x.device, rows))
    if gemv:
        units = triton.cdiv(n, cols) * split
        progs = min(units, _gemv_programs(x.device))
        launch_fitting(_gemv_kernel, (progs,), x, weight, x if bias is None else bias, out, n, k, k_split, units,
                       *epilogue, ITERS=triton.cdiv(units, progs) * (k_split // block_k), K_TILES=k_split // block_k,
                       SPLIT=split, EVEN=n % cols == 0 and k % k_split == 0, BLOCK_N=cols,
                       LINES=pdl.lines(block_k, weight), **common)
    else:
        r_main, r_tail = _row_tiles((2 if pair else 1) * cols)
        ahead = min(PREFETCH_TILES, k_split // block_k)
        span = block_k << max(0, ahead.bit_length() - 1)   # a power of two of whole tiles inside the slice
        launch_fitting(
            _linear_rows_kernel, (triton.cdiv(n_out, cols), split),
            x, weight, x if bias is None else bias, out, rows, n_out, k, k_split, x.shape[1], *epilogue,
            K_TILES=k_split // block_k, COLS=cols, R_MAIN=r_main, R_TAIL=r_tail, PAIR=pair, EVEN_K=k % k_split == 0,
            IEEE=weight.dtype == torch.float32, ROWS_P=max(16, triton.next_power_of_2(rows)),
            LINES=pdl.lines(span, weight), SPAN=span, **common)
    if partials or split == 1:
        return out
    summed = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    blk = min(1024, triton.next_power_of_2(n))
    _sum_partials_kernel[(rows, triton.cdiv(n, blk))](out, out if bias is None else bias, summed, rows, n,
                                                     PARTS=split, HAS_BIAS=bias is not None, BLOCK=blk, num_warps=4,
                                                     **pdl.launch_args(x.device, rows))
    return summed


_FITTED_STAGES: dict[tuple, int] = {}   # (kernel, device, stages asked, constexprs) -> stages that fit that GPU


def launch_fitting(kernel, grid: tuple[int, ...], *args, num_stages: int, **constexprs) -> None:
    """kernel[grid](*args, num_stages=..., **constexprs), with fewer pipeline stages where the GPU's shared memory
    cannot hold the ones asked for. The tables' configs were picked on the H200 (227 KB a program); an A100
    (163 KB) or an RTX 4090 (99 KB) would refuse the deepest of them (Triton's OutOfResources) instead of running
    them a little slower. The first launch that fails finds the stages that fit; later ones start from them."""
    from triton.runtime.errors import OutOfResources

    def key() -> tuple:   # built only once some launch has had to fit (none does on the H200)
        return (kernel, args[0].device, asked, tuple(sorted(constexprs.items())))

    asked = num_stages
    if _FITTED_STAGES:
        num_stages = _FITTED_STAGES.get(key(), asked)
    while True:
        try:
            kernel[grid](*args, num_stages=num_stages, **constexprs)
            return
        except OutOfResources:
            if num_stages <= 1:
                raise
            num_stages -= 1
            _FITTED_STAGES[key()] = num_stages


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


def linear_silu(x: torch.Tensor, gate_up: torch.Tensor,
                config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """silu_mul(F.linear(x, gate_up)) for x [rows <= 64, K] and the stacked gate/up weight [2F, K] in one
    launch: each program owns gate and up rows of the same output columns, so SiLU*up is its epilogue
    (gate/up rounded to x's dtype first, as the two-launch path rounds them). Returns [rows, F]."""
    return _linear_rows_launch(x, gate_up, None, False, False, config, pair=True)


# -- cuBLAS with K split, for the down matmul past the small-rows table -----------------------------
W2_SPLIT_K_ROWS = 512  # where w2 runs on cuBLAS (more token rows than LINEAR_ROWS_TABLE covers), its K is cut into
                       # W2_SPLIT_K_ROWS // rows slices (w2_split_k: a divisor of K) run as one batched GEMM, float32
                       # partials that add_rmsnorm sums; 0: F.linear. Why: at 128-512 rows cuBLAS makes too few output
                       # tiles of w2's [rows x 1536] for the H200's 132 SMs. H200, 2026-12-04 (docs/BENCHMARKS.md
                       # twentieth session): w2 alone 12.5 -> 10.7 us at 128 rows (4 slices), 18.0 -> 15.0 at 256 (2);
                       # steps round-robin: 8 x 16 -3.2 %, 8 x 32 -3.9 %, 8 x 64 (no split) +0.2 %. A budget of 1024
                       # (8 / 4 / 2 slices) gave 8 x 16 +0.2 %, 8 x 32 -5.0 %, 8 x 64 -0.2 %; 2048 lost everywhere


def w2_split_k(rows: int, k: int) -> int:
    """K slices for the down matmul (x [rows, k]) on cuBLAS: the largest divisor of k up to W2_SPLIT_K_ROWS // rows
    (at most 16); 1 (no split) with the knob off or from W2_SPLIT_K_ROWS / 2 rows on."""
    most = min(16, W2_SPLIT_K_ROWS // max(1, rows))
    return max((d for d in range(1, most + 1) if k % d == 0), default=1)


def linear_split_k(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x @ weight.T for a matmul that add_rmsnorm adds to the residual (wo, w2; no bias), on cuBLAS: F.linear
    for parts <= 1; else float32 partials [parts, rows, N] (what linear_rows_partials returns), K cut into
    `parts` equal slices and run as one batched GEMM over strided views of x and weight (no copies)."""
    if parts <= 1:
        return F.linear(x, weight)
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or k % parts or not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"linear_split_k: x {tuple(x.shape)} against weight {tuple(weight.shape)} (contiguous) "
                         f"in {parts} equal K slices")
    piece = k // parts
    xs = x.view(rows, parts, piece).transpose(0, 1)         # [parts, rows, piece]
    ws = weight.view(n, parts, piece).permute(1, 2, 0)     # [parts, piece, n]: each slice's W^T, no copy
    if x.is_cuda and x.dtype != torch.float32:   # bf16/fp16 operands, float32 accumulation and output
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())   # (the CPU has no out_dtype; .float() of float32 is a no-op)


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
                # 1 x 1 replay went 1.517 -> 1.504 ms (-0.9 %, the epilogue takes back most of what the launch cost);
                # round-robin in the thirteenth session, +3.1 % (slower)


ROWS_ROPE = 1   # from two rows on (steps where linear_rows serves wqkv) its epilogue does RoPE and the cache writes
                # (0: rope_store's own launch). H200, 2026-12-02, round-robin replays: 1 x 16 -2.5 %, 8 x 1 -0.3 %;
                # the other cells did not use it then (within 0.2 %); 17-64 rows do since the twenty-fourth session


def rope_in_matmul_fits(rows: int, weight: torch.Tensor, head_dim: int) -> bool:
    """Whether linear_rope_store can serve this wqkv matmul: its knob on (GEMV_ROPE for one row, ROWS_ROPE for
    more), a table config, K unsplit, and column shares that keep RoPE's pairs together (one row: even
    BLOCK_N dividing head_dim; more: an even COLS)."""
    if not (GEMV_ROPE if rows == 1 else ROWS_ROPE) or not linear_rows_wins(rows, *weight.shape) \
            or weight.shape[0] % head_dim:
        return False
    cols, _, split, _, _ = linear_rows_config(rows, *weight.shape, can_split=False)
    return split == 1 and cols % 2 == 0 and (rows > 1 or head_dim % cols == 0)


def linear_rope_store_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                            sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, n_head: int,
                            n_head_kv: int) -> torch.Tensor:
    """rope_store_torch(F.linear(x, weight, bias), ...): the reference of linear_rope_store."""
    return rope_store_torch(F.linear(x, weight, bias), cos, sin, cache, slots, n_head, n_head_kv)


def linear_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, n_head: int,
                      n_head_kv: int) -> torch.Tensor:
    """rope_store(linear_rows(x, weight, bias), ...) in one launch (rope_in_matmul_fits): the matmul's
    epilogue rotates q and k and writes q [rows, n_head, D] (returned) and k, v to the rows' cache slots;
    one row runs the GEMV, more _linear_rows_kernel."""
    n, k = weight.shape
    if x.shape[1:] != (k,) or n != (n_head + 2 * n_head_kv) * cache.shape[-1]:
        raise ValueError(f"linear_rope_store: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"{n_head}+2*{n_head_kv} heads of {cache.shape[-1]}")
    return _linear_rows_launch(x, weight, bias, False, False, None,
                               rope=_Rope(cos, sin, cache, slots, n_head, n_head_kv))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, two_f = gate_up.shape
    f = two_f // 2
    out = torch.empty(rows, f, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(f, block))](gate_up, out, F_=f, BLOCK=block, num_warps=4,
                                                    **pdl.launch_args(gate_up.device, rows))
    return out


# -- warming L2 with the next matmuls' weights ----------------------------------------------------
L2_WARM = 32      # MB of a layer's next weights that a side stream asks L2 for while the layer's attention runs:
                  # all of wo, then the first 128-byte lines of every gate/up row as far as the budget goes (the
                  # matmul kernels walk K in order, so every program's first tiles hit L2). Attention, RoPE and the
                  # norms are latency-bound, HBM idles under them. 0: off. H200, 2026-12-03 (docs/BENCHMARKS.md
                  # fifteenth session), graph replays round-robin against no warming, two calls: 1 x 16 -0.9 / -1.3 %,
                  # 8 x 1 -1.9 / -2.0 %; at 1 x 64 every budget (16 / 32 / 48 MB) was 1.3-2.1 % slower, at 8 x 64
                  # within 1 %: hence the row bound
L2_WARM_ROWS = 64  # ... for steps of at most this many token rows. 16 until the twenty-fourth session: with wqkv on
                   # linear_rows at 17-64 rows (every kernel of a layer in one PDL chain) warming there paid too
                   # (1 x 64 -4.2 % with both, against -1.4 % for the matmul alone; budgets 16 / 24 / 48 MB slower)
WARM_BELOW_MAIN = 0   # 1: the engine captures a step's graph on a high-priority stream, so the main chain's kernel
                      # nodes outrank the warming side stream's (torch instantiates graphs with node priorities) where
                      # both wait for SMs: the warming then fills what the chain leaves instead of delaying it
WARM_ROWS_PER_PROGRAM = 128   # rows (one bulk prefetch each) per program of the warming kernel; 1024 (fewer,
                              # longer programs) was 3-7 % slower at 1 x 1, 1 x 16 and 8 x 1 (H200, 2026-12-03)


if triton is not None:
    @triton.jit
    def _l2_warm_kernel(W, n_rows, row_len, nbytes, ROWS: tl.constexpr):
        """One bulk L2 prefetch (cp.async.bulk.prefetch, sm_90+) of the first `nbytes` of each of ROWS rows of
        W [n_rows, row_len] per program: nothing waits for it, no register or shared memory receives it; the
        lines are in L2 when the next kernel that reads them starts. Surplus rows of the last program ask for
        the last row again."""
        r = tl.minimum(tl.program_id(0) * ROWS + tl.arange(0, ROWS), n_rows - 1)
        size = tl.full([ROWS], 0, tl.int32) + nbytes
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // dummy $0", "=r,l,r",
                                  [W + r.to(tl.int64) * row_len, size], dtype=tl.int32, is_pure=False, pack=1)


def bulk_prefetch_ok(device: torch.device) -> bool:
    """Whether _l2_warm_kernel can run on `device`: its bulk prefetch is an sm_90 instruction, so on an A100,
    L4 or RTX 4090 the kernel would not even assemble and the step must not warm. Tensors on the CPU or the meta
    device never launch it; they say yes, so the budget arithmetic can be checked anywhere."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def l2_warm_lines(rows: int, wo: torch.Tensor, gate_up: torch.Tensor) -> int | None:
    """How many 128-byte lines of each gate/up row to warm besides all of wo within L2_WARM MB (0: wo
    alone); None: no warming (knob off, more than L2_WARM_ROWS rows, or a GPU without the bulk prefetch)."""
    if not L2_WARM or rows > L2_WARM_ROWS or not bulk_prefetch_ok(wo.device):
        return None
    left = L2_WARM * 2 ** 20 - wo.numel() * wo.element_size()
    row_lines = gate_up.shape[1] * gate_up.element_size() // 128
    return int(max(0, min(row_lines, left // (gate_up.shape[0] * 128))))


def warm_l2(weight: torch.Tensor, lines: int | None = None) -> None:
    """Ask L2 for the first `lines` 128-byte lines of every row of `weight` (None: all of it), on the current
    stream. Changes no value anywhere: where it runs beside other kernels (a side stream) only their
    timing can change."""
    n, k = weight.shape
    row_bytes = k * weight.element_size()
    nbytes = row_bytes if lines is None else min(row_bytes, 128 * lines)
    if not weight.is_contiguous() or row_bytes % 16 or weight.data_ptr() % 16:
        raise ValueError(f"warm_l2: weight {tuple(weight.shape)} rows are not 16-byte aligned and contiguous")
    if nbytes:
        _l2_warm_kernel[(triton.cdiv(n, WARM_ROWS_PER_PROGRAM),)](weight, n, k, nbytes, ROWS=WARM_ROWS_PER_PROGRAM,
                                                                   num_warps=4)
