"""Helpers (not tests) for the daemon tests: a real `edgespec serve` process on loopback."""
from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from grpc_helpers import stop_process

LISTENING = re.compile(r"^edgespec-serve listening on (\S+)$")


class DaemonProcess:
    """`python -m edgespec serve ARGS --port 0`; `url` once it printed its ready line."""

    def __init__(self, *args: str, config: str | None = None, tmp: Path | None = None, env: dict | None = None,
                 timeout_s: float = 180, wait_ready: bool = True) -> None:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("EDGESPEC_") or k == "EDGESPEC_HOME"}
        full_env.update(PYTHONUNBUFFERED="1", **(env or {}))
        cmd = [sys.executable, "-m", "edgespec", "serve", "--host", "127.0.0.1", "--port", "0", *args]
        if config is not None:
            path = (tmp or Path("/tmp")) / "edgespec.toml"
            path.write_text(config)
            cmd += ["--config", str(path)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
        self.stderr: list[str] = []
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, args=(self.proc.stderr, self.stderr), daemon=True).start()
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = ""
        line = self.next_line(timeout_s)
        m = LISTENING.match(line or "")
        if not m:
            self.stop()
            raise RuntimeError(f"daemon did not start (exit {self.proc.returncode}): {line!r} {''.join(self.stderr)}")
        self.url = m.group(1)
        if wait_ready:
            line = self.next_line(timeout_s)
            if line != "edgespec-serve ready":
                self.stop()
                raise RuntimeError(f"daemon not ready: {line!r} {''.join(self.stderr)}")

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    @staticmethod
    def _drain(stream, sink: list[str]) -> None:  # noqa: ANN001
        for line in stream:
            sink.append(line)

    def next_line(self, timeout_s: float) -> str | None:
        try:
            return self.lines.get(timeout=timeout_s)
        except queue.Empty:
            return None

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def client(self, **kwargs):  # noqa: ANN003, ANN201
        import openai

        return openai.OpenAI(base_url=self.api, api_key=kwargs.pop("api_key", "unused"),
                             max_retries=kwargs.pop("max_retries", 0), timeout=kwargs.pop("timeout", 300), **kwargs)

    def stop(self, timeout_s: float = 30) -> int:
        return stop_process(self.proc, timeout_s)

    def wait_exit(self, timeout_s: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            time.sleep(0.1)   # let the stderr pump finish
