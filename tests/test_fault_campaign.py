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

The fleet campaign (test_fleet_fault_campaign) runs the same edge child, in lock step, against a
fleet of three `edgespec verifier serve` replicas routed at the edge (edgespec/edge/fleet.py),
each replica in its own namespace on its own veth with its own relay (netlab.netns_star), and
faults the replicas: SIGKILL of the one holding the session mid-step, its restart on the same
port, a partition of the next one's link, a stalled (SIGSTOPped) replica. A third replica is full
(--max-streams 1, held by another client): back-pressure. Same checks, plus: after every fault
the session is on a live replica that is not the faulted one, never on the full one, the full
replica's own client is unharmed, and no replica keeps a stream the moves left behind.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parent / "tools")):
    if p not in sys.path:
        sys.path.insert(0, p)

import netlab  # noqa: E402
import netrelay  # noqa: E402
from edgespec.edge.fleet import hrw_score  # noqa: E402
from failover_helpers import check_output  # noqa: E402
from lossless import target_only_greedy  # noqa: E402

pytestmark = pytest.mark.netns

N_CTX = 2048
SHAPE = (6, 3, 2, 2)  # TreeShape(budget, max_depth, branching, width)
MAX_TOKENS = 200
DEADLINE_S = 1.0
PROBE_S = 0.3
PROMPTS = ["Explain, step by step and in detail, how a computer boots.",
           "Write a detailed essay about the history of the printing press."]
BASE_DELAY_MS, BASE_JITTER_MS = 10, 3

EDGE = r"""
import json, sys, time
args = json.loads(sys.argv[1])
from edgespec import EdgeSession, TreeShape

def emit(**kw):
    print(json.dumps(kw), flush=True)

session = EdgeSession(args["model"], args["model"], verifier=args["address"], n_ctx=args["n_ctx"],
                      tree=TreeShape(*args["shape"]), deadline_s=args["deadline_s"],
                      probe_interval_s=args["probe_s"], on_switch=lambda e: emit(kind="switch", event=e.as_dict()),
                      session_id=args.get("session_id"))
inner, count, turn = session.decoder.run, [0], [0]

def lockstep(*a, **k):
    started = time.time()  # wall clock, like the failover's breaker history
    for tokens in inner(*a, **k):
        fo = session.stats.extra["failover"]
        emit(kind="step", n=count[0], turn=turn[0], tokens=list(tokens), mode=fo["mode"], breaker=fo["breaker"],
             started=started, replica=fo.get("fleet", {}).get("replica"))
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


def start_verifier(ns: str, host: str, model: Path, port: int = 0, *extra: str) -> tuple[subprocess.Popen, int]:
    return netlab.start_verifier(ns, host, model, port, *extra, n_ctx=N_CTX)


class Edge:
    """The edge child in lock step: `advance()` lets it run one step and returns that step's report."""

    def __init__(self, ns: str, args: dict) -> None:
        self.proc = netlab.run_in(ns, [sys.executable, "-c", EDGE, json.dumps(args)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        self.messages: queue.Queue = queue.Queue()
        threading.Thread(target=netlab.drain, args=(self.proc.stderr, self.stderr), daemon=True).start()
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


def report(edge: Edge, marks: dict[str, tuple[int, int, float]], seconds: float) -> None:
    """Print the switches and the phases' durations (the campaign's log)."""
    print(f"campaign {seconds:.1f} s, {len(edge.steps)} steps, switches:")
    for e in edge.switches:
        print(f"  step {e['step']}: {e['from_mode']} -> {e['to_mode']} ({e['breaker']}): {e['reason'][:110]}")
    names = list(marks)
    print("phases: " + ", ".join(f"{a} {marks[b][2] - marks[a][2]:.1f} s / {marks[b][0] - marks[a][0]} steps"
                                 for a, b in zip(names, names[1:])))


def check_switches(sw: list[dict], marks: dict[str, tuple[int, int, float]], none: tuple[str, ...] = (),
                   both_ways: tuple[str, ...] = ()) -> None:
    """Per phase (marks: name -> (first step, switches before it, time), in order): no switch in
    `none`, remote -> local first and local -> remote last in `both_ways`, and every switch goes
    from the mode the last one went to."""
    names = list(marks)
    for name, nxt in zip(names, names[1:]):
        got = [(e["from_mode"], e["to_mode"]) for e in sw[marks[name][1]:marks[nxt][1]]]
        if name in none:
            assert got == [], (name, got)
        elif name in both_ways:
            assert got and got[0] == ("remote", "local") and got[-1] == ("local", "remote"), (name, got)
        assert all(a != b for a, b in got) and all(got[i][1] == got[i + 1][0] for i in range(len(got) - 1)), got


def check_turns(edge: Edge, model, max_tokens: int) -> None:
    """Every turn the edge reported keeps the failover invariant (failover_helpers.check_output):
    nothing lost or duplicated, streamed chunks equal the text, the target's own greedy output."""
    assert edge.done is not None and all("committed" in t for t in edge.turns), "a turn did not finish"
    for turn in edge.turns:
        out = [t for m in edge.steps if m["turn"] == turn["index"] for t in m["tokens"]]
        reference = target_only_greedy(model, turn["prompt"], max_tokens)
        check_output(model, turn["prompt"], out, turn["chunks"], turn["committed"], reference,
                     f"turn {turn['index']}", max_tokens, SHAPE[1])


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
    report(edge, marks, campaign_s)
    check_switches(sw, marks, none=("delay spike",), both_ways=("stall", "partition", "sigkill"))
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

    assert len(edge.turns) == len(PROMPTS)
    check_turns(edge, smol_model, MAX_TOKENS)
    assert campaign_s < 150, campaign_s



# -- the fleet campaign ------------------------------------------------------------------------------
FLEET_MAX_TOKENS = 120
FLEET_DEADLINE_S = 3.0  # room for a move (two Info calls, Open, a Sync of ~60 tokens) and for busy cores
DEAD_S = 5.0  # Fleet's dead_s: a replica that failed is not chosen again for this long

# Another client holding the full replica's only stream: it must keep working through the campaign.
SQUAT = r"""
import sys
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.edge.link import Deadline, Link
link = Link(sys.argv[1], tokenizer_hash=sys.argv[2], timeout_s=60)
context = [1, 2, 3, 4]
link.sync(context, Deadline(60, "squat"))
print("held", flush=True)
sys.stdin.readline()
result = link.verify(context, TokenTree.chain(context[-1], []), SamplingParams(), 0, Deadline(60, "verify"))
print(f"verified {len(result.tokens)}", flush=True)
link.close()
"""


@pytest.fixture
def star():
    ok, why = netlab.netns_available()
    if not ok:
        pytest.skip(why)
    with netlab.netns_star(3, prefix="esfc-") as s:
        yield s


def fleet_streams(hub: str, spec: str) -> dict[str, int | None]:
    """Open streams per replica, from the fleet's aggregate metrics (`edgespec verifier info` run in
    the hub, i.e. Fleet.metrics over every replica's Info); None for a replica that did not answer."""
    cp = subprocess.run(["ip", "netns", "exec", hub, sys.executable, "-m", "edgespec", "verifier", "info", spec,
                         "--timeout-s", "3"], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr[-2000:]
    return {r["address"]: r.get("open_streams") for r in json.loads(cp.stdout)["replicas"]}


def test_fleet_fault_campaign(star, smol_path, smol_model):
    """Replica faults under a fleet-routed session (module docstring): the topology forces the path
    home -> second (kill) -> home, restarted (partition) -> second (stall), never the full replica."""
    t0 = time.monotonic()
    marks: dict[str, tuple[int, int, float]] = {}
    recovery: dict[str, tuple[float, float, str]] = {}  # fault -> (s to the next step, s to a live replica's)
    links = star.links
    for link in links:  # 20 Mbit/s both ways on every replica's link
        netlab.set_rate(star.hub, mbit=20, dev=link.veth_a)
        netlab.set_rate(link.ns_b, mbit=20)
    extra = [("--threads", "1")] * 2 + [("--threads", "1", "--max-streams", "1")]  # replica 2 is full
    with ThreadPoolExecutor(3) as pool:  # the replicas load their models at the same time
        started = list(pool.map(lambda i: start_verifier(links[i].ns_b, links[i].ip_b, smol_path, 0, *extra[i]),
                                range(3)))
    verifiers, ports = [p for p, _ in started], [port for _, port in started]
    with contextlib.ExitStack() as stack:
        relays = [stack.enter_context(netrelay.RelayThread(
            (link.ip_b, port), ("127.0.0.1", 0), thread_init=lambda: netlab.enter_netns(star.hub),
            delay_up_ms=BASE_DELAY_MS, delay_down_ms=BASE_DELAY_MS, jitter_ms=BASE_JITTER_MS, connect_timeout_s=2,
            seed=7 + i)) for i, (link, port) in enumerate(zip(links, ports))]
        addrs = [f"127.0.0.1:{relay.address[1]}" for relay in relays]
        spec = ",".join(addrs)

        def ranking(key: str) -> list[int]:
            return sorted(range(3), key=lambda i: hrw_score(key, addrs[i]), reverse=True)

        # a session id that ranks the full replica last: its home and next replica have room
        session_id = next(k for k in (f"robot-{n}" for n in itertools.count()) if ranking(k)[2] == 2)
        home, second, full = ranking(session_id)
        squat = netlab.run_in(star.hub, [sys.executable, "-c", SQUAT, addrs[full], smol_model.tokenizer_fingerprint()],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert netlab.read_line(squat.stdout, 60) == "held"
        edge = Edge(star.hub, {"model": str(smol_path), "address": spec, "n_ctx": N_CTX, "shape": SHAPE,
                               "deadline_s": FLEET_DEADLINE_S, "probe_s": PROBE_S, "prompts": PROMPTS[:1],
                               "max_tokens": FLEET_MAX_TOKENS, "session_id": session_id})
        try:
            def mark(name: str) -> None:
                marks[name] = (len(edge.steps), len(edge.switches), time.monotonic())

            def on(i: int):
                return lambda m: remote(m) and m["replica"] == addrs[i]

            def rest_after(t: float) -> None:  # the lock-stepped edge waits; a failed replica's dead_s runs out
                time.sleep(max(0.0, t + DEAD_S + 0.5 - time.monotonic()))

            def recover(name: str, faulted: int, fault_at: float, timeout_s: float, pace_s: float) -> None:
                """Steps until one is verified by a replica other than `faulted`; times from the fault to
                the next committed step (any side) and to that one."""
                first = edge.advance()
                assert first is not None, "the generation ended before the fault plan did"
                took = [time.monotonic() - fault_at]
                if not (remote(first) and first["replica"] != addrs[faulted]):
                    edge.run_until(lambda m: remote(m) and m["replica"] != addrs[faulted], timeout_s, pace_s)
                took.append(time.monotonic() - fault_at)
                recovery[name] = (took[0], took[1], edge.steps[-1]["replica"])

            assert all(on(home)(m) for m in edge.run(3)), edge.steps  # placed on its home, all remote

            mark("sigkill")  # the replica holding the session, mid-step: the same call moves to the next
            threading.Timer(0.05, verifiers[home].kill).start()
            killed = time.monotonic()
            recover("sigkill", home, killed + 0.05, timeout_s=20, pace_s=0.1)
            assert edge.steps[-1]["replica"] == addrs[second], edge.steps[-1]
            verifiers[home].wait(10)

            mark("restart")  # on the same port: sticky, the session stays on the replica that works
            verifiers[home], again = start_verifier(links[home].ns_b, links[home].ip_b, smol_path, ports[home],
                                                    *extra[home])
            assert again == ports[home]
            rest_after(killed)
            assert all(on(second)(m) for m in edge.run(2)), edge.steps[-2:]

            mark("partition")  # the second replica's link down: the only live replica with room is home
            netlab.set_link(links[second].ns_b, up=False)
            recover("partition", second, time.monotonic(), timeout_s=25, pace_s=0.3)
            assert edge.steps[-1]["replica"] == addrs[home], edge.steps[-1]  # back on the restarted replica
            netlab.set_link(links[second].ns_b, up=True)
            rest_after(time.monotonic())
            assert all(on(home)(m) for m in edge.run(2)), edge.steps[-2:]

            mark("stall")  # home stops answering (SIGSTOP): moved to the second replica again
            os.killpg(verifiers[home].pid, signal.SIGSTOP)
            try:
                recover("stall", home, time.monotonic(), timeout_s=25, pace_s=0.3)
            finally:
                os.killpg(verifiers[home].pid, signal.SIGCONT)
            assert edge.steps[-1]["replica"] == addrs[second], edge.steps[-1]
            mark("end")

            # no stream left behind by the moves: the edge's one on `second`, the other client's on `full`
            want = {addrs[home]: 0, addrs[second]: 1, addrs[full]: 1}
            seen: list[dict] = []
            assert netlab.wait_for(lambda: seen.append(fleet_streams(star.hub, spec)) or seen[-1] == want, 30, 0.5), \
                seen[-3:]
            squat.stdin.write("go\n")  # the full replica's own client was never disturbed
            squat.stdin.flush()
            assert netlab.read_line(squat.stdout, 60) == "verified 1"
            edge.finish()
        finally:
            for proc in (edge.proc, squat):
                if proc.poll() is None:
                    proc.kill()
    campaign_s = time.monotonic() - t0

    report(edge, marks, campaign_s)
    for e in edge.done["failover"]["fleet"]["history"]:
        print(f"  move {e['old'] or '-'} -> {e['new']}: {e['reason'][:100]}")
    sw = edge.switches
    check_switches(sw, marks, none=("restart",), both_ways=("partition", "stall"))
    # back-pressure: the full replica never served the session (it was never placed there, or refused it)
    assert not any(m["replica"] == addrs[full] for m in edge.steps if remote(m)), edge.steps
    fo = edge.done["failover"]
    assert fo["fleet"]["moves"] >= 3 and fo["fleet"]["replica"] == addrs[second], fo["fleet"]
    assert fo["mode"] == "remote" and fo["breaker"] == "closed" and fo["switches"] == len(sw)
    assert fo["remote_steps"] + fo["local_steps"] == edge.done["steps"] == len(edge.steps)
    for name, (first, moved, replica) in recovery.items():
        steps = edge.steps[marks[name][0]:]
        n = next(i for i, m in enumerate(steps) if remote(m) and m["replica"] == replica) + 1
        print(f"{name}: next committed step {first:.2f} s after the fault, verified on {replica} after "
              f"{moved:.2f} s ({n} steps, {sum(local(m) for m in steps[:n])} local)")
    assert len(edge.turns) == 1
    check_turns(edge, smol_model, FLEET_MAX_TOKENS)
    assert campaign_s < 150, campaign_s  # as the link campaign: 52 s at load 8 here, ~4 min at load 13
