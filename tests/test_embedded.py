"""The bundled verifier child (edgespec/edge/embedded.py): started by EdgeSession() when no verifier
address is given, restarted by the failover probe when it dies, stopped on close.

Real parts only: `python -m edgespec verifier serve` children with SmolLM2, real gRPC on loopback.
"""
from __future__ import annotations

import os
import signal

import pytest

from edgespec import EdgeSession
from edgespec.common.errors import VerifierUnavailableError
from edgespec.edge.embedded import EmbeddedVerifier
from edgespec.edge.failover import Breaker
from netlab import wait_for
from lossless import target_only_greedy
from failover_helpers import MAX_TOKENS, N_CTX, PROBE_S, PROMPT, SHAPE, Recorder, check_run, fo_stats, pull


@pytest.fixture(scope="module")
def reference(smol_model):
    return target_only_greedy(smol_model, smol_model.chat_tokens([{"role": "user", "content": PROMPT}]), MAX_TOKENS)


def test_dead_bundled_verifier_is_restarted_and_reattached(smol_path, smol_model, reference):
    events: list = []
    session = EdgeSession(smol_path, smol_path, n_ctx=N_CTX, tree=SHAPE, probe_interval_s=PROBE_S,
                          deadline_s=5.0, on_switch=events.append)
    rec = Recorder(session)
    try:
        embedded = session.embedded
        assert embedded is not None and embedded.running and embedded.restarts == 0
        first_pid, first_address = embedded.proc.pid, embedded.address
        chunks: list[str] = []
        stream = session.chat(PROMPT, stream=True, max_tokens=MAX_TOKENS)
        pull(stream, chunks, lambda: len(rec.tokens) >= 30)
        assert fo_stats(session)["mode"] == "remote"

        os.kill(first_pid, signal.SIGKILL)  # crash of the child: no goodbye on the stream
        pull(stream, chunks, lambda: events)
        assert (events[0].from_mode, events[0].to_mode) == ("remote", "local")
        # the probe restarts the child (a new process on a new port) and attaches to it
        assert wait_for(lambda: session.failover.state is Breaker.HALF_OPEN or len(events) > 1, 60), fo_stats(session)
        assert embedded.restarts == 1 and embedded.running and embedded.proc.pid != first_pid
        assert session.failover.address == embedded.address != first_address
        chunks += list(stream)
        assert [(e.from_mode, e.to_mode) for e in events] == [("remote", "local"), ("local", "remote")]
        fo = fo_stats(session)
        assert fo["mode"] == "remote" and fo["reattaches"] == 1 and fo["local_steps"] >= 1
        assert fo["remote_steps"] + fo["local_steps"] == len(rec.steps) == session.stats.steps
        check_run(smol_model, session, rec, chunks, reference, "embedded sigkill+restart")
    finally:
        session.close()
    assert not embedded.running
    with pytest.raises(VerifierUnavailableError, match="stopped"):
        embedded.ensure_running()


def test_restart_that_fails_backs_off(smol_path, tmp_path):
    embedded = EmbeddedVerifier(smol_path, n_ctx=512, restart_backoff_s=30.0)
    try:
        embedded.proc.kill()
        embedded.proc.wait(10)
        embedded.model = embedded._cmd[embedded._cmd.index("--model") + 1] = str(tmp_path / "gone.gguf")
        with pytest.raises(VerifierUnavailableError, match="exited with code"):
            embedded.ensure_running()  # the child cannot load its model
        with pytest.raises(VerifierUnavailableError, match="next restart in"):
            embedded.ensure_running()  # backing off: no new child is spawned
        assert embedded.restarts == 0 and not embedded.running
    finally:
        embedded.stop()
