"""The Triton paged tree-attention kernel against the torch reference (TorchPagedAttention), run by
Triton's CPU interpreter (TRITON_INTERPRET=1, float32): block tables with scattered blocks,
several context lengths (one of them 0), padding rows, key splits. Its GPU speed is measured by
tools/bench_gpu_verify.py. Needs the `triton` package (skipped where it is not installed)."""
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'edgespec[torch]')")
assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets the interpreter mode"
pytest.importorskip("triton", reason="triton is not installed")

from edgespec.verifier.torch.tree_attention import TorchPagedAttention, ancestor_mask  # noqa: E402
from edgespec.verifier.torch.tree_ops import pack_ancestor_bits  # noqa: E402
from edgespec.verifier.torch.triton_attention import TritonPagedAttention  # noqa: E402
from edgespec.verifier.torch import knobs  # noqa: E402


def test_pack_ancestor_bits():
    anc = torch.zeros(1, 2, 40, dtype=torch.bool)
    anc[0, 0, [0, 31]] = True
    anc[0, 1, [1, 33]] = True
    bits = pack_ancestor_bits(anc)
    assert bits.shape == (1, 2, 2) and bits.dtype == torch.int32
    assert bits[0, 0].tolist() == [1 - 2 ** 31, 0] and bits[0, 1].tolist() == [2, 2]


@pytest.mark.parametrize("nsplit,m_first,T,tree_split,block_m,block_n,merge_rows", [
    (1, 1, 20, 0, 16, 16, 1), (3, 1, 20, 0, 16, 16, 1), (5, 0, 20, 0, 16, 16, 1), (2, 1, 70, 0, 16, 16, 1),
    (1, 1, 20, 1, 16, 16, 1), (3, 0, 70, 1, 16, 16, 1), (2, 1, 70, 0, 16, 64, 1), (2, 1, 32, 0, 0, 0, 1),
    (5, 0, 70, 1, 16, 16, 1), (3, 1, 20, 0, 16, 16, 8), (5, 0, 70, 1, 16, 16, 16)])
def test_triton_kernel_equals_reference(nsplit, m_first, T, tree_split, block_m, block_n, merge_rows):
    """Either program order (M_FIRST) gives the torch reference's output; 70 nodes: three ancestor
    words per row, and a key tile (16 or 64 keys) that starts inside one word and ends in the next;
    TREE_SPLIT: the tree's keys in a split of their own (a context of 0 leaves the context splits
    empty; 5 splits of a short context: the tree's 70 keys outnumber a context split's, so the
    interpreter's loop bound must cover them). block_m 0: the tiles tile_config fits with M_TILE_FIT
    (96 query rows: 32-row tiles). merge_rows: query rows a merge program takes (MERGE_ROWS; 60 and 210
    rows are not multiples of 8 or 16: the last program's rest is masked)."""
    g = torch.Generator().manual_seed(nsplit)
    rng = np.random.default_rng(nsplit)
    B, Hkv, G, D, bs = 3, 2, 3, 32, 4
    n_blocks = 120
    cache = torch.randn(2, n_blocks * bs, Hkv, D, generator=g)
    ctx = torch.tensor([37, 0, 6])
    sizes = [T, 7, 13]                                   # real tree sizes; the rest are padding rows
    NB = 32
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
    kernel.BLOCK_M, kernel.BLOCK_N = block_m, block_n
    kernel.M_FIRST, kernel.TREE_SPLIT, kernel.M_TILE_FIT = m_first, tree_split, int(block_m == 0)
    kernel.MERGE_ROWS, kernel.MERGE_ROWS_FROM = merge_rows, 1
    if block_m == 0:
        assert kernel.launch_config(B, G * T, Hkv)[0] == 32
    out = kernel(q, cache)
    for b, n in enumerate(sizes):
        assert torch.allclose(out[b, :n], ref[b, :n], atol=1e-5), float((out[b, :n] - ref[b, :n]).abs().max())


def test_fitted_query_tiles_pad_fewer_rows():
    """M_TILE_FIT: 96 query rows (T = 16 at 6 query heads per KV head) in three 32-row tiles, not two
    64-row ones; 384 rows keep 64-row tiles, a handful of rows 16-row ones (the kernel on fitted tiles:
    test_triton_kernel_equals_reference with block_m 0)."""
    attn = TritonPagedAttention.__new__(TritonPagedAttention)
    with knobs.override({"M_TILE_FIT": 1}):
        assert [attn.tile_config(r, 256)[0] for r in (6, 48, 96, 384)] == [16, 64, 32, 64]
    with knobs.override({"M_TILE_FIT": 0}):
        assert [attn.tile_config(r, 256)[0] for r in (6, 48, 96, 384)] == [16, 64, 64, 64]


def test_fused_ops_equal_torch_references():
    from edgespec.verifier.torch import fused

    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 64, generator=g)
    r = torch.randn(6, 64, generator=g)
    w = torch.rand(64, generator=g) + 0.5
    y_ref, x_ref = fused.add_rmsnorm_torch(x.clone(), r, w, 1e-6)
    y, x_new = fused.add_rmsnorm(x.clone(), r, w, 1e-6)
    assert torch.allclose(y, y_ref, atol=1e-5) and torch.allclose(x_new, x_ref, atol=1e-6)
    y, _ = fused.add_rmsnorm(x.clone(), None, w, 1e-6)
    assert torch.allclose(y, fused.add_rmsnorm_torch(x.clone(), None, w, 1e-6)[0], atol=1e-5)
    Hq, Hkv, D = 4, 2, 16
    qkv = torch.randn(6, (Hq + 2 * Hkv) * D, generator=g)
    cos, sin = torch.rand(6, D // 2, generator=g), torch.rand(6, D // 2, generator=g)
    slots = torch.tensor([3, 9, 0, 17, 5, 11])
    cache_ref, cache = torch.zeros(2, 20, Hkv, D), torch.zeros(2, 20, Hkv, D)
    q_ref = fused.rope_store_torch(qkv, cos, sin, cache_ref, slots, Hq, Hkv)
    q = fused.rope_store(qkv, cos, sin, cache, slots, Hq, Hkv)
    assert torch.allclose(q, q_ref, atol=1e-6) and torch.allclose(cache, cache_ref, atol=1e-6)
    gu = torch.randn(6, 2 * 40, generator=g)
    assert torch.allclose(fused.silu_mul(gu), fused.silu_mul_torch(gu), atol=1e-6)
    # argmax and top-2 margin over several chunks (2048 logits by default, and 4096), with ties inside a chunk and
    # across chunks, and a chunk boundary between the two largest (4095 | 4096)
    logits = torch.randn(5, 9000, generator=g)
    logits[1, [7, 4100]] = 50.0          # the maximum twice, in two chunks: the first index, margin 0
    logits[2, [8001, 8002]] = 60.0       # twice in one chunk
    logits[3, 8999] = 70.0               # in the last, partial chunk
    logits[4, 4095], logits[4, 4096] = 40.0, 39.5
    arg_ref, margin_ref = fused.argmax_top2_torch(logits)
    for block, warps in ((None, None), (4096, 8)):
        arg, margin = fused.argmax_top2(logits, block, warps)
        assert arg.tolist() == arg_ref.tolist() == [int(logits[0].argmax()), 7, 8001, 8999, 4095]
        assert torch.allclose(margin, margin_ref) and margin[1] == 0 and margin[2] == 0 and margin[4] == 0.5


@pytest.mark.parametrize("move_kernel", [0, 1])
def test_engine_with_triton_kernels_equals_torch_engine(monkeypatch, move_kernel):
    """The whole verify step with the fused kernels and the Triton attention (interpreted) gives
    the torch engine's logits, decisions and compacted cache (tiny float32 model); also with the
    compaction copy as one kernel (tree_ops.MOVE_ROWS_KERNEL)."""
    from edgespec.verifier.torch import tree_ops
    from edgespec.verifier.torch.engine import Engine, TreeStep
    from edgespec.verifier.torch.model import ModelConfig, TransformerLM

    monkeypatch.setattr(tree_ops, "MOVE_ROWS_KERNEL", move_kernel)

    model = TransformerLM.random(ModelConfig.tiny("qwen2"), dtype=torch.float32, seed=2)
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 512, size=21).tolist()
    tokens = rng.integers(0, 512, size=9).tolist()
    parents = [-1, 0, 0, 1, 1, 2, 3, 6, 6]
    out = []
    for kind in ("torch", "triton"):
        engine = Engine(model, num_blocks=32, block_size=4, attention=kind, fused=kind == "triton")
        seq = engine.new_sequence()
        engine.prefill(seq, prefix)
        logits = engine.logits(seq, tokens, parents)
        tokens[2] = int(logits[0].argmax())             # node 2, not 1: compaction moves it one slot back
        tokens[1] = (tokens[2] + 1) % 512
        logits = engine.logits(seq, tokens, parents)
        [d] = engine.verify([TreeStep(seq, tokens, parents)])
        slots = [seq.blocks[p // 4] * 4 + p % 4 for p in range(seq.length)]   # the committed positions
        out.append((logits, d, engine.cache.flat[:, :, slots].clone()))
    model.fused_ops = False
    assert torch.allclose(out[0][0], out[1][0], atol=1e-4)
    assert torch.allclose(out[0][2], out[1][2], atol=1e-4)   # the accepted path's K/V moved into place alike
    (_, a, _), (_, b, _) = out
    assert (a.path, a.next_token) == (b.path, b.next_token) and a.path[0] == 2
    assert np.allclose(a.margins, b.margins, atol=1e-4)


def k_slices(k: int, cfg: tuple[int, int, int, int, int]) -> int:
    """How many K slices linear_rows makes of a config's SPLIT: each a whole number of BLOCK_K tiles."""
    block_k, split = cfg[1], cfg[2]
    k_split = math.ceil(math.ceil(k / split) / block_k) * block_k
    return math.ceil(k / k_split)


@pytest.mark.parametrize("rows", [1, 5, 16, 64])
def test_linear_rows_equals_f_linear(rows):
    """The small-rows matmul against F.linear (float32: exact products in the interpreter): with a
    bias, unmasked and ragged shapes, split K (summed by its own launch, or left as partials for
    add_rmsnorm), and the SiLU*up input of w2. (bf16 is checked on the GPU by
    tools/bench_gpu_verify.py's matmuls section: Triton 3.6's interpreter multiplies bf16 tiles in
    tl.dot as raw 16-bit integers.)"""
    import torch.nn.functional as F

    from edgespec.verifier.torch import fused

    g = torch.Generator().manual_seed(rows)
    for n, k, cfg in [(48, 96, (16, 32, 1, 4, 2)),      # unmasked, no split
                      (40, 100, (16, 32, 1, 4, 2)),     # ragged N and K
                      (48, 96, (16, 32, 3, 4, 2)),      # K split in 3 whole tiles
                      (40, 100, (32, 16, 3, 4, 2)),     # split with a ragged last slice
                      (48, 96, None)] + (                # the default config
                     [(40, 100, (8, 64, 2, 4, 2)),      # the one-row GEMV: 8 columns a unit, ragged K slices
                      (256, 96, (8, 32, 3, 4, 2))]      # 96 units on 16 interpreter programs: 6 rounds each
                     if rows == 1 else
                     [(40, 100, (20, 32, 1, 4, 2)),     # 20 columns a program: a 16-row tile and a 16-row tail
                      (48, 96, (40, 32, 2, 4, 2))]):    # 32 + a tail of 8 (16 with 8 masked), split K
        x = torch.randn(rows, k, generator=g)
        w = torch.randn(n, k, generator=g) / k ** 0.5
        b = torch.randn(n, generator=g)
        ref = F.linear(x, w, b)
        assert torch.allclose(fused.linear_rows(x, w, b, config=cfg), ref, atol=1e-5)
        assert torch.allclose(fused.linear_rows(x, w, config=cfg), F.linear(x, w), atol=1e-5)
        p = fused.linear_rows_partials(x, w, config=cfg)
        assert p.dtype == torch.float32 and p.shape[1:] == (rows, n)
        assert p.shape[0] == (1 if cfg is None else k_slices(k, cfg))
        assert torch.allclose(p.sum(0), F.linear(x, w), atol=1e-5)
        gu = torch.randn(rows, 2 * k, generator=g)
        assert torch.allclose(fused.linear_rows(gu, w, silu=True, config=cfg),
                              fused.linear_rows_torch(gu, w, silu=True), atol=1e-5)
        assert torch.allclose(fused.linear_rows_partials(gu, w, silu=True, config=cfg).sum(0),
                              fused.linear_rows_partials_torch(gu, w, silu=True).sum(0), atol=1e-5)
    # partials as add_rmsnorm's residual: the same as adding the matmul's output
    x, r = torch.randn(rows, 64, generator=g), torch.randn(rows, 32, generator=g)
    w, nw = torch.randn(64, 32, generator=g), torch.rand(64, generator=g) + 0.5
    p = fused.linear_rows_partials(r, w, config=(16, 16, 2, 4, 2))
    assert p.shape[0] == 2
    y_ref, x_ref = fused.add_rmsnorm_torch(x.clone(), F.linear(r, w), nw, 1e-6)
    y, x_new = fused.add_rmsnorm(x.clone(), p, nw, 1e-6)
    assert torch.allclose(y, y_ref, atol=1e-5) and torch.allclose(x_new, x_ref, atol=1e-5)
    y, x_new = fused.add_rmsnorm_torch(x.clone(), p, nw, 1e-6)
    assert torch.allclose(y, y_ref, atol=1e-5) and torch.allclose(x_new, x_ref, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 16, 64])
def test_linear_silu_equals_matmul_then_silu_mul(rows):
    """linear_silu (gate and up rows of the same output columns in one program, SiLU*up the epilogue)
    against silu_mul(F.linear(...)), float32: whole and ragged shares, a share that fills one tile, the
    balanced default; a split K is refused (SiLU needs whole sums)."""
    from edgespec.verifier.torch import fused

    g = torch.Generator().manual_seed(40 + rows)
    for f, k, cfg in [(40, 100, (12, 32, 1, 4, 2)),   # 24 weight rows a program: 16 + a tail of 8
                      (40, 96, (3, 32, 1, 4, 2)),     # 6 weight rows in a 16-row tile
                      (48, 96, (8, 16, 1, 4, 2)),     # exactly one 16-row tile
                      (40, 100, None)]:               # balanced_config
        x = torch.randn(rows, k, generator=g)
        w = torch.randn(2 * f, k, generator=g) / k ** 0.5
        got = fused.linear_silu(x, w, config=cfg)
        assert got.shape == (rows, f)
        assert torch.allclose(got, fused.linear_silu_torch(x, w), atol=1e-5)
    with pytest.raises(ValueError, match="splits K"):
        fused.linear_silu(x, w, config=(8, 16, 2, 4, 2))


def test_balanced_config_gives_every_sm_an_equal_share():
    """balanced_config on the H200's 132 SMs: the programs cover every output column once, at most one
    program per SM, and no program holds more than one column more than an equal share."""
    from edgespec.verifier.torch import fused

    for rows, n_out, k, pair, can_split in [(64, 8960, 1536, True, False), (16, 8960, 1536, True, False),
                                            (64, 1536, 8960, False, True), (16, 2048, 1536, False, False),
                                            (64, 1536, 1536, False, True)]:
        cols, block_k, split, _, _ = fused.balanced_config(rows, n_out, k, sms=132, pair=pair, can_split=can_split)
        programs = math.ceil(n_out / cols) * split
        assert programs <= 132 and math.ceil(n_out / cols) * cols >= n_out
        assert cols <= math.ceil(n_out / (132 // split)), (rows, n_out, k, cols, split)
        assert split == 1 or can_split
        assert math.ceil(k / block_k) >= split
    assert fused.balanced_config(64, 1536, 8960, sms=132, can_split=True)[2] > 1   # w2's 1536 columns need K split
    assert fused._row_tiles(136) == (128, 16) and fused._row_tiles(128) == (128, 0) and fused._row_tiles(6) == (16, 0)


def test_l2_warm_budget_takes_wo_whole_then_whole_lines_of_every_gate_up_row():
    """fused.L2_WARM (MB) and L2_WARM_ROWS decide what the side stream warms: all of wo (4.5 MiB at
    the Qwen2.5-1.5B shape) and then the first 128-byte lines of each of the 17920 gate/up rows (2.2 MiB a line,
    24 lines a row) within the budget; never more than a whole row; nothing past the row bound. On the CPU the
    forward never warms (the model asks only for CUDA tensors), so the fused forward's tests run it unchanged."""
    from edgespec.verifier.torch import fused

    wo = torch.empty(1536, 1536, dtype=torch.bfloat16, device="meta")
    gate_up = torch.empty(17920, 1536, dtype=torch.bfloat16, device="meta")
    assert (fused.L2_WARM, fused.L2_WARM_ROWS) == (32, 64)   # the H200's pick
    with knobs.override({"L2_WARM": 0}):
        assert fused.l2_warm_lines(1, wo, gate_up) is None
    with knobs.override({"L2_WARM": 32, "L2_WARM_ROWS": 64}):
        assert fused.l2_warm_lines(64, wo, gate_up) == (32 * 2 ** 20 - 1536 * 1536 * 2) // (17920 * 128) == 12
        assert fused.l2_warm_lines(65, wo, gate_up) is None
        with knobs.override({"L2_WARM_ROWS": 512}):
            assert fused.l2_warm_lines(512, wo, gate_up) == 12
    with knobs.override({"L2_WARM": 4}):
        assert fused.l2_warm_lines(1, wo, gate_up) == 0      # wo alone
    with knobs.override({"L2_WARM": 1000}):
        assert fused.l2_warm_lines(1, wo, gate_up) == 24     # all of it


def test_l2_warming_only_where_the_gpu_has_the_bulk_prefetch(monkeypatch):
    """_l2_warm_kernel's cp.async.bulk.prefetch is an sm_90 instruction: on an A100, L4 or RTX 4090 (compute
    capability 8.x) the step does not warm at all (the kernel would not assemble there); an H100 / H200 does."""
    from edgespec.verifier.torch import fused

    capability = {0: (8, 9), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[device.index])
    assert not fused.bulk_prefetch_ok(torch.device("cuda", 0))
    assert fused.bulk_prefetch_ok(torch.device("cuda", 1))
    assert fused.bulk_prefetch_ok(torch.device("cpu")) and fused.bulk_prefetch_ok(torch.device("meta"))

    class OnGpu0:   # l2_warm_lines reads the weight's device only before it gives up
        device = torch.device("cuda", 0)

    assert fused.l2_warm_lines(1, OnGpu0(), OnGpu0()) is None


def test_one_row_gemv_in_bfloat16():
    """The one-row GEMV as the step runs it, in bf16 (its dot-free sums run in the interpreter in any
    dtype): bf16 weights and input, float32 sums, one rounding at the end; SiLU*up rounded to bf16
    before the product. Against float32 F.linear of the same bf16 values; the SiLU*up input exactly,
    with the rounding the interpreter does (its float32 -> bf16 conversion truncates where the GPU
    rounds to nearest even)."""
    import torch.nn.functional as F

    from edgespec.verifier.torch import fused

    g = torch.Generator().manual_seed(3)
    for n, k, cfg in [(256, 512, (8, 128, 2, 4, 3)), (72, 200, (16, 64, 3, 4, 3))]:   # even; ragged
        x = torch.randn(1, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
        b = torch.randn(n, generator=g).bfloat16()
        ref = F.linear(x.float(), w.float(), b.float())
        got = fused.linear_rows(x, w, b, config=cfg)
        assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), ref, rtol=1e-2, atol=1e-2)
        gu = torch.randn(1, 2 * k, generator=g).bfloat16()
        gate, up = gu.float().chunk(2, dim=-1)
        silu = (F.silu(gate) * up).view(torch.int32).bitwise_and(-65536).view(torch.float32)   # truncated to bf16
        p = fused.linear_rows_partials(gu, w, silu=True, config=cfg)
        assert p.dtype == torch.float32
        assert torch.allclose(p.sum(0), F.linear(silu, w.float()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gate_up", ["linear_silu", "cublas"])
def test_fused_forward_small_rows_matmul_equals_cublas_path(monkeypatch, gate_up):
    """The fused forward with linear_rows for the block matmuls equals the one with F.linear (tiny
    float32 model, one tree step over a prefilled context, torch attention). The tiny shapes get
    table entries (untuned shapes keep F.linear), one of them split for wo and w2's partials; gate/up
    runs as linear_silu, or stays F.linear with w2 applying SiLU*up as it loads."""
    from edgespec.verifier.torch import fused
    from edgespec.verifier.torch.engine import Engine
    from edgespec.verifier.torch.model import ModelConfig, TransformerLM

    c = ModelConfig.tiny("qwen2")
    qkv = (c.n_head + 2 * c.n_head_kv) * c.head_dim
    table = {(qkv, c.d_model): [(64, (16, 32, 1, 4, 2))], (c.d_model, c.n_head * c.head_dim): [(64, (16, 16, 2, 4, 2))],
             (2 * c.d_ff, c.d_model): [(64, (32, 32, 1, 4, 2))], (c.d_model, c.d_ff): [(64, (16, 32, 3, 4, 2))]}
    if gate_up == "cublas":
        table[(2 * c.d_ff, c.d_model)] = [(64, None)]
    monkeypatch.setattr(fused, "LINEAR_ROWS_TABLE", table)
    monkeypatch.setattr(fused, "LINEAR_SILU_ROWS", 1)   # the steps here have 5 and 11 rows
    assert fused.linear_rows_wins(5, 2 * c.d_ff, c.d_model) == (gate_up == "linear_silu")
    assert not fused.linear_rows_wins(5, 2048, 1536)
    calls = []
    for name in ("linear_silu", "silu_mul"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    model = TransformerLM.random(c, dtype=torch.float32, seed=5)
    rng = np.random.default_rng(6)
    prefix = rng.integers(0, 512, size=11).tolist()
    tokens = rng.integers(0, 512, size=5).tolist()
    parents = [-1, 0, 0, 1, 2]
    out = []
    for small in (0, 64):
        engine = Engine(model, num_blocks=16, block_size=4, attention="torch", fused=True, small_rows_matmul=small)
        assert model.small_rows_matmul == small
        seq = engine.new_sequence()
        engine.prefill(seq, prefix)
        out.append(engine.logits(seq, tokens, parents))
    model.fused_ops, model.small_rows_matmul = False, 0
    assert torch.allclose(out[0], out[1], atol=1e-4), float((out[0] - out[1]).abs().max())
    # cuBLAS path: silu_mul every layer; the other: linear_silu (or w2's SiLU*up load), no silu_mul
    assert calls.count("silu_mul") == 2 * c.n_layer   # prefill chunk and tree step of small=0
    assert calls.count("linear_silu") == (2 * c.n_layer if gate_up == "linear_silu" else 0)


def test_engine_with_triton_kernels_equals_plain_torch_path():
    """The whole forward as the GPU runs it (fused norms, RoPE + cache stores, SiLU; the Triton tree
    attention), interpreted on the CPU, against the plain
    float32 torch path: a prefilled context, then a branching tree step."""
    from edgespec.verifier.torch.engine import Engine
    from edgespec.verifier.torch.model import ModelConfig, TransformerLM

    model = TransformerLM.random(ModelConfig.tiny("qwen2"), dtype=torch.float32, seed=8)
    rng = np.random.default_rng(9)
    prefix = rng.integers(0, 512, size=23).tolist()
    tokens = rng.integers(0, 512, size=7).tolist()
    parents = [-1, 0, 0, 1, 1, 2, 4]
    out = []
    for attention, fused in (("torch", False), ("triton", True)):
        engine = Engine(model, num_blocks=24, block_size=4, attention=attention, fused=fused)
        seq = engine.new_sequence()
        engine.prefill(seq, prefix)
        out.append(engine.logits(seq, tokens, parents))
    model.fused_ops = False
    assert torch.allclose(out[0], out[1], atol=1e-4), float((out[0] - out[1]).abs().max())


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 3)])
def test_matmul_with_rope_epilogue_equals_linear_then_rope_store(dtype, rows):
    """linear_rope_store (the wqkv matmul whose epilogue rotates q, k and writes the cache: the one-row
    GEMV, or _linear_rows_kernel for more rows) against rope_store_torch(F.linear(...)): q, the written
    k/v slots, and no other slot touched. Float32: equal up to the sums' order; bf16: the same rounding
    of the matmul output before the rotation, so equal within one bf16 step (the interpreter truncates
    where the GPU rounds; its tl.dot cannot take bf16, so more rows are checked in float32)."""
    from edgespec.verifier.torch import fused

    g = torch.Generator().manual_seed(7)
    n_head, n_head_kv, D, K, S = 4, 2, 16, 48, 10
    N = (n_head + 2 * n_head_kv) * D
    x = torch.randn(rows, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    ang = torch.rand(rows, D // 2, generator=g) * 6.0
    cos, sin = ang.cos(), ang.sin()
    slots = torch.tensor([7, 2, 9][:rows])
    cfgs = ([(8, 16, 1, 4, 2), (16, 32, 1, 4, 2), (4, 64, 1, 4, 2)] if rows == 1   # whole K tiles; ragged last tile
            else [(16, 16, 1, 4, 2), (24, 32, 1, 4, 2), (6, 64, 1, 4, 2)])       # COLS spanning heads, ragged shares
    for cfg in cfgs:
        table = {(N, K): [(rows, cfg)]}
        old = fused.LINEAR_ROWS_TABLE
        fused.LINEAR_ROWS_TABLE = table
        try:
            cache_ref = torch.zeros(2, S, n_head_kv, D, dtype=dtype)
            cache = torch.zeros_like(cache_ref)
            q_ref = fused.linear_rope_store_torch(x, w, b, cos, sin, cache_ref, slots, n_head, n_head_kv)
            q = fused.linear_rope_store(x, w, b, cos, sin, cache, slots, n_head, n_head_kv)
        finally:
            fused.LINEAR_ROWS_TABLE = old
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        assert q.shape == q_ref.shape and q.dtype == dtype
        assert torch.allclose(q.float(), q_ref.float(), **tol)
        assert torch.allclose(cache.float(), cache_ref.float(), **tol)
        untouched = torch.ones(S, dtype=torch.bool)
        untouched[slots] = False
        assert not cache[:, untouched].any()
    fused.LINEAR_ROWS_TABLE, old = {(N, K): [(rows, (8, 16, 2, 4, 2))]}, fused.LINEAR_ROWS_TABLE   # K split: refused
    try:
        with pytest.raises(ValueError, match="does not pair"):
            fused.linear_rope_store(x, w, b, cos, sin, cache, slots, n_head, n_head_kv)
    finally:
        fused.LINEAR_ROWS_TABLE = old


@pytest.mark.parametrize("knob", ["GEMV_ROPE", "ROWS_ROPE"])
def test_fused_forward_with_rope_in_the_matmul_equals_without(monkeypatch, knob):
    """The fused forward with RoPE in the wqkv matmul's epilogue equals it with the separate RoPE launch
    (tiny float32 model, a wqkv table entry that pairs within heads): a one-token step with GEMV_ROPE;
    a 13-token prefill chunk and a 5-node tree step with ROWS_ROPE."""
    from edgespec.verifier.torch import fused
    from edgespec.verifier.torch.engine import Engine
    from edgespec.verifier.torch.model import ModelConfig, TransformerLM

    c = ModelConfig.tiny("qwen2")
    qkv = (c.n_head + 2 * c.n_head_kv) * c.head_dim
    monkeypatch.setattr(fused, "LINEAR_ROWS_TABLE", {(qkv, c.d_model): [(1, (8, 32, 1, 4, 2)), (16, (24, 32, 1, 4, 2))]})
    model = TransformerLM.random(c, dtype=torch.float32, seed=9)
    prefix = np.random.default_rng(3).integers(0, 512, size=13).tolist()
    tokens, parents = ([5], [-1]) if knob == "GEMV_ROPE" else ([5, 9, 11, 3, 7], [-1, 0, 0, 1, 1])
    monkeypatch.setattr(fused, "ROWS_ROPE" if knob == "GEMV_ROPE" else "GEMV_ROPE", 0)   # the other one off
    calls = []
    fused_call = fused.linear_rope_store
    monkeypatch.setattr(fused, "linear_rope_store", lambda *a: calls.append(1) or fused_call(*a))
    out = []
    for on in (0, 1):
        monkeypatch.setattr(fused, knob, on)
        rows = len(tokens)
        assert fused.rope_in_matmul_fits(rows, model.layers[0].wqkv.weight, c.head_dim) == bool(on)
        engine = Engine(model, num_blocks=16, block_size=4, attention="torch", fused=True, small_rows_matmul=64)
        seq = engine.new_sequence()
        engine.prefill(seq, prefix)
        out.append((engine.logits(seq, tokens, parents), engine.cache.flat.clone()))
    model.fused_ops, model.small_rows_matmul = False, 0
    # once a layer in the steps with the knob on: the one-token step (GEMV_ROPE); prefill and tree (ROWS_ROPE)
    assert len(calls) == c.n_layer * (1 if knob == "GEMV_ROPE" else 2)
    assert torch.allclose(out[0][0], out[1][0], atol=1e-4), float((out[0][0] - out[1][0]).abs().max())
    assert torch.allclose(out[0][1], out[1][1], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_split_k_partials_sum_to_the_matmul(dtype):
    """fused.linear_split_k: float32 partials [parts, rows, N] over equal K slices (strided views, one batched
    GEMM) that sum to x @ W^T; parts <= 1 is F.linear itself; K that does not divide is refused."""
    import torch.nn.functional as F

    from edgespec.verifier.torch import fused

    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 96, generator=g).to(dtype)
    w = (torch.randn(40, 96, generator=g) / 96 ** 0.5).to(dtype)
    exact = F.linear(x.float(), w.float())
    for parts in (2, 3, 4):
        p = fused.linear_split_k(x, w, parts)
        assert p.shape == (parts, 7, 40) and p.dtype == torch.float32
        assert torch.allclose(p.sum(0), exact, atol=1e-5, rtol=1e-5)
        piece = 96 // parts   # each slice is its own product, not a share of the whole
        assert torch.allclose(p[1], F.linear(x[:, piece:2 * piece].float(), w[:, piece:2 * piece].float()), atol=1e-5)
    assert torch.equal(fused.linear_split_k(x, w, 1), F.linear(x, w))
    with pytest.raises(ValueError, match="equal K slices"):
        fused.linear_split_k(x, w, 5)


def test_w2_split_k_takes_a_divisor_of_k_by_rows(monkeypatch):
    """W2_SPLIT_K_ROWS // rows slices, rounded down to a divisor of K (at most 16); off, or past half the budget: 1."""
    from edgespec.verifier.torch import fused

    monkeypatch.setattr(fused, "W2_SPLIT_K_ROWS", 0)
    assert fused.w2_split_k(128, 8960) == 1
    monkeypatch.setattr(fused, "W2_SPLIT_K_ROWS", 1024)
    assert [fused.w2_split_k(r, 8960) for r in (64, 128, 256, 512, 600, 2048)] == [16, 8, 4, 2, 1, 1]
    assert fused.w2_split_k(128, 8959) == 1 and fused.w2_split_k(300, 8960) == 2   # 8959 is prime; 3 does not divide


def test_fused_forward_with_cublas_split_k_equals_without(monkeypatch):
    """The fused forward with w2 on cuBLAS in K slices (W2_SPLIT_K_ROWS; the partials summed by add_rmsnorm)
    equals it with F.linear: tiny float32 model, a 17-token prefill chunk (2 slices) and a 5-node tree step
    (8 slices), the Triton attention interpreted."""
    from edgespec.verifier.torch import fused
    from edgespec.verifier.torch.engine import Engine
    from edgespec.verifier.torch.model import ModelConfig, TransformerLM

    c = ModelConfig.tiny("qwen2")
    model = TransformerLM.random(c, dtype=torch.float32, seed=12)
    rng = np.random.default_rng(13)
    prefix = rng.integers(0, 512, size=17).tolist()
    tokens, parents = [5, 9, 11, 3, 7], [-1, 0, 0, 1, 1]
    parts = []
    real = fused.linear_split_k
    monkeypatch.setattr(fused, "linear_split_k", lambda x, w, n: parts.append(n) or real(x, w, n))
    out = []
    for budget in (0, 64):
        with knobs.override({"W2_SPLIT_K_ROWS": budget}):
            engine = Engine(model, num_blocks=16, block_size=4, attention="triton", fused=True)
            seq = engine.new_sequence()
            engine.prefill(seq, prefix)
            out.append(engine.logits(seq, tokens, parents))
    model.fused_ops = False
    assert parts == [1] * 2 * c.n_layer + [2] * c.n_layer + [8] * c.n_layer   # per layer: prefill, then tree step
    assert torch.allclose(out[0], out[1], atol=1e-4), float((out[0] - out[1]).abs().max())


def test_tma_rows_experiment_kernel_equals_torch():
    """tools/bench_tma_rows.py's TMA small-rows kernel (a measured experiment, docs/BENCHMARKS.md twentieth session)
    against torch in the interpreter: gate/up with SiLU*up, and float32 K-slice partials with ragged K and columns."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "bench_tma_rows.py"
    spec = importlib.util.spec_from_file_location("bench_tma_rows", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.check()   # asserts each product within 1e-4 of torch's


@pytest.mark.parametrize("tiles,config,span", [(1, (16, 128, 1, 4, 6), 128), (4, (16, 128, 1, 4, 6), 512),
                                               (4, (16, 64, 8, 4, 6), 128), (16, (16, 64, 1, 4, 6), 1024)])
def test_prefetch_tiles_spans_whole_tiles_of_the_slice(monkeypatch, tiles, config, span):
    """fused.PREFETCH_TILES: with PDL, a small-rows matmul program asks L2 for the first tiles of its K slice before
    it waits, a power of two of whole tiles inside the slice (1536 = 12 tiles of 128; 8 slices of 192 = 3 tiles of
    64: two; 24 tiles of 64: sixteen), one 128-byte line per 32 float32 weights of each row."""
    from edgespec.verifier.torch import fused

    seen = {}
    kernel = fused._linear_rows_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.update(SPAN=kw["SPAN"], LINES=kw["LINES"])
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(fused, "_linear_rows_kernel", Spy())
    x, w = torch.randn(4, 1536), torch.randn(64, 1536)   # float32 (the interpreter's bf16 dot is not the GPU's)
    with knobs.override({"PREFETCH_TILES": tiles}):
        out = fused.linear_rows_partials(x, w, config=config)
    assert seen == {"SPAN": span, "LINES": span * 4 // 128}
    assert torch.allclose(out.sum(0), x @ w.T, atol=1e-3)


def test_launch_fitting_drops_stages_until_shared_memory_fits(monkeypatch):
    """A config picked on the H200 that asks for more shared memory than a smaller GPU has (Triton's
    OutOfResources at load) runs with fewer stages instead of failing, and later launches start from the stages
    that fit; a kernel that does not fit with one stage still raises."""
    from triton.runtime.errors import OutOfResources

    from edgespec.verifier.torch import fused

    monkeypatch.setattr(fused, "_FITTED_STAGES", {})
    tried: list[int] = []

    class Kernel:   # stands in for a jit function on a GPU with room for 3 stages of this config
        limit = 3

        def __getitem__(self, grid):
            def launch(*args, num_stages, **constexprs):
                tried.append(num_stages)
                if num_stages > self.limit:
                    raise OutOfResources(num_stages * 1000, self.limit * 1000, "shared memory")
            return launch

    x = torch.zeros(2)
    kernel = Kernel()
    fused.launch_fitting(kernel, (1,), x, num_stages=6, BLOCK=64)
    assert tried == [6, 5, 4, 3]
    tried.clear()
    fused.launch_fitting(kernel, (1,), x, num_stages=6, BLOCK=64)
    assert tried == [3]                       # remembered per kernel, device, stages asked and constexprs
    tried.clear()
    fused.launch_fitting(kernel, (1,), x, num_stages=2, BLOCK=64)
    assert tried == [2]                       # a config that fits runs as asked
    kernel.limit = 0
    with pytest.raises(OutOfResources):
        fused.launch_fitting(kernel, (1,), x, num_stages=2, BLOCK=128)


@pytest.mark.parametrize("rows", [65, 128])
def test_small_rows_matmuls_past_64_rows_when_the_knob_allows(rows):
    """LINEAR_ROWS_MAX bounds the rows the small-rows kernel takes (64: the step then uses cuBLAS past it). The
    kernel itself is generic in its padded row count, so a GPU session can time it past 64 rows (a knob and '%'
    table entries in tools/bench_gpu_verify.py, no code change): plain with bias, float32 partials of a K split,
    and gate/up with SiLU*up, each against torch."""
    import torch.nn.functional as F

    from edgespec.verifier.torch import fused

    torch.manual_seed(rows)
    x, w, b, gate_up = torch.randn(rows, 64), torch.randn(96, 64), torch.randn(96), torch.randn(96, 64)
    with knobs.override({"LINEAR_ROWS_MAX": rows}):
        assert torch.allclose(fused.linear_rows(x, w, b, config=(16, 32, 1, 4, 2)), F.linear(x, w, b), atol=1e-4)
        partials = fused.linear_rows_partials(x, w, config=(32, 16, 2, 4, 2))
        assert partials.shape == (2, rows, 96) and torch.allclose(partials.sum(0), x @ w.T, atol=1e-4)
        assert torch.allclose(fused.linear_silu(x, gate_up, config=(16, 32, 1, 4, 2)),
                              fused.linear_silu_torch(x, gate_up), atol=1e-3)
    with pytest.raises(ValueError, match="1..64 rows"):
        fused.linear_rows(x, w, b, config=(16, 32, 1, 4, 2))


def test_the_critical_path_charges_each_kernel_what_it_adds_to_the_chains_end():
    """tools/bench_gpu_verify.critical_path: with PDL a kernel starts early and waits, so each is charged only
    what it moves the chain's end (here the second matmul of a layer overlaps the first and adds 2 us);
    launches are labelled by their place in a layer, the one before layer 0 as #pre; side-stream warming
    is set apart; replays average, the first one (the profiler starting up) left out."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from bench_gpu_verify import critical_path

    def replay(t0: float) -> list[tuple[str, float, float]]:
        ks = [("norm", t0, t0 + 1)]
        t = t0 + 1
        for _ in range(2):   # two layers: matmul, matmul (overlapping), norm; warming beside
            ks += [("mm", t, t + 10), ("mm", t + 1, t + 12), ("warm", t, t + 30), ("norm", t + 12, t + 13)]
            t += 13
        return ks + [("head", t, t + 5)]

    path = critical_path(replay(0.0) + replay(100.0), steps=2, layers=2, beside=frozenset({"warm"}))
    assert path["kernels_per_step"] == 8 and path["span_us"] == 32
    assert path["chain_us"] == {"mm#0": 20, "head": 5, "mm#1": 4, "norm#0": 2, "norm#pre": 1}
    assert path["busy_us"]["mm#1"] == 22 and path["beside_us"] == 60
    assert path["first_replay_ends"][:2] == [("norm", 0, 1), ("mm", 1, 11)] and path["first_replay_ends"][-1] == ("head", 27, 32)
    assert path["middle_layer"] == [("mm#0", 0, 10, 10), ("mm#1", 1, 12, 2), ("norm#0", 12, 13, 1)]   # layer 1, in order
    with pytest.raises(ValueError, match="replays"):
        critical_path(replay(0.0)[:-1] + replay(100.0), steps=2, layers=2, beside=frozenset({"warm"}))
    # the first replay under the profiler waits before its first kernel (CUPTI starting up): left out by default
    first = replay(-100.0)
    slow_first = first[:1] + [(n, a + 50, b + 50) for n, a, b in first[1:]]   # 50 us before its second kernel
    assert critical_path(slow_first + replay(100.0), 2, 2, frozenset({"warm"})) == path
    assert critical_path(slow_first + replay(100.0), 2, 2, frozenset({"warm"}), skip=0)["span_us"] == 32 + 50 / 2
