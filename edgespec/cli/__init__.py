"""`edgespec` command line: one module per sub-command, each exposing `add_parser(subparsers)`.

Exit codes: 0 ok, 1 runtime failure, 2 bad usage or bad input (argparse convention), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from edgespec.common.errors import EdgespecError

DESCRIPTION = ("edgespec: edge-cloud speculative decoding. The device drafts token trees with a small model, a "
               "verifier checks them with the target model; the output is the target's own.")
EPILOG = ("Exit codes: 0 ok, 1 runtime failure, 2 bad usage or bad input, 130 Ctrl-C. "
          "Run 'edgespec COMMAND --help' for a command's options.")

SUBCOMMANDS = ("run", "serve", "config", "doctor", "models", "verifier", "bench")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class CliError(Exception):
    """A user-facing error: printed without a traceback, exits with `code`."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("edgespec")
    except PackageNotFoundError:   # a source tree that was never installed
        ver = "unknown"
    parser = argparse.ArgumentParser(prog="edgespec", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"edgespec {ver}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug information")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"edgespec.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)   # imports the sub-commands: Ctrl-C may land here too
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"edgespec: error: {exc}", file=sys.stderr)
        return exc.code
    except EdgespecError as exc:
        print(f"edgespec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("edgespec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
