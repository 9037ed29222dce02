"""Counter-based random numbers: every draw is a pure function of (seed, step, node, purpose).

No RNG state travels over the wire; replicas, retries and a resynced session draw the same
numbers, and any two parties that know the seed agree (numpy's Philox, a standard CBRNG).
"""
from __future__ import annotations

from enum import IntEnum

import numpy as np

_MASK64 = (1 << 64) - 1


class Purpose(IntEnum):
    """Separate streams for independent decisions at the same (step, node)."""

    DRAFT = 1       # the draft's draws of children (edge)
    ACCEPT = 2      # the verifier's accept/reject uniforms over siblings
    RESIDUAL = 3    # the verifier's final sample (residual or bonus token)


def generator(seed: int, step: int, node: int, purpose: Purpose) -> np.random.Generator:
    """A fresh generator whose stream is fixed by its four coordinates."""
    key = np.array([seed & _MASK64, int(purpose)], dtype=np.uint64)
    counter = np.array([0, 0, node & _MASK64, step & _MASK64], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key, counter=counter))
