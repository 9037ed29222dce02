"""Abusive clients against a real verifier with per-client limits, while a well-behaved session runs.

The server listens on both loopbacks (`--host ::`): the good session connects over IPv6 (::1), the
abusers over IPv4 (127.0.0.1), so they are two clients for the per-client limits. Each abuser
must be refused with a clear status (RESOURCE_EXHAUSTED for the stream and rate limits,
UNAUTHENTICATED for a wrong or missing token, FAILED_PRECONDITION for a stream that claims another
session), and the good session's answers stay bit-for-bit those of its reference run. The speed of
the good session before and during the abuse is measured by tools/bench_abuse.py (a benchmark,
not a test).
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from edgespec.common import wire
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.v1 import edgespec_pb2 as pb
from fuzz_helpers import Witness, answer, settled
from grpc_helpers import AuthInterceptor, RawStream, ServerProcess

TOKEN = "abuse-token-0123456789"
PER_CLIENT, RATE = 3, 25

pytestmark = pytest.mark.timeout(900)


class DualStackServer(ServerProcess):
    """A ServerProcess on `::`: `channel()` (the good client) goes over ::1."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.address = f"[::1]:{self.port}"


def abuser_channel(srv: ServerProcess, token: str | None = TOKEN) -> grpc.Channel:
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    return grpc.intercept_channel(ch, AuthInterceptor(token)) if token else ch


@pytest.fixture(scope="module")
def server(smol_path):
    srv = DualStackServer(smol_path, "--host", "::", "--n-ctx", "512", "--max-sessions", "4", "--max-streams", "16",
                          "--max-streams-per-client", str(PER_CLIENT), "--client-rate", str(RATE),
                          "--no-prefix-cache", token=TOKEN)
    yield srv
    assert srv.alive, "".join(srv.stderr)[-4000:]
    assert srv.stop() == 0, "".join(srv.stderr)[-4000:]


@pytest.fixture(scope="module")
def info(server):
    return server.info()


@pytest.fixture(scope="module")
def witness(server, info, smol_model):
    prompt = smol_model.chat_tokens([{"role": "user", "content": "Say something about rivers."}])
    w = Witness(server, info.tokenizer_hash, prompt, steps=12)
    w.record()
    yield w
    w.close()


def open_abuser(srv: ServerProcess, fingerprint: str, token: str | None = TOKEN, **open_kw):
    ch = abuser_channel(srv, token)
    s = RawStream(ch)
    return ch, s, s.ask(wire.open_message("test", fingerprint, **open_kw))


def test_stream_hog_is_refused_per_client(server, info, witness):
    """Streams up to the per-client limit, then RESOURCE_EXHAUSTED; the hog idles on them while
    the good client (another address) still opens streams and gets its exact answers. Info tells a
    client both limits before it hits them."""
    assert (info.max_streams_per_client, info.client_rate) == (PER_CLIENT, RATE)
    held = []
    try:
        for _ in range(PER_CLIENT):
            ch, s, reply = open_abuser(server, info.tokenizer_hash)
            assert answer(reply) == "opened", reply
            held.append((ch, s))
        ch, s, reply = open_abuser(server, info.tokenizer_hash)
        held.append((ch, s))
        assert answer(reply) == "RESOURCE_EXHAUSTED", reply
        assert "per-client limit" in reply.details()
        for _ in range(6):            # the good client is unaffected while the hog idles
            witness.step()
        assert server.info().open_streams == PER_CLIENT + 1
    finally:
        for ch, s in held:
            s.close()
            ch.close()
    info = settled(server, open_streams=1)
    assert info.open_streams == 1, info


def test_flooder_is_throttled(server, info, witness, smol_model):
    """As fast as it can, on every stream it may open: refused past the client's rate with a
    RESOURCE_EXHAUSTED naming the limit; meanwhile every step of the good session is exact."""
    prompt = witness.prompt
    statuses: list[str] = []
    sent = [0]
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            ch, s, reply = open_abuser(server, info.tokenizer_hash)
            try:
                if answer(reply) != "opened":
                    statuses.append(answer(reply))
                    continue
                reply = s.ask(wire.sync_message(prompt))
                while answer(reply) in ("synced", "resync") and not stop.is_set():
                    sent[0] += 1   # cheap requests (a stale context length: answered ResyncRequired at once)
                    reply = s.ask(wire.verify_message(TokenTree.chain(prompt[-1], [5, 6, 7]), SamplingParams(), 0,
                                                      context_length=len(prompt) + 1))
                if stop.is_set() and answer(reply) in ("synced", "resync"):
                    break
                statuses.append(answer(reply) + ": " + (reply.details() if isinstance(reply, grpc.RpcError) else ""))
            finally:
                s.close()
                ch.close()

    threads = [threading.Thread(target=flood) for _ in range(PER_CLIENT)]
    for t in threads:
        t.start()
    try:
        started = time.monotonic()
        steps = 0   # at least 8 exact steps, and until the flooder has been refused (slow under load)
        while (steps < 8 or not statuses) and time.monotonic() - started < 300:
            witness.step()
            steps += 1
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert statuses, "the flooder was never refused"
    refused = [x for x in statuses if x.startswith("RESOURCE_EXHAUSTED")]
    assert refused and all("rate limit" in x or "per-client limit" in x for x in refused), statuses[:5]
    assert all(x.startswith("RESOURCE_EXHAUSTED") for x in statuses), statuses[:5]
    # the flooder got at most about its rate (plus one burst) through
    assert sent[0] <= RATE * (elapsed + 5) + RATE, (sent[0], elapsed)
    settled(server, open_streams=1)


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", ""])
def test_wrong_or_missing_token(server, info, witness, token):
    ch = abuser_channel(server, token or None)
    try:
        s = RawStream(ch)
        reply = s.ask(wire.open_message("test", info.tokenizer_hash))
        assert answer(reply) == "UNAUTHENTICATED", reply
        err = pb_grpc_info(ch)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        ch.close()
    witness.step()


def pb_grpc_info(ch: grpc.Channel) -> grpc.RpcError:
    from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
    try:
        pb_grpc.VerifierStub(ch).Info(pb.InfoRequest(), timeout=10)
    except grpc.RpcError as err:
        return err
    raise AssertionError("Info answered without a valid token")


def test_another_sessions_id_gives_nothing(server, info, witness):
    """A stream that names the witness's session id (in its metadata and client name) is a new,
    empty session: it cannot verify against the witness's context, and the witness is unaffected."""
    witness.step()
    ch0 = server.channel()
    s0 = RawStream(ch0)
    victim_id = s0.ask(wire.open_message("test", info.tokenizer_hash)).opened.session_id
    assert answer(s0.ask(wire.sync_message(witness.prompt))) == "synced"
    ch = abuser_channel(server)
    try:
        s = RawStream(ch, metadata=[("edgespec-session-id", victim_id)])
        reply = s.ask(wire.open_message("test", info.tokenizer_hash, client_name=victim_id))
        assert answer(reply) == "opened" and reply.opened.session_id != victim_id, reply
        reply = s.ask(wire.verify_message(TokenTree.chain(witness.prompt[-1], []), SamplingParams(), 0,
                                          context_length=len(witness.prompt)))
        assert answer(reply) == "FAILED_PRECONDITION" and "before Sync" in reply.details(), reply
    finally:
        ch.close()
    # the victim's own session still verifies against its context
    reply = s0.ask(wire.verify_message(TokenTree.chain(witness.prompt[-1], []), SamplingParams(), 0,
                                       context_length=len(witness.prompt)))
    assert answer(reply) == "verified", reply
    s0.close()
    ch0.close()
    witness.step()
    settled(server, open_streams=1)
