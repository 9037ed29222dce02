#!/usr/bin/env python3
"""The verifier's batch worker (edgespec/verifier/torch/batching.py) on its own, with a stand-in
compute, both ways in one run: `alone` on (a lone session's batch in its own thread, what the registry
does with one stream open) and off (every batch in the worker's thread). No model, no gRPC.

    .venv/bin/python tools/bench_batch_worker.py [--compute-ms 1.5] [--sessions 1,8,32] [--seconds 3]

- lone: BatchWorker.submit's cost beyond a busy compute of --compute-ms (ms, median; bench_roundtrip.py
  reports it beside the link's costs).
- sessions: N threads, each submitting its next request 0.3 ms after its last was answered (an edge's
  reply path), the batch's compute 1.5 ms + 0.1 ms a request, either asleep (releases the GIL, as a
  GPU wait does) or busy in Python (holds it): requests/s and the mean batch size.
Why the registry turns `alone` on only with one stream: with several sessions and a compute that
holds the GIL, running a request at once leaves the others no time to queue for the same batch.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgespec.verifier.torch.batching import BatchWorker  # noqa: E402


def spin(seconds: float) -> None:
    """Busy for `seconds` in Python (holding the GIL)."""
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


def batch_worker_ms(steps: int, compute_s: float, alone: bool = True) -> float:
    """Median of BatchWorker.submit's wall time less `compute_s` (spent busy in run_batch), one
    request at a time with a 0.5 ms pause between them (as a gRPC handler waits for the next one);
    alone: as the registry's worker with one stream open (else every batch in the worker's thread)."""
    def run(jobs) -> None:  # noqa: ANN001
        spin(compute_s)
        for job in jobs:
            job.result = True

    worker = BatchWorker(run, alone=lambda: alone)
    times = []
    for i in range(steps):
        time.sleep(0.0005)
        t = time.perf_counter()
        worker.submit(i)
        times.append(time.perf_counter() - t - compute_s)
    worker.close()
    return 1000 * statistics.median(times[30:])


def sessions_run(n: int, seconds: float, holds_gil: bool, alone: bool) -> dict:
    """n sessions against one worker for `seconds`: requests/s and the mean batch size."""
    compute = spin if holds_gil else time.sleep

    def run(jobs) -> None:  # noqa: ANN001
        compute(0.0015 + 0.0001 * len(jobs))
        for job in jobs:
            job.result = True

    worker = BatchWorker(run, alone=lambda: alone)
    stop = threading.Event()
    counts = [0] * n

    def session(i: int) -> None:
        while not stop.is_set():
            worker.submit(i)
            counts[i] += 1
            time.sleep(0.0003)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    worker.close()
    return {"requests_per_s": round(sum(counts) / seconds, 1), "mean_batch": round(worker.stats.mean_batch, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compute-ms", type=float, default=1.5)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sessions", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    out: dict = {"lone_ms": {}, "sessions": []}
    for alone in (True, False):
        out["lone_ms"]["alone" if alone else "worker"] = round(batch_worker_ms(args.steps, args.compute_ms / 1000, alone), 3)
    for n in (int(x) for x in args.sessions.split(",")):
        for holds_gil in (False, True):
            for alone in (True, False):
                row = {"sessions": n, "compute": "holds GIL" if holds_gil else "releases GIL",
                       "alone": alone, **sessions_run(n, args.seconds, holds_gil, alone)}
                out["sessions"].append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps(out["lone_ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
