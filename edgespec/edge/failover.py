"""Fallback that loses nothing: verify on the verifier service while it answers in time, locally otherwise.

    fo = FailoverVerifier("gpu-box:50051", token="...", tokenizer_hash=draft.tokenizer_fingerprint(),
                          local=LocalFallback(target_path, tokenizer_hash=..., config=config),
                          deadline_s=10, probe_interval_s=2, on_switch=print)
    fo.sync(context); result = fo.verify(context, tree, sampling, step); fo.close()

The decoder's verifier (edgespec/edge/decoder.py). The decoder owns the committed context and
passes it to every call; this class keeps no copy. It is assembled from parts with one job each:

  Link            (link.py)          the remote side: channel, stream, deadlines, the one recovery path
  CircuitBreaker  (breaker.py)       who verifies the next step: closed, open, half-open
  LocalSide       (local_target.py)  the device's own target, loaded on first need
  Probe           (probe.py)         while open, looks for the verifier and re-attaches the link
  check_health    (health.py)        the standard gRPC health check
  SwitchLog       (switches.py)      switch events, counters, what goes to stats.extra["failover"]
  unreached       (first_contact.py) the configuration error for a verifier that never answered

The rules:
- First contact (Open) must work: a verifier that never answered is a configuration mistake, raised
  with its cause (first_contact.py), never hidden by the fallback. Exceptions: `local_first=True`
  starts locally while the verifier cannot be reached yet (a refused token or model still raises),
  and a verifier (or every replica of a fleet) that answered RESOURCE_EXHAUSTED is full, not
  misconfigured: the session starts locally and the probe attaches once there is room (without a
  fallback the VerifierBusyError is raised, naming the verifier).
- Breaker closed (or half-open): the step goes to the verifier and must be answered within
  `deadline_s` (network + queue + compute, plus a Sync when the server is behind the context). A
  failure -- unreachable, a broken stream that does not come back at once, an inconsistent answer,
  no answer in time -- sends THAT step to the local target; `failure_threshold` consecutive
  failures open the breaker. Without a fallback the failure is raised.
- Breaker open: steps are verified locally; the probe health-checks the verifier every
  `probe_interval_s` (restarting a bundled one first: `revive`), re-attaches the link (new channel,
  Open, Sync of the decoder's context as of then) and half-opens the breaker; the next step tries
  the verifier (its Sync sends only what the probe's did not cover) and closes the breaker.
- Client errors are not failures and propagate from either side: a bad tree (InvalidRequestError),
  a context that does not fit (ContextOverflowError).

Why no committed token is lost or duplicated, whatever fails and whenever: each step returns
exactly one answer, the remote one that arrived before the deadline or else the local one (the
local side runs only once the remote attempt has failed), and the decoder commits that answer.
A missed deadline cancels the stream and drops the channel at once, so a late answer is never
read. Each side brings itself to the context it is given before verifying, so it always verifies
the tree against exactly the committed context. Remote answers are checked against their tree.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc

from edgespec.common.acceptance import VerifyResult
from edgespec.common.errors import (
    EdgespecError,
    InvalidRequestError,
    InvalidTreeError,
    VerifierUnavailableError,
)
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.common.wire import DeadlineExceededError, VerifierBusyError
from edgespec.edge.breaker import HISTORY, Breaker, BreakerEvent, CircuitBreaker
from edgespec.edge.first_contact import check_address, is_refusal, unreached
from edgespec.edge.health import check_health
from edgespec.edge.link import CLIENT_ERRORS, Deadline, Link, LinkStats
from edgespec.edge.local_target import LocalFallback, LocalSide
from edgespec.edge.probe import Probe
from edgespec.edge.switches import SwitchEvent, SwitchLog
from edgespec.runtime.conversation import ContextVerifier

__all__ = ["Breaker", "BreakerEvent", "FailoverVerifier", "LocalFallback", "SwitchEvent"]

log = logging.getLogger("edgespec.failover")

DEFAULT_DEADLINE_S = 10.0            # per step, with a local fallback
NO_FALLBACK_DEADLINE_S = 60.0        # per step without one: waiting is all that can be done
MIN_ATTACH_TIMEOUT_S = 30.0          # a probe's Open + Sync of a whole context (server-side prefill)


def is_failure(exc: BaseException) -> bool:
    """Whether an exception from the remote side means "the verifier failed" (fall back) rather
    than "the request is wrong" (propagate) or a bug (propagate)."""
    if isinstance(exc, CLIENT_ERRORS):
        return False
    return isinstance(exc, (EdgespecError, OSError, grpc.RpcError, TimeoutError))


class FailoverVerifier:
    """The decoder's verifier: remote while the verifier answers in time, local (lossless) otherwise."""

    def __init__(self, address: str, *, token: str | None = None, tls: None | bool | str | Path = None,
                 tokenizer_hash: str, model_id: str = "", client_name: str = "edgespec",
                 server_name: str | None = None, local: Callable[[], ContextVerifier] | None = None,
                 no_local_reason: str = "fallback disabled", deadline_s: float | None = None,
                 sync_deadline_s: float | None = None, probe_interval_s: float = 2.0, failure_threshold: int = 1,
                 on_switch: Callable[[SwitchEvent], None] | None = None,
                 stats: Callable[[], Any] | None = None, connect_now: bool = True,
                 revive: Callable[[], str] | None = None, local_first: bool = False,
                 link: Link | None = None) -> None:
        """Connect to the verifier at `address` (Open) unless connect_now=False.

        local: a factory of the local verifier (e.g. LocalFallback), called on the first local
            step; None = no fallback: failures raise VerifierUnavailableError (the message says
            why there is no fallback: `no_local_reason`).
        deadline_s: how long a step may wait for the remote answer (default 10 s with a fallback,
            60 s without), first contact included; sync_deadline_s: the same for `sync` (a new
            prompt is prefilled on the server; default 3 x deadline_s).
        failure_threshold: consecutive failures that open the breaker (default 1: every failure
            already cost up to deadline_s of waiting, and the link re-attached a broken stream once
            by itself; a blip is repaired by the probe within probe_interval_s).
        stats: returns the session's SessionStats; the snapshot goes to its extra["failover"].
        revive: called by the probe before each health check; returns the verifier's address,
            which may change (EmbeddedVerifier.ensure_running restarts a dead bundled verifier on
            a new port); an exception counts as a failed probe.
        local_first: a verifier that cannot be reached yet is not an error: verify locally and
            attach it once the probe finds it (needs a fallback).
        link: the remote side to use instead of a Link to `address` (a FleetLink, edge/fleet.py,
            which moves the session between replicas itself and fails here only when all do).
        """
        for name, value in (("failure_threshold", failure_threshold), ("probe_interval_s", probe_interval_s)):
            if value <= 0:
                raise InvalidRequestError(f"{name} must be > 0, got {value}")
        if deadline_s is None:
            deadline_s = DEFAULT_DEADLINE_S if local is not None else NO_FALLBACK_DEADLINE_S
        if deadline_s <= 0:
            raise InvalidRequestError(f"deadline_s must be > 0, got {deadline_s}")
        check_address(address)
        self.deadline_s = float(deadline_s)
        self.sync_deadline_s = 3 * self.deadline_s if sync_deadline_s is None else float(sync_deadline_s)
        self.attach_timeout_s = max(MIN_ATTACH_TIMEOUT_S, self.deadline_s, self.sync_deadline_s)
        self.probe_timeout_s = max(1.0, min(5.0, self.deadline_s))
        self.local_first = local_first
        self._token, self._tls, self._server_name = token, tls, server_name
        self._revive = revive
        self._stats = stats
        self._closed = False
        # The decoder's committed context as last passed in (its list, never written here): the
        # probe reads it to warm up a re-attached verifier before the next step needs it.
        self._context: Sequence[int] = ()

        self.link = link or Link(address, token, tls, tokenizer_hash=tokenizer_hash, model_id=model_id,
                                 client_name=client_name, server_name=server_name, timeout_s=self.attach_timeout_s)
        self.local = LocalSide(local, no_local_reason)
        self.breaker = CircuitBreaker(failure_threshold)
        self.switches = SwitchLog(on_switch)
        self.probe = Probe(float(probe_interval_s), self._probe_once)
        if connect_now:
            try:
                self.link.attach(None, Deadline(self.deadline_s, "connect"))
                self.switches.count("attaches")
            except Exception as exc:
                if not is_failure(exc):
                    self.link.close()
                    raise
                try:
                    self._never_reached(exc, step=-1)
                except BaseException:
                    self.close()
                    raise
        self._publish()

    # -- what the decoder calls ------------------------------------------------------------------
    def sync(self, context: Sequence[int]) -> None:
        """A new context (prompt, next turn): prefilled on the verifier when the breaker is not
        open; otherwise, or if that fails, on the local target, so the first step does not pay."""
        self._check_open()
        if not context:
            raise InvalidTreeError("the committed context is empty")
        self._context = context
        cause = "the breaker is open"
        if self.breaker.allows_remote:
            try:
                self.link.sync(context, Deadline(self.sync_deadline_s, "sync"))
                return
            except Exception as exc:
                if not is_failure(exc):
                    raise
                cause = self._failed(exc, "sync", step=-1)
        self.local.get(cause).sync(context)

    def verify(self, context: Sequence[int], tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        """One step: the remote answer within deadline_s, else the local one (never both)."""
        self._check_open()
        if not context or int(tree.tokens[0]) != context[-1]:
            raise InvalidTreeError(f"tree root {int(tree.tokens[0])} is not the last committed token")
        self._context = context
        cause = "the breaker is open"
        if self.breaker.allows_remote:
            try:
                result = self.link.verify(context, tree, sampling, step, Deadline(self.deadline_s, f"step {step}"))
            except Exception as exc:
                if not is_failure(exc):
                    raise
                cause = self._failed(exc, f"step {step}", step)
            else:
                self._remote_answered(len(context))
                return self._answered("remote", step, result)
        return self._answered("local", step, self.local.get(cause).verify(context, tree, sampling, step))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.probe.stop()
        self.link.close()
        self.local.close()

    def __enter__(self) -> "FailoverVerifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the session and the tests read -------------------------------------------------------
    @property
    def address(self) -> str:
        return self.link.address

    @property
    def state(self) -> Breaker:
        return self.breaker.state

    @property
    def mode(self) -> str:
        return self.switches.mode

    @property
    def has_fallback(self) -> bool:
        return self.local.available

    @property
    def counters(self) -> dict[str, int]:
        return self.switches.counters

    @property
    def events(self) -> list[SwitchEvent]:
        return self.switches.events

    @property
    def breaker_history(self) -> list[BreakerEvent]:
        return list(self.breaker.history)

    @property
    def link_stats(self) -> LinkStats:
        return self.link.stats

    def snapshot(self) -> dict:
        """Mode, breaker state, counters and recent history (published as stats.extra["failover"])."""
        s = self.switches
        return {"mode": s.mode, "breaker": self.breaker.state.value, "address": self.link.address,
                "fallback": self.local.available, "local_loaded": self.local.loaded, "local_first": self.local_first,
                "deadline_s": self.deadline_s, "probe_interval_s": self.probe.interval_s,
                "failure_threshold": self.breaker.threshold, "switches": len(s.events), **s.counters,
                "consecutive_failures": self.breaker.consecutive_failures,
                "abandoned": self.link.stats.abandoned, "late_answers": self.link.stats.late_answers,
                "last_error": s.last_error, "last_probe": s.last_probe, "no_local_reason": self.local.reason,
                "events": [e.as_dict() for e in s.events[-HISTORY:]],
                "breaker_history": [e.as_dict() for e in self.breaker.history],
                **({"fleet": self.link.snapshot()} if hasattr(self.link, "snapshot") else {})}  # a FleetLink

    # -- outcomes -------------------------------------------------------------------------------
    def _answered(self, side: str, step: int, result: VerifyResult) -> VerifyResult:
        self.switches.answered(side, step, self.breaker.state.value)
        self._publish()
        return result

    def _remote_answered(self, context_len: int) -> None:
        if self.breaker.succeeded("re-attached"):
            self.switches.count("reattaches")
            self.switches.reason = (f"the verifier at {self.link.address} is back: re-attached and resynced "
                                    f"{context_len} committed tokens")
        elif self.switches.mode == "local":
            self.switches.reason = f"the verifier at {self.link.address} answered in time again"

    def _failed(self, exc: Exception, where: str, step: int) -> str:
        """Account for a failed remote attempt; returns the cause for the local side, or raises
        when there is no local side to use (a verifier never reached, no fallback)."""
        if not self.link.reached:
            self._never_reached(exc, step)  # raises unless local-first
            return self.switches.last_error
        error = f"{type(exc).__name__}: {exc}"
        s = self.switches
        s.count("failures")
        if isinstance(exc, DeadlineExceededError):
            s.count("deadline_misses")
        s.last_error, s.reason = error, f"{where}: {error}"
        log.warning("verifier at %s failed (%s): %s", self.link.address, where, error)
        if not self.local.available:
            self._publish()
            cls = type(exc) if isinstance(exc, VerifierUnavailableError) else VerifierUnavailableError
            raise cls(f"{exc}; {self.local.why_not()}") from exc
        if self.breaker.failed(error):
            self.probe.start()
        self._publish()
        return error

    def _never_reached(self, exc: Exception, step: int) -> None:
        """First contact failed: a configuration error, unless local-first allows waiting for it, or
        the verifier answered that it is full (then, with a fallback, wait for room the same way)."""
        busy = isinstance(exc, VerifierBusyError)  # it answered: address, TLS and token are right
        if not ((self.local_first or busy) and self.local.available) or is_refusal(exc):
            raise unreached(self.link.address, self._tls, exc) from exc
        s = self.switches
        s.count("failures")
        s.last_error = f"{type(exc).__name__}: {exc}"
        s.reason = (f"the verifier at {self.link.address} has no room for this session yet ({s.last_error})" if busy
                    else f"local-first: the verifier at {self.link.address} cannot be reached yet ({s.last_error})")
        if self.breaker.trip(s.reason):
            self.probe.start()
        if s.mode == "remote":
            s.switch("local", step, self.breaker.state.value)
        self._publish()

    # -- the probe (background thread) --------------------------------------------------------------
    def _probe_once(self) -> bool:
        """Revive, health-check and re-attach; True when done (attached, or nothing left to do)."""
        if self._closed or self.breaker.state is not Breaker.OPEN:
            return True
        s = self.switches
        s.count("probes")
        ok, detail = self._revive_and_check()
        if ok:
            context = list(self._context)  # the decoder's context as of now (a snapshot: it grows)
            try:
                self.link.attach(context or None, Deadline(self.attach_timeout_s, "re-attach"))
            except Exception as exc:  # noqa: BLE001 - try again at the next interval
                ok, detail = False, f"healthy, but attaching failed: {type(exc).__name__}: {exc}"
                if is_refusal(exc):
                    log.error("the verifier at %s refuses this edge: %s", self.link.address, exc)
            else:
                s.count("attaches")
                self.breaker.half_open(f"probe: {detail}; attached, {len(context)} tokens synced")
        s.last_probe = detail
        if not ok:
            s.count("probe_failures")
        self._publish()
        return ok

    def _revive_and_check(self) -> tuple[bool, str]:
        if self._revive is not None:
            try:
                self.link.retarget(self._revive())
            except Exception as exc:  # noqa: BLE001 - a probe never raises
                return False, f"revive: {type(exc).__name__}: {exc}"
        return check_health(self.link.address, tls=self._tls, server_name=self._server_name, token=self._token,
                            timeout_s=self.probe_timeout_s)

    # -- plumbing ---------------------------------------------------------------------------------
    def _publish(self) -> None:
        if self._stats is None:
            return
        try:
            self._stats().extra["failover"] = self.snapshot()
        except Exception:  # noqa: BLE001 - statistics never break decoding
            log.debug("publishing failover stats failed", exc_info=True)

    def _check_open(self) -> None:
        if self._closed:
            raise VerifierUnavailableError("the failover verifier is closed")
