"""`edgespec bench plot`: PNG plots of the benchmark results, next to their tables.

Reads the JSON the benchmark tools write (tools/bench_local.py, bench_link.py, bench_wire.py; the
repository's own runs are in docs/bench/) and draws

  tau_by_category.png          τ per Spec-Bench category and HumanEval, per draft configuration (greedy)
  speedup_vs_rtt.png           edge-cloud decoding speed relative to cloud-only decoding, per round trip
  verify_time_vs_tree_size.png the verifier's compute and wall time per step against the tree's nodes

Inputs that are not given or do not exist are skipped (and said so).
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from edgespec.cli import CliError

DOCS = Path("docs") / "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="plot benchmark results (PNG)", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="bench_command", required=True)
    plot = sub.add_parser("plot", help="draw the PNG plots from the benchmarks' JSON files",
                          description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    plot.add_argument("--local", type=Path, default=DOCS / "local.json",
                      help="tools/bench_local.py --json output (default %(default)s)")
    plot.add_argument("--link", type=Path, default=DOCS / "link_v3.json",
                      help="tools/bench_link.py --json output (default %(default)s)")
    plot.add_argument("--wire", type=Path, default=DOCS / "wire.json",
                      help="tools/bench_wire.py --json output (default %(default)s)")
    plot.add_argument("--out", type=Path, default=Path("."), help="directory for the PNG files (default: here)")
    plot.set_defaults(func=cmd_plot)


def read_results(path: Path) -> Any:
    """A benchmark's JSON result, plain or gzipped (`.gz`: docs/bench keeps its large raw files compressed, so the
    tracked tree a GPU call carries beside the model pieces stays small)."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def _load(path: Path) -> Any | None:
    if not path.exists():
        print(f"skipped {path}: no such file")
        return None
    try:
        return read_results(path)
    except (OSError, ValueError) as exc:
        raise CliError(f"{path}: not a benchmark JSON file: {exc}") from None


def cmd_plot(args: argparse.Namespace) -> int:
    try:
        import matplotlib
    except ImportError:
        raise CliError("plots need matplotlib: pip install 'edgespec[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for path, draw, name in ((args.local, tau_by_category, "tau_by_category.png"),
                             (args.link, speedup_vs_rtt, "speedup_vs_rtt.png"),
                             (args.wire, verify_time_vs_tree_size, "verify_time_vs_tree_size.png")):
        data = _load(path)
        if data is None:
            continue
        fig = draw(plt, data, source=path)
        target = args.out / name
        fig.savefig(target, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(target)
        print(f"wrote {target} (from {path})")
    if not written:
        raise CliError("no input found: pass --local, --link or --wire (JSON from the tools/bench_*.py scripts)")
    return 0


def tau_by_category(plt, rows: list[dict], source: Path):  # noqa: ANN001, ANN201
    """Grouped bars: τ per category for each draft configuration, greedy rows only."""
    rows = [r for r in rows if r.get("temperature", 0.0) == 0.0 and r.get("config") != "target"]
    if not rows:
        raise CliError(f"{source}: no greedy rows with a draft configuration")
    categories = sorted({r["category"] for r in rows}, key=lambda c: (c == "overall", c))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    tau = {(r["config"], r["category"]): r["tau"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, len(categories) * 0.8), 4.5))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        xs = [j + i * width for j in range(len(categories))]
        ax.bar(xs, [tau.get((config, c), 0.0) for c in categories], width, label=config)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))])
    ax.set_xticklabels(categories, rotation=35, ha="right")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("τ (tokens per target step)")
    ax.set_title(f"τ by category, greedy ({source.name})")
    ax.legend(ncol=len(configs), fontsize="small")
    return fig


def speedup_vs_rtt(plt, data: dict, source: Path):  # noqa: ANN001, ANN201
    """Tokens/s of each mode divided by cloud-only ("ar") at the same round trip and bandwidth."""
    cells = data.get("cells", [])
    speed = {(c["rtt_ms"], c["mbit"], c["mode"]): c["tokens"] / c["seconds"] for c in cells if c.get("seconds")}
    lines: dict[tuple[str, float], list[tuple[float, float]]] = defaultdict(list)
    for (rtt, mbit, mode), tps in sorted(speed.items()):
        base = speed.get((rtt, mbit, "ar"))
        if mode != "ar" and base:
            lines[(mode, mbit)].append((rtt, tps / base))
    if not lines:
        raise CliError(f"{source}: no cells with both a cloud-only ('ar') and a speculative mode")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (mode, mbit), points in sorted(lines.items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=f"{mode}, {mbit:g} Mbit/s")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("round-trip time (ms)")
    ax.set_ylabel("speed-up over cloud-only decoding")
    ax.set_title(f"Edge-cloud speculative decoding vs RTT ({source.name})")
    ax.legend(fontsize="small")
    return fig


def verify_time_vs_tree_size(plt, data: dict, source: Path):  # noqa: ANN001, ANN201
    rows = data.get("rows", [])
    if not rows:
        raise CliError(f"{source}: no rows")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in ("greedy", "sampled"):
        points = [(r["size"], r["lat"][mode]) for r in rows if mode in r.get("lat", {})]
        if points:
            sizes = [s for s, _ in points]
            ax.plot(sizes, [p["compute_ms"] for _, p in points], marker="o", label=f"{mode}: verifier compute")
            ax.plot(sizes, [p["wall_ms"] for _, p in points], marker="x", linestyle="--", label=f"{mode}: wall")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree nodes (root included)")
    ax.set_ylabel("ms per verify step")
    machine = data.get("machine", {})
    ax.set_title(f"Verify time vs tree size ({source.name}, {machine.get('cpu', '')} {machine.get('nproc', '')} cores)")
    ax.legend(fontsize="small")
    return fig
