"""Time the router's decision per turn on one thread: embedding (by request length), scoring, total.

    .venv/bin/python tools/bench_router.py [--arms 4] [--repeats 50] [--route-tokens 64] [--json out.json]

A turn's decision is `Router.route` (embed the request up to --route-tokens tokens; earlier turns
are cached) plus `Router.choose` (score every arm x ladder shape with the planner's model); each
later step of the turn pays `choose` only. Reports median and p90 in milliseconds. The embedding
runs with one intra-op thread, as on the edge; on a loaded machine the numbers rise with the load
(the load average is printed with them).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.edge.embedding import Embedder  # noqa: E402
from edgespec.edge.router import ArmSpec, Router  # noqa: E402

WORDS = ("write a python function that parses the log file and returns the number of errors per hour "
         "then explain how it handles malformed lines and time zones in plain words please").split()


def text_of(tokens: int) -> str:
    """A request of roughly `tokens` wordpiece tokens (one per common English word)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(max(tokens - 2, 1)))


def timed(fn, repeats: int) -> dict:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(1000 * (time.perf_counter() - t0))
    samples.sort()
    return {"median_ms": round(statistics.median(samples), 3), "p90_ms": round(samples[int(0.9 * (len(samples) - 1))], 3),
            "min_ms": round(samples[0], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", type=int, default=4, help="experts/mixes to choose among")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--route-tokens", type=int, default=64, help="request tokens embedded per turn")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    results: dict = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                                f"{os.cpu_count()} cores", "load_before": os.getloadavg()[0],
                     "route_tokens": args.route_tokens, "arms": args.arms}
    embed = {}
    for tokens in (16, 32, 64, 128, 256):
        embedder = Embedder(max_tokens=tokens)
        text = text_of(tokens)
        embed[tokens] = timed(lambda: embedder.embed_one(text), args.repeats)
        print(f"embed {tokens:4d} tokens: {embed[tokens]}")
    results["embed"] = embed

    embedder = Embedder(max_tokens=args.route_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        router = Router([ArmSpec(f"expert{i}", 0.001 * (i + 1)) for i in range(args.arms)], embedder=embedder,
                        state_path=Path(tmp) / "state.npz", save_every=0)
        request = text_of(300)   # long request: truncated to route_tokens
        history = [text_of(40), text_of(80)]
        router.route(request, history)   # earlier turns are embedded once, as in a conversation
        counter = iter(range(10**9))
        # each turn's request is new text (not in the cache): a suffix makes it unique
        results["route"] = timed(lambda: router.route(f"{next(counter)} {request}", history), args.repeats)
        route = router.route(request, history)
        results["choose"] = timed(lambda: router.choose(route), args.repeats)
        results["turn"] = timed(lambda: router.choose(router.route(f"{next(counter)} {request}", history)),
                                args.repeats)
    results["load_after"] = os.getloadavg()[0]
    for key in ("route", "choose", "turn"):
        print(f"{key:7s}: {results[key]}")
    print(f"load average {results['load_before']:.2f} -> {results['load_after']:.2f} on {results['machine']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
