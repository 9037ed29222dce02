"""Fallback that loses nothing (edgespec/edge/failover.py), with real parts only.

A real `python -m edgespec verifier serve` process (SmolLM2 as draft and target), real gRPC on
loopback, tools/netrelay.py for a stalled link. The verifier is SIGKILLed mid-generation, restarted
on the same port, its link stalled past the deadline; the session must finish every generation
with exactly the target's greedy output (near-ties excepted, tests/lossless.py), report every
switch, and re-attach once the verifier is back.
"""
from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from edgespec import EdgeSession
from edgespec.common.errors import InvalidTreeError, VerifierConfigError, VerifierUnavailableError
from edgespec.common.tree import TokenTree
from edgespec.edge.failover import Breaker, FailoverVerifier, LocalFallback
from edgespec.runtime.llama import ContextConfig
from grpc_helpers import ServerProcess
from failover_helpers import (MAX_TOKENS, N_CTX, PROBE_S, PROMPT, SHAPE, Recorder, assert_targets_choices,
                              check_output, check_run, fo_stats, pull)
from lossless import GREEDY, assert_lossless, target_only_greedy
from netlab import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import netrelay  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prompt_tokens(smol_model):
    return smol_model.chat_tokens([{"role": "user", "content": PROMPT}])


@pytest.fixture(scope="module")
def reference(smol_model, prompt_tokens):
    """Local-only, uninterrupted: plain greedy decoding with the target."""
    return target_only_greedy(smol_model, prompt_tokens, MAX_TOKENS)


@pytest.fixture(scope="module")
def server(smol_path):
    srv = ServerProcess(smol_path, "--n-ctx", str(N_CTX))
    yield srv
    srv.stop()


def session_for(smol_path, address: str, events: list, **kw) -> EdgeSession:
    kw.setdefault("probe_interval_s", PROBE_S)
    return EdgeSession(smol_path, smol_path, verifier=address, n_ctx=N_CTX, tree=SHAPE, on_switch=events.append, **kw)


# -- the tests ----------------------------------------------------------------------------------
def test_sigkill_goes_local_and_restart_reattaches(smol_path, smol_model, reference):
    srv = ServerProcess(smol_path, "--n-ctx", str(N_CTX))
    port, events = srv.port, []
    session = session_for(smol_path, srv.address, events, deadline_s=5.0)
    rec = Recorder(session)
    try:
        chunks: list[str] = []
        stream = session.chat(PROMPT, stream=True, max_tokens=MAX_TOKENS)
        pull(stream, chunks, lambda: len(rec.tokens) >= 30)
        fo = fo_stats(session)
        assert fo["mode"] == "remote" and fo["breaker"] == "closed" and fo["local_steps"] == 0
        assert fo["remote_steps"] == len(rec.steps) and not fo["local_loaded"]

        srv.proc.kill()  # SIGKILL: no goodbye on the stream
        srv.proc.wait(10)
        killed_at = time.time()  # wall clock, like the breaker's history
        pull(stream, chunks, lambda: events)
        # The failure is noticed at once (broken stream, nobody to reconnect to), not after the 5 s
        # deadline. Timed to the breaker opening: the switch event only comes after the local target
        # was loaded and prefilled, which a busy machine makes take seconds.
        opened = fo_stats(session)["breaker_history"][0]
        assert opened["to_state"] == "open" and opened["time"] - killed_at < 5.0, (opened, killed_at)
        assert (events[0].from_mode, events[0].to_mode) == ("remote", "local")
        assert "VerifierUnavailableError" in events[0].reason and events[0].breaker == "open"
        remote_steps = fo_stats(session)["remote_steps"]
        steps = len(rec.steps)
        pull(stream, chunks, lambda: len(rec.steps) >= steps + 3)  # a few steps while nothing listens
        fo = fo_stats(session)
        assert fo["remote_steps"] == remote_steps and fo["local_steps"] >= 4 and fo["breaker"] == "open"
        assert fo["local_loaded"] and fo["switches"] == 1

        srv = ServerProcess(smol_path, "--n-ctx", str(N_CTX), "--port", str(port))  # same port
        assert wait_for(lambda: session.failover.state is Breaker.HALF_OPEN, 30), fo_stats(session)
        assert fo_stats(session)["breaker"] == "half-open"
        chunks += list(stream)
        fo = fo_stats(session)
        assert [(e.from_mode, e.to_mode) for e in events] == [("remote", "local"), ("local", "remote")]
        assert events[1].breaker == "closed" and "re-attached" in events[1].reason
        assert fo["mode"] == "remote" and fo["breaker"] == "closed" and fo["reattaches"] == 1
        assert fo["remote_steps"] > remote_steps + 3, fo  # remote steps resumed
        assert fo["remote_steps"] + fo["local_steps"] == len(rec.steps) == session.stats.steps
        assert [h["to_state"] for h in fo["breaker_history"]] == ["open", "half-open", "closed"]
        assert session.stats.link.reconnects >= 1
        check_run(smol_model, session, rec, chunks, reference, "sigkill+restart")
    finally:
        session.close()
        srv.stop()


def test_a_link_of_400_ms_each_way_connects_and_verifies(server, smol_path, smol_model, prompt_tokens, reference):
    """A slow link (800 ms round trip) is still a link: the first contact and every step go through
    it. gRPC's connect timeout was once the 250 ms reconnect backoff (link.CHANNEL_OPTIONS), and
    such a link never connected."""
    with netrelay.RelayThread(("127.0.0.1", server.port), delay_up_ms=400, delay_down_ms=400) as relay:
        session = session_for(smol_path, f"127.0.0.1:{relay.address[1]}", [], deadline_s=20.0, fallback=False)
        rec = Recorder(session)
        try:
            chunks = list(session.chat(PROMPT, stream=True, max_tokens=6))
            fo = fo_stats(session)
            assert fo["mode"] == "remote" and fo["local_steps"] == 0 and fo["remote_steps"] >= 1, fo
            assert session.stats.link.mean_rtt_ms >= 700, session.stats.link.summary()
            check_output(smol_model, prompt_tokens, rec.tokens, chunks, session.decoder.committed, reference,
                         "400 ms each way", 6, SHAPE.max_depth)
        finally:
            session.close()


def test_stalled_link_goes_local_within_the_deadline(server, smol_path, smol_model, reference):
    # 2 s: remote steps (~20 ms) stay far inside it on a loaded machine, and a local step (~0.1 s,
    # ~0.5 s on a loaded 2-core machine) is far from what waiting for the link first would cost.
    deadline = 2.0
    stall_s = 15.0  # far longer than any bound below; resume() ends it when the test is done with it
    with netrelay.RelayThread(("127.0.0.1", server.port), delay_up_ms=2, delay_down_ms=2) as relay:
        events: list = []
        session = session_for(smol_path, f"127.0.0.1:{relay.address[1]}", events, deadline_s=deadline)
        rec = Recorder(session)
        try:
            chunks: list[str] = []
            stream = session.chat(PROMPT, stream=True, max_tokens=MAX_TOKENS)
            pull(stream, chunks, lambda: len(rec.tokens) >= 30)
            assert fo_stats(session)["mode"] == "remote"
            relay.stall(stall_s)  # the link holds every byte, connections stay open
            steps = len(rec.steps)
            pull(stream, chunks, lambda: len(rec.steps) > steps)
            took = rec.times[steps] - rec.times[steps - 1]
            fo = fo_stats(session)
            # the step gave up on the link at its deadline (plus drafting the tree)...
            gave_up = fo["breaker_history"][0]["time"] - rec.walls[steps - 1]
            assert deadline <= gave_up < deadline + 1.0, gave_up
            # ...then loaded the local SmolLM2, prefilled ~130 tokens and verified (~0.7 s idle, a few
            # seconds on a busy machine); never did it wait for the stalled link to deliver
            assert deadline <= took < deadline + 6.0 < stall_s, took
            assert fo["deadline_misses"] == 1 and fo["local_steps"] == 1 and fo["breaker"] == "open"
            assert len(events) == 1 and events[0].to_mode == "local" and f"within {deadline:g} s" in events[0].reason
            pull(stream, chunks, lambda: len(rec.steps) > steps + 3)  # still stalled: local, no waiting
            assert max(b - a for a, b in zip(rec.times[steps:], rec.times[steps + 1:])) < deadline
            # the round trip was given up at the deadline: its stream cancelled, its channel closed
            assert fo["abandoned"] == 1 == session.stats.link.abandoned
            relay.resume()  # the held bytes (the stalled step's answer among them) are delivered now
            time.sleep(0.5)
            assert session.stats.link.late_answers == 0  # ...to a cancelled stream: never read
            assert wait_for(lambda: session.failover.state is not Breaker.OPEN, 20), fo_stats(session)
            chunks += list(stream)
            fo = fo_stats(session)
            assert [(e.from_mode, e.to_mode) for e in events] == [("remote", "local"), ("local", "remote")]
            assert fo["breaker"] == "closed" and fo["remote_steps"] > 0
            check_run(smol_model, session, rec, chunks, reference, "stall")
        finally:
            session.close()


def test_failure_without_fallback_raises_and_a_verifier_never_reached_is_an_error(server, smol_path, tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    for kw in ({"fallback": False}, {}):  # with a fallback too: a configuration mistake is never hidden
        with pytest.raises(VerifierConfigError, match="connection refused: nothing listens") as info:
            EdgeSession(smol_path, smol_path, verifier=dead, n_ctx=N_CTX, tree=SHAPE, **kw)
        assert dead in str(info.value)
    with pytest.raises(VerifierConfigError, match="not HOST:PORT"):
        EdgeSession(smol_path, smol_path, verifier="not an address", n_ctx=N_CTX, tree=SHAPE)

    # local-first: an unreachable verifier is expected; the session starts local (and says so)
    events: list = []
    with session_for(smol_path, dead, events, local_first=True) as session:
        assert session.failover.state is Breaker.OPEN
        assert [(e.from_mode, e.to_mode, e.step) for e in events] == [("remote", "local", -1)]
        assert "local-first" in events[0].reason and "Connection refused" in events[0].reason
        assert session.chat("Say hi.", max_tokens=8)
        assert fo_stats(session)["local_steps"] > 0 and fo_stats(session)["remote_steps"] == 0

    for label, kw, match in [("fallback=False", {"fallback": False}, "fallback=False"),
                             ("no local target", {"target": tmp_path / Path(smol_path).name}, "no local target model")]:
        srv = ServerProcess(smol_path, "--n-ctx", str(N_CTX))
        target = kw.pop("target", smol_path)
        events = []
        session = EdgeSession(smol_path, target, verifier=srv.address, n_ctx=N_CTX, tree=SHAPE,
                              on_switch=events.append, deadline_s=5.0, **kw)
        try:
            stream = session.chat(PROMPT, stream=True, max_tokens=60)
            next(stream)
            srv.proc.kill()
            srv.proc.wait(10)
            with pytest.raises(VerifierUnavailableError, match=match) as info:
                for _ in stream:
                    pass
            print(f"{label}: {info.value}")
            fo = fo_stats(session)
            assert fo["local_steps"] == 0 and not fo["local_loaded"] and not fo["fallback"] and not events
        finally:
            session.close()
            srv.stop()


def test_breaker_transitions_local_first_then_threshold(smol_path, smol_model, prompt_tokens, reference):
    """The test plays the decoder: it owns the committed context and passes it to every call."""
    port = free_port()  # nobody listens here (yet)
    fingerprint = smol_model.tokenizer_fingerprint()
    events: list = []
    fo = FailoverVerifier(f"127.0.0.1:{port}", tokenizer_hash=fingerprint,
                          local=LocalFallback(smol_path, tokenizer_hash=fingerprint, config=ContextConfig(n_ctx=N_CTX)),
                          deadline_s=3.0, probe_interval_s=0.2, failure_threshold=2, on_switch=events.append,
                          local_first=True)
    srv = None
    ref = reference.tokens
    context = list(prompt_tokens)

    def step(i: int) -> None:
        done = len(context) - len(prompt_tokens)
        context.extend(fo.verify(context, TokenTree.chain(context[-1], ref[done:done + 3]), GREEDY, i).tokens)

    try:
        # local-first, nobody listens: the breaker starts open, steps go straight to the local target
        assert fo.state is Breaker.OPEN and fo.counters["failures"] == 1
        assert [(e.from_mode, e.to_mode, e.step) for e in events] == [("remote", "local", -1)]
        fo.sync(context)  # the prompt is prefilled locally
        assert fo.snapshot()["local_loaded"]
        started = time.monotonic()
        step(0)
        assert time.monotonic() - started < 1.0 and fo.counters["local_steps"] == 1
        assert wait_for(lambda: fo.counters["probe_failures"] >= 2, 5)
        assert fo.state is Breaker.OPEN  # probes fail while nobody listens

        srv = ServerProcess(smol_path, "--n-ctx", str(N_CTX), "--port", str(port))
        assert wait_for(lambda: fo.state is Breaker.HALF_OPEN, 10), fo.snapshot()
        step(1)  # re-attach: Sync of the context (beyond what the probe sent), verify there, close the breaker
        assert fo.state is Breaker.CLOSED and fo.mode == "remote" and fo.counters["remote_steps"] == 1
        assert [(e.from_mode, e.to_mode, e.step) for e in events][1:] == [("local", "remote", 1)]
        step(2)
        with pytest.raises(InvalidTreeError):  # a client error propagates and is not a failure
            fo.verify(context, TokenTree.chain(context[-1], [10**6]), GREEDY, 3)
        assert fo.state is Breaker.CLOSED and fo.counters["failures"] == 1
        step(3)  # the stream the client error ended is reopened on the same channel
        assert fo.link_stats.reconnects == 1

        assert srv.stop() == 0  # the verifier worked and then went away: now the fallback is right
        step(4)  # failure 1 of 2: this step is verified locally, the breaker stays closed
        assert fo.state is Breaker.CLOSED and fo.mode == "local" and fo.counters["failures"] == 2
        step(5)  # failure 2 of 2: the breaker opens
        assert fo.state is Breaker.OPEN and fo.counters["local_steps"] == 3 and fo.counters["remote_steps"] == 3
        assert [(e.from_mode, e.to_mode, e.step) for e in events][2:] == [("remote", "local", 4)]
        assert [(h.from_state, h.to_state) for h in fo.breaker_history] == [
            ("closed", "open"), ("open", "half-open"), ("half-open", "closed"), ("closed", "open")]
        out = context[len(prompt_tokens):]
        assert len(out) >= 6 * 2
        assert_lossless(out, reference, "breaker")
        assert_targets_choices(smol_model, prompt_tokens, out, "breaker")
    finally:
        fo.close()
        if srv is not None:
            srv.stop()
