"""The daemon under systemd's eyes, with real processes and sockets: sd_notify datagrams on a unix
socket set as NOTIFY_SOCKET (READY only once the models are loaded, watchdog pings that stop while a
decode step hangs and resume after), a dead verifier (clear 503 or a local fallback, the daemon keeps
serving, metrics show the switch), and the unit files checked by `systemd-analyze verify`."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

try:
    import httpx2 as httpx
except ImportError:  # openai 1.x
    import httpx
import openai
import pytest

from grpc_helpers import ServerProcess
from serve_helpers import DaemonProcess

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


class NotifySocket:
    """A bound AF_UNIX datagram socket collecting (monotonic time, message) like systemd would,
    and, like systemd, the sender's pid from its credentials (SO_PASSCRED): NotifyAccess=main
    ignores messages from any other process."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self.senders: set[int] = set()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except socket.timeout:
                continue
            except OSError:
                return
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    self.senders.add(struct.unpack("3i", payload[:12])[0])
            self.messages.append((time.monotonic(), data.decode()))

    def first(self, field: str, timeout_s: float = 180) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for t, m in list(self.messages):
                if field in m.split("\n"):
                    return t
            time.sleep(0.02)
        raise AssertionError(f"no {field} within {timeout_s} s: {self.messages}")

    def pings(self, since: float = 0.0) -> list[float]:
        return [t for t, m in self.messages if m == "WATCHDOG=1" and t >= since]

    def close(self) -> None:
        self._stop.set()
        self.thread.join()
        self.sock.close()


def health(url: str) -> tuple[int, dict]:
    r = httpx.get(url + "/health", timeout=30)
    return r.status_code, r.json()


def test_ready_only_after_models_load_then_watchdog_pings(tmp_path):
    notify = NotifySocket(tmp_path / "notify.sock")
    # bundled verifier mode: loading starts a verifier child, so the loading phase is observable
    d = DaemonProcess("--draft", "test", "--target", "test", wait_ready=False,
                      env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"})
    try:
        seen = []
        while not any(m.startswith("READY=1") for _, m in notify.messages) and d.proc.poll() is None:
            seen.append((time.monotonic(), *health(d.url)))
            time.sleep(0.05)
        ready_at = notify.first("READY=1")
        before = [(code, body["status"]) for t, code, body in seen if t < ready_at - 0.5]
        assert before and set(before) == {(503, "loading")}, before
        assert notify.messages[0][1].startswith("STATUS=loading"), notify.messages[:2]
        assert not notify.pings() or min(notify.pings()) > ready_at   # no ping before READY
        # READY means serving: the first request right after it is answered
        r = d.client().chat.completions.create(model="edgespec", messages=PROMPT, max_tokens=3)
        assert r.choices[0].message.content
        assert health(d.url) == (200, health(d.url)[1]) and health(d.url)[1]["status"] == "ok"
        time.sleep(1.5)
        pings = notify.pings(since=ready_at)
        assert len(pings) >= 4, notify.messages
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        assert max(gaps) < 1.0, gaps        # every WATCHDOG_USEC / 2 = 0.2 s, with slack for load
    finally:
        code = d.stop()
        notify.close()
    assert code == 0, "".join(d.stderr)
    assert any(m == "STOPPING=1" for _, m in notify.messages)
    # only the daemon speaks: its bundled verifier child must not report READY or pings for it
    assert notify.senders == {d.proc.pid}, (notify.senders, d.proc.pid)


@pytest.fixture()
def verifier():
    v = ServerProcess("test", "--keepalive-s", "0")
    yield v
    if v.proc.poll() is None:
        os.kill(v.proc.pid, signal.SIGCONT)
    v.stop()


def test_watchdog_pings_stop_while_a_step_hangs(tmp_path, verifier):
    notify = NotifySocket(tmp_path / "notify.sock")
    d = DaemonProcess("--draft", "test", "--target", "test", "--verifier", verifier.address, "--no-fallback",
                      "--deadline-s", "120", "--hang-timeout-s", "2",
                      env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"})
    chunks: list[float] = []
    try:
        notify.first("READY=1")

        def read() -> None:
            try:
                with d.client().chat.completions.create(model="edgespec", messages=PROMPT, max_tokens=400,
                                                        stream=True) as s:
                    for _ in s:
                        chunks.append(time.monotonic())
            except openai.APIConnectionError:   # the daemon stops at the end of the test
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while len(chunks) < 3:
            time.sleep(0.02)
        os.kill(verifier.proc.pid, signal.SIGSTOP)     # the verifier freezes: the decode step hangs
        frozen = time.monotonic()
        time.sleep(5)
        assert not chunks or chunks[-1] < frozen + 1.0
        pings_while_hung = notify.pings(since=frozen + 3.0)   # hang_timeout 2 s + one ping interval + slack
        code, body = health(d.url)
        assert not pings_while_hung, pings_while_hung
        assert code == 503 and body["status"] == "unhealthy" and "no progress" in body["problem"]
        assert any(m.startswith("STATUS=unhealthy") for _, m in notify.messages)
        os.kill(verifier.proc.pid, signal.SIGCONT)   # it answers again: progress, pings come back
        resumed = time.monotonic()
        # recovery, polled rather than timed: on a loaded CI host the first steps after SIGCONT can take seconds
        code, body = health(d.url)
        while code != 200 and time.monotonic() < resumed + 30:
            time.sleep(0.2)
            code, body = health(d.url)
        assert code == 200, body
        assert any(t > resumed for t in chunks), "the stream did not resume"
        time.sleep(1.0)
        assert notify.pings(since=resumed), notify.messages[-5:]
    finally:
        assert d.stop() == 0, "".join(d.stderr)
        notify.close()


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_dead_verifier_clear_error_or_fallback_and_the_daemon_keeps_serving(verifier):
    strict = DaemonProcess("--draft", "test", "--target", "test", "--verifier", verifier.address, "--no-fallback",
                           "--deadline-s", "5")
    failover = DaemonProcess("--draft", "test", "--target", "test", "--verifier", verifier.address,
                             "--deadline-s", "3", "--probe-interval-s", "60")
    try:
        for d in (strict, failover):
            assert d.client().chat.completions.create(model="edgespec", messages=PROMPT, max_tokens=3).choices
        m = _metrics(failover.url)
        assert m["edgespec_edge_fallback_active"] == 0 and m["edgespec_edge_rtt_ms"] > 0
        assert m['edgespec_edge_breaker_state{state="closed"}'] == 1
        verifier.stop()
        with pytest.raises(openai.APIStatusError) as info:
            strict.client().chat.completions.create(model="edgespec", messages=PROMPT, max_tokens=3)
        assert info.value.status_code == 503 and info.value.body["code"] == "verifier_unavailable"
        assert "verifier" in info.value.body["message"]
        assert [x.id for x in strict.client().models.list().data] == ["edgespec"]   # still serving
        assert health(strict.url)[0] == 200
        # with fallback the device's own target answers, and the metrics say so
        r = failover.client().chat.completions.create(model="edgespec", messages=PROMPT, max_tokens=3)
        assert r.choices[0].message.content
        m = _metrics(failover.url)
        assert m["edgespec_edge_fallback_active"] == 1
        assert m["edgespec_edge_failover_switches_total"] >= 1
        assert m['edgespec_edge_failover_events_total{event="local_steps"}'] >= 1
        assert m['edgespec_edge_breaker_state{state="open"}'] == 1
    finally:
        for d in (strict, failover):
            assert d.stop() == 0, "".join(d.stderr)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing: tools/setup.sh "
                    "installs the systemd package")
def test_units_pass_systemd_analyze_verify(tmp_path):
    """The units as installed: their ExecStart binary must exist, so point it at this venv's edgespec."""
    exe = ROOT / ".venv" / "bin" / "edgespec"
    assert exe.exists()
    for unit in ("edgespec-edge.service", "edgespec-verifier.service"):
        text = (ROOT / "jetson" / unit).read_text().replace("/opt/edgespec/venv/bin/edgespec", str(exe))
        assert "Type=notify" in text and "Restart=on-failure" in text and "WatchdogSec=" in text
        assert "NoNewPrivileges=yes" in text and "ProtectSystem=strict" in text and "User=edgespec" in text
        (tmp_path / unit).write_text(text)
        r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / unit)],
                           capture_output=True, text=True, timeout=120)
        problems = [line for line in (r.stdout + r.stderr).splitlines()
                    if unit in line or "edgespec" in line]
        assert r.returncode == 0 and not problems, r.stdout + r.stderr


def test_jetson_install_script_dry_run():
    """What jetson/install.sh would do (it needs root and a Jetson to run for real): the CUDA build
    for sm_87, the service user, the models fetched as that user, units installed and checked."""
    r = subprocess.run(["bash", str(ROOT / "jetson" / "install.sh"), "--dry-run", "--verifier"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=87" in out
    assert "useradd --system" in out and "runuser -u edgespec" in out and "models fetch default" in out
    assert "systemd-analyze verify /etc/systemd/system/edgespec-edge.service" in out
    assert "systemctl enable --now edgespec-edge.service edgespec-verifier.service" in out
    assert "[edge]" in out or "src[edge]" in out
    assert "--no-build-isolation" in out and "grpcio-tools" in out   # stubs built by the pinned grpcio-tools
    bad = subprocess.run(["bash", str(ROOT / "jetson" / "install.sh"), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_example_config_is_valid():
    from edgespec import config

    cfg = config.load(ROOT / "jetson" / "edgespec.toml", env={})
    assert cfg.get("edge.draft_gpu_layers") == -1 and cfg.source("serve.port").startswith("file ")
