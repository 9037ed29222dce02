"""The block pool: which KV blocks are free, and how many owners each used block has.

Bookkeeping only, no tensors (kv_cache.py owns the memory), in the spirit of vLLM v1's
block_pool.py. Block 0 is the null block: never handed out, it pads block tables of sequences
shorter than the longest one in a batch (its contents are never attended to).

A block may have several owners (refcount > 1) when sessions share the full blocks of a common
prefix; it returns to the free list when its last owner lets go. Freed blocks are reused last-in
first-out (the most recently freed block is the likeliest to still be in a cache).

Fragmentation: F = 1 - largest run of consecutive free ids / free blocks. Paged allocation never
fails because of it (any free block will do), but scattered blocks cost locality. `compaction_moves`
plans the moves that make the free space one run at the top of the id range, and `move` applies
them to the refcounts; the copies themselves are the cache's job (kv_cache.PagedKVCache.compact).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.common.errors import ContextOverflowError

NULL_BLOCK = 0


class OutOfBlocksError(ContextOverflowError):
    """The pool has fewer free blocks than asked for (answered RESOURCE_EXHAUSTED by the service)."""


@dataclass(frozen=True)
class PoolStats:
    """num_blocks = free + used + spare. The pool itself cannot tell a sequence's spare blocks
    (kv_cache.KVSequence.trim) from used ones, so BlockPool.stats counts them as used (spare 0);
    PagedKVCache.stats takes them out."""

    num_blocks: int     # usable blocks (the null block excluded)
    free: int
    used: int
    shared: int         # used blocks with more than one owner
    spare: int = 0      # kept by sequences for their next trees: reclaimable, holding nothing


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        """num_blocks counts the null block too, so num_blocks - 1 are usable."""
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() hands out 1, 2, 3, ...
        # the free list as a bitmap (runs), one byte per block: a bytearray, since its one-block updates on
        # every step cost a third of numpy's; the vectorised scans read it through _free_map()
        self._is_free = bytearray(b"\x01") * num_blocks
        self._is_free[NULL_BLOCK] = 0

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
            self._is_free[b] = 0
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
                self._is_free[b] = 1

    def stats(self) -> PoolStats:
        used = sum(1 for r in self.refcount if r > 0)
        return PoolStats(num_blocks=self.num_blocks - 1, free=len(self._free), used=used,
                         shared=sum(1 for r in self.refcount if r > 1))

    # -- fragmentation and compaction ----------------------------------------------------------
    def _free_map(self) -> np.ndarray:
        """The bitmap as a numpy bool array (a view: no copy)."""
        return np.frombuffer(self._is_free, dtype=np.bool_)

    def largest_free_run(self) -> int:
        """The longest run of consecutive free block ids (vectorised: cheap enough to check every step)."""
        edges = np.diff(np.concatenate(([0], self._free_map().view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        return int((ends - starts).max()) if starts.size else 0

    def fragmentation(self) -> float:
        """F = 1 - largest free run / free blocks (0 when the free blocks are one run, or none)."""
        free = len(self._free)
        return 1.0 - self.largest_free_run() / free if free else 0.0

    def compaction_moves(self) -> list[tuple[int, int]]:
        """(src, dst) pairs that leave the U used blocks on ids 1..U and the free ones in one run above:
        each used block above U moves into a free id at or below U. Only free blocks are written, so
        compaction needs no spare block of its own; it moves at most as many blocks as are free."""
        used = len(self.refcount) - 1 - len(self._free)
        is_free = self._free_map()
        holes = np.flatnonzero(is_free[1:used + 1]) + 1
        movers = np.flatnonzero(~is_free[used + 1:]) + used + 1
        assert holes.size == movers.size, "free list and bitmap disagree"
        return list(zip(movers.tolist(), holes.tolist()))

    def move(self, moves: list[tuple[int, int]]) -> None:
        """Hand each src block's owners to its dst (a free block) and free src; the free list is then
        rebuilt so that pop() hands out the lowest free id first (new blocks stay next to the used run)."""
        for src, dst in moves:
            if src == NULL_BLOCK or self.refcount[src] <= 0 or self.refcount[dst] != 0 or dst == NULL_BLOCK:
                raise ValueError(f"cannot move block {src} (refcount {self.refcount[src]}) to block {dst} "
                                 f"(refcount {self.refcount[dst]}): only used blocks move, only into free ones")
        if len({b for m in moves for b in m}) != 2 * len(moves):
            raise ValueError("a block appears in more than one move")
        for src, dst in moves:
            self.refcount[dst], self.refcount[src] = self.refcount[src], 0
            self._is_free[dst], self._is_free[src] = 0, 1
        self._free = np.flatnonzero(self._free_map())[::-1].tolist()
