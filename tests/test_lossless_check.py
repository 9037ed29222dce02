"""The divergence rule itself (tests/lossless.py) must reject a wrong acceptance, also at a near-tie.

The retired rule let any divergence pass where the target's top-2 margin was below 0.5 logits, so
a verifier that emitted the runner-up at such a spot passed. Here a real llama.cpp verifier is
wrapped so that, at one step, it emits the runner-up of its own logits at the first position where
the target's margin is below that old allowance; the speculative run goes through the whole edge
pipeline (drafting, pipelining, commit), and the checks every test uses must reject it.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import pytest

import logit_record
from edgespec import EdgeSession, TreeShape
from edgespec.common.acceptance import VerifyResult
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.runtime.llama import ContextConfig, LlamaModel
from edgespec.runtime.tree_verifier import LocalVerifier
from failover_helpers import assert_targets_choices
from lossless import assert_lossless, first_divergence, model_name, spec_tokens, target_only_greedy

PROMPT = "Write a Python function that adds two numbers."
N_TOKENS = 48
RETIRED_ALLOWANCE = 0.5   # the old fixed near-tie margin, only to show what it would have let through
SHAPE = TreeShape(budget=16)


class FlippingVerifier:
    """A llama.cpp verifier (the decoder's protocol: it is told the committed context on every
    call) that emits the runner-up of its own logits at one absolute position (context length
    `flip_at`) and returns only the tokens up to it, as a buggy acceptance would."""

    def __init__(self, model: LlamaModel, config: ContextConfig, flip_at: int) -> None:
        self.inner = LocalVerifier(model, config)
        self.flip_at = flip_at
        self.flipped: tuple[int, int] | None = None   # (verifier's argmax, emitted runner-up)

    def sync(self, context: Sequence[int]) -> None:
        self.inner.sync(context)

    def verify(self, context: Sequence[int], tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        result = self.inner.verify(context, tree, sampling, step)
        j = self.flip_at - len(context)
        if self.flipped is not None or not 0 <= j < len(result.tokens):
            return result
        record, node = logit_record.latest([*context, *result.tokens[:j]], here=True)
        row = record.row(node)
        self.flipped = (row.argmax, int(row.ids[1]))
        return dataclasses.replace(result, path=result.path[:j], tokens=[*result.tokens[:j], int(row.ids[1])],
                                   margins=result.margins[:j + 1])

    def close(self) -> None:
        self.inner.close()


def test_a_wrong_acceptance_at_a_near_tie_is_rejected(smol_path, smol_model):
    prompt = smol_model.chat_tokens([{"role": "user", "content": PROMPT}])
    ref = target_only_greedy(smol_model, prompt, N_TOKENS)
    p = next(i for i, m in enumerate(ref.margins) if m < RETIRED_ALLOWANCE)
    config = ContextConfig(n_ctx=1024, max_tree_nodes=SHAPE.budget + 1)
    flipping = FlippingVerifier(smol_model, config, flip_at=len(prompt) + p)
    with EdgeSession(smol_path, smol_path, verifier=flipping, tree=SHAPE, n_ctx=1024) as session:
        candidate = spec_tokens(session, prompt, N_TOKENS)
    assert flipping.flipped == (ref.tokens[p], candidate[p]) and candidate[p] != ref.tokens[p]
    assert first_divergence(candidate, ref.tokens) == p
    print(f"flipped token {p}: {ref.tokens[p]} -> {candidate[p]} where the target's margin is {ref.margins[p]:.3f}")
    assert ref.margins[p] < RETIRED_ALLOWANCE   # the old rule would have accepted this output
    with pytest.raises(AssertionError, match="wrong acceptance"):
        assert_lossless(candidate, ref, "flipped")
    with pytest.raises(AssertionError, match="wrong acceptance"):   # the teacher-forced check of every token
        assert_targets_choices(smol_model, prompt, candidate, "flipped")


def test_the_same_run_without_the_flip_passes(smol_path, smol_model):
    """Control: the wrapper with no flip position gives output the rule accepts."""
    prompt = smol_model.chat_tokens([{"role": "user", "content": PROMPT}])
    ref = target_only_greedy(smol_model, prompt, N_TOKENS)
    honest = FlippingVerifier(smol_model, ContextConfig(n_ctx=1024, max_tree_nodes=SHAPE.budget + 1), flip_at=-1)
    with EdgeSession(smol_path, smol_path, verifier=honest, tree=SHAPE, n_ctx=1024) as session:
        candidate = spec_tokens(session, prompt, N_TOKENS)
    assert honest.flipped is None
    assert_lossless(candidate, ref, "honest")
    assert_targets_choices(smol_model, prompt, candidate, "honest")


def test_a_verifier_child_records_the_logits_it_decided_with(smol_path, smol_model):
    """Divergences over gRPC are explained with logits recorded in the verifier's own process
    (tests/logit_site): every token the bundled verifier emitted has a recorded row there, from that
    process, whose argmax is that token."""
    prompt = smol_model.chat_tokens([{"role": "user", "content": PROMPT}])
    with EdgeSession(smol_path, smol_path, tree=SHAPE, n_ctx=1024) as session:   # bundled verifier child
        out = [t for chunk in session.generate_tokens(prompt, 16, SamplingParams()) for t in chunk]
    assert len(out) == 16
    for i, token in enumerate(out):
        found = logit_record.latest(prompt + out[:i], model_name(smol_model), here=False)
        assert found is not None, f"no logits recorded by the verifier child for token {i}"
        record, node = found
        assert record.pid != os.getpid() and record.row(node).argmax == token, (i, record.describe(node))
