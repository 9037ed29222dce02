"""The token tree: one type for drafting, the wire format and verification.

Layout (flattened, breadth-first friendly):
- node 0 is the root: the last committed token. The target has not processed it yet, so the
  verifier decodes it together with the drafted nodes and gets the logits for depth 1 from it;
- `parents[i] < i` for every other node, so parents precede children and cycles are impossible;
- siblings appear in the order the draft drew them (greedy: by decreasing q), which is the order
  the sampled acceptance rule must try them in;
- `q_tokens[i]`, `q_weights[i]`: the sparse draft distribution the children of node i were drawn
  from (uint16 weights, see `sampling.quantize_draft`); padding is token -1 / weight 0. Greedy
  trees may carry no q at all (k = 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgespec.common.errors import InvalidTreeError
from edgespec.common.sampling import dequantize

MAX_TREE_NODES = 255  # llama.cpp allows at most 256 sequences; one per leaf plus the context


def _frozen(value: object, dtype: type) -> np.ndarray:
    """A read-only contiguous array of `value`; the caller's own writeable array is copied first (a
    tree never freezes, or changes under, an array its caller still holds)."""
    arr = np.ascontiguousarray(value, dtype=dtype)
    if arr is value and arr.flags.writeable:
        arr = arr.copy()
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True)
class TokenTree:
    """Immutable (its arrays are read-only), so `validate` remembers what it has checked: the
    verifier's request thread validates a tree as it arrives and the batch thread's check of the
    same tree is then free (docs/BENCHMARKS.md, verify host time)."""

    tokens: np.ndarray
    parents: np.ndarray
    q_tokens: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), np.int32))
    q_weights: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), np.uint16))
    _checked: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _depth_cache: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", _frozen(self.tokens, np.int32))
        object.__setattr__(self, "parents", _frozen(self.parents, np.int32))
        n = len(self.tokens)
        q_tokens = np.asarray(self.q_tokens, dtype=np.int32)
        q_weights = np.asarray(self.q_weights, dtype=np.uint16)
        if q_tokens.shape[1:] == (0,) and q_tokens.shape[0] != n:  # default: no q
            q_tokens = np.zeros((n, 0), np.int32)
            q_weights = np.zeros((n, 0), np.uint16)
        object.__setattr__(self, "q_tokens", _frozen(q_tokens, np.int32))
        object.__setattr__(self, "q_weights", _frozen(q_weights, np.uint16))

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def chain(cls, root: int, drafts: list[int] | np.ndarray) -> "TokenTree":
        """A linear tree: root followed by `drafts` (classic chain speculation)."""
        n = 1 + len(drafts)
        return cls(tokens=np.array([root, *drafts], np.int32), parents=np.arange(-1, n - 1, dtype=np.int32))

    # -- structure ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> np.ndarray:
        """Depth of each node (root 0), read-only; valid only after `validate` (parents precede children)."""
        if self._depth_cache is None:
            self._set_depths(_depths(self.parents.tolist()))
        return self._depth_cache

    @property
    def max_depth(self) -> int:
        """The deepest node's depth (0 for a lone root); valid only after `validate`."""
        return int(self.depths.max())

    def _set_depths(self, depths: list[int]) -> None:
        arr = np.array(depths, np.int32)
        arr.flags.writeable = False
        object.__setattr__(self, "_depth_cache", arr)

    def children(self) -> list[list[int]]:
        """Children of every node, in draw order."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i in range(1, len(self)):
            kids[self.parents[i]].append(i)
        return kids

    def leaves(self) -> list[int]:
        has_child = np.zeros(len(self), bool)
        has_child[self.parents[1:]] = True
        return [i for i in range(len(self)) if not has_child[i]]

    def path_to(self, node: int) -> list[int]:
        """Nodes from the first drafted node down to `node` (root excluded)."""
        path = []
        while node > 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def draft_distribution(self, node: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, float64 q) the children of `node` were drawn from."""
        valid = self.q_weights[node] > 0
        return self.q_tokens[node][valid], dequantize(self.q_weights[node][valid])

    # -- validation ---------------------------------------------------------------------------
    def validate(self, vocab_size: int, max_nodes: int = MAX_TREE_NODES, max_depth: int | None = None,
                 require_q: bool = False) -> None:
        """Raise InvalidTreeError unless the tree is safe to decode and verify. The structural checks
        run once per tree and set of limits; max_depth is then a comparison with the cached depths."""
        checked = (vocab_size, max_nodes, require_q)
        if self._checked != checked:
            self._validate(vocab_size, max_nodes, require_q)
            object.__setattr__(self, "_checked", checked)
        if max_depth is not None and self.max_depth > max_depth:
            raise InvalidTreeError(f"tree depth {self.max_depth} exceeds the limit of {max_depth}")

    def _validate(self, vocab_size: int, max_nodes: int, require_q: bool) -> None:
        n = len(self)
        if n == 0:
            raise InvalidTreeError("tree is empty: it needs at least the root token")
        if n > max_nodes:
            raise InvalidTreeError(f"tree has {n} nodes, over the limit of {max_nodes}")
        if self.tokens.ndim != 1 or self.parents.shape != self.tokens.shape:
            raise InvalidTreeError(f"tokens {self.tokens.shape} and parents {self.parents.shape} must be equal 1-D arrays")
        # The verifier checks every tree of every batch: a handful of whole-array numpy calls and one
        # Python pass over the parents here, not numpy calls per node (docs/BENCHMARKS.md, host time)
        tokens = self.tokens
        if tokens.min() < 0 or tokens.max() >= vocab_size:
            bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
            raise InvalidTreeError(f"node {bad[0]} has token id {tokens[bad[0]]} outside the vocabulary [0, {vocab_size})")
        if self.parents[0] != -1:
            raise InvalidTreeError(f"node 0 must be the root (parent -1), got parent {self.parents[0]}")
        if n == 1:
            self._validate_q(vocab_size, require_q)
            self._set_depths([0])
            return
        self._set_depths(_depths(self.parents.tolist(), check=True))
        # (parent, token) pairs as one sorted key: equal neighbours are duplicate siblings; the smallest
        # such key names the first parent in node order, as a per-parent loop would
        key = np.sort(self.parents[1:].astype(np.int64) * vocab_size + tokens[1:])
        dup = key[1:][key[1:] == key[:-1]]
        if dup.size:
            raise InvalidTreeError(f"node {int(dup[0] // vocab_size)} has duplicate child tokens")
        self._validate_q(vocab_size, require_q)

    def _validate_q(self, vocab_size: int, require_q: bool) -> None:
        n = len(self)
        if self.q_tokens.shape != self.q_weights.shape or self.q_tokens.ndim != 2 or self.q_tokens.shape[0] != n:
            raise InvalidTreeError(f"q arrays must both be (nodes, k); got {self.q_tokens.shape} and {self.q_weights.shape}")
        if not require_q:
            return
        for parent, kids in enumerate(self.children()):
            if not kids:
                continue
            q_tok, _ = self.draft_distribution(parent)
            if q_tok.size == 0:
                raise InvalidTreeError(f"node {parent} has children but no draft distribution (needed for sampling)")
            if ((q_tok < 0) | (q_tok >= vocab_size)).any():
                raise InvalidTreeError(f"node {parent} has a draft distribution token outside the vocabulary")
            if len(set(q_tok.tolist())) != q_tok.size:
                raise InvalidTreeError(f"node {parent} has duplicate tokens in its draft distribution")
            missing = set(self.tokens[kids].tolist()) - set(q_tok.tolist())
            if missing:
                raise InvalidTreeError(f"children {sorted(missing)} of node {parent} are not in its draft distribution")


def _depths(parents: list[int], check: bool = False) -> list[int]:
    """Depth of each node from the parents as a list (a plain Python pass beats numpy per node, and
    pointer doubling too, up to MAX_TREE_NODES). With `check`, raise InvalidTreeError at the first
    node whose parent does not precede it."""
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        p = parents[i]
        if check and not 0 <= p < i:
            raise InvalidTreeError(f"node {i} has parent {p}: parents must precede children (orphan or cycle)")
        d[i] = d[p] + 1
    return d
