"""Token-sequence helpers shared by the KV caches of the edge and the verifier."""
from __future__ import annotations

from typing import Sequence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share: the part of a cached context that can be kept."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
