"""The bundled verifier as a child process: `EdgeSession()` with no verifier address uses this.

    with EmbeddedVerifier(modelstore.resolve("target")) as ev:
        link = RemoteVerifier(ev.address, token=ev.token, tokenizer_hash=...)

The child is `python -m edgespec verifier serve --model PATH --host 127.0.0.1 --port 0`: the same
service a GPU box runs, so the edge always talks the one protocol. It listens on loopback only,
with a random bearer token passed through the environment (not the command line). We read its
ready line, wait for the standard health check to say SERVING, and on `stop()` send SIGTERM, then
SIGKILL after a timeout. The child also exits by itself if this process dies (--exit-with-parent).
"""
from __future__ import annotations

import os
import queue
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgespec.common import wire
from edgespec.common.errors import VerifierUnavailableError

READY_RE = re.compile(r"^edgespec-verifier listening on (\S+)$")


def _terminate(proc: subprocess.Popen, timeout_s: float) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


class EmbeddedVerifier:
    """A verifier service child process (default on 127.0.0.1), ready (health SERVING) when constructed."""

    def __init__(self, model: str | os.PathLike, *, n_ctx: int = 4096, max_nodes: int | None = None,
                 max_depth: int | None = None, max_sessions: int = 4, extra_args: Sequence[str] = (),
                 startup_timeout_s: float = 300.0, stop_timeout_s: float = 5.0, host: str = "127.0.0.1",
                 command_prefix: Sequence[str] = (), wait_serving: bool = True) -> None:
        """`command_prefix` runs the child through another command (the benchmarks use
        `ip netns exec NS` to put it in a network namespace; `wait_serving=False` then, because the
        health check would come from this process's namespace)."""
        self.model = str(model)
        self.token = secrets.token_urlsafe(24)
        self.stop_timeout_s = stop_timeout_s
        cmd = [*command_prefix, sys.executable, "-m", "edgespec", "verifier", "serve", "--model", self.model,
               "--host", host, "--port", "0", "--n-ctx", str(n_ctx),
               "--max-sessions", str(max_sessions), "--exit-with-parent"]
        if max_nodes is not None:
            cmd += ["--max-nodes", str(max_nodes)]
        if max_depth is not None:
            cmd += ["--max-depth", str(max_depth)]
        cmd += list(extra_args)
        env = dict(os.environ, EDGESPEC_TOKEN=self.token, PYTHONUNBUFFERED="1")
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr,
                                     env=env, text=True, start_new_session=True)  # Ctrl-C is the parent's to handle
        self._finalizer = weakref.finalize(self, _terminate, self.proc, stop_timeout_s)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, name="edgespec-embedded-stdout", daemon=True).start()
        try:
            self.address = self._wait_ready(startup_timeout_s)
            if wait_serving:
                self._wait_serving(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:  # keep draining so the child never blocks on a full pipe
                self._lines.put(line.rstrip("\n"))
        except (OSError, ValueError):  # closed by stop()
            pass
        self._lines.put(None)

    def _stderr_tail(self, n: int = 4000) -> str:
        try:
            self._stderr.seek(0)
            return self._stderr.read().decode("utf-8", "replace")[-n:].strip()
        except (OSError, ValueError):
            return ""

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise VerifierUnavailableError(f"the embedded verifier did not start within {timeout_s:g} s: "
                                               f"{self._stderr_tail()}") from None
            if line is None:
                self.proc.wait(timeout=5)
                raise VerifierUnavailableError(f"the embedded verifier exited with code {self.proc.returncode}: "
                                               f"{self._stderr_tail() or 'no output'}")
            m = READY_RE.match(line)
            if m:
                return m.group(1)

    def _wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError as exc:
                    last = f"{exc.code().name}: {exc.details()}"
                else:
                    last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise VerifierUnavailableError(f"the embedded verifier is not serving ({last}): {self._stderr_tail()}")
                time.sleep(0.05)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after stop_timeout_s; returns the exit code."""
        self._finalizer.detach()
        _terminate(self.proc, self.stop_timeout_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        return self.proc.returncode

    close = stop

    def __enter__(self) -> "EmbeddedVerifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
