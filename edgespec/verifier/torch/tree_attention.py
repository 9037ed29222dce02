"""Tree attention: which keys each step token may see, and the attention call itself.

A step is T tokens per sequence: a draft tree (node 0 = the root, the last committed token), or a
chunk of prompt (a chain, i.e. a causal mask). Keys are the sequence's cached context (L tokens,
positions 0..L-1) followed by the step's own T tokens. Token i attends to
- every valid context key (j < its sequence's context length), and
- step token j iff j is an ancestor of i or i itself (the ancestor mask),
and sits at position L + depth(i). That is exactly what a chain decode of i's root-to-i path sees.

The step's own K/V are written into the sequence's cache slots ctx_len + i (i = node index) before
attention runs, so keys are simply cache positions 0..ctx_len+T-1, read through the block table:
nothing is concatenated. After acceptance the engine moves the accepted nodes' rows into place.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from edgespec.verifier.torch.tree_ops import unpack_ancestor_bits


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """[T, T] bool: m[i, j] iff node j is node i or one of its ancestors (parents precede children)."""
    n = len(parents)
    m = np.eye(n, dtype=bool)
    for i in range(1, n):
        m[i] |= m[parents[i]]
    return m


def depths(parents: Sequence[int]) -> np.ndarray:
    d = np.zeros(len(parents), np.int64)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def chain_parents(n: int) -> list[int]:
    """Parents of a chain (a prompt chunk): the ancestor mask is then the causal mask."""
    return list(range(-1, n - 1))


def visibility(ctx_lens: torch.Tensor, anc: torch.Tensor, key_len: int) -> torch.Tensor:
    """[B, T, key_len] bool from context lengths [B] and ancestor masks [B, T, T] (on the device, no sync).

    Keys are cache positions 0..key_len-1 of each sequence; the step's token i sits at position
    ctx_len + i (index order: its RoPE position is ctx_len + depth, its slot is ctx_len + i). Key 0 is
    always visible, so a padding row (no context, no tree) never has an empty softmax row; for a real
    row key 0 is context or the root, visible anyway."""
    B, T, _ = anc.shape
    j = torch.arange(key_len, device=anc.device)
    rel = j[None, :] - ctx_lens[:, None]                                   # [B, K]
    in_tree = (rel >= 0) & (rel < T)
    padded = F.pad(anc, (0, 1))                                            # column T: False
    idx = torch.where(in_tree, rel, T)[:, None, :].expand(B, T, key_len)
    return (rel < 0)[:, None, :] | padded.gather(2, idx) | (j == 0)[None, None, :]


def block_slots(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, nb * block_size] flat cache slots of each sequence's positions, in position order."""
    offsets = torch.arange(block_size, device=tables.device, dtype=tables.dtype)
    return (tables[:, :, None] * block_size + offsets).flatten(1)


class TorchPagedAttention:
    """Reference tree attention over the paged cache: gather each sequence's blocks, then SDPA with
    a boolean mask. GQA without repeating K/V: the G query heads that share a KV head are packed
    into the query-row axis ([B, Hkv, G*T, D] against [B, Hkv, K, D]), so each KV head is read once
    per group. Runs anywhere torch runs (CPU tests use it); the Triton kernel in triton_attention.py
    has the same constructor and call."""

    def __init__(self, tables: torch.Tensor, ctx_lens: torch.Tensor, anc: torch.Tensor, block_size: int,
                 group: int) -> None:
        B, T, _ = anc.shape
        key_len = tables.shape[1] * block_size
        vis = visibility(ctx_lens, anc, key_len)
        self.mask = vis[:, None].expand(B, group, T, key_len).reshape(B, 1, group * T, key_len)
        self.slots = block_slots(tables, block_size)

    @classmethod
    def packed(cls, tables: torch.Tensor, ctx_lens: torch.Tensor, bits: torch.Tensor, block_size: int,
               group: int) -> "TorchPagedAttention":
        """The same from ancestor bits (tree_ops.prepare's [B, T, W] int32) instead of a bool mask."""
        return cls(tables, ctx_lens, unpack_ancestor_bits(bits, bits.shape[1]), block_size, group)

    def __call__(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        B, T, Hq, D = q.shape
        Hkv = cache.shape[2]
        G = Hq // Hkv
        k = cache[0][self.slots].transpose(1, 2)                           # [B, Hkv, K, D]
        v = cache[1][self.slots].transpose(1, 2)
        qp = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=self.mask)
        return out.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)
