"""A well-behaved edge's speed before and during abuse of its verifier (a benchmark, not a test).

    .venv/bin/python tools/bench_abuse.py [--runs 3] [--max-tokens 48] [--out bench_abuse.json]

The verifier (SmolLM2 test model) listens on both loopbacks: the good edge (a real EdgeSession,
greedy, fixed tree shape) connects over ::1, the abusers over 127.0.0.1, so they are two clients.
For each configuration (per-client limits on: --max-streams-per-client 4 --client-rate 20; and
off), the good edge generates `--runs` answers alone, then again while four abusers run:

  hog        opens streams until refused and idles on them
  flooder    4 streams, each sending Verify as fast as it can (full-size trees, and cheap requests
             with a stale context length that are answered ResyncRequired)
  bad-token  Info and Session calls with a wrong or missing token, in a loop
  hijack     streams that name another session's id and Verify without a Sync

Reports the good edge's tokens/s (median) alone and under abuse, and what each abuser got
(answers by status).
"""
from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT / "tests"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import grpc  # noqa: E402

from edgespec import EdgeSession, TreeShape  # noqa: E402
from edgespec.common import modelstore, wire  # noqa: E402
from edgespec.common.sampling import SamplingParams  # noqa: E402
from edgespec.common.tree import TokenTree  # noqa: E402
from grpc_helpers import AuthInterceptor, RawStream, ServerProcess  # noqa: E402

TOKEN = "bench-abuse-token-0123"
PROMPT = "Write a short paragraph about the ocean."
LIMITS = ["--max-streams-per-client", "4", "--client-rate", "20"]


def abuser_channel(port: int, token: str | None = TOKEN) -> grpc.Channel:
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    return grpc.intercept_channel(ch, AuthInterceptor(token)) if token else ch


def name(reply) -> str:  # noqa: ANN001
    if isinstance(reply, grpc.RpcError):
        return reply.code().name
    return reply if isinstance(reply, str) else reply.WhichOneof("kind")


class Abusers:
    def __init__(self, port: int, fingerprint: str, prompt: list[int], max_nodes: int) -> None:
        self.port, self.fp, self.prompt, self.max_nodes = port, fingerprint, prompt, max_nodes
        self.stop = threading.Event()
        self.got: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.threads = [threading.Thread(target=self.hog, daemon=True),
                        *(threading.Thread(target=self.flood, args=(i,), daemon=True) for i in range(4)),
                        threading.Thread(target=self.bad_token, daemon=True),
                        threading.Thread(target=self.hijack, daemon=True)]

    def __enter__(self) -> "Abusers":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _open(self, token: str | None = TOKEN, metadata=None):  # noqa: ANN001, ANN202
        ch = abuser_channel(self.port, token)
        s = RawStream(ch, metadata=metadata)
        return ch, s, s.ask(wire.open_message("test", self.fp), timeout_s=60)

    def hog(self) -> None:
        held = []
        while not self.stop.is_set():
            ch, s, reply = self._open()
            held.append(ch)
            self.got["hog"][name(reply)] += 1
            if isinstance(reply, grpc.RpcError):
                self.stop.wait(1.0)
        for ch in held:
            ch.close()

    def flood(self, i: int) -> None:
        big = TokenTree(tokens=[self.prompt[-1], *range(100, 100 + self.max_nodes - 1)],
                        parents=[-1] + [0] * (self.max_nodes - 1))
        while not self.stop.is_set():
            ch, s, reply = self._open()
            try:
                self.got["flooder"][name(reply)] += 1
                if isinstance(reply, grpc.RpcError):
                    continue
                reply = s.ask(wire.sync_message(self.prompt), timeout_s=60)
                n = 0
                while not self.stop.is_set() and not isinstance(reply, (grpc.RpcError, str)):
                    self.got["flooder"][name(reply)] += 1
                    n += 1
                    stale = n % 4 != 0
                    tree = TokenTree.chain(self.prompt[-1], [5]) if stale else big
                    reply = s.ask(wire.verify_message(tree, SamplingParams(), n, context_length=len(self.prompt)
                                                      + (1 if stale else 0)), timeout_s=60)
                    if name(reply) == "verified":
                        reply = s.ask(wire.sync_message(self.prompt), timeout_s=60)
                self.got["flooder"][name(reply)] += 1
            finally:
                s.close()
                ch.close()

    def bad_token(self) -> None:
        from edgespec.v1 import edgespec_pb2 as pb
        from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
        while not self.stop.is_set():
            for token in ("wrong", None):
                ch = abuser_channel(self.port, token)
                try:
                    pb_grpc.VerifierStub(ch).Info(pb.InfoRequest(), timeout=10)
                    self.got["bad-token"]["answered"] += 1
                except grpc.RpcError as err:
                    self.got["bad-token"][err.code().name] += 1
                ch.close()

    def hijack(self) -> None:
        while not self.stop.is_set():
            ch, s, reply = self._open(metadata=[("edgespec-session-id", "s1")])
            try:
                if isinstance(reply, grpc.RpcError):
                    self.got["hijack"][name(reply)] += 1
                    self.stop.wait(0.2)
                    continue
                reply = s.ask(wire.verify_message(TokenTree.chain(self.prompt[-1], []), SamplingParams(), 0,
                                                  context_length=len(self.prompt)), timeout_s=60)
                self.got["hijack"][name(reply)] += 1
            finally:
                s.close()
                ch.close()
            self.stop.wait(0.05)


def good_runs(session: EdgeSession, prompt: list[int], n: int, max_tokens: int) -> tuple[list[float], list[list[int]]]:
    speeds, outs = [], []
    for _ in range(n):
        started = time.monotonic()
        out = [t for chunk in session.generate_tokens(prompt, max_tokens, SamplingParams()) for t in chunk]
        speeds.append(len(out) / (time.monotonic() - started))
        outs.append(out)
    return speeds, outs


def one_config(model: Path, limits: bool, runs: int, max_tokens: int) -> dict:
    srv = ServerProcess(model, "--host", "::", "--n-ctx", "1024", "--max-sessions", "8", "--max-nodes", "32",
                        "--max-streams", "32", *(LIMITS if limits else []), token=TOKEN)
    try:
        with EdgeSession(model, model, verifier=f"[::1]:{srv.port}", token=TOKEN, n_ctx=1024,
                         tree=TreeShape(budget=8, max_depth=4), deadline_s=30) as good:
            prompt = good.draft_model.chat_tokens([{"role": "user", "content": PROMPT}])
            alone, texts = good_runs(good, prompt, runs, max_tokens)
            with Abusers(srv.port, good.draft_model.tokenizer_fingerprint(), prompt, 32) as ab:
                time.sleep(2)
                during, texts2 = good_runs(good, prompt, runs, max_tokens)
            got = {k: dict(v) for k, v in ab.got.items()}
            fo = good.stats.extra.get("failover", {})
        alive = srv.alive
    finally:
        code = srv.stop()
    return {"limits": limits, "alone_tok_s": [round(x, 2) for x in alone], "during_tok_s": [round(x, 2) for x in during],
            "alone_median": round(statistics.median(alone), 2), "during_median": round(statistics.median(during), 2),
            "same_text": all(t == texts[0] for t in texts + texts2), "abusers": got,
            "good_switches": fo.get("switches"), "server_alive": alive, "exit_code": code}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--model", default="test")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    model = modelstore.resolve(args.model, progress=False)
    rows = [one_config(model, limits, args.runs, args.max_tokens) for limits in (True, False)]
    report = {"rows": rows, "machine": f"{platform.node()} {platform.machine()}", "model": str(model),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "max_tokens": args.max_tokens}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
