"""Session registry of the verifier service: streams, KV slots, LRU eviction, the compute worker.

- Every `Session` stream is a `ServerSession`. At most `max_streams` are open at once.
- A session that has synced holds a KV slot (a `BackendSession`: its own KV cache; the model is
  shared). At most `max_live` slots exist: `max_sessions`, lowered to what `kv_budget_bytes` allows.
- A session that needs a slot when all are taken evicts the least recently used session that has
  no request in flight; the evicted session keeps its stream, and its next Verify is answered
  `ResyncRequired(EVICTED)` (the edge re-sends Sync and retries). If every other slot belongs to a
  session with a request in flight, the request fails with RESOURCE_EXHAUSTED (VerifierBusyError).
- Sessions idle longer than `idle_timeout_s` lose their slot the same way (reason IDLE_TIMEOUT).
- Per-client limits (a client = the peer's address without its port): at most
  `max_streams_per_client` open streams, and `client_rate` Sync/Verify requests per second (a token
  bucket holding up to one second's worth); past either, RESOURCE_EXHAUSTED (VerifierBusyError).
- Prefix cache: when a stream ends, its KV state stays as a *retained* slot (they count towards
  `max_live` and are the first to go when a slot is needed). A session's first Sync adopts the
  retained slot sharing the longest prefix with its context, so an edge that re-attaches after a
  broken link, or a new conversation with the same system prompt, prefills only what differs.
  The edge still sends its whole context; only computation is saved.
- All model work (sync, verify, allocating and freeing KV) is serialised through one FIFO lock:
  the compute worker. The time a request waits for it is its queue time.
- Chunked prefill: a Sync prefills in chunks (`BackendSession.sync_chunks`) and between chunks
  hands the compute worker to whatever queued meanwhile (`FifoLock.yield_turn`): verify batches of
  other sessions and other prefills' chunks take turns with it, so one long prompt delays every
  other session's step by one chunk instead of the whole prompt.
- Batching: a backend with `verify_many` (the torch backend) gets a batch worker
  (verifier/torch/batching.py): Verify requests queue, and whenever the compute worker is free one
  thread takes all queued ones (up to `max_batch`) and verifies them in one forward. Where the
  backend has `mixed_prefill` (the torch backend), Syncs queue there too and prefill in the
  same forwards, one chunk per batch (`verify_many(..., prefills=...)`), instead of taking turns.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Iterator

from edgespec.common.tokens import common_prefix_length
from edgespec.common.wire import DeadlineExceededError, VerifierBusyError
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.verifier.backends import Backend, BackendSession, PrefillProgress
from edgespec.verifier.torch.batching import BatchWorker, Job

log = logging.getLogger("edgespec.verifier")

Reason = pb.ResyncRequired.Reason


class FifoLock:
    """A mutex granted in arrival order, with a timeout that leaves the queue cleanly."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiters: collections.deque[threading.Event] = collections.deque()

    def acquire(self, timeout: float | None = None) -> bool:
        with self._mutex:
            if not self._held and not self._waiters:
                self._held = True
                return True
            ticket = threading.Event()
            self._waiters.append(ticket)
        if ticket.wait(None if timeout is None else max(0.0, timeout)):
            return True  # ownership was handed to us by release()
        with self._mutex:
            if ticket.is_set():  # handed over between the timeout and now: we own it after all
                return True
            self._waiters.remove(ticket)
            return False

    def release(self) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().set()  # hand over directly: nobody can overtake
            else:
                self._held = False

    def yield_turn(self) -> float:
        """Held by the caller: let everyone queued now go first, then take the lock back (FIFO turns
        for long work). Returns the seconds spent waiting (0 when nobody was queued)."""
        with self._mutex:
            if not self._waiters:
                return 0.0
        started = time.monotonic()
        self.release()
        self.acquire()
        return time.monotonic() - started

    @property
    def queued(self) -> int:
        return len(self._waiters)


@dataclass
class ServerSession:
    id: str
    peer: str = ""
    opened: bool = False
    synced: bool = False                   # has adopted a context at least once
    kv: BackendSession | None = None       # None: no slot (never synced, evicted or idle)
    lost_reason: int = Reason.REASON_UNSPECIFIED
    last_used: float = field(default_factory=time.monotonic)
    in_flight: int = 0                     # requests queued for or inside the compute worker
    client_name: str = ""
    client: str = ""                       # the peer's address without its port (per-client limits)


def client_of(peer: str) -> str:
    """The client a gRPC peer string belongs to: "ipv4:10.0.0.5:51234" -> "10.0.0.5",
    "ipv6:%5B::1%5D:5000" -> "::1", an IPv4-mapped IPv6 address -> the IPv4 one; else the string."""
    if not peer.startswith(("ipv4:", "ipv6:")):
        return peer
    host = urllib.parse.unquote(peer[5:]).rsplit(":", 1)[0].strip("[]")
    return host[7:] if host.startswith("::ffff:") and "." in host else host


@dataclass
class RegistryStats:
    evictions: int = 0
    idle_evictions: int = 0
    resyncs: int = 0
    verifies: int = 0
    syncs: int = 0
    rejected_streams: int = 0
    throttled: int = 0            # requests refused by the per-client rate limit
    prefix_hits: int = 0          # Syncs that adopted a retained slot
    prefix_tokens_reused: int = 0  # context tokens those Syncs did not have to prefill
    prefill_turns: int = 0        # times a chunked Sync handed the compute worker to queued requests
    prefill_chunks_mixed: int = 0  # Sync chunks that ran in the same forward as verify trees


@dataclass
class _SyncJob:
    """A Sync queued for the batch worker: its prefill rides in verify batches until done."""

    session: ServerSession
    tokens: list[int]
    work: PrefillProgress | None = None   # the backend's prefill once started
    compute_s: float = 0.0           # time of the batches it ran in


@dataclass(frozen=True)
class VerifyOutcome:
    """What the batch worker answers one Verify: a result, or a resync request."""

    result: object = None            # VerifyResult
    resync: tuple[int, str] | None = None   # (reason, detail)
    queue_s: float = 0.0
    compute_s: float = 0.0
    batch_size: int = 0


class SessionRegistry:
    def __init__(self, backend: Backend, *, max_sessions: int = 4, max_streams: int = 64,
                 kv_budget_bytes: int | None = None, idle_timeout_s: float = 600.0,
                 retain_closed: bool = True, max_batch: int = 32, max_streams_per_client: int = 0,
                 client_rate: float = 0.0) -> None:
        """max_streams_per_client: open streams one client may hold (0: only max_streams applies);
        client_rate: Sync/Verify requests per second one client may send (0: unlimited)."""
        if max_sessions < 1 or max_streams < 1:
            raise ValueError("max_sessions and max_streams must be >= 1")
        self.backend = backend
        per = backend.info.kv_bytes_per_session
        self.max_live = max_sessions
        if kv_budget_bytes is not None and per > 0:
            fit = kv_budget_bytes // per
            if fit < 1:
                raise ValueError(f"a KV budget of {kv_budget_bytes} bytes does not fit one session "
                                 f"(~{per} bytes at n_ctx {backend.info.n_ctx})")
            self.max_live = min(max_sessions, int(fit))
        self.max_streams = max_streams
        self.max_streams_per_client = max_streams_per_client
        self.client_rate = client_rate
        self._client_streams: collections.Counter[str] = collections.Counter()
        self._buckets: dict[str, tuple[float, float]] = {}   # client -> (tokens, monotonic time)
        self.idle_timeout_s = idle_timeout_s
        self.retain_closed = retain_closed
        self.stats = RegistryStats()
        self.compute_lock = FifoLock()
        self._lock = threading.Lock()                       # guards the dicts and counters below
        self._streams: dict[str, ServerSession] = {}
        self._live: collections.OrderedDict[str, ServerSession] = collections.OrderedDict()  # LRU first
        self._retained: collections.deque[BackendSession] = collections.deque()  # of ended streams, LRU first
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.batcher: BatchWorker | None = None
        if callable(getattr(backend, "verify_many", None)) and max_batch > 1:
            self.batcher = BatchWorker(self._run_verify_batch, max_batch=max_batch, lock=self.compute_lock,
                                       alone=lambda: self.open_streams <= 1,   # one edge: no hand-off
                                       expired=lambda job: DeadlineExceededError(
                                           f"the request waited {(time.monotonic() - job.received) * 1000:.0f} ms "
                                           "for the compute worker, over its deadline"))

    # -- streams ------------------------------------------------------------------------------
    def open_stream(self, peer: str = "") -> ServerSession:
        with self._lock:
            if len(self._streams) >= self.max_streams:
                self.stats.rejected_streams += 1
                raise VerifierBusyError(f"this verifier already has {len(self._streams)} open sessions "
                                        f"(limit {self.max_streams}); retry later")
            client = client_of(peer)
            if 0 < self.max_streams_per_client <= self._client_streams[client]:
                self.stats.rejected_streams += 1
                raise VerifierBusyError(f"client {client} already has {self._client_streams[client]} open sessions "
                                        f"(per-client limit {self.max_streams_per_client}); close one or retry later")
            session = ServerSession(id=f"s{next(self._ids)}", peer=peer, client=client)
            self._streams[session.id] = session
            self._client_streams[client] += 1
            return session

    def admit(self, session: ServerSession) -> None:
        """Count one Sync/Verify against its client's rate; VerifierBusyError when over it."""
        if self.client_rate <= 0:
            return
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.get(session.client, (self.client_rate, now))
            tokens = min(max(self.client_rate, 1.0), tokens + (now - at) * self.client_rate)
            if tokens < 1:
                self._buckets[session.client] = (tokens, now)
                self.stats.throttled += 1
                wait_ms = (1 - tokens) / self.client_rate * 1000
                raise VerifierBusyError(f"client {session.client} is over its rate limit of {self.client_rate:g} "
                                        f"requests/s; retry in {wait_ms:.0f} ms")
            self._buckets[session.client] = (tokens - 1, now)
            if len(self._buckets) > 4096:   # forget clients whose buckets have refilled
                full = max(self.client_rate, 1.0)
                for c, (t, a) in list(self._buckets.items()):
                    if t + (now - a) * self.client_rate >= full:
                        del self._buckets[c]

    def close_stream(self, session: ServerSession) -> None:
        with self.compute_lock_held():
            if self.retain_closed and session.kv is not None and session.kv.committed_length > 0:
                with self._lock:
                    self._live.pop(session.id, None)
                self._retained.append(session.kv)
                session.kv = None
            else:
                self._drop_kv(session, Reason.REASON_UNSPECIFIED)
        with self._lock:
            if self._streams.pop(session.id, None) is not None:
                self._client_streams[session.client] -= 1
                if self._client_streams[session.client] <= 0:
                    del self._client_streams[session.client]

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def live_sessions(self) -> int:
        return len(self._live)

    @property
    def retained_slots(self) -> int:
        return len(self._retained)

    # -- the compute worker -------------------------------------------------------------------
    @contextlib.contextmanager
    def compute_lock_held(self) -> Iterator[None]:
        self.compute_lock.acquire()
        try:
            yield
        finally:
            self.compute_lock.release()

    @contextlib.contextmanager
    def compute(self, session: ServerSession, received: float, deadline_ms: int = 0) -> Iterator[float]:
        """Run the body in the compute worker; yields the seconds the request waited for it.

        With deadline_ms > 0, give up with DeadlineExceededError once the request has waited that
        long since `received` (time.monotonic() when the message arrived).
        """
        with self._lock:
            session.in_flight += 1
        try:
            timeout = None if deadline_ms <= 0 else received + deadline_ms / 1000 - time.monotonic()
            if not self.compute_lock.acquire(timeout):
                waited = (time.monotonic() - received) * 1000
                raise DeadlineExceededError(f"the request waited {waited:.0f} ms for the compute worker, "
                                            f"over its deadline of {deadline_ms} ms")
            try:
                yield time.monotonic() - received
            finally:
                session.last_used = time.monotonic()
                self.compute_lock.release()
        finally:
            with self._lock:
                session.in_flight -= 1

    def sync(self, session: ServerSession, tokens: list[int], received: float,
             deadline_ms: int = 0) -> tuple[float, float]:
        """Make `tokens` the session's committed context (a slot first: ensure_slot), prefilling chunk
        by chunk with turns for queued requests in between. Returns (queue, compute) seconds: the
        waits for the compute worker, before and between chunks, and the rest. With deadline_ms,
        DeadlineExceededError if the wait before the first chunk is longer (nothing changed then)."""
        if self.batcher is not None and self.mixed_prefill:
            return self._sync_batched(session, tokens, received, deadline_ms)
        with self.compute(session, received, deadline_ms) as waited:
            kv = self.ensure_slot(session, tokens)
            started = time.monotonic()
            turns = 0.0
            try:
                for done in kv.sync_chunks(tokens):
                    if done < len(tokens) and self.compute_lock.queued:
                        turns += self.compute_lock.yield_turn()
                        self.stats.prefill_turns += 1
            except BaseException:
                self.invalidate(session)  # a half-synced KV must never be used
                raise
            session.synced = True
            self.stats.syncs += 1
            return waited + turns, time.monotonic() - started - turns

    @property
    def mixed_prefill(self) -> bool:
        """Whether Syncs prefill inside verify batches (the backend's sessions can begin_sync)."""
        return bool(getattr(self.backend, "mixed_prefill", False))

    def _sync_batched(self, session: ServerSession, tokens: list[int], received: float,
                      deadline_ms: int) -> tuple[float, float]:
        """sync through the batch worker: the prefill rides in verify batches, one chunk per batch."""
        sync = _SyncJob(session, tokens)
        self._submit(session, sync, received, deadline_ms)
        total = time.monotonic() - received
        return total - sync.compute_s, sync.compute_s

    # -- batched verification ---------------------------------------------------------------
    def verify_batched(self, session: ServerSession, received: float, deadline_ms: int, tree, sampling,  # noqa: ANN001
                       step: int, context_length: int) -> VerifyOutcome:
        """Queue one Verify for the batch worker and wait for its batch; raises its error."""
        return self._submit(session, (session, tree, sampling, step, context_length), received, deadline_ms).result

    def _submit(self, session: ServerSession, payload: object, received: float, deadline_ms: int) -> Job:
        """Queue a request of `session` for the batch worker, wait for it to finish; raises its error."""
        assert self.batcher is not None
        with self._lock:
            session.in_flight += 1
        try:
            deadline = None if deadline_ms <= 0 else received + deadline_ms / 1000
            job = self.batcher.submit(payload, received, deadline)
        finally:
            session.last_used = time.monotonic()
            with self._lock:
                session.in_flight -= 1
        if job.error is not None:
            raise job.error
        return job

    def _run_verify_batch(self, jobs: list[Job]) -> None:
        """Inside the compute worker: check each request, then one backend.verify_many call (with
        one chunk of each queued Sync riding in it)."""
        run, requests, syncs = [], [], []
        for job in jobs:
            if isinstance(job.payload, _SyncJob):
                if self._start_sync(job):
                    syncs.append(job)
                continue
            session, tree, sampling, step, context_length = job.payload
            if session.kv is None:
                job.result = VerifyOutcome(resync=(session.lost_reason or Reason.UNKNOWN_CONTEXT,
                                                   "this session's KV cache was freed; send Sync again"),
                                           queue_s=job.queue_s)
                continue
            self.ensure_slot(session)  # marks it most recently used
            if context_length and context_length != session.kv.committed_length:
                job.result = VerifyOutcome(resync=(Reason.UNKNOWN_CONTEXT,
                                                   f"the edge holds {context_length} committed tokens, "
                                                   f"this verifier {session.kv.committed_length}"),
                                           queue_s=job.queue_s)
                continue
            run.append(job)
            requests.append((session.kv, tree, sampling, step))
        if not requests and not syncs:
            return
        started = time.monotonic()
        try:
            if self.mixed_prefill:   # Syncs are queued here only then (see sync)
                results = self.backend.verify_many(requests, prefills=[job.payload.work for job in syncs])
            else:
                results = self.backend.verify_many(requests)
        finally:
            computed = time.monotonic() - started
            for job in syncs:
                self._sync_step_done(job, computed)
        for job, result in zip(run, results):
            if isinstance(result, BaseException):
                self.invalidate(job.payload[0])
                job.error = result
            else:
                self.stats.verifies += 1
                job.result = VerifyOutcome(result=result, queue_s=job.queue_s, compute_s=computed,
                                           batch_size=len(run))

    def _start_sync(self, job: Job) -> bool:
        """A Sync job's first batch: take a KV slot and begin the prefill. False when it failed."""
        sync: _SyncJob = job.payload
        if sync.work is not None:
            return True
        try:
            kv = self.ensure_slot(sync.session, sync.tokens)
            sync.work = kv.begin_sync(sync.tokens)
        except BaseException as exc:  # noqa: BLE001 - that Sync alone fails
            self.invalidate(sync.session)
            job.error = exc
            return False
        return True

    def _sync_step_done(self, job: Job, seconds: float) -> None:
        sync: _SyncJob = job.payload
        work = sync.work
        if work.ran:
            sync.compute_s += seconds
        if work.error is not None:
            self.invalidate(sync.session)  # a half-synced KV must never be used
            job.error = work.error
        elif work.finished:
            sync.session.synced = True
            self.stats.syncs += 1
            job.result = True
        else:
            job.pending = True
        if work.rode:
            self.stats.prefill_chunks_mixed += 1

    # -- KV slots (call only while holding the compute worker) --------------------------------
    def ensure_slot(self, session: ServerSession, context: list[int] | None = None) -> BackendSession:
        """The session's KV state. A session without one adopts the retained slot sharing the
        longest prefix with `context` (a Sync's tokens), else gets a new slot, freeing retained
        slots first and then evicting the least recently used idle session."""
        if session.kv is not None:
            with self._lock:
                self._live.move_to_end(session.id)
            return session.kv
        kv = self._adopt_retained(context) if context else None
        if kv is None:
            kv = self._new_slot(session)
        session.kv = kv
        session.lost_reason = Reason.REASON_UNSPECIFIED
        with self._lock:
            self._live[session.id] = session
        return kv

    def _adopt_retained(self, context: list[int]) -> BackendSession | None:
        best, best_len = None, 0
        for kv in self._retained:
            n = common_prefix_length(kv.committed_tokens, context)
            if n > best_len:
                best, best_len = kv, n
        if best is None:
            return None
        self._retained.remove(best)
        self.stats.prefix_hits += 1
        self.stats.prefix_tokens_reused += best_len
        return best

    def _new_slot(self, session: ServerSession) -> BackendSession:
        while self._retained and len(self._live) + len(self._retained) >= self.max_live:
            self._close_kv(self._retained.popleft(), "retained")
        while len(self._live) >= self.max_live:
            with self._lock:
                victim = next((s for s in self._live.values() if s is not session and s.in_flight == 0), None)
            if victim is None:
                raise VerifierBusyError(f"all {self.max_live} KV slots of this verifier belong to sessions with "
                                        "requests in flight; retry later")
            log.info("evicting idle session %s (LRU) for %s", victim.id, session.id)
            self._drop_kv(victim, Reason.EVICTED)
            self.stats.evictions += 1
        return self.backend.open_session()

    def _drop_kv(self, session: ServerSession, reason: int) -> None:
        with self._lock:
            self._live.pop(session.id, None)
        kv, session.kv = session.kv, None
        if kv is not None:
            session.lost_reason = reason
            self._close_kv(kv, f"session {session.id}")

    @staticmethod
    def _close_kv(kv: BackendSession, owner: str) -> None:
        try:
            kv.close()
        except Exception:  # noqa: BLE001 - freeing must never take the server down
            log.exception("closing the KV state of %s failed", owner)

    def invalidate(self, session: ServerSession, reason: int = Reason.UNKNOWN_CONTEXT) -> None:
        """Forget a session's KV (e.g. after a failed backend call left it in doubt)."""
        self._drop_kv(session, reason)

    # -- idle timeout -------------------------------------------------------------------------
    def reap_idle(self, now: float | None = None) -> int:
        """Free the KV slots of sessions idle longer than idle_timeout_s; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:  # cheap check first: do not queue behind model work for nothing
            if not any(s.in_flight == 0 and now - s.last_used > self.idle_timeout_s for s in self._live.values()):
                return 0
        with self.compute_lock_held():
            with self._lock:
                idle = [s for s in self._live.values()
                        if s.in_flight == 0 and now - s.last_used > self.idle_timeout_s]
            for s in idle:
                log.info("session %s idle for %.0f s: freeing its KV slot", s.id, now - s.last_used)
                self._drop_kv(s, Reason.IDLE_TIMEOUT)
                self.stats.idle_evictions += 1
        return len(idle)

    def start_reaper(self) -> None:
        if self._reaper is not None or self.idle_timeout_s <= 0:
            return
        period = min(max(self.idle_timeout_s / 4, 0.05), 5.0)

        def loop() -> None:
            while not self._stop.wait(period):
                try:
                    self.reap_idle()
                except Exception:  # noqa: BLE001  # pragma: no cover - keep reaping
                    log.exception("idle reaper")

        self._reaper = threading.Thread(target=loop, name="edgespec-idle-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        self._stop.set()
        if self.batcher is not None:
            self.batcher.close()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        with self.compute_lock_held():
            for s in list(self._live.values()):
                self._drop_kv(s, Reason.REASON_UNSPECIFIED)
            while self._retained:
                self._close_kv(self._retained.popleft(), "retained")
