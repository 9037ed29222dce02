"""Fused small ops for the GPU forward (Triton): at one token per sequence a step is ~45 tiny
kernels per layer when each torch op is its own launch, which costs more than the weights take to
read. These kernels cut a layer to ten launches: add+RMSNorm, QKV matmul, RoPE+cache write,
attention (2), output matmul, add+RMSNorm, gate/up matmul, SiLU*up, down matmul.

Each function here has a torch reference with the same signature (`*_torch`), used on the CPU (where
the float32 path must stay the exact reference) and by the tests, which run the Triton versions in
Triton's CPU interpreter against them. All arithmetic is float32; outputs are rounded once to the
model dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use the torch versions
    triton = None


# -- torch references -----------------------------------------------------------------------------
def add_rmsnorm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); x [rows, d] is updated in place."""
    if residual is not None:
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


def argmax_top2_torch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, V] -> (argmax [rows] int64, the first index of the maximum; top-2 margin [rows]:
    the largest minus the second largest value, 0 when the maximum occurs twice)."""
    top2 = logits.topk(2, dim=-1).values
    return logits.argmax(-1), top2[..., 0] - top2[..., 1]


# -- Triton kernels -------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _add_rmsnorm_kernel(X, R, W, Y, eps, N, HAS_R: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(X + row * N + cols, mask=ok, other=0.0)
        if HAS_R:
            x = (x.to(tl.float32) + tl.load(R + row * N + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(X + row * N + cols, x, mask=ok)
        h = x.to(tl.float32)
        var = tl.sum(h * h, 0) / N
        y = h * (1.0 / tl.sqrt(var + eps)) * tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_store_kernel(QKV, Cos, Sin, Slots, KC, VC, QO, v_offset,
                           H_Q: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        half = tl.arange(0, D // 2)
        base = QKV + (row * (H_Q + 2 * H_KV) + head) * D
        if head < H_Q + H_KV:
            x1 = tl.load(base + half).to(tl.float32)
            x2 = tl.load(base + D // 2 + half).to(tl.float32)
            c = tl.load(Cos + row * (D // 2) + half)
            s = tl.load(Sin + row * (D // 2) + half)
            o1 = (x1 * c - x2 * s).to(QO.dtype.element_ty)
            o2 = (x2 * c + x1 * s).to(QO.dtype.element_ty)
            if head < H_Q:
                dst = QO + (row * H_Q + head) * D
            else:
                slot = tl.load(Slots + row)
                dst = KC + (slot * H_KV + head - H_Q) * D
            tl.store(dst + half, o1)
            tl.store(dst + D // 2 + half, o2)
        else:
            slot = tl.load(Slots + row)
            d = tl.arange(0, D)
            tl.store(VC + v_offset + (slot * H_KV + head - H_Q - H_KV) * D + d, tl.load(base + d))

    @triton.jit
    def _silu_mul_kernel(GU, O, F_: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < F_
        g = tl.load(GU + row * 2 * F_ + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GU + row * 2 * F_ + F_ + cols, mask=ok, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(O + row * F_ + cols, y.to(O.dtype.element_ty), mask=ok)


    @triton.jit
    def _top2_chunks_kernel(X, Val, Idx, Second, V, CHUNKS, BLOCK: tl.constexpr):
        """Stage 1 of argmax + top-2: each program reduces one BLOCK-wide chunk of one row to (its
        maximum, the first index of it, the runner-up). Many programs per row: one program reading
        a whole 600 KB row of a 152k vocabulary alone took 49 us on the H200."""
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
    def _top2_merge_kernel(Val, Idx, Second, Arg, Margin, CHUNKS, CHUNKS_P2: tl.constexpr):
        """Stage 2: the row's maximum over the chunks (ties: the earliest chunk, so the first index),
        and the runner-up: the best of the other chunks' maxima and the winning chunk's runner-up."""
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
    _top2_chunks_kernel[(rows, chunks)](logits, val, idx, second, V, chunks, BLOCK=block, num_warps=8)
    arg = torch.empty(rows, dtype=torch.int64, device=logits.device)
    margin = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _top2_merge_kernel[(rows,)](val, idx, second, arg, margin, chunks, CHUNKS_P2=triton.next_power_of_2(chunks),
                                num_warps=1)
    return arg, margin


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x.shape
    y = torch.empty_like(x)
    _add_rmsnorm_kernel[(rows,)](x, x if residual is None else residual, weight, y, eps, n,
                                 HAS_R=residual is not None, BLOCK=triton.next_power_of_2(n), num_warps=8)
    return y, x


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
               slots: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    rows = qkv.shape[0]
    D = cache.shape[-1]
    q = torch.empty(rows, n_head, D, dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(rows, n_head + 2 * n_head_kv)](qkv, cos, sin, slots, cache, cache, q, cache.stride(0),
                                                      H_Q=n_head, H_KV=n_head_kv, D=D, num_warps=1)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, two_f = gate_up.shape
    f = two_f // 2
    out = torch.empty(rows, f, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(f, block))](gate_up, out, F_=f, BLOCK=block, num_warps=4)
    return out
