"""What an operator trying the CLI hit (issue 12's polish list), each on real processes."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from edgespec.cli import build_parser
from grpc_helpers import ServerProcess, make_tls_files


def cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if k != "EDGESPEC_TOKEN"} | (env or {})
    return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True,
                          timeout=timeout, env=full)


def test_version_and_top_level_help():
    r = cli("--version")
    assert r.returncode == 0 and re.fullmatch(r"edgespec \d+\.\d+\.\d+\S*\n", r.stdout)
    h = cli("--help").stdout
    assert "add_parser" not in h and "one module per sub-command" not in h
    assert "speculative decoding" in h and "Exit codes" in h
    for command in ("run", "serve", "config", "doctor", "models", "verifier", "bench"):
        assert command in h


def test_every_run_option_has_help_and_shows_defaults():
    parser = build_parser()
    run = parser._subparsers._group_actions[0].choices["run"]   # noqa: SLF001 - argparse has no public accessor
    missing = [a.option_strings for a in run._actions if a.option_strings and not a.help]   # noqa: SLF001
    assert not missing
    text = run.format_help()
    for flag in ("--max-tokens", "--top-p", "--top-k", "--seed", "--n-ctx"):
        block = text.split(flag, 1)[1].split("\n  --", 1)[0]
        assert "default" in block, (flag, block)


def test_json_stats_is_strict_json_with_a_verifier():
    with_verifier = ServerProcess("test")
    try:
        r = cli("run", "Say hi.", "--draft", "test", "--target", "test", "--verifier", with_verifier.address,
                "--max-tokens", "4", "--json-stats")
    finally:
        with_verifier.stop()
    assert r.returncode == 0, r.stderr
    line = r.stderr.strip().splitlines()[-1]

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    stats = json.loads(line, parse_constant=refuse)    # Infinity / NaN would raise here
    assert stats["tokens"] >= 1 and "planner" in stats and stats["planner"]["uplink_mbit_s"] in (None,) or \
        isinstance(stats["planner"]["uplink_mbit_s"], float)


@pytest.fixture(scope="module")
def verifier():
    v = ServerProcess("test", "--metrics-port", "0", token="s3cret")
    yield v
    v.stop()


def test_second_verifier_on_the_same_port_is_refused(verifier):
    r = cli("verifier", "serve", "--model", "test", "--port", str(verifier.port))
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{verifier.port}: the port is in use" in r.stderr
    assert "Traceback" not in r.stderr
    assert verifier.alive


def test_busy_port_held_by_another_program():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        r = cli("verifier", "serve", "--model", "test", "--port", str(port))
    assert r.returncode == 2 and "the port is in use" in r.stderr and "Traceback" not in r.stderr


def test_swapped_or_bad_tls_files(tmp_path):
    ca, cert, key = make_tls_files(tmp_path)
    r = cli("verifier", "serve", "--model", "test", "--port", "0", "--tls-cert", str(key), "--tls-key", str(cert))
    assert r.returncode == 2 and "look swapped" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli("verifier", "serve", "--model", "test", "--port", "0", "--tls-cert", str(ca), "--tls-key",
            str(tmp_path / "missing.pem"))
    assert r.returncode == 2 and "cannot read the TLS key file" in r.stderr, r.stderr


def test_failed_logins_are_logged_and_counted(verifier):
    import urllib.request

    from edgespec.v1 import edgespec_pb2 as pb
    from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

    for md in ([("authorization", "Bearer wrong")], []):
        with grpc.insecure_channel(verifier.address) as ch:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.VerifierStub(ch).Info(pb.InfoRequest(), metadata=md, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "".join(verifier.stderr).count("refused /edgespec.v1.Verifier/Info") < 2:
        time.sleep(0.1)
    log = "".join(verifier.stderr)
    assert "refused /edgespec.v1.Verifier/Info: invalid bearer token" in log
    assert "refused /edgespec.v1.Verifier/Info: missing authorization metadata" in log
    assert "s3cret" not in log and "wrong" not in log
    url = re.search(r"metrics on (http://\S+/metrics)", log).group(1)
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'edgespec_verifier_auth_failures_total{reason="invalid"} 1.0' in text
    assert 'edgespec_verifier_auth_failures_total{reason="missing"} 1.0' in text


def test_info_shows_zero_counters_as_numbers(verifier):
    r = cli("verifier", "info", verifier.address, env={"EDGESPEC_TOKEN": "s3cret"})
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    for counter in ("evictions", "resyncs", "verifies", "prefix_hits", "prefix_tokens_reused", "open_streams"):
        assert info[counter] == 0 and type(info[counter]) is int, (counter, info.get(counter))
    assert type(info["n_ctx"]) is int and info["model_id"]


@pytest.mark.parametrize("service", ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"])
def test_reflection_v1_and_v1alpha(verifier, service):
    """What grpcurl does: list the services, then fetch a service's file descriptor."""
    with grpc.insecure_channel(verifier.address) as ch:
        call = ch.stream_stream(f"/{service}/ServerReflectionInfo",
                                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        md = [("authorization", "Bearer s3cret")]
        replies = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services=""),
                                  reflection_pb2.ServerReflectionRequest(
                                      file_containing_symbol="edgespec.v1.Verifier"),
                                  reflection_pb2.ServerReflectionRequest(
                                      file_containing_symbol="grpc.reflection.v1.ServerReflection")]),
                            metadata=md, timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"edgespec.v1.Verifier", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    assert replies[1].file_descriptor_response.file_descriptor_proto
    assert replies[2].file_descriptor_response.file_descriptor_proto, replies[2]
