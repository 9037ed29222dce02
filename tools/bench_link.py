#!/usr/bin/env python3
"""Edge-cloud link benchmark (issue 5): tokens/s of cloud-only AR vs chain vs adaptive trees per link.

The link is real TCP between two throw-away Linux network namespaces (tests/netlab.py):

    edge (this process, namespace A) -> netrelay (namespace A, adds RTT/2 each way)
        -> veth with a tbf rate limit on both ends -> verifier process (namespace B)

- the verifier is `python -m edgespec verifier serve --model <target> --host <ip B> --port 0`,
  started with `ip netns exec B`, one thread (like the edge's draft model);
- the relay is `tools/netrelay.py` run with `ip netns exec A`; its control port sets the delay per
  condition; `tc ... tbf` sets the rate on both veth ends;
- the edge is `EdgeSession(draft, target, verifier="<ip A>:<relay port>", fallback=False)` (no local
  target takes over slow steps: this measures the link). Its main thread enters
  namespace A (netlab.in_netns) *before* the process touches gRPC, so every gRPC thread (created
  lazily, and shared by all channels of the process) lives in A. One namespace pair, one verifier
  and one relay serve every condition: between conditions only the relay delay and the tbf rate
  change. (Per-condition namespaces would need a fresh process per condition: gRPC threads
  created inside one namespace keep it, and later channels may connect from any of them.)

Modes, all greedy, the same prompts for every mode and condition:
- `ar`: cloud-only autoregressive decoding, `TreeShape.target_only()`: one round trip per token;
- `chain4`: chain speculation, `TreeShape.chain(4)` (any `chainK`, K = 1..16, with --modes);
- `adaptive`: `tree=None`, the default (cost-model planner + drafting the next tree while one is
  in flight). Each link condition gets its own planner (the session's planner is swapped per
  condition), so what it learned at one RTT does not leak into another;
- `router` (only with --modes): `EdgeSession(router=STATE)`, the router choosing per prompt among
  the draft model, the lookup and both, and per step the tree (edge/router.py); it starts from
  --router-state (default: a fresh state) and learns over the run's prompts and conditions.

Prompts: HumanEval and Spec-Bench single-turn prompts, plus --multi-turn items of
tools/bench_pool.py's multi-turn/agentic/editing set (message lists).

Runs are ordered prompt-major (prompt -> condition -> mode), so slow drift of the (shared, noisy)
CPU hits every mode and condition alike, and a time budget (--budget-min) that ends the run early
ends it after a whole prompt. Before its first timed run each session is warmed up with one token
(prompt prefill on both ends; not timed). Times per run are the decoder's per-step wall times,
which exclude the initial Sync of the prompt (a round trip plus, after the first run, a one-token
re-decode).

  .venv/bin/python tools/bench_link.py --quick                     # 1 RTT, 1 rate, 1 prompt, 16 tokens
  .venv/bin/python tools/bench_link.py --json docs/bench/link.json # full grid, table + docs/bench/link_speedup.png
  .venv/bin/python tools/bench_link.py --rtts 50 --mbits 100 --modes ar,router --multi-turn 6  # router vs AR

--local-link: the same run on one host with no namespaces and no tc (a GPU VM may have neither;
rates are irrelevant there): the verifier listens on 127.0.0.1, the relay too, and only the relay's
delay changes per condition (the Mbit/s column reads "-"). --verifier-args passes options to the
verifier (e.g. its torch backend on the GPU), --draft-threads the edge's llama.cpp threads (default:
EdgeSession's choice for a remote verifier, every core but one up to 8), and --warmup-tokens an
untimed pass over every prompt, mode and (adaptive session) ladder shape first, so a GPU verifier
has captured its CUDA graphs (one per tree-size/context bucket) before any clock runs:

  .venv/bin/python tools/bench_link.py --local-link --rtts 0,50,100 --warmup-tokens 32 --max-tokens 80 \
      --verifier-args="--backend torch --device cuda" --draft-threads 8 --json /tmp/e2e.json --no-plot
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "tools"), str(REPO / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import netlab  # noqa: E402  (tests/netlab.py)
from bench_local import add_model_args  # noqa: E402
from bench_wire import load_prompts, machine  # noqa: E402

from edgespec.cli.bench import read_results  # noqa: E402

MODES = ("ar", "chain4", "adaptive")
ALL_MODES = (*MODES, "router")


@dataclass
class Cell:
    """One (rtt, rate, mode), summed over prompts."""

    rtt_ms: float
    mbit: float
    mode: str
    runs: int = 0
    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prepared_hits: int = 0
    prefill_seconds: float = 0.0
    link_wall_ms: float = 0.0      # summed Verify round trips (client wall)
    link_rtt_ms: float = 0.0       # summed wall - server queue - server compute
    link_compute_ms: float = 0.0
    link_queue_ms: float = 0.0
    link_step_bytes_up: int = 0    # protobuf Verify messages
    link_step_bytes_down: int = 0  # protobuf Verified messages
    relay_bytes_up: int = 0        # TCP payload through the relay (HTTP/2 framing, Sync, pings included)
    relay_bytes_down: int = 0
    shapes: dict = field(default_factory=dict)  # steps per tree shape (TreeShape.label)
    outputs: list = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def per_step(self, value: float) -> float:
        return value / self.steps if self.steps else 0.0


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """First stdout line of a child, with a timeout."""
    box: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: box.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = box.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(f"no output from {proc.args} within {timeout_s} s") from None
    if not line:
        raise RuntimeError(f"{proc.args} exited (rc {proc.poll()}) before printing its address")
    return line.strip()


def relay_stats(control: tuple[str, int]) -> dict:
    import netrelay
    return json.loads(netrelay.control(control, "stats").split(" ", 1)[1])


def tbf_stats(pair: netlab.NetnsPair) -> dict:
    """`tc -s qdisc show` of both veth ends (shows the tbf rate and its counters)."""
    out = {}
    for ns, dev in ((pair.ns_a, pair.veth_a), (pair.ns_b, pair.veth_b)):
        cp = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True,
                            timeout=10)
        out[ns] = " ".join(cp.stdout.split())
    return out


@dataclass
class Link:
    """The edge's way to the verifier: the relay's addresses, and how a condition is applied.

    Two kinds (see the module docstring): namespaces with a tbf rate (`netns_link`) and plain
    loopback (`local_link`); the benchmark loop is the same for both."""

    edge_address: str                            # where the edge connects: the relay's listening port
    control: tuple[str, int]                     # the relay's control port (delay, stats)
    verifier_address: str
    token: str
    set_rate: Callable[[float], None]            # Mbit/s on both directions (a no-op on loopback)
    edge_side: Callable[[], contextlib.AbstractContextManager]  # where the edge's thread must live
    rate_stats: Callable[[], dict]               # the rate limiter's counters, per condition


def start_relay(upstream: str, host: str, netns: str | None = None) -> tuple[subprocess.Popen, dict]:
    """tools/netrelay.py as a child (its own process: the edge's GIL never delays a byte), inside
    `netns` if given (then killed with the namespace pair); returns it and its ready line (listen
    and control addresses)."""
    argv = [sys.executable, str(REPO / "tools" / "netrelay.py"), "--listen", f"{host}:0", "--upstream", upstream,
            "--control", "127.0.0.1:0"]
    kw: dict = {"stdout": subprocess.PIPE, "text": True, "stdin": subprocess.DEVNULL}
    relay = netlab.run_in(netns, argv, **kw) if netns else subprocess.Popen(argv, **kw)
    return relay, json.loads(read_line(relay, 30))


@contextlib.contextmanager
def netns_link(target: Path, args: argparse.Namespace) -> Iterator[Link]:
    """Verifier in namespace B, relay in A, a tbf rate on both veth ends (needs root and `ip netns`)."""
    from edgespec.edge.embedded import EmbeddedVerifier

    ok, why = netlab.netns_available()
    if not ok:
        raise SystemExit(f"bench_link needs network namespaces (or --local-link): {why}")
    with netlab.netns_pair() as pair:
        vp = EmbeddedVerifier(target, n_ctx=args.n_ctx, max_nodes=128, max_sessions=4, host=pair.ip_b,
                              command_prefix=["ip", "netns", "exec", pair.ns_b], wait_serving=False,
                              extra_args=["--threads", "1", *shlex.split(args.verifier_args)])
        try:
            _, info = start_relay(vp.address, pair.ip_a, pair.ns_a)
            host, port = info["control"].rsplit(":", 1)
            print(f"verifier {vp.address} (netns {pair.ns_b}); relay {info['listen']} (netns {pair.ns_a})",
                  file=sys.stderr, flush=True)

            def set_rate(mbit: float) -> None:
                netlab.set_rate(pair.ns_a, mbit)
                netlab.set_rate(pair.ns_b, mbit)

            # The edge's thread enters namespace A before the process touches gRPC, so gRPC's
            # threads (created lazily, shared by all channels) live in A.
            yield Link(info["listen"], (host, int(port)), vp.address, vp.token, set_rate,
                       lambda: netlab.in_netns(pair.ns_a), lambda: tbf_stats(pair))
        finally:
            vp.stop()


@contextlib.contextmanager
def local_link(target: Path, args: argparse.Namespace) -> Iterator[Link]:
    """Verifier and relay on 127.0.0.1, no namespaces, no rate limit: only the relay's delay
    changes. For hosts without `ip netns`/tc (a GPU VM), where the link's rate is not the question."""
    from edgespec.edge.embedded import EmbeddedVerifier

    vp = EmbeddedVerifier(target, n_ctx=args.n_ctx, max_nodes=128, max_sessions=4, host="127.0.0.1",
                          extra_args=["--threads", "1", *shlex.split(args.verifier_args)])
    relay = None
    try:
        relay, info = start_relay(vp.address, "127.0.0.1")
        host, port = info["control"].rsplit(":", 1)
        print(f"verifier {vp.address}; relay {info['listen']} (loopback, no rate limit)", file=sys.stderr, flush=True)
        yield Link(info["listen"], (host, int(port)), vp.address, vp.token, lambda mbit: None,
                   contextlib.nullcontext, dict)
    finally:
        if relay is not None:
            relay.terminate()
            try:
                relay.wait(timeout=10)
            except subprocess.TimeoutExpired:
                relay.kill()
        vp.stop()


def make_sessions(draft: Path, target: Path, address: str, token: str, n_ctx: int,
                  modes: tuple[str, ...] = MODES, router_state: Path | None = None,
                  draft_threads: int | None = None) -> dict:
    from edgespec.edge.drafting import TreeShape
    from edgespec.edge.session import EdgeSession

    shapes = {"ar": TreeShape.target_only(), "adaptive": None, "router": None}
    shapes |= {mode: TreeShape.from_label(mode) for mode in modes if mode.startswith("chain")}
    sessions = {}
    try:
        for mode in modes:
            # fallback=False: a slow step must not be verified by a local copy of the target (that
            # would measure the device, not the link); the step deadline is then the link's 60 s.
            sessions[mode] = EdgeSession(draft, target, verifier=address, token=token, tree=shapes[mode], n_ctx=n_ctx,
                                         fallback=False, router=router_state if mode == "router" else None,
                                         draft_threads=draft_threads)
    except BaseException:
        for s in sessions.values():
            s.close()
        raise
    return sessions


@contextlib.contextmanager
def run_delta(stats) -> Iterator[dict]:
    """A SessionStats' change over the block, filled into the yielded dict when it ends: the counters, the steps per
    shape, and the block's step trace (kept only for the block)."""
    before = {k: getattr(stats, k) for k in stats.COUNTERS}
    shapes_before = dict(stats.shapes)
    delta: dict = {}
    stats.trace = []
    try:
        yield delta
    finally:
        trace, stats.trace = stats.trace, None
    delta.update({k: getattr(stats, k) - before[k] for k in stats.COUNTERS})
    delta["shapes"] = {k: n - shapes_before.get(k, 0) for k, n in stats.shapes.items() if n > shapes_before.get(k, 0)}
    delta["trace"] = trace


def one_run(session, prompt: list[int], max_tokens: int) -> tuple[dict, list[int]]:
    """Generate greedily; returns the deltas of the decoder's and the link's counters."""
    from edgespec.common.sampling import SamplingParams

    link = session.verifier.link_stats
    lkeys = ("wall_ms", "rtt_ms", "compute_ms", "queue_ms", "step_bytes_up", "step_bytes_down")
    link_before = {k: getattr(link, k) for k in lkeys}
    out: list[int] = []
    with run_delta(session.decoder.stats) as delta:
        for tokens in session.generate_tokens(prompt, max_tokens, SamplingParams(temperature=0.0)):
            out.extend(tokens)
    delta.update({"link_" + k: getattr(link, k) - link_before[k] for k in lkeys})
    return delta, out


def warm_up(sessions: dict, prompts: list[list[int]], tokens: int) -> None:
    """Untimed, at no added delay: every session generates `tokens` on every prompt, the adaptive
    one once per ladder shape. A GPU verifier captures a CUDA graph on the first use of each
    (tree size, context length) bucket; without this the first timed runs would pay for the
    captures. The router session is left out: what it learned would change its later choices."""
    from edgespec.edge.planner import LADDER

    for prompt in prompts:
        for mode, s in sessions.items():
            if mode == "adaptive":
                for shape in LADDER:
                    s.tree_shape = shape
                    one_run(s, prompt, tokens)
                s.tree_shape = None
            elif mode != "router":
                one_run(s, prompt, tokens)


def prompt_set(spec_bench: Path, humaneval: int, spec: int) -> list:
    """(name, text) of the first `humaneval` HumanEval and `spec` Spec-Bench prompts, alternating."""
    code = load_prompts(spec_bench, humaneval, 0)
    prose = load_prompts(spec_bench, 0, spec)
    return [p for pair in zip(code, prose) for p in pair] + code[len(prose):] + prose[len(code):]


def run(args: argparse.Namespace) -> dict:
    from edgespec.common import modelstore

    import netrelay
    rtts = [float(x) for x in args.rtts.split(",")]
    rates = [0.0] if args.local_link else [float(x) for x in args.mbits.split(",")]  # 0: no rate limit
    named = prompt_set(args.spec_bench, args.humaneval, args.spec)
    if args.multi_turn:
        from bench_pool import MULTI_TURN
        named += MULTI_TURN[:args.multi_turn]
    modes = tuple(args.modes.split(","))
    unknown = [m for m in modes if m not in ALL_MODES and not re.fullmatch(r"chain([1-9]|1[0-6])", m)]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}: use {', '.join(ALL_MODES)} or chainK (K = 1..16)")
    draft, target = modelstore.resolve(args.draft), modelstore.resolve(args.target)
    conds = [(r, m) for m in rates for r in rtts]
    cells = {(r, m, mode): Cell(r, m, mode) for (r, m) in conds for mode in modes}
    meta: dict = {"machine": machine(), "command": " ".join(["python", *sys.argv]), "draft": draft.name,
                  "target": target.name, "max_tokens": args.max_tokens, "rtts_ms": rtts, "mbits": rates,
                  "prompts": [n for n, _ in named], "modes": modes, "tbf": {}, "relay": {},
                  "link": "loopback" if args.local_link else "netns", "verifier_args": args.verifier_args,
                  "warmup_tokens": args.warmup_tokens}
    code_rev = os.environ.get("EDGESPEC_CODE_REV")   # the commit, where the checkout's own git is not it (GPU host)
    if code_rev:
        meta["git"] = code_rev
    else:
        try:
            head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no",
                                    "edgespec"], capture_output=True, text=True, timeout=10).stdout.strip()
            meta["git"] = (head + (" (edgespec/ has uncommitted changes)" if dirty else "")) or "unknown"
        except (OSError, subprocess.SubprocessError):
            meta["git"] = "unknown"
    started = time.monotonic()
    with (local_link if args.local_link else netns_link)(target, args) as link:
        control = link.control
        meta["verifier_ready_s"] = round(time.monotonic() - started, 1)
        with link.edge_side():
            router_state = args.router_state or Path(tempfile.mkdtemp(prefix="bench-link-")) / "router.npz"
            sessions = make_sessions(draft, target, link.edge_address, link.token, args.n_ctx, modes, router_state,
                                     args.draft_threads)
            try:
                meta["draft_threads"] = next(iter(sessions.values())).threads["draft"]
                # gRPC shares one subchannel (TCP connection) between channels to the same
                # address, so the three sessions may use one connection: at least one must exist.
                meta["relay_connections"] = relay_stats(control)["connections"]
                if meta["relay_connections"] < 1:
                    raise RuntimeError("the sessions did not connect through the relay")
                first = next(iter(sessions.values()))
                tokenized = [first.draft_model.chat_tokens(
                    [{"role": "user", "content": text}] if isinstance(text, str) else text) for _, text in named]
                meta["prompt_tokens"] = [len(t) for t in tokenized]
                from edgespec.edge.planner import Planner
                planners = {c: Planner() for c in conds}
                if args.warmup_tokens:
                    t0 = time.monotonic()
                    link.set_rate(max(rates))
                    netrelay.control(control, "delay 0 0")
                    warm_up(sessions, tokenized, args.warmup_tokens)
                    meta["warmup_s"] = round(time.monotonic() - t0, 1)
                    print(f"[{time.monotonic() - started:6.0f} s] warm-up done in {meta['warmup_s']:.0f} s",
                          file=sys.stderr, flush=True)
                done_prompts = 0
                for pi, prompt in enumerate(tokenized):
                    if pi and time.monotonic() - started > args.budget_min * 60:
                        print(f"time budget reached after {pi} prompts", file=sys.stderr, flush=True)
                        break
                    for mode, s in sessions.items():  # warm-up: prefill on both ends, untimed
                        if mode == "adaptive":
                            s.decoder.planner = Planner()
                        one_run(s, prompt, 1)
                    for (rtt, mbit) in conds:
                        link.set_rate(mbit)
                        netrelay.control(control, f"delay {rtt / 2:g} {rtt / 2:g}")
                        for mode, s in sessions.items():
                            if mode == "adaptive":
                                s.decoder.planner = planners[(rtt, mbit)]
                            r0 = relay_stats(control)
                            d, out = one_run(s, prompt, args.max_tokens)
                            r1 = relay_stats(control)
                            c = cells[(rtt, mbit, mode)]
                            c.runs += 1
                            for k, v in d.items():
                                if k == "shapes":
                                    for label, n in v.items():
                                        c.shapes[label] = c.shapes.get(label, 0) + n
                                elif k != "trace":   # per step: kept in the run's record only
                                    setattr(c, k, getattr(c, k) + v)
                            c.relay_bytes_up += r1["bytes_up"] - r0["bytes_up"]
                            c.relay_bytes_down += r1["bytes_down"] - r0["bytes_down"]
                            c.outputs.append(out)
                            meta.setdefault("runs", []).append(
                                {"prompt": named[pi][0], "rtt_ms": rtt, "mbit": mbit, "mode": mode,
                                 **{k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}})
                            print(f"[{time.monotonic() - started:6.0f} s] {named[pi][0]:22s} rtt {rtt:g} ms "
                                  f"{rate_label(mbit)} Mbit/s {mode:8s}: {d['tokens']} tok in {d['seconds']:.2f} s = "
                                  f"{d['tokens'] / max(d['seconds'], 1e-9):.2f} tok/s, tau "
                                  f"{d['tokens'] / max(d['steps'], 1):.2f}, rtt "
                                  f"{d['link_rtt_ms'] / max(d['steps'], 1):.1f} ms, compute "
                                  f"{d['link_compute_ms'] / max(d['steps'], 1):.0f} ms/step",
                                  file=sys.stderr, flush=True)
                        if mbit:
                            meta["tbf"].setdefault(f"{rtt:g}ms/{mbit:g}Mbit", []).append(link.rate_stats())
                    done_prompts += 1
                meta["prompts_done"] = done_prompts
                fo = {m: getattr(s, "failover", None) for m, s in sessions.items()}
                meta["failover"] = {m: f.counters for m, f in fo.items() if f is not None}
                if any(c.get("local_steps") for c in meta["failover"].values()):
                    print("WARNING: some steps were verified locally (failover)", file=sys.stderr)
                meta["relay"] = relay_stats(control)
                meta["planner_final"] = {f"{r:g}ms/{rate_label(m)}Mbit": planners[(r, m)].snapshot()
                                         for (r, m) in conds}
                if "router" in sessions:
                    meta["router_final"] = sessions["router"].stats.extra.get("planner", {}).get("router")
            finally:
                for s in sessions.values():
                    s.close()
    meta["wall_s"] = time.monotonic() - started
    res = {"meta": meta, "cells": [dict(asdict(c), tok_s=c.tok_s, tau=c.tau) for c in cells.values()]}
    add_agreement(res)
    return res


def rate_label(mbit: float) -> str:
    """A condition's rate as the tables show it: "-" where no rate limit was set (--local-link)."""
    return f"{mbit:g}" if mbit else "-"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a shorter one differs where it ends), or None."""
    if a == b:
        return None
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def add_agreement(res: dict) -> None:
    """Losslessness per cell: `agree_tokens` of `ar_tokens` = the AR output's tokens (same prompt, same
    RTT, same verifier) that the mode reproduced before its first difference, and `diverge_at`,
    that position per prompt (None: identical). Greedy speculation is lossless up to floating point,
    so anything below 1.0 is either a near-tie of the target's logits or a bug."""
    by = {(c["rtt_ms"], c["mbit"], c["mode"]): c for c in res["cells"]}
    for (rtt, mbit, _mode), c in by.items():
        ref = by.get((rtt, mbit, "ar"), {}).get("outputs", [])
        c["diverge_at"] = [first_difference(a, b) for a, b in zip(ref, c["outputs"])]
        c["ar_tokens"] = sum(len(a) for a in ref[:len(c["outputs"])])
        c["agree_tokens"] = sum(len(a) if k is None else k for a, k in zip(ref, c["diverge_at"]))


def agreement(res: dict) -> list[str]:
    """Greedy outputs of every mode vs cloud-only AR (same condition and prompt), and of AR at each
    condition vs AR at the first: where they first differ."""
    if any("diverge_at" not in c for c in res["cells"]):
        add_agreement(res)
    by = {(c["rtt_ms"], c["mbit"], c["mode"]): c for c in res["cells"]}
    notes = []
    for (rtt, mbit, mode), c in by.items():
        for i, k in enumerate(c["diverge_at"]):
            if k is not None:
                notes.append(f"rtt {rtt:g} ms, {rate_label(mbit)} Mbit/s, {mode}, prompt {i}: differs from AR at token {k}")
    m = res["meta"]
    ref = by[(m["rtts_ms"][0], m["mbits"][0], "ar")]["outputs"]
    for (rtt, mbit, mode), c in by.items():
        if mode == "ar" and c["outputs"] is not ref:
            for i, (a, b) in enumerate(zip(ref, c["outputs"])):
                k = first_difference(a, b)
                if k is not None:
                    notes.append(f"AR at rtt {rtt:g} ms, {rate_label(mbit)} Mbit/s, prompt {i}: differs from AR at "
                                 f"rtt {m['rtts_ms'][0]:g} ms at token {k} (the verifier is not deterministic)")
    return notes


def summary(res: dict) -> str:
    """One row per condition: cloud-only AR tok/s, every other mode as a ratio to it, and the share of
    AR's tokens each mode reproduced before its first difference (1.00: lossless on these prompts)."""
    if any("agree_tokens" not in c for c in res["cells"]):
        add_agreement(res)
    m = res["meta"]
    by = {(c["rtt_ms"], c["mbit"], c["mode"]): c for c in res["cells"]}
    others = [mode for mode in m.get("modes", MODES) if mode != "ar"]
    rows = ["| RTT ms | Mbit/s | AR tok/s | " + " | ".join(f"{o} tok/s (× AR)" for o in others) + " | "
            + " | ".join(f"{o}: tokens = AR" for o in others) + " |",
            "|---|---|---|" + "---|" * (2 * len(others))]
    for mbit in m["mbits"]:
        for rtt in m["rtts_ms"]:
            base = by[(rtt, mbit, "ar")]
            if not base["steps"]:
                continue
            speed, agree = [], []
            for o in others:
                c = by[(rtt, mbit, o)]
                ratio = c["tok_s"] / base["tok_s"] if base["tok_s"] else float("nan")
                speed.append(f"{c['tok_s']:.2f} ({ratio:.2f}×)")
                first = [k for k in c["diverge_at"] if k is not None]
                agree.append(f"{c['agree_tokens'] / max(c['ar_tokens'], 1):.3f}"
                             + (f" (first diff at token {min(first)})" if first else ""))
            rows.append(f"| {rtt:g} | {rate_label(mbit)} | {base['tok_s']:.2f} | " + " | ".join(speed) + " | "
                        + " | ".join(agree) + " |")
    return "\n".join(rows)


def markdown(res: dict) -> str:
    m = res["meta"]
    by = {(c["rtt_ms"], c["mbit"], c["mode"]): c for c in res["cells"]}
    rows = ["| RTT ms | Mbit/s | mode | tok/s | τ | drafted nodes/step | verify round trip ms (wall) | "
            "of which server compute ms | network ms (wall − compute − queue) | bytes up/down per step (protobuf) | "
            "bytes up/down per step (TCP payload at relay) | speedup vs cloud-only AR | trees used (steps) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mbit in m["mbits"]:
        for rtt in m["rtts_ms"]:
            base = by[(rtt, mbit, "ar")]
            for mode in m.get("modes", MODES):
                c = by[(rtt, mbit, mode)]
                st = max(c["steps"], 1)
                if not c["steps"]:
                    continue
                sp = c["tok_s"] / base["tok_s"] if base["tok_s"] else float("nan")
                rows.append(
                    f"| {rtt:g} | {rate_label(mbit)} | {mode} | {c['tok_s']:.2f} | {c['tau']:.2f} | "
                    f"{c['drafted'] / st:.1f} | "
                    f"{c['link_wall_ms'] / st:.0f} | {c['link_compute_ms'] / st:.0f} | {c['link_rtt_ms'] / st:.1f} | "
                    f"{c['link_step_bytes_up'] / st:.0f} / {c['link_step_bytes_down'] / st:.0f} | "
                    f"{c['relay_bytes_up'] / st:.0f} / {c['relay_bytes_down'] / st:.0f} | {sp:.2f}× | "
                    + ", ".join(f"{k} {v}" for k, v in sorted(c.get("shapes", {}).items(), key=lambda kv: -kv[1]))
                    + " |")
    mm = m["machine"]
    if m.get("link") == "loopback":
        serve = f"edgespec verifier serve --threads 1 {m.get('verifier_args') or ''}".strip()
        where = (f"verifier `{serve}`"
                 + " and relay on 127.0.0.1 of the same host, no rate limit; edge draft threads "
                 f"{m.get('draft_threads', '?')}; warm-up {m.get('warmup_tokens', 0)} tokens per prompt, mode and shape")
    else:
        where = "verifier: 1 llama.cpp thread, same 2-core CPU as the drafter"
    head = (f"Machine: `{mm['arch']}`, {mm['nproc']} cores, {mm['cpu']}; {mm['date_utc']}. Draft {m['draft']}, "
            f"target {m['target']} ({where}). "
            f"Prompts ({m.get('prompts_done', 0)} of {len(m['prompts'])} run): "
            f"{', '.join(m['prompts'][:m.get('prompts_done', 0)])}; greedy, {m['max_tokens']} new tokens each; "
            f"wall {m['wall_s'] / 60:.1f} min; code {m.get('git', '?')}.")
    return head + "\n\n" + summary(res) + "\n\n" + "\n".join(rows)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = res["meta"]
    by = {(c["rtt_ms"], c["mbit"], c["mode"]): c for c in res["cells"]}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"ar": ("k", "o"), "chain4": ("tab:blue", "s"), "adaptive": ("tab:red", "^"), "router": ("tab:green", "D")}
    for mbit in m["mbits"]:
        ls = "-" if mbit == max(m["mbits"]) else "--"
        for mode in m.get("modes", MODES):
            color, marker = styles.get(mode, ("tab:purple", "v"))
            xs = [r for r in m["rtts_ms"] if by[(r, mbit, mode)]["steps"]]
            tok = [by[(r, mbit, mode)]["tok_s"] for r in xs]
            sp = [by[(r, mbit, mode)]["tok_s"] / by[(r, mbit, "ar")]["tok_s"] for r in xs]
            label = f"{mode}, {rate_label(mbit)} Mbit/s"
            ax1.plot(xs, tok, ls, color=color, marker=marker, label=label)
            ax2.plot(xs, sp, ls, color=color, marker=marker, label=label)
    # The physical ceiling of cloud-only AR: one round trip plus one target forward per token.
    for mbit in m["mbits"][:1]:
        xs = [r for r in m["rtts_ms"] if by[(r, mbit, "ar")]["steps"]]
        bound = [1000 / (r + by[(r, mbit, "ar")]["link_compute_ms"] / by[(r, mbit, "ar")]["steps"]) for r in xs]
        ax1.plot(xs, bound, ":", color="grey", label=f"1 / (RTT + measured AR compute), {rate_label(mbit)} Mbit/s runs")
    ax1.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.set_xlabel("RTT added by the relay (ms)")
        ax.grid(alpha=0.3)
        if len(m["rtts_ms"]) > 1:
            if min(m["rtts_ms"]) > 0:
                ax.set_xscale("log")
            else:  # RTT 0 (--local-link) has no place on a log axis
                ax.set_xscale("symlog", linthresh=10)
            ax.set_xticks(m["rtts_ms"])
            ax.set_xticklabels([f"{r:g}" for r in m["rtts_ms"]])
    ax1.set_ylabel("tokens/s")
    ax1.set_title("Throughput")
    ax2.set_ylabel("speedup vs cloud-only AR")
    ax2.set_title("Speedup over one round trip per token")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.legend(fontsize=8)
    fig.suptitle(f"Qwen2.5-Coder 0.5B draft (edge) / 1.5B target (verifier), both on one {m['machine']['nproc']}-core "
                 f"CPU, greedy, {m['max_tokens']} tokens × {m.get('prompts_done', 0)} prompts", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, n_ctx=2048)
    ap.add_argument("--rtts", default="5,20,50,100", help="round-trip times added by the relay, ms")
    ap.add_argument("--mbits", default="10,100", help="tbf rates on both veth ends, Mbit/s")
    ap.add_argument("--humaneval", type=int, default=2, help="HumanEval prompts (the first N)")
    ap.add_argument("--spec", type=int, default=2, help="Spec-Bench prompts (writing, math_reasoning, ...)")
    ap.add_argument("--spec-bench", type=Path, default=REPO / "tools" / "data" / "spec_bench_questions.jsonl")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(ALL_MODES)}")
    ap.add_argument("--multi-turn", type=int, default=0, help="items of bench_pool.py's multi-turn/editing set")
    ap.add_argument("--router-state", type=Path, help="router mode: start from (and save to) this state file")
    ap.add_argument("--budget-min", type=float, default=30.0,
                    help="stop starting new prompts after this many minutes (whole prompts only)")
    ap.add_argument("--quick", action="store_true", help="RTT 20 ms, 100 Mbit/s, 1 prompt, 16 tokens")
    ap.add_argument("--local-link", action="store_true",
                    help="verifier and relay on 127.0.0.1: no network namespaces, no tc rate (--mbits ignored)")
    ap.add_argument("--verifier-args", default="",
                    help='extra options of `edgespec verifier serve`, one string; write it with "=", as in '
                         '--verifier-args="--backend torch --device cuda"')
    ap.add_argument("--draft-threads", type=int, default=None,
                    help="the edge's llama.cpp draft threads (default: EdgeSession's, every core but one up to 8)")
    ap.add_argument("--warmup-tokens", type=int, default=0,
                    help="untimed first: this many tokens per prompt, mode and (adaptive) ladder shape, "
                         "so a GPU verifier captures its CUDA graphs before timing (0: off)")
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "bench" / "link_speedup.png")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    ap.add_argument("--from-json", type=Path, help="re-render table (and plot unless --no-plot) from a saved --json")
    args = ap.parse_args(argv)
    if args.from_json:
        res = read_results(args.from_json)
        if not args.no_plot:
            plot(res, args.plot)
        print(markdown(res))
        return 0
    if "ar" not in args.modes.split(","):   # before an hour of runs, not at the tables after them
        ap.error("--modes must include ar: the tables, the plot and the greedy check compare every mode with cloud-only AR")
    if args.quick:
        args.rtts, args.mbits, args.humaneval, args.spec, args.max_tokens = "20", "100", 1, 0, 16
        if args.plot == REPO / "docs" / "bench" / "link_speedup.png":
            args.no_plot = True
    res = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
    if not args.no_plot:
        plot(res, args.plot)
    print(markdown(res))
    notes = agreement(res)
    print("\nGreedy outputs identical to cloud-only AR in every run." if not notes else
          "\nGreedy output differences from cloud-only AR:\n" + "\n".join("- " + n for n in notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
