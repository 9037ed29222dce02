"""EdgeSession misuse never takes the interpreter down: closed sessions, concurrent requests,
contexts that fill up, and the statistics a short answer reports (issue 8, section 5).

The reproductions that used to kill the process (segfault, GGML_ASSERT abort) run in a child
Python, so a regression fails one test with the child's fatal error instead of ending the run.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from edgespec import EdgeSession, TreeShape
from edgespec.common.errors import (
    ContextOverflowError,
    InvalidRequestError,
    SessionBusyError,
    SessionClosedError,
)
from edgespec.edge.session import available_cpus, default_threads
from grpc_helpers import ServerProcess

SMALL = TreeShape(budget=8, max_depth=4, branching=4, width=4)   # the reproduction shape
PROMPT = "List three fruits."


def run_child(code: str, smol_path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with S = the SmolLM2 path; its exit status tells a crash."""
    prelude = f"import sys, threading\nfrom edgespec import EdgeSession, TreeShape\nS = {str(smol_path)!r}\n"
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout)


def test_a_closed_session_raises_session_closed_error(smol_path):
    r = run_child("""
        from edgespec.common.errors import SessionClosedError
        from edgespec.common.sampling import SamplingParams
        for tree in (TreeShape(budget=8, max_depth=4, branching=4, width=4), None):   # fixed shape; planner
            s = EdgeSession(draft=S, target=S, local=True, tree=tree, n_ctx=1024)
            s.chat("Say hi.", max_tokens=5)
            early = s.chat("again", stream=True, max_tokens=5)    # made before close(), read after
            s.close()
            s.close()                                               # idempotent
            calls = {"chat": lambda: s.chat("again", max_tokens=5),
                     "stream": lambda: next(s.chat("again", stream=True, max_tokens=5)),
                     "early stream": lambda: next(early),
                     "generate_tokens": lambda: next(s.generate_tokens([1, 2, 3], 5, SamplingParams()))}
            for name, call in calls.items():
                try:
                    call()
                    print(name, "no error")
                except SessionClosedError as exc:
                    print(name, "SessionClosedError", exc)
        print("alive")
    """, smol_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "alive" and len(lines) == 9, r.stdout
    assert all("SessionClosedError" in line and "closed" in line for line in lines[:-1]), r.stdout


def test_two_threads_on_one_session_are_served_one_after_the_other(smol_path):
    r = run_child("""
        s = EdgeSession(draft=S, target=S, local=True, tree=TreeShape(budget=8, max_depth=4, branching=4, width=4),
                        n_ctx=1024)
        alone = s.chat("List three fruits.", max_tokens=40)
        answers, errors = [], []
        def ask():
            try:
                answers.append(s.chat("List three fruits.", max_tokens=40))
            except BaseException as exc:
                errors.append(repr(exc))
        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(len(answers), errors, all(a == alone for a in answers))
        s.close()
    """, smol_path)
    assert r.returncode == 0, r.stderr   # was: GGML_ASSERT(i1 >= 0 && i1 < ne1) failed, process aborted
    assert r.stdout.split() == ["4", "[]", "True"], r.stdout


@pytest.fixture(scope="module")
def session(smol_path):
    with EdgeSession(smol_path, smol_path, local=True, tree=SMALL, n_ctx=1024) as s:
        yield s


def test_a_second_stream_on_the_same_thread_raises_busy(session):
    alone = session.chat(PROMPT, max_tokens=30)
    first = session.chat(PROMPT, stream=True, max_tokens=30)
    second = session.chat("Count to five.", stream=True, max_tokens=30)
    head = next(first)
    with pytest.raises(SessionBusyError, match="already answering"):
        next(second)       # was: InvalidTreeError from two streams sharing the KV caches
    assert head + "".join(first) == alone   # the first stream is unharmed
    assert session.chat(PROMPT, max_tokens=30) == alone   # and the session is free again


def test_an_abandoned_stream_frees_the_session(session):
    alone = session.chat(PROMPT, max_tokens=20)
    stream = session.chat(PROMPT, stream=True, max_tokens=20)
    next(stream)
    stream.close()
    assert session.chat(PROMPT, max_tokens=20) == alone
    stream = session.chat(PROMPT, stream=True, max_tokens=20)
    next(stream)
    del stream         # garbage-collected mid-answer
    assert session.chat(PROMPT, max_tokens=20) == alone


def test_close_from_another_thread_stops_a_running_request(smol_path):
    s = EdgeSession(smol_path, smol_path, local=True, tree=SMALL, n_ctx=2048)
    started, outcome = threading.Event(), []

    def answer() -> None:
        try:
            for _ in s.chat("Write a long story about a robot.", stream=True, max_tokens=1500):
                started.set()
            outcome.append("finished")
        except SessionClosedError as exc:
            outcome.append(exc)
        finally:
            started.set()

    worker = threading.Thread(target=answer)
    worker.start()
    assert started.wait(120)
    s.close()            # waits for the step in progress, then frees the models
    worker.join(120)
    assert not worker.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], SessionClosedError), outcome
    assert s.draft_model.closed and s.closed


@pytest.mark.parametrize("n_ctx", [16, 0, -1])
def test_a_context_too_small_for_the_trees_is_refused(smol_path, n_ctx):
    with pytest.raises(InvalidRequestError, match=f"n_ctx={n_ctx} is too small"):
        EdgeSession(smol_path, smol_path, local=True, n_ctx=n_ctx)


def test_a_full_context_ends_the_answer_cleanly(smol_path):
    with EdgeSession(smol_path, smol_path, local=True, tree=TreeShape.chain(4), n_ctx=200) as s:
        assert s.drafter.ctx.n_ctx == 200    # not silently raised to llama.cpp's padded 256
        prompt = s.draft_model.chat_tokens([{"role": "user", "content": "Write a long story about a robot."}])
        text = s.chat("Write a long story about a robot.", max_tokens=1000)
        assert text and s.finish_reason == "context_full"
        assert len(prompt) + s.stats.tokens <= 200
        assert s.chat("Say hi.", max_tokens=3) and s.finish_reason == "max_tokens"   # still usable
        with pytest.raises(ContextOverflowError, match="n_ctx=200"):
            s.chat("word " * 300)


def test_a_verifier_with_a_smaller_window_ends_the_answer_cleanly(smol_path, smol_model):
    """The session's own window has room, the verifier's (e.g. a remote one) fills first."""
    from edgespec.runtime.llama import ContextConfig
    from edgespec.runtime.tree_verifier import LocalVerifier

    small = LocalVerifier(smol_model, ContextConfig(n_ctx=120, max_tree_nodes=8))
    with EdgeSession(smol_path, smol_path, verifier=small, tree=TreeShape.chain(4), n_ctx=1024) as s:
        text = s.chat("Write a long story about a robot.", max_tokens=600)
        assert text and s.finish_reason == "context_full" and 0 < s.stats.tokens < 120


def test_tau_counts_target_steps_not_emitted_tokens(smol_path):
    """τ is at least 1: every step commits the target's own token, even the end-of-generation one
    (which is never emitted) and tokens cut by max_tokens. Counting emitted tokens gave 0.93."""
    with EdgeSession(smol_path, smol_path, local=True, tree=TreeShape.target_only(), n_ctx=1024) as s:
        s.chat("Say hi.", max_tokens=200)
        assert s.finish_reason == "stop"
        assert s.stats.steps == s.stats.tokens + 1      # the last step committed only the end token
        assert s.stats.tau == 1.0
    with EdgeSession(smol_path, smol_path, local=True, tree=TreeShape.chain(4), n_ctx=1024) as s:
        for _ in range(3):
            s.chat("Say hi.", max_tokens=3)
            assert s.finish_reason == "max_tokens"
        assert s.stats.tau >= 1.0 and s.stats.tau == 1 + s.stats.accepted / s.stats.steps


@pytest.mark.parametrize("cpus,remote,expected", [
    (1, False, (1, 1)), (2, False, (1, 1)), (8, False, (2, 5)), (64, False, (4, 59)),
    (1, True, (1, 1)), (2, True, (1, 1)), (4, True, (3, 2)), (8, True, (7, 5)), (64, True, (8, 59)),
])
def test_default_threads_follow_the_mode(cpus, remote, expected):
    draft, target = default_threads(remote, cpus)
    assert (draft, target) == expected
    if remote:   # the edge only drafts: every core but one (up to 8); the fallback gets the target's local share
        assert draft == max(1, min(8, cpus - 1)) and target == default_threads(False, cpus)[1]
    else:        # both models at once: a core stays free where there is one to spare
        assert draft + target <= max(2, cpus - 1)


def test_remote_session_drafts_on_every_core_but_one(smol_path):
    """With a verifier elsewhere the drafter's llama.cpp context gets every core but one (up to 8),
    and a local session splits them."""
    import llama_cpp as C

    cpus = available_cpus()
    server = ServerProcess(smol_path, "--n-ctx", "512", "--threads", "1")
    try:
        with EdgeSession(smol_path, smol_path, verifier=server.address, fallback=False, tree=SMALL, n_ctx=256) as s:
            assert s.threads["draft"] == default_threads(True, cpus)[0] == C.llama_n_threads(s.drafter.ctx._ctx)
            assert s.chat("Say hi.", max_tokens=4)
    finally:
        server.stop()
    with EdgeSession(smol_path, smol_path, local=True, tree=SMALL, n_ctx=256) as s:
        assert (s.threads["draft"], s.threads["target"]) == default_threads(False, cpus)
        assert C.llama_n_threads(s.drafter.ctx._ctx) == s.threads["draft"]


def test_threads_and_gpu_layers_reach_llama_cpp(smol_path):
    import llama_cpp as C

    with EdgeSession(smol_path, smol_path, local=True, tree=SMALL, n_ctx=256, draft_threads=1,
                     target_threads=2) as s:
        assert s.threads == {"draft": 1, "target": 2} and s.gpu_layers == {"draft": 0, "target": 0}
        assert C.llama_n_threads(s.drafter.ctx._ctx) == 1
        assert C.llama_n_threads(s.verifier.ctx._ctx) == 2
    for bad in ({"draft_threads": 0}, {"target_threads": -2}, {"draft_gpu_layers": -5}):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            EdgeSession(smol_path, smol_path, local=True, **bad)
    with pytest.raises(InvalidRequestError, match="cannot offload"):   # this build has no GPU support
        EdgeSession(smol_path, smol_path, local=True, draft_gpu_layers=4)
