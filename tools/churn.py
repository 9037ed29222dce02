"""Session churn against a real verifier: many sessions opened and closed, or abandoned mid-stream,
must leave the verifier's KV pool, threads and file descriptors where they started.

    .venv/bin/python tools/churn.py --sessions 10000 --concurrency 8 --seed 1 [--out churn.json]

Starts `python -m edgespec verifier serve` (SmolLM2 test model, prefix cache on) on loopback, runs
a warm-up (so that gRPC's worker threads and the prefix cache reach their steady state), records
the baseline (Info counters, /proc threads, fds, RSS), then N sessions, each one of:

  clean      Open, Sync, sometimes Verify, half-close, read to the end
  cancel     Open, Sync, Verify sent and the call cancelled before its answer
  drop       Open, Sync, the channel closed without half-closing (the TCP connection goes away)
  open-only  Open, then the channel closed
  refused    a wrong token (UNAUTHENTICATED)

(A Sync that finds every KV slot busy with another request, or an Open past the stream limit while
ended streams are still being torn down, is answered RESOURCE_EXHAUSTED by design; such sessions
are counted as "busy".)

and compares the counters once every stream has ended. Exit 0 when nothing leaked. The test
(tests/test_memory_churn.py) runs a few hundred sessions through `churn()`.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT / "tests"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import grpc  # noqa: E402

from edgespec.common import modelstore, wire  # noqa: E402
from edgespec.common.sampling import SamplingParams  # noqa: E402
from edgespec.common.tree import TokenTree  # noqa: E402
from fuzz_helpers import proc_counters  # noqa: E402  (tests/fuzz_helpers.py)
from grpc_helpers import RawStream, ServerProcess  # noqa: E402  (tests/grpc_helpers.py)

KINDS = ("clean", "clean", "clean", "cancel", "drop", "open-only", "refused")
TOKEN = "churn-token-0123456789"


def one_session(srv: ServerProcess, fingerprint: str, kind: str, rng: random.Random, prefixes: list[list[int]]) -> str:
    """Run one session of the given kind; returns what happened (for the report)."""
    ch = srv.channel(token="wrong" if kind == "refused" else "default")
    s = None
    try:
        s = RawStream(ch)
        reply = s.ask(wire.open_message("test", fingerprint), timeout_s=120)
        if kind == "refused":
            assert isinstance(reply, grpc.RpcError) and reply.code() == grpc.StatusCode.UNAUTHENTICATED, reply
            return "refused"
        if isinstance(reply, grpc.RpcError) and reply.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "busy"   # the stream limit: ended streams are still being torn down
        assert not isinstance(reply, Exception) and reply.WhichOneof("kind") == "opened", reply
        if kind == "open-only":
            return kind
        context = rng.choice(prefixes) + [rng.randrange(100, 20000) for _ in range(rng.randint(0, 4))]
        reply = s.ask(wire.sync_message(context), timeout_s=120)
        if isinstance(reply, grpc.RpcError) and reply.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "busy"   # every KV slot had a request in flight (more clients than slots): by design
        assert not isinstance(reply, Exception) and reply.WhichOneof("kind") == "synced", reply
        tree = TokenTree.chain(context[-1], [rng.randrange(100, 20000) for _ in range(rng.randint(0, 2))])
        msg = wire.verify_message(tree, SamplingParams(), 0, context_length=len(context))
        if kind == "cancel":
            s._out.put(msg)
            time.sleep(rng.random() * 0.02)
            s.call.cancel()
            return kind
        if kind == "drop":
            return kind
        if rng.random() < 0.3:
            reply = s.ask(msg, timeout_s=120)
            assert reply.WhichOneof("kind") in ("verified", "resync_required"), reply   # (evicted meanwhile)
        s.close()
        end = s._in.get(timeout=120)
        assert end == "end", end
        return kind
    finally:
        ch.close()
        if s is not None:
            s.close()   # ends the request iterator (gRPC's consumer thread waits on it)


def settle(srv: ServerProcess, timeout_s: float = 60, baseline: dict | None = None, max_sessions: int = 0,
           max_workers: int = 0) -> dict:
    """The counters once every stream has ended and, given a baseline, once nothing is over it: an
    ended stream's socket and threads close a moment after the stream count drops (seen in CI:
    one fd over the baseline right after the last stream ended). What is still over it after
    timeout_s is what leaked."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = srv.info()
        timed_out = time.monotonic() > deadline
        if info.open_streams == 0 or timed_out:
            snap = snapshot(srv, info)
            if baseline is None or timed_out or not leaks(baseline, snap, max_sessions, max_workers):
                return snap
        time.sleep(0.1)


def snapshot(srv: ServerProcess, info=None) -> dict:  # noqa: ANN001
    info = info or srv.info()
    return {"open_streams": info.open_streams, "live_sessions": info.live_sessions,
            "retained_slots": info.retained_slots, **proc_counters(srv.proc.pid)}


def churn(srv: ServerProcess, n: int, concurrency: int, seed: int, warmup: int | None = None,
          log=None, max_minutes: float | None = None) -> dict:  # noqa: ANN001
    """Warm up, take the baseline, run n sessions (fewer if max_minutes runs out first); returns the
    report (baseline, after, per kind)."""
    fingerprint = srv.info().tokenizer_hash
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 20000) for _ in range(rng.randint(1, 16))] for _ in range(6)]
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def run(i: int) -> None:
        r = random.Random(seed * 1_000_003 + i)
        what = one_session(srv, fingerprint, r.choice(KINDS), r, prefixes)
        with lock:
            counts[what] = counts.get(what, 0) + 1

    warmup = 4 * concurrency if warmup is None else warmup
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(run, range(-warmup, 0)))
    baseline = settle(srv)
    counts.clear()
    checkpoints: list[dict] = []
    started = time.monotonic()
    done = submitted = 0
    stop_at = None if max_minutes is None else started + max_minutes * 60
    with ThreadPoolExecutor(concurrency) as pool:
        pending: set = set()
        while pending or (submitted < n and (stop_at is None or time.monotonic() < stop_at)):
            while submitted < n and len(pending) < 2 * concurrency and (stop_at is None or time.monotonic() < stop_at):
                pending.add(pool.submit(run, submitted))
                submitted += 1
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                f.result()
                done += 1
                if done % 500 == 0:
                    checkpoints.append({"sessions": done, "seconds": round(time.monotonic() - started, 1),
                                        **snapshot(srv)})
                    if log:
                        log(str(checkpoints[-1]))
    n = done
    elapsed = time.monotonic() - started
    info = srv.info()
    max_sessions, max_workers = info.max_sessions, info.max_streams + 8
    after = settle(srv, baseline=baseline, max_sessions=max_sessions, max_workers=max_workers)
    return {"sessions": n, "concurrency": concurrency, "seed": seed, "seconds": round(elapsed, 1),
            "per_kind": counts, "baseline": baseline, "after": after, "max_sessions": max_sessions,
            "checkpoints": checkpoints, "leaks": leaks(baseline, after, max_sessions, max_workers)}


def leaks(baseline: dict, after: dict, max_sessions: int, max_workers: int) -> list[str]:
    """What did not come back to where it started (RSS is reported, not judged: allocators keep pages)."""
    out = []
    if after["open_streams"] != 0:
        out.append(f"{after['open_streams']} streams still open")
    if after["live_sessions"] != baseline["live_sessions"]:
        out.append(f"live KV slots {baseline['live_sessions']} -> {after['live_sessions']}")
    if after["retained_slots"] > max_sessions or after["live_sessions"] + after["retained_slots"] > max_sessions:
        out.append(f"KV slots over the pool: {after}")
    # gRPC's worker pool (max_streams + 8 threads) starts threads on demand, up to its size, when
    # none is idle: growth within that bound is the pool warming up; beyond it threads leak
    if after["threads"] > baseline["threads"] + max_workers:
        out.append(f"threads {baseline['threads']} -> {after['threads']} (more than the gRPC pool of {max_workers})")
    if after["fds"] > baseline["fds"]:
        out.append(f"file descriptors {baseline['fds']} -> {after['fds']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", default="test")
    ap.add_argument("--max-sessions", type=int, default=4)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop starting sessions after this long")
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON")
    args = ap.parse_args(argv)
    model = modelstore.resolve(args.model, progress=False)
    srv = ServerProcess(model, "--n-ctx", "256", "--max-sessions", str(args.max_sessions), "--max-nodes", "16",
                        "--max-depth", "8", "--max-streams", str(max(16, 2 * args.concurrency)), token=TOKEN)
    try:
        report = churn(srv, args.sessions, args.concurrency, args.seed,
                       log=lambda m: print(m, file=sys.stderr, flush=True), max_minutes=args.max_minutes)
        report["alive"] = srv.alive
    finally:
        code = srv.stop()
    report.update(exit_code=code, machine=f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), model=str(model))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if not report["leaks"] and report["alive"] and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
