"""Edge-side fleet routing (edgespec/edge/fleet.py) over real `edgespec verifier serve` processes.

Placement: rendezvous hashing is stable across Fleet objects and least-loaded placement sees the
replicas' open streams (Info). Failover: the replica serving a session is SIGKILLed mid-generation;
the session moves to the other replica (Open + Sync of the decoder's committed context) and
finishes with exactly the target's greedy output, no local fallback involved (fallback=False), and
the time from the kill to the next committed token is measured. Load signals: a replica kept busy by
other clients reports its queue time in every answer; the edge's planner picks smaller trees for it,
the fleet's metrics show it, and a new session goes to the idle replica. Slow is not dead: a replica
behind a link of 400 ms each way answers its Info probes (timeouts adapt to what was measured) and
serves a session, and the same replica stalled is found dead within its adapted timeout. Full
replicas: placement passes over a replica with every stream or KV slot taken, moves on a
RESOURCE_EXHAUSTED answer without calling the replica dead, and when every replica is full raises
FleetFullError; a session on a full fleet starts local and attaches once a replica has room.
"""
from __future__ import annotations

import copy
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgespec import EdgeSession
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.common.wire import VerifierBusyError
from edgespec.edge.failover import Breaker
from edgespec.edge.fleet import (INFO_TIMEOUT_FACTOR, Fleet, FleetFullError, FleetLink, hrw_score, is_fleet_spec,
                                 parse_fleet)
from edgespec.edge.link import CONNECT_TIMEOUT_S, Deadline, Link
from failover_helpers import (MAX_TOKENS, N_CTX, PROBE_S, PROMPT, SHAPE, Recorder, check_output, check_run, fo_stats,
                              pull)
from grpc_helpers import ServerProcess
from lossless import target_only_greedy
from netlab import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import netrelay  # noqa: E402


@pytest.fixture(scope="module")
def replicas(smol_path):
    servers = [ServerProcess(smol_path, "--n-ctx", str(N_CTX), "--threads", "1") for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def reference(smol_model):
    prompt = smol_model.chat_tokens([{"role": "user", "content": PROMPT}])
    return target_only_greedy(smol_model, prompt, MAX_TOKENS)


def test_fleet_specs():
    assert is_fleet_spec("a:1,b:2") and is_fleet_spec("fleet:verifier.ns.svc:50051")
    assert not is_fleet_spec("a:1") and not is_fleet_spec("dns:///a:1") and not is_fleet_spec(None)
    assert parse_fleet("a:1, b:2,a:1") == (["a:1", "b:2"], None)
    assert parse_fleet("fleet:localhost:50051") == ([], "localhost:50051")
    fleet = Fleet("fleet:localhost:50051")  # DNS: every record of the name is a replica
    assert {r.address for r in fleet.replicas} <= {"127.0.0.1:50051", "[::1]:50051"} and fleet.replicas


def test_sticky_and_least_loaded(replicas, smol_model):
    spec = ",".join(s.address for s in replicas)
    a, b = Fleet(spec), Fleet(spec)
    # the same session id ranks the replicas the same way in any edge process (no shared state)
    for key in ("robot-1", "robot-2", "robot-3"):
        assert [r.address for r in a.ranking(key)] == [r.address for r in b.ranking(key)]
        assert a.ranking(key)[0].address == max((s.address for s in replicas), key=lambda x: hrw_score(key, x))
    fp = smol_model.tokenizer_fingerprint()
    links = []
    try:
        first = FleetLink(a, "robot-1", tokenizer_hash=fp)
        first.attach(None, Deadline(30, "open"))
        links.append(first)
        assert replicas[[s.address for s in replicas].index(first.address)].info().open_streams == 1
        # a new session goes to the least-loaded replica, whatever its hash says: the other one
        second = FleetLink(Fleet(spec, info_max_age_s=0), "robot-1", tokenizer_hash=fp)
        second.attach(None, Deadline(30, "open"))
        links.append(second)
        assert second.address != first.address
        m = a.metrics()
        assert m["totals"]["up"] == 2 and m["totals"]["open_streams"] == 2, m
        assert sorted(r["open_streams"] for r in m["replicas"]) == [1, 1]
    finally:
        for link in links:
            link.close()


def test_replica_sigkill_moves_the_session_losslessly(smol_path, smol_model, reference):
    # own replicas: this test kills one
    servers = [ServerProcess(smol_path, "--n-ctx", str(N_CTX), "--threads", "1") for _ in range(2)]
    session = EdgeSession(smol_path, smol_path, verifier=",".join(s.address for s in servers), n_ctx=N_CTX,
                          tree=SHAPE, fallback=False, deadline_s=60.0, session_id="robot-42")
    rec = Recorder(session)
    try:
        link = session.failover.link
        home = link.address
        assert home == Fleet(",".join(s.address for s in servers)).ranking("robot-42")[0].address
        chunks: list[str] = []
        stream = session.chat(PROMPT, stream=True, max_tokens=MAX_TOKENS)
        pull(stream, chunks, lambda: len(rec.tokens) >= 30)
        victim = next(s for s in servers if s.address == home)
        steps = len(rec.steps)
        victim.proc.kill()  # SIGKILL: no goodbye on the stream
        killed = time.monotonic()
        victim.proc.wait(10)
        pull(stream, chunks, lambda: len(rec.steps) > steps + 1)
        # the first step committed after the kill (a step may have been in flight, already answered)
        after = next(t for t in rec.times[steps:] if t > killed)
        gap = after - killed
        chunks += list(stream)
        moved = [m for m in link.moves if m.old]
        assert len(moved) == 1 and moved[0].old == home and moved[0].new != home, link.moves
        assert link.address != home and link.fleet.replica(home).failures >= 1
        fo = fo_stats(session)
        assert fo["local_steps"] == 0 and fo["mode"] == "remote" and fo["failures"] == 0, fo  # no fallback used
        assert fo["fleet"]["replica"] == link.address and fo["fleet"]["moves"] == 1, fo["fleet"]  # in the stats
        assert session.stats.link.syncs >= 2  # the committed context was resynced to the new replica
        check_run(smol_model, session, rec, chunks, reference, "fleet sigkill")
        print(f"replica SIGKILL -> next committed token: {gap * 1000:.0f} ms "
              f"(moved {moved[0].old} -> {moved[0].new}; {len(rec.tokens)} tokens)")
        assert gap < 30.0
    finally:
        session.close()
        for s in servers:
            s.stop()


def test_directory_url_lists_replicas_and_is_reread(replicas):
    """A fleet published as an HTTP replica directory (what edgespec/verifier/fleet_ray.py serves):
    read at start, and read again when every known replica has failed (a replaced replica has a new
    address)."""
    import http.server
    import json

    listed = {"replicas": [replicas[0].address]}

    class Directory(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps(listed).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Directory)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/replicas"
        assert is_fleet_spec(url)
        fleet = Fleet(url)
        assert [r.address for r in fleet.replicas] == [replicas[0].address]
        assert fleet.place("robot-7").address == replicas[0].address
        listed["replicas"] = [replicas[1].address]      # the directory now lists a replacement
        fleet.failed(fleet.replica(replicas[0].address), RuntimeError("gone"))
        assert fleet.place("robot-7").address == replicas[1].address
    finally:
        httpd.shutdown()


def test_a_loaded_replica_shrinks_the_planners_trees_and_shows_in_the_fleet_metrics(smol_path, smol_model):
    """Load signals end to end: other clients keep the session's replica busy; its queue time comes
    back in every Verified, the edge's real planner (no fixed tree) sees it, rates every bigger tree
    lower than the same planner without the queue and never picks a bigger one, the fleet's metrics show the load, and a new
    session is placed on the idle replica."""
    servers = [ServerProcess(smol_path, "--n-ctx", str(N_CTX), "--threads", "1") for _ in range(2)]
    relays = [netrelay.RelayThread(("127.0.0.1", s.port), ("127.0.0.1", 0), delay_up_ms=20, delay_down_ms=20)
              for s in servers]
    stop = threading.Event()
    loaders: list[threading.Thread] = []
    session = None
    try:
        nets = [r.start() for r in relays]
        addrs = [f"127.0.0.1:{net.address[1]}" for net in nets]
        spec = ",".join(addrs)
        session = EdgeSession(smol_path, smol_path, verifier=spec, n_ctx=N_CTX, fallback=False,
                              session_id="robot-load", draft_threads=1)
        planner, link = session.decoder.planner, session.failover.link
        assert planner is not None  # no fixed tree: the planner sizes every tree
        home = addrs.index(link.address)
        sent: list[tuple[int, float]] = []  # (drafted nodes sent, queue_s) per step
        observe = planner.observe

        def spy(obs):
            sent.append((obs.nodes, obs.queue_s))
            observe(obs)

        planner.observe = spy
        # A long round trip (set once connected) makes drafted nodes worth their cost on an idle replica.
        nets[home].set_delay(600, 600)
        session.chat("Explain, step by step and in detail, how a computer boots.", max_tokens=40)
        idle, at_idle = list(sent), copy.deepcopy(planner)

        def load(seed: int) -> None:  # another client on the same replica: 32-node trees, back to back
            other = Link(servers[home].address, tokenizer_hash=smol_model.tokenizer_fingerprint(), timeout_s=120)
            rng, context, step = np.random.default_rng(seed), [1, 2, 3], 0
            try:
                while not stop.is_set():
                    tree = TokenTree.chain(context[-1], rng.integers(100, 40000, 32).tolist())
                    context = context + list(other.verify(context, tree, SamplingParams(), step).tokens)
                    step += 1
            finally:
                other.close()

        loaders = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(2)]
        for t in loaders:
            t.start()
        session.chat("Write a detailed essay about the history of the printing press.", max_tokens=28)
        busy = sent[len(idle):]
        nets[home].set_delay(20, 20)

        # the replica reported its queue in every answer, and the planner took it in
        # (relative bounds: how long the two loaders keep the queue depends on the machine's speed; in
        # CI, alone on 2 cores, 0.23-0.64 s per step, under heavy load more)
        idle_q, busy_q = np.mean([q for _, q in idle]), np.mean([q for _, q in busy[-4:]])
        assert idle_q < 0.1 and busy_q > max(0.05, 10 * idle_q), (idle, busy)
        snap = planner.snapshot()
        # the planner's queue is a running average (0.2 weight a step) that started at the idle queue, so after a
        # few busy steps it lags their mean: bounded relative to the idle queue too (CI, 2026-12-02: 46 ms
        # after a 28-token answer, where the last steps queued more than 50 ms)
        lagged_floor_ms = max(25, 5 * 1000 * idle_q)   # what a running average of the busy queue at least reaches
        assert snap["verifier_queue_ms"] > lagged_floor_ms and snap["load_factor"] > 1.05, snap
        # Smaller trees because of the queue: the planner as it was on the idle replica, given the queue
        # it measured on the busy one (nothing else changed), rates every bigger tree lower against
        # the smallest drafted one (chain2) and never chooses a bigger tree; a strictly smaller one
        # whenever it drafted more than chain2 on the idle replica (on this CPU it often settles on
        # chain2 even then: drafting one depth costs 130-400 ms here).
        queued = copy.deepcopy(at_idle)
        queued.queue_s = planner.queue_s
        for p in (at_idle, queued, planner):
            p.explore_every = 10 ** 9
        free, loaded, now = at_idle.choose(), queued.choose(), planner.choose()

        def rates(p) -> np.ndarray:
            return np.array([p.expected_tokens(i) / p.step_seconds(sh.budget, sh.max_depth if sh.budget else 0)
                             for i, sh in enumerate(p.ladder)])

        ratio_free, ratio_loaded = rates(at_idle)[2:] / rates(at_idle)[1], rates(queued)[2:] / rates(queued)[1]
        print(f"idle nodes {[n for n, _ in idle]}; busy nodes {[n for n, _ in busy]} (queue "
              f"{[round(1000 * q) for _, q in busy]} ms); load factor {snap['load_factor']:.2f}; the idle planner "
              f"chooses {free.label}, {loaded.label} with the measured queue; the busy planner chooses {now.label}; "
              f"rate of chain4..tree64 / chain2: {ratio_free.round(2)} idle, {ratio_loaded.round(2)} with the queue")
        print({k: v for k, v in snap.items() if "acceptance" not in k})
        assert (ratio_loaded < ratio_free).all(), (ratio_free, ratio_loaded)
        assert loaded.budget <= free.budget, (free, loaded)
        # Whether the choice itself drops a rung depends on the queue against the round trip and the
        # draft's cost: with a 1.2 s round trip and a 0.2-0.4 s queue (CI, alone on 2 cores) tree64
        # still wins with its rate cut (1.75 -> 1.47 × chain2's); under heavy load it went tree32 -> chain2.

        # the fleet's aggregate metrics show the load, and a new session goes to the idle replica
        m = link.fleet.metrics()
        rows = {r["address"]: r for r in m["replicas"]}
        # the fleet's queue is a running average too (the planner's lag, above): the same bound (a clean-clone
        # run, 2026-12-05: 34 ms once, under load, against the 50 ms this asserted before)
        assert rows[addrs[home]]["open_streams"] == 3, m
        assert rows[addrs[home]]["edge_queue_ms"] > lagged_floor_ms, (m, idle_q)
        assert m["totals"]["max_edge_queue_ms"] == rows[addrs[home]]["edge_queue_ms"] and m["totals"]["edge_steps"] \
            == len(sent), m["totals"]
        # a new session whose hash prefers the busy replica is placed on the idle one
        key = next(k for k in (f"robot-{n}" for n in range(1000))
                   if max(addrs, key=lambda a: hrw_score(k, a)) == addrs[home])
        assert link.fleet.place(key).address == addrs[1 - home]
        print(f"fleet totals: {m['totals']}")
    finally:
        stop.set()
        for t in loaders:
            t.join(30)
        if session is not None:
            session.close()
        for r in relays:
            r.stop()
        for s in servers:
            s.stop()


def key_ranking(addrs: list[str], first: str, second: str | None = None) -> str:
    """A session id whose rendezvous ranking starts with `first` (then `second`)."""
    def ranks(k: str) -> list[str]:
        return sorted(addrs, key=lambda a: hrw_score(k, a), reverse=True)
    return next(k for k in (f"robot-{n}" for n in range(10_000))
                if ranks(k)[0] == first and (second is None or ranks(k)[1] == second))


def test_a_slow_replica_is_slow_not_dead(replicas, smol_model):
    """400 ms each way (tests/test_failover.py's slow link) in front of one replica: its Info probe
    (a fresh channel: 1.2 s through the relay) once hit a fixed 1 s timeout, so the replica was
    marked dead. Now the probe's timeout follows what was measured: the slow replica is placed on
    and serves a session; the fast one keeps the 1 s floor; and the slow one, stalled, is found
    dead after its adapted timeout (7 s here: 3 x 3 round trips; at most the 10 s cap)."""
    fp = smol_model.tokenizer_fingerprint()
    with netrelay.RelayThread(("127.0.0.1", replicas[0].port), delay_up_ms=400, delay_down_ms=400) as relay:
        slow, fast = f"127.0.0.1:{relay.address[1]}", replicas[1].address
        fleet = Fleet(f"{slow},{fast}", choices=1, info_max_age_s=0)  # sticky only; every placement probes
        s, f = fleet.replica(slow), fleet.replica(fast)
        assert fleet.info_timeout(s) == CONNECT_TIMEOUT_S  # nothing measured yet: the link's connect timeout
        key = key_ranking([slow, fast], slow)
        assert fleet.place(key) is s
        assert s.alive() and s.failures == 0 and s.info_probes == 1, s
        assert s.info_s >= 0.8, s  # at least the round trip
        assert fleet.info_timeout(s) == pytest.approx(min(CONNECT_TIMEOUT_S, max(1.0, INFO_TIMEOUT_FACTOR * s.info_s)))
        assert fleet.place(key) is s and s.alive() and s.info_probes == 2  # and again: slow, not dead
        assert fleet.place(key_ranking([slow, fast], fast)) is f
        # a fast replica keeps its short timeout (the 1 s floor, unless the machine is very busy)
        assert f.info_s < s.info_s / 2
        assert fleet.info_timeout(f) == pytest.approx(max(1.0, INFO_TIMEOUT_FACTOR * f.info_s))

        link = FleetLink(fleet, key, tokenizer_hash=fp, timeout_s=30)
        try:  # a session there: no move, its round trips measured
            context = [1, 2, 3]
            link.sync(context)
            result = link.verify(context, TokenTree.chain(3, [4, 5]), SamplingParams(), 0)
            assert len(result.tokens) >= 1 and link.address == slow and len(link.moves) == 1, link.moves
            assert s.rtt_ms >= 700 and s.alive(), s
        finally:
            link.close()
        timeout = fleet.info_timeout(s)  # now from the session's round trips too (3 per fresh channel)
        print(f"slow replica: Info {s.info_s:.2f} s, rtt {s.rtt_ms:.0f} ms -> probe timeout {timeout:.1f} s")
        assert 2.0 < timeout <= CONNECT_TIMEOUT_S

        relay.stall(60)  # the slow replica stops answering: dead after its timeout, the session goes elsewhere
        started = time.monotonic()
        assert fleet.place(key) is f
        took = time.monotonic() - started
        relay.resume()
        assert not s.alive() and "DEADLINE_EXCEEDED" in s.last_error and s.failures == 1, s
        assert timeout - 0.1 <= took < timeout + 2.0, (took, timeout)
        assert s.info_backoff_s == pytest.approx(min(CONNECT_TIMEOUT_S, 2 * timeout))  # the next probe waits longer


def test_placement_skips_full_replicas(smol_path, smol_model):
    """Replicas with 2 streams and 1 KV slot each; other clients fill them step by step. Sticky-only
    placement (choices=1, so load cannot hide it) goes past a replica whose KV slots are all taken
    while another has room, uses such a replica when all are (the replica evicts, as designed), never
    one whose streams are all taken, moves on a RESOURCE_EXHAUSTED answer without calling the
    replica dead, and raises FleetFullError when no replica has room."""
    servers = [ServerProcess(smol_path, "--n-ctx", "512", "--threads", "1", "--max-streams", "2",
                             "--max-sessions", "1") for _ in range(2)]
    fp = smol_model.tokenizer_fingerprint()
    holders: list[Link] = []
    moving = None

    def hold(address: str, sync: bool) -> Link:  # another client's stream (synced: it holds a KV slot)
        link = Link(address, tokenizer_hash=fp, timeout_s=30)
        holders.append(link)
        link.sync([1, 2, 3]) if sync else link.attach(None, Deadline(30, "open"))
        return link

    try:
        x, y = (s.address for s in servers)
        key = key_ranking([x, y], x)
        fleet = Fleet(f"{x},{y}", choices=1, info_max_age_s=0)
        stale = Fleet(f"{x},{y}", choices=1, info_max_age_s=600)  # keeps the Info of its first placement
        X, Y = fleet.replica(x), fleet.replica(y)
        assert fleet.place(key) is X and stale.place(key).address == x  # both empty: its home

        hold(x, sync=True)  # X: every KV slot taken (1/1), a stream free
        assert fleet.place(key) is Y, fleet.describe()
        hold(y, sync=True)  # Y too: nobody has a free slot, X evicts (its load is no higher)
        assert fleet.place(key) is X, fleet.describe()
        hold(x, sync=False)  # X: every stream taken (2/2)
        assert fleet.place(key) is Y, fleet.describe()
        assert X.alive() and X.failures == 0 and X.full() == "full: 2/2 open streams"

        # an edge whose Info is old places on X; X answers RESOURCE_EXHAUSTED: full, not dead; moved to Y
        moving = FleetLink(stale, key, tokenizer_hash=fp, timeout_s=30)
        moving.attach(None, Deadline(30, "open"))
        assert [(m.old, m.new) for m in moving.moves] == [("", x), (x, y)], moving.moves
        assert "VerifierBusyError" in moving.moves[1].reason and "open sessions" in moving.moves[1].reason
        sx = stale.replica(x)
        assert sx.alive() and sx.failures == 0 and sx.full().startswith("answered VerifierBusyError"), sx

        # every stream of both taken (Y: the holder and the moved session): no room anywhere
        with pytest.raises(FleetFullError, match="no replica of the fleet") as info:
            fleet.place(key)
        assert f"{x}: full: 2/2 open streams" in str(info.value) and f"{y}: full: 2/2" in str(info.value)
        assert isinstance(info.value, VerifierBusyError)
        late = FleetLink(fleet, key, tokenizer_hash=fp, timeout_s=30)  # a session asks anyway: a real refusal
        try:
            with pytest.raises(FleetFullError, match="no replica of the fleet"):
                late.attach(None, Deadline(30, "open"))
        finally:
            late.close()
        assert X.alive() and Y.alive() and X.failures == Y.failures == 0  # full, never dead

        moving.close()  # Y has a stream free again; X is still full
        assert wait_for(lambda: servers[1].info().open_streams == 1, 10)
        assert fleet.place(key) is Y, fleet.describe()
    finally:
        for link in holders + ([moving] if moving else []):
            link.close()
        for s in servers:
            s.stop()


def test_a_full_fleet_starts_local_and_attaches_when_a_replica_has_room(smol_path, smol_model, reference):
    """Every replica's only stream is taken by another client. Without a fallback the session
    cannot start and says why (FleetFullError naming each replica, not a configuration error); with
    one it starts on the local target, and once a replica has room the probe attaches there and the
    steps go remote again, the output the target's own, nothing lost."""
    servers = [ServerProcess(smol_path, "--n-ctx", str(N_CTX), "--threads", "1", "--max-streams", "1")
               for _ in range(2)]
    fp = smol_model.tokenizer_fingerprint()
    holders = [Link(s.address, tokenizer_hash=fp, timeout_s=30) for s in servers]
    session = None
    try:
        for h in holders:
            h.attach(None, Deadline(30, "open"))
        addrs = [s.address for s in servers]
        spec, key = ",".join(addrs), key_ranking(addrs, addrs[0])
        with pytest.raises(FleetFullError, match="no replica of the fleet") as info:
            EdgeSession(smol_path, smol_path, verifier=spec, n_ctx=N_CTX, tree=SHAPE, fallback=False, session_id=key)
        assert all(a in str(info.value) for a in addrs) and "retry later" in str(info.value), info.value
        print(f"fallback=False: {info.value}")

        events: list = []
        session = EdgeSession(smol_path, smol_path, verifier=spec, n_ctx=N_CTX, tree=SHAPE, session_id=key,
                              probe_interval_s=PROBE_S, deadline_s=10.0, on_switch=events.append)
        fo = fo_stats(session)
        assert fo["mode"] == "local" and fo["breaker"] == "open", fo
        assert [(e.from_mode, e.to_mode) for e in events] == [("remote", "local")] and "no room" in events[0].reason
        rec = Recorder(session)
        chunks: list[str] = []
        stream = session.chat(PROMPT, stream=True, max_tokens=40)
        pull(stream, chunks, lambda: len(rec.tokens) >= 8)
        assert fo_stats(session)["remote_steps"] == 0 and fo_stats(session)["local_steps"] >= 1

        holders[1].close()  # the second replica of its ranking has room now (the first is still full)
        assert wait_for(lambda: session.failover.state is not Breaker.OPEN, 30), fo_stats(session)
        chunks += list(stream)
        fo = fo_stats(session)
        assert [(e.from_mode, e.to_mode) for e in events] == [("remote", "local"), ("local", "remote")], events
        assert fo["remote_steps"] > 0 and fo["fleet"]["replica"] == addrs[1], fo
        assert fo["remote_steps"] + fo["local_steps"] == len(rec.steps)
        prompt = session.draft_model.chat_tokens([{"role": "user", "content": PROMPT}])
        check_output(smol_model, prompt, rec.tokens, chunks, session.decoder.committed, reference, "full fleet", 40,
                     SHAPE.max_depth)
    finally:
        if session is not None:
            session.close()
        for h in holders:
            h.close()
        for s in servers:
            s.stop()
