"""Property tests (hypothesis) of the paged KV cache's bookkeeping and of compaction.

- Random programs of new / append / share_prefix / truncate / a step (reserve, accept some of it,
  trim keeping spares) / close / compact on PagedKVCache: after every operation each sequence reads
  back exactly the K/V written for it (so copy-on-write never lets a truncated-then-appended
  sequence write into a prefix it shares), refcounts equal the number of owning sequences, no block
  is both free and owned, none is lost (free + used + spare = all), the free bitmap equals the free
  list, an allocation fails only when the free blocks and the other sequences' spares together are
  too few, and after a compaction F = 0 and no spares are left.
- The engine with a tiny random float32 model: sessions with shared prefixes, holes left by closed
  ones and spare blocks give bit-identical logits before and after compaction.
- The torch backend: with compaction triggered between steps (threshold 0), every session's greedy
  speculative tokens and margins equal those of a backend that never compacts.

CI runs a small number of examples; EDGESPEC_PROP_EXAMPLES=500 for a longer run.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'edgespec[torch]')")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

from edgespec.common.sampling import SamplingParams  # noqa: E402
from edgespec.common.tree import TokenTree  # noqa: E402
from edgespec.verifier.torch.backend import TorchBackend  # noqa: E402
from edgespec.verifier.torch.block_pool import NULL_BLOCK, BlockPool, OutOfBlocksError  # noqa: E402
from edgespec.verifier.torch.engine import Engine  # noqa: E402
from edgespec.verifier.torch.kv_cache import PagedKVCache  # noqa: E402
from edgespec.verifier.torch.model import ModelConfig, TransformerLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

EXAMPLES = int(os.environ.get("EDGESPEC_PROP_EXAMPLES", 40))
PROPS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LAYERS, HEADS, DIM = 2, 1, 2


def rows(n: int, tag: float) -> torch.Tensor:
    """K/V rows that say who wrote them: distinct values per call, so any mix-up shows."""
    return tag + torch.arange(LAYERS * 2 * n * HEADS * DIM, dtype=torch.float32).reshape(LAYERS, 2, n, HEADS, DIM)


def read_back(cache: PagedKVCache, seq) -> torch.Tensor:  # noqa: ANN001
    tables = cache.block_tables([seq])
    return torch.stack([cache.gather(i, tables)[:, 0, :len(seq)] for i in range(cache.n_layer)])


class CacheProgram(RuleBasedStateMachine):
    """A model of the cache: each open sequence's expected K/V (its shadow)."""

    @initialize(block_size=st.integers(1, 4), blocks=st.integers(4, 24), reserve=st.integers(1, 5))
    def start(self, block_size: int, blocks: int, reserve: int) -> None:
        self.cache = PagedKVCache(LAYERS, HEADS, DIM, num_blocks=blocks, block_size=block_size,
                                  compact_reserve=reserve)
        self.seqs: list = []
        self.shadow: list[torch.Tensor] = []
        self.writes = 0

    def _pick(self, i: int) -> int:
        return i % len(self.seqs)

    @rule()
    def new(self) -> None:
        self.seqs.append(self.cache.new_sequence())
        self.shadow.append(torch.zeros(LAYERS, 2, 0, HEADS, DIM))

    def _available(self, seq) -> int:  # noqa: ANN001
        """Blocks an allocation for seq may get: the free ones and the other sequences' spares."""
        return self.cache.pool.num_free + sum(s.num_spare for s in self.seqs if s is not seq)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), n=st.integers(1, 7))
    def append(self, i: int, n: int) -> None:
        i = self._pick(i)
        self.writes += 1
        data = rows(n, 1000.0 * self.writes)
        s = self.seqs[i]
        need = self.cache.blocks_for(len(s) + n) - len(s.blocks)
        available = self._available(s)
        try:
            s.append(data)
        except OutOfBlocksError:
            assert need > available, "spares made an allocation fail"
            return
        self.shadow[i] = torch.cat((self.shadow[i], data), dim=2)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), keep=st.floats(0, 1))
    def truncate(self, i: int, keep: float) -> None:
        i = self._pick(i)
        n = int(keep * len(self.seqs[i]))
        try:
            self.seqs[i].truncate(n)
        except OutOfBlocksError:
            return  # copy-on-write found no block: nothing may have changed (the invariants check it)
        self.shadow[i] = self.shadow[i][:, :, :n]

    @precondition(lambda self: len(self.seqs) > 1)
    @rule(i=st.integers(0, 99), j=st.integers(0, 99), part=st.floats(0, 1))
    def share_prefix(self, i: int, j: int, part: float) -> None:
        i, j = self._pick(i), self._pick(j)
        if i == j:
            return
        self.seqs[i].truncate(0)
        self.shadow[i] = self.shadow[i][:, :, :0]
        got = self.seqs[i].share_prefix(self.seqs[j], int(part * len(self.seqs[j])))
        self.shadow[i] = self.shadow[j][:, :, :got]

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), extra=st.integers(0, 9), accept=st.floats(0, 1), spare=st.integers(0, 9))
    def step(self, i: int, extra: int, accept: float, spare: int) -> None:
        """As a verify step: reserve a tree's positions, fill some (the accepted path), trim keeping
        the blocks `spare` more positions need."""
        i = self._pick(i)
        s = self.seqs[i]
        need = self.cache.blocks_for(len(s) + extra) - len(s.blocks)
        available = self._available(s)
        try:
            s.reserve(len(s) + extra)
        except OutOfBlocksError:
            assert need > available, "spares made an allocation fail"
            return
        self.writes += 1
        data = rows(int(accept * extra), 1000.0 * self.writes)
        free = self.cache.pool.num_free
        s.append(data)                   # inside the reserved blocks: allocates nothing
        assert self.cache.pool.num_free == free
        self.shadow[i] = torch.cat((self.shadow[i], data), dim=2)
        held = len(s.blocks)
        s.trim(spare)
        assert len(s.blocks) == min(held, self.cache.blocks_for(len(s) + spare)), "spares: bounded, and kept"

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def close(self, i: int) -> None:
        i = self._pick(i)
        self.seqs.pop(i).close()
        self.shadow.pop(i)

    @rule()
    def compact(self) -> None:
        free_before = self.cache.pool.num_free + self.cache.num_spare   # compact frees the spares first
        done = self.cache.compact()
        pool = self.cache.pool
        assert done.fragmentation_after == 0.0 and pool.fragmentation() == 0.0
        assert done.moved <= free_before
        used = pool.num_blocks - 1 - pool.num_free
        assert all(pool.refcount[b] > 0 for b in range(1, used + 1)), "used blocks are ids 1..U"
        assert not pool.num_free or pool._free[-1] == used + 1, "the next block handed out is the lowest free one"
        assert self.cache.num_spare == 0, "compaction frees the spares"

    @invariant()
    def contents_are_what_was_written(self) -> None:
        for s, want in zip(self.seqs, self.shadow):
            assert len(s) == want.shape[2]
            assert len(s.blocks) == self.cache.blocks_for(len(s)) + s.num_spare and s.num_spare >= 0
            if len(s):
                assert torch.equal(read_back(self.cache, s), want)

    @invariant()
    def refcounts_count_owners(self) -> None:
        pool = self.cache.pool
        owners: dict[int, int] = {}
        for s in self.seqs:
            for b in s.blocks:
                owners[b] = owners.get(b, 0) + 1
        assert NULL_BLOCK not in owners
        assert all(pool.refcount[b] == owners.get(b, 0) for b in range(pool.num_blocks))
        free = pool._free
        assert len(set(free)) == len(free), "a block is on the free list twice (double free)"
        assert not set(free) & set(owners), "a block is both free and owned"
        assert len(free) + len(owners) == pool.num_blocks - 1, "a block was lost"
        assert set(np.flatnonzero(pool._is_free).tolist()) == set(free)
        spares = [b for s in self.seqs for b in s.blocks[self.cache.blocks_for(len(s)):]]
        assert all(pool.refcount[b] == 1 for b in spares), "a spare block is shared"
        report = self.cache.report()
        assert 0.0 <= report.fragmentation <= 1.0 and report.shared_blocks == sum(v > 1 for v in owners.values())
        assert report.spare_blocks == len(spares) == self.cache.stats().spare
        assert report.used_blocks == len(owners) - len(spares)
        assert report.used_blocks + report.free_blocks + report.spare_blocks == report.num_blocks


CacheProgram.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestCacheProgram = CacheProgram.TestCase


@PROPS
@given(free=st.lists(st.booleans(), min_size=1, max_size=40))
def test_fragmentation_index_and_compaction_plan(free: list[bool]) -> None:
    """F from the pool's bitmap equals the definition computed by hand, and the plan's moves make
    the free blocks the top run."""
    pool = BlockPool(len(free) + 1)
    taken = pool.allocate(len(free))
    pool.release([b for b, f in zip(taken, free) if f])
    ids = sorted(b for b, f in zip(taken, free) if f)
    best = run = 0
    for k, b in enumerate(ids):
        run = run + 1 if k and b == ids[k - 1] + 1 else 1
        best = max(best, run)
    assert pool.largest_free_run() == best
    assert pool.fragmentation() == (1 - best / len(ids) if ids else 0.0)
    pool.move(pool.compaction_moves())
    used = len(free) - len(ids)
    assert sorted(pool._free) == list(range(used + 1, len(free) + 1))
    assert all(pool.refcount[b] == 1 for b in range(1, used + 1))


def test_move_refuses_bad_moves() -> None:
    pool = BlockPool(5)
    a, b, _c, _d = pool.allocate(4)
    pool.release([b])
    with pytest.raises(ValueError):
        pool.move([(a, _c)])            # into a used block
    with pytest.raises(ValueError):
        pool.move([(b, a)])             # a free block cannot move
    assert pool.refcount == [0, 1, 0, 1, 1]


# -- the engine: logits unchanged ----------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> TransformerLM:
    return TransformerLM.random(ModelConfig.tiny("qwen2"), dtype=torch.float32, seed=5)


@settings(max_examples=max(4, EXAMPLES // 4), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_compaction_leaves_every_sessions_logits_unchanged(model: TransformerLM, data: st.DataObject) -> None:
    """Sessions prefill prompts (some adopt another's prefix and go on privately, some close and
    leave holes, some keep spare blocks past their context); each session's logits for a probe tree
    are bit-identical after compaction."""
    engine = Engine(model, num_blocks=64, block_size=4, prefill_chunk=8, attention="torch")
    vocab = model.config.vocab_size
    seqs, probes = [], []
    for k in range(data.draw(st.integers(2, 6), label="sessions")):
        seq = engine.new_sequence()
        if seqs and data.draw(st.booleans(), label=f"share {k}"):
            donor = data.draw(st.sampled_from(seqs), label=f"donor {k}")
            seq.share_prefix(donor, data.draw(st.integers(0, len(donor)), label=f"shared {k}"))
        n = data.draw(st.integers(1, 20), label=f"prompt {k}")
        engine.prefill(seq, data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)))
        seqs.append(seq)
    for k in data.draw(st.lists(st.integers(0, len(seqs) - 1), unique=True, max_size=len(seqs) - 1),
                       label="closed"):
        seqs[k].close()
    seqs = [s for s in seqs if not s.closed]
    for _ in seqs:
        n = data.draw(st.integers(1, 6), label="probe size")
        probes.append((data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)),
                       [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]))
    before = [engine.logits(s, *p) for s, p in zip(seqs, probes)]   # logits() trims: spares come after
    for s in seqs:
        s.reserve(len(s) + data.draw(st.integers(0, 12), label="reserved"))
        s.trim(data.draw(st.integers(0, 12), label="spare positions"))
    tables = [s.blocks[:engine.cache.blocks_for(len(s))] for s in seqs]
    done = engine.cache.compact()
    after = [engine.logits(s, *p) for s, p in zip(seqs, probes)]
    for b, a in zip(before, after):
        assert torch.equal(b, a)
    assert engine.cache.pool.fragmentation() == 0.0 and engine.cache.num_spare == 0
    changed = {x for t, s in zip(tables, seqs) for x, y in zip(t, s.blocks) if x != y}
    assert len(changed) == done.moved, "each moved block (shared or not) changed in every table holding it"


def greedy_run(backend: TorchBackend, prompts: list[list[int]], close_after: set[int], steps: int,
               rng_seed: int) -> list[list[tuple]]:
    """Each session syncs its prompt and verifies `steps` random 6-node trees (greedy); the sessions
    in close_after close after step 0, leaving holes. Returns each session's (tokens, margins)."""
    rng = np.random.default_rng(rng_seed)
    sessions = [backend.open_session() for _ in prompts]
    for s, p in zip(sessions, prompts):
        s.sync(p)
    out: list[list[tuple]] = [[] for _ in prompts]
    live = dict(enumerate(sessions))
    for step in range(steps):
        requests = []
        for i, s in live.items():
            tokens = [s.committed[-1]] + rng.integers(0, backend.info.vocab_size, size=5).tolist()
            tree = TokenTree(tokens=np.array(tokens), parents=np.array([-1, 0, 0, 1, 1, 2]))
            requests.append((s, tree, SamplingParams(), step))
        for (s, *_), r, i in zip(requests, backend.verify_many(requests), list(live)):
            out[i].append((tuple(r.tokens), tuple(r.margins)))
        if step == 0:
            for i in close_after:
                live.pop(i).close()
    for s in live.values():
        s.close()
    return out


def test_backend_compacts_between_steps_and_changes_no_output(model: TransformerLM) -> None:
    """Threshold 0 compacts after every step that left the free blocks in pieces; the tokens and
    margins of every session equal a backend that never compacts, and nothing leaks."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (37, 5, 52, 18, 29)]
    kw = dict(n_ctx=128, max_nodes=8, max_depth=4, max_sessions=5, block_size=4, attention="torch")
    plain = TorchBackend.from_model(model, compact_threshold=1.0, **kw)
    compacting = TorchBackend.from_model(model, compact_threshold=0.0, compact_check_every=1, **kw)
    want = greedy_run(plain, prompts, {1, 3}, 6, 0)
    got = greedy_run(compacting, prompts, {1, 3}, 6, 0)
    assert got == want
    assert plain.engine.stats["compactions"] == 0
    usage = compacting.kv_usage()
    assert usage.compactions > 0 and usage.blocks_moved > 0 and usage.used_blocks == 0
    assert compacting.engine.cache.pool.num_free == usage.blocks


def test_between_steps_looks_at_f_every_n_calls_and_compacts_over_the_threshold(model: TransformerLM) -> None:
    engine = Engine(model, num_blocks=16, block_size=4, attention="torch", compact_threshold=0.3,
                    compact_check_every=3)
    seqs = [engine.new_sequence() for _ in range(5)]
    for s in seqs:
        engine.prefill(s, [1, 2, 3, 4, 5])           # two blocks each: ids 1..10
    seqs[0].close(), seqs[2].close()                  # holes at 1, 2 and 5, 6; free 11..15 above
    assert engine.cache.pool.fragmentation() > 0.3
    assert engine.between_steps() is None and engine.between_steps() is None
    done = engine.between_steps()
    assert done is not None and done.moved == 4 and engine.stats["compactions"] == 1
    assert engine.cache.pool.fragmentation() == 0.0
    seqs[4].truncate(4)                               # its second block was the top used one: F stays 0
    for _ in range(3):
        assert engine.between_steps() is None
