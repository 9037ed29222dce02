"""Counter-based random numbers: every draw is a pure function of (seed, step, node, purpose).

No RNG state travels over the wire; replicas, retries and a resynced session draw the same
numbers, and any two parties that know the seed agree (numpy's Philox, a standard CBRNG).
"""
from __future__ import annotations

from enum import IntEnum
from typing import Sequence

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


# -- the RESIDUAL stream of many nodes at once ----------------------------------------------------
# generator() is numpy's Philox4x64-10 keyed (seed, purpose) at counter (0, 0, node, step); its first
# draw increments the counter's low word, runs the 10 rounds and maps the first output word to
# [0, 1) as (x >> 11) * 2**-53. Building one numpy Generator per node costs ~25 us on the host (a
# verifier batch of 16 trees of 64 nodes: ~25 ms); residual_uniforms runs the rounds on all nodes'
# counters as uint64 arrays (the 64 x 64 -> 128-bit products from 32-bit halves). It lives here, next
# to generator(), because it must follow generator()'s key and counter layout bit for bit
# (tests/test_rng.py checks it against generator()).
_M0, _M1 = np.uint64(0xD2E7470EE14C6C93), np.uint64(0xCA5A826395121157)   # Random123's Philox4x64 constants
_W0, _W1 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBB67AE8584CAA73B)
_LO32, _32 = np.uint64(0xFFFFFFFF), np.uint64(32)
_HALVES = {int(m): (m & _LO32, m >> _32) for m in (_M0, _M1)}


def _mulhilo(m: np.uint64, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) 64-bit words of the 128-bit products m * x."""
    m_lo, m_hi = _HALVES[int(m)]
    x_lo, x_hi = x & _LO32, x >> _32
    ll, lh, hl, hh = x_lo * m_lo, x_lo * m_hi, x_hi * m_lo, x_hi * m_hi   # each < 2**64: no wrap
    mid = (ll >> _32) + (lh & _LO32) + (hl & _LO32)
    return m * x, hh + (lh >> _32) + (hl >> _32) + (mid >> _32)


def residual_uniforms(trees: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """The uniforms of nodes 0..n-1 of each (seed, step, n), concatenated (float64)."""
    n = np.array([t[2] for t in trees], np.int64)
    starts = np.repeat(np.cumsum(n) - n, n)
    node = (np.arange(int(n.sum())) - starts).astype(np.uint64)
    with np.errstate(over="ignore"):                     # uint64 arithmetic wraps by design
        k0 = np.repeat(np.array([t[0] & _MASK64 for t in trees], np.uint64), n)
        k1 = np.full(node.shape, int(Purpose.RESIDUAL), np.uint64)
        c0 = np.ones(node.shape, np.uint64)              # the first draw's counter increment (0 -> 1)
        c1 = np.zeros(node.shape, np.uint64)
        c2 = node
        c3 = np.repeat(np.array([t[1] & _MASK64 for t in trees], np.uint64), n)
        for r in range(10):
            if r:
                k0, k1 = k0 + _W0, k1 + _W1
            lo0, hi0 = _mulhilo(_M0, c0)
            lo1, hi1 = _mulhilo(_M1, c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return (c0 >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
