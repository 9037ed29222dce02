"""A verifier fleet managed by Ray Serve (edgespec/verifier/fleet_ray.py), end to end, for real.

Needs a running fleet (Ray is a 500 MB environment of its own, so CI does not install it). The file
is not named test_*.py, so the suite never collects it (and never skips it); run it by name:

    python3 -m venv /work/ray-venv && /work/ray-venv/bin/pip install "ray[serve]==2.60.0"
    PYTHONPATH=$PWD /work/ray-venv/bin/python -m edgespec.verifier.fleet_ray --model $(edgespec models path test) \\
        --replicas 2 --http-port 18000 --verifier-python $PWD/.venv/bin/python --num-cpus 2 -- --n-ctx 2048
    EDGESPEC_RAY_FLEET=http://127.0.0.1:18000/replicas .venv/bin/python -m pytest -s tests/ray_fleet_check.py

(the failover test also needs EDGESPEC_TEST_LOGITS_DIR=DIR and PYTHONPATH=tests/logit_site:$PWD in the
environment of both commands, so the lossless check finds the replicas' recorded logits at near-ties),
and for autoscaling on queue time, a fleet started with `--replicas 1 --max-replicas 2
--target-queue-ms 200 --http-port 18001` and EDGESPEC_RAY_FLEET_AUTOSCALE=http://127.0.0.1:18001/replicas.

A session routed over the directory Ray Serve publishes; the verifier process of its replica is
SIGKILLed mid-generation; the session moves to the other replica and ends with exactly the target's
greedy output (no local fallback), and Ray Serve's health check replaces the dead replica, whose
successor appears in the directory.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request

import pytest

from edgespec import EdgeSession
from failover_helpers import MAX_TOKENS, N_CTX, PROMPT, SHAPE, Recorder, check_run, fo_stats, pull
from lossless import target_only_greedy
from netlab import wait_for

URL = os.environ.get("EDGESPEC_RAY_FLEET")


def listed() -> list[str]:
    with urllib.request.urlopen(URL, timeout=10) as reply:
        return json.load(reply)["replicas"]


def pid_listening(address: str) -> int:
    port = address.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"pid=(\d+)", out).group(1))


@pytest.mark.skipif(not URL, reason="needs a Ray Serve fleet: set EDGESPEC_RAY_FLEET (see the docstring)")
def test_ray_serve_fleet_sigkill(smol_path, smol_model):
    before = listed()
    assert len(before) >= 2, before
    prompt = smol_model.chat_tokens([{"role": "user", "content": PROMPT}])
    reference = target_only_greedy(smol_model, prompt, MAX_TOKENS)
    session = EdgeSession(smol_path, smol_path, verifier=URL, n_ctx=N_CTX, tree=SHAPE, fallback=False,
                          deadline_s=60.0, session_id="ray-robot-1")
    rec = Recorder(session)
    try:
        link = session.failover.link
        home = link.address
        assert home in before
        chunks: list[str] = []
        stream = session.chat(PROMPT, stream=True, max_tokens=MAX_TOKENS)
        pull(stream, chunks, lambda: len(rec.tokens) >= 30)
        steps = len(rec.steps)
        os.kill(pid_listening(home), signal.SIGKILL)
        killed = time.monotonic()
        pull(stream, chunks, lambda: len(rec.steps) > steps + 1)
        gap = next(t for t in rec.times[steps:] if t > killed) - killed
        chunks += list(stream)
        assert link.address != home and [m.old for m in link.moves if m.old] == [home]
        fo = fo_stats(session)
        assert fo["local_steps"] == 0 and fo["failures"] == 0, fo
        check_run(smol_model, session, rec, chunks, reference, "ray fleet sigkill")
        # Ray Serve's health check notices the dead process and replaces the replica
        assert wait_for(lambda: home not in listed() and len(listed()) == len(before), 120, interval_s=1.0), listed()
        replaced = time.monotonic() - killed
        print(f"Ray Serve fleet: SIGKILL -> next committed token {gap * 1000:.0f} ms; replica replaced and "
              f"listed after {replaced:.1f} s: {before} -> {listed()}")
    finally:
        session.close()


AUTOSCALE_URL = os.environ.get("EDGESPEC_RAY_FLEET_AUTOSCALE")


@pytest.mark.skipif(not AUTOSCALE_URL, reason="needs an autoscaling Ray Serve fleet started with --replicas 1 "
                    "--max-replicas 2: set EDGESPEC_RAY_FLEET_AUTOSCALE")
def test_ray_serve_scales_out_on_queue_time(smol_path):
    """Three sessions on one replica queue behind each other; the replicas report that queue time
    (record_autoscaling_stats), queue_time_policy asks for a second replica, Ray starts it and the
    directory lists it."""
    import threading

    def replicas() -> list[str]:
        with urllib.request.urlopen(AUTOSCALE_URL, timeout=10) as reply:
            return json.load(reply)["replicas"]

    assert len(replicas()) == 1
    sessions = [EdgeSession(smol_path, smol_path, verifier=AUTOSCALE_URL, n_ctx=1024, tree=SHAPE, fallback=False,
                            deadline_s=120.0, session_id=f"load-{i}") for i in range(3)]
    stop = threading.Event()

    def load(s: EdgeSession) -> None:
        while not stop.is_set():
            s.chat(PROMPT, max_tokens=24)

    threads = [threading.Thread(target=load, args=(s,), daemon=True) for s in sessions]
    started = time.monotonic()
    try:
        for t in threads:
            t.start()
        assert wait_for(lambda: len(replicas()) == 2, 300, interval_s=2.0), replicas()
        took = time.monotonic() - started
        queue_ms = [s.stats.link.mean_queue_ms for s in sessions]
        assert max(queue_ms) > 200, queue_ms  # the load really queued past the target
        print(f"Ray Serve autoscaling: 1 -> 2 replicas {took:.0f} s after 3 sessions started "
              f"(mean queue per session {[round(q) for q in queue_ms]} ms): {replicas()}")
    finally:
        stop.set()
        for t in threads:
            t.join(300)
        for s in sessions:
            s.close()
