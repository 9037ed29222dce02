"""Lossless acceptance of a token tree (greedy and sampled). Pure functions of logits/probabilities.

Greedy: follow the child equal to the target's argmax; emit the path plus the argmax after it.

Sampled mode has two exact rules, chosen by `SamplingParams.rule`:
- target-sample (default): at each node the verifier draws the target's own token from p with its
  own Philox uniform; if a child carries it, descend, else it is the last emitted token. The
  emitted sequence is a plain sample from the target by construction, whatever the tree was, so
  any drafting, pruning or planner sizing is allowed and no q travels.
- rejection: multi-draft speculative sampling (SpecInfer; Chen et al.'s residual rule) with
  children drawn *without replacement* from the draft's sparse q (recursive rejection sampling,
  Jeon et al. 2024): the i-th sibling was drawn from q with the earlier siblings removed and
  renormalised (q_i), so it is accepted with min(1, r(x)/q_i(x)) and on rejection the target's
  residual becomes r <- norm(max(0, r - q_i)). Exact only if the number of children of every node
  was fixed before they were drawn, and no child was dropped afterwards because of its value:
  the drafter keeps whole draw-order prefixes whose lengths depend on pre-draw information only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from edgespec.common.constraints import TokenConstraint, node_context
from edgespec.common.errors import ContextOverflowError, InvalidRequestError, InvalidTreeError
from edgespec.common.rng import Purpose, generator
from edgespec.common.sampling import AcceptanceRule, SamplingParams, probabilities, sample_inverse_cdf, top2_margin
from edgespec.common.tree import TokenTree


@dataclass(frozen=True)
class Acceptance:
    path: list[int]   # accepted drafted nodes, root excluded, in order
    next_token: int   # the target's own token after the path (bonus or residual sample)


@dataclass(frozen=True)
class VerifyResult:
    """What a verifier returns for one tree: the same from every backend, local or remote."""


    path: list[int]              # accepted drafted nodes (root excluded)
    tokens: list[int]            # what is committed: accepted tokens + the target's next token
    margins: list[float] = field(default_factory=list)  # target top-2 logit gap per committed token
    compute_s: float = 0.0       # the target's decode + acceptance time
    queue_s: float = 0.0         # time the request waited at a (remote) verifier
    network_s: float = 0.0       # round-trip wall time minus queue and compute (0 in-process)
    bytes_up: int = 0            # serialized request size (0 in-process)
    bytes_down: int = 0


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


def follow_target(tree: TokenTree, target_token: Callable[[int], int]) -> Acceptance:
    """Walk from the root: at each node the target picks its own token (`target_token(node)`);
    descend while a child carries it, else that token ends the step. Greedy (argmax) and the
    target-sample rule (a sample from p) differ only in how the target picks."""
    kids = tree.children()
    node, path = 0, []
    while True:
        token = int(target_token(node))
        nxt = next((c for c in kids[node] if tree.tokens[c] == token), None)
        if nxt is None:
            return Acceptance(path, token)
        path.append(nxt)
        node = nxt


def accept_greedy(tree: TokenTree, target_argmax: Sequence[int]) -> Acceptance:
    """Follow the child equal to the target's argmax while there is one."""
    return follow_target(tree, target_argmax.__getitem__)


def target_sample_uniform(seed: int, step: int, node: int) -> float:
    """The one uniform the target-sample rule uses at (step, node): any backend can reproduce it."""
    return float(generator(seed, step, node, Purpose.RESIDUAL).random())


def accept_target_sample(tree: TokenTree, target_probs: Callable[[int], np.ndarray], seed: int,
                         step: int) -> Acceptance:
    """Sample the target's token at each node (inverse CDF); descend while a child carries it."""
    return follow_target(tree, lambda node: sample_inverse_cdf(target_probs(node),
                                                               target_sample_uniform(seed, step, node)))


def accept_rejection(tree: TokenTree, target_probs: Callable[[int], np.ndarray], seed: int, step: int) -> Acceptance:
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


# -- one verification step, shared by every verifier backend (llama.cpp, torch) ------------------
def check_context(committed: Sequence[int], vocab_size: int, n_ctx: int, max_depth: int) -> None:
    """Raise unless `committed` can be adopted: non-empty, valid ids, room left for a deepest tree."""
    if not committed:
        raise InvalidTreeError("the committed context is empty")
    bad = [t for t in committed if not 0 <= t < vocab_size]
    if bad:
        raise InvalidTreeError(f"context token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if len(committed) + max_depth + 1 > n_ctx:
        raise ContextOverflowError(f"context of {len(committed)} tokens does not fit n_ctx={n_ctx}")


def check_tree(tree: TokenTree, committed: Sequence[int], vocab_size: int, max_nodes: int, max_depth: int,
               sampling: SamplingParams) -> None:
    """Raise InvalidTreeError unless `tree` may be verified after `committed` (its root is the last token)."""
    tree.validate(vocab_size, max_nodes=max_nodes, max_depth=max_depth, require_q=sampling.needs_q)
    if sampling.constraint:
        sampling.constraint.validate(vocab_size)
    if not committed or tree.tokens[0] != committed[-1]:
        raise InvalidTreeError(f"tree root {int(tree.tokens[0])} is not the last committed token")


def accept_logits(tree: TokenTree, sampling: SamplingParams, step: int, argmax: Sequence[int],
                  row: Callable[[int], np.ndarray], context: Sequence[int] | None = None,
                  ) -> tuple[Acceptance, list[float]]:
    """Acceptance from the target's per-node logits, and the top-2 margin at each decided node.

    argmax: the target's argmax per node (used in greedy mode); row(i): node i's logits as a float
    array (sampled mode, and the margins). Decided nodes are the root and the accepted path: the
    nodes whose logits chose a committed token. With `sampling.constraint` every node's logits are
    masked first, given `context` (the committed tokens, required then) plus the node's path, the
    same mask the drafter applied (common/constraints.py); argmax is then taken over the masked row.
    """
    if sampling.constraint:
        row, argmax = _masked(tree, sampling.constraint, context, row)
    if sampling.greedy:
        acc = accept_greedy(tree, argmax)
    else:
        accept = accept_rejection if sampling.rule is AcceptanceRule.REJECTION else accept_target_sample
        acc = accept(tree, lambda node: probabilities(row(node), sampling), sampling.seed, step)
    return acc, [top2_margin(row(n)) for n in (0, *acc.path)]


def _masked(tree: TokenTree, constraint: TokenConstraint, context: Sequence[int] | None,
            row: Callable[[int], np.ndarray]) -> tuple[Callable[[int], np.ndarray], Sequence[int]]:
    """row and argmax of the constraint-masked logits, computed per node on first use."""
    if context is None:
        raise InvalidRequestError("a constrained request needs the committed context at acceptance")
    rows: dict[int, np.ndarray] = {}

    def masked_row(node: int) -> np.ndarray:
        if node not in rows:
            rows[node] = constraint.apply(row(node), node_context(context, tree.tokens, tree.path_to(node)))
        return rows[node]

    class _Argmax:
        def __getitem__(self, node: int) -> int:
            return int(np.argmax(masked_row(node)))

    return masked_row, _Argmax()  # type: ignore[return-value]
