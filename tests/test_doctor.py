"""`edgespec doctor` against real things: model files in a scratch EDGESPEC_HOME, a real verifier
process (gRPC health), a real UDP SNTP responder whose clock is off by a chosen amount."""
from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time

from edgespec.cli.doctor import CPU_FLAGS, NTP_EPOCH, build_features, cpu_flags
from edgespec.common import modelstore
from grpc_helpers import ServerProcess


class SntpServer:
    """Answers SNTP requests on 127.0.0.1 with this machine's time plus `offset_s`."""

    def __init__(self, offset_s: float) -> None:
        self.offset_s = offset_s
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                _, peer = self.sock.recvfrom(512)
            except OSError:
                return
            now = time.time() + self.offset_s + NTP_EPOCH
            stamp = struct.pack("!2I", int(now), int((now % 1) * 2**32))
            self.sock.sendto(b"\x24\x02" + 30 * b"\0" + stamp + stamp, peer)

    def close(self) -> None:
        self.sock.close()


def doctor(*args: str, home=None) -> tuple[int, list[dict], str]:  # noqa: ANN001
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGESPEC_")}
    env["EDGESPEC_HOME"] = str(home or modelstore.home_dir())
    r = subprocess.run([sys.executable, "-m", "edgespec", "doctor", "--json", "--timeout-s", "5", *args],
                       capture_output=True, text=True, timeout=300, env=env)
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else []), r.stderr


def by_check(findings: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in findings:
        out.setdefault(f["check"], []).append(f)
    return out


def test_healthy_device_exits_0():
    ntp = SntpServer(0.0)
    verifier = ServerProcess("test")
    try:
        code, findings, err = doctor("--draft", "test", "--target", "test", "--verifier", verifier.address,
                                     "--ntp-server", ntp.address)
    finally:
        verifier.stop()
        ntp.close()
    assert code == 0, (findings, err)
    checks = by_check(findings)
    assert set(checks) == {"config", "models", "cpu", "privacy", "verifier", "clock", "disk"}
    assert all(f["status"] == "ok" for f in findings), findings
    assert "SERVING" in checks["verifier"][0]["message"]
    assert "sha256" in checks["models"][0]["message"]


def test_every_problem_is_reported_with_a_fix(tmp_path):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    spec = modelstore.load_manifest().get("test")
    (home / "models" / modelstore.model_path(spec).name).write_bytes(b"GGUF" + b"\0" * 100)   # truncated
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
    ntp = SntpServer(30.0)
    try:
        code, findings, err = doctor("--draft", "test", "--target", str(tmp_path / "nope.gguf"), "--verifier", dead,
                                     "--ntp-server", ntp.address, home=home)
    finally:
        ntp.close()
    assert code == 1, (findings, err)
    checks = by_check(findings)
    draft, target = checks["models"]
    assert draft["status"] == "FAIL" and "partial" in draft["message"] and "edgespec models fetch" in draft["fix"]
    assert target["status"] == "FAIL" and "nope.gguf" in target["message"]
    assert checks["verifier"][0]["status"] == "FAIL" and "UNAVAILABLE" in checks["verifier"][0]["message"]
    clock = checks["clock"][0]
    assert clock["status"] == "FAIL" and "timedatectl" in clock["fix"]
    offset = float(re.search(r"clock is ([+-][0-9.]+) s off", clock["message"]).group(1))
    assert abs(offset - 30.0) < 0.5, clock["message"]   # the SNTP round trip blurs the offset by a few ms


def test_bad_config_is_a_problem(tmp_path):
    bad = tmp_path / "edgespec.toml"
    bad.write_text("[edge]\nn_ctx = 'big'\n")
    code, findings, _ = doctor("--config", str(bad), "--ntp-server", "none")
    assert code == 1
    config = by_check(findings)["config"][0]
    assert config["status"] == "FAIL" and "edge.n_ctx: expected an integer" in config["message"]


def test_cpu_features_versus_the_build():
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    info = info.decode() if isinstance(info, bytes) else info
    used = {k for k, on in build_features(info).items() if on}
    assert used, info   # this build reports its features
    real = cpu_flags(open("/proc/cpuinfo").read())
    assert all(CPU_FLAGS[name] in real for name in used)
    # the same build on a CPU without AVX2 (an old Atom, an emulator): doctor must say so
    weaker = {flag for flag in real if flag not in ("avx2", "fma")}
    missing = [name for name in used if CPU_FLAGS[name] not in weaker]
    if "AVX2" in used:
        assert "AVX2" in missing


def test_human_output_says_what_to_fix(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGESPEC_")}
    r = subprocess.run([sys.executable, "-m", "edgespec", "doctor", "--draft", str(tmp_path / "x.gguf"),
                        "--local", "--ntp-server", "none"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1
    assert "FAIL  models" in r.stdout and "fix: set edge.draft" in r.stdout and "problem(s)" in r.stdout


def test_privacy_analyzer_check():
    code, findings, err = doctor("--local", "--draft", "test", "--target", "test", "--privacy", "presidio",
                                 "--ntp-server", "none")
    privacy = by_check(findings)["privacy"][0]
    assert privacy["status"] == "ok" and "masks a test address" in privacy["message"], (privacy, err)
    assert code == 0
