"""Grow a draft token tree with the small model (EAGLE-2 style dynamic trees).

Each depth expands the `width` frontier nodes with the highest path probability in ONE llama_decode
(one fresh KV sequence per node, seeded with a copy of its parent's sequence); afterwards the best
`budget` nodes overall are kept. Path probability never increases along a path, and in sampled
mode we also make it non-increasing along each node's draw order, so "best N by score" always
yields a valid tree whose sibling sets are prefixes of the draw order (which the sampled
acceptance rule needs, see common/acceptance.py).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edgespec.common.acceptance import draw_without_replacement
from edgespec.common.rng import Purpose, generator
from edgespec.common.sampling import (
    SamplingParams,
    dequantize,
    probabilities,
    quantize_draft,
)
from edgespec.common.tree import TokenTree
from edgespec.runtime.llama import ContextConfig, LlamaModel, TreeContext


@dataclass(frozen=True)
class TreeShape:
    """How big a tree to draft. budget counts drafted nodes (the root is extra)."""

    budget: int = 16
    max_depth: int = 6
    top_k: int = 4          # children considered per node; also the draft's q support when sampling
    width: int = 4          # frontier nodes expanded per depth (one decode per depth)
    min_prob: float = 0.0   # drop nodes whose path probability falls below this

    @classmethod
    def target_only(cls) -> "TreeShape":
        """No drafting at all: plain autoregressive decoding with the target (the baseline)."""
        return cls(budget=0)

    @property
    def label(self) -> str:
        """Short name for stats: "target-only", "chain4", "tree16"."""
        if self.budget == 0:
            return "target-only"
        return f"chain{self.budget}" if self.width == 1 and self.top_k == 1 else f"tree{self.budget}"

    @classmethod
    def chain(cls, k: int) -> "TreeShape":
        """Classic chain speculation with k drafted tokens."""
        return cls(budget=k, max_depth=k, top_k=1, width=1)

    def __post_init__(self) -> None:
        if self.budget < 0 or min(self.max_depth, self.top_k, self.width) < 1:
            raise ValueError(f"tree shape needs budget >= 0 and max_depth, top_k, width >= 1: {self}")


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    score: float
    seq: int = -1                      # KV sequence holding this node, once decoded
    q_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    q_weights: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint16))


def best_nodes(scores: np.ndarray | list[float], n: int) -> list[int]:
    """Indices (ascending, root 0 always kept) of the n best non-root nodes by (score desc, index).

    Scores never increase from parent to child nor along a node's draw order, and parents have
    smaller indices, so the result is always a valid tree with prefix-closed sibling sets.
    """
    ranked = sorted(range(1, len(scores)), key=lambda i: (-scores[i], i))[:n]
    return [0, *sorted(ranked)]


@dataclass
class Draft:
    tree: TokenTree
    node_seq: list[int]      # per tree node, the draft KV sequence holding it (-1: not decoded)
    scores: np.ndarray       # per tree node, the draft's path probability (root 1)
    seconds: float = 0.0
    decodes: int = 0
    shape: str = ""          # TreeShape.label of the shape it was drafted with

    def pruned(self, n: int) -> "Draft":
        """The same draft cut to its n best nodes (for a smaller step than was drafted)."""
        keep = best_nodes(self.scores, n)
        index = {old: new for new, old in enumerate(keep)}
        t = self.tree
        tree = TokenTree(tokens=t.tokens[keep], parents=np.array([index.get(int(t.parents[i]), -1) for i in keep]),
                         q_tokens=t.q_tokens[keep], q_weights=t.q_weights[keep])
        return Draft(tree, [self.node_seq[i] for i in keep], self.scores[keep], self.seconds, self.decodes, self.shape)


class Drafter:
    """Owns the draft model's KV cache for one conversation."""

    def __init__(self, model: LlamaModel, config: ContextConfig = ContextConfig()) -> None:
        self.model = model
        self.ctx = TreeContext(model, config)

    def close(self) -> None:
        self.ctx.close()

    def predict_next(self, committed: list[int]) -> int:
        """The draft's most probable next token after `committed` (a guess of the target's)."""
        return int(np.argmax(self.ctx.sync(committed)))

    def grow(self, committed: list[int], shape: TreeShape, sampling: SamplingParams, step: int,
             stop: Callable[[], bool] | None = None) -> Draft:
        """Draft a tree rooted at committed[-1]; `stop()` returning True ends growth early."""
        started = time.perf_counter()
        root_logits = self.ctx.sync(committed)
        nodes = [_Node(token=committed[-1], parent=-1, depth=0, score=1.0, seq=0)]
        frontier = self._expand(nodes, 0, root_logits, shape, sampling, step)
        decodes, next_seq = 1, 1
        for depth in range(1, shape.max_depth):
            if stop is not None and stop():
                break
            cutoff = self._cutoff(nodes, shape.budget)
            candidates = [i for i in frontier if nodes[i].score >= max(cutoff, shape.min_prob)
                          and not self.model.is_end_of_generation(nodes[i].token)]
            pick = sorted(candidates, key=lambda i: (-nodes[i].score, i))[: shape.width]
            if not pick or next_seq + len(pick) > self.ctx.n_seq_max:
                break
            pick.sort()
            logits = self.ctx.decode_frontier([nodes[i].token for i in pick], [nodes[nodes[i].parent].seq for i in pick],
                                              depth, next_seq)
            decodes += 1
            frontier = []
            for row, i in enumerate(pick):
                nodes[i].seq = next_seq + row
                frontier += self._expand(nodes, i, logits[row], shape, sampling, step)
            next_seq += len(pick)
        draft = self._select(nodes, shape.budget, sampling.greedy)
        draft.seconds, draft.decodes = time.perf_counter() - started, decodes
        return draft

    def accept(self, draft: Draft, path: list[int]) -> None:
        """Keep the KV of the longest decoded accepted prefix; the rest is re-ingested lazily."""
        decoded = list(itertools.takewhile(lambda n: draft.node_seq[n] >= 0, path))
        if not decoded:
            self.ctx.drop_branches()
            return
        self.ctx.adopt_branch(draft.node_seq[decoded[-1]], draft.tree.tokens[decoded].tolist())

    # -- internals ----------------------------------------------------------------------------
    def _expand(self, nodes: list[_Node], parent: int, logits: np.ndarray, shape: TreeShape,
                sampling: SamplingParams, step: int) -> list[int]:
        """Add the children of `parent` in draw order; returns their indices."""
        if sampling.greedy:
            z = logits.astype(np.float64) - logits.max()
            probs = np.exp(z) / np.exp(z).sum()
            order = np.argsort(-probs, kind="stable")[: shape.top_k]
            child_tokens, child_q = order, probs[order]
        else:
            p = probabilities(logits, sampling)
            support = np.argsort(-p, kind="stable")[: shape.top_k]
            support = support[p[support] > 0]
            q_tokens, q_weights = quantize_draft(support, p[support])
            q = dequantize(q_weights)
            nodes[parent].q_tokens, nodes[parent].q_weights = q_tokens, q_weights
            drawn = draw_without_replacement(q, q.size, generator(sampling.seed, step, parent, Purpose.DRAFT))
            child_tokens, child_q = q_tokens[drawn], q[drawn]
        added, score = [], nodes[parent].score
        for token, q in zip(child_tokens.tolist(), child_q.tolist()):
            score = min(score, nodes[parent].score * q)  # non-increasing along the draw order
            nodes.append(_Node(token=int(token), parent=parent, depth=nodes[parent].depth + 1, score=score))
            added.append(len(nodes) - 1)
        return added

    @staticmethod
    def _cutoff(nodes: list[_Node], budget: int) -> float:
        """Score of the budget-th best node so far: anything below can never be selected."""
        scores = sorted((n.score for n in nodes[1:]), reverse=True)
        return scores[budget - 1] if len(scores) >= budget else 0.0

    @staticmethod
    def _select(nodes: list[_Node], budget: int, greedy: bool) -> Draft:
        keep = best_nodes([n.score for n in nodes], budget)
        new_index = {old: new for new, old in enumerate(keep)}
        k = 0 if greedy else max((nodes[i].q_tokens.size for i in keep), default=0)
        q_tokens = np.full((len(keep), k), -1, np.int32)
        q_weights = np.zeros((len(keep), k), np.uint16)
        for new, old in enumerate(keep):
            m = min(k, nodes[old].q_tokens.size)
            q_tokens[new, :m] = nodes[old].q_tokens[:m]
            q_weights[new, :m] = nodes[old].q_weights[:m]
        tree = TokenTree(tokens=np.array([nodes[i].token for i in keep], np.int32),
                         parents=np.array([new_index.get(nodes[i].parent, -1) for i in keep], np.int32),
                         q_tokens=q_tokens, q_weights=q_weights)
        return Draft(tree=tree, node_seq=[nodes[i].seq for i in keep], scores=np.array([nodes[i].score for i in keep]))
