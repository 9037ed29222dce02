#!/usr/bin/env python3
"""Throughput of the device daemon (`edgespec serve`) at 1 and N concurrent clients.

Starts a real daemon process (port 0), warms it up with one request, then for each client count
sends the same set of Spec-Bench first turns (one per category, round robin, from the copy in
tools/data/) with the official openai client, each client on its own thread, and reports the
aggregate completion tokens per second, requests per second, latency and time to first token.
Requests are greedy and streamed. With `serve.sessions` = 1 (the default) concurrent requests
queue for the one session, so aggregate throughput stays flat while latency grows with clients.

  python tools/bench_serve.py --clients 1,4 --requests 8 --max-tokens 64 --markdown
  python tools/bench_serve.py --sessions 2 -- --draft test --target test --local   # serve flags after --
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_prompts(path: Path, n: int) -> list[tuple[str, str]]:
    """n first turns, one category after another (the order is fixed: runs are comparable)."""
    by_category: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        by_category.setdefault(row["category"], []).append(row["turns"][0])
    out, i = [], 0
    while len(out) < n:
        for category, turns in by_category.items():
            if len(out) < n and i < len(turns):
                out.append((category, turns[i]))
        i += 1
    return out


class Daemon:
    def __init__(self, serve_args: list[str]) -> None:
        cmd = [sys.executable, "-m", "edgespec", "serve", "--host", "127.0.0.1", "--port", "0", *serve_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        line = self.proc.stdout.readline().strip()
        m = re.match(r"edgespec-serve listening on (\S+)", line)
        if not m:
            raise SystemExit(f"daemon did not start: {line!r}")
        self.url = m.group(1)
        t0 = time.monotonic()
        if self.proc.stdout.readline().strip() != "edgespec-serve ready":
            raise SystemExit("daemon did not get ready")
        self.load_s = time.monotonic() - t0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def one_request(client, prompt: str, max_tokens: int) -> dict:  # noqa: ANN001
    t0 = time.monotonic()
    first = None
    stream = client.chat.completions.create(model="edgespec", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    tokens = 0
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"latency_s": time.monotonic() - t0, "ttft_s": first or 0.0, "tokens": tokens}


def run_level(url: str, prompts: list[tuple[str, str]], clients: int, max_tokens: int) -> dict:
    import openai

    work = list(enumerate(prompts))
    lock = threading.Lock()
    results: list[dict] = []
    errors: list[str] = []

    def client_loop() -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600)
        while True:
            with lock:
                if not work:
                    return
                _, (_, prompt) = work.pop(0)
            try:
                r = one_request(c, prompt, max_tokens)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                results.append(r)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    tokens = sum(r["tokens"] for r in results)
    lat = sorted(r["latency_s"] for r in results)
    return {"clients": clients, "requests": len(results), "errors": errors, "wall_s": round(wall, 2),
            "tokens": tokens, "tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(results) / wall, 3),
            "latency_p50_s": round(statistics.median(lat), 2) if lat else None,
            "latency_max_s": round(lat[-1], 2) if lat else None,
            "ttft_p50_s": round(statistics.median(r["ttft_s"] for r in results), 2) if results else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,4", help="comma-separated client counts (default %(default)s)")
    ap.add_argument("--requests", type=int, default=8, help="requests per client count (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default %(default)s)")
    ap.add_argument("--sessions", type=int, default=1, help="serve.sessions of the daemon (default %(default)s)")
    ap.add_argument("--spec-bench", type=Path, default=REPO / "tools" / "data" / "spec_bench_questions.jsonl")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("serve_args", nargs="*", help="flags for `edgespec serve` (after --)")
    args = ap.parse_args()
    prompts = load_prompts(args.spec_bench, args.requests)
    daemon = Daemon(["--sessions", str(args.sessions), *args.serve_args])
    try:
        import openai

        warm = openai.OpenAI(base_url=daemon.url + "/v1", api_key="bench", max_retries=0, timeout=3600)
        one_request(warm, "Say hello.", 8)
        levels = [run_level(daemon.url, prompts, int(c), args.max_tokens) for c in args.clients.split(",")]
    finally:
        daemon.stop()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
            "cpus": os.cpu_count(), "load_avg": os.getloadavg()[0], "sessions": args.sessions,
            "serve_args": args.serve_args, "max_tokens": args.max_tokens, "load_s": round(daemon.load_s, 1)}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "levels": levels}, indent=2))
    if args.markdown:
        print(f"\nsessions {args.sessions}, {args.requests} requests x {args.max_tokens} tokens, serve args "
              f"`{' '.join(args.serve_args) or '(defaults)'}`, {meta['date']}, load avg {meta['load_avg']:.1f}\n")
        print("| clients | requests | wall s | tokens/s (aggregate) | requests/s | latency p50 s | latency max s "
              "| TTFT p50 s | errors |")
        print("|---|---|---|---|---|---|---|---|---|")
        for lv in levels:
            print(f"| {lv['clients']} | {lv['requests']} | {lv['wall_s']} | {lv['tokens_per_s']} | {lv['requests_per_s']} "
                  f"| {lv['latency_p50_s']} | {lv['latency_max_s']} | {lv['ttft_p50_s']} | {len(lv['errors'])} |")
    else:
        print(json.dumps({"meta": meta, "levels": levels}, indent=2))
    return 1 if any(lv["errors"] for lv in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
