"""The edge's link to a verifier service: one channel, one Session stream, one way to recover.

    link = Link("gpu-box:50051", token="...", tls="ca.pem", tokenizer_hash=draft.tokenizer_fingerprint())
    link.sync(prompt)                                              # Open (first contact) + Sync
    result = link.verify(context, tree, sampling, step, Deadline(2.0, "step 0"))

The caller owns the committed context and passes it to every call (see edgespec/edge/decoder.py);
the link keeps no copy. It only counts how many of the caller's tokens the server holds
(`server_len`) of which context object: the caller's list only grows by verify answers between
syncs, so the server holds a prefix of it, and the link sends a Sync of the context whenever it
is another list or that count is not its length (after steps verified elsewhere, a new stream). Every Verify also carries the
context length, which the server checks (ResyncRequired, answered with a Sync and a retry).

Recovery, in one place (`attach`): a failure ends the stream (the server ends it with a status).
A client error (bad tree, full context) leaves the channel as it is; any other failure, or a
missed deadline, also drops the channel, so nothing the old connection still carries (a late
Verified, a stalled TCP connection) can reach a later call. `attach(context)` brings back what is
missing: a channel, a stream (Open), a Sync when the server is behind. `verify` attaches first,
and if a stream that was working broke under it (a reset, a restarted server) it attaches once
more within the same deadline. The failover's probe re-attaches through the same method.

Deadlines: every call takes a `Deadline` for all its round trips together. A stream is long-lived,
so gRPC has no per-message timeout; the one place that waits for an answer waits at most the time
left and then cancels the call (no thread per call: each stream has one reader thread). Verify
also tells the server the time left, so it drops a request the edge has given up on.

Link statistics (`stats`): per Verify round trip the wall time, the network share of it
(rtt = wall - server queue - server compute), the server's queue and compute times, and the bytes
of the serialised protobuf messages each way (HTTP/2 and TLS framing not included).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import grpc

from edgespec.common import modelstore, wire
from edgespec.common.acceptance import VerifyResult
from edgespec.common.errors import (
    ContextOverflowError,
    EdgespecError,
    InvalidRequestError,
    VerifierUnavailableError,
)
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.common.wire import DeadlineExceededError, UnauthenticatedError, VerifierBusyError
from edgespec.runtime.conversation import Conversation
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

_END = object()
_RESULT_FIELDS = {f.name for f in dataclasses.fields(VerifyResult)}  # per-step link figures, where supported
# Errors about the request itself: the stream ends, but the channel and the verifier are fine.
CLIENT_ERRORS = (InvalidRequestError, ContextOverflowError)
# How long one connection attempt may take (below); also the longest an Info probe of a fleet replica
# may wait (edge/fleet.py): a probe opens a fresh channel, so it may need as long as connecting does.
CONNECT_TIMEOUT_S = 10.0
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),          # notice a dead peer during long idle chats
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),      # what grpc core (1.85 here) times unanswered pings with
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 250),  # a restarted verifier is found again quickly
    # gRPC's MIN_CONNECT_TIMEOUT (doc/connection-backoff.md): how long one connection attempt may take
    # (TCP + TLS + the HTTP/2 settings exchange, several round trips). At 250 ms a link slower than
    # ~250 ms one way (satellite, a congested cellular uplink) never finished connecting. A refused
    # connection still fails at once and is retried after the 250 ms initial backoff.
    ("grpc.min_reconnect_backoff_ms", int(CONNECT_TIMEOUT_S * 1000)),
    ("grpc.max_reconnect_backoff_ms", 3000),
]


def expected_model_id(target: str | os.PathLike) -> str:
    """What to put into Open.model_id for a target given as a manifest name, role alias or path:
    the manifest name when the manifest knows it, else the file name (servers accept both)."""
    if not isinstance(target, os.PathLike):
        try:
            spec = modelstore.load_manifest().find(str(target))
        except EdgespecError:
            spec = None
        if spec is not None:
            return spec.name
    return Path(target).name


def make_channel(address: str, tls: None | bool | str | Path = None, *,
                 server_name: str | None = None) -> grpc.Channel:
    """A channel to `address` (host:port). tls: None/False plain text, True system roots, or the
    path of a PEM CA file to trust. server_name overrides the name checked against the certificate."""
    options = list(CHANNEL_OPTIONS)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if tls is None or tls is False:
        return grpc.insecure_channel(address, options=options)
    roots = None if tls is True else Path(tls).read_bytes()
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=roots), options=options)


class Deadline:
    """When an operation (all of its round trips) must be done; `what` names it in errors."""

    def __init__(self, seconds: float, what: str = "call") -> None:
        self.seconds = float(seconds)
        self.what = what
        self._expires = time.monotonic() + self.seconds

    def remaining(self) -> float:
        return max(0.0, self._expires - time.monotonic())

    def error(self, address: str) -> DeadlineExceededError:
        return DeadlineExceededError(f"no answer from the verifier at {address} within {self.seconds:g} s ({self.what})")


@dataclass
class LinkStats:
    """Cumulative link statistics; `steps` counts answered Verify round trips."""

    steps: int = 0
    syncs: int = 0
    resyncs: int = 0          # ResyncRequired answers (server evicted or lost the session)
    reconnects: int = 0       # streams opened after the first one
    abandoned: int = 0        # round trips given up at their deadline (their stream cancelled)
    late_answers: int = 0     # answers that still arrived on an abandoned stream (never used)
    bytes_up: int = 0         # every message sent (Open, Sync, Verify)
    bytes_down: int = 0       # every message received
    step_bytes_up: int = 0    # Verify messages only
    step_bytes_down: int = 0  # Verified messages only
    wall_ms: float = 0.0      # Verify sent -> Verified received, summed over steps
    rtt_ms: float = 0.0       # wall minus the server's queue and compute time, summed
    queue_ms: float = 0.0     # the server's queue time, summed
    compute_ms: float = 0.0   # the server's compute time, summed
    recent_rtt_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))

    def _mean(self, total: float) -> float:
        return total / self.steps if self.steps else 0.0

    @property
    def mean_rtt_ms(self) -> float:
        return self._mean(self.rtt_ms)

    @property
    def mean_wall_ms(self) -> float:
        return self._mean(self.wall_ms)

    @property
    def mean_queue_ms(self) -> float:
        return self._mean(self.queue_ms)

    @property
    def mean_compute_ms(self) -> float:
        return self._mean(self.compute_ms)

    @property
    def bytes_up_per_step(self) -> float:
        return self._mean(self.step_bytes_up)

    @property
    def bytes_down_per_step(self) -> float:
        return self._mean(self.step_bytes_down)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "syncs": self.syncs, "resyncs": self.resyncs, "reconnects": self.reconnects,
                "abandoned": self.abandoned, "late_answers": self.late_answers,
                "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "mean_rtt_ms": round(self.mean_rtt_ms, 3), "mean_wall_ms": round(self.mean_wall_ms, 3),
                "mean_queue_ms": round(self.mean_queue_ms, 3), "mean_compute_ms": round(self.mean_compute_ms, 3),
                "bytes_up_per_step": round(self.bytes_up_per_step, 1),
                "bytes_down_per_step": round(self.bytes_down_per_step, 1)}

    def summary(self) -> str:
        return (f"link: rtt {self.mean_rtt_ms:.1f} ms, verifier queue {self.mean_queue_ms:.1f} ms + compute "
                f"{self.mean_compute_ms:.1f} ms, {self.bytes_up_per_step:.0f} B up / {self.bytes_down_per_step:.0f} B "
                f"down per step, {self.resyncs} resyncs, {self.reconnects} reconnects")


class _Stream:
    """One Session call: requests go through a queue, a reader thread collects the answers."""

    def __init__(self, stub: pb_grpc.VerifierStub, metadata: list[tuple[str, str]], stats: LinkStats) -> None:
        self._requests: queue.Queue = queue.Queue()
        self.responses: queue.Queue = queue.Queue()
        self._stats = stats
        self.abandoned = False
        self.call = stub.Session(self._request_iter(), metadata=metadata)
        threading.Thread(target=self._read, name="edgespec-link-reader", daemon=True).start()

    def _request_iter(self) -> Iterator[pb.EdgeMessage]:
        while True:
            item = self._requests.get()
            if item is _END:
                return
            yield item

    def _read(self) -> None:
        try:
            for response in self.call:
                if self.abandoned:  # whoever asked has given up on this stream: drop it
                    self._stats.late_answers += 1
                    continue
                self.responses.put(response)
            self.responses.put(_END)
        except Exception as exc:  # noqa: BLE001 - grpc.RpcError and others: handed to the waiting caller
            self.responses.put(exc)

    def send(self, message: pb.EdgeMessage) -> None:
        self._requests.put(message)

    def abandon(self) -> None:
        """Give up on this stream now: nobody reads what it still delivers."""
        self.abandoned = True
        self.call.cancel()
        self._requests.put(_END)

    def close(self) -> None:
        """Half-close (the server ends the stream and keeps its KV as a prefix cache); cancel a
        stream that does not end promptly."""
        self._requests.put(_END)
        try:
            reply = self.responses.get(timeout=1.0)
        except queue.Empty:
            reply = None
        if reply is not _END:
            self.abandoned = True
            self.call.cancel()


def _error_of(exc: grpc.RpcError) -> EdgespecError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailer = None
    try:
        trailer = next((v for k, v in (exc.trailing_metadata() or ()) if k == wire.ERROR_CLASS_KEY), None)
    except Exception:  # noqa: BLE001 - some RpcErrors carry no metadata
        pass
    return wire.error_from_status(code, details, trailer)


def check_answer(tree: TokenTree, path: Sequence[int], tokens: Sequence[int]) -> None:
    """A remote answer must fit the tree it answers: an accepted path that is a chain from the
    root, whose tokens are the tree's, plus exactly one token of the target's."""
    parents = tree.parents.tolist()
    ok = len(tokens) == len(path) + 1 and all(0 < p < len(tree) for p in path)
    if ok:
        ok = all(parents[p] == (path[i - 1] if i else 0) for i, p in enumerate(path))
        ok = ok and [int(tree.tokens[p]) for p in path] == list(tokens[:-1])
    if not ok:
        raise VerifierUnavailableError(f"inconsistent answer from the verifier (path {list(path)}, tokens {list(tokens)})")


def broke_a_working_stream(exc: BaseException) -> bool:
    """A transport failure worth one immediate re-attach (a reset, a restarted server), unlike a
    missed deadline, a full verifier or a refused token."""
    return (isinstance(exc, VerifierUnavailableError)
            and not isinstance(exc, (UnauthenticatedError, VerifierBusyError, DeadlineExceededError)))


class Link:
    """The remote side of verification: `sync` / `verify` / `close` against the caller's context."""

    def __init__(self, address: str, token: str | None = None, tls: None | bool | str | Path = None, *,
                 tokenizer_hash: str, model_id: str = "", client_name: str = "edgespec",
                 server_name: str | None = None, timeout_s: float = 60.0) -> None:
        """Nothing is connected yet: the first call (or `attach`) makes first contact.
        timeout_s: the deadline of calls that are not given one."""
        self.address = address
        self.timeout_s = timeout_s
        self._tls, self._server_name = tls, server_name
        self._open_msg = wire.open_message(model_id, tokenizer_hash, client_name)
        self._metadata = [(wire.AUTH_KEY, f"Bearer {token}")] if token else []
        self._lock = threading.RLock()     # one operation at a time (the decoder's step, the probe)
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.VerifierStub | None = None
        self._stream: _Stream | None = None
        self._streams_opened = 0
        self._closed = False
        self._held: Sequence[int] | None = None  # the caller's context the server holds a prefix of...
        self.server_len = 0                      # ...this long
        self.opened: pb.Opened | None = None
        self.reached = False               # an Open was ever answered: the configuration works
        self.stats = LinkStats()

    # -- the context-passing verifier ----------------------------------------------------------
    def sync(self, context: Sequence[int], deadline: Deadline | None = None) -> None:
        """A new context: the server is made to hold exactly `context`."""
        with self._lock:
            self._held = None  # whatever the server held, it is to hold this now
            self.attach(context, deadline or Deadline(self.timeout_s, "sync"))

    def verify(self, context: Sequence[int], tree: TokenTree, sampling: SamplingParams, step: int,
               deadline: Deadline | None = None) -> VerifyResult:
        """Verify `tree` after `context` (its root is context[-1])."""
        deadline = deadline or Deadline(self.timeout_s, f"step {step}")
        with self._lock:
            was_open = self._stream is not None
            try:
                self.attach(context, deadline)
                return self._verify(context, tree, sampling, step, deadline)
            except Exception as exc:
                if not (was_open and broke_a_working_stream(exc) and deadline.remaining() > 0):
                    raise
            self.attach(context, deadline)  # once more: the stream broke, the verifier may be fine
            return self._verify(context, tree, sampling, step, deadline)

    def attach(self, context: Sequence[int] | None, deadline: Deadline) -> None:
        """The one way (back) to a working stream: a channel if there is none, a stream (Open),
        and a Sync when the server does not hold `context` (None: no Sync)."""
        with self._lock:
            if self._closed:
                raise VerifierUnavailableError("the link to the verifier is closed")
            try:
                if self._stream is None:
                    self._open(deadline)
                if context is not None and not self._holds(context):
                    # the server gives up on a Sync still queued when our deadline passes (its
                    # prefill would be wasted: we are gone by then)
                    request = wire.sync_message(context, deadline_ms=max(1, int(deadline.remaining() * 1000)))
                    self._roundtrip(request, deadline, "synced")
                    self._held, self.server_len = context, len(context)
                    self.stats.syncs += 1
            except BaseException as exc:
                self._failed(exc)
                raise

    def retarget(self, address: str) -> None:
        """Talk to `address` from now on (a bundled verifier restarted on a new port)."""
        with self._lock:
            if address != self.address:
                self.address = address
                self._drop(channel=True)

    def close(self) -> None:
        """End the stream politely (the server keeps its KV as a prefix cache) and the channel.
        An operation in flight (a probe re-attaching) is cut short rather than waited for."""
        if not self._lock.acquire(timeout=0.2):
            stream = self._stream
            if stream is not None:
                stream.abandon()
            self._lock.acquire()
        try:
            if not self._closed:
                self._closed = True
                self._drop(channel=True, gently=True)
        finally:
            self._lock.release()

    @property
    def attached(self) -> bool:
        return self._stream is not None

    # -- internals ------------------------------------------------------------------------------
    def _holds(self, context: Sequence[int]) -> bool:
        """Whether the server holds exactly `context`: the same context object (the caller's list,
        which only grows between syncs) at the length the server last confirmed."""
        return self._held is context and self.server_len == len(context)

    def _open(self, deadline: Deadline) -> None:
        if self._channel is None:
            self._channel = make_channel(self.address, self._tls, server_name=self._server_name)
            self._stub = pb_grpc.VerifierStub(self._channel)
        self._stream = _Stream(self._stub, self._metadata, self.stats)
        self._held, self.server_len = None, 0
        reply = self._roundtrip(self._open_msg, deadline, "opened")
        self.opened, self.reached = reply.opened, True
        self._streams_opened += 1
        if self._streams_opened > 1:
            self.stats.reconnects += 1

    def _verify(self, context: Sequence[int], tree: TokenTree, sampling: SamplingParams, step: int,
                deadline: Deadline) -> VerifyResult:
        if sampling.constraint and sampling.constraint.grammar is not None and not self.opened.grammar_constraints:
            raise InvalidRequestError(f"the verifier at {self.address} ({self.opened.backend}) does not apply grammar "
                                      "constraints (an older version, or a backend without them): its answer would "
                                      "not follow the grammar")
        try:
            for _ in range(3):
                request = wire.verify_message(tree, sampling, step, deadline_ms=max(1, int(deadline.remaining() * 1000)),
                                              context_length=len(context))
                started = time.perf_counter()
                reply = self._roundtrip(request, deadline, "verified", "resync_required")
                wall = (time.perf_counter() - started) * 1000
                if reply.WhichOneof("kind") == "resync_required":  # the server lost our KV: Sync, retry
                    self.stats.resyncs += 1
                    self._held = None
                    self.attach(context, deadline)
                    continue
                verified = wire.verified_from_proto(reply.verified)
                if verified.step != step:
                    raise VerifierUnavailableError(f"verifier answered step {verified.step} to step {step}")
                check_answer(tree, verified.path, verified.tokens)
                self._held, self.server_len = context, len(context) + len(verified.tokens)
                return self._result(verified, request, reply, wall)
            raise VerifierUnavailableError("the verifier keeps asking for a resync; giving up on this step")
        except BaseException as exc:
            self._failed(exc)
            raise

    def _result(self, verified: wire.Verified, request: pb.EdgeMessage, reply: pb.VerifierMessage,
                wall: float) -> VerifyResult:
        s = self.stats
        s.steps += 1
        s.step_bytes_up += request.ByteSize()
        s.step_bytes_down += reply.ByteSize()
        s.wall_ms += wall
        rtt = max(0.0, wall - verified.queue_ms - verified.compute_ms)
        s.rtt_ms += rtt
        s.recent_rtt_ms.append(rtt)
        s.queue_ms += verified.queue_ms
        s.compute_ms += verified.compute_ms
        timings = {"queue_s": verified.queue_ms / 1000, "network_s": rtt / 1000,
                   "bytes_up": request.ByteSize(), "bytes_down": reply.ByteSize()}
        return VerifyResult(path=verified.path, tokens=verified.tokens, margins=verified.margins,
                            compute_s=verified.compute_ms / 1000,
                            **{k: v for k, v in timings.items() if k in _RESULT_FIELDS})

    def _roundtrip(self, message: pb.EdgeMessage, deadline: Deadline, *expected: str) -> pb.VerifierMessage:
        stream = self._stream
        if stream is None:
            raise VerifierUnavailableError(f"no stream to the verifier at {self.address}")
        stream.send(message)
        self.stats.bytes_up += message.ByteSize()
        try:
            reply = stream.responses.get(timeout=deadline.remaining())
        except queue.Empty:
            self.stats.abandoned += 1
            raise deadline.error(self.address) from None
        if isinstance(reply, grpc.RpcError):
            raise _error_of(reply) from None
        if reply is _END:
            raise VerifierUnavailableError(f"the verifier at {self.address} ended the session unexpectedly")
        if isinstance(reply, BaseException):
            raise VerifierUnavailableError(f"link to {self.address} failed: {reply}") from reply
        self.stats.bytes_down += reply.ByteSize()
        kind = reply.WhichOneof("kind")
        if kind not in expected:
            raise VerifierUnavailableError(f"verifier answered {kind!r}, expected {' or '.join(expected)}")
        return reply

    def _failed(self, exc: BaseException) -> None:
        """After any error the stream is over; after anything but a client error, the channel too."""
        self._drop(channel=not isinstance(exc, CLIENT_ERRORS))

    def _drop(self, channel: bool, gently: bool = False) -> None:
        stream, self._stream = self._stream, None
        self._held, self.server_len = None, 0
        if stream is not None:
            stream.close() if gently else stream.abandon()
        if channel and self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None


class RemoteVerifier(Conversation):
    """A link that owns its conversation, for callers without a decoder (tests, benchmarks):
    `sync(committed)`, `verify(tree, sampling, step)`, `committed`. Connects at once, so a wrong
    address, token, model or tokenizer fails here; a broken stream is re-attached (Open + Sync of
    the committed context) by the next call."""

    def __init__(self, address: str, token: str | None = None, tls: None | bool | str | Path = None, *,
                 tokenizer_hash: str, model_id: str = "", timeout_s: float = 60.0, client_name: str = "edgespec",
                 server_name: str | None = None) -> None:
        link = Link(address, token, tls, tokenizer_hash=tokenizer_hash, model_id=model_id, client_name=client_name,
                    server_name=server_name, timeout_s=timeout_s)
        super().__init__(link)
        self.link = link
        try:
            link.attach(None, Deadline(timeout_s, "connect"))
        except BaseException:
            link.close()
            raise

    @property
    def link_stats(self) -> LinkStats:
        return self.link.stats

    @property
    def opened(self) -> pb.Opened | None:
        return self.link.opened
