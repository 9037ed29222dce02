"""The verifier gRPC service: `edgespec.v1.Verifier` plus standard health checking and reflection.

    server = VerifierServer(LlamaCppBackend(path), host="127.0.0.1", port=0, token="s3cret")
    server.start(); print(server.address); ...; server.stop()

- Authentication: with a token, every RPC except `grpc.health.v1.Health/*` (load balancers probe
  it without credentials) needs the metadata `authorization: Bearer <token>`, compared in constant
  time; anything else is UNAUTHENTICATED.
- TLS: optional, from PEM certificate-chain and key files.
- Errors: every failure ends its stream with a status code from `edgespec.common.wire.status_of`
  and the trailer `edgespec-error: <class>`; the server itself and other sessions carry on.
"""
from __future__ import annotations

import errno
import hmac
import logging
import socket
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from edgespec.common import wire
from edgespec.common.errors import (
    ContextOverflowError,
    EdgespecError,
    InvalidRequestError,
    InvalidTreeError,
    TokenizerMismatchError,
)
from edgespec.common.wire import ModelNotServedError, ProtocolError, TreeTooLargeError
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.verifier.backends import Backend
from edgespec.verifier.sessions import Reason, ServerSession, SessionRegistry

if TYPE_CHECKING:
    from edgespec.verifier.metrics import VerifierMetrics

log = logging.getLogger("edgespec.verifier")

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
UNAUTHENTICATED_PREFIXES = (f"/{HEALTH_SERVICE}/",)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, backend: Backend, registry: SessionRegistry, metrics: "VerifierMetrics | None" = None) -> None:
        self.backend = backend
        self.registry = registry
        self.metrics = metrics
        self.info = backend.info

    # -- Info ---------------------------------------------------------------------------------
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoReply:
        if isinstance(request, _Undecodable):
            self._abort(context, None, wire.WireFormatError(f"InfoRequest does not decode: {request.error}"))
        i, r = self.info, self.registry
        return pb.InfoReply(
            protocol_version=wire.PROTOCOL_VERSION, model_id=i.model_id, model_aliases=list(i.aliases),
            tokenizer_hash=i.tokenizer_hash, vocab_size=i.vocab_size, n_ctx=i.n_ctx, max_nodes=i.max_nodes,
            max_depth=i.max_depth, max_k=i.max_k, backend=i.backend, max_sessions=r.max_live,
            max_streams=r.max_streams, open_streams=r.open_streams, live_sessions=r.live_sessions,
            evictions=r.stats.evictions + r.stats.idle_evictions, resyncs=r.stats.resyncs,
            verifies=r.stats.verifies, retained_slots=r.retained_slots, prefix_hits=r.stats.prefix_hits,
            prefix_tokens_reused=r.stats.prefix_tokens_reused, grammar_constraints=i.grammar_constraints,
            max_streams_per_client=r.max_streams_per_client, client_rate=r.client_rate)

    # -- Session ------------------------------------------------------------------------------
    def Session(self, request_iterator: Iterator[pb.EdgeMessage],
                context: grpc.ServicerContext) -> Iterator[pb.VerifierMessage]:
        session: ServerSession | None = None
        try:
            session = self.registry.open_stream(context.peer())
            for message in request_iterator:
                received = time.monotonic()
                if isinstance(message, _Undecodable):
                    raise wire.WireFormatError(f"EdgeMessage does not decode: {message.error}")
                kind = message.WhichOneof("kind")
                if kind == "open":
                    yield self._open(session, message.open)
                elif kind == "sync":
                    yield self._sync(session, message.sync, received)
                elif kind == "verify":
                    yield self._verify(session, message.verify, received)
                else:
                    raise wire.WireFormatError("EdgeMessage carries none of open/sync/verify")
        except EdgespecError as exc:
            self._abort(context, session, exc)
        except Exception as exc:  # noqa: BLE001 - a bug must cost one stream, not the server
            if context.is_active():
                log.exception("session %s failed", session.id if session else "?")
                self._abort(context, session, exc)
        finally:
            if session is not None:
                self.registry.close_stream(session)

    def _abort(self, context: grpc.ServicerContext, session: ServerSession | None, exc: BaseException) -> None:
        code = wire.status_of(exc)
        message = str(exc) if isinstance(exc, EdgespecError) else f"internal error: {type(exc).__name__}: {exc}"
        log.info("session %s: %s %s", session.id if session else "?", code.name, message)
        if self.metrics is not None:
            self.metrics.errors.labels(code.name).inc()
        context.set_trailing_metadata(((wire.ERROR_CLASS_KEY, type(exc).__name__),))
        context.abort(code, message)

    def _open(self, session: ServerSession, msg: pb.Open) -> pb.VerifierMessage:
        if session.opened:
            raise ProtocolError("Open was already sent on this stream")
        if msg.protocol_version != wire.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {msg.protocol_version} is not supported "
                                f"(this verifier speaks {wire.PROTOCOL_VERSION})")
        if not self.info.serves(msg.model_id):
            names = ", ".join((self.info.model_id, *self.info.aliases))
            shown = msg.model_id if len(msg.model_id) <= 200 else msg.model_id[:200] + "..."  # details must fit a header
            raise ModelNotServedError(f"model {shown!r} is not served here (this verifier serves {names})")
        if not msg.tokenizer_hash:
            raise TokenizerMismatchError("Open.tokenizer_hash is required (the draft's token-list fingerprint)")
        if not hmac.compare_digest(msg.tokenizer_hash.encode(), self.info.tokenizer_hash.encode()):
            raise TokenizerMismatchError(
                f"the draft's tokenizer ({msg.tokenizer_hash[:12]}...) differs from the target "
                f"{self.info.model_id}'s ({self.info.tokenizer_hash[:12]}...): draft tokens would mean "
                "nothing to the target")
        session.opened = True
        session.client_name = msg.client_name[:200]
        log.info("session %s opened by %s (%s)", session.id, session.peer, session.client_name)
        i = self.info
        return pb.VerifierMessage(opened=pb.Opened(
            protocol_version=wire.PROTOCOL_VERSION, model_id=i.model_id, vocab_size=i.vocab_size, n_ctx=i.n_ctx,
            max_nodes=i.max_nodes, max_depth=i.max_depth, max_k=i.max_k, session_id=session.id, backend=i.backend,
            grammar_constraints=i.grammar_constraints))

    def _sync(self, session: ServerSession, msg: pb.Sync, received: float) -> pb.VerifierMessage:
        if not session.opened:
            raise ProtocolError("Sync before Open: the first message of a stream must be Open")
        self.registry.admit(session)
        tokens = wire.tokens_from_bytes(msg.tokens, "sync.tokens")
        if not tokens:
            raise InvalidRequestError("Sync carries no tokens: the committed context needs at least one")
        if len(tokens) > self.info.n_ctx:
            raise ContextOverflowError(f"context of {len(tokens)} tokens exceeds n_ctx={self.info.n_ctx}")
        bad = next((t for t in tokens if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:   # checked here: a backend that already holds tokens[:-1] would skip its own check
            raise InvalidTreeError(f"context token id {bad} outside the vocabulary [0, {self.info.vocab_size})")
        waited, computed = self.registry.sync(session, tokens, received, msg.deadline_ms)
        if self.metrics is not None:
            self.metrics.observe("sync", waited, computed)
        return pb.VerifierMessage(synced=pb.Synced(n_tokens=len(tokens), queue_ms=_ms(waited), compute_ms=_ms(computed)))

    def _verify(self, session: ServerSession, msg: pb.Verify, received: float) -> pb.VerifierMessage:
        if not session.opened:
            raise ProtocolError("Verify before Open: the first message of a stream must be Open")
        if not session.synced:
            raise ProtocolError("Verify before Sync: send the committed context first")
        self.registry.admit(session)
        i = self.info
        tree = wire.tree_from_proto(msg.tree, max_nodes=i.max_nodes, max_k=i.max_k)
        sampling = wire.sampling_from_proto(msg.sampling)
        tree.validate(i.vocab_size, max_nodes=i.max_nodes, require_q=sampling.needs_q)
        depth = tree.max_depth
        if depth > i.max_depth:
            raise TreeTooLargeError(f"tree depth {depth} is over this verifier's limit of {i.max_depth}")
        if self.registry.batcher is not None:  # several sessions' trees per forward
            outcome = self.registry.verify_batched(session, received, msg.deadline_ms, tree, sampling, msg.step,
                                                   msg.context_length)
            if outcome.resync is not None:
                return self._resync(session, msg.step, *outcome.resync)
            result, waited, computed = outcome.result, outcome.queue_s, outcome.compute_s
            if self.metrics is not None:
                self.metrics.observe("verify", waited, computed)
                self.metrics.observe_tree(len(tree), len(result.tokens))
            return wire.verified_message(msg.step, result.path, result.tokens, result.margins,
                                         queue_ms=_ms(waited), compute_ms=_ms(computed))
        with self.registry.compute(session, received, msg.deadline_ms) as waited:
            if session.kv is None:
                return self._resync(session, msg.step, session.lost_reason or Reason.UNKNOWN_CONTEXT,
                                    "this session's KV cache was freed; send Sync again")
            self.registry.ensure_slot(session)  # marks it most recently used
            if msg.context_length and msg.context_length != session.kv.committed_length:
                return self._resync(session, msg.step, Reason.UNKNOWN_CONTEXT,
                                    f"the edge holds {msg.context_length} committed tokens, "
                                    f"this verifier {session.kv.committed_length}")
            started = time.monotonic()
            try:
                result = session.kv.verify(tree, sampling, msg.step)
            except BaseException:
                self.registry.invalidate(session)
                raise
            computed = time.monotonic() - started
            self.registry.stats.verifies += 1
        if self.metrics is not None:
            self.metrics.observe("verify", waited, computed)
            self.metrics.observe_tree(len(tree), len(result.tokens))
        return wire.verified_message(msg.step, result.path, result.tokens, result.margins,
                                     queue_ms=_ms(waited), compute_ms=_ms(computed))

    def _resync(self, session: ServerSession, step: int, reason: int, detail: str) -> pb.VerifierMessage:
        self.registry.stats.resyncs += 1
        log.info("session %s: ResyncRequired(%s) at step %d", session.id, Reason.Name(reason), step)
        return pb.VerifierMessage(resync_required=pb.ResyncRequired(step=step, reason=reason, detail=detail))


class _Undecodable:
    """A request whose bytes do not parse: answered INVALID_ARGUMENT by the servicer (gRPC itself
    would answer INTERNAL, "Exception deserializing request!")."""

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(cls):  # noqa: ANN001, ANN202
    def parse(data: bytes):  # noqa: ANN202
        try:
            return cls.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, RecursionError on deep nesting, ...
            return _Undecodable(f"{type(exc).__name__}: {exc}"[:300])
    return parse


def _add_verifier_servicer(servicer: "VerifierServicer", server: grpc.Server) -> None:
    """pb_grpc.add_VerifierServicer_to_server with request parsers that never fail (see _Undecodable)."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.SERVICE_NAME, {
        "Session": grpc.stream_stream_rpc_method_handler(
            servicer.Session, request_deserializer=_lenient(pb.EdgeMessage),
            response_serializer=pb.VerifierMessage.SerializeToString),
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info, request_deserializer=_lenient(pb.InfoRequest),
            response_serializer=pb.InfoReply.SerializeToString)}),))


class BearerAuthInterceptor(grpc.ServerInterceptor):
    """`authorization: Bearer <token>` on every RPC except the exempt method prefixes."""

    def __init__(self, token: str, exempt_prefixes: tuple[str, ...] = UNAUTHENTICATED_PREFIXES) -> None:
        if not token:
            raise ValueError("empty token")
        self._expected = f"Bearer {token}".encode()
        self._exempt = exempt_prefixes
        self.failures = 0                      # refused calls (failed logins), for Info-like reports
        self.on_failure = None                 # callable(why) -> None, e.g. a metrics counter
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001, ANN201
        method = handler_call_details.method or ""
        if method.startswith(self._exempt):
            return continuation(handler_call_details)
        got = next((v for k, v in handler_call_details.invocation_metadata or () if k == wire.AUTH_KEY), None)
        if got is not None and hmac.compare_digest(str(got).encode(), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        why = "missing authorization metadata (expected 'Bearer <token>')" if got is None else "invalid bearer token"
        with self._lock:
            self.failures += 1
        # the peer address is not known here; the method and the reason are (never the token itself)
        log.warning("refused %s: %s (%d failed logins so far)", method, why, self.failures)
        if self.on_failure is not None:
            self.on_failure("missing" if got is None else "invalid")
        return _denying_handler(handler, why)


def _denying_handler(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    def deny(request, context: grpc.ServicerContext):  # noqa: ANN001, ANN202
        context.set_trailing_metadata(((wire.ERROR_CLASS_KEY, "UnauthenticatedError"),))
        context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _why_not_bindable(host: str, port: int) -> str:
    """Why gRPC could not bind (it only says "Failed to bind"): try the same bind with a plain socket."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            return {errno.EADDRINUSE: "the port is in use (another verifier?)",
                    errno.EADDRNOTAVAIL: "the address is not one of this machine's",
                    errno.EACCES: "permission denied (ports below 1024 need privileges)"}.get(exc.errno, str(exc))
    return "gRPC could not bind it"


def read_tls_files(cert: str | Path, key: str | Path) -> tuple[bytes, bytes]:
    """The PEM certificate chain and key, checked for the usual mistakes (swapped, missing, not PEM)."""
    data = {}
    for what, path in (("certificate", cert), ("key", key)):
        try:
            data[what] = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the TLS {what} file {path}: {exc.strerror or exc}") from None
    if b"PRIVATE KEY-----" in data["certificate"] and b"-----BEGIN CERTIFICATE-----" in data["key"]:
        raise ValueError(f"the TLS certificate and key look swapped: {cert} holds a private key and {key} a "
                         "certificate (--tls-cert takes the certificate, --tls-key the key)")
    if b"-----BEGIN CERTIFICATE-----" not in data["certificate"]:
        raise ValueError(f"{cert} is not a PEM certificate (no BEGIN CERTIFICATE block)")
    if b"PRIVATE KEY-----" not in data["key"]:
        raise ValueError(f"{key} is not a PEM private key (no BEGIN ... PRIVATE KEY block)")
    return data["certificate"], data["key"]


def _v1_reflection_descriptor() -> None:
    """Register grpc.reflection.v1 in the default descriptor pool: the same messages as v1alpha under
    the package current tools (grpcurl, Postman, grpcui) ask for first. grpcio-reflection ships v1alpha only."""
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_reflection.v1alpha import reflection_pb2

    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"

    def rename(messages) -> None:  # noqa: ANN001
        for m in messages:
            for f in m.field:
                if f.type_name:   # assigning "" would mark a scalar field as a message reference
                    f.type_name = f.type_name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
            rename(m.nested_type)

    rename(fdp.message_type)
    for service in fdp.service:
        for method in service.method:
            method.input_type = method.input_type.replace(".v1alpha.", ".v1.")
            method.output_type = method.output_type.replace(".v1alpha.", ".v1.")
    pool.Add(fdp)


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: tuple[str, ...], server: grpc.Server) -> None:
    """Reflection as v1alpha and as v1 (wire-identical messages: one servicer answers both)."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    _v1_reflection_descriptor()
    names = (*service_names, reflection.SERVICE_NAME, REFLECTION_V1)
    servicer = reflection.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}),))


class VerifierServer:
    """A running gRPC server around one backend."""

    def __init__(self, backend: Backend, *, host: str = "127.0.0.1", port: int = 50051, token: str | None = None,
                 tls_cert: str | Path | None = None, tls_key: str | Path | None = None, max_sessions: int = 4,
                 max_streams: int = 64, kv_budget_bytes: int | None = None, idle_timeout_s: float = 600.0,
                 prefix_cache: bool = True, metrics: bool = False, keepalive_s: float = 20.0,
                 max_streams_per_client: int = 0, client_rate: float = 0.0) -> None:
        """metrics=True keeps Prometheus metrics (edgespec/verifier/metrics.py, needs the
        `verifier` extra); `serve_metrics` exposes them over HTTP.

        keepalive_s: ping each client connection this often (and give up after as long again
        without an answer), so that a stream whose edge vanished without closing it (power loss,
        partition) is ended and its stream and KV slots are freed; 0 disables pinging."""
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both a certificate and a key file")
        self.backend = backend
        self.registry = SessionRegistry(backend, max_sessions=max_sessions, max_streams=max_streams,
                                        kv_budget_bytes=kv_budget_bytes, idle_timeout_s=idle_timeout_s,
                                        retain_closed=prefix_cache, max_streams_per_client=max_streams_per_client,
                                        client_rate=client_rate)
        # One thread per open stream (sync gRPC) plus a few for Info/health/reflection; calls past
        # that are refused with RESOURCE_EXHAUSTED by gRPC instead of queueing forever.
        workers = max_streams + 8
        ping_ms = int(keepalive_s * 1000)
        keepalive = [("grpc.keepalive_time_ms", ping_ms), ("grpc.keepalive_timeout_ms", ping_ms),
                     ("grpc.http2.ping_timeout_ms", ping_ms),   # what grpc core times unanswered pings with
                     ("grpc.http2.max_pings_without_data", 0)] if ping_ms > 0 else []  # 0: keep pinging an idle edge
        self.auth = BearerAuthInterceptor(token) if token else None
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edgespec-rpc"),
            interceptors=[self.auth] if self.auth else [],
            maximum_concurrent_rpcs=workers,
            # one verifier per port: with SO_REUSEPORT (gRPC's default on Linux) a second server on
            # the same port starts too and the kernel splits the edges between the two
            options=[("grpc.so_reuseport", 0), *keepalive,
                     ("grpc.keepalive_permit_without_calls", 1),
                     ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
                     ("grpc.http2.max_ping_strikes", 0)])
        self.metrics = None
        if metrics:
            from edgespec.verifier.metrics import VerifierMetrics

            self.metrics = VerifierMetrics(self.registry)
            if self.auth is not None:
                self.auth.on_failure = self.metrics.auth_failure
        self.servicer = VerifierServicer(backend, self.registry, self.metrics)
        _add_verifier_servicer(self.servicer, self._server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        enable_reflection((wire.SERVICE_NAME, HEALTH_SERVICE), self._server)
        bind = _host_port(host, port)
        try:
            if tls_cert is not None:
                cert, key = read_tls_files(tls_cert, tls_key)
                try:
                    creds = grpc.ssl_server_credentials([(key, cert)])
                    self.port = self._server.add_secure_port(bind, creds)
                except RuntimeError:
                    if not _why_not_bindable(host, port).startswith("gRPC"):
                        raise
                    raise ValueError(f"TLS: gRPC refused the certificate {tls_cert} with the key {tls_key} (not a "
                                     "matching pair, or an unsupported key type)") from None
            else:
                self.port = self._server.add_insecure_port(bind)
        except RuntimeError:   # gRPC's "Failed to bind to address ..."
            self.port = 0
        if not self.port:
            raise OSError(errno.EADDRINUSE, f"cannot listen on {bind}: {_why_not_bindable(host, port)}")
        self.host = host
        self.tls = tls_cert is not None
        self.address = _host_port(host, self.port)

    def start(self) -> "VerifierServer":
        self._server.start()
        for service in ("", wire.SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.registry.start_reaper()
        return self

    def serve_metrics(self, host: str, port: int) -> str:
        """Serve /metrics over HTTP (needs metrics=True); returns host:port."""
        if self.metrics is None:
            raise ValueError("this server was created without metrics")
        return _host_port(host, self.metrics.serve(host, port))

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self._server.stop(grace_s).wait()
        self.registry.close()
        if self.metrics is not None:
            self.metrics.close()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout_s)
