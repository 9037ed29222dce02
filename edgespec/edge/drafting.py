"""Grow a draft token tree with the small model (EAGLE-2 style dynamic trees).

Each depth expands the `width` frontier nodes with the highest path probability in ONE llama_decode
(one fresh KV sequence per node, seeded with a copy of its parent's sequence); afterwards the best
`budget` nodes are kept (`selection_order`). How children are chosen depends on what the verifier
needs to stay exact (common/acceptance.py):
- greedy and the target-sample rule: the `branching` most probable tokens, by decreasing draft
  probability; any subset may be kept, so the best nodes by path probability are kept.
- the rejection rule: each expanded node draws min(branching, support) children without
  replacement from its quantised q, a count fixed before drawing; pruning keeps, per node, a
  prefix of the draw order whose length depends only on information available before that
  node's children were drawn (its parent's path probability and the nodes ranked above it).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from edgespec.common.acceptance import draw_without_replacement
from edgespec.common.rng import Purpose, generator
from edgespec.common.sampling import (
    SamplingParams,
    dequantize,
    probabilities,
    quantize_draft,
    top_tokens,
)
from edgespec.common.tree import TokenTree
from edgespec.runtime.llama import ContextConfig, LlamaModel, TreeContext


_PLAIN_SOFTMAX = SamplingParams(temperature=1.0)  # greedy drafts are ranked by the draft's untempered p


@dataclass(frozen=True)
class TreeShape:
    """How big a tree to draft. budget counts drafted nodes (the root is extra)."""

    budget: int = 16
    max_depth: int = 6
    branching: int = 4      # children per expanded node (and the draft's q support under the rejection rule)
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
        return f"chain{self.budget}" if self.width == 1 and self.branching == 1 else f"tree{self.budget}"

    @classmethod
    def chain(cls, k: int) -> "TreeShape":
        """Classic chain speculation with k drafted tokens."""
        return cls(budget=k, max_depth=k, branching=1, width=1)

    @classmethod
    def from_label(cls, label: str, known: "tuple[TreeShape, ...] | list[TreeShape]" = ()) -> "TreeShape":
        """The shape a label names (label's inverse, for tools' --modes and --ladder): "target-only", "chainK" for
        any K, or the label of one of `known`; a ValueError names the label otherwise."""
        if label == "target-only":
            return cls.target_only()
        if label.startswith("chain") and label[5:].isdigit():
            return cls.chain(int(label[5:]))
        for shape in known:
            if shape.label == label:
                return shape
        names = dict.fromkeys(["target-only", "chainK", *(s.label for s in known)])   # each once, in order
        raise ValueError(f"unknown tree shape {label!r} ({', '.join(names)})")

    def __post_init__(self) -> None:
        if self.budget < 0 or min(self.max_depth, self.branching, self.width) < 1:
            raise ValueError(f"tree shape needs budget >= 0 and max_depth, branching, width >= 1: {self}")


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    score: float
    seq: int = -1                      # KV sequence holding this node, once decoded
    q_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    q_weights: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint16))


@dataclass
class _Growth:
    """A tree growing in the draft's KV cache: what Drafter.grow needs to go on where it stopped."""

    committed: list[int]
    shape: TreeShape
    sampling: SamplingParams
    step: int
    nodes: list[_Node]
    frontier: list[int]      # nodes added at the last depth (the candidates for the next one)
    depth: int = 1           # the next depth to decode (the root's children are depth 1)
    decodes: int = 1
    next_seq: int = 1        # the first free KV sequence
    seconds: float = 0.0     # drafting time so far, over every call that grew it
    catchup_tokens: int = 0  # committed tokens the KV cache lacked and the first call prefilled (Draft.catchup_tokens)

    def resumes(self, committed: list[int], shape: TreeShape, sampling: SamplingParams, step: int,
                ctx: "DraftContext") -> bool:
        """Whether a grow() call with these arguments continues this growth. The context's own
        tokens are checked too (where it has them): its KV cache must still be the one grown in."""
        return (step == self.step and sampling is self.sampling and shape == self.shape
                and committed == self.committed and getattr(ctx, "tokens", self.committed) == self.committed)


def selection_order(scores: np.ndarray | list[float], parents: np.ndarray | list[int],
                    prefix_groups: bool = False) -> list[int]:
    """Non-root nodes in the order they are kept: the n best nodes are the first n of it.

    Default: by (score desc, index). A child's score never exceeds its parent's and parents have
    smaller indices, so every prefix is a tree.
    prefix_groups (the rejection rule): sibling groups are visited by their parent's (score desc,
    index) and each contributes its children in draw order. Whether a child is kept then depends
    on its parent's score and the groups ranked before it (never its descendants: their scores are
    no higher and their indices larger), not on its own or its siblings' drawn values.
    """
    n = len(scores)
    if not prefix_groups:
        return sorted(range(1, n), key=lambda i: (-scores[i], i))
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[int(parents[i])].append(i)
    kept, order = {0}, []
    for parent in sorted(range(n), key=lambda i: (-scores[i], i)):
        if parent in kept:
            order += kids[parent]
            kept.update(kids[parent])
    return order


@dataclass
class Draft:
    tree: TokenTree
    node_seq: list[int]      # per tree node, the draft KV sequence holding it (-1: not decoded)
    scores: np.ndarray       # per tree node, the draft's path probability (root 1)
    seconds: float = 0.0
    decodes: int = 0
    shape: str = ""          # TreeShape.label of the shape it was drafted with
    prefix_groups: bool = False  # drawn for the rejection rule: prune only as selection_order allows
    # False when a stop() cut growth short: Drafter.grow with the same arguments finishes the tree
    # (the decoder does so before sending a tree drafted ahead; see Drafter.grow).
    complete: bool = True
    # Committed tokens the draft model's KV cache lacked and had to prefill before this tree: ~1 after an
    # ordinary step (the bonus token), many after turns it sat out. Their time is in `seconds`, but it is
    # not a cost of drafting this shape: the planner and the router do not learn drafting costs from it.
    catchup_tokens: int = 0
    # the planner's choice behind `shape`: (Planner.last_why, its predicted tokens/s per ladder rung), for step traces
    plan: tuple[str, tuple[float, ...]] | None = None

    def order(self) -> list[int]:
        """Non-root nodes in the order pruning keeps them (see selection_order)."""
        return selection_order(self.scores, self.tree.parents, self.prefix_groups)

    def pruned(self, n: int, order: list[int] | None = None) -> "Draft":
        """The same draft cut to its n best nodes (for a smaller step than was drafted); `order`
        is self.order() where the caller has it already."""
        keep = [0, *sorted((self.order() if order is None else order)[:n])]
        index = {old: new for new, old in enumerate(keep)}
        t = self.tree
        tree = TokenTree(tokens=t.tokens[keep], parents=np.array([index.get(int(t.parents[i]), -1) for i in keep]),
                         q_tokens=t.q_tokens[keep], q_weights=t.q_weights[keep])
        return dataclasses.replace(self, tree=tree, node_seq=[self.node_seq[i] for i in keep], scores=self.scores[keep])


class DraftContext(Protocol):
    """What the drafter needs from a model's KV context (runtime.llama.TreeContext; tests use tables)."""

    n_seq_max: int

    def sync(self, tokens: list[int]) -> np.ndarray: ...
    def decode_frontier(self, tokens: list[int], parent_seqs: list[int], depth: int, first_seq: int) -> np.ndarray: ...
    def adopt_branch(self, seq: int, new_tokens: list[int]) -> None: ...
    def drop_branches(self) -> None: ...
    def close(self) -> None: ...


class Drafter:
    """Owns the draft model's KV cache for one conversation."""

    def __init__(self, model: LlamaModel, config: ContextConfig = ContextConfig(),
                 context: DraftContext | None = None) -> None:
        self.model = model
        self.ctx = context if context is not None else TreeContext(model, config)
        self._unfinished: _Growth | None = None   # a tree a stop() cut short (grow resumes it)
        self._committed: list[int] = []

    def close(self) -> None:
        self.ctx.close()

    def predict_next(self, committed: list[int]) -> int:
        """The draft's most probable next token after `committed` (a guess of the target's)."""
        self._unfinished = None   # the sync below rewrites the KV cache the growth lives in
        return int(np.argmax(self.ctx.sync(committed)))

    def grow(self, committed: list[int], shape: TreeShape, sampling: SamplingParams, step: int,
             stop: Callable[[], bool] | None = None) -> Draft:
        """Draft a tree rooted at committed[-1]; `stop()` returning True ends growth early.

        A tree cut short by stop() comes back with complete=False, and its growth stays in the KV
        cache: the next call with the same context, shape, sampling (the same object) and step,
        with nothing done to the drafter in between, resumes it where it stopped, so the finished
        tree is the one an uninterrupted call would have drafted. The decoder relies on this for
        trees drafted ahead: cut short when the verifier answers, finished if the guess came true
        (sending them truncated cost tree16 about half its accepted tokens, docs/BENCHMARKS.md).
        """
        started = time.perf_counter()
        growth, self._unfinished = self._unfinished, None
        if growth is None or not growth.resumes(committed, shape, sampling, step, self.ctx):
            growth = self._start(committed, shape, sampling, step)
        self._committed = growth.committed   # the context of the constraint mask (_expand)
        nodes = growth.nodes
        complete = True
        while growth.depth < shape.max_depth:
            if stop is not None and stop():
                complete = False
                break
            cutoff = self._cutoff(nodes, shape.budget)
            candidates = [i for i in growth.frontier if nodes[i].score >= max(cutoff, shape.min_prob)
                          and not self.model.is_end_of_generation(nodes[i].token)]
            pick = sorted(candidates, key=lambda i: (-nodes[i].score, i))[: shape.width]
            if not pick or growth.next_seq + len(pick) > self.ctx.n_seq_max:
                break
            pick.sort()
            logits = self.ctx.decode_frontier([nodes[i].token for i in pick], [nodes[nodes[i].parent].seq for i in pick],
                                              growth.depth, growth.next_seq)
            growth.decodes += 1
            growth.frontier = []
            for row, i in enumerate(pick):
                nodes[i].seq = growth.next_seq + row
                growth.frontier += self._expand(nodes, i, logits[row], shape, sampling, step)
            growth.next_seq += len(pick)
            growth.depth += 1
        growth.seconds += time.perf_counter() - started
        if not complete:
            self._unfinished = growth
        draft = self._as_draft(nodes, sampling.needs_q).pruned(shape.budget)
        draft.seconds, draft.decodes, draft.complete = growth.seconds, growth.decodes, complete
        draft.catchup_tokens = growth.catchup_tokens
        return draft

    def _start(self, committed: list[int], shape: TreeShape, sampling: SamplingParams, step: int) -> "_Growth":
        """Sync the KV cache to `committed` and expand the root (depth 0: one decode)."""
        committed = list(committed)   # the caller's list may grow; the growth keeps what it was for
        self._committed = committed
        kept = getattr(self.ctx, "kept_prefix", None)   # (a context that does not say: no catch-up counted)
        catchup = 0 if kept is None else len(committed) - kept(committed)
        root_logits = self.ctx.sync(committed)
        nodes = [_Node(token=committed[-1], parent=-1, depth=0, score=1.0, seq=0)]
        frontier = self._expand(nodes, 0, root_logits, shape, sampling, step)
        return _Growth(committed, shape, sampling, step, nodes, frontier, catchup_tokens=catchup)

    def accept(self, draft: Draft, path: list[int]) -> None:
        """Keep the KV of the longest decoded accepted prefix; the rest is re-ingested lazily."""
        self._unfinished = None   # the tree's branches are dropped below
        decoded = list(itertools.takewhile(lambda n: draft.node_seq[n] >= 0, path))
        if not decoded:
            self.ctx.drop_branches()
            return
        self.ctx.adopt_branch(draft.node_seq[decoded[-1]], draft.tree.tokens[decoded].tolist())

    # -- internals ----------------------------------------------------------------------------
    def _expand(self, nodes: list[_Node], parent: int, logits: np.ndarray, shape: TreeShape,
                sampling: SamplingParams, step: int) -> list[int]:
        """Add the children of `parent` (see the module docstring); returns their indices."""
        if sampling.constraint:   # the verifier's mask, so q is the masked draft distribution
            path, node = [], parent
            while node > 0:
                path.append(nodes[node].token)
                node = nodes[node].parent
            logits = sampling.constraint.apply(logits, [*self._committed, *path[::-1]])
        if sampling.needs_q:
            p = probabilities(logits, sampling)
            support = top_tokens(p, shape.branching)
            support = support[p[support] > 0]
            q_tokens, q_weights = quantize_draft(support, p[support])
            q = dequantize(q_weights)
            nodes[parent].q_tokens, nodes[parent].q_weights = q_tokens, q_weights
            drawn = draw_without_replacement(q, q.size, generator(sampling.seed, step, parent, Purpose.DRAFT))
            child_tokens, child_q = q_tokens[drawn], q[drawn]
        else:  # greedy / target-sample: the most probable tokens, deterministically
            probs = probabilities(logits, _PLAIN_SOFTMAX if sampling.greedy else sampling)
            child_tokens = top_tokens(probs, shape.branching)
            child_tokens = child_tokens[probs[child_tokens] > 0]
            child_q = probs[child_tokens]
        added = []
        for token, q in zip(child_tokens.tolist(), child_q.tolist()):
            nodes.append(_Node(token=int(token), parent=parent, depth=nodes[parent].depth + 1,
                               score=nodes[parent].score * q))
            added.append(len(nodes) - 1)
        return added

    @staticmethod
    def _cutoff(nodes: list[_Node], budget: int) -> float:
        """Score of the budget-th best node so far: a frontier node below it is not expanded."""
        scores = sorted((n.score for n in nodes[1:]), reverse=True)
        return scores[budget - 1] if len(scores) >= budget else 0.0

    @staticmethod
    def _as_draft(nodes: list[_Node], with_q: bool) -> Draft:
        """Every grown node as a Draft (to be pruned to the budget)."""
        k = max((n.q_tokens.size for n in nodes), default=0) if with_q else 0
        q_tokens = np.full((len(nodes), k), -1, np.int32)
        q_weights = np.zeros((len(nodes), k), np.uint16)
        for i, node in enumerate(nodes if k else ()):
            q_tokens[i, :node.q_tokens.size] = node.q_tokens
            q_weights[i, :node.q_weights.size] = node.q_weights
        tree = TokenTree(tokens=np.array([n.token for n in nodes], np.int32),
                         parents=np.array([n.parent for n in nodes], np.int32), q_tokens=q_tokens, q_weights=q_weights)
        return Draft(tree=tree, node_seq=[n.seq for n in nodes], scores=np.array([n.score for n in nodes]),
                     prefix_groups=with_q)

