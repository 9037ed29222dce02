"""top_tokens and the nucleus cut rank exactly as the full stable sort they replace (drafts stay
identical: the children, their order and their probabilities)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgespec.common.sampling import SamplingParams, probabilities, top_tokens


def _full_sort(p: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-p, kind="stable")[:k]


def _reference_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """probabilities() as it was, with a full stable sort for the nucleus (temperature and top-k,
    which did not change, from probabilities() itself)."""
    p = probabilities(logits, dataclasses.replace(params, top_p=1.0))
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, params.top_p)) + 1]
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    ties = rng.integers(0, 5, 2000).astype(np.float64)            # many ties at every rank
    zeros = np.zeros(3000)
    zeros[[5, 900, 17]] = [0.2, 0.5, 0.2]
    nan = rng.random(500)
    nan[[3, 99]] = np.nan
    inf = rng.random(500)
    inf[[10, 20]] = [np.inf, -np.inf]
    signed = np.array([0.0, -0.0, 0.0, -0.0, 1.0, -1.0])
    return [rng.random(151936), rng.standard_normal(5000).astype(np.float32), ties, zeros, nan, inf, signed]


@pytest.mark.parametrize("k", [0, 1, 2, 4, 8, 64, 5999, 10**6])
def test_top_tokens_is_the_full_stable_sort_prefix(k):
    for p in _arrays():
        np.testing.assert_array_equal(top_tokens(p, k), _full_sort(p, k))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.5),
                                    SamplingParams(temperature=3.0, top_p=0.99), SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
                                    SamplingParams(temperature=50.0, top_p=0.999999)])
def test_nucleus_matches_the_full_sort(params):
    rng = np.random.default_rng(3)
    for scale in (0.5, 3.0, 10.0):
        logits = (rng.standard_normal(151936) * scale).astype(np.float32)
        logits[rng.integers(0, logits.size, 50)] = logits.max()   # ties at the top
        np.testing.assert_array_equal(probabilities(logits, params), _reference_probabilities(logits, params))
