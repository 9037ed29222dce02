"""The edge's link to a verifier service: `RemoteVerifier`, a drop-in for the local verifier.

    v = RemoteVerifier("gpu-box:50051", token="...", tls="ca.pem", tokenizer_hash=draft.tokenizer_fingerprint())
    v.sync(prompt_tokens); result = v.verify(tree, sampling, step); v.close()

One bidirectional `Session` stream carries the conversation (see proto/edgespec/v1/edgespec.proto).
The link keeps the committed context itself, so it can recover without bothering the caller:
- `ResyncRequired` (the server evicted this session's KV, or lost track): re-send Sync, retry.
- The stream broke (server restarted, connection reset: UNAVAILABLE/CANCELLED): reconnect
  (Open + Sync) and retry once; if that fails too, VerifierUnavailableError reaches the caller.
Other failures raise the edgespec exception the server named (edgespec.common.wire.error_from_status),
with the server's message; the stream is then reopened on the next call.

Link statistics (`link_stats`): per Verify round trip the wall time, the network share of it
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

import grpc

from edgespec.common import modelstore, wire
from edgespec.common.acceptance import VerifyResult
from edgespec.common.errors import EdgespecError, VerifierUnavailableError
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.common.wire import (
    DeadlineExceededError,
    UnauthenticatedError,
    VerifierBusyError,
)
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

_END = object()
_RESULT_FIELDS = {f.name for f in dataclasses.fields(VerifyResult)}  # per-step link figures, where supported
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),          # notice a dead peer during long idle chats
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),      # what grpc core (1.85 here) times unanswered pings with
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 250),  # a restarted verifier is found again quickly
    ("grpc.min_reconnect_backoff_ms", 250),
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


@dataclass
class LinkStats:
    """Cumulative link statistics; `steps` counts answered Verify round trips."""

    steps: int = 0
    syncs: int = 0
    resyncs: int = 0          # ResyncRequired answers (server evicted or lost the session)
    reconnects: int = 0       # streams opened after the first one
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

    def __init__(self, stub: pb_grpc.VerifierStub, metadata: list[tuple[str, str]], wait_for_ready: bool) -> None:
        self._requests: queue.Queue = queue.Queue()
        self.responses: queue.Queue = queue.Queue()
        self.call = stub.Session(self._request_iter(), metadata=metadata, wait_for_ready=wait_for_ready)
        self.broken = False
        self._reader = threading.Thread(target=self._read, name="edgespec-link-reader", daemon=True)
        self._reader.start()

    def _request_iter(self):  # noqa: ANN202
        while True:
            item = self._requests.get()
            if item is _END:
                return
            yield item

    def _read(self) -> None:
        try:
            for response in self.call:
                self.responses.put(response)
            self.responses.put(_END)
        except grpc.RpcError as exc:
            self.responses.put(exc)
        except Exception as exc:  # noqa: BLE001 - hand it to the waiting caller
            self.responses.put(exc)

    def send(self, message: pb.EdgeMessage) -> None:
        self._requests.put(message)

    def close(self, wait_s: float = 1.0) -> None:
        self._requests.put(_END)  # half-close: the server ends the stream and frees the session
        self._reader.join(timeout=wait_s)
        if self._reader.is_alive():
            self.call.cancel()
            self._reader.join(timeout=wait_s)


def _error_of(exc: grpc.RpcError) -> EdgespecError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailer = None
    try:
        trailer = next((v for k, v in (exc.trailing_metadata() or ()) if k == wire.ERROR_CLASS_KEY), None)
    except Exception:  # noqa: BLE001 - some RpcErrors carry no metadata
        pass
    return wire.error_from_status(code, details, trailer)


class RemoteVerifier:
    """`sync`/`verify`/`close` of a local verifier, served over gRPC by a verifier service."""

    def __init__(self, address: str, token: str | None = None, tls: None | bool | str | Path = None, *,
                 tokenizer_hash: str, model_id: str = "", timeout_s: float = 60.0, deadline_ms: int | None = None,
                 client_name: str = "edgespec", server_name: str | None = None, retries: int = 1,
                 reconnect_timeout_s: float = 5.0) -> None:
        """Connect and Open the session at once, so a wrong address, token, model or tokenizer fails here.

        timeout_s bounds every round trip; deadline_ms (default: timeout_s) tells the server how
        long a Verify may wait in its queue before it should give up (DEADLINE_EXCEEDED).
        After a transport failure a call is retried `retries` times on a new stream, each retry
        waiting up to reconnect_timeout_s for the verifier to be reachable again.
        """
        self.address = address
        self.timeout_s = timeout_s
        self.deadline_ms = int(timeout_s * 1000) if deadline_ms is None else deadline_ms
        self.retries = retries
        self.reconnect_timeout_s = reconnect_timeout_s
        self._open_msg = wire.open_message(model_id, tokenizer_hash, client_name)
        self._metadata = [(wire.AUTH_KEY, f"Bearer {token}")] if token else []
        self._channel = make_channel(address, tls, server_name=server_name)
        self._stub = pb_grpc.VerifierStub(self._channel)
        self._lock = threading.RLock()
        self._stream: _Stream | None = None
        self._streams_opened = 0
        self._committed: list[int] = []
        self.link_stats = LinkStats()
        self.opened: pb.Opened | None = None
        self._closed = False
        try:
            self._connect(resync=False)
        except BaseException:
            self._channel.close()
            raise

    # -- the Verifier protocol ----------------------------------------------------------------
    def sync(self, committed: list[int]) -> None:
        with self._lock:
            self._committed = list(committed)
            self._with_reconnect(lambda: self._sync_now())

    def verify(self, tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        with self._lock:
            return self._with_reconnect(lambda: self._verify_now(tree, sampling, step))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._stream is not None:
                self._stream.close()
                self._stream = None
            self._channel.close()

    def __enter__(self) -> "RemoteVerifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def committed(self) -> list[int]:
        return list(self._committed)

    # -- internals ----------------------------------------------------------------------------
    def _with_reconnect(self, action):  # noqa: ANN001, ANN202
        if self._closed:
            raise VerifierUnavailableError("the link to the verifier is closed")
        for attempt in range(self.retries + 1):
            try:
                if self._stream is None:
                    self._connect(resync=bool(self._committed), patient=attempt > 0)
                return action()
            except VerifierUnavailableError as exc:
                self._drop_stream()
                retryable = not isinstance(exc, (UnauthenticatedError, VerifierBusyError, DeadlineExceededError))
                if not retryable or attempt == self.retries:
                    raise
            except BaseException:
                self._drop_stream()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close(wait_s=0.2)
            self._stream = None

    def _connect(self, resync: bool, patient: bool = False) -> None:
        """Open a new stream; `patient` waits (reconnect_timeout_s) for an unreachable verifier."""
        self._stream = _Stream(self._stub, self._metadata, wait_for_ready=patient)
        self._streams_opened += 1
        if self._streams_opened > 1:
            self.link_stats.reconnects += 1
        if patient:
            reply = self._roundtrip(self._open_msg, "opened", timeout_s=min(self.timeout_s, self.reconnect_timeout_s),
                                    on_timeout=VerifierUnavailableError)
        else:
            reply = self._roundtrip(self._open_msg, "opened")
        self.opened = reply.opened
        if resync:
            self._sync_now()

    def _sync_now(self) -> None:
        self._roundtrip(wire.sync_message(self._committed), "synced")
        self.link_stats.syncs += 1

    def _verify_now(self, tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        request = wire.verify_message(tree, sampling, step, deadline_ms=self.deadline_ms,
                                      context_length=len(self._committed))
        for _ in range(3):
            started = time.perf_counter()
            reply = self._roundtrip(request, "verified", "resync_required")
            wall = (time.perf_counter() - started) * 1000
            if reply.WhichOneof("kind") == "resync_required":
                self.link_stats.resyncs += 1
                self._sync_now()
                continue
            verified = wire.verified_from_proto(reply.verified)
            if verified.step != step:
                raise VerifierUnavailableError(f"verifier answered step {verified.step} to step {step}")
            s = self.link_stats
            s.steps += 1
            s.step_bytes_up += request.ByteSize()
            s.step_bytes_down += reply.ByteSize()
            s.wall_ms += wall
            rtt = max(0.0, wall - verified.queue_ms - verified.compute_ms)
            s.rtt_ms += rtt
            s.recent_rtt_ms.append(rtt)
            s.queue_ms += verified.queue_ms
            s.compute_ms += verified.compute_ms
            self._committed.extend(verified.tokens)
            timings = {"queue_s": verified.queue_ms / 1000, "network_s": rtt / 1000,
                       "bytes_up": request.ByteSize(), "bytes_down": reply.ByteSize()}
            return VerifyResult(path=verified.path, tokens=verified.tokens, margins=verified.margins,
                                compute_s=verified.compute_ms / 1000,
                                **{k: v for k, v in timings.items() if k in _RESULT_FIELDS})
        raise VerifierUnavailableError("the verifier keeps asking for a resync; giving up on this step")

    def _roundtrip(self, message: pb.EdgeMessage, *expected: str, timeout_s: float | None = None,
                   on_timeout: type[EdgespecError] = DeadlineExceededError) -> pb.VerifierMessage:
        stream = self._stream
        assert stream is not None
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        stream.send(message)
        self.link_stats.bytes_up += message.ByteSize()
        try:
            reply = stream.responses.get(timeout=timeout_s)
        except queue.Empty:
            stream.call.cancel()
            raise on_timeout(f"no answer from the verifier at {self.address} within {timeout_s:g} s") from None
        if isinstance(reply, grpc.RpcError):
            raise _error_of(reply) from None
        if reply is _END:
            raise VerifierUnavailableError(f"the verifier at {self.address} ended the session unexpectedly")
        if isinstance(reply, BaseException):
            raise VerifierUnavailableError(f"link to {self.address} failed: {reply}") from reply
        self.link_stats.bytes_down += reply.ByteSize()
        kind = reply.WhichOneof("kind")
        if kind not in expected:
            raise VerifierUnavailableError(f"verifier answered {kind!r}, expected {' or '.join(expected)}")
        return reply
