"""Daemon configuration: one TOML file, then environment variables, then command-line flags.

Every key lives in a section (`[edge]`, `[serve]`) and has one schema entry below, so the file,
the environment (`EDGESPEC_<SECTION>_<KEY>`, e.g. EDGESPEC_SERVE_PORT), the flags of `edgespec
serve` (`--port`) and `edgespec config show` cannot drift apart. Each value remembers where it came
from (default, file, env, cli). Errors name the key and the source, e.g.
`serve.port: expected an integer, got 'abc' (from env EDGESPEC_SERVE_PORT)`.

The default file is /etc/edgespec/edgespec.toml (or $EDGESPEC_CONFIG); a missing default file
means "all defaults", a missing file given with --config is an error.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from edgespec.common.errors import EdgespecError

DEFAULT_PATH = Path("/etc/edgespec/edgespec.toml")
ENV_PATH = "EDGESPEC_CONFIG"
SECRET = "(set, hidden)"


class ConfigError(EdgespecError):
    """A configuration file, variable or flag that cannot be used; the message names the key."""


def _range(low: float | None = None, high: float | None = None) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value is None:
            return None
        if low is not None and value < low:
            return f"must be >= {low}, got {value}"
        if high is not None and value > high:
            return f"must be <= {high}, got {value}"
        return None
    return check


def _positive(value: Any) -> str | None:
    return None if value is None or value > 0 else f"must be > 0, got {value}"


@dataclasses.dataclass(frozen=True)
class Key:
    """One setting: its type (bool, int, float, str), default (None: decided at run time), help."""

    section: str
    name: str
    type: type
    default: Any
    help: str
    check: Callable[[Any], str | None] | None = None
    choices: tuple[str, ...] | None = None
    secret: bool = False

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env(self) -> str:
        return f"EDGESPEC_{self.section}_{self.name}".upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SCHEMA: tuple[Key, ...] = (
    # [edge]: the EdgeSession behind the daemon (see EdgeSession.__init__ for the semantics).
    Key("edge", "draft", str, "draft", "draft model: manifest name, role alias or GGUF path"),
    Key("edge", "target", str, "target", "target model: manifest name, role alias or GGUF path"),
    Key("edge", "verifier", str, "", "remote verifier HOST:PORT (empty: a bundled verifier on loopback)"),
    Key("edge", "local", bool, False, "verify in-process with the target, no gRPC"),
    Key("edge", "token", str, "", "bearer token for the verifier (prefer the env var EDGESPEC_EDGE_TOKEN)",
        secret=True),
    Key("edge", "tls_ca", str, "", "CA certificate (PEM) to trust for the verifier's TLS; empty: no TLS"),
    Key("edge", "deadline_s", float, None, "per-step deadline before a step is verified locally "
        "(default 10 s, 60 s without fallback)", _positive),
    Key("edge", "probe_interval_s", float, 2.0, "how often a failed verifier is probed for re-attaching", _positive),
    Key("edge", "fallback", bool, True, "verify locally when the verifier fails (needs the target on the device)"),
    Key("edge", "local_first", bool, False, "start locally if the verifier is not up yet, attach it later"),
    Key("edge", "n_ctx", int, 4096, "context window in tokens (prompt + answer)", _range(64)),
    Key("edge", "chain", int, None, "classic chain speculation with this many drafts (default: planner trees)",
        _range(1, 64)),
    Key("edge", "privacy", str, "", "PII masking before anything leaves the device: presidio, patterns, "
        "or empty (off); each request gets its own placeholder vault", choices=("", "presidio", "patterns")),
    Key("edge", "pii_strict", bool, False, "refuse a request (400) when the PII analyzer is unavailable or fails, "
        "instead of falling back to the pattern recognizers"),
    Key("edge", "draft_threads", int, None, "llama.cpp threads of the draft (default: per mode, see README)",
        _range(1)),
    Key("edge", "target_threads", int, None, "llama.cpp threads of this device's target", _range(1)),
    Key("edge", "draft_gpu_layers", int, None, "draft layers on the GPU (-1: all; default: all on a GPU build)",
        _range(-1)),
    Key("edge", "target_gpu_layers", int, None, "the same for this device's target", _range(-1)),
    # [serve]: the HTTP daemon.
    Key("serve", "host", str, "127.0.0.1", "address to listen on (0.0.0.0: every interface)"),
    Key("serve", "port", int, 8080, "HTTP port of the API and /metrics (0: a free one, printed)", _range(0, 65535)),
    Key("serve", "model_name", str, "edgespec", "model id that /v1/models lists and requests must name"),
    Key("serve", "api_key", str, "", "bearer key clients must send (empty: none; prefer EDGESPEC_SERVE_API_KEY)",
        secret=True),
    Key("serve", "sessions", int, 1, "EdgeSessions (model copies) answering requests in parallel", _range(1, 16)),
    Key("serve", "max_queue", int, 16, "requests that may wait for a session; more are refused with 429",
        _range(0)),
    Key("serve", "max_tokens", int, 256, "answer length when a request gives no max_tokens", _range(1)),
    Key("serve", "max_tokens_limit", int, 4096, "largest max_tokens a request may ask for", _range(1)),
    Key("serve", "hang_timeout_s", float, 120.0, "a request making no progress this long counts as hung: "
        "/health fails and systemd watchdog pings stop", _positive),
    Key("serve", "log_level", str, "info", "log level", choices=("debug", "info", "warning", "error")),
)

SECTIONS = tuple(dict.fromkeys(k.section for k in SCHEMA))
BY_NAME = {k.dotted: k for k in SCHEMA}


@dataclasses.dataclass
class Setting:
    value: Any
    source: str      # "default", "file /etc/...", "env EDGESPEC_SERVE_PORT", "cli --port"


class Config:
    """The effective configuration: `cfg.get("serve.port")`, `cfg["serve"]["port"]`, sources."""

    def __init__(self, settings: dict[str, Setting], path: Path | None) -> None:
        self.settings = settings
        self.path = path

    def get(self, dotted: str) -> Any:
        return self.settings[dotted].value

    def __getitem__(self, section: str) -> dict[str, Any]:
        return {k.name: self.settings[k.dotted].value for k in SCHEMA if k.section == section}

    def source(self, dotted: str) -> str:
        return self.settings[dotted].source

    def rows(self) -> list[tuple[str, Any, str]]:
        """(key, value shown, source); secrets are never shown."""
        out = []
        for key in SCHEMA:
            s = self.settings[key.dotted]
            shown = SECRET if key.secret and s.value else s.value
            out.append((key.dotted, shown, s.source))
        return out


def parse_value(key: Key, raw: Any, source: str, typed: bool = False) -> Any:
    """Convert and validate one value for `key`: a TOML value (`typed`: it must have the key's type,
    or be "auto" where the default is decided at run time) or an env/CLI string."""
    where = f" (from {source})"
    if typed and isinstance(raw, str) and key.type is not str and not (raw == "auto" and key.default is None):
        raise ConfigError(f"{key.dotted}: expected {_type_name(key.type)}, got {raw!r}{where}")
    if isinstance(raw, str) and key.type is not str:
        text = raw.strip()
        if text.lower() in ("", "auto", "none") and key.default is None:
            return None
        try:
            if key.type is bool:
                lowered = text.lower()
                if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    raise ValueError
                value: Any = lowered in ("1", "true", "yes", "on")
            else:
                value = key.type(text)
        except ValueError:
            raise ConfigError(f"{key.dotted}: expected {_type_name(key.type)}, got {raw!r}{where}") from None
    else:
        value = raw
        ok = (isinstance(value, bool) if key.type is bool else
              isinstance(value, int) and not isinstance(value, bool) if key.type is int else
              isinstance(value, (int, float)) and not isinstance(value, bool) if key.type is float else
              isinstance(value, str))
        if not ok:
            raise ConfigError(f"{key.dotted}: expected {_type_name(key.type)}, got {value!r}{where}")
        if key.type is float:
            value = float(value)
    if key.type is float and value is not None and not math.isfinite(value):
        raise ConfigError(f"{key.dotted}: must be a finite number, got {value}{where}")
    if key.choices and value not in key.choices:
        raise ConfigError(f"{key.dotted}: must be one of {', '.join(key.choices)}, got {value!r}{where}")
    if key.check is not None:
        problem = key.check(value)
        if problem:
            raise ConfigError(f"{key.dotted}: {problem}{where}")
    return value


def _type_name(t: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[t]


def _unknown(name: str, known: list[str]) -> str:
    near = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {near[0]}?)" if near else f" (known: {', '.join(known)})"


def read_file(path: Path) -> dict[str, dict[str, Any]]:
    """The TOML file as {section: {key: value}}, with unknown sections and keys refused by name."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: invalid TOML: {exc}") from None
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}]{_unknown(section, list(SECTIONS))}")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {section} must be a table ([{section}]), got {table!r}")
        names = [k.name for k in SCHEMA if k.section == section]
        for name in table:
            if name not in names:
                raise ConfigError(f"{path}: unknown key {section}.{name}{_unknown(name, names)}")
    return data


def load(path: str | os.PathLike | None = None, *, env: Mapping[str, str] | None = None,
         cli: Mapping[str, Any] | None = None) -> Config:
    """Defaults < file < environment < CLI. `path` None: $EDGESPEC_CONFIG or the default file if it exists.

    `cli` maps dotted keys to values already given on the command line (absent: not given)."""
    env = os.environ if env is None else env
    explicit = path is not None or bool(env.get(ENV_PATH))
    file_path = Path(path if path is not None else env.get(ENV_PATH) or DEFAULT_PATH)
    data: dict[str, dict[str, Any]] = {}
    if explicit or file_path.exists():
        data = read_file(file_path)
    else:
        file_path = None
    settings: dict[str, Setting] = {}
    for key in SCHEMA:
        setting = Setting(key.default, "default")
        if key.section in data and key.name in data[key.section]:
            source = f"file {file_path}"
            setting = Setting(parse_value(key, data[key.section][key.name], source, typed=True), source)
        if key.env in env:
            source = f"env {key.env}"
            setting = Setting(parse_value(key, env[key.env], source), source)
        if cli and key.dotted in cli:
            source = f"cli {key.flag}"
            setting = Setting(parse_value(key, cli[key.dotted], source), source)
        settings[key.dotted] = setting
    cfg = Config(settings, file_path)
    _check_together(cfg)
    return cfg


def _check_together(cfg: Config) -> None:
    """Rules that span keys."""
    if cfg.get("edge.local") and cfg.get("edge.verifier"):
        raise ConfigError(f"edge.local ({cfg.source('edge.local')}) and edge.verifier "
                          f"({cfg.source('edge.verifier')}) exclude each other")
    if cfg.get("serve.max_tokens") > cfg.get("serve.max_tokens_limit"):
        raise ConfigError(f"serve.max_tokens ({cfg.get('serve.max_tokens')}) must be <= serve.max_tokens_limit "
                          f"({cfg.get('serve.max_tokens_limit')})")


# -- argparse --------------------------------------------------------------------------------------
def add_flags(parser: argparse.ArgumentParser, sections: tuple[str, ...] = SECTIONS) -> None:
    """One flag per key (default: not given, so the file and the environment decide)."""
    parser.add_argument("--config", metavar="PATH",
                        help=f"TOML configuration file (default: ${ENV_PATH} or {DEFAULT_PATH} if it exists)")
    for section in sections:
        group = parser.add_argument_group(f"[{section}] settings (flag > env EDGESPEC_{section.upper()}_* > file)")
        for key in SCHEMA:
            if key.section != section:
                continue
            default = "auto" if key.default is None else ("none" if key.default == "" else key.default)
            text = f"{key.help} (default: {'hidden' if key.secret else default})".replace("%", "%%")
            kwargs: dict[str, Any] = dict(dest=key.dotted, default=argparse.SUPPRESS, help=text)
            if key.type is bool:
                group.add_argument(key.flag, action=argparse.BooleanOptionalAction, **kwargs)
            else:
                group.add_argument(key.flag, metavar=key.name.upper(), choices=key.choices, **kwargs)


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The keys given on the command line (flags left out are absent, not defaults)."""
    return {k: v for k, v in vars(args).items() if k in BY_NAME}


def from_args(args: argparse.Namespace) -> Config:
    return load(getattr(args, "config", None), cli=cli_values(args))


def session_kwargs(cfg: Config) -> dict[str, Any]:
    """EdgeSession keyword arguments for the [edge] section."""
    from edgespec.edge.drafting import TreeShape

    e = cfg["edge"]
    kwargs: dict[str, Any] = dict(
        tree=TreeShape.chain(e["chain"]) if e["chain"] else None, n_ctx=e["n_ctx"],
        draft_threads=e["draft_threads"], target_threads=e["target_threads"],
        draft_gpu_layers=e["draft_gpu_layers"], target_gpu_layers=e["target_gpu_layers"])
    if e["privacy"]:
        kwargs.update(privacy=e["privacy"], strict=e["pii_strict"])
    if e["local"]:
        kwargs["local"] = True
    else:
        kwargs.update(fallback=e["fallback"], local_first=e["local_first"], deadline_s=e["deadline_s"],
                      probe_interval_s=e["probe_interval_s"])
        if e["verifier"]:
            kwargs.update(verifier=e["verifier"], token=e["token"] or os.environ.get("EDGESPEC_TOKEN"),
                          tls=e["tls_ca"] or None)
    return kwargs
