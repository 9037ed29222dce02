"""Lossless acceptance of a token tree (greedy and sampled). Pure functions of logits/probabilities.

Sampled mode is multi-draft speculative sampling (SpecInfer; Chen et al.'s residual rule) with
children drawn *without replacement* from the draft's sparse q (recursive rejection sampling,
Jeon et al. 2024): the i-th sibling was drawn from q with the earlier siblings removed and
renormalised (q_i), so it is accepted with min(1, r(x)/q_i(x)) and on rejection the target's
residual becomes r <- norm(max(0, r - q_i)). Each try is a standard speculative-sampling step for
target r and proposal q_i, hence the emitted token is distributed exactly as the target's p.
Drafts therefore never repeat a sibling, and pruning must keep a prefix of each node's draw order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from edgespec.common.rng import Purpose, generator
from edgespec.common.tree import TokenTree


@dataclass(frozen=True)
class Acceptance:
    path: list[int]   # accepted drafted nodes, root excluded, in order
    next_token: int   # the target's own token after the path (bonus or residual sample)


def draw_without_replacement(q: np.ndarray, m: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of m draws without replacement from q, in draw order (Gumbel-top-m)."""
    keys = np.log(q) - np.log(-np.log(rng.random(q.size)))
    return np.argsort(-keys, kind="stable")[:m]


def resolve_siblings(p: np.ndarray, q_tokens: np.ndarray, q: np.ndarray, child_tokens: Sequence[int],
                     accept_rng: np.random.Generator, residual_rng: np.random.Generator) -> tuple[int, int | None]:
    """Try the children in draw order; return (emitted token, index of the accepted child or None).

    p: target distribution over the whole vocabulary; q over `q_tokens` (the draft's support).
    """
    r = np.asarray(p, dtype=np.float64)
    remaining = np.ones(q.size, dtype=bool)
    position = {int(t): j for j, t in enumerate(q_tokens)}
    for i, token in enumerate(child_tokens):
        q_i = np.where(remaining, q, 0.0)
        q_i /= q_i.sum()
        j = position[int(token)]
        if accept_rng.random() * q_i[j] < r[token]:
            return int(token), i
        residual = r.copy()
        residual[q_tokens] = np.maximum(0.0, r[q_tokens] - q_i)
        mass = residual.sum()
        if mass > 1e-12:  # mass 0 would mean r == q_i, where rejection is impossible
            r = residual / mass
        remaining[j] = False
    return int(residual_rng.choice(r.size, p=r)), None


def accept_greedy(tree: TokenTree, target_argmax: Sequence[int]) -> Acceptance:
    """Follow the child equal to the target's argmax while there is one."""
    kids = tree.children()
    node, path = 0, []
    while True:
        best = int(target_argmax[node])
        nxt = next((c for c in kids[node] if tree.tokens[c] == best), None)
        if nxt is None:
            return Acceptance(path, best)
        path.append(nxt)
        node = nxt


def accept_sampled(tree: TokenTree, target_probs: Callable[[int], np.ndarray], seed: int, step: int) -> Acceptance:
    """Walk the tree with `resolve_siblings`; random numbers keyed by (seed, step, node)."""
    kids = tree.children()
    node, path = 0, []
    while True:
        q_tokens, q = tree.draft_distribution(node) if kids[node] else (np.zeros(0, np.int32), np.zeros(0))
        token, child = resolve_siblings(
            target_probs(node), q_tokens, q, tree.tokens[kids[node]],
            generator(seed, step, node, Purpose.ACCEPT), generator(seed, step, node, Purpose.RESIDUAL))
        if child is None:
            return Acceptance(path, token)
        node = kids[node][child]
        path.append(node)
