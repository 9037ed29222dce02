"""Soak: concurrent edge sessions generate through a long series of random faults; nothing may be
lost, duplicated or changed (a benchmark tool, not a CI test; tests/test_soak_slice.py runs a short
seeded slice).

    sudo .venv/bin/python tools/soak.py --faults 1000 --seed 1 [--edges 3] [--out soak.json]

Topology (throw-away network namespaces, tests/netlab.py), as in tests/test_fault_campaign.py:

    ns_a: edge processes (EdgeSession children, greedy and sampled) -> 127.0.0.1:relay
          (tools/netrelay.py, a thread of this process: delay, jitter, stalls, resets)
          ==veth, tbf 20 Mbit/s both ways==>  ns_b: verifier service (child, restarted on its port)

The edges run multi-turn conversations without pause (fixed tree shape, no drafting ahead, so a
sampled turn is reproducible from its seed); after every turn an edge saves its conversation.
Faults are drawn from a seeded RNG, one after every few committed steps: delay spikes, jitter,
stalls past the deadline, partitions (veth down), half-open connections (the verifier's replies
dropped by a firewall rule in ns_b), relay resets, verifier SIGKILL + restart on the same port, a
slow verifier (SIGSTOP/SIGCONT duty cycle), and edge restarts (SIGKILL, then a new process that
continues from the saved conversation; the interrupted turn is discarded and asked again).

Checked for every completed turn: the streamed chunks concatenate to the text of the emitted
tokens; the edge's committed context is the prompt plus exactly those tokens (nothing lost or
duplicated); greedy turns equal the target's own greedy output (tests/lossless.py: a divergence
is accepted only where measured logits explain a near-tie) and sampled turns equal an
uninterrupted local run with the same seed, token for token. The seed fixes the fault sequence
(kinds, parameters and the step counts they wait for); the report lists faults per kind,
switches, resyncs, reattaches, tokens committed and every violation.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT / "tests"), str(ROOT / "tools"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import netlab  # noqa: E402  (tests/netlab.py)
import netrelay  # noqa: E402

N_CTX = 2048
SHAPE = (6, 3, 2, 2)          # TreeShape(budget, max_depth, branching, width)
DEADLINE_S = 2.0             # 3 edges share a 2-core verifier here: 1 s sends most steps local
PROBE_S = 0.3
BASE_DELAY_MS, BASE_JITTER_MS = 10, 3
KINDS = ("delay_spike", "jitter", "stall", "partition", "half_open", "relay_reset", "verifier_kill",
         "verifier_slow", "edge_restart")
CONVERSATIONS = [
    ["Explain how a computer boots.", "And what does the bootloader do?"],
    ["Write a short story about a robot that learns to paint.", "Give it a title."],
    ["List five facts about the moon.", "Which of them is the most surprising?"],
    ["Describe how bread is made.", "How long does it take?"],
]

EDGE = r"""
import json, sys, time
args = json.loads(sys.argv[1])
from edgespec import EdgeSession, TreeShape

def emit(**kw):
    print(json.dumps(kw), flush=True)

session = EdgeSession(args["model"], args["model"], verifier=args["address"], n_ctx=args["n_ctx"],
                      tree=TreeShape(*args["shape"]), deadline_s=args["deadline_s"],
                      probe_interval_s=args["probe_s"], on_switch=lambda e: emit(kind="switch", event=e.as_dict()),
                      local_first=args["local_first"])
session.decoder.pipelined = False   # trees from the context alone: a seeded sampled turn is reproducible
inner, turn_key, n_turns = session.decoder.run, [None], 0

def reporting(*a, **k):
    for tokens in inner(*a, **k):
        emit(kind="step", turn=turn_key[0], tokens=list(tokens), mode=session.stats.extra["failover"]["mode"])
        yield tokens

session.decoder.run = reporting
conv, history = args["conversation"], args["history"]
emit(kind="ready")
while True:
    i = len([m for m in history if m["role"] == "user"])
    if i >= len(conv[1]):
        conv[0] = (conv[0] + 1) % args["n_conversations"]
        conv[1] = args["conversations"][conv[0]]
        history, i = [], 0
    messages = history + [{"role": "user", "content": conv[1][i]}]
    key = [args["incarnation"], n_turns, conv[0], len(history)]
    n_turns += 1
    turn_key[0] = key
    seed = args["seed"] + 1000 * conv[0] + i
    prompt = session.draft_model.chat_tokens(messages)
    emit(kind="turn", turn=key, prompt=prompt, messages=messages, seed=seed)
    chunks = list(session.chat(messages, stream=True, max_tokens=args["max_tokens"], temperature=args["temperature"],
                               seed=seed))
    fo = session.stats.extra["failover"]
    emit(kind="turn_done", turn=key, chunks=chunks, committed=session.decoder.committed,
         failover={k: v for k, v in fo.items() if isinstance(v, (int, float, str))}, link=session.stats.link.as_dict())
    history = messages + [{"role": "assistant", "content": "".join(chunks)}]
    emit(kind="saved", conversation=[conv[0], conv[1]], history=history)
"""


def start_verifier(ns: str, host: str, model: Path, port: int = 0) -> tuple[subprocess.Popen, int]:
    return netlab.start_verifier(ns, host, model, port, "--max-sessions", "8", "--keepalive-s", "5", n_ctx=N_CTX,
                                 timeout_s=120)


@dataclass
class Turn:
    key: tuple
    edge: int
    prompt: list[int]
    messages: list[dict]
    seed: int
    temperature: float
    tokens: list[int] = field(default_factory=list)
    done: dict | None = None


class Edge:
    """One edge child; restartable from its saved conversation."""

    def __init__(self, index: int, ns: str, base_args: dict) -> None:
        self.index, self.ns, self.base = index, ns, base_args
        self.incarnation = 0
        self.saved = {"conversation": [index % len(CONVERSATIONS), CONVERSATIONS[index % len(CONVERSATIONS)]],
                      "history": []}
        self.turns: dict[tuple, Turn] = {}
        self.completed: list[Turn] = []
        self.discarded = 0            # turns cut by an edge restart
        self.switches: list[dict] = []
        self.steps = 0
        self.stderr: list[str] = []
        self.last_done: dict = {}     # incarnation -> the last turn_done's failover/link counters
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.exited: queue.Queue = queue.Queue()

    def start(self) -> None:
        self.incarnation += 1
        args = dict(self.base, conversation=self.saved["conversation"], history=self.saved["history"],
                    incarnation=f"{self.index}.{self.incarnation}",
                    # a restarted edge may come up during an outage: it starts locally and attaches the
                    # verifier once it answers (a first start must reach it: a configuration check)
                    local_first=self.incarnation > 1)
        self.stderr = []
        self.proc = netlab.run_in(self.ns, [sys.executable, "-c", EDGE, json.dumps(args)], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=netlab.drain, args=(self.proc.stderr, self.stderr), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc, self.incarnation), daemon=True).start()

    def _read(self, proc: subprocess.Popen, incarnation: int) -> None:
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            kind = msg["kind"]
            with self.lock:
                if kind == "turn":
                    key = tuple(msg["turn"])
                    self.turns[key] = Turn(key, self.index, msg["prompt"], msg["messages"], msg["seed"],
                                           self.base["temperature"])
                elif kind == "step":
                    self.turns[tuple(msg["turn"])].tokens.extend(msg["tokens"])
                    self.steps += 1
                elif kind == "switch":
                    self.switches.append(msg["event"])
                elif kind == "turn_done":
                    turn = self.turns.pop(tuple(msg["turn"]))
                    turn.done = msg
                    self.completed.append(turn)
                    self.last_done[incarnation] = {**msg["failover"], **{f"link_{k}": v for k, v in msg["link"].items()}}
                elif kind == "saved":
                    self.saved = {"conversation": msg["conversation"], "history": msg["history"]}
        self.exited.put(incarnation)

    def kill_and_restart(self) -> None:
        """SIGKILL mid-turn; the new process continues from the saved conversation."""
        self.proc.kill()
        self.proc.wait(30)
        self.exited.get(timeout=30)   # the reader has seen everything the old process wrote
        with self.lock:
            self.discarded += len(self.turns)
            self.turns.clear()
        self.start()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def counters(self) -> dict:
        total: collections.Counter = collections.Counter()
        for c in self.last_done.values():
            for k, v in c.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] += v
        return dict(total)


def targets_choices(model, prompt: list[int], out: list[int], label: str) -> list[int]:  # noqa: ANN001
    """tests/failover_helpers.assert_targets_choices, with one difference: several processes verify
    the same contexts here (edges on the same conversation, a step given up at its deadline and
    verified again locally, a stopped verifier finishing late), so a divergence is explained if the
    logits of ANY recorded verification of exactly that context explain it (lossless.explain_divergence
    takes the most recent one). A wrong acceptance still fails: no verification chose that token."""
    import numpy as np

    import logit_record
    from edgespec.common.tree import TokenTree
    from edgespec.runtime.llama import ContextConfig
    from edgespec.runtime.tree_verifier import LlamaTreeVerifier
    from lossless import GREEDY, explain_divergence, model_name

    def explained(context: list[int], token: int, row, position: int) -> None:  # noqa: ANN001
        ctx = np.asarray(context, np.int32)
        digests: dict[int, bytes] = {}

        def prefix_digest(n: int) -> bytes:
            if n not in digests:
                digests[n] = logit_record.base_digest(ctx[:n])
            return digests[n]

        matches = [r for r in sorted(logit_record._child_records(), key=lambda r: r.t_ns, reverse=True)
                   if r.node_for(ctx, prefix_digest) is not None]
        errors = []
        for rec in matches:
            try:
                explain_divergence(context, token, row, label, model=model_name(model), position=position, records=[rec])
                return
            except AssertionError as exc:
                errors.append(str(exc))
        raise AssertionError(f"{label}: token {position}: none of {len(matches)} recorded verifications of that "
                             f"context explains it: {errors[:2] or 'no record'}")

    verifier = LlamaTreeVerifier(model, ContextConfig(n_ctx=N_CTX))
    ties, i = [], 0
    try:
        verifier.sync(prompt)
        while i < len(out):
            chunk = out[i:i + 16]
            with logit_record.capture() as records:
                result = verifier.verify(TokenTree.chain(verifier.committed[-1], chunk), GREEDY, i)
            n = len(result.path)
            if n < len(chunk):
                explained(prompt + out[:i + n], chunk[n], records[-1].row(n), i + n)
                ties.append(i + n)
                n += 1
            i += n
            verifier.sync(prompt + out[:i])
    finally:
        verifier.close()
    return ties


def half_open(ns: str, on: bool) -> None:
    """Drop what ns leaves through its veth (the verifier's replies), while requests still arrive."""
    table = "edgespec_soak"
    exec_ = ["ip", "netns", "exec", ns, "nft"]
    subprocess.run([*exec_, "delete", "table", "inet", table], capture_output=True, timeout=10)
    if on:
        script = (f"table inet {table} {{\n  chain output {{ type filter hook output priority -300; "
                  f'oifname != "lo" drop; }}\n}}\n')
        subprocess.run([*exec_, "-f", "-"], input=script, text=True, check=True, capture_output=True, timeout=10)


class Soak:
    def __init__(self, args: argparse.Namespace, model: Path, log=print) -> None:  # noqa: ANN001
        self.args, self.model, self.log = args, model, log
        self.rng = random.Random(args.seed)
        self.faults: collections.Counter = collections.Counter()
        self.fault_log: list[dict] = []
        self.verifier_restarts = 0

    def total_steps(self) -> int:
        return sum(e.steps for e in self.edges)

    def wait_steps(self, n: int, timeout_s: float = 120) -> bool:
        target, deadline = self.total_steps() + n, time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.total_steps() >= target:
                return True
            for e in self.edges:
                if e.proc.poll() is not None:
                    raise RuntimeError(f"edge {e.index} exited: {''.join(e.stderr)[-3000:]}")
            time.sleep(0.05)
        return False

    def run(self) -> dict:
        a = self.args
        t0 = time.monotonic()
        # the verifier and the edges' local targets record the logits they decided with, so that
        # a greedy divergence at a near-tie can be explained (tests/logit_record.py, lossless.py)
        import logit_record
        logit_record.enable_children()
        with netlab.netns_pair() as pair:
            self.pair = pair
            netlab.set_rate(pair.ns_a, mbit=20)
            netlab.set_rate(pair.ns_b, mbit=20)
            self.verifier, self.port = start_verifier(pair.ns_b, pair.ip_b, self.model)
            with netrelay.RelayThread((pair.ip_b, self.port), ("127.0.0.1", 0),
                                      thread_init=lambda: netlab.enter_netns(pair.ns_a),
                                      delay_up_ms=BASE_DELAY_MS, delay_down_ms=BASE_DELAY_MS, jitter_ms=BASE_JITTER_MS,
                                      connect_timeout_s=2, seed=a.seed) as relay:
                self.relay = relay
                base = {"model": str(self.model), "address": f"127.0.0.1:{relay.address[1]}", "n_ctx": N_CTX,
                        "shape": SHAPE, "deadline_s": DEADLINE_S, "probe_s": PROBE_S, "max_tokens": a.max_tokens,
                        "conversations": CONVERSATIONS, "n_conversations": len(CONVERSATIONS), "seed": a.seed}
                self.edges = [Edge(i, pair.ns_a, dict(base, temperature=0.0 if i % 3 != 2 else 0.8))
                              for i in range(a.edges)]
                try:
                    for e in self.edges:
                        e.start()
                    if not self.wait_steps(2 * a.edges, timeout_s=300):
                        raise RuntimeError("the edges made no progress: " + " | ".join(
                            "".join(e.stderr)[-1500:] for e in self.edges))
                    budget_end = t0 + a.max_minutes * 60 if getattr(a, "max_minutes", None) else None
                    for i in range(a.faults):
                        if budget_end is not None and time.monotonic() > budget_end:
                            self.log(f"time budget of {a.max_minutes} min spent after {i} faults")
                            break
                        kind = self.rng.choice(KINDS)
                        gap = self.rng.randint(2, 6)
                        if not self.wait_steps(gap):
                            raise RuntimeError(f"no progress before fault {i} ({kind}): " + " | ".join(
                                "".join(e.stderr)[-1500:] for e in self.edges))
                        started = time.monotonic()
                        detail = self.inject(kind)
                        self.faults[kind] += 1
                        self.fault_log.append({"i": i, "kind": kind, "after_steps": gap, "detail": detail,
                                               "t": round(started - t0, 2), "s": round(time.monotonic() - started, 2)})
                        if (i + 1) % 10 == 0:
                            self.log(f"{i + 1}/{a.faults} faults, {time.monotonic() - t0:.0f} s, "
                                     f"{self.total_steps()} steps, {sum(len(e.completed) for e in self.edges)} turns")
                    # let every edge finish one more turn after the last fault
                    want = {e.index: len(e.completed) + 1 for e in self.edges}
                    deadline = time.monotonic() + 600
                    while time.monotonic() < deadline and any(len(e.completed) < want[e.index] for e in self.edges):
                        time.sleep(0.2)
                finally:
                    for e in self.edges:
                        e.stop()
                    half_open(pair.ns_b, False)
                    if self.verifier.poll() is None:
                        os.kill(self.verifier.pid, signal.SIGCONT)
                        self.verifier.kill()
        soak_s = time.monotonic() - t0
        self.log(f"fault phase done: {sum(self.faults.values())} faults in {soak_s:.0f} s, "
                 f"{sum(len(e.completed) for e in self.edges)} turns to check; {dict(self.faults)}")
        return self.report(soak_s)

    # -- faults ---------------------------------------------------------------------------------
    def inject(self, kind: str) -> dict:
        r, relay = self.rng, self.relay
        if kind == "delay_spike":
            ms = r.randint(50, 400)
            relay.set_delay(ms, ms, jitter_ms=ms // 4)
            time.sleep(r.uniform(0.3, 1.5))
            relay.set_delay(BASE_DELAY_MS, BASE_DELAY_MS, jitter_ms=BASE_JITTER_MS)
            return {"delay_ms": ms}
        if kind == "jitter":
            ms = r.randint(20, 300)
            relay.set_delay(BASE_DELAY_MS, BASE_DELAY_MS, jitter_ms=ms)
            time.sleep(r.uniform(0.5, 2.0))
            relay.set_delay(BASE_DELAY_MS, BASE_DELAY_MS, jitter_ms=BASE_JITTER_MS)
            return {"jitter_ms": ms}
        if kind == "stall":
            s = round(DEADLINE_S + r.uniform(0.2, 2.0), 2)
            relay.stall(s)
            time.sleep(s)
            return {"stall_s": s}
        if kind == "partition":
            s = round(r.uniform(0.5, 3.0), 2)
            netlab.set_link(self.pair.ns_a, up=False)
            time.sleep(s)
            netlab.set_link(self.pair.ns_a, up=True)
            return {"down_s": s}
        if kind == "half_open":
            s = round(r.uniform(0.5, 3.0), 2)
            half_open(self.pair.ns_b, True)
            time.sleep(s)
            half_open(self.pair.ns_b, False)
            return {"replies_dropped_s": s}
        if kind == "relay_reset":
            time.sleep(r.uniform(0, 0.2))
            return {"connections": relay.reset_all()}
        if kind == "verifier_kill":
            time.sleep(r.uniform(0, 0.3))
            self.verifier.kill()
            self.verifier.wait(30)
            down = r.uniform(0.2, 2.0)
            time.sleep(down)
            self.verifier, again = start_verifier(self.pair.ns_b, self.pair.ip_b, self.model, self.port)
            assert again == self.port
            self.verifier_restarts += 1
            return {"down_s": round(down, 2)}
        if kind == "verifier_slow":
            period, duty, total = r.uniform(0.1, 0.6), r.uniform(0.3, 0.9), r.uniform(1.0, 3.0)
            end = time.monotonic() + total
            try:
                while time.monotonic() < end:
                    os.kill(self.verifier.pid, signal.SIGSTOP)
                    time.sleep(period * duty)
                    os.kill(self.verifier.pid, signal.SIGCONT)
                    time.sleep(period * (1 - duty))
            finally:
                os.kill(self.verifier.pid, signal.SIGCONT)
            return {"period_s": round(period, 2), "stopped_fraction": round(duty, 2), "total_s": round(total, 2)}
        if kind == "edge_restart":
            edge = self.edges[r.randrange(len(self.edges))]
            time.sleep(r.uniform(0, 0.5))
            edge.kill_and_restart()
            return {"edge": edge.index}
        raise ValueError(kind)

    # -- checks ---------------------------------------------------------------------------------
    def report(self, soak_s: float) -> dict:
        from lossless import target_only_greedy  # tests/lossless.py

        from edgespec import EdgeSession, TreeShape
        from edgespec.runtime.llama import LlamaModel

        model = LlamaModel(self.model)
        violations: list[str] = []
        failed: list[dict] = []
        verdicts: dict = {}
        explained = greedy_equal = sampled_equal = 0
        tie_positions: list[list[int]] = []
        sampled_diff: list[str] = []
        refs: dict = {}
        local = None
        n_tokens = 0
        checked = 0
        for e in self.edges:
            for t in e.completed:
                checked += 1
                if checked % 10 == 0:
                    self.log(f"checked {checked} turns")
                label = f"edge {e.index} turn {t.key}"
                out = t.tokens
                n_tokens += len(out)
                text = b"".join(model.token_bytes(x) for x in out).decode("utf-8", "replace")
                if "".join(t.done["chunks"]) != text:
                    violations.append(f"{label}: streamed chunks differ from the text of the tokens")
                ended = len(out) < self.args.max_tokens
                candidate = out + [model.eos] if ended else out
                committed = t.done["committed"]
                if committed[:len(t.prompt) + len(candidate)] != t.prompt + candidate or \
                        len(committed) - len(t.prompt) - len(out) > SHAPE[1] + 1:
                    violations.append(f"{label}: committed context != prompt + emitted tokens (lost or duplicated)")
                    continue
                if t.temperature == 0:
                    # equal to the uninterrupted target-only run, or diverged at a near-tie: then every
                    # token must still be the target's choice after the tokens before it (teacher
                    # forced; a near-tie only where recorded logits explain it)
                    key = tuple(t.prompt)
                    if key not in refs:
                        refs[key] = target_only_greedy(model, t.prompt, self.args.max_tokens).tokens
                    if candidate == refs[key][:len(candidate)]:
                        greedy_equal += 1
                        continue
                    verdict_key = (key, tuple(candidate))   # the same turn, the same output: checked once
                    if verdict_key not in verdicts:
                        try:
                            verdicts[verdict_key] = targets_choices(model, t.prompt, candidate, label)
                        except AssertionError as exc:
                            verdicts[verdict_key] = f"not the target's greedy output: {str(exc)[:300]}"
                    verdict = verdicts[verdict_key]
                    if isinstance(verdict, str):
                        failed.append({"label": label, "prompt": t.prompt, "out": out, "ref": refs[key]})
                        violations.append(f"{label}: {verdict}")
                    else:
                        explained += 1
                        tie_positions.append(verdict)
                else:
                    key = (json.dumps(t.messages), t.seed)
                    if key not in refs:
                        if local is None:
                            local = EdgeSession(self.model, self.model, local=True, n_ctx=N_CTX, tree=TreeShape(*SHAPE))
                        local.chat(t.messages, max_tokens=self.args.max_tokens, temperature=t.temperature, seed=t.seed)
                        refs[key] = local.decoder.committed[len(t.prompt):]
                    ref = refs[key]
                    if candidate[:len(ref)] == ref[:len(candidate)] and not (ended and len(ref) < len(candidate)):
                        sampled_equal += 1
                    else:
                        sampled_diff.append(f"{label}: differs from the local run with seed {t.seed} at token "
                                            f"{next(j for j in range(len(candidate) + 1) if j >= len(ref) or j >= len(candidate) or ref[j] != candidate[j])}")
        if local is not None:
            local.close()
        counters: collections.Counter = collections.Counter()
        for e in self.edges:
            counters.update(e.counters())
        return {
            "seed": self.args.seed, "faults_requested": self.args.faults, "faults": sum(self.faults.values()),
            "faults_per_kind": dict(sorted(self.faults.items())), "edges": self.args.edges,
            "sampled_edges": sum(1 for e in self.edges if e.base["temperature"] > 0),
            "turns_checked": sum(len(e.completed) for e in self.edges),
            "turns_discarded_by_edge_restarts": sum(e.discarded for e in self.edges),
            "tokens_committed": n_tokens, "steps": self.total_steps(),
            "switches": sum(len(e.switches) for e in self.edges),
            "resyncs": counters.get("link_resyncs", 0), "reconnects": counters.get("link_reconnects", 0),
            "reattaches": counters.get("reattaches", 0), "deadline_misses": counters.get("deadline_misses", 0),
            "local_steps": counters.get("local_steps", 0), "remote_steps": counters.get("remote_steps", 0),
            "verifier_restarts": self.verifier_restarts,
            "greedy_turns_equal_to_reference": greedy_equal, "greedy_turns_near_tie_explained": explained,
            "near_tie_positions": tie_positions, "sampled_turns_equal_to_local_run": sampled_equal,
            "sampled_turns_different": sampled_diff,
            "violations": violations, "seconds": round(soak_s, 1),
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "fault_log": self.fault_log, "failed_turns": failed,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--edges", type=int, default=3, help="edge sessions; every third one samples (temperature 0.8)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--model", default="test", help="draft and target (default: the SmolLM2 test model)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="stop injecting faults after this long (the run then finishes its turns and reports)")
    ap.add_argument("--out", type=Path, default=None, help="write the report (with the fault log) as JSON")
    args = ap.parse_args(argv)
    ok, why = netlab.netns_available()
    if not ok:
        print(f"soak needs network namespaces: {why}", file=sys.stderr)
        return 2
    from edgespec.common import modelstore

    model = modelstore.resolve(args.model, progress=False)
    report = Soak(args, model, log=lambda m: print(m, file=sys.stderr, flush=True)).run()
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k not in ("fault_log", "failed_turns")}, indent=2))
    return 0 if not report["violations"] else 1


if __name__ == "__main__":
    sys.exit(main())
