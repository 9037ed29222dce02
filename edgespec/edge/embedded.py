"""The bundled verifier as a child process: `EdgeSession()` with no verifier address uses this.

    with EmbeddedVerifier(modelstore.resolve("target")) as ev:
        link = RemoteVerifier(ev.address, token=ev.token, tokenizer_hash=...)   # or EdgeSession()

The child is `python -m edgespec verifier serve --model PATH --host 127.0.0.1 --port 0`: the same
service a GPU box runs, so the edge always talks the one protocol. It listens on loopback only,
with a random bearer token passed through the environment (not the command line). We read its
ready line, wait for the standard health check (edge/health.py) to say SERVING, and on `stop()` send SIGTERM, then
SIGKILL after a timeout. The child also exits by itself if this process dies (--exit-with-parent).
"""
from __future__ import annotations

import logging
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
from typing import IO, Sequence

from edgespec.common.errors import VerifierUnavailableError
from edgespec.edge import health

log = logging.getLogger(__name__)
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
    """A verifier service child process (default on 127.0.0.1), ready (health SERVING) when constructed.

    A child that dies (crash, OOM killer, SIGKILL) is replaced by `ensure_running()`, which the
    session's failover probe calls before each health check: the new child listens on a new port,
    so the probe re-attaches to `address` as returned. Restarts that fail back off exponentially
    (restart_backoff_s doubling up to MAX_RESTART_BACKOFF_S) so a child that cannot start does not
    spin; the failover session keeps answering locally meanwhile.
    """

    MAX_RESTART_BACKOFF_S = 60.0

    def __init__(self, model: str | os.PathLike, *, n_ctx: int = 4096, max_nodes: int | None = None,
                 max_depth: int | None = None, max_sessions: int = 4, extra_args: Sequence[str] = (),
                 startup_timeout_s: float = 300.0, stop_timeout_s: float = 5.0, host: str = "127.0.0.1",
                 command_prefix: Sequence[str] = (), wait_serving: bool = True,
                 restart_backoff_s: float = 1.0) -> None:
        """`command_prefix` runs the child through another command (the benchmarks use
        `ip netns exec NS` to put it in a network namespace; `wait_serving=False` then, because the
        health check would come from this process's namespace)."""
        self.model = str(model)
        # hex, not urlsafe: a urlsafe token can start with '-', which argparse reads as an option
        self.token = secrets.token_hex(24)
        self.stop_timeout_s = stop_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.wait_serving = wait_serving
        cmd = [*command_prefix, sys.executable, "-m", "edgespec", "verifier", "serve", "--model", self.model,
               "--host", host, "--port", "0", "--n-ctx", str(n_ctx),
               "--max-sessions", str(max_sessions), "--exit-with-parent"]
        if max_nodes is not None:
            cmd += ["--max-nodes", str(max_nodes)]
        if max_depth is not None:
            cmd += ["--max-depth", str(max_depth)]
        self._cmd = cmd + list(extra_args)
        self._env = dict(os.environ, EDGESPEC_TOKEN=self.token, PYTHONUNBUFFERED="1")
        self._lock = threading.Lock()          # guards proc / _stderr / _lines / _stopped
        self._restart_lock = threading.Lock()  # one restart at a time
        self._stopped = False
        self._restart_backoff_s = self._backoff_s = restart_backoff_s
        self._next_restart = 0.0
        self.restarts = 0
        self.proc: subprocess.Popen | None = None
        self._stderr: IO[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        try:
            self.address = self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> str:
        """Spawn a child, wait for its ready line (and health SERVING); returns its address."""
        stderr = tempfile.TemporaryFile()
        proc = subprocess.Popen(self._cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
                                env=self._env, text=True, start_new_session=True)  # Ctrl-C is the parent's
        lines: queue.Queue = queue.Queue()
        with self._lock:
            old_stderr = self._stderr
            self.proc, self._stderr, self._lines = proc, stderr, lines
            if self._finalizer is not None:
                self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _terminate, proc, self.stop_timeout_s)
            stopped = self._stopped
        if old_stderr is not None:
            old_stderr.close()
        threading.Thread(target=self._pump, args=(proc, lines), name="edgespec-embedded-stdout", daemon=True).start()
        if stopped:  # stop() ran while we were spawning
            _terminate(proc, self.stop_timeout_s)
            raise VerifierUnavailableError("the embedded verifier was stopped")
        address = self._wait_ready(self.startup_timeout_s)
        if self.wait_serving:
            self._wait_serving(address, self.startup_timeout_s)
        return address

    def ensure_running(self) -> str:
        """The address of a running child; a dead one is replaced first (see the class docstring).
        Raises VerifierUnavailableError when stopped, while backing off, or when the restart fails."""
        with self._restart_lock:
            with self._lock:
                if self._stopped:
                    raise VerifierUnavailableError("the embedded verifier was stopped")
                if self.proc is not None and self.proc.poll() is None:
                    return self.address
                code = None if self.proc is None else self.proc.returncode
                wait_s = self._next_restart - time.monotonic()
            if wait_s > 0:
                raise VerifierUnavailableError(f"the embedded verifier exited (code {code}); "
                                               f"next restart in {wait_s:.1f} s")
            log.warning("the embedded verifier exited with code %s, restarting it: %s", code, self._stderr_tail(800))
            try:
                address = self._start()
            except BaseException:
                with self._lock:
                    failed = self.proc
                if failed is not None:
                    _terminate(failed, self.stop_timeout_s)
                self._next_restart = time.monotonic() + self._backoff_s
                self._backoff_s = min(2 * self._backoff_s, self.MAX_RESTART_BACKOFF_S)
                raise
            self.address, self._backoff_s = address, self._restart_backoff_s
            self.restarts += 1
            return address

    @staticmethod
    def _pump(proc: subprocess.Popen, lines: queue.Queue) -> None:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:  # keep draining so the child never blocks on a full pipe
                lines.put(line.rstrip("\n"))
        except (OSError, ValueError):  # closed by stop()
            pass
        lines.put(None)

    def _stderr_tail(self, n: int = 4000) -> str:
        if self._stderr is None:
            return ""
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

    def _wait_serving(self, address: str, timeout_s: float) -> None:
        ok, seen = health.wait_serving(address, timeout_s, alive=lambda: self.proc.poll() is None)
        if not ok:
            raise VerifierUnavailableError(f"the embedded verifier is not serving ({seen}): {self._stderr_tail()}")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after stop_timeout_s; returns the exit code. A restart in
        progress is cut short (its child is terminated as soon as it is spawned)."""
        with self._lock:
            self._stopped = True
            proc, stderr = self.proc, self._stderr
            if self._finalizer is not None:
                self._finalizer.detach()
        if proc is None:
            return None
        _terminate(proc, self.stop_timeout_s)
        if proc.stdout is not None:
            proc.stdout.close()
        if stderr is not None:
            stderr.close()
        return proc.returncode

    close = stop

    def __enter__(self) -> "EmbeddedVerifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
