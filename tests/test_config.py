"""Configuration: file < environment < flags, validation errors that name the key, `config show`."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edgespec import config
from edgespec.config import ConfigError


def write(tmp_path, text: str):
    path = tmp_path / "edgespec.toml"
    path.write_text(text)
    return path


def test_precedence_and_sources(tmp_path):
    path = write(tmp_path, '[serve]\nport = 9000\nhost = "0.0.0.0"\nmax_queue = 3\n[edge]\nlocal = true\n')
    cfg = config.load(path, env={"EDGESPEC_SERVE_PORT": "9001", "EDGESPEC_SERVE_MAX_QUEUE": "4"},
                      cli={"serve.max_queue": "5"})
    assert cfg.get("serve.port") == 9001 and cfg.source("serve.port") == "env EDGESPEC_SERVE_PORT"
    assert cfg.get("serve.host") == "0.0.0.0" and cfg.source("serve.host") == f"file {path}"
    assert cfg.get("serve.max_queue") == 5 and cfg.source("serve.max_queue") == "cli --max-queue"
    assert cfg.get("edge.local") is True
    assert cfg.get("serve.sessions") == 1 and cfg.source("serve.sessions") == "default"
    assert cfg.get("edge.draft_threads") is None   # auto


def test_missing_default_file_means_defaults(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "DEFAULT_PATH", tmp_path / "absent.toml")
    cfg = config.load(env={})
    assert cfg.path is None and cfg.get("serve.port") == 8080
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "absent.toml", env={})
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(env={"EDGESPEC_CONFIG": str(tmp_path / "absent.toml")})


@pytest.mark.parametrize("text, env, message", [
    ("[serve]\nprot = 1\n", {}, r"unknown key serve.prot \(did you mean port\?\)"),
    ("[srve]\nport = 1\n", {}, r"unknown section \[srve\] \(did you mean serve\?\)"),
    ('[serve]\nport = "80"\n', {}, r"serve.port: expected an integer, got '80' \(from file "),
    ("[serve]\nport = 70000\n", {}, r"serve.port: must be <= 65535, got 70000"),
    ("[serve]\nport = \n", {}, r"invalid TOML"),
    ("[edge]\nlocal = 1\n", {}, r"edge.local: expected true or false, got 1"),
    ("[edge]\nn_ctx = 8\n", {}, r"edge.n_ctx: must be >= 64"),
    ("", {"EDGESPEC_EDGE_DEADLINE_S": "-1"}, r"edge.deadline_s: must be > 0, got -1.0 \(from env EDGESPEC_EDGE_DEADLINE_S\)"),
    ("", {"EDGESPEC_EDGE_FALLBACK": "maybe"}, r"edge.fallback: expected true or false, got 'maybe'"),
    ("", {"EDGESPEC_SERVE_LOG_LEVEL": "loud"}, r"serve.log_level: must be one of debug, info"),
    ("[edge]\nlocal = true\nverifier = \"h:1\"\n", {}, r"edge.local .* and edge.verifier .* exclude each other"),
    ("[serve]\nmax_tokens = 10\nmax_tokens_limit = 5\n", {}, r"serve.max_tokens \(10\) must be <= serve.max_tokens_limit"),
])
def test_errors_name_the_key(tmp_path, text, env, message):
    with pytest.raises(ConfigError, match=message):
        config.load(write(tmp_path, text), env=env)


def test_auto_values_round_trip(tmp_path):
    cfg = config.load(write(tmp_path, '[edge]\nchain = "auto"\ndraft_threads = 2\n'), env={"EDGESPEC_EDGE_CHAIN": "3"})
    assert cfg.get("edge.chain") == 3 and cfg.get("edge.draft_threads") == 2
    assert config.session_kwargs(cfg)["draft_threads"] == 2


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True,
                          env=base | (env or {}), timeout=120)


def test_config_show_prints_values_and_sources(tmp_path):
    path = write(tmp_path, '[serve]\nport = 9000\napi_key = "s3cret"\n')
    r = run_cli("config", "show", "--config", str(path), "--sessions", "2", env={"EDGESPEC_SERVE_HOST": "0.0.0.0"})
    assert r.returncode == 0, r.stderr
    lines = {line.split("=")[0].strip(): line for line in r.stdout.splitlines() if "=" in line}
    assert lines["port"].endswith(f"# file {path}") and "9000" in lines["port"]
    assert '"0.0.0.0"' in lines["host"] and lines["host"].endswith("# env EDGESPEC_SERVE_HOST")
    assert lines["sessions"].endswith("# cli --sessions")
    assert "s3cret" not in r.stdout and "(set, hidden)" in lines["api_key"]
    j = run_cli("config", "show", "--config", str(path), "--json")
    settings = json.loads(j.stdout)["settings"]
    assert settings["serve.port"] == {"value": 9000, "source": f"file {path}"}


def test_bad_config_exits_2_naming_the_key(tmp_path):
    r = run_cli("config", "show", "--config", str(write(tmp_path, "[serve]\nsessions = 0\n")))
    assert r.returncode == 2 and "serve.sessions: must be >= 1, got 0" in r.stderr
    r = run_cli("serve", "--config", str(write(tmp_path, "[serve]\nport = 'x'\n")))
    assert r.returncode == 2 and "serve.port: expected an integer" in r.stderr and "Traceback" not in r.stderr
