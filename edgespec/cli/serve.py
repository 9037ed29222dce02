"""`edgespec serve`: the device daemon with an OpenAI-compatible HTTP API (see edgespec/serve)."""
from __future__ import annotations

import argparse
import logging
import os

from edgespec.cli import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from edgespec import config

    p = subparsers.add_parser(
        "serve", help="run the device daemon: OpenAI-compatible HTTP API, /health, /metrics",
        description="Run the device daemon. Settings come from the TOML file, then EDGESPEC_<SECTION>_<KEY> "
                    "environment variables, then these flags (`edgespec config show` prints the result). "
                    "Endpoints: POST /v1/chat/completions (streaming or not), GET /v1/models, /health, /metrics. "
                    "Under systemd (Type=notify) it sends READY=1 once the models are loaded and watchdog pings "
                    "while requests make progress.")
    config.add_flags(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from edgespec import config
    from edgespec.serve import daemon

    cfg = config.from_args(args)
    if os.environ.get("JOURNAL_STREAM"):   # under systemd: the journal stamps time and unit itself
        for handler in logging.getLogger().handlers:
            handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    if not args.verbose:
        level = getattr(logging, cfg.get("serve.log_level").upper())
        logging.getLogger().setLevel(level)
        logging.getLogger("edgespec").setLevel(level)
    try:
        return daemon.run(cfg)
    except daemon.BindError as exc:
        raise CliError(str(exc)) from None
