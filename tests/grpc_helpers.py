"""Helpers (not tests) for the verifier-service tests: a real `edgespec verifier serve` process on
loopback, raw gRPC streams driven message by message, and throw-away TLS certificates."""
from __future__ import annotations

import datetime
import ipaddress
import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgespec.common import wire
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

READY = re.compile(r"^edgespec-verifier listening on (\S+)$")


def stop_process(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s; its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class ServerProcess:
    """`python -m edgespec verifier serve ARGS` with --port 0; `address` once it printed its ready line."""

    def __init__(self, model: str | os.PathLike, *args: str, token: str | None = None, timeout_s: float = 60) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("EDGESPEC_TOKEN", None)
        if token:
            env["EDGESPEC_TOKEN"] = token
        self.token = token
        self.cmd = [sys.executable, "-m", "edgespec", "verifier", "serve", "--model", str(model),
                    "--host", "127.0.0.1", "--port", "0", "--exit-with-parent", *args]
        # errors="replace": a log line may carry bytes that are not UTF-8 (a token's piece of a multi-byte
        # character); the reader thread must not die on it
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     errors="replace", env=env)
        self.stderr: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        lines: queue.Queue = queue.Queue()

        def pump() -> None:
            for line in self.proc.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise RuntimeError(f"server did not start: {''.join(self.stderr)}") from None
            if line is None:
                self.proc.wait()
                raise RuntimeError(f"server exited with {self.proc.returncode}: {''.join(self.stderr)}")
            m = READY.match(line)
            if m:
                self.address = m.group(1)
                self.port = int(self.address.rsplit(":", 1)[1])
                break

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10) -> int:
        return stop_process(self.proc, timeout_s)

    # -- clients ------------------------------------------------------------------------------
    def channel(self, token: str | None = "default", **kwargs) -> grpc.Channel:
        """A plain-text channel; with a token every call carries `authorization: Bearer ...`."""
        token = self.token if token == "default" else token
        ch = grpc.insecure_channel(self.address, **kwargs)
        return grpc.intercept_channel(ch, AuthInterceptor(token)) if token else ch

    def health(self, service: str = wire.SERVICE_NAME) -> int:
        with grpc.insecure_channel(self.address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def info(self) -> pb.InfoReply:
        with self.channel() as ch:
            return pb_grpc.VerifierStub(ch).Info(pb.InfoRequest(), timeout=10)


class AuthInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
                      grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.md = (wire.AUTH_KEY, f"Bearer {token}")

    def _details(self, d):  # noqa: ANN001, ANN202
        return d._replace(metadata=[*(d.metadata or ()), self.md]) if hasattr(d, "_replace") else _Details(
            d.method, d.timeout, [*(d.metadata or ()), self.md], d.credentials, getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, d, request):  # noqa: ANN001, ANN201
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation, d, request):  # noqa: ANN001, ANN201
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation, d, requests):  # noqa: ANN001, ANN201
        return continuation(self._details(d), requests)

    def intercept_stream_stream(self, continuation, d, requests):  # noqa: ANN001, ANN201
        return continuation(self._details(d), requests)


@dataclass
class _Details(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list
    credentials: object
    wait_for_ready: bool | None
    compression: object


class RawStream:
    """A Session stream driven one message at a time: `ask(msg)` returns the answer or the RpcError."""

    def __init__(self, channel: grpc.Channel, metadata: list | None = None) -> None:
        self._out: queue.Queue = queue.Queue()
        self._in: queue.Queue = queue.Queue()
        self.call = pb_grpc.VerifierStub(channel).Session(iter(self._out.get, None), metadata=metadata or [])

        def read() -> None:
            try:
                for m in self.call:
                    self._in.put(m)
                self._in.put("end")
            except grpc.RpcError as exc:
                self._in.put(exc)

        threading.Thread(target=read, daemon=True).start()

    def ask(self, msg: pb.EdgeMessage, timeout_s: float = 30):
        self._out.put(msg)
        return self._in.get(timeout=timeout_s)

    def close(self) -> None:
        self._out.put(None)


def error_class(err: grpc.RpcError) -> str | None:
    return next((v for k, v in err.trailing_metadata() or () if k == wire.ERROR_CLASS_KEY), None)


# -- TLS --------------------------------------------------------------------------------------
def make_tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1/localhost: (ca, cert, key) PEM paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgespec test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_path, cert_path, key_path = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca_path, cert_path, key_path
