"""A verifier that was never reached is a configuration mistake (edgespec/edge/first_contact.py):
`edgespec run` exits with code 2 and a message naming the cause, and never quietly verifies with
the local target instead. The fallback is for a verifier that worked and then failed
(tests/test_failover.py); `--local-first` starts locally on purpose.

Real parts: `edgespec verifier serve` processes (TLS with a throw-away CA, a bearer token), the
CLI as a subprocess, SmolLM2 as draft and target.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from grpc_helpers import ServerProcess, make_tls_files

TOKEN = "s3cret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, smol_path):
    """A TLS verifier with a token; (server, its CA, a CA that did not sign it)."""
    ca, cert, key = make_tls_files(tmp_path_factory.mktemp("tls"))
    other_ca, _, _ = make_tls_files(tmp_path_factory.mktemp("other"))
    srv = ServerProcess(smol_path, "--n-ctx", "1024", "--tls-cert", str(cert), "--tls-key", str(key), token=TOKEN)
    yield srv, ca, other_ca
    srv.stop()


def run(smol_path, *args: str, target=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("EDGESPEC_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "edgespec", "run", "Say hi.", "--draft", str(smol_path),
                           "--target", str(target or smol_path), "--max-tokens", "8", "--deadline", "5", *args],
                          capture_output=True, text=True, timeout=180, env=env)


def assert_config_error(r: subprocess.CompletedProcess, *causes: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "edgespec: error: " in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    for cause in causes:
        assert cause in r.stderr, r.stderr[-3000:]
    # nothing was answered, locally or otherwise
    assert not r.stdout.strip() and "[edgespec] verifying local" not in r.stderr


def test_wrong_tls_settings_token_or_model_exit_2_naming_the_cause(tls_server, smol_path, tmp_path):
    srv, ca, other_ca = tls_server
    address = f"localhost:{srv.port}"
    # the reproduction from the issue: plain text against a TLS verifier used to exit 0 after a quiet
    # local run, saying only "Socket closed"
    assert_config_error(run(smol_path, "--verifier", address, "--token", TOKEN),
                        f"cannot use the verifier at {address}", "probably serves TLS", "--tls-ca")
    assert_config_error(run(smol_path, "--verifier", address, "--token", TOKEN, "--tls-ca", str(other_ca)),
                        "not signed by the CA trusted here")
    assert_config_error(run(smol_path, "--verifier", address, "--token", "nope", "--tls-ca", str(ca)),
                        "refused the bearer token")
    renamed = tmp_path / "some-other-model.gguf"  # the same weights under a name the server does not serve
    renamed.symlink_to(smol_path)
    assert_config_error(run(smol_path, "--verifier", address, "--token", TOKEN, "--tls-ca", str(ca), target=renamed),
                        "refused this edge", "not served")
    # and the same verifier, rightly configured, answers (remote: no switch to local)
    r = run(smol_path, "--verifier", address, "--token", TOKEN, "--tls-ca", str(ca))
    assert r.returncode == 0 and r.stdout.strip() and "[edgespec] verifying local" not in r.stderr, r.stderr[-3000:]


def test_unreachable_or_malformed_address_exit_2_unless_local_first(smol_path):
    dead = f"127.0.0.1:{free_port()}"
    assert_config_error(run(smol_path, "--verifier", "not an address"), "'not an address' is not HOST:PORT")
    for extra in ([], ["--no-fallback"]):
        assert_config_error(run(smol_path, "--verifier", dead, *extra),
                            f"cannot use the verifier at {dead}", "connection refused")
    # local-first: asked for, so the answer comes from the local target, and the switch is reported
    r = run(smol_path, "--verifier", dead, "--local-first")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() and "verifying local from step -1: local-first" in r.stderr
