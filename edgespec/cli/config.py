"""`edgespec config show`: the effective configuration and where each value came from."""
from __future__ import annotations

import argparse
import json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from edgespec import config

    p = subparsers.add_parser("config", help="show the effective daemon configuration",
                              description="Configuration of `edgespec serve`: the TOML file, then environment "
                                          "variables, then flags.")
    sub = p.add_subparsers(dest="config_command", required=True)
    show = sub.add_parser("show", help="print every setting with its value and source (secrets hidden)",
                          description="Print every setting as KEY = VALUE  # SOURCE, where SOURCE is default, "
                                      "file PATH, env NAME or cli --flag. Takes the same flags as `edgespec serve`.")
    show.add_argument("--json", action="store_true", help="print JSON instead")
    config.add_flags(show)
    show.set_defaults(func=cmd_show)


def _toml(value: object) -> str:
    if value is None:
        return '"auto"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def cmd_show(args: argparse.Namespace) -> int:
    from edgespec import config

    cfg = config.from_args(args)
    rows = cfg.rows()
    if args.json:
        print(json.dumps({"file": str(cfg.path) if cfg.path else None,
                          "settings": {k: {"value": v, "source": s} for k, v, s in rows}}, indent=2))
        return 0
    print(f"# file: {cfg.path if cfg.path else f'none ({config.DEFAULT_PATH} does not exist)'}")
    section = None
    width = max(len(k.split('.', 1)[1]) + 3 + len(_toml(v)) for k, v, _ in rows)
    for key, value, source in rows:
        sec, name = key.split(".", 1)
        if sec != section:
            print(f"\n[{sec}]")
            section = sec
        line = f"{name} = {_toml(value)}"
        print(f"{line:<{width}}  # {source}")
    return 0
