"""The verifier service for real: `python -m edgespec verifier serve` on loopback, real gRPC, SmolLM2.

Covers: greedy output over the link == local mode token for token, concurrent sessions, LRU
eviction + transparent resync, idle timeout, per-step deadline, every bad input with its status
code (and the server still healthy and serving others afterwards), bearer-token auth, TLS, the
standard health service, reflection and the embedded (child-process) verifier.
"""
from __future__ import annotations

import contextlib
import random
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from edgespec import EdgeSession, TreeShape
from edgespec.common import wire
from edgespec.common.errors import (ContextOverflowError, InvalidTreeError, ModelError, TokenizerMismatchError,
                                    VerifierUnavailableError)
from edgespec.common.sampling import AcceptanceRule, SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.edge.link import RemoteVerifier
from edgespec.runtime.llama import ContextConfig
from edgespec.runtime.tree_verifier import LlamaTreeVerifier
from edgespec.v1 import edgespec_pb2 as pb
import logit_record
from grpc_helpers import RawStream, ServerProcess, error_class, make_tls_files
from lossless import explain_divergence, first_divergence, model_name, target_only_row
from netlab import wait_for

TOKEN = "test-token-0123456789"
SHAPE = TreeShape()  # fixed tree shape on both sides (no cost-model planning: keeps runs comparable)
N_CTX = 1024
PROMPTS = ["Write a Python function that adds two numbers.", "What is the capital of France? Answer briefly.",
           "List three fruits.", "Explain recursion in one sentence."]
MAX_TOKENS = 32
GREEDY = SamplingParams()
SERVING = health_pb2.HealthCheckResponse.SERVING
C = grpc.StatusCode


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smol_path):
    srv = ServerProcess(smol_path, "--n-ctx", str(N_CTX), "--max-sessions", "4", token=TOKEN)
    yield srv
    assert srv.alive, "".join(srv.stderr)
    assert srv.stop() == 0, "SIGTERM must shut the server down cleanly"


@pytest.fixture(scope="module")
def small_server(smol_path):
    """One KV slot (eviction), three streams, a small context and a 1 s idle timeout; no auth."""
    srv = ServerProcess(smol_path, "--n-ctx", "256", "--max-sessions", "1", "--max-streams", "3",
                        "--idle-timeout-s", "1")
    yield srv
    assert srv.stop() == 0, "".join(srv.stderr)


@pytest.fixture(scope="module")
def local_session(smol_path):
    with EdgeSession(smol_path, smol_path, local=True, n_ctx=N_CTX, tree=SHAPE) as s:
        yield s


@pytest.fixture(scope="module")
def fingerprint(local_session):
    return local_session.draft_model.tokenizer_fingerprint()


@pytest.fixture(scope="module")
def prompts(local_session):
    return [local_session.draft_model.chat_tokens([{"role": "user", "content": p}]) for p in PROMPTS]


LOCAL_RECORDS: dict[tuple[int, ...], tuple[list[int], list]] = {}  # per prompt: reference output, its verifier's logits


@pytest.fixture(scope="module")
def reference(local_session, prompts):
    """Local-mode output of every prompt (the same llama.cpp computation the server does); the
    logits its verifier used are kept to explain a divergence on the local side."""
    outs = []
    for p in prompts:
        with logit_record.capture() as records:   # local, fixed shape: verified on this thread
            outs.append(generate(local_session, p))
        LOCAL_RECORDS[tuple(p)] = (outs[-1], records)
    return outs


def generate(session: EdgeSession, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    return [t for chunk in session.generate_tokens(prompt, n, GREEDY) for t in chunk]


def remote_session(srv: ServerProcess, smol_path, **kw) -> EdgeSession:
    kw.setdefault("tree", SHAPE)
    return EdgeSession(smol_path, smol_path, verifier=srv.address, token=srv.token, n_ctx=N_CTX, **kw)


def assert_same_output(model, prompt: list[int], got: list[int], want: list[int], label: str = "",
                       n: int = MAX_TOKENS) -> None:
    """Token for token equal, or the first divergence explained by numerics (lossless.py).

    Over the link the target runs the very same llama.cpp computation as in local mode, but the
    edge's decoder may shape (or pipeline) its trees differently, and a different tree changes the
    KV-cache layout and so the last bits of the logits (tests/test_runtime.py,
    test_adopt_branch_keeps_only_the_accepted_path, measures such differences). So at the first divergence,
    each side whose token is not the target-only choice must be explained by its own verifier's
    recorded logits (the link: the server process; local mode: this process) against target-only
    logits for the common prefix, with the same rule as every other test (explain_divergence).
    """
    if got == want:
        return
    got, want = [with_end(model, out, n) for out in (got, want)]
    i = first_divergence(got, want)
    assert i is not None, f"{label}: {got} != {want}"
    context = prompt + got[:i]
    target = target_only_row(model, context, N_CTX)
    for side, tokens, here in (("link", got, False), ("local", want, True)):
        if tokens[i] != target.argmax:
            explain_divergence(context, tokens[i], target, f"{label} ({side})", model=model_name(model), position=i,
                               verifier_here=here, records=local_records(prompt, want) if here else None)


def local_records(prompt: list[int], want: list[int]) -> list | None:
    """The reference run's verifier logits if `want` is (a prefix of) that run's output; else None
    (the most recent trees verified in this process are then the local side's)."""
    out, records = LOCAL_RECORDS.get(tuple(prompt), ([], None))
    return records if records and with_end_prefix(out, want) else None


def with_end_prefix(out: list[int], want: list[int]) -> bool:
    return len(want) <= len(out) + 1 and out[:len(want)] == want[:len(out)]


def with_end(model, out: list[int], n: int) -> list[int]:
    """The output with its end-of-generation token (if it stopped before n), as spec_tokens keeps it."""
    return out + [model.eos] if len(out) < n else out


def open_raw(srv: ServerProcess, fingerprint: str, model_id: str = "test", token: str | None = "default"):
    ch = srv.channel(token=token)
    s = RawStream(ch)
    reply = s.ask(wire.open_message(model_id, fingerprint))
    assert not isinstance(reply, Exception), reply
    return ch, s, reply.opened


def expect_error(reply, code: grpc.StatusCode, match: str | None = None) -> grpc.RpcError:
    assert isinstance(reply, grpc.RpcError), f"expected {code.name}, got {reply!r}"
    assert reply.code() == code, (reply.code(), reply.details())
    if match:
        assert match in reply.details(), reply.details()
    return reply


def assert_healthy_and_serving(srv: ServerProcess, fingerprint: str, prompt: list[int]) -> None:
    """The process lives, health says SERVING, and a fresh session verifies correctly."""
    assert srv.alive, "".join(srv.stderr)
    assert srv.health() == SERVING
    ch, s, _ = open_raw(srv, fingerprint)
    try:
        assert s.ask(wire.sync_message(prompt)).synced.n_tokens == len(prompt)
        reply = s.ask(wire.verify_message(TokenTree.chain(prompt[-1], []), GREEDY, 0, context_length=len(prompt)))
        assert reply.WhichOneof("kind") == "verified", reply
        assert len(wire.tokens_from_bytes(reply.verified.tokens)) == 1
    finally:
        s.close()
        ch.close()


# -- correctness over the link ----------------------------------------------------------------
def test_greedy_over_the_link_equals_local(server, smol_path, smol_model, prompts, reference):
    with remote_session(server, smol_path) as session:
        for i, (prompt, ref) in enumerate(zip(prompts, reference)):
            assert_same_output(smol_model, prompt, generate(session, prompt), ref, f"prompt {i}")
        link = session.stats.link
        assert link.steps == session.stats.steps > 0
        assert link.syncs == len(prompts) and link.resyncs == 0
        assert link.bytes_up_per_step > 0 and link.bytes_down_per_step > 0
        assert link.mean_compute_ms > 0 and link.mean_rtt_ms >= 0
        assert "rtt" in link.summary() and "tau" in session.stats.summary()


def test_chat_text_over_the_link_equals_local(server, smol_path, smol_model, local_session):
    with remote_session(server, smol_path, tree=TreeShape.chain(4)) as remote, \
            EdgeSession(smol_path, smol_path, local=True, n_ctx=N_CTX, tree=TreeShape.chain(4)) as local:
        got, want = remote.chat(PROMPTS[0], max_tokens=24), local.chat(PROMPTS[0], max_tokens=24)
        if got != want:  # same rule as assert_same_output, on the text
            prompt = local.draft_model.chat_tokens([{"role": "user", "content": PROMPTS[0]}])
            assert_same_output(smol_model, prompt, smol_model.tokenize(got, False, False),
                               smol_model.tokenize(want, False, False), "chat", n=24)


def test_concurrent_sessions(server, smol_path, smol_model, prompts, reference):
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with remote_session(server, smol_path) as s:
                results[i] = generate(s, prompts[i])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i in range(3):
        assert_same_output(smol_model, prompts[i], results[i], reference[i], f"thread {i}")


@pytest.mark.parametrize("rule", list(AcceptanceRule), ids=lambda r: r.value)
def test_sampled_trees_verify_identically_over_the_link(server, smol_model, fingerprint, prompts, rule):
    """Same sampled tree (seed, temperature, rule and, for the rejection rule, q weights on the wire)
    -> same accept/reject decisions locally and remotely."""
    from edgespec.edge.drafting import Drafter

    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234, rule=rule)
    drafter = Drafter(smol_model, ContextConfig(n_ctx=N_CTX, max_tree_nodes=33))
    local = LlamaTreeVerifier(smol_model, ContextConfig(n_ctx=N_CTX))
    committed = list(prompts[3])
    try:
        with RemoteVerifier(server.address, TOKEN, tokenizer_hash=fingerprint, model_id="test") as link:
            link.sync(committed)
            local.sync(committed)
            for step in range(6):
                draft = drafter.grow(committed, TreeShape(budget=12, max_depth=4), sampling, step)
                assert (draft.tree.q_tokens.shape[1] > 0) == (rule is AcceptanceRule.REJECTION)
                a, b = local.verify(draft.tree, sampling, step), link.verify(draft.tree, sampling, step)
                assert (a.path, a.tokens) == (b.path, b.tokens)
                np.testing.assert_allclose(a.margins, b.margins, rtol=1e-6)
                committed += a.tokens  # grow() re-syncs the drafter's KV to this context
            assert link.committed == committed
    finally:
        drafter.close()
        local.close()


def test_info_and_reflection(server, fingerprint):
    info = server.info()
    assert info.model_id == "smollm2-135m-instruct" and "test" in info.model_aliases
    assert info.tokenizer_hash == fingerprint and info.vocab_size == 49152 and info.n_ctx == N_CTX
    assert info.protocol_version == wire.PROTOCOL_VERSION and info.max_nodes == 128
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with server.channel() as ch:
        services = ProtoReflectionDescriptorDatabase(ch).get_services()
        assert wire.SERVICE_NAME in services and "grpc.health.v1.Health" in services
        desc = ProtoReflectionDescriptorDatabase(ch).FindFileContainingSymbol(wire.SERVICE_NAME)
        assert desc.package == "edgespec.v1"


def test_health_needs_no_token(server):
    assert server.health("") == SERVING
    assert server.health(wire.SERVICE_NAME) == SERVING


# -- eviction, idle timeout, limits, deadline -------------------------------------------------
def test_eviction_and_transparent_resync(small_server, smol_path, smol_model, prompts, reference):
    """One KV slot, two sessions stepping alternately: each step evicts the other; both stay correct."""
    before = small_server.info()
    a, b = (EdgeSession(smol_path, smol_path, verifier=small_server.address, n_ctx=N_CTX, tree=SHAPE) for _ in range(2))
    with a, b:
        gens = [a.generate_tokens(prompts[0], MAX_TOKENS, GREEDY), b.generate_tokens(prompts[1], MAX_TOKENS, GREEDY)]
        outs: list[list[int]] = [[], []]
        live = [True, True]
        while any(live):
            for i, g in enumerate(gens):
                if live[i]:
                    chunk = next(g, None)
                    if chunk is None:
                        live[i] = False
                    else:
                        outs[i] += chunk
        for i in range(2):
            assert_same_output(smol_model, prompts[i], outs[i], reference[i], f"session {i}")
        assert a.stats.link.resyncs > 0 and b.stats.link.resyncs > 0
    after = small_server.info()
    assert after.resyncs - before.resyncs == a.stats.link.resyncs + b.stats.link.resyncs
    assert after.evictions > before.evictions and after.max_sessions == 1


def test_idle_timeout_asks_for_resync(small_server, fingerprint, prompts):
    ch, s, _ = open_raw(small_server, fingerprint)
    try:
        s.ask(wire.sync_message(prompts[0]))
        # idle timeout 1 s, reaper every 0.25 s: after ~1.25 s the reaper frees the slot of this, the
        # one live session (one KV slot); Info does not touch the session, a busy reaper may be late
        assert wait_for(lambda: small_server.info().live_sessions == 0, 15), small_server.info()
        tree = TokenTree.chain(prompts[0][-1], [])
        reply = s.ask(wire.verify_message(tree, GREEDY, 0))
        assert reply.WhichOneof("kind") == "resync_required"
        assert reply.resync_required.reason == pb.ResyncRequired.IDLE_TIMEOUT and reply.resync_required.step == 0
        s.ask(wire.sync_message(prompts[0]))
        assert s.ask(wire.verify_message(tree, GREEDY, 0)).WhichOneof("kind") == "verified"
    finally:
        s.close()
        ch.close()


def test_context_mismatch_asks_for_resync(server, fingerprint, prompts):
    ch, s, _ = open_raw(server, fingerprint)
    try:
        s.ask(wire.sync_message(prompts[0]))
        reply = s.ask(wire.verify_message(TokenTree.chain(prompts[0][-1], []), GREEDY, 0, context_length=3))
        assert reply.resync_required.reason == pb.ResyncRequired.UNKNOWN_CONTEXT
    finally:
        s.close()
        ch.close()


def wait_for_streams(srv: ServerProcess, n: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while srv.info().open_streams > n:
        assert time.monotonic() < deadline, "streams of earlier tests were not released"
        time.sleep(0.05)


def test_too_many_streams(small_server, fingerprint, prompts):
    wait_for_streams(small_server, 0)
    held = [open_raw(small_server, fingerprint) for _ in range(3)]
    try:
        ch = small_server.channel()
        extra = RawStream(ch)
        err = expect_error(extra.ask(wire.open_message("test", fingerprint)), C.RESOURCE_EXHAUSTED, "open sessions")
        assert error_class(err) == "VerifierBusyError"
        ch.close()
        with pytest.raises(wire.VerifierBusyError, match="open sessions"):
            RemoteVerifier(small_server.address, tokenizer_hash=fingerprint)
    finally:
        for ch, s, _ in held:
            s.close()
            ch.close()
    wait_for_streams(small_server, 0)
    assert_healthy_and_serving(small_server, fingerprint, prompts[0])


def test_kv_slots_all_in_flight_is_resource_exhausted(smol_path):
    """Registry level, real backend: the only slot belongs to a session with a queued request."""
    from edgespec.verifier.llama_backend import LlamaCppBackend
    from edgespec.verifier.sessions import SessionRegistry

    backend = LlamaCppBackend(smol_path, n_ctx=256)
    registry = SessionRegistry(backend, max_sessions=1)
    try:
        a, b = registry.open_stream(), registry.open_stream()
        with registry.compute(a, time.monotonic()):
            registry.ensure_slot(a).sync([1, 2, 3])
        queued = threading.Event()
        with registry.compute(b, time.monotonic()):
            def a_waits() -> None:
                queued.set()
                with registry.compute(a, time.monotonic()):
                    pass

            t = threading.Thread(target=a_waits)
            t.start()
            queued.wait()
            while a.in_flight == 0:
                time.sleep(0.001)
            with pytest.raises(wire.VerifierBusyError, match="KV slots"):
                registry.ensure_slot(b)
        t.join()
        with registry.compute(b, time.monotonic()):  # a is idle again: evicted for b
            registry.ensure_slot(b)
        assert a.kv is None and registry.stats.evictions == 1
    finally:
        registry.close()
        backend.close()


def test_ended_streams_leave_a_prefix_cache(smol_path, smol_model):
    """Registry level, real backend: the KV state of an ended stream serves the next session whose
    context shares its prefix (only the rest is prefilled, and verification is unchanged); with
    every slot needed, retained states go first, before any live session is evicted."""
    from edgespec.verifier.llama_backend import LlamaCppBackend
    from edgespec.verifier.sessions import SessionRegistry

    backend = LlamaCppBackend(smol_path, n_ctx=512)
    registry = SessionRegistry(backend, max_sessions=2)
    prompt = smol_model.chat_tokens([{"role": "user", "content": "Name three colours."}])
    other = smol_model.chat_tokens([{"role": "user", "content": "What is two plus two?"}])

    def sync(tokens: list[int]):
        s = registry.open_stream()
        with registry.compute(s, time.monotonic()):
            registry.ensure_slot(s, tokens).sync(tokens)
        return s

    try:
        a = sync(prompt)
        kept = a.kv
        registry.close_stream(a)
        assert registry.retained_slots == 1 and registry.live_sessions == 0
        longer = prompt + [int(smol_model.tokenize("Red")[0])]
        b = sync(longer)
        assert b.kv is kept and registry.retained_slots == 0
        assert registry.stats.prefix_hits == 1 and registry.stats.prefix_tokens_reused == len(prompt)
        tree = TokenTree.chain(longer[-1], [1, 2, 3])
        with registry.compute(b, time.monotonic()):
            reused = b.kv.verify(tree, GREEDY, 0)
        fresh = LlamaTreeVerifier(backend.model, ContextConfig(n_ctx=512))
        try:
            fresh.sync(longer)
            assert fresh.verify(tree, GREEDY, 0).tokens == reused.tokens
        finally:
            fresh.close()
        registry.close_stream(b)
        c = sync(other)   # shares the chat template's opening with what b left behind
        assert registry.stats.prefix_hits == 2 and c.kv is kept
        registry.close_stream(c)
        d = sync([5, 6, 7])      # no common prefix: a new slot (1 live + 1 retained fit in 2)
        assert d.kv is not kept and registry.retained_slots == 1
        e = sync([8, 9, 10])     # the slots are full: the retained state goes, no live session does
        assert registry.retained_slots == 0 and registry.stats.evictions == 0 and d.kv is not None
        sync([11, 12])           # now only live sessions are left: the idle LRU one (d) is evicted
        assert registry.stats.evictions == 1 and d.kv is None and e.kv is not None
    finally:
        registry.close()
        backend.close()


def test_a_second_session_reuses_the_first_ones_prefill(server, smol_path, smol_model, prompts, reference):
    """End to end: a session that ends leaves its KV behind; the next one with the same prompt
    prefills nothing it already has, and its output is unchanged."""
    with remote_session(server, smol_path) as s:
        generate(s, prompts[0], 4)
    wait_for_streams(server, 0)
    before = server.info()
    with remote_session(server, smol_path) as s:
        out = generate(s, prompts[0])
    after = server.info()
    assert after.prefix_hits == before.prefix_hits + 1
    assert after.prefix_tokens_reused - before.prefix_tokens_reused >= len(prompts[0])
    assert_same_output(smol_model, prompts[0], out, reference[0], "after a prefix hit")


@contextlib.contextmanager
def queued_behind_a_long_prefill(server, fingerprint, prompts, seed: int):  # noqa: ANN001
    """A stream that has synced prompts[0], while a second session's ~2 s prefill holds the compute
    worker: what the first stream sends now waits in the queue. Yields that first stream."""
    ch, waiting, _ = open_raw(server, fingerprint)
    ch2, busy, _ = open_raw(server, fingerprint)
    try:
        wait_for_streams(server, 2)  # only ours are open: live sessions are ours (ended ones are retained)
        waiting.ask(wire.sync_message(prompts[0]))
        assert server.info().live_sessions == 1
        rng = random.Random(seed)
        long_context = [rng.randrange(100, 40000) for _ in range(300)]  # ~2 s of prefill on one thread
        t = threading.Thread(target=busy.ask, args=(wire.sync_message(long_context),))
        t.start()
        # busy's Sync holds the compute worker once it has its KV slot (it prefills right after)
        assert wait_for(lambda: server.info().live_sessions == 2, 15), server.info()
        yield waiting
        t.join()
    finally:
        for s, c in ((waiting, ch), (busy, ch2)):
            s.close()
            c.close()


def test_deadline_exceeded_while_queued(server, fingerprint, prompts):
    with queued_behind_a_long_prefill(server, fingerprint, prompts, seed=0) as waiting:
        reply = waiting.ask(wire.verify_message(TokenTree.chain(prompts[0][-1], []), GREEDY, 0, deadline_ms=50))
        err = expect_error(reply, C.DEADLINE_EXCEEDED, "deadline of 50 ms")
        assert error_class(err) == "DeadlineExceededError"
    assert_healthy_and_serving(server, fingerprint, prompts[0])


def test_sync_deadline_exceeded_while_queued(server, fingerprint, prompts):
    """A Sync carries a deadline too (the edge sends what is left of its own): queued behind
    another session's long prefill past it, it is answered DEADLINE_EXCEEDED before any prefill,
    and the server goes on serving."""
    with queued_behind_a_long_prefill(server, fingerprint, prompts, seed=1) as waiting:
        reply = waiting.ask(wire.sync_message(prompts[1], deadline_ms=50))
        err = expect_error(reply, C.DEADLINE_EXCEEDED, "deadline of 50 ms")
        assert error_class(err) == "DeadlineExceededError"
    assert_healthy_and_serving(server, fingerprint, prompts[0])


# -- bad input --------------------------------------------------------------------------------
def chain_msg(root: int, drafts: list[int], step: int = 0, **kw) -> pb.EdgeMessage:
    return wire.verify_message(TokenTree.chain(root, drafts), GREEDY, step, **kw)


def tree_msg(tokens: bytes, parents: bytes, k: int = 0, q_tokens: bytes = b"", q_weights: bytes = b"",
             sampling: pb.SamplingParams | None = None) -> pb.EdgeMessage:
    return pb.EdgeMessage(verify=pb.Verify(step=0, sampling=sampling or pb.SamplingParams(), tree=pb.TokenTree(
        tokens=tokens, parents=parents, k=k, q_tokens=q_tokens, q_weights=q_weights)))


P = wire.pack_i32
# (name, open?, sync?, message given the last prompt token, status code, detail substring, error class)
BAD = [
    ("verify before open", False, False, lambda r: chain_msg(r, []), C.FAILED_PRECONDITION, "before Open", "ProtocolError"),
    ("sync before open", False, False, lambda r: wire.sync_message([1, 2]), C.FAILED_PRECONDITION, "before Open", None),
    ("verify before sync", True, False, lambda r: chain_msg(r, []), C.FAILED_PRECONDITION, "before Sync", None),
    ("second open", True, False, lambda r: wire.open_message("test", "x"), C.FAILED_PRECONDITION, "already", None),
    ("empty message", True, True, lambda r: pb.EdgeMessage(), C.INVALID_ARGUMENT, "none of", "WireFormatError"),
    ("tree too large", True, True, lambda r: chain_msg(r, [5] * 128), C.RESOURCE_EXHAUSTED, "129 nodes",
     "TreeTooLargeError"),
    ("tree too deep", True, True, lambda r: chain_msg(r, list(range(10, 50))), C.RESOURCE_EXHAUSTED, "depth 40", None),
    ("odd token bytes", True, True, lambda r: tree_msg(P([r]) + b"\x00", P([-1])), C.INVALID_ARGUMENT, "int32", None),
    ("parents length", True, True, lambda r: tree_msg(P([r, 5]), P([-1])), C.INVALID_ARGUMENT, "tree.parents", None),
    ("orphan node", True, True, lambda r: tree_msg(P([r, 5, 6]), P([-1, 2, 0])), C.INVALID_ARGUMENT,
     "parents must precede", "InvalidTreeError"),
    ("token out of vocab", True, True, lambda r: chain_msg(r, [49152]), C.INVALID_ARGUMENT, "outside the vocabulary",
     None),
    ("negative token", True, True, lambda r: chain_msg(r, [-7]), C.INVALID_ARGUMENT, "outside the vocabulary", None),
    ("wrong root", True, True, lambda r: chain_msg(r + 1, [5]), C.INVALID_ARGUMENT, "last committed", None),
    ("rejection rule without q", True, True,
     lambda r: tree_msg(P([r, 5]), P([-1, 0]), sampling=pb.SamplingParams(temperature=0.8, top_p=1,
                                                                          rule=pb.ACCEPTANCE_RULE_REJECTION)),
     C.INVALID_ARGUMENT, "draft distribution", None),
    ("bad sampling", True, True, lambda r: tree_msg(P([r]), P([-1]), sampling=pb.SamplingParams(top_p=1.5)),
     C.INVALID_ARGUMENT, "top_p", None),
    ("q length", True, True, lambda r: tree_msg(P([r]), P([-1]), k=2, q_tokens=P([1, 2]), q_weights=b"\x01\x00"),
     C.INVALID_ARGUMENT, "q_weights", None),
    ("k over limit", True, True, lambda r: tree_msg(P([r]), P([-1]), k=65, q_tokens=P([1] * 65),
                                                    q_weights=b"\x01\x00" * 65), C.RESOURCE_EXHAUSTED, "k = 65", None),
    ("sync empty", True, False, lambda r: wire.sync_message([]), C.INVALID_ARGUMENT, "no tokens", None),
    ("sync out of vocab", True, False, lambda r: wire.sync_message([1, 99999]), C.INVALID_ARGUMENT, "vocabulary", None),
    ("sync over n_ctx", True, False, lambda r: wire.sync_message([1] * (N_CTX + 1)), C.RESOURCE_EXHAUSTED, "n_ctx",
     "ContextOverflowError"),
    ("sync near n_ctx", True, False, lambda r: wire.sync_message([1] * (N_CTX - 10)), C.RESOURCE_EXHAUSTED,
     "does not fit", "ContextOverflowError"),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_status_and_the_server_carries_on(server, fingerprint, prompts, case):
    name, do_open, do_sync, make, code, match, cls = case
    ch = server.channel()
    s = RawStream(ch)
    try:
        if do_open:
            assert s.ask(wire.open_message("test", fingerprint)).WhichOneof("kind") == "opened"
        if do_sync:
            assert s.ask(wire.sync_message(prompts[0])).synced.n_tokens == len(prompts[0])
        err = expect_error(s.ask(make(prompts[0][-1])), code, match)
        if cls:
            assert error_class(err) == cls
    finally:
        s.close()
        ch.close()
    assert_healthy_and_serving(server, fingerprint, prompts[1])


@pytest.mark.parametrize("model_id,hash_,code,match", [
    ("test", "0" * 64, C.FAILED_PRECONDITION, "tokenizer"),
    ("test", "", C.FAILED_PRECONDITION, "tokenizer_hash is required"),
    ("no-such-model", None, C.NOT_FOUND, "not served here"),
    ("qwen2.5-coder-1.5b-instruct", None, C.NOT_FOUND, "not served here"),
])
def test_bad_open(server, fingerprint, prompts, model_id, hash_, code, match):
    ch = server.channel()
    s = RawStream(ch)
    expect_error(s.ask(wire.open_message(model_id, fingerprint if hash_ is None else hash_)), code, match)
    ch.close()
    assert_healthy_and_serving(server, fingerprint, prompts[0])


def test_bad_protocol_version(server, fingerprint):
    ch = server.channel()
    msg = wire.open_message("test", fingerprint)
    msg.open.protocol_version = 2
    expect_error(RawStream(ch).ask(msg), C.FAILED_PRECONDITION, "protocol version 2")
    ch.close()


def test_link_raises_edgespec_errors(server, fingerprint, prompts, smol_path, qwen_paths):
    with pytest.raises(TokenizerMismatchError, match="tokenizer"):
        RemoteVerifier(server.address, TOKEN, tokenizer_hash="f" * 64)
    with pytest.raises(ModelError, match="not served"):
        RemoteVerifier(server.address, TOKEN, tokenizer_hash=fingerprint, model_id="no-such-model")
    with pytest.raises(TokenizerMismatchError):  # a Qwen draft against the SmolLM2 server
        EdgeSession(qwen_paths[0], smol_path, verifier=server.address, token=TOKEN)
    with RemoteVerifier(server.address, TOKEN, tokenizer_hash=fingerprint, model_id="test") as link:
        link.sync(prompts[0])
        with pytest.raises(InvalidTreeError, match="outside the vocabulary"):
            link.verify(TokenTree.chain(prompts[0][-1], [10**6]), GREEDY, 0)
        # the broken stream is reopened (Open + Sync) transparently on the next call
        result = link.verify(TokenTree.chain(prompts[0][-1], []), GREEDY, 0)
        assert len(result.tokens) == 1 and link.link_stats.reconnects == 1
        with pytest.raises(ContextOverflowError):
            link.sync([1] * (N_CTX + 5))


def test_context_overflow_while_generating(small_server, fingerprint, smol_path):
    """n_ctx 256: a session that keeps verifying eventually overflows: RESOURCE_EXHAUSTED."""
    rng = np.random.default_rng(1)
    committed = rng.integers(100, 40000, 200).tolist()
    with RemoteVerifier(small_server.address, tokenizer_hash=fingerprint) as link:
        link.sync(committed)
        with pytest.raises(ContextOverflowError, match="full"):
            for step in range(100):
                result = link.verify(TokenTree.chain(link.committed[-1], []), GREEDY, step)
                assert len(result.tokens) == 1
        assert 250 <= len(link.committed) <= 257


def test_link_reconnects_after_a_server_restart(smol_path, fingerprint, prompts):
    srv = ServerProcess(smol_path, "--n-ctx", "512")
    port = srv.port
    try:
        with RemoteVerifier(srv.address, tokenizer_hash=fingerprint, timeout_s=20) as link:
            link.sync(prompts[0])
            first = link.verify(TokenTree.chain(prompts[0][-1], []), GREEDY, 0).tokens
            assert srv.stop() == 0
            with pytest.raises(VerifierUnavailableError):  # nobody listens: fails fast
                link.verify(TokenTree.chain(link.committed[-1], []), GREEDY, 1)
            srv = ServerProcess(smol_path, "--n-ctx", "512", "--port", str(port))
            # a new stream (Open + Sync of the whole committed context) is set up transparently
            second = link.verify(TokenTree.chain(link.committed[-1], []), GREEDY, 1).tokens
            assert link.committed == prompts[0] + first + second
            assert link.link_stats.reconnects >= 1 and link.link_stats.syncs >= 2
    finally:
        srv.stop()


# -- auth and TLS -----------------------------------------------------------------------------
@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", ""])
def test_wrong_or_missing_token(server, fingerprint, prompts, token):
    ch = server.channel(token=token or None) if token != "" else server.channel(token=None)
    from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.VerifierStub(ch).Info(pb.InfoRequest(), timeout=10)
    assert info.value.code() == C.UNAUTHENTICATED
    expect_error(RawStream(ch).ask(wire.open_message("test", fingerprint)), C.UNAUTHENTICATED)
    ch.close()
    with pytest.raises(wire.UnauthenticatedError) as info:
        RemoteVerifier(server.address, token or None, tokenizer_hash=fingerprint)
    assert isinstance(info.value, VerifierUnavailableError)
    assert_healthy_and_serving(server, fingerprint, prompts[0])


def test_tls(tmp_path, smol_path, smol_model, fingerprint, prompts, reference):
    ca, cert, key = make_tls_files(tmp_path)
    srv = ServerProcess(smol_path, "--n-ctx", str(N_CTX), "--tls-cert", str(cert), "--tls-key", str(key), token=TOKEN)
    try:
        host_port = f"localhost:{srv.port}"
        with EdgeSession(smol_path, smol_path, verifier=host_port, token=TOKEN, tls=str(ca), n_ctx=N_CTX, tree=SHAPE) as s:
            assert_same_output(smol_model, prompts[0], generate(s, prompts[0], 16), reference[0][:16], "tls", n=16)
        with RemoteVerifier(f"127.0.0.1:{srv.port}", TOKEN, str(ca), tokenizer_hash=fingerprint) as link:
            link.sync(prompts[0])  # IP SAN
        with pytest.raises(VerifierUnavailableError):  # plain text against a TLS port
            RemoteVerifier(host_port, TOKEN, None, tokenizer_hash=fingerprint, timeout_s=5)
        (tmp_path / "other").mkdir()
        other_ca, _, _ = make_tls_files(tmp_path / "other")
        with pytest.raises(VerifierUnavailableError):  # a CA that did not sign the server's certificate
            RemoteVerifier(host_port, TOKEN, str(other_ca), tokenizer_hash=fingerprint, timeout_s=5)
        with pytest.raises(wire.UnauthenticatedError):  # TLS does not replace the token
            RemoteVerifier(host_port, "nope", str(ca), tokenizer_hash=fingerprint, timeout_s=5)
    finally:
        assert srv.stop() == 0


# -- the embedded verifier --------------------------------------------------------------------
def test_embedded_verifier_is_the_default(smol_path, smol_model, prompts, reference):
    session = EdgeSession(smol_path, smol_path, n_ctx=N_CTX, tree=SHAPE)
    child = session._embedded
    try:
        assert child is not None and child.running
        assert child.address.startswith("127.0.0.1:")
        assert_same_output(smol_model, prompts[2], generate(session, prompts[2]), reference[2], "embedded")
        assert session.stats.link.steps > 0
    finally:
        session.close()
    assert not child.running and child.proc.returncode == 0


def test_embedded_verifier_reports_startup_failure(tmp_path):
    from edgespec.edge.embedded import EmbeddedVerifier

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(VerifierUnavailableError, match="exited with code"):
        EmbeddedVerifier(bad, startup_timeout_s=60)


def test_prometheus_metrics(smol_path, smol_model, fingerprint, prompts, reference):
    """--metrics-port: the figures Info reports, request histograms and error counts, over HTTP."""
    import re
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    srv = ServerProcess(smol_path, "--n-ctx", str(N_CTX), "--metrics-port", "0")
    try:
        assert wait_for(lambda: any("metrics on http" in line for line in srv.stderr), 10), srv.stderr
        url = re.search(r"metrics on (http://\S+/metrics)", "".join(srv.stderr)).group(1)

        def scrape() -> dict[str, float]:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            return {(s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()) if k != "le")): s.value
                    for fam in text_string_to_metric_families(text) for s in fam.samples if "le" not in s.labels}

        with remote_session(srv, smol_path) as s:
            out = generate(s, prompts[0])
            assert_same_output(smol_model, prompts[0], out, reference[0], "with metrics")
            steps = s.stats.steps
            m = scrape()
            assert m["edgespec_verifier_open_streams"] == 1 and m["edgespec_verifier_live_sessions"] == 1
        ch = srv.channel()
        msg = wire.open_message("test", fingerprint)
        msg.open.protocol_version = 2
        expect_error(RawStream(ch).ask(msg), C.FAILED_PRECONDITION, "protocol version")
        ch.close()
        wait_for_streams(srv, 0)  # both streams ended on the server too: the figures below stay put
        info = srv.info()
        m = scrape()
        assert m["edgespec_verifier_verifies_total"] == info.verifies == steps
        assert m["edgespec_verifier_compute_seconds_count{kind=verify}"] == steps
        assert m["edgespec_verifier_queue_seconds_count{kind=sync}"] == m["edgespec_verifier_syncs_total"] >= 1
        assert m["edgespec_verifier_tree_nodes_count"] == steps
        assert m["edgespec_verifier_tokens_per_verify_sum"] >= len(out)   # + the end's overshoot
        assert m["edgespec_verifier_errors_total{code=FAILED_PRECONDITION}"] == 1
        assert m["edgespec_verifier_retained_slots"] == info.retained_slots
    finally:
        srv.stop()


def test_a_vanished_edge_frees_its_stream(smol_path, prompts):
    """An edge whose link goes silent without closing (power loss, partition: here a relay that
    holds every byte) is detected by the server's keepalive pings; its stream and KV slot are freed."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import netrelay

    srv = ServerProcess(smol_path, "--n-ctx", str(N_CTX), "--keepalive-s", "1")
    try:
        with netrelay.RelayThread(("127.0.0.1", srv.port)) as relay:
            session = EdgeSession(smol_path, smol_path, verifier=netrelay.format_hostport(relay.address),
                                  n_ctx=N_CTX, tree=SHAPE, fallback=False)
            try:
                generate(session, prompts[0], 4)
                assert srv.info().open_streams == 1 and srv.info().live_sessions == 1
                relay.stall(30.0)
                started = time.monotonic()
                assert wait_for(lambda: srv.info().open_streams == 0, 15), "the silent stream was never closed"
                assert time.monotonic() - started < 10   # about keepalive (1 s) + its timeout (1 s)
                info = srv.info()
                assert info.live_sessions == 0 and info.retained_slots == 1   # its KV is a prefix cache now
            finally:
                relay.resume()
                session.close()
    finally:
        srv.stop()
