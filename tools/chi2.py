"""χ² goodness of fit of sampled counts against exact probabilities: the one implementation for the
tests (tests/test_sampling_pipeline.py and those importing its chi2_pvalue) and for
tools/check_gpu_sampling.py, which runs on a GPU host that has torch but not scipy."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def chi2_gof(observed: Sequence[float] | np.ndarray, expected: Sequence[float] | np.ndarray) -> tuple[float, int]:
    """(p-value, degrees of freedom) of the χ² test of `observed` counts against `expected` counts.
    Cells expected 0 are left out (the caller checks that none was observed); cells expected under 5
    are pooled into one, as χ² needs expected counts of 5 or more."""
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    possible = expected > 0
    observed, expected = observed[possible], expected[possible]
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    return chi2_sf(stat, df), df


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ χ²(df), the regularized upper incomplete gamma Q(df/2, stat/2): scipy's
    where it is installed, else torch's."""
    try:
        from scipy.special import gammaincc
    except ImportError:
        import torch

        return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                             torch.tensor(stat / 2, dtype=torch.float64)))
    return float(gammaincc(df / 2, stat / 2))
