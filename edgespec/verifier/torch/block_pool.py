"""The block pool: which KV blocks are free, and how many owners each used block has.

Bookkeeping only, no tensors (kv_cache.py owns the memory), in the spirit of vLLM v1's
block_pool.py. Block 0 is the null block: never handed out, it pads block tables of sequences
shorter than the longest one in a batch (its contents are never attended to).

A block may have several owners (refcount > 1) when sessions share the full blocks of a common
prefix; it returns to the free list when its last owner lets go. Freed blocks are reused last-in
first-out (the most recently freed block is the likeliest to still be in a cache).
"""
from __future__ import annotations

from dataclasses import dataclass

from edgespec.common.errors import ContextOverflowError

NULL_BLOCK = 0


class OutOfBlocksError(ContextOverflowError):
    """The pool has fewer free blocks than asked for (answered RESOURCE_EXHAUSTED by the service)."""


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int     # usable blocks (the null block excluded)
    free: int
    used: int
    shared: int         # used blocks with more than one owner


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        """num_blocks counts the null block too, so num_blocks - 1 are usable."""
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() hands out 1, 2, 3, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, each with refcount 1."""
        if n > len(self._free):
            raise OutOfBlocksError(f"KV cache full: {n} blocks needed, {len(self._free)} of "
                                   f"{self.num_blocks - 1} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more owner for each of `blocks` (they must be in use)."""
        for b in blocks:
            if b == NULL_BLOCK or self.refcount[b] <= 0:
                raise ValueError(f"block {b} is not in use: only used blocks can be shared")
            self.refcount[b] += 1

    def release(self, blocks: list[int]) -> None:
        """One owner fewer for each of `blocks`; blocks left without owners become free."""
        for b in blocks:
            if b == NULL_BLOCK or self.refcount[b] <= 0:
                raise ValueError(f"block {b} released more often than it was allocated or shared")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)

    def stats(self) -> PoolStats:
        used = sum(1 for r in self.refcount if r > 0)
        return PoolStats(num_blocks=self.num_blocks - 1, free=len(self._free), used=used,
                         shared=sum(1 for r in self.refcount if r > 1))
