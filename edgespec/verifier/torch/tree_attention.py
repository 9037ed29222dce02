"""Tree attention: which keys each step token may see, and the attention call itself.

A step is T tokens per sequence: a draft tree (node 0 = the root, the last committed token), or a
chunk of prompt (a chain, i.e. a causal mask). Keys are the sequence's cached context (L tokens,
positions 0..L-1) followed by the step's own T tokens. Token i attends to
- every valid context key (j < its sequence's context length), and
- step token j iff j is an ancestor of i or i itself (the ancestor mask),
and sits at position L + depth(i). That is exactly what a chain decode of i's root-to-i path sees.

Masks are boolean (True = may attend) and go to `scaled_dot_product_attention` unchanged, which
runs on the CPU and on CUDA. GQA without repeating K/V: the G query heads that share a KV head are
packed into the query-row axis ([B, Hkv, G*T, D] against [B, Hkv, L+T, D]), so each KV head is read
once per step, and the mask is repeated over the G row groups once per step, not per layer.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F


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


def step_mask(parents_list: Sequence[Sequence[int]], context_lens: Sequence[int], key_len: int) -> np.ndarray:
    """[B, 1, T, key_len + T] bool for B sequences; T is the longest tree, shorter ones are padded.

    key_len: context slots gathered per sequence (>= every context length; extra slots are padding).
    Padding tree rows attend to themselves only, so no softmax row is ever empty.
    """
    B, T = len(parents_list), max(len(p) for p in parents_list)
    mask = np.zeros((B, 1, T, key_len + T), dtype=bool)
    for b, (parents, n_ctx) in enumerate(zip(parents_list, context_lens)):
        n = len(parents)
        mask[b, 0, :n, :n_ctx] = True
        mask[b, 0, :n, key_len:key_len + n] = ancestor_mask(parents)
        mask[b, 0, range(n, T), range(key_len + n, key_len + T)] = True
    return mask


def expand_mask_for_gqa(mask: torch.Tensor, group: int) -> torch.Tensor:
    """[B, 1, T, K] -> [B, 1, G*T, K]: the same rows for each of the G query heads of a KV head."""
    if group == 1:
        return mask
    B, _, T, K = mask.shape
    return mask.expand(B, group, T, K).reshape(B, 1, group * T, K)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_kv: torch.Tensor | None,
           mask: torch.Tensor) -> torch.Tensor:
    """q [B, T, Hq, D]; k, v [B, T, Hkv, D] (the step's own); context_kv [2, B, L, Hkv, D] or None;
    mask [B, 1, G*T, L+T] (already expanded). Returns [B, T, Hq, D]; head h uses KV head h // G."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    if context_kv is not None and context_kv.shape[2]:
        k = torch.cat((context_kv[0], k), dim=1)
        v = torch.cat((context_kv[1], v), dim=1)
    qp = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    out = F.scaled_dot_product_attention(qp, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)
