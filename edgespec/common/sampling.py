"""Sampling parameters and the distributions both sides derive from logits.

The target's p and the draft's q must be computed the same way everywhere, so this is the one
place that turns logits into probabilities (temperature, top-k, top-p) and quantises q for the wire.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from edgespec.common.constraints import TokenConstraint
from edgespec.common.errors import InvalidRequestError

Q_SCALE = 65535  # draft probabilities travel as uint16 fractions of this scale


class AcceptanceRule(str, enum.Enum):
    """How a sampled tree is verified (common/acceptance.py); both yield exactly the target's p.

    TARGET_SAMPLE: the verifier samples the target's token at each node and descends if a child
    carries it. Valid for ANY tree (deterministic top-k children, pruned, planner-sized), needs no
    q on the wire. REJECTION: recursive rejection sampling over children drawn without
    replacement from the draft's q; higher acceptance per child, but only valid when each node's
    number of children was fixed before its children were drawn and nothing was pruned by value
    afterwards (edge/drafting.py keeps whole draw-order prefixes for this), and q travels.
    """

    TARGET_SAMPLE = "target-sample"
    REJECTION = "rejection"


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation.

    top_k/top_p truncate the *target's* (and the draft's) distribution; they are unrelated to the
    tree's branching factor (edge/drafting.TreeShape.branching).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    rule: AcceptanceRule = AcceptanceRule.TARGET_SAMPLE
    # Banned token sequences, masked identically in the draft and in acceptance (common/constraints.py).
    constraint: TokenConstraint | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        try:
            object.__setattr__(self, "rule", AcceptanceRule(self.rule))
        except ValueError:
            choices = ", ".join(r.value for r in AcceptanceRule)
            raise InvalidRequestError(f"acceptance rule must be one of {choices}, got {self.rule!r}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_q(self) -> bool:
        """Whether trees must carry the draft's q (only the sampled rejection rule reads it)."""
        return not self.greedy and self.rule is AcceptanceRule.REJECTION


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Full-vocabulary float64 distribution after temperature, top-k and top-p (nucleus)."""
    z = np.asarray(logits, dtype=np.float64) / max(params.temperature, 1e-8)
    if 0 < params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        # The nucleus is a prefix of the tokens by decreasing p: widen a top-k until it holds the
        # cut (cumsum is sequential, so a prefix's sums are the full order's), not a full sort.
        k = 64
        while True:
            order = top_tokens(p, k)
            cum = np.cumsum(p[order])
            cut = int(np.searchsorted(cum, params.top_p))
            if cut < order.size or order.size == p.size:
                break
            k *= 8
        keep = order[: cut + 1]
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def top_tokens(p: np.ndarray, k: int) -> np.ndarray:
    """The first k of np.argsort(-p, kind="stable"): largest first, ties by lower id.

    Without sorting the vocabulary: a stable sort of 152k floats costs about 20 ms, more than
    half a draft model's forward on a CPU, and drafting ranks every expanded row
    (docs/BENCHMARKS.md, drafting overhead). A partition finds the k-th largest value; every id
    at or above it (ties included, in id order) is then sorted stably, which ranks them as the
    full sort does.
    """
    p = np.asarray(p)
    n = p.size
    if 0 < k < n:
        top = np.partition(p, n - k)[n - k:]   # the k largest, NaN counted as largest
        if not np.isnan(top).any():   # NaN ranks last in the sort of -p: leave it to the full sort
            candidates = np.flatnonzero(p >= top.min())
            return candidates[np.argsort(-p[candidates], kind="stable")[:k]]
    return np.argsort(-p, kind="stable")[:max(k, 0)]


def sample_inverse_cdf(p: np.ndarray, u: float) -> int:
    """The token at which the cumulative p (token-id order) first exceeds u in [0, 1).

    One uniform per decision, so a GPU backend can reproduce the draw from the same u.
    """
    cdf = np.cumsum(p)
    token = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(token, int(np.flatnonzero(p)[-1]))


def top2_margin(logits: np.ndarray) -> float:
    """Logit gap between the best and second-best token: small means a near-tie."""
    a, b = np.partition(np.asarray(logits, dtype=np.float64), -2)[-2:]
    return float(b - a)


def quantize_draft(tokens: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise a truncated draft distribution to uint16 weights; every kept token keeps weight >= 1.

    The draft then samples from `dequantize(weights)`, so the verifier knows q bit-exactly.
    """
    probs = np.asarray(probs, dtype=np.float64)
    weights = np.maximum(np.rint(probs / probs.sum() * Q_SCALE), 1).astype(np.uint16)
    return np.asarray(tokens, dtype=np.int32), weights


def dequantize(weights: np.ndarray) -> np.ndarray:
    """The exact float64 q both sides use."""
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()
