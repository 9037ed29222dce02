"""A decoder-only transformer for the `llama` and `qwen2` GGUF architectures, in plain torch.

    model = Decoder.from_gguf(path)                       # float32 on the CPU (the exact reference)
    model = Decoder.from_gguf(path, dtype=torch.bfloat16, device="cuda")
    model = Decoder.random(ModelConfig.qwen2_1_5b(), dtype=torch.bfloat16, device="cuda")  # timing only

One block: x += Wo·Attn(RoPE(Wq·n(x)), RoPE(Wk·n(x)), Wv·n(x)); x += W2·(silu(W1·n(x)) ⊙ W3·n(x)),
n = RMSNorm. q/k/v have biases in qwen2. Q, K and V come out of one fused matrix (wqkv), gate and up
out of another (w13), as in gpt-fast: fewer, larger matmuls.

RoPE is the NEOX ("rotate half") form for both architectures. llama.cpp applies the interleaved
form to `llama` GGUFs, whose converter permuted the rows of Q and K to make that equal to HF's
rotate-half; gguf_weights.py undoes that permutation at load time. Attention scores are unchanged
by it (the same permutation of head dimensions on both q and k), so the engine needs one RoPE only.

Attention is delegated to `tree_attention.attend`: queries are the step's tokens (a tree, or a
chunk of prompt), keys are the session's cached context plus the step's own tokens under a
boolean mask. `forward` returns the step's K/V rows in a scratch tensor instead of writing them
anywhere: the engine decides which of them become part of the cache (engine.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from edgespec.verifier.torch.tree_attention import attend, expand_mask_for_gqa

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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context_kv: torch.Tensor | None,
                mask: torch.Tensor, kv_out: torch.Tensor) -> torch.Tensor:
        """x [B, T, d]; context_kv [2, B, L, Hkv, D] or None; kv_out [2, B, T, Hkv, D] receives this step's K/V."""
        c = self.c
        B, T, _ = x.shape
        qkv = self.wqkv(self.attn_norm(x)).view(B, T, c.n_head + 2 * c.n_head_kv, c.head_dim)
        q, k, v = qkv.split((c.n_head, c.n_head_kv, c.n_head_kv), dim=2)
        kv_out[0] = apply_rope(k, *rope)
        kv_out[1] = v
        att = attend(apply_rope(q, *rope), kv_out[0], kv_out[1], context_kv, mask)
        x = x + self.wo(att.reshape(B, T, c.n_head * c.head_dim))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int = 4096) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = None if config.tied_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.rope = Rotary(config.head_dim, config.rope_theta, max_positions)
        self.requires_grad_(False)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                  max_positions: int = 4096) -> "Decoder":
        """Load and dequantize a llama/qwen2 GGUF file (see gguf_weights.py); dtype defaults to
        float32 on the CPU and bfloat16 elsewhere."""
        from edgespec.verifier.torch import gguf_weights

        if dtype is None:
            dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
        return gguf_weights.load_decoder(path, dtype=dtype, device=device, max_positions=max_positions)

    @classmethod
    def empty(cls, config: ModelConfig, *, dtype: torch.dtype, device: str | torch.device,
              max_positions: int = 4096) -> "Decoder":
        """Uninitialised weights on `device` (to be filled by a loader)."""
        with torch.device("meta"):
            model = cls(config, max_positions).to(dtype)
        model = model.to_empty(device=device)
        model.rope = Rotary(config.head_dim, config.rope_theta, max_positions).to(device)  # float32 tables
        return model.eval()

    @classmethod
    def random(cls, config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               max_positions: int = 4096, seed: int = 0) -> "Decoder":
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
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                context: Callable[[int], torch.Tensor] | None = None, logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One step over B sequences of T tokens each.

        tokens, positions: [B, T] int64 (positions < rope.max_positions: not checked here, no device sync).
        mask: [B, 1, T, L + T] bool, True where query t may attend
        key j (L context keys first, then the T step tokens). context: per layer, the sequences'
        cached K/V as [2, B, L, Hkv, D] (None when L = 0); the engine gathers it from blocks.
        Returns (logits [B, T, vocab] in the model dtype, or None if logits=False;
                 the step's K/V [n_layer, 2, B, T, Hkv, D]).
        """
        c = self.config
        B, T = tokens.shape
        kv = torch.empty(c.n_layer, 2, B, T, c.n_head_kv, c.head_dim, dtype=self.dtype, device=tokens.device)
        mask = expand_mask_for_gqa(mask, c.group)  # once per step, shared by every layer
        rope = self.rope(positions)
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, None if context is None else context(i), mask, kv[i])
        if not logits:
            return None, kv
        h = self.norm(x)
        out = F.linear(h, self.embed.weight) if self.lm_head is None else self.lm_head(h)
        return out, kv
