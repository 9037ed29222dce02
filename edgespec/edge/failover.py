"""Fallback that loses nothing: verify on the verifier service while it answers in time, locally otherwise.

    fo = FailoverVerifier("gpu-box:50051", token="...", tokenizer_hash=draft.tokenizer_fingerprint(),
                          local=LocalFallback(target_path, tokenizer_hash=..., config=config),
                          deadline_s=10, probe_interval_s=2, on_switch=print)
    fo.sync(prompt); result = fo.verify(tree, sampling, step); fo.close()

`FailoverVerifier` is a drop-in verifier for the decoder (`sync` / `verify` / `close`, see
edgespec/edge/decoder.py). It wraps the gRPC link (`RemoteVerifier`) and, as the fallback, the
device's own copy of the target (`LlamaTreeVerifier`), and holds the committed context itself, so
either side can be (re)synced at any moment.

Circuit breaker (who verifies the next step):

  CLOSED     The verifier is attached; every step goes there and must be answered within
             `deadline_s` (network + queue + compute, plus a Sync when the link's context is behind).
             A failure -- the verifier unreachable or gone (VerifierUnavailableError and its
             subclasses DeadlineExceededError, VerifierBusyError, UnauthenticatedError), a broken
             connection, an inconsistent answer, or no answer before the deadline -- sends THAT step
             to the local target. `failure_threshold` consecutive failures open the breaker.
  OPEN       Every step is verified locally. A background probe thread checks the verifier every
             `probe_interval_s` (standard gRPC health check, `Info` where health is not served);
             once it is SERVING the probe attaches a fresh link (new channel, Open, Sync of the
             committed context as of then) and moves to HALF_OPEN.
  HALF_OPEN  The next step re-attaches: the fresh link is re-synced to the FULL committed context
             (the server reuses what the probe already sent) and the step's tree goes there, within
             `deadline_s`. Success -> CLOSED (a switch back to remote is reported); failure -> OPEN
             (the step runs locally, probing resumes).

Client errors are not failures and propagate from either side: a bad tree (InvalidTreeError and
other InvalidRequestError), a context that does not fit (ContextOverflowError).

Why no committed token is lost or duplicated, whatever fails and whenever:
- Only `_commit` extends the committed context, with the tokens of ONE answer per step: either the
  remote answer that arrived before the deadline or the local one, never both (the local side runs
  only after the remote attempt was decided as failed).
- Every remote operation runs on its own worker thread; the caller waits at most the deadline and
  then abandons the attempt atomically (`_Call`): an answer arriving later is dropped by the worker.
  The link's own round-trip timeout is set just past the deadline, so an abandoned round trip
  cancels its stream about CANCEL_GRACE_S after the caller gave up, and the worker then closes the
  link (channel included). A link that failed or timed out is never used again: re-attaching means
  a new channel, Open and a Sync of the full committed context, so nothing the old stream carried
  (a late Verified, a half-done Sync) can leak into a later step.
- Before every remote or local verify, that side's context is compared with the committed context
  and re-synced when it differs (after local steps the link is behind, after remote steps the local
  target is), so each side always verifies the tree against exactly the committed context.
- Remote answers are checked against the tree they answer (accepted path = a chain from the root,
  its tokens = the tree's tokens, plus exactly one target token); anything else is a failure.

Every switch of the verifying side is reported through `on_switch(SwitchEvent)` (called from the
decoder's verify thread; exceptions in it are logged and ignored) and counted; the counters, the
breaker state and a short history are published as `stats().extra["failover"]` (see `snapshot`).
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgespec.common import modelstore, wire
from edgespec.common.acceptance import VerifyResult
from edgespec.common.errors import (
    ContextOverflowError,
    EdgespecError,
    InvalidRequestError,
    InvalidTreeError,
    ModelError,
    TokenizerMismatchError,
    VerifierUnavailableError,
)
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.common.wire import (
    DeadlineExceededError,
    ProtocolError,
    UnauthenticatedError,
)
from edgespec.edge.link import LinkStats, RemoteVerifier, make_channel
from edgespec.runtime.llama import ContextConfig, LlamaModel
from edgespec.runtime.tree_verifier import LlamaTreeVerifier
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

log = logging.getLogger("edgespec.failover")

DEFAULT_DEADLINE_S = 10.0            # per step, with a local fallback
NO_FALLBACK_DEADLINE_S = 60.0        # per step without one: waiting is all that can be done
MIN_ATTACH_TIMEOUT_S = 30.0          # Open + Sync of a whole context (server-side prefill)
HISTORY = 64                         # events kept in the published snapshot
CANCEL_GRACE_S = 0.25                # an abandoned round trip cancels its stream this long after the deadline

# Errors about the request itself: the local target would refuse it just the same.
CLIENT_ERRORS = (InvalidRequestError, ContextOverflowError)
# Errors at first contact that no fallback should hide: the configuration is wrong.
CONFIG_ERRORS = (UnauthenticatedError, TokenizerMismatchError, ModelError, ProtocolError, InvalidRequestError)


class Breaker(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(frozen=True)
class SwitchEvent:
    """The verifying side changed: `from_mode` -> `to_mode` ("remote" / "local") at decode `step`
    (-1: before the first step, e.g. the verifier was unreachable when the session started)."""

    from_mode: str
    to_mode: str
    reason: str
    step: int
    time: float      # time.time()
    breaker: str     # the breaker state after the switch

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BreakerEvent:
    from_state: str
    to_state: str
    reason: str
    time: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def is_failure(exc: BaseException) -> bool:
    """Whether an exception from the remote side means "the verifier failed" (fall back) rather
    than "the request is wrong" (propagate)."""
    if isinstance(exc, CLIENT_ERRORS):
        return False
    return isinstance(exc, (EdgespecError, OSError, grpc.RpcError, TimeoutError))


def _transient_at_start(exc: BaseException) -> bool:
    """First contact failed for a reason a later probe may see go away (not a configuration error)."""
    if isinstance(exc, CONFIG_ERRORS):
        return False
    return isinstance(exc, (VerifierUnavailableError, OSError, grpc.RpcError, TimeoutError))


def _close_quietly(obj: Any) -> None:
    if obj is None:
        return
    try:
        obj.close()
    except Exception:  # noqa: BLE001 - closing a link that already failed
        log.debug("closing %r failed", obj, exc_info=True)


# -- the local fallback -------------------------------------------------------------------------
class LocalFallback:
    """The device's own copy of the target model, loaded on first use.

    Lazy on purpose: a device whose verifier keeps answering never pays the target's memory (about
    1.1 GB for the default 1.5B target, plus its KV cache) nor its load time. Loading eagerly would
    not make the first local step much faster anyway: an idle local target's KV cache is empty, so
    the first switch has to prefill the committed context either way (keeping it current would mean
    running the target on every step, i.e. local mode). The price of laziness is the model load
    (memory-mapped GGUF: well under a second from the page cache) on the first failure, once.
    The tokenizer is checked against the draft's when the model is loaded; a mismatch makes the
    fallback unusable (the failing step then raises VerifierUnavailableError naming it).
    """

    def __init__(self, target: str | os.PathLike, *, tokenizer_hash: str, config: ContextConfig = ContextConfig(),
                 max_depth: int = 32) -> None:
        self.target = Path(target)
        self.tokenizer_hash = tokenizer_hash
        self.config = config
        self.max_depth = max_depth
        self.model: LlamaModel | None = None
        self.load_seconds = 0.0

    @classmethod
    def for_target(cls, target: str | os.PathLike, **kwargs: Any) -> tuple["LocalFallback | None", str]:
        """(fallback, "") if this device has the target model file, else (None, why not).

        Never downloads: a manifest model that is not in the local cache means "no local target".
        """
        try:
            path = modelstore.resolve(target, fetch_missing=False, progress=False)
        except EdgespecError as exc:
            return None, f"no local target model ({exc})"
        return cls(path, **kwargs), ""

    def __call__(self) -> LlamaTreeVerifier:
        started = time.perf_counter()
        if self.model is None:
            model = LlamaModel(self.target)
            if model.tokenizer_fingerprint() != self.tokenizer_hash:
                model.close()
                raise TokenizerMismatchError(
                    f"the local target {self.target.name} does not share the draft's tokenizer; it cannot "
                    "verify the draft's trees")
            self.model = model
        verifier = LlamaTreeVerifier(self.model, self.config, max_depth=self.max_depth)
        self.load_seconds += time.perf_counter() - started
        return verifier

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
            self.model = None


# -- one remote operation with a deadline -------------------------------------------------------
class _Timeout(Exception):
    pass


class _Call:
    """Runs `fn(call)` on a daemon thread; `wait(timeout)` returns its value or abandons it.

    Abandoning is atomic with finishing: either the caller took the outcome before the deadline,
    or the worker learns (under the same lock) that nobody listens, drops its outcome and closes the
    link it used: a late answer can never reach the caller.
    """

    def __init__(self, fn: Callable[["_Call"], Any], name: str,
                 on_late: Callable[[bool], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False
        self._value: Any = None
        self._error: BaseException | None = None
        self.link: RemoteVerifier | None = None  # the link the worker uses (set by fn)
        self._on_late = on_late
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    def _run(self, fn: Callable[["_Call"], Any]) -> None:
        value, error = None, None
        try:
            value = fn(self)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            error = exc
        with self._lock:
            late = self._abandoned
            if not late:
                self._value, self._error = value, error
                self._done.set()
        if late:  # nobody waits for this answer any more: drop it, and the link with it
            _close_quietly(self.link)
            if self._on_late is not None:
                self._on_late(error is None)

    def wait(self, timeout_s: float) -> Any:
        self._done.wait(timeout_s)
        with self._lock:
            if not self._done.is_set():
                self._abandoned = True
                raise _Timeout()
        if self._error is not None:
            raise self._error
        return self._value


class _Failed(Exception):
    """A remote attempt failed in a way that calls for the fallback."""

    def __init__(self, cause: BaseException, deadline: bool = False) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.deadline = deadline


# -- the verifier ------------------------------------------------------------------------------
class FailoverVerifier:
    """The decoder's verifier: remote while the verifier answers in time, local (lossless) otherwise."""

    def __init__(self, address: str, *, token: str | None = None, tls: None | bool | str | Path = None,
                 tokenizer_hash: str, model_id: str = "", client_name: str = "edgespec",
                 server_name: str | None = None, local: Callable[[], Any] | None = None,
                 no_local_reason: str = "fallback disabled", deadline_s: float | None = None,
                 sync_deadline_s: float | None = None, probe_interval_s: float = 2.0, failure_threshold: int = 1,
                 on_switch: Callable[[SwitchEvent], None] | None = None,
                 stats: Callable[[], Any] | None = None, connect_now: bool = True,
                 revive: Callable[[], str] | None = None) -> None:
        """Connect to the verifier at `address` (Open) unless connect_now=False.

        local: a factory of the local verifier (e.g. LocalFallback), called on the first local
            step; None = no fallback: failures raise VerifierUnavailableError (the message says
            why there is no fallback: `no_local_reason`).
        deadline_s: how long a step may wait for the remote answer (default 10 s with a fallback,
            60 s without), including the first contact; sync_deadline_s: the same for `sync`
            (a new prompt is prefilled on the server; default 3 x deadline_s).
        failure_threshold: consecutive failures that open the breaker (default 1: every failure
            already cost up to deadline_s of waiting, and the link retried transport errors once
            by itself; a blip is repaired by the probe within probe_interval_s).
        stats: returns the session's SessionStats; the snapshot goes to its extra["failover"].
        revive: called by the probe before each health check; returns the verifier's address,
            which may change (EmbeddedVerifier.ensure_running restarts a dead bundled verifier on
            a new port); an exception counts as a failed probe.
        First contact: a configuration error (wrong token, model, tokenizer, protocol) always
        raises; an unreachable verifier raises only without a fallback, else the session starts
        local with the breaker open (and a switch event with step -1).
        """
        if failure_threshold < 1:
            raise InvalidRequestError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if probe_interval_s <= 0:
            raise InvalidRequestError(f"probe_interval_s must be > 0, got {probe_interval_s}")
        self.address = address
        self._token, self._tls, self._server_name = token, tls, server_name
        self._tokenizer_hash, self._model_id, self._client_name = tokenizer_hash, model_id, client_name
        self._local_factory = local
        self._revive = revive
        self._no_local_reason = no_local_reason if local is None else ""
        if deadline_s is None:
            deadline_s = DEFAULT_DEADLINE_S if local is not None else NO_FALLBACK_DEADLINE_S
        if deadline_s <= 0:
            raise InvalidRequestError(f"deadline_s must be > 0, got {deadline_s}")
        self.deadline_s = float(deadline_s)
        self.sync_deadline_s = 3 * self.deadline_s if sync_deadline_s is None else float(sync_deadline_s)
        self.attach_timeout_s = max(MIN_ATTACH_TIMEOUT_S, self.deadline_s, self.sync_deadline_s)
        self.probe_interval_s = float(probe_interval_s)
        self.probe_timeout_s = max(1.0, min(5.0, self.deadline_s))
        self.failure_threshold = failure_threshold
        self.on_switch = on_switch
        self._stats = stats

        self._lock = threading.RLock()
        self._committed: list[int] = []
        self._remote: RemoteVerifier | None = None
        self._local: Any = None
        self._state = Breaker.CLOSED
        self._mode = "remote"           # the side that verified the last step
        self._switch_reason = ""        # why the next switch happens (set on failure / re-attach)
        self._closed = False
        self._probe_gen = 0
        self._probe_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.link_stats = LinkStats()   # cumulative over every link this verifier attached
        self._links = 0
        self.events: list[SwitchEvent] = []
        self.breaker_history: collections.deque[BreakerEvent] = collections.deque(maxlen=HISTORY)
        self.counters = {"remote_steps": 0, "local_steps": 0, "failures": 0, "deadline_misses": 0,
                         "consecutive_failures": 0, "probes": 0, "probe_failures": 0, "attaches": 0,
                         "reattaches": 0, "local_syncs": 0, "remote_syncs": 0,
                         "late_answers": 0,   # remote answers that came after their deadline: dropped
                         "late_failures": 0}  # remote attempts that failed after their deadline
        self.last_error = ""
        self.last_probe = ""
        if connect_now:  # first contact (Open), within deadline_s like every foreground remote call
            try:
                self._remote, _ = self._remote_call(None, [], None, self.deadline_s, "connect")
            except _Failed as failed:
                exc = failed.cause
                if self._local_factory is None or not _transient_at_start(exc):
                    if isinstance(exc, VerifierUnavailableError) and self._local_factory is None:
                        raise type(exc)(f"{exc}; {self._why_no_local()}") from exc
                    raise exc from None
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.counters["failures"] += 1
                self._switch_reason = f"verifier unreachable at start: {self.last_error}"
                with self._lock:
                    self._set_state(Breaker.OPEN, self._switch_reason)
                self._emit_switch("local", -1)
        self._publish()

    # -- properties -----------------------------------------------------------------------------
    @property
    def state(self) -> Breaker:
        return self._state

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def has_fallback(self) -> bool:
        return self._local_factory is not None

    @property
    def committed(self) -> list[int]:
        with self._lock:
            return list(self._committed)

    # -- the Verifier protocol -------------------------------------------------------------------
    def sync(self, committed: list[int]) -> None:
        """Adopt the caller's committed context. The remote side is synced now (prefill, within
        sync_deadline_s) when the breaker is not open; otherwise, or if that fails, the local
        target is synced now so the prompt prefill happens here rather than in the first step."""
        committed = [int(t) for t in committed]
        if not committed:
            raise InvalidTreeError("the committed context is empty")
        self._check_open()
        with self._lock:
            self._committed = list(committed)
            state, link = self._state, self._remote
        if state is not Breaker.OPEN:
            try:
                link, _ = self._remote_call(link, committed, None, self.sync_deadline_s, "sync")
            except _Failed as failed:
                self._remote_failed(failed, step=None)
                if self._local_factory is None:
                    raise self._no_fallback_error(failed) from failed.cause
            else:
                self._remote_ok(link)
                return
        local = self._local_verifier(None)
        local.sync(committed)
        with self._lock:
            self.counters["local_syncs"] += 1

    def verify(self, tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        self._check_open()
        with self._lock:
            if not self._committed:
                raise InvalidTreeError("verify before sync: no committed context")
            context = list(self._committed)
            state, link = self._state, self._remote
        if int(tree.tokens[0]) != context[-1]:
            raise InvalidTreeError(f"tree root {int(tree.tokens[0])} is not the last committed token")
        failure: _Failed | None = None
        if state is not Breaker.OPEN:
            def op(v: RemoteVerifier) -> VerifyResult:
                result = v.verify(tree, sampling, step)
                _check_answer(tree, result)
                return result
            try:
                link, result = self._remote_call(link, context, op, self.deadline_s, f"step {step}")
            except _Failed as failed:
                failure = failed
                self._remote_failed(failed, step)
                if self._local_factory is None:
                    raise self._no_fallback_error(failed) from failed.cause
            else:
                self._remote_ok(link)
                return self._commit(result, "remote", step)
        local = self._local_verifier(failure)
        if getattr(local, "committed", None) != context:
            local.sync(context)
            with self._lock:
                self.counters["local_syncs"] += 1
        return self._commit(local.verify(tree, sampling, step), "local", step)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._probe_gen += 1
            link, self._remote = self._remote, None
            local, self._local = self._local, None
            probe = self._probe_thread
        self._stop.set()
        if probe is not None and probe is not threading.current_thread():
            probe.join(timeout=2.0)
        _close_quietly(link)
        _close_quietly(local)
        if self._local_factory is not None and hasattr(self._local_factory, "close"):
            _close_quietly(self._local_factory)

    def __enter__(self) -> "FailoverVerifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- statistics ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Mode, breaker state, counters and recent history (published as stats.extra["failover"])."""
        with self._lock:
            return {"mode": self._mode, "breaker": self._state.value, "address": self.address,
                    "fallback": self._local_factory is not None, "local_loaded": self._local is not None,
                    "deadline_s": self.deadline_s, "probe_interval_s": self.probe_interval_s,
                    "failure_threshold": self.failure_threshold, "switches": len(self.events),
                    **self.counters, "committed": len(self._committed), "last_error": self.last_error,
                    "last_probe": self.last_probe, "no_local_reason": self._no_local_reason,
                    "events": [e.as_dict() for e in self.events[-HISTORY:]],
                    "breaker_history": [e.as_dict() for e in self.breaker_history]}

    def _publish(self) -> None:
        if self._stats is None:
            return
        try:
            self._stats().extra["failover"] = self.snapshot()
        except Exception:  # noqa: BLE001 - statistics never break decoding
            log.debug("publishing failover stats failed", exc_info=True)

    # -- remote side -------------------------------------------------------------------------------
    def _connect(self) -> RemoteVerifier:
        """A fresh link (new channel, Open). Its round trips time out after attach_timeout_s at the
        latest (the step deadline is enforced by the caller); the server is told deadline_s. After a
        broken stream the link retries once, waiting for the verifier at most reconnect_timeout_s:
        short with a fallback (a reset is repaired in well under a second, a dead verifier should
        not hold the step), longer without one (waiting is then the only way forward)."""
        link = RemoteVerifier(self.address, self._token, self._tls, tokenizer_hash=self._tokenizer_hash,
                              model_id=self._model_id, client_name=self._client_name,
                              server_name=self._server_name, timeout_s=self.attach_timeout_s,
                              deadline_ms=int(self.deadline_s * 1000), retries=1,
                              reconnect_timeout_s=min(1.0 if self._local_factory is not None else 5.0,
                                                      max(0.2, self.deadline_s / 2)))
        with self._lock:
            fresh, link.link_stats = link.link_stats, self.link_stats
            _add_link_stats(self.link_stats, fresh)
            self._links += 1
            if self._links > 1:
                self.link_stats.reconnects += 1
            self.counters["attaches"] += 1
        return link

    def _remote_call(self, link: RemoteVerifier | None, context: list[int],
                     op: Callable[[RemoteVerifier], Any] | None, timeout_s: float,
                     what: str) -> tuple[RemoteVerifier, Any]:
        """(link, op(link)) on a worker thread within timeout_s: connects first if there is no
        link, re-syncs it when its context differs from `context`. Raises _Failed on a failure or
        a missed deadline (the link is then dropped for good), other errors as they are."""

        def work(call: _Call) -> tuple[RemoteVerifier, Any]:
            v = link if link is not None else self._connect()
            call.link = v
            # Each round trip of this operation gives up (and cancels its stream) shortly after the
            # caller stopped waiting, so an abandoned attempt does not linger on the verifier.
            v.timeout_s = timeout_s + CANCEL_GRACE_S
            try:
                if v.committed != context:
                    v.sync(context)
                    with self._lock:
                        self.counters["remote_syncs"] += 1
                return v, (op(v) if op is not None else None)
            except BaseException as exc:
                if is_failure(exc):  # this link is finished: nobody uses it again
                    _close_quietly(v)
                raise

        def late(answered: bool) -> None:
            with self._lock:
                self.counters["late_answers" if answered else "late_failures"] += 1

        call = _Call(work, name=f"edgespec-failover-{what.replace(' ', '-')}", on_late=late)
        try:
            return call.wait(timeout_s)
        except _Timeout:
            with self._lock:
                if self._remote is link:
                    self._remote = None
            stray = call.link
            if stray is not None:
                stray.link_stats = LinkStats()  # its late traffic is not this session's anymore
            raise _Failed(DeadlineExceededError(
                f"no answer from the verifier at {self.address} within {timeout_s:g} s ({what})"),
                deadline=True) from None
        except BaseException as exc:
            if is_failure(exc):
                with self._lock:
                    if self._remote is link:
                        self._remote = None
                raise _Failed(exc) from exc
            with self._lock:  # a client error: the link itself is fine (it reopens its stream)
                if call.link is not None and self._remote is None and not self._closed:
                    self._remote = call.link
            raise

    def _remote_ok(self, link: RemoteVerifier) -> None:
        with self._lock:
            if self._closed:
                _close_quietly(link)
                return
            self._remote = link
            self.counters["consecutive_failures"] = 0
            if self._state is Breaker.HALF_OPEN:
                self.counters["reattaches"] += 1
                self._set_state(Breaker.CLOSED, f"re-attached: context of {len(self._committed)} tokens resynced")
                self._switch_reason = (f"verifier at {self.address} is back: re-attached and resynced "
                                       f"{len(self._committed)} committed tokens")
            elif self._mode == "local":
                self._switch_reason = f"the verifier at {self.address} answered in time again"

    def _remote_failed(self, failed: _Failed, step: int | None) -> None:
        cause = failed.cause
        with self._lock:
            self.counters["failures"] += 1
            self.counters["consecutive_failures"] += 1
            if failed.deadline:
                self.counters["deadline_misses"] += 1
            self.last_error = f"{type(cause).__name__}: {cause}"
            link, self._remote = self._remote, None
            where = "sync" if step is None else f"step {step}"
            self._switch_reason = f"{where}: {self.last_error}"
            if self._local_factory is not None:
                if self._state is Breaker.HALF_OPEN:
                    self._set_state(Breaker.OPEN, f"re-attach failed: {self.last_error}")
                elif (self._state is Breaker.CLOSED
                      and self.counters["consecutive_failures"] >= self.failure_threshold):
                    self._set_state(Breaker.OPEN, f"{self.counters['consecutive_failures']} consecutive "
                                                  f"failure(s): {self.last_error}")
        log.warning("verifier at %s failed (%s): %s", self.address, where, self.last_error)
        if link is not None and not failed.deadline:
            _close_quietly(link)  # (a timed-out link is closed by its worker once it returns)
        self._publish()

    def _no_fallback_error(self, failed: _Failed) -> VerifierUnavailableError:
        cause = failed.cause
        cls = type(cause) if isinstance(cause, VerifierUnavailableError) else VerifierUnavailableError
        return cls(f"{cause}; {self._why_no_local()}")

    def _why_no_local(self) -> str:
        return f"no local fallback on this device ({self._no_local_reason or 'none configured'})"

    # -- local side --------------------------------------------------------------------------------
    def _local_verifier(self, failure: _Failed | None) -> Any:
        with self._lock:
            local = self._local
        if local is not None:
            return local
        if self._local_factory is None:
            cause = failure.cause if failure is not None else None
            raise VerifierUnavailableError(f"{cause or 'verifier unavailable'}; {self._why_no_local()}")
        try:
            local = self._local_factory()
        except EdgespecError as exc:
            with self._lock:
                self._local_factory = None
                self._no_local_reason = f"the local target cannot be used: {type(exc).__name__}: {exc}"
            raise VerifierUnavailableError(
                f"the verifier at {self.address} is unavailable ({self.last_error or 'breaker open'}) and "
                f"{self._no_local_reason}") from exc
        with self._lock:
            if self._closed:
                _close_quietly(local)
                raise VerifierUnavailableError("the failover verifier is closed")
            self._local = local
        log.info("local fallback target loaded")
        return local

    # -- committing and reporting -----------------------------------------------------------------
    def _commit(self, result: VerifyResult, side: str, step: int) -> VerifyResult:
        with self._lock:
            self._committed.extend(int(t) for t in result.tokens)
            self.counters[f"{side}_steps"] += 1
        if side != self._mode:
            self._emit_switch(side, step)
        self._publish()
        return result

    def _emit_switch(self, to_mode: str, step: int) -> None:
        with self._lock:
            event = SwitchEvent(from_mode=self._mode, to_mode=to_mode, reason=self._switch_reason, step=step,
                                time=time.time(), breaker=self._state.value)
            self._mode = to_mode
            self.events.append(event)
        log.warning("verification switched %s -> %s at step %d: %s", event.from_mode, event.to_mode, step,
                    event.reason)
        if self.on_switch is not None:
            try:
                self.on_switch(event)
            except Exception:  # noqa: BLE001 - a reporting callback must not break decoding
                log.exception("on_switch callback failed")

    def _set_state(self, new: Breaker, reason: str) -> None:
        """Breaker transition; the caller holds self._lock."""
        old = self._state
        if old is new:
            return
        self._state = new
        self.breaker_history.append(BreakerEvent(old.value, new.value, reason, time.time()))
        log.info("breaker %s -> %s: %s", old.value, new.value, reason)
        if new is Breaker.OPEN and not self._closed:
            self._probe_gen += 1
            self._probe_thread = threading.Thread(target=self._probe_loop, args=(self._probe_gen,),
                                                  name="edgespec-failover-probe", daemon=True)
            self._probe_thread.start()

    def _check_open(self) -> None:
        if self._closed:
            raise VerifierUnavailableError("the failover verifier is closed")

    # -- probing (background) ------------------------------------------------------------------------
    def _probe_loop(self, gen: int) -> None:
        while not self._stop.wait(self.probe_interval_s):
            with self._lock:
                if self._closed or gen != self._probe_gen or self._state is not Breaker.OPEN:
                    return
                self.counters["probes"] += 1
            ok, detail = self._revive_and_check()
            with self._lock:
                self.last_probe = detail
                if not ok:
                    self.counters["probe_failures"] += 1
            if not ok:
                self._publish()
                continue
            with self._lock:
                context = list(self._committed)
            link = None
            try:
                link = self._connect()
                if context:
                    link.sync(context)
            except Exception as exc:  # noqa: BLE001 - try again at the next interval
                _close_quietly(link)
                with self._lock:
                    self.counters["probe_failures"] += 1
                    self.last_probe = f"healthy, but attaching failed: {type(exc).__name__}: {exc}"
                self._publish()
                continue
            with self._lock:
                if not self._closed and gen == self._probe_gen and self._state is Breaker.OPEN:
                    self._remote = link
                    self._set_state(Breaker.HALF_OPEN, f"probe: {detail}; attached, {len(context)} tokens synced")
                    link = None
            _close_quietly(link)
            self._publish()
            return

    def _revive_and_check(self) -> tuple[bool, str]:
        if self._revive is not None:
            try:
                address = self._revive()
            except Exception as exc:  # noqa: BLE001 - a probe never raises
                return False, f"revive: {type(exc).__name__}: {exc}"
            with self._lock:
                self.address = address
        return self._health()

    def _health(self) -> tuple[bool, str]:
        """Standard gRPC health check of the verifier service (no token needed); Info where the
        server does not implement health."""
        channel = make_channel(self.address, self._tls, server_name=self._server_name)
        try:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME), timeout=self.probe_timeout_s)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    return False, f"health check: {exc.code().name}"
                metadata = [(wire.AUTH_KEY, f"Bearer {self._token}")] if self._token else []
                pb_grpc.VerifierStub(channel).Info(pb.InfoRequest(), timeout=self.probe_timeout_s,
                                                   metadata=metadata)
                return True, "Info answered"
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            return reply.status == health_pb2.HealthCheckResponse.SERVING, f"health check: {status}"
        except grpc.RpcError as exc:
            return False, f"Info: {exc.code().name}"
        except Exception as exc:  # noqa: BLE001 - a probe never raises
            return False, f"probe failed: {type(exc).__name__}: {exc}"
        finally:
            channel.close()


def _check_answer(tree: TokenTree, result: VerifyResult) -> None:
    """The remote answer must fit the tree: an accepted path that is a chain from the root, whose
    tokens are the tree's, plus exactly one token of the target's."""
    path = [int(p) for p in result.path]
    tokens = [int(t) for t in result.tokens]
    parents = tree.parents.tolist()
    ok = len(tokens) == len(path) + 1 and all(0 < p < len(tree) for p in path)
    if ok:
        ok = all(parents[p] == (path[i - 1] if i else 0) for i, p in enumerate(path))
        ok = ok and [int(tree.tokens[p]) for p in path] == tokens[:-1]
    if not ok:
        raise VerifierUnavailableError(f"inconsistent answer from the verifier (path {path}, tokens {tokens})")


def _add_link_stats(total: LinkStats, part: LinkStats) -> None:
    for f in dataclasses.fields(LinkStats):
        value = getattr(part, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(total, f.name, getattr(total, f.name) + value)
    total.recent_rtt_ms.extend(part.recent_rtt_ms)
