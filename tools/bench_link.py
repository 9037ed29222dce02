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
- `chain4`: chain speculation, `TreeShape.chain(4)`;
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
"""
from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "tools"), str(REPO / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import netlab  # noqa: E402  (tests/netlab.py)
from bench_local import add_model_args  # noqa: E402
from bench_wire import load_prompts, machine  # noqa: E402

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


def make_sessions(draft: Path, target: Path, address: str, token: str, n_ctx: int,
                  modes: tuple[str, ...] = MODES, router_state: Path | None = None):
    from edgespec.edge.drafting import TreeShape
    from edgespec.edge.session import EdgeSession

    shapes = {"ar": TreeShape.target_only(), "chain4": TreeShape.chain(4), "adaptive": None, "router": None}
    sessions = {}
    try:
        for mode in modes:
            # fallback=False: a slow step must not be verified by a local copy of the target (that
            # would measure the device, not the link); the step deadline is then the link's 60 s.
            sessions[mode] = EdgeSession(draft, target, verifier=address, token=token, tree=shapes[mode], n_ctx=n_ctx,
                                         fallback=False, router=router_state if mode == "router" else None)
    except BaseException:
        for s in sessions.values():
            s.close()
        raise
    return sessions


def one_run(session, prompt: list[int], max_tokens: int) -> tuple[dict, list[int]]:
    """Generate greedily; returns the deltas of the decoder's and the link's counters."""
    from edgespec.common.sampling import SamplingParams

    stats = session.decoder.stats
    link = session.verifier.link_stats
    keys = stats.COUNTERS
    lkeys = ("wall_ms", "rtt_ms", "compute_ms", "queue_ms", "step_bytes_up", "step_bytes_down")
    before = {k: getattr(stats, k) for k in keys} | {"link_" + k: getattr(link, k) for k in lkeys}
    shapes_before = dict(stats.shapes)
    out: list[int] = []
    for tokens in session.generate_tokens(prompt, max_tokens, SamplingParams(temperature=0.0)):
        out.extend(tokens)
    after = {k: getattr(stats, k) for k in keys} | {"link_" + k: getattr(link, k) for k in lkeys}
    delta = {k: after[k] - before[k] for k in before}
    delta["shapes"] = {k: n - shapes_before.get(k, 0) for k, n in stats.shapes.items() if n > shapes_before.get(k, 0)}
    return delta, out


def run(args: argparse.Namespace) -> dict:
    from edgespec.common import modelstore

    ok, why = netlab.netns_available()
    if not ok:
        raise SystemExit(f"bench_link needs network namespaces: {why}")
    rtts = [float(x) for x in args.rtts.split(",")]
    rates = [float(x) for x in args.mbits.split(",")]
    code = load_prompts(args.spec_bench, args.humaneval, 0)
    prose = load_prompts(args.spec_bench, 0, args.spec)
    named: list = [p for pair in zip(code, prose) for p in pair] + code[len(prose):] + prose[len(code):]  # alternate
    if args.multi_turn:
        from bench_pool import MULTI_TURN
        named += MULTI_TURN[:args.multi_turn]
    modes = tuple(args.modes.split(","))
    draft, target = modelstore.resolve(args.draft), modelstore.resolve(args.target)
    conds = [(r, m) for m in rates for r in rtts]
    cells = {(r, m, mode): Cell(r, m, mode) for (r, m) in conds for mode in modes}
    meta: dict = {"machine": machine(), "command": " ".join(["python", *sys.argv]), "draft": draft.name,
                  "target": target.name, "max_tokens": args.max_tokens, "rtts_ms": rtts, "mbits": rates,
                  "prompts": [n for n, _ in named], "modes": modes, "tbf": {}, "relay": {}}
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "edgespec"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        meta["git"] = head + (" (edgespec/ has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        meta["git"] = "unknown"
    started = time.monotonic()
    with netlab.netns_pair() as pair:
        from edgespec.edge.embedded import EmbeddedVerifier
        vp = EmbeddedVerifier(target, n_ctx=args.n_ctx, max_nodes=128, max_sessions=4, host=pair.ip_b,
                              command_prefix=["ip", "netns", "exec", pair.ns_b], wait_serving=False,
                              extra_args=["--threads", "1"])
        try:
            relay = netlab.run_in(pair.ns_a, [sys.executable, str(REPO / "tools" / "netrelay.py"),
                                              "--listen", f"{pair.ip_a}:0", "--upstream", vp.address,
                                              "--control", "127.0.0.1:0"],
                                  stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
            info = json.loads(read_line(relay, 30))
            host, port = info["control"].rsplit(":", 1)
            control = (host, int(port))
            edge_address = info["listen"]
            print(f"verifier {vp.address} (netns {pair.ns_b}); relay {edge_address} (netns {pair.ns_a})",
                  file=sys.stderr, flush=True)
            import netrelay
            # From here on this thread lives in namespace A: gRPC's threads are created here.
            with netlab.in_netns(pair.ns_a):
                router_state = args.router_state or Path(tempfile.mkdtemp(prefix="bench-link-")) / "router.npz"
                sessions = make_sessions(draft, target, edge_address, vp.token, args.n_ctx, modes, router_state)
                try:
                    # gRPC shares one subchannel (TCP connection) between channels to the same
                    # address, so the three sessions may use one connection: at least one must exist.
                    meta["relay_connections"] = relay_stats(control)["connections"]
                    if meta["relay_connections"] < 1:
                        raise RuntimeError("the sessions did not connect through the relay")
                    tokenized = [sessions["ar"].draft_model.chat_tokens(
                        [{"role": "user", "content": text}] if isinstance(text, str) else text) for _, text in named]
                    meta["prompt_tokens"] = [len(t) for t in tokenized]
                    from edgespec.edge.planner import Planner
                    planners = {c: Planner() for c in conds}
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
                            netlab.set_rate(pair.ns_a, mbit)
                            netlab.set_rate(pair.ns_b, mbit)
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
                                    else:
                                        setattr(c, k, getattr(c, k) + v)
                                c.relay_bytes_up += r1["bytes_up"] - r0["bytes_up"]
                                c.relay_bytes_down += r1["bytes_down"] - r0["bytes_down"]
                                c.outputs.append(out)
                                meta.setdefault("runs", []).append(
                                    {"prompt": named[pi][0], "rtt_ms": rtt, "mbit": mbit, "mode": mode,
                                     **{k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}})
                                print(f"[{time.monotonic() - started:6.0f} s] {named[pi][0]:22s} rtt {rtt:g} ms "
                                      f"{mbit:g} Mbit/s {mode:8s}: {d['tokens']} tok in {d['seconds']:.2f} s = "
                                      f"{d['tokens'] / max(d['seconds'], 1e-9):.2f} tok/s, tau "
                                      f"{d['tokens'] / max(d['steps'], 1):.2f}, rtt "
                                      f"{d['link_rtt_ms'] / max(d['steps'], 1):.1f} ms, compute "
                                      f"{d['link_compute_ms'] / max(d['steps'], 1):.0f} ms/step",
                                      file=sys.stderr, flush=True)
                            meta["tbf"].setdefault(f"{rtt:g}ms/{mbit:g}Mbit", []).append(tbf_stats(pair))
                        done_prompts += 1
                    meta["prompts_done"] = done_prompts
                    fo = {m: getattr(s, "failover", None) for m, s in sessions.items()}
                    meta["failover"] = {m: f.counters for m, f in fo.items() if f is not None}
                    if any(c.get("local_steps") for c in meta["failover"].values()):
                        print("WARNING: some steps were verified locally (failover)", file=sys.stderr)
                    meta["relay"] = relay_stats(control)
                    meta["planner_final"] = {f"{r:g}ms/{m:g}Mbit": planners[(r, m)].snapshot() for (r, m) in conds}
                    if "router" in sessions:
                        meta["router_final"] = sessions["router"].stats.extra.get("planner", {}).get("router")
                finally:
                    for s in sessions.values():
                        s.close()
        finally:
            vp.stop()
    meta["wall_s"] = time.monotonic() - started
    return {"meta": meta, "cells": [dict(asdict(c), tok_s=c.tok_s, tau=c.tau) for c in cells.values()]}


def agreement(res: dict) -> list[str]:
    """Greedy outputs of chain4/adaptive vs cloud-only AR, per condition and prompt."""
    by = {(c["rtt_ms"], c["mbit"], c["mode"]): c for c in res["cells"]}
    notes = []
    for (rtt, mbit, mode), c in by.items():
        if mode == "ar":
            continue
        ref = by[(rtt, mbit, "ar")]["outputs"]
        for i, (a, b) in enumerate(zip(ref, c["outputs"])):
            if a != b:
                k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                notes.append(f"rtt {rtt:g} ms, {mbit:g} Mbit/s, {mode}, prompt {i}: differs from AR at token {k}")
    return notes


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
                    f"| {rtt:g} | {mbit:g} | {mode} | {c['tok_s']:.2f} | {c['tau']:.2f} | {c['drafted'] / st:.1f} | "
                    f"{c['link_wall_ms'] / st:.0f} | {c['link_compute_ms'] / st:.0f} | {c['link_rtt_ms'] / st:.1f} | "
                    f"{c['link_step_bytes_up'] / st:.0f} / {c['link_step_bytes_down'] / st:.0f} | "
                    f"{c['relay_bytes_up'] / st:.0f} / {c['relay_bytes_down'] / st:.0f} | {sp:.2f}× | "
                    + ", ".join(f"{k} {v}" for k, v in sorted(c.get("shapes", {}).items(), key=lambda kv: -kv[1]))
                    + " |")
    mm = m["machine"]
    head = (f"Machine: `{mm['arch']}`, {mm['nproc']} cores, {mm['cpu']}; {mm['date_utc']}. Draft {m['draft']}, "
            f"target {m['target']} (verifier: 1 llama.cpp thread, same 2-core CPU as the drafter). "
            f"Prompts ({m.get('prompts_done', 0)} of {len(m['prompts'])} run): "
            f"{', '.join(m['prompts'][:m.get('prompts_done', 0)])}; greedy, {m['max_tokens']} new tokens each; "
            f"wall {m['wall_s'] / 60:.1f} min; code {m.get('git', '?')}.")
    return head + "\n\n" + "\n".join(rows)


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
            color, marker = styles[mode]
            xs = [r for r in m["rtts_ms"] if by[(r, mbit, mode)]["steps"]]
            tok = [by[(r, mbit, mode)]["tok_s"] for r in xs]
            sp = [by[(r, mbit, mode)]["tok_s"] / by[(r, mbit, "ar")]["tok_s"] for r in xs]
            label = f"{mode}, {mbit:g} Mbit/s"
            ax1.plot(xs, tok, ls, color=color, marker=marker, label=label)
            ax2.plot(xs, sp, ls, color=color, marker=marker, label=label)
    # The physical ceiling of cloud-only AR: one round trip plus one target forward per token.
    for mbit in m["mbits"][:1]:
        xs = [r for r in m["rtts_ms"] if by[(r, mbit, "ar")]["steps"]]
        bound = [1000 / (r + by[(r, mbit, "ar")]["link_compute_ms"] / by[(r, mbit, "ar")]["steps"]) for r in xs]
        ax1.plot(xs, bound, ":", color="grey", label=f"1 / (RTT + measured AR compute), {mbit:g} Mbit/s runs")
    ax1.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.set_xlabel("RTT added by the relay (ms)")
        ax.grid(alpha=0.3)
        if len(m["rtts_ms"]) > 1:
            ax.set_xscale("log")
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
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "bench" / "link_speedup.png")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    ap.add_argument("--from-json", type=Path, help="re-render table (and plot unless --no-plot) from a saved --json")
    args = ap.parse_args(argv)
    if args.from_json:
        res = json.loads(args.from_json.read_text())
        if not args.no_plot:
            plot(res, args.plot)
        print(markdown(res))
        return 0
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
