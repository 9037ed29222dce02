"""Continuous batching of verify requests: whenever the compute worker is free, ONE thread takes
every queued request (up to `max_batch`) and runs them as one forward (TorchBackend.verify_many),
so 32 sessions cost about one batched step instead of 32 serial ones.

With `alone` (a callable: whether only one session can send requests now), a request that finds
nothing running and nothing queued while it is alone runs its batch in its own thread (the gRPC
handler's), not the worker's: a lone session's step then pays no hand-off to the worker and back
(two thread wake-ups: 0.09 ms a step on this 2-core VM, tools/bench_batch_worker.py). With several
sessions every batch is the worker's: a session that ran its request at once would run it alone,
one forward more for the same requests, where the worker's wake-up lets the others queue for the
same batch (where the batch's Python holds the GIL, the others would queue behind it only one by
one: batches of one for good, 622 against 1 105 requests/s at 8 sessions, tools/bench_batch_worker.py).

    worker = BatchWorker(run_batch, max_batch=32, lock=registry.compute_lock, alone=lambda: streams == 1)
    result = worker.submit(payload, received=time.monotonic(), deadline=...)   # blocks; raises on error

`run_batch(jobs)` sets `job.result` or `job.error` for each job, or `job.pending` for a job that
needs more batches (a sync prefilling chunk by chunk): it goes back to the head of the queue and
rides in the next batch too, so a long prompt shares forwards with other sessions' steps. The lock, when given, is the
service's FIFO compute lock: syncs (prefills) and batches take turns in arrival order. A job whose
deadline passed while it was queued gets `expired(job)` as its error and is not run. Each job
records its queue time and the size of the batch it ran in (reported to the edge and in metrics);
`on_batch(size, seconds)`, when set, sees every batch's size and run time (the metrics' step time).
No torch here: the service's registry uses it for any backend with `verify_many`.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Job:
    payload: Any
    received: float                       # time.monotonic() when the request arrived
    deadline: float | None = None         # monotonic time after which it must not start
    result: Any = None
    error: BaseException | None = None
    queue_s: float = 0.0
    batch_size: int = 0
    pending: bool = False                 # set by run_batch: not finished, run it in the next batch too
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class BatchStats:
    batches: int = 0
    jobs: int = 0
    expired: int = 0
    largest: int = 0
    sizes: collections.Counter = field(default_factory=collections.Counter)

    @property
    def mean_batch(self) -> float:
        return self.jobs / self.batches if self.batches else 0.0


class BatchWorker:
    def __init__(self, run_batch: Callable[[list[Job]], None], *, max_batch: int = 32, lock: Any = None,
                 expired: Callable[[Job], BaseException] | None = None, name: str = "edgespec-batcher",
                 alone: Callable[[], bool] | None = None) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.lock = lock
        self.alone = alone or (lambda: False)
        self.expired = expired or (lambda job: TimeoutError("the request's deadline passed while it was queued"))
        self.stats = BatchStats()
        self.on_batch: Callable[[int, float], None] | None = None
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False                    # a batch is running (in the worker or inline in a submitter)
        self._thread: threading.Thread | None = None
        self._name = name

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, payload: Any, received: float | None = None, deadline: float | None = None) -> Job:
        """Queue one request and wait for its batch to finish; returns the job (result or error set)."""
        job = Job(payload, time.monotonic() if received is None else received, deadline)
        with self._cond:
            if self._stop:
                raise RuntimeError("the batch worker was stopped")
            inline = not self._busy and not self._queue and self.alone()   # a lone session: run it here
            self._queue.append(job)
            if inline:
                self._busy = True
            else:
                self._wake_worker()
        if inline:
            try:
                while not job.done.is_set():   # a pending job (a sync in chunks) rides in the next batch too
                    self._run_one_batch()
            finally:
                with self._cond:
                    self._busy = False
                    if self._queue:   # what arrived meanwhile: the worker's
                        self._wake_worker()
        job.done.wait()
        return job

    def _wake_worker(self) -> None:
        """(With _cond held.) Start the worker thread on first use, or wake it."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (self._busy or not self._queue) and not self._stop:
                    self._cond.wait()
                if self._stop and not self._queue:
                    return
                self._busy = True
            try:
                self._run_one_batch()
            finally:
                with self._cond:
                    self._busy = False

    def _run_one_batch(self) -> None:
        """Take up to max_batch queued jobs (under the compute lock) and run them as one batch; the
        caller has claimed the worker (_busy). Pending jobs go back to the head of the queue."""
        if self.lock is not None:
            self.lock.acquire()
        jobs: list[Job] = []
        try:
            with self._cond:
                while self._queue and len(jobs) < self.max_batch:
                    jobs.append(self._queue.popleft())
            now = time.monotonic()
            ready = []
            for job in jobs:
                job.pending = False
                if not job.started and job.deadline is not None and now > job.deadline:
                    job.error = self.expired(job)
                    self.stats.expired += 1
                else:
                    ready.append(job)
            for job in ready:
                if not job.started:
                    job.queue_s = now - job.received
                    job.started = True
                job.batch_size = len(ready)
            if ready:
                self.stats.batches += 1
                self.stats.jobs += len(ready)
                self.stats.largest = max(self.stats.largest, len(ready))
                self.stats.sizes[len(ready)] += 1
                try:
                    self.run_batch(ready)
                except BaseException as exc:  # noqa: BLE001 - every job of the batch gets the error
                    for job in ready:
                        if job.result is None and job.error is None:
                            job.error = exc
                if self.on_batch is not None:
                    self.on_batch(len(ready), time.monotonic() - now)
        finally:
            again = [job for job in jobs if job.pending and job.error is None]
            if again:
                with self._cond:
                    self._queue.extendleft(reversed(again))   # at the head, in their order
            if self.lock is not None:
                self.lock.release()
            for job in jobs:
                if not (job.pending and job.error is None):
                    job.done.set()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
