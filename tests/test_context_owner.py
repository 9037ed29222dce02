"""The caller owns the committed context; verifiers are told it on every call and keep no copy
(edgespec/edge/link.py, edgespec/runtime/tree_verifier.py).

Two verifiers take turns on one context, as the failover's two sides do: each must bring itself
to the context it is given (a Sync for the link, a KV prefill for the local target) and answer
exactly what a verifier that saw every step answers. Real parts: a verifier service process,
gRPC on loopback, SmolLM2.
"""
from __future__ import annotations

import pytest

from edgespec.common.tree import TokenTree
from edgespec.edge.link import Link
from edgespec.runtime.llama import ContextConfig
from edgespec.runtime.tree_verifier import LlamaTreeVerifier, LocalVerifier
from failover_helpers import N_CTX, PROMPT
from grpc_helpers import ServerProcess
from lossless import GREEDY


@pytest.fixture(scope="module")
def server(smol_path):
    srv = ServerProcess(smol_path, "--n-ctx", str(N_CTX))
    yield srv
    srv.stop()


def next_token(verifier, context: list[int], step: int) -> list[int]:
    return verifier.verify(context, TokenTree.chain(context[-1], []), GREEDY, step).tokens


def test_two_verifiers_take_turns_on_one_context(server, smol_model):
    prompt = smol_model.chat_tokens([{"role": "user", "content": PROMPT}])
    link = Link(server.address, tokenizer_hash=smol_model.tokenizer_fingerprint(), timeout_s=30)
    local = LocalVerifier(smol_model, ContextConfig(n_ctx=N_CTX))
    reference = LlamaTreeVerifier(smol_model, ContextConfig(n_ctx=N_CTX))  # owns its context, sees every step
    try:
        context = list(prompt)
        link.sync(context)
        local.sync(context)
        reference.sync(context)
        sides = [link, link, local, local, link, local, link, link]
        syncs = [link.stats.syncs]
        for step, side in enumerate(sides):
            tokens = next_token(side, context, step)
            assert tokens == reference.verify(TokenTree.chain(reference.committed[-1], []), GREEDY, step).tokens
            context.extend(tokens)
            syncs.append(link.stats.syncs)
        # the link synced exactly when the server was behind: after each run of local steps
        assert [b - a for a, b in zip(syncs, syncs[1:])] == [0, 0, 0, 0, 1, 0, 1, 0]
        assert context == reference.committed and link.server_len == len(context)

        # another conversation whose context has the same length as the one the server holds is
        # never taken for it: it is another list, so the link syncs it
        other = context[:-1] + [(context[-1] + 1) % smol_model.n_vocab]
        before = link.stats.syncs
        fresh = LocalVerifier(smol_model, ContextConfig(n_ctx=N_CTX))
        try:
            assert next_token(link, other, 99) == next_token(fresh, other, 99)
        finally:
            fresh.close()
        assert link.stats.syncs == before + 1
    finally:
        link.close()
        local.close()
        reference.close()
