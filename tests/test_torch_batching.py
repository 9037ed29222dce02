"""Continuous batching in the verifier service: the batch worker forms batches from whatever is
queued while the compute worker is busy, honours deadlines, and through the real gRPC service
several concurrent sessions on the torch backend (SmolLM2, float32 CPU) get exactly the tokens
each would get alone, in batches of more than one session."""
import queue
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'edgespec[torch]')")

import grpc  # noqa: E402

from edgespec.common import wire  # noqa: E402
from edgespec.common.sampling import SamplingParams  # noqa: E402
from edgespec.common.tree import TokenTree  # noqa: E402
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc  # noqa: E402
from edgespec.verifier.server import VerifierServer  # noqa: E402
from edgespec.verifier.sessions import FifoLock  # noqa: E402
from edgespec.verifier.torch.backend import TorchBackend  # noqa: E402
from edgespec.verifier.torch.batching import BatchWorker  # noqa: E402


def test_batch_worker_takes_everything_queued_while_busy():
    lock = FifoLock()
    seen = []

    def run(jobs):
        seen.append([j.payload for j in jobs])
        for j in jobs:
            j.result = j.payload * 10

    worker = BatchWorker(run, max_batch=4, lock=lock)
    lock.acquire()  # the compute worker is busy (a prefill, say): requests pile up
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, worker.submit(i).result)) for i in range(6)]
    for t in threads:
        t.start()
    while worker.queued < 6:
        time.sleep(0.01)
    lock.release()
    for t in threads:
        t.join(timeout=10)
    worker.close()
    assert results == {i: i * 10 for i in range(6)}
    assert sorted(len(b) for b in seen) == [2, 4] and worker.stats.largest == 4 and worker.stats.jobs == 6


def test_batch_worker_deadline_and_errors():
    lock = FifoLock()

    def run(jobs):
        raise RuntimeError("forward failed")

    worker = BatchWorker(run, lock=lock, expired=lambda job: TimeoutError("late"))
    lock.acquire()
    out = queue.Queue()
    threading.Thread(target=lambda: out.put(worker.submit("a", deadline=time.monotonic() + 0.05))).start()
    threading.Thread(target=lambda: out.put(worker.submit("b"))).start()
    while worker.queued < 2:
        time.sleep(0.01)
    time.sleep(0.1)
    lock.release()
    jobs = {j.payload: j for j in (out.get(timeout=10), out.get(timeout=10))}
    worker.close()
    assert isinstance(jobs["a"].error, TimeoutError) and worker.stats.expired == 1
    assert isinstance(jobs["b"].error, RuntimeError) and jobs["b"].batch_size == 1


def test_batch_worker_runs_a_lone_sessions_request_in_its_own_thread():
    """Alone, with nothing running and nothing queued, the submitter's thread runs the batch (no worker
    thread, no hand-off). A request arriving meanwhile waits for that batch, never runs beside it, and
    the worker thread takes it; a pending job (a sync in chunks) rides in the submitter's next batch too.
    Not alone (several sessions), every batch is the worker thread's."""
    ran_in, running, overlap = [], threading.Event(), []
    release = threading.Event()
    sessions = [1]

    def run(jobs):
        if running.is_set():
            overlap.append(jobs)
        running.set()
        ran_in.append((threading.current_thread().name, [j.payload for j in jobs]))
        if jobs[0].payload == "first":
            release.wait(10)    # hold the batch until the second request is queued
        for j in jobs:
            if j.payload == "chunked" and not getattr(j, "chunks", 0):
                j.chunks, j.pending = 1, True
            else:
                j.result = j.payload
        running.clear()

    worker = BatchWorker(run, max_batch=4, alone=lambda: sessions[0] == 1)
    assert worker.submit("alone").result == "alone" and worker._thread is None
    assert ran_in == [(threading.current_thread().name, ["alone"])]
    first = threading.Thread(target=worker.submit, args=("first",), name="submitter-1")
    first.start()
    while not running.is_set():
        time.sleep(0.005)
    second = {}
    t = threading.Thread(target=lambda: second.update(job=worker.submit("second")), name="submitter-2")
    t.start()
    while worker.queued < 1:
        time.sleep(0.005)
    release.set()
    first.join(10)
    t.join(10)
    assert second["job"].result == "second" and not overlap
    assert [r[0] for r in ran_in[1:]] == ["submitter-1", "edgespec-batcher"]
    ran_in.clear()
    job = worker.submit("chunked")
    assert job.result == "chunked" and [r[0] for r in ran_in] == [threading.current_thread().name] * 2
    sessions[0] = 2
    ran_in.clear()
    assert worker.submit("shared").result == "shared" and ran_in == [("edgespec-batcher", ["shared"])]
    worker.close()


class Client:
    """One raw gRPC session stream: Open, Sync, then greedy root-only verifies (AR decoding)."""

    def __init__(self, address: str, info) -> None:  # noqa: ANN001
        self.channel = grpc.insecure_channel(address)
        self.requests: queue.Queue = queue.Queue()
        self.replies = pb_grpc.VerifierStub(self.channel).Session(iter(self.requests.get, None))
        self.send(wire.open_message("", info.tokenizer_hash, "test"))

    def send(self, message):  # noqa: ANN001, ANN201
        self.requests.put(message)
        return next(self.replies)

    def decode(self, prompt: list[int], n: int, tree_extra: int) -> list[int]:
        self.send(wire.sync_message(prompt))
        out, last = [], prompt[-1]
        for step in range(n):
            tokens = [last] + [(last + 1 + i) % 400 for i in range(tree_extra)]  # drafts that are (almost) never right
            tree = TokenTree(tokens=np.array(tokens), parents=np.array([-1] + [0] * tree_extra))
            reply = self.send(wire.verify_message(tree, SamplingParams(), step))
            verified = wire.verified_from_proto(reply.verified)
            out += verified.tokens
            last = out[-1]
        return out[:n]

    def close(self) -> None:
        self.requests.put(None)
        self.channel.close()


@pytest.mark.parametrize("mixed", [False, True], ids=["turns", "mixed-prefill"])
def test_concurrent_sessions_are_batched_and_exact(smol_path, mixed):
    """mixed: the Syncs' prefill rides in the verify batches (the default on a GPU), so they go
    through the batch worker too."""
    torch.set_num_threads(1)
    backend = TorchBackend(smol_path, n_ctx=256, max_sessions=6)
    backend.mixed_prefill = mixed
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 5000, size=n).tolist() for n in (9, 23, 14, 31)]
    alone = []
    for p in prompts:  # each session alone, straight on the backend
        s = backend.open_session()
        s.sync(p)
        out = []
        for step in range(6):
            r = s.verify(TokenTree(tokens=np.array([p[-1] if not out else out[-1]]), parents=np.array([-1])),
                         SamplingParams(), step)
            out += r.tokens
        alone.append(out[:6])
        s.close()
    server = VerifierServer(backend, port=0, max_sessions=6, keepalive_s=0).start()
    try:
        assert server.registry.batcher is not None
        clients = [Client(server.address, backend.info) for _ in prompts]
        got = [None] * len(prompts)
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, clients[i].decode(prompts[i], 6, i)))
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for c in clients:
            c.close()
        stats = server.registry.batcher.stats
        print(f"batches {stats.batches}, jobs {stats.jobs}, sizes {dict(stats.sizes)}")
        assert got == alone
        syncs = len(prompts) if mixed else 0
        assert stats.jobs == 6 * len(prompts) + syncs and stats.largest > 1
        assert server.registry.stats.syncs == len(prompts)
    finally:
        server.stop()
        backend.close()
