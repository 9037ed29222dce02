"""Fleet throughput and failover time: R verifier replicas, S concurrent edge sessions routed by the edge.

    .venv/bin/python tools/bench_fleet.py --replicas 1,2,4 --sessions 4 --max-tokens 64 [--kill] [--json out.json]

Starts R real `edgespec verifier serve` processes (llama.cpp backend, --threads 1 each), opens S
EdgeSessions in threads of this process with verifier="a:p,b:p,..." (edge routing, edgespec/edge/
fleet.py), each answering its own prompt greedily with a fixed small tree, no local fallback. Reports
fleet tokens/s (all committed tokens / wall time from the first request to the last answer), where
the sessions were placed, mean queue and compute time per step, and the fleet's aggregate metrics.
--kill: once every session has committed a third of its tokens, SIGKILL the replica serving most
sessions and report, per moved session, the time from the kill to its next committed token.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time

from edgespec import EdgeSession, TreeShape
from edgespec.common import modelstore

PROMPTS = ["Explain, step by step and in detail, how a computer boots.",
           "Describe how a bicycle works, part by part.",
           "Write a short story about a robot that learns to paint.",
           "Explain why the sky is blue to a ten year old.",
           "List the steps to bake bread at home, with reasons.",
           "Explain how a compiler turns source code into a program.",
           "Describe the water cycle in detail.",
           "Explain what a hash table is and when to use one."]
SHAPE = TreeShape(budget=6, max_depth=3, branching=2, width=2)


def start_replica(model: str, n_ctx: int, threads: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "edgespec", "verifier", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", "0", "--n-ctx", str(n_ctx), "--threads", str(threads), "--exit-with-parent"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for line in proc.stdout:
        if line.startswith("edgespec-verifier listening on "):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, line.split()[-1]
    raise RuntimeError(f"replica exited with {proc.wait()}")


def run(n_replicas: int, n_sessions: int, max_tokens: int, kill: bool, model: str, n_ctx: int) -> dict:
    procs = [start_replica(model, n_ctx, 1) for _ in range(n_replicas)]
    spec = ",".join(a for _, a in procs) + ("," if n_replicas == 1 else "")  # a fleet of one is routed the same way
    sessions = [EdgeSession(model, model, verifier=spec, n_ctx=n_ctx, tree=SHAPE, fallback=False, deadline_s=120,
                            session_id=f"bench-robot-{i}", draft_threads=1) for i in range(n_sessions)]
    times: list[list[float]] = [[] for _ in sessions]
    counts = [0] * n_sessions
    errors: queue.Queue = queue.Queue()

    def work(i: int) -> None:
        s = sessions[i]
        inner = s.decoder.run

        def spy(*a, **kw):  # the time each step's tokens were committed
            for tokens in inner(*a, **kw):
                counts[i] += len(tokens)
                times[i].append(time.monotonic())
                yield tokens

        s.decoder.run = spy
        try:
            s.chat(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens)
        except Exception as exc:  # noqa: BLE001 - reported
            errors.put(f"session {i}: {type(exc).__name__}: {exc}")

    placed = [s.failover.link.address for s in sessions]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_sessions)]
    start = time.monotonic()
    for t in threads:
        t.start()
    killed_at, victim = None, None
    if kill and n_replicas > 1:
        while any(t.is_alive() for t in threads) and min(counts) < max_tokens // 3:
            time.sleep(0.05)
        victim = max((a for _, a in procs), key=placed.count)
        proc = next(p for p, a in procs if a == victim)
        proc.kill()
        killed_at = time.monotonic()
        proc.wait()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    link_stats = [s.stats.link for s in sessions]
    fleet = sessions[0].failover.link.fleet
    result = {
        "replicas": n_replicas, "sessions": n_sessions, "max_tokens": max_tokens, "wall_s": round(wall, 2),
        "tokens": sum(counts), "tokens_per_s": round(sum(counts) / wall, 2),
        "placement": {a: placed.count(a) for _, a in procs},
        "mean_queue_ms": round(sum(ls.queue_ms for ls in link_stats) / max(1, sum(ls.steps for ls in link_stats)), 1),
        "mean_compute_ms": round(sum(ls.compute_ms for ls in link_stats) / max(1, sum(ls.steps for ls in link_stats)), 1),
        "steps": sum(ls.steps for ls in link_stats), "errors": list(errors.queue),
        "fleet_totals": fleet.metrics(5.0)["totals"],
    }
    if killed_at is not None:
        gaps = []
        for i, s in enumerate(sessions):
            if placed[i] == victim:
                after = [t for t in times[i] if t > killed_at]
                gaps.append(round((after[0] - killed_at) * 1000) if after else None)
        result["killed"] = victim
        result["kill_to_next_token_ms"] = gaps
    for s in sessions:
        s.close()
    for p, _ in procs:
        p.terminate()
        p.wait()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="1,2,4", help="comma list of fleet sizes (default %(default)s)")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="test", help="draft and target (default: the SmolLM2 test model)")
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--kill", action="store_true", help="SIGKILL the busiest replica a third of the way in")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    model = str(modelstore.resolve(args.model, progress=False))
    results = []
    for r in (int(x) for x in args.replicas.split(",")):
        res = run(r, args.sessions, args.max_tokens, args.kill, model, args.n_ctx)
        print(json.dumps(res), flush=True)
        results.append(res)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
            "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "args": vars(args)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
