"""Scheduling in the verifier service with the torch backend (tiny random float32 model, CPU):
a long Sync prefills in chunks and hands the compute worker to queued verify batches between
them, so another session keeps stepping during the prefill, with exactly the tokens it gets alone;
the queue time includes the turns; Prometheus shows batch size, step time, KV use and the turns."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'edgespec[torch]')")

from prometheus_client import generate_latest  # noqa: E402

from edgespec.common.sampling import SamplingParams  # noqa: E402
from edgespec.common.tree import TokenTree  # noqa: E402
from edgespec.verifier.metrics import VerifierMetrics  # noqa: E402
from edgespec.verifier.sessions import FifoLock, SessionRegistry  # noqa: E402
from edgespec.verifier.torch.backend import TorchBackend  # noqa: E402
from edgespec.verifier.torch.model import ModelConfig, TransformerLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

N_CTX = 1100


def test_yield_turn_lets_queued_waiters_go_first():
    lock = FifoLock()
    lock.acquire()
    assert lock.yield_turn() == 0.0, "nobody queued: the holder keeps the lock"
    order = []
    waiter = threading.Thread(target=lambda: (lock.acquire(), order.append("waiter"), lock.release()))
    waiter.start()
    while not lock.queued:
        time.sleep(0.001)
    waited = lock.yield_turn()
    order.append("holder")
    lock.release()
    waiter.join(timeout=10)
    assert order == ["waiter", "holder"] and waited > 0


def root_tree(last: int) -> TokenTree:
    return TokenTree(tokens=np.array([last]), parents=np.array([-1]))


def backend(model: TransformerLM) -> TorchBackend:
    return TorchBackend.from_model(model, n_ctx=N_CTX, max_nodes=8, max_depth=4, max_sessions=3, block_size=16,
                                   prefill_chunk=16, attention="torch")


def alone(model: TransformerLM, prompt: list[int], steps: int) -> list[int]:
    """Greedy target-only tokens of one session on a backend of its own."""
    b = backend(model)
    s = b.open_session()
    s.sync(prompt)
    out: list[int] = []
    for step in range(steps):
        out += s.verify(root_tree(s.committed[-1]), SamplingParams(), step).tokens
    b.close()
    return out


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-forward", "turns"])
def test_long_prefill_takes_turns_with_other_sessions_verifies(mixed):
    """mixed: the Sync's chunks ride in the stepping session's verify forwards (the torch backend's
    default); turns: the Sync holds the compute worker and yields it between chunks (backends that
    cannot mix, e.g. llama.cpp)."""
    model = TransformerLM.random(ModelConfig.tiny("qwen2"), dtype=torch.float32, max_positions=N_CTX, seed=11)
    rng = np.random.default_rng(2)
    short, long = rng.integers(0, 512, size=12).tolist(), rng.integers(0, 512, size=1000).tolist()
    b = backend(model)
    b.mixed_prefill = mixed
    registry = SessionRegistry(b, max_sessions=3, max_batch=8)
    metrics = VerifierMetrics(registry)
    stepper, syncer = registry.open_stream(), registry.open_stream()
    registry.sync(stepper, short, time.monotonic())
    done: list[tuple[float, list[int]]] = []
    stop = threading.Event()

    def step_until_stopped() -> None:
        step = 0
        while not stop.is_set():
            out = registry.verify_batched(stepper, time.monotonic(), 0, root_tree(stepper.kv.committed[-1]),
                                          SamplingParams(), step, 0)
            done.append((time.monotonic(), out.result.tokens))
            step += 1

    thread = threading.Thread(target=step_until_stopped)
    thread.start()
    while not done:
        time.sleep(0.001)
    started = time.monotonic()
    queue_s, compute_s = registry.sync(syncer, long, started)
    ended = time.monotonic()
    stop.set()
    thread.join(timeout=60)

    during = [t for t, _ in done if started < t < ended]
    assert len(during) >= 3, f"only {len(during)} verifies finished during a {len(long) // 16}-chunk prefill"
    if mixed:
        assert registry.stats.prefill_turns == 0 and registry.stats.prefill_chunks_mixed >= len(during) - 1
    else:
        assert registry.stats.prefill_turns >= len(during) - 1 and registry.stats.prefill_chunks_mixed == 0
    assert queue_s > 0 and compute_s > 0
    tokens = [t for _, got in done for t in got]
    assert tokens == alone(model, short, len(done)), "turns changed the stepping session's tokens"
    after = registry.verify_batched(syncer, time.monotonic(), 0, root_tree(long[-1]), SamplingParams(), 0, 0)
    assert after.result.tokens == alone(model, long, 1), "the chunked, interleaved prefill is not the prompt's"

    text = generate_latest(metrics.registry).decode()
    for name in ("edgespec_verifier_batch_size_count", "edgespec_verifier_step_seconds_count",
                 "edgespec_verifier_kv_used_blocks", "edgespec_verifier_kv_fragmentation",
                 "edgespec_verifier_prefill_turns_total", "edgespec_verifier_prefill_chunks_mixed_total"):
        assert name in text, name
    value = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert value["edgespec_verifier_batch_size_count"] == registry.batcher.stats.batches
    kv = b.engine.cache.stats()   # spares (kept for the sessions' next trees) count apart from used blocks
    assert value["edgespec_verifier_kv_used_blocks"] == kv.used > 0
    assert value["edgespec_verifier_kv_spare_blocks"] == kv.spare
    assert value["edgespec_verifier_prefill_turns_total"] == registry.stats.prefill_turns
    assert value["edgespec_verifier_prefill_chunks_mixed_total"] == registry.stats.prefill_chunks_mixed
    registry.close()
    assert b.engine.cache.pool.stats().used == 0


def test_syncs_with_no_trees_prefill_as_steps_of_prefill_rows():
    """Where prefill runs as verify-step rows (mixed_prefill, CUDA's default: replayed graphs there,
    not eager forwards), Syncs with no tree to ride beside are steps of prefill rows of their own,
    two Syncs in one step when they overlap, and so is a direct TorchSession.sync. Every context
    ends as eager prefill leaves it: the next token equals that of a session prefilled eagerly."""
    model = TransformerLM.random(ModelConfig.tiny("qwen2"), dtype=torch.float32, max_positions=N_CTX, seed=12)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (300, 170, 90)]
    b = backend(model)
    b.mixed_prefill = True
    registry = SessionRegistry(b, max_sessions=3, max_batch=8)
    streams = [registry.open_stream(), registry.open_stream()]
    steps = b.engine.stats["steps"]
    syncs = [threading.Thread(target=registry.sync, args=(st, p, time.monotonic())) for st, p in zip(streams, prompts)]
    for t in syncs:
        t.start()
    for t in syncs:
        t.join(timeout=120)
    chunks = sum(-(-(len(p) - 1) // b.alone_chunk) for p in prompts[:2])
    assert b.engine.stats["steps"] - steps >= -(-(len(prompts[0]) - 1) // b.alone_chunk), "not run as steps"
    assert b.engine.stats["steps"] - steps <= chunks
    assert registry.stats.prefill_chunks_mixed == 0 and registry.stats.prefill_turns == 0
    for stream, prompt in zip(streams, prompts):
        out = registry.verify_batched(stream, time.monotonic(), 0, root_tree(prompt[-1]), SamplingParams(), 0, 0)
        assert out.result.tokens == alone(model, prompt, 1)
    registry.close()
    direct = b.open_session()
    direct.sync(prompts[2])
    assert direct.verify(root_tree(prompts[2][-1]), SamplingParams(), 0).tokens == alone(model, prompts[2], 1)
    direct.close()
    assert b.engine.cache.pool.stats().used == 0


def test_a_sync_the_pool_cannot_hold_fails_that_session_alone():
    """Out of KV blocks in the middle of a chunked prefill: that Sync fails with OutOfBlocksError
    (RESOURCE_EXHAUSTED on the wire), its blocks go back to the pool, and another session goes on
    stepping with the tokens it gets alone."""
    from edgespec.common.wire import status_of
    from edgespec.verifier.torch.block_pool import OutOfBlocksError

    model = TransformerLM.random(ModelConfig.tiny("qwen2"), dtype=torch.float32, max_positions=N_CTX, seed=11)
    b = TorchBackend.from_model(model, n_ctx=N_CTX, max_nodes=8, max_depth=4, max_sessions=1, block_size=16,
                                prefill_chunk=16, attention="torch")
    registry = SessionRegistry(b, max_sessions=2, max_batch=8)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 512, size=600).tolist()    # the pool holds one session of n_ctx: not two of 600
    first, second = registry.open_stream(), registry.open_stream()
    registry.sync(first, prompt, time.monotonic())
    used = b.engine.cache.pool.stats().used
    with pytest.raises(OutOfBlocksError) as failed:
        registry.sync(second, rng.integers(0, 512, size=600).tolist(), time.monotonic())
    assert "KV cache full" in str(failed.value)
    assert status_of(failed.value).name == "RESOURCE_EXHAUSTED"
    assert second.kv is None and b.engine.cache.pool.stats().used == used
    tokens = []
    for step in range(3):
        out = registry.verify_batched(first, time.monotonic(), 0, root_tree(first.kv.committed[-1]),
                                      SamplingParams(), step, 0)
        tokens += out.result.tokens
    assert tokens == alone(model, prompt, 3)
    registry.close()
