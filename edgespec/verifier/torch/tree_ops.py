"""A verify step's tree bookkeeping on the device, around the forward (engine.py):

- `prepare`: from each tree's parents, its ancestor-or-self masks as packed bits (what the attention
  kernel and the acceptance read), node depths (RoPE positions are context length + depth) and the
  flat cache slots the step's K/V go to (context length + node index, through the block table);
- `accept`: from each node's choice (greedy argmax or the sampled token), the accepted path (a node
  is accepted iff every node on its root path matches its parent's choice), the next token, the
  top-2 margins along the path, and the cache slots compaction moves (accepted node at depth d to
  slot context + d).

Each has a torch version (`*_torch`: the CPU path, the float32 reference, and what the tests compare
the kernels with) and a Triton kernel with the same signature that does the whole thing for one
sequence in one program. As torch ops these are ~100 tiny launches per step, about 0.15 ms of a
2 ms step on the H200 (docs/BENCHMARKS.md); as kernels, two.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use the torch versions
    triton = None

MAX_KERNEL_NODES = 128   # trees up to this bucket take the kernels (a [T, T] tile in registers); larger: torch


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool ancestor-or-self masks from parents [B, T] (root and padding nodes are their own
    parents), by pointer doubling: log2(T) boolean matrix squarings, on the device."""
    B, T = parents.shape
    anc = torch.zeros(B, T, T, dtype=torch.float32, device=parents.device)
    anc.scatter_(2, parents[:, :, None], 1.0)
    anc += torch.eye(T, device=parents.device)
    anc = anc.clamp_(max=1.0)
    for _ in range(doubling_steps(T)):
        anc = torch.bmm(anc, anc).clamp_(max=1.0)
    return anc > 0


def doubling_steps(T: int) -> int:
    """Squarings that cover a root path of up to T nodes."""
    return max(1, (T - 1).bit_length())


def pack_ancestor_bits(anc: torch.Tensor) -> torch.Tensor:
    """[B, T, N] bool -> [B, T, ceil(N/32)] int32 (bit j % 32 of word j // 32)."""
    B, T, N = anc.shape
    W = -(-N // 32)
    padded = torch.nn.functional.pad(anc, (0, W * 32 - N)).reshape(B, T, W, 32).to(torch.int64)
    words = (padded << torch.arange(32, device=anc.device, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_ancestor_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """pack_ancestor_bits's inverse: [B, T, W] int32 -> [B, T, n] bool."""
    j = torch.arange(n, device=bits.device)
    return ((bits[:, :, j // 32] >> (j % 32)) & 1).bool()


def slot_of(tables: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots [B * P] of positions pos [B, P] through block tables [B, NB]; positions past
    the table land in the null block (their contents are never attended to)."""
    NB = tables.shape[1]
    blk = pos // block_size
    b = tables.gather(1, blk.clamp(max=NB - 1))
    return (torch.where(blk < NB, b, 0) * block_size + pos % block_size).flatten()


def compaction_slots(tables: torch.Tensor, ctx: torch.Tensor, path: torch.Tensor, k: torch.Tensor,
                     enabled: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) flat slots [B * T] that move the K/V of path[d] (slot ctx + path[d]) to
    slot ctx + d for d <= k, in rows where `enabled`; every other slot maps onto itself."""
    T = path.shape[1]
    d = torch.arange(T, device=path.device)[None, :]
    use = (d <= k) & enabled[:, None]
    return (slot_of(tables, ctx[:, None] + torch.where(use, path, d), block_size),
            slot_of(tables, ctx[:, None] + d.expand_as(path), block_size))


# -- torch versions ---------------------------------------------------------------------------------
def prepare_torch(parents: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents [B, T] (padding nodes are their own parents, node 0's parent is 0), context lengths [B],
    block tables [B, NB] -> (ancestor bits [B, T, ceil(T/32)] int32, depths [B, T] int64, the step's
    cache slots [B * T] int64)."""
    T = parents.shape[1]
    anc = ancestors(parents)
    node = torch.arange(T, device=parents.device)
    return pack_ancestor_bits(anc), anc.sum(-1) - 1, slot_of(tables, ctx[:, None] + node[None, :], block_size)


def accept_torch(tokens: torch.Tensor, parents: torch.Tensor, choice: torch.Tensor, margin: torch.Tensor,
                 bits: torch.Tensor, depth: torch.Tensor, sizes: torch.Tensor, force: torch.Tensor,
                 compact: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decide every tree of the step. tokens, parents, choice (the target's token after each node),
    depth [B, T]; margin [B, T] float32; bits from prepare; sizes (real nodes; 0: a padding row),
    force (a prefill chunk: every node accepted), compact (move the accepted path into place), ctx [B].

    Returns (out [B, 2 + 2T] float32 = next token, path length k, path[0..T) (node at depth d, 0 past
    k), margins along path; source and destination slots [B * T] for the compaction copy)."""
    B, T = tokens.shape
    node = torch.arange(T, device=tokens.device)
    valid = node[None, :] < sizes[:, None]
    anc = unpack_ancestor_bits(bits, T)
    match = (tokens == choice.gather(1, parents)) & valid
    match = match | (node == 0)[None, :] | force.bool()[:, None]            # prefill rows: all accepted
    accepted = ~(anc & ~match[:, None, :]).any(-1) & valid                 # every ancestor matches
    last = torch.where(accepted, depth, -1).argmax(1, keepdim=True)         # the deepest accepted node
    k = depth.gather(1, last)
    next_token = choice.gather(1, last)
    where = torch.where(accepted, depth, T)
    path = torch.zeros(B, T + 1, dtype=torch.int64, device=tokens.device)
    path.scatter_(1, where, node.expand(B, T).contiguous())
    path = path[:, :T]                                                     # path[b, d]: node at depth d
    src, dst = compaction_slots(tables, ctx, path, k, compact.bool(), block_size)
    out = torch.cat((next_token, k, path, margin.gather(1, path)), dim=1).float()
    return out, src, dst


def move_rows_torch(flat: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V rows of every layer of flat [L, 2, S, Hkv, D] from slots src to slots dst (a step's
    compaction: accept's src, dst); reads all sources before writing. A slot mapped onto itself is a no-op."""
    flat.index_copy_(2, dst, flat.index_select(2, src))


# -- Triton kernels ---------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _bit_or(a, b):
        return a | b

    @triton.jit
    def _slots(Tables, b, pos, NB, BS: tl.constexpr):
        blk = pos // BS
        table = tl.load(Tables + b * NB + tl.minimum(blk, NB - 1))
        return tl.where(blk < NB, table, 0) * BS + pos % BS

    @triton.jit
    def _prepare_kernel(Parents, Ctx, Tables, Bits, Depth, Slots, NB,
                        T: tl.constexpr, TP: tl.constexpr, W: tl.constexpr, STEPS: tl.constexpr, BS: tl.constexpr):
        """One program per sequence: the [TP, TP] ancestor matrix in registers (0/1 in fp16, squared
        with tl.dot: sums of at most TP ones are exact), packed 32 columns to a word."""
        b = tl.program_id(0)
        i = tl.arange(0, TP)
        real = i < T
        par = tl.load(Parents + b * T + i, mask=real, other=0)
        par = tl.where(real, par, i)
        anc = ((i[None, :] == par[:, None]) | (i[None, :] == i[:, None])).to(tl.float16)
        for _ in tl.static_range(STEPS):
            anc = tl.minimum(tl.dot(anc, anc), 1.0).to(tl.float16)
        ones = anc.to(tl.int32)
        tl.store(Depth + b * T + i, tl.sum(ones, 1) - 1, mask=real)
        words = tl.reduce(tl.reshape(ones << (i % 32)[None, :], [TP, TP // 32, 32]), 2, _bit_or)
        w = tl.arange(0, TP // 32)
        tl.store(Bits + (b * T + i)[:, None] * W + w[None, :], words, mask=real[:, None] & (w < W)[None, :])
        tl.store(Slots + b * T + i, _slots(Tables, b, tl.load(Ctx + b) + i, NB, BS), mask=real)

    @triton.jit
    def _accept_kernel(Tokens, Parents, Choice, Margin, Bits, Depth, Sizes, Force, Compact, Ctx, Tables,
                       Out, Src, Dst, NB,
                       T: tl.constexpr, TP: tl.constexpr, W: tl.constexpr, BS: tl.constexpr):
        """One program per sequence; the same decisions as accept_torch, node vectors in registers."""
        b = tl.program_id(0)
        i = tl.arange(0, TP)
        real = i < T
        valid = i < tl.load(Sizes + b)
        tok = tl.load(Tokens + b * T + i, mask=real, other=0)
        par = tl.load(Parents + b * T + i, mask=real, other=0)
        match = (tok == tl.load(Choice + b * T + par, mask=real, other=-1)) & valid
        match = match | (i == 0) | (tl.load(Force + b) != 0)
        match_words = tl.reduce(tl.reshape(match.to(tl.int32) << (i % 32), [TP // 32, 32]), 1, _bit_or)
        w = tl.arange(0, TP // 32)
        bits = tl.load(Bits + (b * T + i)[:, None] * W + w[None, :], mask=real[:, None] & (w < W)[None, :], other=0)
        accepted = (tl.reduce(bits & ~match_words[None, :], 1, _bit_or) == 0) & valid
        depth = tl.load(Depth + b * T + i, mask=real, other=0)
        key = tl.where(accepted, depth, -1)
        last = tl.min(tl.where(key == tl.max(key, 0), i, TP), 0)                 # first deepest accepted node
        k = tl.sum(tl.where(i == last, depth, 0), 0)
        next_token = tl.load(Choice + b * T + last)
        on = accepted[None, :] & (depth[None, :] == i[:, None])                  # [depth d, node]
        path = tl.sum(tl.where(on, i[None, :], 0), 1)
        row = Out + b * (2 + 2 * T)
        tl.store(row, next_token.to(tl.float32))
        tl.store(row + 1, k.to(tl.float32))
        tl.store(row + 2 + i, path.to(tl.float32), mask=real)
        tl.store(row + 2 + T + i, tl.load(Margin + b * T + path, mask=real, other=0.0), mask=real)
        ctx = tl.load(Ctx + b)
        use = (i <= k) & (tl.load(Compact + b) != 0)
        tl.store(Src + b * T + i, _slots(Tables, b, ctx + tl.where(use, path, i), NB, BS), mask=real)
        tl.store(Dst + b * T + i, _slots(Tables, b, ctx + i, NB, BS), mask=real)


    @triton.jit
    def _move_rows_kernel(Flat, Src, Dst, plane_stride, T: tl.constexpr, TP: tl.constexpr, ROW: tl.constexpr,
                          CHUNK: tl.constexpr):
        """Program (sequence, layer and K or V, column chunk): every row of the sequence's step that
        moves (src != dst) is loaded, then, after a barrier, stored: one sequence's sources and
        destinations overlap (ctx + path[d] -> ctx + d), so no row is written before all are read."""
        b = tl.program_id(0)
        plane = tl.program_id(1).to(tl.int64)
        col = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
        i = tl.arange(0, TP)
        real = i < T
        src = tl.load(Src + b * T + i, mask=real, other=0)
        dst = tl.load(Dst + b * T + i, mask=real, other=0)
        move = (real & (src != dst))[:, None]
        base = Flat + plane * plane_stride
        rows = tl.load(base + src[:, None] * ROW + col[None, :], mask=move)
        tl.debug_barrier()
        tl.store(base + dst[:, None] * ROW + col[None, :], rows, mask=move)


def _tile(T: int) -> tuple[int, int]:
    """(TP, warps): the register tile covering T nodes (at least one 32-bit word)."""
    tp = max(32, triton.next_power_of_2(T))
    return tp, 8 if tp >= 128 else 4


def prepare(parents: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor,
            block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """prepare_torch as one Triton launch (trees above MAX_KERNEL_NODES: prepare_torch)."""
    B, T = parents.shape
    if T > MAX_KERNEL_NODES:
        return prepare_torch(parents, ctx, tables, block_size)
    W = -(-T // 32)
    bits = torch.empty(B, T, W, dtype=torch.int32, device=parents.device)
    depth = torch.empty(B, T, dtype=torch.int64, device=parents.device)
    slots = torch.empty(B * T, dtype=torch.int64, device=parents.device)
    tp, warps = _tile(T)
    _prepare_kernel[(B,)](parents, ctx, tables, bits, depth, slots, tables.shape[1], T=T, TP=tp, W=W,
                          STEPS=doubling_steps(T), BS=block_size, num_warps=warps)
    return bits, depth, slots


def accept(tokens: torch.Tensor, parents: torch.Tensor, choice: torch.Tensor, margin: torch.Tensor,
           bits: torch.Tensor, depth: torch.Tensor, sizes: torch.Tensor, force: torch.Tensor,
           compact: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor,
           block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """accept_torch as one Triton launch (trees above MAX_KERNEL_NODES: accept_torch)."""
    B, T = tokens.shape
    if T > MAX_KERNEL_NODES:
        return accept_torch(tokens, parents, choice, margin, bits, depth, sizes, force, compact, ctx, tables,
                            block_size)
    out = torch.empty(B, 2 + 2 * T, dtype=torch.float32, device=tokens.device)
    src = torch.empty(B * T, dtype=torch.int64, device=tokens.device)
    dst = torch.empty_like(src)
    tp, warps = _tile(T)
    _accept_kernel[(B,)](tokens, parents, choice.contiguous(), margin.contiguous(), bits, depth, sizes, force,
                         compact, ctx, tables, out, src, dst, tables.shape[1], T=T, TP=tp, W=bits.shape[2],
                         BS=block_size, num_warps=warps)
    return out, src, dst


MOVE_ROWS_KERNEL = 1   # 1: the step's compaction copy is one Triton launch that moves only the rows that move
                       # (move_rows); 0: an index_select + index_copy_ of all B*T rows (move_rows_torch). H200,
                       # 2026-12-02, graph replay against 0 in one run: 8 x 64 -2.3 %, the other cells -0.2..-0.8 %
                       # (docs/BENCHMARKS.md, ninth session); the check against index_copy_ passed


def move_rows(flat: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, T: int) -> None:
    """move_rows_torch as one launch for a step of B trees of T nodes (src, dst [B * T], each sequence's
    rows together, as accept writes them); trees above MAX_KERNEL_NODES: move_rows_torch."""
    L, two, S, H, D = flat.shape
    row = H * D
    if T > MAX_KERNEL_NODES or not flat.is_contiguous():
        return move_rows_torch(flat, src, dst)
    chunk = min(64, triton.next_power_of_2(row))
    if row % chunk:
        return move_rows_torch(flat, src, dst)
    tp = triton.next_power_of_2(T)
    _move_rows_kernel[(src.shape[0] // T, L * two, row // chunk)](flat, src, dst, S * row, T=T, TP=tp, ROW=row,
                                                                 CHUNK=chunk, num_warps=4)
