"""Edge-side fleet routing (edgespec/edge/fleet.py) over real `edgespec verifier serve` processes.

Placement: rendezvous hashing is stable across Fleet objects and least-loaded placement sees the
replicas' open streams (Info). Failover: the replica serving a session is SIGKILLed mid-generation;
the session moves to the other replica (Open + Sync of the decoder's committed context) and
finishes with exactly the target's greedy output, no local fallback involved (fallback=False), and
the time from the kill to the next committed token is measured.
"""
from __future__ import annotations

import time

import pytest

from edgespec import EdgeSession
from edgespec.edge.fleet import Fleet, FleetLink, hrw_score, is_fleet_spec, parse_fleet
from edgespec.edge.link import Deadline
from failover_helpers import MAX_TOKENS, N_CTX, PROMPT, SHAPE, Recorder, check_run, fo_stats, pull
from grpc_helpers import ServerProcess
from lossless import target_only_greedy


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
    import threading

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
