"""A decoder-only transformer for the `llama` and `qwen2` GGUF architectures, in plain torch.

    model = gguf_weights.load_model(path)                          # float32 on the CPU (the exact reference)
    model = gguf_weights.load_model(path, dtype=torch.bfloat16, device="cuda")
    model = TransformerLM.random(ModelConfig.qwen2_1_5b(), dtype=torch.bfloat16, device="cuda")  # timing only

(Loading lives in gguf_weights.py, which imports this module; this module imports nothing of it.)

One block: x += Wo·Attn(RoPE(Wq·n(x)), RoPE(Wk·n(x)), Wv·n(x)); x += W2·(silu(W1·n(x)) ⊙ W3·n(x)),
n = RMSNorm. q/k/v have biases in qwen2. Q, K and V come out of one fused matrix (wqkv), gate and up
out of another (w13), as in gpt-fast: fewer, larger matmuls.

RoPE is the NEOX ("rotate half") form for both architectures. llama.cpp applies the interleaved
form to `llama` GGUFs, whose converter permuted the rows of Q and K to make that equal to HF's
rotate-half; gguf_weights.py undoes that permutation at load time. Attention scores are unchanged
by it (the same permutation of head dimensions on both q and k), so the engine needs one RoPE only.

The forward writes each step token's K/V straight into the paged KV cache (at the flat slot the
engine chose for it) and then calls an attention function that reads keys from that cache
(tree_attention.py: a torch reference and a Triton kernel with the same signature). Nothing is
gathered or concatenated per layer by the model itself; which slots become committed context is
the engine's business (engine.py). The final norm and the LM head run in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    d_model: int
    n_head: int
    n_head_kv: int
    head_dim: int
    d_ff: int
    vocab_size: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool           # qwen2: q/k/v projections carry biases
    tied_embeddings: bool    # no separate output matrix: the LM head is the token embedding

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"architecture {self.arch!r} is not supported (only {', '.join(ARCHITECTURES)})")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"{self.n_head} query heads do not split into {self.n_head_kv} KV groups")

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_head // self.n_head_kv

    @property
    def kv_elements_per_token(self) -> int:
        """K and V of one token over all layers, in elements (times the element size: bytes)."""
        return 2 * self.n_layer * self.n_head_kv * self.head_dim

    @classmethod
    def qwen2_1_5b(cls) -> "ModelConfig":
        """The shape of Qwen2.5(-Coder)-1.5B (the default target), for benchmarks with random weights.
        Tied embeddings as in the HF config (1.544 B parameters); the GGUF stores a separate output
        matrix, which costs the same FLOPs and bytes per step."""
        return cls(arch="qwen2", n_layer=28, d_model=1536, n_head=12, n_head_kv=2, head_dim=128, d_ff=8960,
                   vocab_size=151936, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True, tied_embeddings=True)

    @property
    def n_params(self) -> int:
        q, kv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        block = self.d_model * (q + 2 * kv) + q * self.d_model + 3 * self.d_model * self.d_ff + 2 * self.d_model
        block += (q + 2 * kv) if self.qkv_bias else 0
        head = 0 if self.tied_embeddings else self.vocab_size * self.d_model
        return self.vocab_size * self.d_model + self.n_layer * block + self.d_model + head

    @classmethod
    def tiny(cls, arch: str = "qwen2") -> "ModelConfig":
        """A toy configuration for smoke tests."""
        return cls(arch=arch, n_layer=2, d_model=64, n_head=4, n_head_kv=2, head_dim=16, d_ff=128,
                   vocab_size=512, rope_theta=1e4, norm_eps=1e-6, qkv_bias=arch == "qwen2", tied_embeddings=True)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """The same norm kept in float32 (for the LM head)."""
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


class Rotary(nn.Module):
    """cos/sin tables for positions [0, max_positions), computed in float64 once."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, D/2] for positions [B, T] (once per step; the caller checks the range)."""
        return self.cos[positions][:, :, None, :], self.sin[positions][:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D], NEOX form: rotate the pairs (x[i], x[i + D/2]), in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.wqkv = nn.Linear(c.d_model, q + 2 * kv, bias=c.qkv_bias)
        self.wo = nn.Linear(q, c.d_model, bias=False)
        self.ffn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.w13 = nn.Linear(c.d_model, 2 * c.d_ff, bias=False)   # gate (w1) and up (w3) stacked
        self.w2 = nn.Linear(c.d_ff, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                slots: torch.Tensor, attend: "Attention") -> torch.Tensor:
        """x [B, T, d]; cos/sin [B, T, 1, D/2]; cache: this layer's [2, S, Hkv, D] flat slot view of the
        paged KV cache; slots [B*T]: where this step's K/V go; attend reads keys back from `cache`."""
        c = self.c
        B, T, _ = x.shape
        qkv = self.wqkv(self.attn_norm(x)).view(B, T, c.n_head + 2 * c.n_head_kv, c.head_dim)
        q, k, v = qkv.split((c.n_head, c.n_head_kv, c.n_head_kv), dim=2)
        cache[0].index_copy_(0, slots, apply_rope(k, cos, sin).reshape(B * T, c.n_head_kv, c.head_dim))
        cache[1].index_copy_(0, slots, v.reshape(B * T, c.n_head_kv, c.head_dim))
        att = attend(apply_rope(q, cos, sin), cache)
        x = x + self.wo(att.reshape(B, T, c.n_head * c.head_dim))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Attention(Protocol):
    """q [B, T, Hq, D] (after RoPE), one layer's cache [2, S, Hkv, D] -> [B, T, Hq, D]. The step's
    own K/V are already in the cache; the callable carries the step's block tables and tree mask."""

    def __call__(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor: ...


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int = 4096) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = None if config.tied_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.rope = Rotary(config.head_dim, config.rope_theta, max_positions)
        self.fused_ops = False  # fused.py's Triton kernels (CUDA); the engine turns them on
        # with fused_ops: fused.linear_rows for the four block matmuls when B*T <= this (0: cuBLAS always)
        self.small_rows_matmul = 0
        self._warm_stream: torch.cuda.Stream | None = None   # fused.L2_WARM's side stream, made on first use
        self.requires_grad_(False)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def empty(cls, config: ModelConfig, *, dtype: torch.dtype, device: str | torch.device,
              max_positions: int = 4096) -> "TransformerLM":
        """Uninitialised weights on `device` (to be filled by a loader)."""
        with torch.device("meta"):
            model = cls(config, max_positions).to(dtype)
        model = model.to_empty(device=device)
        model.rope = Rotary(config.head_dim, config.rope_theta, max_positions).to(device)  # float32 tables
        return model.eval()

    @classmethod
    def random(cls, config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               max_positions: int = 4096, seed: int = 0) -> "TransformerLM":
        """Random weights at a sensible scale (timing and shape tests only)."""
        model = cls.empty(config, dtype=dtype, device=device, max_positions=max_positions)
        g = torch.Generator(device=device).manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.ndim == 1:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
        return model

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    # -- forward ------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
                attend: Attention, logits: bool = True) -> torch.Tensor | None:
        """One step over B sequences of T tokens each; no host sync, so it can be graph-captured.

        tokens, positions: [B, T] int64 (positions < rope.max_positions: the engine checks).
        slots: [B*T] int64 flat cache slots receiving the step's K/V (block * block_size + offset).
        cache: the whole paged cache as [n_layer, 2, S, Hkv, D] (S = blocks * block_size).
        Returns float32 logits [B, T, vocab], or None with logits=False (prefill).
        """
        cos, sin = self.rope(positions)
        if self.fused_ops:
            return self._forward_fused(tokens, cos, sin, slots, cache, attend, logits)
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache[i], slots, attend)
        if not logits:
            return None
        return self.head(x)

    def _forward_fused(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                       cache: torch.Tensor, attend: Attention, logits: bool) -> torch.Tensor | None:
        """The same forward with fused.py's Triton kernels: eight to ten launches per layer (the residual
        add is folded into the next RMSNorm, the last one into the final norm). With small_rows_matmul >= B*T,
        the matmuls for which fused.LINEAR_ROWS_TABLE has a config (measured faster than cuBLAS there)
        are fused.linear_rows: the split-K partials of wo and w2 are summed by the add_rmsnorm that reads
        them (past the table, w2's cuBLAS K slices with fused.W2_SPLIT_K_ROWS); gate/up runs as
        fused.linear_silu (SiLU*up its epilogue), or else w2's version applies SiLU*up as it loads gate/up
        (no silu_mul launch either way)."""
        from edgespec.verifier.torch import fused

        c = self.config
        B, T = tokens.shape
        rows = B * T
        small = rows <= min(self.small_rows_matmul, fused.LINEAR_ROWS_MAX)
        blk = self.layers[0]
        use = {name: small and fused.linear_rows_wins(rows, *getattr(blk, name).weight.shape)
               for name in ("wqkv", "wo", "w13", "w2")}   # per matrix: where the table says it beats cuBLAS
        use["w13"] = use["w13"] and rows >= fused.LINEAR_SILU_ROWS
        x = self.embed(tokens).view(rows, c.d_model)
        cos, sin = cos.reshape(rows, -1), sin.reshape(rows, -1)
        h, x = fused.add_rmsnorm(x, None, self.layers[0].attn_norm.weight, c.norm_eps)
        rope_in_matmul = use["wqkv"] and fused.rope_in_matmul_fits(rows, blk.wqkv.weight, c.head_dim)
        w2_parts = fused.w2_split_k(rows, blk.w2.weight.shape[1])   # w2's K slices where it runs on cuBLAS
        warm_lines = fused.l2_warm_lines(rows, blk.wo.weight, blk.w13.weight) if x.is_cuda else None
        warm = self._side_stream() if warm_lines is not None else None
        for i, layer in enumerate(self.layers):
            if rope_in_matmul:   # one launch: the matmul's epilogue rotates and writes the cache
                q = fused.linear_rope_store(h, layer.wqkv.weight, layer.wqkv.bias, cos, sin, cache[i], slots,
                                            c.n_head, c.n_head_kv)
            else:
                qkv = fused.linear_rows(h, layer.wqkv.weight, layer.wqkv.bias) if use["wqkv"] else layer.wqkv(h)
                q = fused.rope_store(qkv, cos, sin, cache[i], slots, c.n_head, c.n_head_kv)
            if warm is not None:   # wo and gate/up into L2 beside the attention (fused.L2_WARM): reads weights only
                warm.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(warm):
                    fused.warm_l2(layer.wo.weight)
                    fused.warm_l2(layer.w13.weight, warm_lines)
            att = attend(q.view(B, T, c.n_head, c.head_dim), cache[i]).reshape(rows, -1)
            out = fused.linear_rows_partials(att, layer.wo.weight) if use["wo"] else layer.wo(att)
            h, x = fused.add_rmsnorm(x, out, layer.ffn_norm.weight, c.norm_eps)   # partials: summed here
            if use["w13"]:   # SiLU*up as the gate/up matmul's epilogue
                act = fused.linear_silu(h, layer.w13.weight)
                down = fused.linear_rows_partials(act, layer.w2.weight) if use["w2"] else layer.w2(act)
            elif use["w2"]:  # float32 partials [SPLIT, rows, d], SiLU*up applied as w2 loads gate/up
                down = fused.linear_rows_partials(layer.w13(h), layer.w2.weight, silu=True)
            else:
                down = fused.linear_split_k(fused.silu_mul(layer.w13(h)), layer.w2.weight, w2_parts)
            if i + 1 < len(self.layers):
                h, x = fused.add_rmsnorm(x, down, self.layers[i + 1].attn_norm.weight, c.norm_eps)
            elif logits:   # the final norm (float32 inside, rounded once for the LM head's operands)
                h, x = fused.add_rmsnorm(x, down, self.norm.weight, c.norm_eps)
        if warm is not None:   # the side stream rejoins (a captured graph must end on the stream it began on)
            torch.cuda.current_stream().wait_stream(warm)
        if not logits:
            return None
        return self.lm_head_logits(h.view(B, T, c.d_model))

    def _side_stream(self) -> torch.cuda.Stream:
        """The stream that warms L2 beside the forward (one per model: captured graphs fork onto it)."""
        if self._warm_stream is None:
            self._warm_stream = torch.cuda.Stream(self.device)
        return self._warm_stream

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head in float32 (argmax and top-2 margins are decided on these)."""
        return self.lm_head_logits(self.norm.forward_float(x))

    def lm_head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final-normed hidden states h (float32, or already rounded to the weights'
        dtype by the fused forward, which is what the bf16 product below takes anyway)."""
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        if w.dtype == torch.float32:
            return F.linear(h.float(), w)
        if h.is_cuda:  # bf16 operands, float32 accumulation and output
            try:
                return torch.mm(h.to(w.dtype).flatten(0, -2), w.t(), out_dtype=torch.float32).view(*h.shape[:-1], -1)
            except (TypeError, RuntimeError):  # a torch without out_dtype: bf16 output
                return F.linear(h.to(w.dtype), w).float()
        return F.linear(h.float(), w.float())
