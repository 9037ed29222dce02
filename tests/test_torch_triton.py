"""The Triton paged tree-attention kernel against the torch reference (TorchPagedAttention), run by
Triton's CPU interpreter (TRITON_INTERPRET=1, float32): block tables with scattered blocks,
several context lengths (one of them 0), padding rows, key splits. Its GPU speed is measured by
tools/bench_gpu_verify.py. Needs the `triton` package (skipped where it is not installed)."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'edgespec[torch]')")
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton", reason="triton is not installed")

from edgespec.verifier.torch.tree_attention import TorchPagedAttention, ancestor_mask  # noqa: E402
from edgespec.verifier.torch.triton_attention import TritonPagedAttention, pack_ancestor_bits  # noqa: E402


def test_pack_ancestor_bits():
    anc = torch.zeros(1, 2, 40, dtype=torch.bool)
    anc[0, 0, [0, 31]] = True
    anc[0, 1, [1, 33]] = True
    bits = pack_ancestor_bits(anc)
    assert bits.shape == (1, 2, 2) and bits.dtype == torch.int32
    assert bits[0, 0].tolist() == [1 - 2 ** 31, 0] and bits[0, 1].tolist() == [2, 2]


@pytest.mark.parametrize("nsplit", [1, 3])
def test_triton_kernel_equals_reference(nsplit):
    g = torch.Generator().manual_seed(nsplit)
    rng = np.random.default_rng(nsplit)
    B, T, Hkv, G, D, bs = 3, 20, 2, 3, 32, 4
    n_blocks = 80
    cache = torch.randn(2, n_blocks * bs, Hkv, D, generator=g)
    ctx = torch.tensor([37, 0, 6])
    sizes = [20, 7, 13]                                  # real tree sizes; the rest are padding rows
    NB = 16
    tables = torch.zeros(B, NB, dtype=torch.int64)
    free = rng.permutation(np.arange(1, n_blocks))
    for b in range(B):
        need = -(-(int(ctx[b]) + sizes[b]) // bs)
        tables[b, :need] = torch.from_numpy(free[:need])
        free = free[need:]
    anc = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)
    for b, n in enumerate(sizes):
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        anc[b, :n, :n] = torch.from_numpy(ancestor_mask(parents))
    q = torch.randn(B, T, Hkv * G, D, generator=g)
    ref = TorchPagedAttention(tables, ctx, anc, bs, G)(q, cache)
    kernel = TritonPagedAttention(tables, ctx, anc, bs, G, nsplit=nsplit)
    kernel.BLOCK_M, kernel.BLOCK_N = 16, 16
    out = kernel(q, cache)
    for b, n in enumerate(sizes):
        assert torch.allclose(out[b, :n], ref[b, :n], atol=1e-5), float((out[b, :n] - ref[b, :n]).abs().max())
