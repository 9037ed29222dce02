"""The paged KV cache: fixed-size blocks in one preallocated tensor, one block table per sequence.

    cache = PagedKVCache(n_layer, n_head_kv, head_dim, num_blocks=257, block_size=16)
    seq = cache.new_sequence()
    seq.append(rows)           # rows: [n_layer, 2, n, Hkv, D], the K/V of the next n positions
    seq.truncate(100)          # keep positions 0..99
    seq.reserve(164); seq.trim(64)       # blocks for a step's tree; those a next 64-node tree needs stay
    other = cache.new_sequence(); other.share_prefix(seq, 100)   # adopts the 6 full blocks
    cache.gather(layer, cache.block_tables([seq, other]))        # [2, B, nb*bs, Hkv, D]
    cache.compact()            # between steps: free blocks as one run, every sequence's K/V unchanged
    seq.close(); other.close()

Memory: `kv[layer]` is [2, num_blocks, block_size, Hkv, D] (K then V), a view of one allocation
made up front (`flat`: the same memory as [n_layer, 2, slots, Hkv, D]). Sequence position p lives in block `table[p // block_size]` at offset
`p % block_size`. The pool (block_pool.py) keeps the free list and the refcounts.

Sharing rule (no copy-on-write machinery): only full blocks are shared, and a sequence writes only
into its tail block, which is private whenever it is partly filled. The one case that would break
that, truncating into the middle of a shared block, copies that one block first.

Spare blocks: each verify step reserves blocks for its tree (`reserve`) and its accepted path fills
only a few of them; `trim(spare_positions)` keeps those that a next tree of that size needs at the
end of the block list, as spares, so the next `reserve` allocates nothing (at B = 8 and trees of 64
nodes, ~5 blocks per sequence and step were allocated and freed again, one Python op each). Spares
hold nothing (a step's forward writes every tree slot before reading it: no clearing), so they are
lent, not owned: an allocation that finds the pool short reclaims other sequences' spares before
it fails (never the blocks of a step in flight: those past `reserve`'s positions until `trim`), and
compaction frees them all first. The pool cannot tell a spare from a used block (both have an owner);
the cache can (`num_spare`), and reports them apart (CacheReport.spare_blocks).

Compaction (`compact`, between steps): the pool plans moves of used blocks into free ids
(block_pool.compaction_moves), the K/V are copied through a preallocated staging buffer of
`compact_reserve` blocks, and only then do the pool and every sequence's block table switch to the
new ids (a shared block is one move, seen by all its owners). The reserve makes compaction need no
memory of its own (no allocation that could fail on a full GPU), and a failure during the copies
leaves the cache as it was: the sources are only read, the destinations were free. Spares are freed
first: copying scratch would be wasted, and the next steps take fresh blocks next to the used run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch

from edgespec.verifier.torch.block_pool import NULL_BLOCK, BlockPool, PoolStats


@dataclass(frozen=True)
class CacheReport:
    """Occupancy and fragmentation: paged memory wastes at most one partly filled block per sequence.
    num_blocks = used + free + spare: sequences' spares count as neither used (they hold no context,
    and any allocation may take them) nor free (they are not on the free list: fragmentation and
    compaction's plan see them as taken)."""

    block_size: int
    num_blocks: int            # usable blocks
    free_blocks: int
    used_blocks: int           # holding some sequence's context (or a step in flight's tree)
    shared_blocks: int         # used by more than one sequence (common prefixes)
    sequences: int
    tokens: int                # positions held, summed over sequences (shared ones counted per sequence)
    partial_blocks: int        # tail blocks not yet full
    empty_slots_in_partial: int
    filled_slots: int          # distinct slots holding K/V (shared ones counted once)
    largest_free_run: int = 0  # longest run of consecutive free block ids
    spare_blocks: int = 0      # kept by sequences for their next trees (KVSequence.trim)

    @property
    def fragmentation(self) -> float:
        """F = 1 - largest free run / free blocks (0: the free blocks are one run)."""
        return 1.0 - self.largest_free_run / self.free_blocks if self.free_blocks else 0.0

    @property
    def utilization(self) -> float:
        """Filled slots / slots of used blocks (1.0 = no internal fragmentation)."""
        return self.filled_slots / (self.used_blocks * self.block_size) if self.used_blocks else 1.0

    def summary(self) -> str:
        return (f"{self.used_blocks}/{self.num_blocks} blocks used ({self.free_blocks} free, {self.spare_blocks} "
                f"spare, {self.shared_blocks} shared), {self.sequences} sequences, {self.tokens} tokens, "
                f"{self.partial_blocks} partial tail blocks with {self.empty_slots_in_partial} empty slots, "
                f"utilization {self.utilization:.3f}, fragmentation {self.fragmentation:.3f}")


@dataclass(frozen=True)
class Compaction:
    """One compaction: how much it moved and what it bought."""

    moved: int                 # blocks copied (a shared block counts once)
    seconds: float
    fragmentation_before: float
    fragmentation_after: float


class PagedKVCache:
    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, *, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 compact_reserve: int = 16) -> None:
        """compact_reserve: blocks of staging memory set aside for compaction (its copy chunk size)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if compact_reserve < 1:
            raise ValueError(f"compact_reserve must be >= 1, got {compact_reserve}")
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, n_head_kv, head_dim
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.kv = torch.zeros(n_layer, 2, num_blocks, block_size, n_head_kv, head_dim, dtype=dtype, device=device)
        self.flat = self.kv.view(n_layer, 2, num_blocks * block_size, n_head_kv, head_dim)
        self._staging = torch.empty(n_layer, 2, compact_reserve, block_size, n_head_kv, head_dim, dtype=dtype,
                                    device=device)
        self._sequences: dict[KVSequence, None] = {}   # open sequences, oldest first (the order spares are reclaimed)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def bytes_per_block(self) -> int:
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    @property
    def reserve_bytes(self) -> int:
        """Memory held for compaction's copies (allocated up front with the cache)."""
        return self._staging.numel() * self._staging.element_size()

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def new_sequence(self) -> "KVSequence":
        seq = KVSequence(self)
        self._sequences[seq] = None
        return seq

    # -- blocks ---------------------------------------------------------------------------------
    @property
    def num_spare(self) -> int:
        """Spare blocks held by all sequences (a pass over them, not over the blocks)."""
        return sum(s.num_spare for s in self._sequences)

    def stats(self) -> PoolStats:
        """The pool's figures with the sequences' spares taken out of `used` (they are what any
        allocation may reclaim, not context: what the service reports as KV use)."""
        pool, spare = self.pool.stats(), self.num_spare
        return PoolStats(num_blocks=pool.num_blocks, free=pool.free, used=pool.used - spare, shared=pool.shared,
                         spare=spare)

    def _allocate(self, n: int, seq: "KVSequence") -> list[int]:
        """n fresh blocks for seq. When the pool has fewer free, other sequences' spares are reclaimed
        first, oldest sequence first; if even they are too few, OutOfBlocksError and nothing changed."""
        short = n - self.pool.num_free
        if short > 0:
            lenders = [(s, s.num_spare) for s in self._sequences if s is not seq]
            if sum(k for _, k in lenders) >= short:
                for s, k in lenders:
                    if short <= 0:
                        break
                    s._release_spares(min(k, short))
                    short -= k
        return self.pool.allocate(n)

    # -- reading ------------------------------------------------------------------------------
    def block_tables(self, seqs: Seq["KVSequence"], n_blocks: int | None = None) -> torch.Tensor:
        """[B, n_blocks] int64 block ids, padded with the null block (default: the longest table)."""
        width = max((s.num_blocks for s in seqs), default=0) if n_blocks is None else n_blocks
        rows = np.full((len(seqs), width), NULL_BLOCK, dtype=np.int64)
        for row, s in zip(rows, seqs):
            row[:s.num_blocks] = s.table
        return torch.from_numpy(rows).to(self.device)

    def gather(self, layer: int, tables: torch.Tensor) -> torch.Tensor:
        """The K/V of the blocks in `tables` [B, nb], in position order: [2, B, nb*block_size, Hkv, D]."""
        return self.kv[layer][:, tables].flatten(2, 3)

    # -- writing (through KVSequence) -----------------------------------------------------------
    def _write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.flat[:, :, slots] = rows.to(self.kv.dtype)

    def _copy_block(self, src: int, dst: int) -> None:
        self.kv[:, :, dst] = self.kv[:, :, src]

    # -- compaction ---------------------------------------------------------------------------
    def compact(self) -> Compaction:
        """Make the free blocks one run (F = 0), keeping every sequence's K/V contents. Call between
        steps only: block ids change, so no step may hold a block table across it."""
        started = time.perf_counter()
        before = self.pool.fragmentation()
        for seq in self._sequences:
            seq._release_spares()
        moves = self.pool.compaction_moves()
        if moves:
            R = self._staging.shape[2]
            src = torch.tensor([m[0] for m in moves], dtype=torch.int64)
            dst = torch.tensor([m[1] for m in moves], dtype=torch.int64)
            pad = -len(moves) % R          # a short last chunk repeats its last move (same bytes, same place)
            src = torch.cat((src, src[-1:].expand(pad))).to(self.device)
            dst = torch.cat((dst, dst[-1:].expand(pad))).to(self.device)
            for i in range(0, src.numel(), R):
                torch.index_select(self.kv, 2, src[i:i + R], out=self._staging)
                self.kv.index_copy_(2, dst[i:i + R], self._staging)
        self.pool.move(moves)      # checks every move before changing anything; with none, it only
        if moves:                  # restarts the free list from the lowest free id
            remap = np.arange(self.pool.num_blocks)
            remap[[m[0] for m in moves]] = [m[1] for m in moves]
            for seq in self._sequences:
                seq.table[:] = remap[seq.table]
        return Compaction(moved=len(moves), seconds=time.perf_counter() - started, fragmentation_before=before,
                          fragmentation_after=self.pool.fragmentation())

    # -- accounting ---------------------------------------------------------------------------
    def report(self) -> CacheReport:
        pool = self.stats()
        filled: dict[int, int] = {}
        partial = empty = 0
        for s in self._sequences:
            for i, b in enumerate(s.blocks):
                n = min(self.block_size, s.length - i * self.block_size)
                filled[b] = max(filled.get(b, 0), n)
            if s.length % self.block_size:
                partial += 1
                empty += self.block_size - s.length % self.block_size
        return CacheReport(block_size=self.block_size, num_blocks=pool.num_blocks, free_blocks=pool.free,
                           used_blocks=pool.used, shared_blocks=pool.shared, sequences=len(self._sequences),
                           tokens=sum(s.length for s in self._sequences), partial_blocks=partial,
                           empty_slots_in_partial=empty, filled_slots=sum(filled.values()),
                           largest_free_run=self.pool.largest_free_run(), spare_blocks=pool.spare)


class KVSequence:
    """One session's cached positions 0..length-1 and the blocks holding them; past those, the table
    may hold the blocks reserved for a step in flight, then spares.

    The block table is an int64 array (`table`), so that a step copies it into its packed inputs in
    one memcpy: from a list, numpy converted each id (~20 ns: 11 us of a B = 8 step at 1024 tokens
    here, growing with the context). `blocks` is a copy as a list, for reading."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self._table = np.zeros(16, dtype=np.int64)   # the ids in [:num_blocks]; grown by doubling
        self.num_blocks = 0
        self.length = 0
        self.closed = False
        self._reserved = 0   # positions reserved for a step in flight (reserve .. trim): never reclaimed

    def __len__(self) -> int:
        return self.length

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this KV sequence was closed")

    @property
    def table(self) -> np.ndarray:
        """The block ids, in position order (a view: valid until this sequence's blocks change)."""
        return self._table[:self.num_blocks]

    @property
    def blocks(self) -> list[int]:
        return self._table[:self.num_blocks].tolist()

    def _extend(self, blocks: list[int]) -> None:
        n = self.num_blocks + len(blocks)
        if n > self._table.size:
            grown = np.zeros(max(n, 2 * self._table.size), dtype=np.int64)
            grown[:self.num_blocks] = self.table
            self._table = grown
        self._table[self.num_blocks:n] = blocks
        self.num_blocks = n

    def _release_from(self, keep: int) -> None:
        """Give the blocks from index `keep` on back to the pool."""
        if self.num_blocks > keep:
            self.cache.pool.release(self._table[keep:self.num_blocks].tolist())
            self.num_blocks = keep

    @property
    def num_spare(self) -> int:
        """Blocks past both the context and a step in flight: kept for the next tree, reclaimable."""
        return self.num_blocks - self.cache.blocks_for(max(self.length, self._reserved))

    def _release_spares(self, n: int | None = None) -> None:
        """Give back the last n spare blocks (all of them by default)."""
        k = self.num_spare if n is None else min(n, self.num_spare)
        if k > 0:
            self._release_from(self.num_blocks - k)

    def append(self, rows: torch.Tensor) -> None:
        """Write the K/V of positions length..length+n-1; rows: [n_layer, 2, n, Hkv, D] (the engine
        writes through its forward instead; this is for tests and tools)."""
        self._check_open()
        c = self.cache
        if rows.dim() != 5 or rows.shape[:2] != c.kv.shape[:2] or rows.shape[3:] != c.kv.shape[4:]:
            raise ValueError(f"K/V rows of shape {tuple(rows.shape)} do not fit this cache "
                             f"([{c.n_layer}, 2, n, {c.n_head_kv}, {c.head_dim}] expected)")
        n = rows.shape[2]
        bs = self.cache.block_size
        need = self.cache.blocks_for(self.length + n) - self.num_blocks
        if need > 0:
            self._extend(self.cache._allocate(need, self))
        positions = torch.arange(self.length, self.length + n)
        table = torch.from_numpy(self.table)
        slots = table[positions // bs] * bs + positions % bs
        self.cache._write(slots.to(self.cache.device), rows)
        self.length += n

    def truncate(self, n: int) -> None:
        """Keep positions 0..n-1; blocks past them go back to the pool.

        If the new tail block is partly filled and shared, it will be written to next, so it is
        replaced by a private copy. That copy's block is allocated FIRST: if the pool is exhausted
        the call raises OutOfBlocksError and the sequence's context is unchanged (never a shared half block
        that the next write would corrupt for its other owners). The backend sizes the pool with one
        spare block per session for this."""
        self._check_open()
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a sequence of {self.length} positions to {n}")
        keep = self.cache.blocks_for(n)
        pool = self.cache.pool
        private = None
        if n % self.cache.block_size and pool.refcount[self._table[keep - 1]] > 1:
            self._release_spares()   # they go anyway, and the copy may need one
            (private,) = self.cache._allocate(1, self)  # may raise: nothing else has changed yet
        self._release_from(keep)
        self.length, self._reserved = n, 0
        if private is not None:
            shared = int(self._table[keep - 1])
            self.cache._copy_block(shared, private)
            pool.release([shared])
            self._table[keep - 1] = private

    def reserve(self, n_positions: int) -> int:
        """Make sure blocks cover positions 0..n_positions-1 (a step writes its tree there before
        acceptance), spares first; the length is unchanged, and until `trim` no other sequence's
        allocation reclaims these blocks. Returns how many blocks cover them (the step's table)."""
        self._check_open()
        cover = self.cache.blocks_for(n_positions)
        if cover > self.num_blocks:
            self._extend(self.cache._allocate(cover - self.num_blocks, self))
        self._reserved = max(self._reserved, n_positions)
        return cover

    def trim(self, spare_positions: int = 0) -> None:
        """The step is over: release the blocks past the current length, except those that
        `spare_positions` more positions need, kept as spares (none by default)."""
        self._reserved = 0
        self._release_from(self.cache.blocks_for(self.length + spare_positions))

    def share_prefix(self, other: "KVSequence", n_tokens: int) -> int:
        """Adopt the full blocks of other's first n_tokens positions (this sequence must be empty).

        Returns the number of positions adopted (a multiple of block_size, maybe 0)."""
        self._check_open()
        other._check_open()
        if self.length or self.num_blocks:
            raise ValueError("share_prefix needs an empty sequence (truncate(0) first)")
        if other.cache is not self.cache:
            raise ValueError("sequences of different caches cannot share blocks")
        full = min(n_tokens, other.length) // self.cache.block_size
        shared = other.table[:full].tolist()
        self.cache.pool.share(shared)
        self._extend(shared)
        self.length = full * self.cache.block_size
        return self.length

    def close(self) -> None:
        """Give every block back, spares included (shared ones stay with their other owners)."""
        if self.closed:
            return
        self._release_from(0)
        self.length, self.closed = 0, True
        self.cache._sequences.pop(self, None)
