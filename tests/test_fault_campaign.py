"""Fault campaign: the edge keeps generating, losslessly, through every link fault we can make.

Topology (throw-away network namespaces, tests/netlab.py):

    ns_a: edge process (EdgeSession, child) -> 127.0.0.1:relay (tools/netrelay.py, a thread of this
          test, delay + jitter)  ==veth, tbf 20 Mbit/s both ways==>  ns_b: verifier service (child)

The edge runs two long generations (SmolLM2 as draft and target, up to 200 tokens each) in lock
step with this test: after every committed step it reports the step and waits for "go", so each
fault lands at a known point. Faults, in order: a delay spike with jitter (below the deadline),
a stall longer than the deadline, a partition (veth down) and back up, relay resets (between
steps and mid-step), and a verifier SIGKILL mid-step followed by a restart on the same port.

Checked: every generation is the target's greedy output (an uninterrupted local-only reference,
token for token, near-ties excepted as in tests/lossless.py, plus a teacher-forced check of every
token), the decoder's committed context is the prompt plus exactly the emitted tokens (nothing
lost, nothing duplicated), streamed chunks concatenate to the text, and switches were reported
both ways for each fault that forced one.
"""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parent / "tools")):
    if p not in sys.path:
        sys.path.insert(0, p)

import netlab  # noqa: E402
import netrelay  # noqa: E402
from lossless import assert_lossless, target_only_greedy  # noqa: E402
from failover_helpers import assert_targets_choices  # noqa: E402

pytestmark = pytest.mark.netns

N_CTX = 2048
SHAPE = (6, 3, 2, 2)  # TreeShape(budget, max_depth, branching, width)
MAX_TOKENS = 200
DEADLINE_S = 1.0
PROBE_S = 0.3
PROMPTS = ["Explain, step by step and in detail, how a computer boots.",
           "Write a detailed essay about the history of the printing press."]
BASE_DELAY_MS, BASE_JITTER_MS = 10, 3
READY_PREFIX = "edgespec-verifier listening on "

EDGE = r"""
import json, sys, time
args = json.loads(sys.argv[1])
from edgespec import EdgeSession, TreeShape

def emit(**kw):
    print(json.dumps(kw), flush=True)

session = EdgeSession(args["model"], args["model"], verifier=args["address"], n_ctx=args["n_ctx"],
                      tree=TreeShape(*args["shape"]), deadline_s=args["deadline_s"],
                      probe_interval_s=args["probe_s"], on_switch=lambda e: emit(kind="switch", event=e.as_dict()))
inner, count, turn = session.decoder.run, [0], [0]

def lockstep(*a, **k):
    started = time.time()  # wall clock, like the failover's breaker history
    for tokens in inner(*a, **k):
        fo = session.stats.extra["failover"]
        emit(kind="step", n=count[0], turn=turn[0], tokens=list(tokens), mode=fo["mode"], breaker=fo["breaker"],
             started=started)
        count[0] += 1
        if sys.stdin.readline().strip() != "go":
            raise SystemExit(3)
        started = time.time()
        yield tokens

session.decoder.run = lockstep
for i, text in enumerate(args["prompts"]):
    turn[0] = i
    emit(kind="turn", index=i, prompt=session.draft_model.chat_tokens([{"role": "user", "content": text}]))
    chunks = list(session.chat(text, stream=True, max_tokens=args["max_tokens"]))
    emit(kind="turn_done", index=i, chunks=chunks, committed=session.decoder.committed)
fo = session.stats.extra["failover"]
emit(kind="done", failover=fo, steps=session.stats.steps, link=session.stats.link.as_dict())
session.close()
"""


@pytest.fixture
def pair():
    ok, why = netlab.netns_available()
    if not ok:
        pytest.skip(why)
    with netlab.netns_pair() as p:
        yield p


def drain(stream, sink: list) -> None:
    for line in stream:
        sink.append(line)


def start_verifier(ns: str, host: str, model: Path, port: int = 0) -> tuple[subprocess.Popen, int]:
    proc = netlab.run_in(ns, [sys.executable, "-m", "edgespec", "verifier", "serve", "--model", str(model),
                              "--host", host, "--port", str(port), "--n-ctx", str(N_CTX), "--exit-with-parent"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    threading.Thread(target=drain, args=(proc.stderr, err), daemon=True).start()
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(60)
    line = box[0].strip() if box else ""
    assert line.startswith(READY_PREFIX), f"verifier did not start in {ns}: {line!r} {''.join(err)[-2000:]}"
    threading.Thread(target=drain, args=(proc.stdout, []), daemon=True).start()
    return proc, int(line.rsplit(":", 1)[1])


class Edge:
    """The edge child in lock step: `advance()` lets it run one step and returns that step's report."""

    def __init__(self, ns: str, args: dict) -> None:
        self.proc = netlab.run_in(ns, [sys.executable, "-c", EDGE, json.dumps(args)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        self.messages: queue.Queue = queue.Queue()
        threading.Thread(target=drain, args=(self.proc.stderr, self.stderr), daemon=True).start()
        threading.Thread(target=self._read, daemon=True).start()
        self.steps: list[dict] = []
        self.switches: list[dict] = []
        self.turns: list[dict] = []
        self.done: dict | None = None
        self._waiting = False

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                self.messages.put(json.loads(line))
        self.messages.put(None)

    def advance(self, timeout_s: float = 60) -> dict | None:
        if self._waiting:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
            self._waiting = False
        while True:
            try:
                msg = self.messages.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"edge silent for {timeout_s} s: {''.join(self.stderr)[-3000:]}") from None
            if msg is None:
                raise AssertionError(f"edge exited ({self.proc.wait(10)}): {''.join(self.stderr)[-3000:]}")
            kind = msg["kind"]
            if kind == "step":
                self.steps.append(msg)
                self._waiting = True
                return msg
            if kind == "switch":
                self.switches.append(msg["event"])
            elif kind == "turn":
                self.turns.append(msg)
            elif kind == "turn_done":
                self.turns[msg["index"]].update(msg)
            elif kind == "done":
                self.done = msg
                return None

    def run(self, n: int, pace_s: float = 0.0) -> list[dict]:
        got = []
        for _ in range(n):
            msg = self.advance()
            assert msg is not None, "the generations ended before the fault plan did"
            got.append(msg)
            time.sleep(pace_s)
        return got

    def run_until(self, pred, timeout_s: float, pace_s: float = 0.3) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.advance()
            assert msg is not None, "the generations ended before the fault plan did"
            if pred(msg):
                return msg
            time.sleep(pace_s)
        raise AssertionError(f"not reached within {timeout_s} s; last steps {self.steps[-3:]}; "
                             f"{''.join(self.stderr)[-2000:]}")

    def finish(self) -> None:
        while self.advance() is not None:
            pass
        assert self.proc.wait(30) == 0, "".join(self.stderr)[-3000:]


def local(msg: dict) -> bool:
    return msg["mode"] == "local"


def remote(msg: dict) -> bool:
    return msg["mode"] == "remote" and msg["breaker"] == "closed"


def test_fault_campaign(pair, smol_path, smol_model):
    t0 = time.monotonic()
    marks: dict[str, tuple[int, int, float]] = {}  # fault -> (first step, switches before it, time)
    netlab.set_rate(pair.ns_a, mbit=20)
    netlab.set_rate(pair.ns_b, mbit=20)
    verifier, port = start_verifier(pair.ns_b, pair.ip_b, smol_path)
    with netrelay.RelayThread((pair.ip_b, port), ("127.0.0.1", 0), thread_init=lambda: netlab.enter_netns(pair.ns_a),
                              delay_up_ms=BASE_DELAY_MS, delay_down_ms=BASE_DELAY_MS, jitter_ms=BASE_JITTER_MS,
                              connect_timeout_s=2, seed=7) as relay:
        edge = Edge(pair.ns_a, {"model": str(smol_path), "address": f"127.0.0.1:{relay.address[1]}",
                                "n_ctx": N_CTX, "shape": SHAPE, "deadline_s": DEADLINE_S, "probe_s": PROBE_S,
                                "prompts": PROMPTS, "max_tokens": MAX_TOKENS})
        try:
            def mark(name: str) -> None:
                marks[name] = (len(edge.steps), len(edge.switches), time.monotonic())

            assert all(remote(m) for m in edge.run(4)), edge.steps  # warm, all remote

            mark("delay spike")  # well below the deadline: slower, but nothing switches
            relay.set_delay(100, 100, jitter_ms=25)
            spike = edge.run(4)
            relay.set_delay(BASE_DELAY_MS, BASE_DELAY_MS, jitter_ms=BASE_JITTER_MS)
            assert all(remote(m) for m in spike), spike

            mark("stall")  # longer than the deadline: that step goes local within about deadline_s
            relay.stall(2.5)
            first = edge.run(1)[0]
            assert local(first), first  # (timing checked below: the breaker opened at the deadline)
            edge.run_until(remote, timeout_s=15)

            mark("partition")  # veth down: nothing gets through, new connections fail
            netlab.set_link(pair.ns_a, up=False)
            edge.run_until(local, timeout_s=10)
            edge.run(3, pace_s=0.3)
            netlab.set_link(pair.ns_a, up=True)
            edge.run_until(remote, timeout_s=20)

            mark("reset")  # RST on every connection: between steps, then mid-step
            relay.reset_all()
            edge.run(2)
            threading.Timer(0.05, relay.reset_all).start()
            edge.run(2)
            edge.run_until(remote, timeout_s=15)

            mark("sigkill")  # mid-step, then a restart on the same port
            threading.Timer(0.05, verifier.kill).start()
            edge.run_until(local, timeout_s=10)
            verifier.wait(10)
            edge.run(2, pace_s=0.2)
            verifier, again = start_verifier(pair.ns_b, pair.ip_b, smol_path, port)
            assert again == port
            edge.run_until(remote, timeout_s=20)
            mark("end")
            edge.finish()
        finally:
            if edge.proc.poll() is None:
                edge.proc.kill()
    campaign_s = time.monotonic() - t0

    # -- switches: reported both ways, for every fault that forced one -------------------------------
    sw = edge.switches
    print(f"campaign {campaign_s:.1f} s, {len(edge.steps)} steps, switches:")
    for e in sw:
        print(f"  step {e['step']}: {e['from_mode']} -> {e['to_mode']} ({e['breaker']}): {e['reason'][:110]}")
    names = list(marks)
    print("phases: " + ", ".join(f"{a} {marks[b][2] - marks[a][2]:.1f} s / {marks[b][0] - marks[a][0]} steps"
                                 for a, b in zip(names, names[1:])))
    for name, nxt in zip(names, names[1:]):
        got = [(e["from_mode"], e["to_mode"]) for e in sw[marks[name][1]:marks[nxt][1]]]
        if name == "delay spike":
            assert got == [], got
        elif name in ("stall", "partition", "sigkill"):
            assert got and got[0] == ("remote", "local") and got[-1] == ("local", "remote"), (name, got)
        assert all(a != b for a, b in got) and all(got[i][1] == got[i + 1][0] for i in range(len(got) - 1))
    fo = edge.done["failover"]
    # The stalled step gave up on the link at its deadline (plus drafting its tree), not when the
    # stall ended. (Its total time also holds loading the local target, which load stretches.)
    started = edge.steps[marks["stall"][0]]["started"]
    opened = next(h for h in fo["breaker_history"] if h["to_state"] == "open" and h["time"] > started)
    assert DEADLINE_S <= opened["time"] - started < DEADLINE_S + 1.0, (opened, started)
    stall = sw[marks["stall"][1]]
    assert f"within {DEADLINE_S:g} s" in stall["reason"] and "DeadlineExceededError" in stall["reason"], stall
    assert fo["switches"] == len(sw) and fo["deadline_misses"] >= 1
    assert fo["reattaches"] >= 3 and fo["mode"] == "remote" and fo["breaker"] == "closed"
    assert fo["remote_steps"] + fo["local_steps"] == edge.done["steps"] == len(edge.steps)
    assert fo["local_steps"] >= 5 and fo["remote_steps"] >= 10

    # -- nothing lost, nothing duplicated, the target's own output ----------------------------------
    assert len(edge.turns) == len(PROMPTS)
    for turn in edge.turns:
        out = [t for m in edge.steps if m["turn"] == turn["index"] for t in m["tokens"]]
        prompt = turn["prompt"]
        ended = len(out) < MAX_TOKENS
        candidate = out + [smol_model.eos] if ended else out
        label = f"turn {turn['index']}"
        text = b"".join(smol_model.token_bytes(t) for t in out).decode("utf-8", "replace")
        assert "".join(turn["chunks"]) == text, label
        committed = turn["committed"]
        assert committed[:len(prompt) + len(candidate)] == prompt + candidate, label
        assert len(committed) - len(prompt) - len(out) <= SHAPE[1] + 1, label
        reference = target_only_greedy(smol_model, prompt, MAX_TOKENS)
        assert_lossless(candidate, reference, label)
        ties = assert_targets_choices(smol_model, prompt, candidate, label)
        print(f"{label}: {len(out)} tokens, near-ties at {ties}")
    assert campaign_s < 150, campaign_s

