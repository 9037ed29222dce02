"""The torch verify engine's device path against the reference on the CPU (float32, tiny random
qwen2 model): acceptance decided on the device (greedy argmax, target-sample inverse CDF) equals
common/acceptance.py on the same logits, the committed K/V after compaction equal a fresh prefill
of the committed tokens, batching several sequences equals verifying each alone, and the paged
cache keeps a shared prefix intact when the pool is exhausted. CUDA graphs and the Triton kernel
are exercised by tools/bench_gpu_verify.py on a GPU (their results go to docs/BENCHMARKS.md).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'edgespec[torch]')")

from edgespec.common.acceptance import accept_logits, target_sample_uniform  # noqa: E402
from edgespec.common.sampling import AcceptanceRule, SamplingParams, probabilities, sample_inverse_cdf  # noqa: E402
from edgespec.common.tree import TokenTree  # noqa: E402
from edgespec.verifier.torch.block_pool import OutOfBlocksError  # noqa: E402
from edgespec.verifier.torch.engine import Engine, TreeStep, bucket, sample_choice  # noqa: E402
from edgespec.verifier.torch.kv_cache import PagedKVCache  # noqa: E402
from edgespec.verifier.torch.model import ModelConfig, TransformerLM  # noqa: E402
from edgespec.verifier.torch.tree_attention import TorchPagedAttention, ancestor_mask  # noqa: E402

VOCAB = 512


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model():
    return TransformerLM.random(ModelConfig.tiny("qwen2"), dtype=torch.float32, seed=3)


def new_engine(model, blocks=96):
    return Engine(model, num_blocks=blocks, block_size=4)


def prefilled(engine, prompts):
    """A new sequence per prompt, each prefilled with it."""
    seqs = []
    for p in prompts:
        s = engine.new_sequence()
        engine.prefill(s, p)
        seqs.append(s)
    return seqs


def random_parents(n, rng):
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def grow_tree(engine, seq, rng, n, choose):
    """A tree of n nodes whose first child at each level is `choose(logits row)` of its parent (so
    the verifier accepts a path of several nodes), other nodes random. Returns (tokens, parents)."""
    tokens, parents = [int(rng.integers(0, VOCAB))], [-1]
    node = 0
    while len(tokens) < n:
        row = engine.logits(seq, tokens, parents)[node].numpy()
        want = choose(node, row)
        kids = {tokens[i] for i in range(len(tokens)) if parents[i] == node}
        if want not in kids:
            tokens.append(want)
            parents.append(node)
            node = len(tokens) - 1
        for _ in range(2):  # a couple of random siblings or cousins
            if len(tokens) >= n:
                break
            p = int(rng.integers(0, len(tokens)))
            t = int(rng.integers(0, VOCAB))
            if t not in {tokens[i] for i in range(len(tokens)) if parents[i] == p}:
                tokens.append(t)
                parents.append(p)
    return tokens, parents


def committed_kv(engine, seq):
    c = engine.cache
    tables = c.block_tables([seq])
    return torch.stack([c.gather(i, tables)[:, 0, :seq.length] for i in range(c.n_layer)])


def reference_decision(engine, seq, tokens, parents, sampling, step):
    logits = engine.logits(seq, tokens, parents).numpy()
    tree = TokenTree(tokens=np.array(tokens), parents=np.array(parents))
    acc, margins = accept_logits(tree, sampling, step, logits.argmax(-1), lambda i: logits[i])
    return acc, margins


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 63, 64, 65)] == [1, 2, 4, 4, 8, 64, 64, 128]


def test_paged_attention_equals_dense_attention(model):
    """TorchPagedAttention over scattered blocks equals plain attention over the same keys."""
    g = torch.Generator().manual_seed(0)
    B, T, Hkv, G, D, bs = 2, 5, 2, 3, 8, 4
    cache = torch.randn(2, 40 * bs, Hkv, D, generator=g)
    tables = torch.tensor([[7, 3, 11, 0], [5, 9, 0, 0]])
    ctx = torch.tensor([9, 2])
    parents = [-1, 0, 0, 1, 3]
    anc = torch.from_numpy(ancestor_mask(parents))[None].expand(B, T, T)
    q = torch.randn(B, T, Hkv * G, D, generator=g)
    out = TorchPagedAttention(tables, ctx, anc, bs, G)(q, cache)
    for b in range(B):
        slots = (tables[b][:, None] * bs + torch.arange(bs)).flatten()
        L = int(ctx[b])
        keys = torch.cat((slots[:L], slots[L:L + T]))
        k, v = cache[0][keys], cache[1][keys]
        for t in range(T):
            vis = torch.tensor([True] * L + [bool(anc[b, t, j]) for j in range(T)])
            for h in range(Hkv * G):
                s = (k[vis, h // G] @ q[b, t, h]) / D ** 0.5
                ref = torch.softmax(s, 0) @ v[vis, h // G]
                assert torch.allclose(out[b, t, h], ref, atol=1e-5)


@pytest.mark.parametrize("sampling", [
    SamplingParams(),
    SamplingParams(temperature=0.7, seed=5),
    SamplingParams(temperature=1.0, top_k=20, seed=6),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7),
], ids=["greedy", "t0.7", "t1.0-topk20", "t0.8-topp0.9"])
def test_device_acceptance_equals_reference_and_compacts_kv(model, sampling):
    """Three sequences (different contexts and tree sizes) in one forward: each decision equals
    accept_logits on that tree's own logits, and each cache then holds exactly the K/V a prefill
    of the committed tokens gives."""
    engine = new_engine(model)
    rng = np.random.default_rng(11)
    seqs, trees, prefixes = [], [], []
    step = 4

    def choose(node, row):
        if sampling.greedy:
            return int(row.argmax())
        return sample_inverse_cdf(probabilities(row, sampling), target_sample_uniform(sampling.seed, step, node))

    for n_ctx, n in ((13, 9), (30, 16), (5, 3)):
        prefix = rng.integers(0, VOCAB, size=n_ctx).tolist()
        seq = engine.new_sequence()
        engine.prefill(seq, prefix)
        seqs.append(seq)
        prefixes.append(prefix)
        trees.append(grow_tree(engine, seq, rng, n, choose))
    refs = [reference_decision(engine, s, t, p, sampling, step) for s, (t, p) in zip(seqs, trees)]
    decisions = engine.verify([TreeStep(s, t, p, sampling, step) for s, (t, p) in zip(seqs, trees)])
    for seq, prefix, (tokens, parents), (acc, margins), d in zip(seqs, prefixes, trees, refs, decisions):
        assert (d.path, d.next_token) == (acc.path, acc.next_token)
        assert np.allclose(d.margins, margins, atol=1e-4)
        committed = prefix + [tokens[0]] + [tokens[i] for i in acc.path]
        assert seq.length == len(committed)
        fresh = engine.new_sequence()
        engine.prefill(fresh, committed)
        assert torch.allclose(committed_kv(engine, seq), committed_kv(engine, fresh), atol=1e-5)
        fresh.close()
    assert sum(len(d.path) for d in decisions) >= 3, "the trees were grown to be accepted"
    for s in seqs:
        s.close()
    assert engine.cache.report().used_blocks == 0


def test_speculative_greedy_equals_target_only_greedy(model):
    """Decoding with trees that contain the target's path (and noise) gives, token for token, the
    target-only greedy sequence, with fewer steps."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, VOCAB, size=20).tolist()
    engine = new_engine(model)
    ref_seq = engine.new_sequence()
    engine.prefill(ref_seq, prompt[:-1])
    reference, last = [], prompt[-1]
    for _ in range(24):
        [d] = engine.verify([TreeStep(ref_seq, [last], [-1])])
        reference.append(d.next_token)
        last = d.next_token
    seq = engine.new_sequence()
    engine.prefill(seq, prompt[:-1])
    out, last, steps = [], prompt[-1], 0
    while len(out) < 24:
        tokens, parents = [last], [-1]
        node = 0
        for depth, t in enumerate(reference[len(out):len(out) + 4]):
            wrong = int((t + 1 + depth) % VOCAB)
            tokens += [wrong, t] if depth % 2 else [t, wrong]
            parents += [node, node]
            node = len(tokens) - (1 if depth % 2 else 2)
            if rng.random() < 0.25:  # sometimes the draft is wrong from here on
                tokens[node] = (tokens[node] + 7) % VOCAB
                break
        [d] = engine.verify([TreeStep(seq, tokens, parents)])
        out += [tokens[i] for i in d.path] + [d.next_token]
        last = out[-1]
        steps += 1
    assert out[:24] == reference
    assert steps < 24


def test_batched_verify_equals_one_at_a_time(model):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (7, 19, 33, 4)]
    trees = [(rng.integers(0, VOCAB, size=n).tolist(), random_parents(n, rng)) for n in (5, 12, 1, 30)]
    results = []
    for batched in (True, False):
        engine = new_engine(model, blocks=160)
        seqs = prefilled(engine, prompts)
        for _ in range(3):
            steps = [TreeStep(s, [int(rng.integers(0, VOCAB))] + t[1:], parents) for s, (t, parents) in zip(seqs, trees)]
            results.append(engine.verify(steps) if batched else [engine.verify([st])[0] for st in steps])
        rng = np.random.default_rng(5)  # the same trees for the second run
        prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (7, 19, 33, 4)]
        trees = [(rng.integers(0, VOCAB, size=n).tolist(), random_parents(n, rng)) for n in (5, 12, 1, 30)]
    half = len(results) // 2
    for a, b in zip(results[:half], results[half:]):
        assert [(d.path, d.next_token) for d in a] == [(d.path, d.next_token) for d in b]


def test_prefill_chunks_in_verify_steps_equal_a_separate_prefill(model):
    """Chunked prefill in the same forward as other sequences' trees (TreeStep.prefill_chunk): the
    trees' decisions equal those of steps without the riders, and the prefilled sequence's cache
    gives exactly the logits (and the same next decisions) a plain eager prefill gives."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (9, 21)]
    long = rng.integers(0, VOCAB, size=45).tolist()
    trees = [(rng.integers(0, VOCAB, size=n).tolist(), random_parents(n, rng)) for n in (6, 13)]
    probe = rng.integers(0, VOCAB, size=5).tolist()
    runs = {}
    for mixed in (True, False):
        engine = new_engine(model, blocks=160)
        seqs = prefilled(engine, prompts)
        late = engine.new_sequence()
        if not mixed:
            engine.prefill(late, long)
        decisions, done = [], 0
        for step in range(4):
            steps = [TreeStep(s, [step] + t[1:], parents) for s, (t, parents) in zip(seqs, trees)]
            if mixed and done < len(long):
                chunk = long[done:done + 16]                       # 16, 16, 13: a ragged last chunk
                steps.append(TreeStep.prefill_chunk(late, chunk))
                done += len(chunk)
            got = engine.verify(steps)
            decisions.append([(d.path, d.next_token) for d in got[:len(seqs)]])
            if mixed and len(got) > len(seqs):
                assert got[-1].path == list(range(1, len(steps[-1].tokens)))   # every prefill node accepted
        assert late.length == len(long) and len(late.blocks) == -(-len(long) // 4)
        runs[mixed] = (decisions, engine.logits(late, probe, random_parents(5, np.random.default_rng(0))).numpy(),
                       [(d.path, d.next_token) for d in engine.verify([TreeStep(late, probe, list(range(-1, 4)))])])
    assert runs[True][0] == runs[False][0]
    np.testing.assert_array_equal(runs[True][1], runs[False][1])
    assert runs[True][2] == runs[False][2]


def test_prefill_chunk_is_greedy_and_device_decided(model):
    engine = new_engine(model)
    seq = engine.new_sequence()
    bad = TreeStep(seq, [1, 2, 3], [-1, 0, 1], SamplingParams(temperature=0.7), prefill=True)
    with pytest.raises(ValueError, match="prefill chunk"):
        engine.verify([bad])


def test_device_sampling_equals_numpy_reference_on_random_logits():
    """sample_choice (float64 on the CPU) picks the same tokens as common.sampling for many rows."""
    g = torch.Generator().manual_seed(1)
    B, T, V = 4, 6, 300
    logits = torch.randn(B, T, V, generator=g) * 3
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.5, top_k=40, top_p=0.95)]
    u = torch.rand(B, T, generator=g, dtype=torch.float64)
    got = sample_choice(logits, torch.tensor([p.temperature for p in params], dtype=torch.float64),
                        torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params],
                                                                             dtype=torch.float64),
                        u, True, torch.float64)
    for b, p in enumerate(params):
        for t in range(T):
            want = sample_inverse_cdf(probabilities(logits[b, t].numpy(), p), float(u[b, t]))
            assert int(got[b, t]) == want


def test_rejection_rule_is_decided_on_the_host(model):
    """A step under the rejection rule (q on the wire) runs the same forward, is decided by its
    host rule on the logits rows, and compacts the path that rule chose."""
    engine = new_engine(model)
    rng = np.random.default_rng(8)
    prefix = rng.integers(0, VOCAB, size=10).tolist()
    seq = engine.new_sequence()
    engine.prefill(seq, prefix)
    tokens, parents = grow_tree(engine, seq, rng, 6, lambda node, row: int(row.argmax()))
    seen = {}

    def rule(argmax, row):
        from edgespec.common.acceptance import accept_greedy
        seen["rows"] = row(0).shape
        return accept_greedy(TokenTree(tokens=np.array(tokens), parents=np.array(parents)), argmax)

    sampling = SamplingParams(temperature=1.0, rule=AcceptanceRule.REJECTION)
    [d] = engine.verify([TreeStep(seq, tokens, parents, sampling, 0, host_rule=rule)])
    assert seen["rows"] == (VOCAB,) and engine.stats["host_decided"] == 1
    assert len(d.path) >= 1
    fresh = engine.new_sequence()
    engine.prefill(fresh, prefix + [tokens[0]] + [tokens[i] for i in d.path])
    assert torch.allclose(committed_kv(engine, seq), committed_kv(engine, fresh), atol=1e-5)
    with pytest.raises(ValueError, match="host_rule"):
        engine.verify([TreeStep(seq, [d.next_token], [-1], sampling)])


def test_truncate_into_shared_block_with_exhausted_pool_changes_nothing():
    """Truncating into a shared block needs a private copy; with no free block the call fails
    BEFORE anything changes, and the other owner's prefix is never written."""
    cache = PagedKVCache(2, 2, 4, num_blocks=4, block_size=4)   # 3 usable blocks
    a, b = cache.new_sequence(), cache.new_sequence()
    data = torch.randn(2, 2, 8, 2, 4)
    a.append(data)                       # blocks 1, 2
    b.share_prefix(a, 8)                 # shares both
    spare = cache.new_sequence()
    spare.append(torch.randn(2, 2, 1, 2, 4))  # takes the last free block
    assert cache.pool.num_free == 0
    before = (list(b.blocks), b.length)
    with pytest.raises(OutOfBlocksError):
        b.truncate(6)                    # into shared block 2: needs a copy, none free
    assert (list(b.blocks), b.length) == before
    spare.close()
    b.truncate(6)                        # now the copy is allocated first, then the tail released
    assert b.blocks[1] != a.blocks[1] and cache.pool.refcount[a.blocks[1]] == 1
    b.append(torch.zeros(2, 2, 2, 2, 4))
    tables = cache.block_tables([a])
    assert torch.equal(torch.stack([cache.gather(i, tables)[:, 0] for i in range(2)]), data)
    a.close(), b.close()
    assert cache.pool.num_free == 3


def test_reserve_and_trim():
    cache = PagedKVCache(1, 1, 2, num_blocks=10, block_size=4)
    s = cache.new_sequence()
    s.append(torch.zeros(1, 2, 5, 1, 2))
    s.reserve(5 + 9)
    assert len(s.blocks) == 4 and len(s) == 5
    s.trim()
    assert len(s.blocks) == 2
    with pytest.raises(OutOfBlocksError):
        s.reserve(100)
    assert len(s.blocks) == 2
    s.close()


def test_a_step_that_fails_after_reserving_gives_the_blocks_back_and_commits_nothing(model, monkeypatch):
    """A forward that raises (a CUDA error, out of memory) between verify's reservation and its commit: every
    sequence of the step keeps its length and its blocks as before, no block stays reserved, and the next step
    of the same sequences runs as if the failed one never happened."""
    engine = new_engine(model)
    seqs = prefilled(engine, [[1, 2, 3, 4, 5], [9, 8, 7]])
    free, blocks = engine.cache.pool.num_free, [list(s.blocks) for s in seqs]
    steps = [TreeStep(s, list(range(20, 40)), [-1] + list(range(19))) for s in seqs]   # 20 nodes: new blocks

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine, "_run", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.verify(steps)
    assert [len(s) for s in seqs] == [5, 3] and [list(s.blocks) for s in seqs] == blocks
    assert engine.cache.pool.num_free == free
    monkeypatch.undo()
    want = new_engine(model)
    fresh = prefilled(want, [[1, 2, 3, 4, 5], [9, 8, 7]])
    assert engine.verify(steps) == want.verify([TreeStep(s, st.tokens, st.parents) for s, st in zip(fresh, steps)])


def test_trim_keeps_the_spares_a_next_tree_needs_and_the_next_reserve_takes_them():
    """trim(spare_positions) keeps the reserved blocks that many more positions need, at the end of
    the table; the next reserve then allocates nothing. Spares count as neither used nor free."""
    cache = PagedKVCache(1, 1, 2, num_blocks=10, block_size=4)   # 9 usable
    s = cache.new_sequence()
    s.append(torch.zeros(1, 2, 5, 1, 2))        # 2 blocks
    s.reserve(5 + 9)                             # a tree of 9 nodes: 4 blocks
    tree_blocks = s.blocks
    assert s.num_spare == 0, "a step in flight holds no spares"
    s.append(torch.ones(1, 2, 2, 1, 2))         # its accepted path: 7 positions
    s.trim(9)
    assert s.blocks == tree_blocks and s.num_spare == 2 and cache.num_spare == 2
    stats, report = cache.stats(), cache.report()
    assert (stats.used, stats.spare, stats.free, stats.num_blocks) == (2, 2, 5, 9)
    assert (report.used_blocks, report.spare_blocks, report.free_blocks) == (2, 2, 5)
    assert cache.pool.stats().used == 4, "the pool alone cannot tell spares from used blocks"
    s.reserve(7 + 9)                             # the next tree of 9 nodes: nothing allocated
    assert s.blocks == tree_blocks and cache.pool.num_free == 5
    s.trim(2)                                    # a smaller next tree: 7 + 2 positions, 3 blocks
    assert s.blocks == tree_blocks[:3] and cache.pool.num_free == 6
    s.trim()
    assert s.blocks == tree_blocks[:2] and s.num_spare == 0 and cache.pool.num_free == 7
    s.reserve(7 + 20)
    s.trim(20)
    assert s.num_spare == 5
    s.close()
    assert cache.pool.num_free == 9 and cache.num_spare == 0


def test_a_short_pool_reclaims_other_sequences_spares_but_never_a_step_in_flight():
    """An allocation that finds too few free blocks takes other sequences' spares (their context
    stays intact) before it fails; blocks reserved for a step in flight are not spares. With neither
    free blocks nor spares, OutOfBlocksError fails that sequence alone and changes nothing."""
    cache = PagedKVCache(1, 1, 2, num_blocks=9, block_size=4)    # 8 usable
    a, b = cache.new_sequence(), cache.new_sequence()
    data = torch.randn(1, 2, 5, 1, 2)
    a.append(data)                        # 2 blocks
    a.reserve(5 + 16)
    a.trim(16)                            # 6 blocks, 4 of them spare: 2 free
    assert a.num_spare == 4 and cache.pool.num_free == 2
    b.append(torch.randn(1, 2, 12, 1, 2))    # 3 blocks: the 2 free ones and one of a's spares
    assert a.num_spare == 3 and cache.pool.num_free == 0
    a.reserve(5 + 12)                     # a step of a: its 5 blocks are in flight, none spare
    assert a.num_spare == 0 and cache.num_spare == 0
    held = (b.blocks, len(b), a.blocks, len(a))
    with pytest.raises(OutOfBlocksError, match="KV cache full"):
        b.append(torch.randn(1, 2, 4, 1, 2))
    assert (b.blocks, len(b), a.blocks, len(a)) == held
    a.trim(12)                            # the step is over: a's 3 blocks past its context are spares again
    b.append(torch.randn(1, 2, 4, 1, 2))
    assert a.num_spare == 2 and len(b) == 16 and cache.pool.num_free == 0
    tables = cache.block_tables([a])
    assert torch.equal(cache.gather(0, tables)[:, 0, :5][None], data)
    a.close(), b.close()
    assert cache.pool.num_free == 8


def test_verify_steps_reuse_their_spares_and_decide_as_without_them(model):
    """Each verify step keeps the blocks a next tree of its size needs: later steps allocate only
    for the context's growth, and decide exactly as steps whose trim keeps no spares (the forward
    rewrites every tree slot before reading it, so stale spare contents never matter)."""
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, VOCAB, size=30).tolist()
    runs = []
    for keep_spares in (True, False):
        engine = new_engine(model)
        seq = prefilled(engine, [prompt])[0]
        if not keep_spares:
            seq.trim = lambda spare_positions=0, trim=seq.trim: trim()
        pool = engine.cache.pool
        allocated = []
        pool.allocate = lambda n, allocate=pool.allocate: allocated.append(n) or allocate(n)
        tree_rng = np.random.default_rng(2)
        root, decisions = prompt[-1], []
        for step in range(8):
            tokens = [root] + tree_rng.integers(0, VOCAB, size=11).tolist()
            [d] = engine.verify([TreeStep(seq, tokens, random_parents(12, tree_rng))])
            decisions.append(d)
            root = d.next_token
            if step == 0:
                first, length = sum(allocated), len(seq)
        runs.append((decisions, sum(allocated) - first, length, len(seq), seq.num_spare))
    (with_spares, grew, start, end, spare), (without, churned, *_) = runs
    assert with_spares == without
    assert spare > 0 and grew == -(-(end + 12) // 4) - -(-(start + 12) // 4), "only the growth was allocated"
    assert churned > grew


def test_exhausted_pool_fails_only_that_request(model):
    """In a batch, a tree the pool cannot hold gets OutOfBlocksError (RESOURCE_EXHAUSTED on the
    wire); the other requests are verified, and the failed session can go on with a smaller tree."""
    from edgespec.verifier.torch.backend import TorchBackend

    backend = TorchBackend.from_model(model, n_ctx=96, max_nodes=32, max_depth=16, max_sessions=2, block_size=16)
    rng = np.random.default_rng(4)
    sessions = []
    for _ in range(3):  # one more session than the pool was sized for
        s = backend.open_session()
        s.sync(rng.integers(0, VOCAB, size=75).tolist())
        sessions.append(s)
    free = backend.engine.cache.pool.num_free
    trees = [TokenTree(tokens=np.array([s.committed[-1]] + list(range(1, 31))), parents=np.array([-1] + [0] * 30))
             for s in sessions]
    results = backend.verify_many([(s, t, SamplingParams(), 0) for s, t in zip(sessions, trees)])
    assert 4 <= free < 6, "two trees fit, three do not"
    assert [type(r).__name__ for r in results] == ["VerifyResult", "VerifyResult", "OutOfBlocksError"]
    last = sessions[2]
    n = len(last.committed)
    r = last.verify(TokenTree(tokens=np.array([last.committed[-1]]), parents=np.array([-1])), SamplingParams(), 1)
    assert len(last.committed) == n + len(r.tokens)
    # The two stepped sessions keep their trees' unused blocks as spares; the third one's tree of the
    # same size now takes some of them instead of failing on the free blocks alone.
    lent = sum(s.seq.num_spare for s in sessions[:2])
    assert lent == backend.kv_usage().spare_blocks > 0 and backend.engine.cache.pool.num_free < 2
    tree = TokenTree(tokens=np.array([last.committed[-1]] + list(range(1, 31))), parents=np.array([-1] + [0] * 30))
    last.verify(tree, SamplingParams(), 2)
    assert sum(s.seq.num_spare for s in sessions[:2]) < lent
    for s in sessions:
        s.close()
    assert backend.engine.cache.report().used_blocks == 0


def test_paged_cache_random_operations_keep_every_sequence_intact():
    """Property test over random operation sequences (append, share a prefix, truncate, reserve and
    trim, close): every sequence always reads back exactly what was written for it, refcounts equal
    the number of owners, and no block is both free and owned."""
    rng = np.random.default_rng(12)
    for trial in range(30):
        bs = int(rng.integers(1, 5))
        cache = PagedKVCache(1, 1, 2, num_blocks=int(rng.integers(8, 30)), block_size=bs)
        seqs, shadow = [], []
        for _ in range(60):
            op = rng.integers(0, 6)
            try:
                if op == 0 or not seqs:
                    seqs.append(cache.new_sequence())
                    shadow.append(torch.zeros(1, 2, 0, 1, 2))
                    continue
                i = int(rng.integers(0, len(seqs)))
                s = seqs[i]
                if op == 1:
                    rows = torch.randn(1, 2, int(rng.integers(1, 7)), 1, 2)
                    s.append(rows)
                    shadow[i] = torch.cat((shadow[i], rows), dim=2)
                elif op == 2:
                    n = int(rng.integers(0, len(s) + 1))
                    s.truncate(n)
                    shadow[i] = shadow[i][:, :, :n]
                elif op == 3 and len(seqs) > 1:
                    j = int(rng.integers(0, len(seqs)))
                    if j != i:
                        s.truncate(0)
                        got = s.share_prefix(seqs[j], int(rng.integers(0, len(seqs[j]) + 1)))
                        shadow[i] = shadow[j][:, :, :got]
                elif op == 4:
                    s.reserve(len(s) + int(rng.integers(0, 9)))
                    s.trim()
                elif op == 5:
                    s.close()
                    del seqs[i], shadow[i]
            except OutOfBlocksError:
                pass  # allowed; the sequence must be unchanged (checked below)
            owners = {}
            for s, want in zip(seqs, shadow):
                assert len(s) == want.shape[2]
                if len(s):
                    tables = cache.block_tables([s])
                    assert torch.equal(cache.gather(0, tables)[:, 0, :len(s)][None], want), f"trial {trial}"
                for b in s.blocks:
                    owners[b] = owners.get(b, 0) + 1
            for b in range(1, cache.pool.num_blocks):
                assert cache.pool.refcount[b] == owners.get(b, 0)
            assert not set(cache.pool._free) & set(owners)
            assert cache.pool.num_free + len(owners) == cache.pool.num_blocks - 1
        report = cache.report()
        assert 0.0 <= report.fragmentation <= 1.0


def test_warmup_steps_every_bucket_and_gives_its_blocks_back():
    """Engine.warmup runs one step per (B, T) bucket and decision mode (greedy, sampled, sampled with
    top-k) on throwaway sequences (on CUDA each is captured then, not while serving); nothing of it
    stays in the cache, and steps after it decide as an engine that never warmed up."""
    model = TransformerLM.random(ModelConfig.tiny(), seed=3)
    warm, cold = (Engine(model, num_blocks=64, block_size=4) for _ in range(2))
    free = warm.cache.pool.num_free
    assert warm.warmup([1, 2, 3], [1, 5]) == 6   # batches 1, 2, 4 x trees 1, 8
    assert warm.stats["steps"] == 6 * 3 and warm.cache.pool.num_free == free
    assert warm.warmup([1], [1], sampled=False) == 1 and warm.stats["steps"] == 19
    out = []
    for engine in (warm, cold):
        seq = engine.new_sequence()
        engine.prefill(seq, list(range(1, 12)))
        out.append(engine.verify([TreeStep(seq, [11, 12, 13], [-1, 0, 1])])[0])
        out.append(engine.verify([TreeStep(seq, [5, 6, 7], [-1, 0, 0], SamplingParams(temperature=0.8, seed=7),
                                           step=3)])[0])
    assert out[:2] == out[2:]
