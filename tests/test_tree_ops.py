"""tree_ops: the verify step's bookkeeping before and after the forward. The torch versions against
the plain numpy definitions (ancestor_mask, depths), and the Triton kernels (run by Triton's CPU
interpreter) against the torch versions on random trees, padding rows, prefill chains, partial
acceptance and tables with scattered blocks."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'edgespec[torch]')")

from edgespec.verifier.torch import tree_ops  # noqa: E402
from edgespec.verifier.torch.tree_attention import ancestor_mask, chain_parents, depths  # noqa: E402


def random_step(T: int, seed: int, bs: int = 4):
    """B = 4 rows of bucket T: a random tree, a chain (prefill), a root alone, and a padding row."""
    rng = np.random.default_rng(seed)
    B, NB = 4, -(-(50 + T) // bs) + 1
    sizes = [T, T, 1, 0]
    parents = np.tile(np.arange(T), (B, 1))                      # padding nodes are their own parents
    trees = [[-1] + [int(rng.integers(0, i)) for i in range(1, T)], chain_parents(T), [-1]]
    for b, p in enumerate(trees):
        parents[b, 1:len(p)] = p[1:]
        parents[b, 0] = 0
    ctx = torch.tensor([37, 0, 5, 0])
    tables = torch.from_numpy(rng.permutation(np.arange(1, B * NB + 1)).reshape(B, NB))
    tables[3] = 0
    return trees, torch.from_numpy(parents), ctx, tables, torch.tensor(sizes), bs


@pytest.mark.parametrize("T", [1, 2, 8, 32, 64])
def test_prepare_torch_matches_the_tree_definitions(T):
    trees, parents, ctx, tables, _, bs = random_step(T, T)
    bits, depth, slots = tree_ops.prepare_torch(parents, ctx, tables, bs)
    anc = tree_ops.unpack_ancestor_bits(bits, T)
    for b, p in enumerate(trees):
        n = len(p)
        assert (anc[b, :n, :n].numpy() == ancestor_mask(p)).all()
        assert (depth[b, :n].numpy() == depths(p)).all()
    pos = ctx[:, None] + torch.arange(T)
    want = tables.gather(1, pos // bs) * bs + pos % bs
    assert torch.equal(slots.view(4, T), want)


def test_pack_and_unpack_are_inverse():
    g = torch.Generator().manual_seed(0)
    anc = torch.rand(2, 5, 70, generator=g) < 0.5
    assert torch.equal(tree_ops.unpack_ancestor_bits(tree_ops.pack_ancestor_bits(anc), 70), anc)


@pytest.mark.parametrize("T", [1, 2, 8, 32, 64, 128])
def test_prepare_kernel_equals_torch(T):
    pytest.importorskip("triton", reason="triton is not installed")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _, parents, ctx, tables, _, bs = random_step(T, 100 + T)
    for got, want in zip(tree_ops.prepare(parents, ctx, tables, bs), tree_ops.prepare_torch(parents, ctx, tables, bs)):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("T", [1, 2, 8, 32, 64, 128])
@pytest.mark.parametrize("agree", [0.0, 0.7, 1.0])
def test_accept_kernel_equals_torch(T, agree):
    """choice agrees with each node's token with probability `agree`: nothing, part or all accepted."""
    pytest.importorskip("triton", reason="triton is not installed")
    _, parents, ctx, tables, sizes, bs = random_step(T, 200 + T)
    rng = np.random.default_rng(T)
    B = parents.shape[0]
    tokens = torch.from_numpy(rng.integers(0, 50, (B, T)))
    choice = torch.from_numpy(rng.integers(0, 50, (B, T)))
    # the target's choice after each parent equals the child's token with probability `agree`
    agrees = torch.from_numpy(rng.random((B, T)) < agree)
    for b in range(B):
        for i in range(1, T):
            if agrees[b, i]:
                choice[b, parents[b, i]] = tokens[b, i]
    margin = torch.from_numpy(rng.random((B, T)).astype(np.float32))
    force = torch.tensor([0, 1, 0, 0])
    compact = torch.tensor([1, 0, 1, 0])
    bits, depth, _ = tree_ops.prepare_torch(parents, ctx, tables, bs)
    args = (tokens, parents, choice, margin, bits, depth, sizes, force, compact, ctx, tables, bs)
    want = tree_ops.accept_torch(*args)
    got = tree_ops.accept(*args)
    assert torch.equal(got[0][:3], want[0][:3])           # real rows; the padding row's outputs are unused
    for g, w in zip(got[1:], want[1:]):
        assert torch.equal(g, w)
    out = want[0]
    assert out[1, 1] == T - 1                               # the prefill chain: every node accepted
    k, path = int(out[0, 1]), out[0, 2:2 + T].long().tolist()
    assert path[0] == 0 and int(out[0, 0]) == choice[0, path[k]]
    for d in range(1, k + 1):                               # a root path whose every node matches
        assert parents[0, path[d]] == path[d - 1] and tokens[0, path[d]] == choice[0, path[d - 1]]
    assert not any(parents[0, c] == path[k] and tokens[0, c] == choice[0, path[k]] for c in range(1, T))


@pytest.mark.parametrize("T", [1, 8, 64])
def test_move_rows_kernel_equals_torch(T):
    """The compaction copy as one launch (move_rows) leaves the cache exactly as index_select +
    index_copy_ (move_rows_torch) for accept's src/dst: partly accepted trees whose paths skip nodes
    (sources and destinations overlap), a prefill chain, a root alone and a padding row."""
    pytest.importorskip("triton", reason="triton is not installed")
    _, parents, ctx, tables, sizes, bs = random_step(T, 300 + T)
    if T > 2:   # row 0: root -> 1 | 2 -> 3 -> 4 ...; the path 0, 2, 3, ... moves each node one slot back
        parents[0, 3:] = torch.arange(2, T - 1)
        parents[0, 1:3] = 0
    rng = np.random.default_rng(T + 1)
    B = parents.shape[0]
    tokens = torch.from_numpy(rng.integers(0, 50, (B, T)))
    choice = torch.from_numpy(rng.integers(0, 50, (B, T)))
    for i in range(1, T):   # accept the last child of each node: the path skips its siblings
        choice[0, parents[0, i]] = tokens[0, i]
    bits, depth, _ = tree_ops.prepare_torch(parents, ctx, tables, bs)
    _, src, dst = tree_ops.accept_torch(tokens, parents, choice, torch.zeros(B, T), bits, depth, sizes,
                                        torch.tensor([0, 1, 0, 0]), torch.tensor([1, 0, 1, 0]), ctx, tables, bs)
    moved = src != dst
    assert T == 1 or moved.any()
    if T > 2:   # a slot read by one move and written by another: reads must come first
        assert set(src[moved].tolist()) & set(dst[moved].tolist())
    flat = torch.randn(3, 2, int(tables.max() + 1) * bs, 2, 32)
    want = flat.clone()
    tree_ops.move_rows_torch(want, src, dst)
    tree_ops.move_rows(flat, src, dst, T)
    assert torch.equal(flat, want)
