"""Time the router's decision per turn on one thread, before and after issue 10's cut, in one run.

    .venv/bin/python tools/bench_router.py [--arms 4] [--repeats 50] [--json out.json]

A turn's decision is `Router.route` (embed the new request; earlier turns are cached) plus
`Router.choose` (score every arm x ladder shape with the planner's model); each later step of the
turn pays `choose` only. Two configurations, measured alternately in the same process:

- before: the shipped graph as onnxruntime folds it (fp32 MatMuls), request cut to 64 tokens;
- after: the integer graph (embedding.integer_graph), request cut to 16 tokens (head and tail).

Reports median / p90 / min wall milliseconds and the median CPU milliseconds of the calling
thread (`time.thread_time`): on a shared machine wall time rises with the load (printed), CPU time
much less. The embedding runs with one intra-op thread, as on the edge.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.edge.embedding import Embedder  # noqa: E402
from edgespec.edge.router import ArmSpec, Router  # noqa: E402

WORDS = ("write a python function that parses the log file and returns the number of errors per hour "
         "then explain how it handles malformed lines and time zones in plain words please").split()
CONFIGS = {"before": {"integer": False, "route_tokens": 64}, "after": {"integer": True, "route_tokens": 16}}


def text_of(tokens: int) -> str:
    """A request of roughly `tokens` wordpiece tokens (one per common English word)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(max(tokens - 2, 1)))


def timed(fn: Callable[[], object], repeats: int) -> dict:
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall.append(1000 * (time.perf_counter() - t0))
        cpu.append(1000 * (time.thread_time() - c0))
    wall.sort()
    return {"median_ms": round(statistics.median(wall), 3), "p90_ms": round(wall[int(0.9 * (len(wall) - 1))], 3),
            "min_ms": round(wall[0], 3), "cpu_median_ms": round(statistics.median(cpu), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", type=int, default=4, help="experts/mixes to choose among")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    results: dict = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                                f"{os.cpu_count()} cores", "load_before": os.getloadavg()[0], "arms": args.arms,
                     "configs": CONFIGS}
    embed: dict = {name: {} for name in CONFIGS}
    for tokens in (8, 16, 32, 64, 128):
        for name, config in CONFIGS.items():
            embedder = Embedder(max_tokens=tokens, integer=config["integer"])
            text = text_of(tokens)
            embed[name][tokens] = timed(lambda: embedder.embed_one(text), args.repeats)
            print(f"embed {tokens:4d} tokens, {name:6s}: {embed[name][tokens]}")
    results["embed"] = embed

    request, history = text_of(300), [text_of(40), text_of(80)]   # long request: cut to route_tokens
    for name, config in CONFIGS.items():
        embedder = Embedder(max_tokens=config["route_tokens"], integer=config["integer"])
        with tempfile.TemporaryDirectory() as tmp:
            router = Router([ArmSpec(f"expert{i}", 0.001 * (i + 1)) for i in range(args.arms)], embedder=embedder,
                            state_path=Path(tmp) / "state.npz", save_every=0)
            router.route(request, history)   # earlier turns are embedded once, as in a conversation
            counter = iter(range(10**9))
            # each turn's request is new text (not in the cache): a prefix makes it unique
            out = {"model_id": embedder.model_id,
                   "route": timed(lambda: router.route(f"{next(counter)} {request}", history), args.repeats)}
            route = router.route(request, history)
            out["choose"] = timed(lambda: router.choose(route), args.repeats)
            out["turn"] = timed(lambda: router.choose(router.route(f"{next(counter)} {request}", history)),
                                args.repeats)
        results[name] = out
        for key in ("route", "choose", "turn"):
            print(f"{name:6s} {key:7s}: {out[key]}")
    results["load_after"] = os.getloadavg()[0]
    print(f"load average {results['load_before']:.2f} -> {results['load_after']:.2f} on {results['machine']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
