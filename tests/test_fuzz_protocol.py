"""Protocol fuzzing of the verifier service (hypothesis) against a real `edgespec verifier serve`.

Generators for every message (trees with cycles, out-of-range parents, huge depths, duplicate
siblings, tokens outside the vocabulary, q rows that do not sum or do not cover the children,
non-finite sampling parameters, wrong context lengths, Sync/Verify out of order, oversized and
undecodable messages, streams cut mid-request) plus byte-level garbage on the socket. For every
input the server owes the answer an oracle (fuzz_helpers) computes with the same wire and tree
code; it must never crash or answer INTERNAL, every stream it ends frees its stream and KV slot
(Info counters), and a witness session stepping between the fuzz inputs gets exactly the answers
(tokens, path, float margins) of its reference run on the quiet server.

CI runs a small number of examples per property (profile "ci"); for a long run:
    EDGESPEC_FUZZ_PROFILE=long .venv/bin/pytest tests/test_fuzz_protocol.py
"""
from __future__ import annotations

import os
import random
import socket
import time

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from edgespec.common import wire
from edgespec.v1 import edgespec_pb2 as pb
from fuzz_helpers import Witness, answer, check_verified, settled, sync_outcome, verify_outcome
from grpc_helpers import RawStream, ServerProcess

TOKEN = "fuzz-token-0123456789"
VOCAB = 49152
MAX_NODES, MAX_DEPTH, N_CTX = 16, 8, 256

_COMMON = dict(deadline=None, derandomize=False, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                      HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("edgespec-fuzz-ci", max_examples=int(os.environ.get("EDGESPEC_FUZZ_EXAMPLES", 25)),
                          phases=[Phase.explicit, Phase.generate, Phase.shrink], **_COMMON)
settings.register_profile("edgespec-fuzz-long", max_examples=int(os.environ.get("EDGESPEC_FUZZ_EXAMPLES", 2000)),
                          **_COMMON)
FUZZ = settings(settings.get_profile(f"edgespec-fuzz-{os.environ.get('EDGESPEC_FUZZ_PROFILE', 'ci')}"))

pytestmark = pytest.mark.timeout(1800)
OK_CODES = {"verified", "resync", "synced", "opened"}


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smol_path):
    """Small limits (cheap valid trees, easy to exceed); no prefix cache, so that a freed slot is
    gone (no retained KV state) and the witness always starts from a fresh slot."""
    srv = ServerProcess(smol_path, "--n-ctx", str(N_CTX), "--max-sessions", "4", "--max-streams", "16",
                        "--max-nodes", str(MAX_NODES), "--max-depth", str(MAX_DEPTH), "--no-prefix-cache",
                        token=TOKEN)
    yield srv
    assert srv.alive, "the verifier died:\n" + "".join(srv.stderr)[-4000:]
    assert srv.stop() == 0, "".join(srv.stderr)[-4000:]


@pytest.fixture(scope="module")
def info(server):
    return server.info()


@pytest.fixture(scope="module")
def prompt(smol_model):
    return smol_model.chat_tokens([{"role": "user", "content": "Name a colour."}])


@pytest.fixture(scope="module")
def witness(server, info, prompt):
    w = Witness(server, info.tokenizer_hash, prompt, steps=16)
    w.record()
    yield w
    w.close()
    assert w.done > 0


@pytest.fixture
def fresh(server, witness):
    """After the test: nothing leaked (only the witness's stream and KV slot remain), the server
    is alive and the witness still gets its reference answers."""
    yield
    witness.step()
    assert server.alive, "".join(server.stderr)[-4000:]
    info = settled(server, open_streams=1, live_sessions=1)
    assert (info.open_streams, info.live_sessions, info.retained_slots) == (1, 1, 0), info


def after_example(server: ServerProcess, witness: Witness) -> None:
    """Per example: the witness steps (bit-for-bit), and every fuzz stream is gone with its slot."""
    witness.step()
    info = settled(server, open_streams=1, live_sessions=1)
    assert (info.open_streams, info.live_sessions) == (1, 1), f"leaked a stream or KV slot: {info}"


def opened_stream(server: ServerProcess, info: pb.InfoReply, prompt: list[int] | None = None):
    ch = server.channel()
    s = RawStream(ch)
    assert answer(s.ask(wire.open_message("test", info.tokenizer_hash))) == "opened"
    if prompt is not None:
        assert answer(s.ask(wire.sync_message(prompt))) == "synced"
    return ch, s


# -- strategies -------------------------------------------------------------------------------
I32 = st.integers(-2**31, 2**31 - 1)
TOKEN_ID = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 50), st.sampled_from([-1, VOCAB, VOCAB + 1, 2**31 - 1, -2**31]),
                     I32)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-320, 1e308, -0.0, 5e-324, 1.0]),
                   st.floats(0.01, 2.0))


def _maybe_truncate(draw, data: bytes) -> bytes:  # noqa: ANN001
    how = draw(st.sampled_from(["keep"] * 8 + ["cut", "extra"]))
    if how == "cut" and data:
        return data[:-draw(st.integers(1, min(3, len(data))))]
    if how == "extra":
        return data + draw(st.binary(min_size=1, max_size=3))
    return data


@st.composite
def trees(draw, root: int) -> pb.TokenTree:  # noqa: ANN001
    shape = draw(st.sampled_from(["small"] * 6 + ["chain", "wide", "huge"]))
    n = {"small": lambda: draw(st.integers(1, 12)), "chain": lambda: draw(st.integers(2, 40)),
         "wide": lambda: draw(st.integers(2, 40)), "huge": lambda: draw(st.integers(MAX_NODES + 1, 2000))}[shape]()
    tokens = [root if draw(st.integers(0, 9)) else draw(TOKEN_ID)]
    parents = [-1 if draw(st.integers(0, 19)) else draw(I32)]
    for i in range(1, n):
        mode = draw(st.sampled_from(["ok"] * 12 + ["neg", "self", "forward", "any"]))
        if mode == "ok":
            p = {"chain": i - 1, "wide": 0}.get(shape, None)
            p = draw(st.integers(0, i - 1)) if p is None else p
        else:
            p = {"neg": -1, "self": i, "forward": draw(st.integers(i + 1, n + 5)), "any": draw(I32)}[mode]
        parents.append(p)
        tokens.append(draw(st.integers(1, 999)) if draw(st.integers(0, 5)) else draw(TOKEN_ID))
    if n > 2 and draw(st.integers(0, 4)) == 0:   # a duplicate sibling
        kids = [i for i in range(1, n) if parents[i] == parents[n - 1] and i != n - 1]
        if kids:
            tokens[n - 1] = tokens[kids[0]]
    msg = pb.TokenTree(tokens=_maybe_truncate(draw, wire.pack_i32(tokens)),
                       parents=_maybe_truncate(draw, wire.pack_i32(parents)))
    k = draw(st.sampled_from([0] * 4 + [1, 2, 3, 4, 65]))
    if k:
        rows_mode = draw(st.sampled_from(["parents", "parents", "all", "random", "unsorted"]))
        inner = sorted({p for p in parents[1:] if 0 <= p < n})
        rows = {"parents": inner, "all": None, "random": sorted(set(draw(st.lists(st.integers(-2, n + 2), max_size=5)))),
                "unsorted": draw(st.lists(st.integers(0, max(0, n - 1)), min_size=2, max_size=4))}[rows_mode]
        n_rows = n if rows is None else len(rows)
        q_tokens, q_weights = [], []
        for r in range(n_rows):
            node = r if rows is None else rows[r]
            kids = [tokens[i] for i in range(1, n) if parents[i] == node]
            row = (kids + draw(st.lists(TOKEN_ID, max_size=k)))[:k] if draw(st.integers(0, 3)) else draw(
                st.lists(TOKEN_ID, min_size=k, max_size=k))
            row += [-1] * (k - len(row))
            q_tokens += row
            q_weights += draw(st.lists(st.one_of(st.integers(1, 65535), st.just(0), st.just(65535)),
                                       min_size=k, max_size=k))
        msg.k = k
        if rows is not None:
            msg.q_rows = wire.pack_i32(rows)
        msg.q_tokens = _maybe_truncate(draw, wire.pack_i32(q_tokens))
        msg.q_weights = _maybe_truncate(draw, wire.pack_u16(q_weights))
    return msg


@st.composite
def samplings(draw) -> pb.SamplingParams:  # noqa: ANN001
    if draw(st.integers(0, 2)) == 0:
        return pb.SamplingParams()
    return pb.SamplingParams(temperature=draw(FLOATS) if draw(st.booleans()) else draw(st.sampled_from([0.0, 0.7, 1.0])),
                             top_k=draw(st.one_of(st.just(0), st.integers(0, 2**32 - 1))),
                             top_p=draw(st.one_of(st.just(0.0), st.just(1.0), FLOATS)),
                             seed=draw(st.integers(0, 2**64 - 1)), rule=draw(st.sampled_from([0, 0, 1, 1, 2, 99])))


@st.composite
def verifies(draw, root: int, context_length: int) -> pb.Verify:  # noqa: ANN001
    return pb.Verify(step=draw(st.integers(0, 2**64 - 1)), sampling=draw(samplings()), tree=draw(trees(root)),
                     deadline_ms=draw(st.sampled_from([0, 0, 0, 60000, 2**32 - 1])),
                     context_length=draw(st.sampled_from([0, context_length, context_length, context_length + 1,
                                                          2**64 - 1])))


SYNC_BYTES = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40).map(wire.pack_i32),
    st.lists(TOKEN_ID, max_size=40).map(wire.pack_i32),
    st.integers(N_CTX - MAX_DEPTH - 3, N_CTX + 3).map(lambda n: wire.pack_i32([7] * n)),
    st.binary(max_size=64),
)


# -- properties -------------------------------------------------------------------------------
@FUZZ
@given(data=st.data())
def test_fuzzed_verify_gets_its_status(server, info, prompt, witness, fresh, data):
    """Any Verify after Open + Sync: exactly the oracle's answer, a well-formed result when verified."""
    ch, s = opened_stream(server, info, prompt)
    try:
        msg = data.draw(verifies(prompt[-1], len(prompt)))
        want = verify_outcome(msg, prompt, info)
        reply = s.ask(pb.EdgeMessage(verify=msg), timeout_s=120)
        got = answer(reply)
        assert got == want, f"{got} != {want}: {getattr(reply, 'details', lambda: reply)()}"
        if got == "verified":
            check_verified(reply.verified, msg, info)
        if isinstance(reply, grpc.RpcError):
            assert reply.details(), "an error status without a message"
    finally:
        s.close()
        ch.close()
    after_example(server, witness)


@FUZZ
@given(data=st.data())
def test_fuzzed_sync_gets_its_status(server, info, witness, fresh, data):
    ch, s = opened_stream(server, info)
    try:
        raw = data.draw(SYNC_BYTES)
        want = sync_outcome(raw, info)
        reply = s.ask(pb.EdgeMessage(sync=pb.Sync(tokens=raw)), timeout_s=120)
        got = answer(reply)
        assert got == want, f"{got} != {want}: {getattr(reply, 'details', lambda: reply)()}"
        if got == "synced":   # the context is really held: a root-only step after it works
            tokens = wire.tokens_from_bytes(raw)
            reply = s.ask(wire.verify_message(wire.TokenTree.chain(tokens[-1], []), witness_greedy(), 0,
                                              context_length=len(tokens)), timeout_s=120)
            assert answer(reply) == "verified", reply
    finally:
        s.close()
        ch.close()
    after_example(server, witness)


def witness_greedy():  # noqa: ANN201
    from edgespec.common.sampling import SamplingParams
    return SamplingParams()


@FUZZ
@given(data=st.data())
def test_fuzzed_open_gets_its_status(server, info, witness, fresh, data):
    version = data.draw(st.sampled_from([1, 1, 0, 2, 2**32 - 1]))
    model = data.draw(st.sampled_from(["", "test", info.model_id, "zz-no-such-model", "zz" + "x" * 100000, "zz\x00\u2603"]))
    tok_hash = data.draw(st.sampled_from([info.tokenizer_hash, "", "0" * 64, info.tokenizer_hash.upper(),
                                          info.tokenizer_hash + "0", "\u00e9" * 64]))
    name = data.draw(st.text(max_size=300))
    if version != 1:
        want = "FAILED_PRECONDITION"
    elif model.startswith("zz"):
        want = "NOT_FOUND"
    elif tok_hash != info.tokenizer_hash:
        want = "FAILED_PRECONDITION"
    else:
        want = "opened"
    ch = server.channel()
    s = RawStream(ch)
    try:
        reply = s.ask(pb.EdgeMessage(open=pb.Open(protocol_version=version, model_id=model, tokenizer_hash=tok_hash,
                                                  client_name=name)))
        assert answer(reply) == want, reply
    finally:
        s.close()
        ch.close()
    after_example(server, witness)


# messages of a conversation, valid or not, in any order
MESSAGES = st.lists(st.sampled_from(["open", "open-bad", "sync", "sync-bad", "verify", "verify-stale", "verify-resync",
                                     "empty"]), min_size=1, max_size=7)


@FUZZ
@given(kinds=MESSAGES)
def test_messages_in_any_order(server, info, prompt, witness, fresh, kinds):
    """A state machine oracle: FAILED_PRECONDITION out of order, the first error ends the stream."""
    ch = server.channel()
    s = RawStream(ch)
    opened = synced = False
    committed: list[int] = []
    try:
        for i, kind in enumerate(kinds):
            if kind.startswith("open"):
                msg = wire.open_message("test", info.tokenizer_hash if kind == "open" else "bad")
                want = "FAILED_PRECONDITION" if opened or kind == "open-bad" else "opened"
            elif kind.startswith("sync"):
                tokens = prompt[: 5 + i] if kind == "sync" else [VOCAB + i]
                msg = wire.sync_message(tokens)
                want = ("FAILED_PRECONDITION" if not opened else
                        "synced" if kind == "sync" else "INVALID_ARGUMENT")
            elif kind.startswith("verify"):
                root = committed[-1] if committed else prompt[-1]
                if kind == "verify-stale":
                    root = (root + 1) % VOCAB
                length = len(committed) + (1 if kind == "verify-resync" else 0)
                msg = wire.verify_message(wire.TokenTree.chain(root, [root % 500 + 1]), witness_greedy(), i,
                                          context_length=length)
                want = ("FAILED_PRECONDITION" if not (opened and synced) else
                        "resync" if kind == "verify-resync" else
                        "INVALID_ARGUMENT" if kind == "verify-stale" else "verified")
            else:
                msg, want = pb.EdgeMessage(), "INVALID_ARGUMENT"
            reply = s.ask(msg, timeout_s=120)
            got = answer(reply)
            assert got == want, (kinds[: i + 1], got, want, reply)
            if got not in OK_CODES:
                assert reply.details(), "an error status without a message"
                break
            if got == "opened":
                opened = True
            elif got == "synced":
                synced, committed = True, list(tokens)
            elif got == "verified":
                committed += wire.tokens_from_bytes(reply.verified.tokens)
    finally:
        s.close()
        ch.close()
    after_example(server, witness)


@FUZZ
@given(payloads=st.lists(st.binary(max_size=200), min_size=1, max_size=4))
def test_undecodable_messages(server, witness, fresh, payloads):
    """Raw bytes as Session messages (protobuf that does not decode, or decodes to nonsense)."""
    ch = server.channel()
    call = ch.stream_stream("/edgespec.v1.Verifier/Session", request_serializer=lambda b: b,
                            response_deserializer=lambda b: b)
    try:
        replies = call(iter(payloads), timeout=60)
        try:
            for _ in replies:
                pass
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), (
                err.code(), err.details())
            assert err.details()
    finally:
        ch.close()
    after_example(server, witness)


@FUZZ
@given(upto=st.integers(0, 3), delay_ms=st.integers(0, 300), how=st.sampled_from(["cancel", "close-channel", "half-close"]))
def test_streams_cut_mid_request(server, info, prompt, witness, fresh, upto, delay_ms, how):
    """A stream cut at any point (before/while a request runs): no stream or KV slot is left behind."""
    ch = server.channel()
    s = RawStream(ch)
    msgs = [wire.open_message("test", info.tokenizer_hash), wire.sync_message(prompt),
            wire.verify_message(wire.TokenTree(tokens=[prompt[-1], *range(10, 10 + MAX_NODES - 1)],
                                               parents=[-1] + [0] * (MAX_NODES - 1)), witness_greedy(), 0)]
    for m in msgs[:upto]:
        s._out.put(m)
    time.sleep(delay_ms / 1000)
    if how == "cancel":
        s.call.cancel()
    elif how == "half-close":
        s.close()
    ch.close()
    after_example(server, witness)


# -- oversized messages and socket garbage --------------------------------------------------
@pytest.mark.parametrize("what", ["sync-5MB", "tree-5MB", "tree-3MB", "open-3MB"])
def test_oversized_messages(server, info, prompt, witness, fresh, what):
    ch, s = opened_stream(server, info, prompt if what.startswith("tree") else None)
    big = {"sync-5MB": lambda: pb.EdgeMessage(sync=pb.Sync(tokens=b"\x01\x00\x00\x00" * 1_300_000)),
           "tree-5MB": lambda: pb.EdgeMessage(verify=pb.Verify(tree=pb.TokenTree(
               tokens=b"\x01\x00\x00\x00" * 650_000, parents=b"\x00\x00\x00\x00" * 650_000))),
           "tree-3MB": lambda: pb.EdgeMessage(verify=pb.Verify(tree=pb.TokenTree(
               tokens=b"\x01\x00\x00\x00" * 390_000, parents=b"\x00\x00\x00\x00" * 390_000))),
           "open-3MB": lambda: pb.EdgeMessage(open=pb.Open(protocol_version=1, model_id="x" * 3_000_000))}[what]
    try:
        reply = s.ask(big(), timeout_s=120)
        want = "FAILED_PRECONDITION" if what == "open-3MB" else "RESOURCE_EXHAUSTED"  # (open: a second Open)
        assert answer(reply) == want, reply
    finally:
        s.close()
        ch.close()
    after_example(server, witness)


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@FUZZ
@given(kind=st.sampled_from(["random", "preface+random", "half-preface", "http1", "silent", "frames"]),
       garbage=st.binary(min_size=0, max_size=4096))
def test_socket_garbage(server, witness, fresh, kind, garbage):
    """Bytes that are not HTTP/2 (or broken HTTP/2 frames) on the server's port."""
    payload = {"random": garbage, "preface+random": PREFACE + garbage, "half-preface": PREFACE[:11],
               "http1": b"GET /edgespec.v1.Verifier/Info HTTP/1.1\r\nHost: x\r\n\r\n" + garbage, "silent": b"",
               # a SETTINGS frame, then frames of random type/flags/stream with a random payload
               "frames": PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + bytes(
                   [0, (len(garbage) >> 8) & 0xFF, len(garbage) & 0xFF, garbage[0] % 10 if garbage else 1,
                    0xFF, 0, 0, 0, 1]) + garbage}[kind]
    with socket.create_connection((server.address.rsplit(":", 1)[0], server.port), timeout=10) as sock:
        sock.sendall(payload)
        sock.settimeout(0.3)
        try:
            sock.recv(65536)
        except (socket.timeout, ConnectionError):
            pass
    after_example(server, witness)


def test_many_garbage_connections_at_once(server, witness, fresh):
    """A burst of connections that send garbage and hang around, then vanish."""
    rng = random.Random(7)
    socks = []
    for i in range(50):
        sock = socket.create_connection((server.address.rsplit(":", 1)[0], server.port), timeout=10)
        sock.sendall(PREFACE[: rng.randint(0, len(PREFACE))] + rng.randbytes(rng.randint(0, 64)))
        socks.append(sock)
        if i % 10 == 0:
            witness.step()
    for sock in socks:
        sock.close()
    after_example(server, witness)
