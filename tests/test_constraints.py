"""Constrained decoding (common/constraints.py): the same token mask in the draft and in the
verifier's acceptance keeps speculative output equal to constrained target-only output (greedy) and
exactly distributed as the masked target (sampled, both acceptance rules, chi-square through the
real Drafter/Decoder pipeline of tests/test_sampling_pipeline.py)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from edgespec.common import wire
from edgespec.common.constraints import TokenConstraint
from edgespec.common.errors import InvalidRequestError
from edgespec.common.sampling import AcceptanceRule, SamplingParams, probabilities
from edgespec.edge.decoder import Decoder, SessionStats
from edgespec.edge.drafting import Drafter, TreeShape
from tests.test_sampling_pipeline import (
    EMITTED,
    PROMPT,
    TARGET_TABLE,
    VOCAB,
    TableDraftContext,
    TableModel,
    TableVerifier,
    chi2_pvalue,
    logits_after,
)

# Token 0 never; token 1 never right after a 2 (the first position sees the prompt's last token).
BANNED = TokenConstraint(((0,), (2, 1), (3, 3, 4)))


def test_mask_follows_the_context() -> None:
    assert BANNED.mask([5]) == [0]
    assert BANNED.mask([1, 2]) == [0, 1]
    assert BANNED.mask([3, 3]) == [0, 4] and BANNED.mask([2, 3]) == [0]
    logits = np.zeros(VOCAB, np.float32)
    masked = BANNED.apply(logits, [3, 3])
    assert np.isneginf(masked[[0, 4]]).all() and np.isfinite(np.delete(masked, [0, 4])).all()
    assert np.isfinite(logits).all()   # the input is left alone
    with pytest.raises(InvalidRequestError):
        TokenConstraint(((0,), (1,))).apply(np.zeros(2), [])
    with pytest.raises(InvalidRequestError):
        BANNED.validate(4)
    with pytest.raises(InvalidRequestError):
        TokenConstraint(((),))


def test_constraint_travels_on_the_wire() -> None:
    sampling = SamplingParams(temperature=0.7, seed=3, constraint=BANNED)
    back = wire.sampling_from_proto(wire.sampling_to_proto(sampling))
    assert back == sampling and back.constraint.banned == BANNED.banned
    plain = wire.sampling_from_proto(wire.sampling_to_proto(SamplingParams()))
    assert plain.constraint is None
    bad = wire.sampling_to_proto(sampling)
    bad.constraint.lengths = wire.pack_i32([1, 1])
    with pytest.raises(wire.WireFormatError):
        wire.sampling_from_proto(bad)


def test_from_phrases_bans_every_usual_tokenisation(smol_model) -> None:
    tokenize = lambda text: smol_model.tokenize(text, add_special=False, parse_special=False)  # noqa: E731
    constraint = TokenConstraint.from_phrases(["best in the world"], tokenize)
    for text in ("best in the world", " best in the world", "Best in the world", " Best in the world"):
        assert tuple(tokenize(text)) in constraint.banned
    # Whatever precedes it, the last token of the phrase is masked once the rest is there.
    ctx = tokenize("We are the") + tokenize(" best in the world")[:-1]
    assert tokenize(" best in the world")[-1] in constraint.mask(ctx)


def make_decoder(shape: TreeShape) -> Decoder:
    drafter = Drafter(TableModel(), context=TableDraftContext())  # type: ignore[arg-type]
    return Decoder(drafter, TableVerifier(), SessionStats(), shape, lambda t: False, pipelined=False)


def target_only_greedy(n: int, constraint: TokenConstraint | None) -> list[int]:
    ctx = list(PROMPT)
    for _ in range(n):
        logits = logits_after(TARGET_TABLE, ctx)
        ctx.append(int(np.argmax(constraint.apply(logits, ctx) if constraint else logits)))
    return ctx[len(PROMPT):]


SHAPES = [TreeShape.chain(3), TreeShape(budget=6, max_depth=3, branching=2, width=2),
          TreeShape(budget=16, max_depth=4, branching=4, width=4)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label)
def test_greedy_constrained_speculation_equals_constrained_target_only(shape: TreeShape) -> None:
    n = 40
    free = target_only_greedy(n, None)
    # A constraint that bites: ban the target's own favourite pair in its unconstrained output.
    pair = next((a, b) for a, b in zip(free, free[1:]))
    constraint = TokenConstraint((pair,))
    expected = target_only_greedy(n, constraint)
    assert expected != free
    decoder = make_decoder(shape)
    try:
        out = [t for chunk in decoder.run(list(PROMPT), n, SamplingParams(constraint=constraint)) for t in chunk][:n]
    finally:
        decoder.close()
    assert out == expected
    assert not any(tuple(out[i:i + 2]) == pair for i in range(n - 1))
    assert decoder.stats.accepted > 0


def masked_exact_distribution(sampling: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first EMITTED tokens) sampling target-only from the masked target table."""
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=EMITTED):
        ctx, prob = list(PROMPT), 1.0
        for t in seq:
            prob *= probabilities(sampling.constraint.apply(logits_after(TARGET_TABLE, ctx), ctx), sampling)[t]
            ctx.append(t)
        out[seq] = prob
    return out


RUNS = 2500


@pytest.mark.parametrize("rule", list(AcceptanceRule), ids=lambda r: r.value)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: s.label)
def test_sampled_constrained_speculation_has_the_masked_target_distribution(shape: TreeShape, rule) -> None:
    decoder = make_decoder(shape)
    counts: dict[tuple[int, ...], int] = {}
    try:
        for seed in range(RUNS):
            s = SamplingParams(temperature=1.0, seed=20_000 + seed, rule=rule, constraint=BANNED)
            out = tuple([t for chunk in decoder.run(list(PROMPT), EMITTED, s) for t in chunk][:EMITTED])
            counts[out] = counts.get(out, 0) + 1
    finally:
        decoder.close()
    exact = masked_exact_distribution(SamplingParams(temperature=1.0, constraint=BANNED))
    assert all(0 not in seq and seq != (2, 1) for seq in counts)   # never a banned token or pair
    assert chi2_pvalue(counts, exact) > 1e-4
    assert decoder.stats.accepted > 0


def test_unmasked_verifier_fails_the_same_test() -> None:
    """Power: a verifier that forgets the mask (the draft still applies it) emits banned tokens."""
    decoder = Decoder(Drafter(TableModel(), context=TableDraftContext()),  # type: ignore[arg-type]
                      _UnmaskedVerifier(), SessionStats(), SHAPES[1], lambda t: False, pipelined=False)
    counts: dict[tuple[int, ...], int] = {}
    try:
        for seed in range(400):
            s = SamplingParams(temperature=1.0, seed=30_000 + seed, constraint=BANNED)
            out = tuple([t for chunk in decoder.run(list(PROMPT), EMITTED, s) for t in chunk][:EMITTED])
            counts[out] = counts.get(out, 0) + 1
    finally:
        decoder.close()
    exact = masked_exact_distribution(SamplingParams(temperature=1.0, constraint=BANNED))
    with pytest.raises(AssertionError, match="probability 0"):
        chi2_pvalue(counts, exact)


class _UnmaskedVerifier(TableVerifier):
    def verify(self, context, tree, sampling, step):  # noqa: ANN001, ANN201
        import dataclasses
        return super().verify(context, tree, dataclasses.replace(sampling, constraint=None), step)


# -- the real thing: SmolLM2 behind a verifier process, the constraint carried by the proto -------
def test_banned_phrase_through_a_real_verifier(smol_path, smol_model) -> None:
    """The verifier process applies the mask the edge sent: remote constrained output equals local
    constrained output (same tree shape), follows the free output up to the banned token, and
    never completes a banned sequence."""
    from tests.grpc_helpers import ServerProcess
    from edgespec.edge.session import EdgeSession

    def tokens(session: EdgeSession, sampling: SamplingParams) -> list[int]:
        return [t for chunk in session.generate_tokens(prompt, 40, sampling) for t in chunk][:40]

    tokenize = lambda text: smol_model.tokenize(text, add_special=False, parse_special=False)  # noqa: E731
    prompt = smol_model.chat_tokens([{"role": "user", "content": "Write three sentences about the sea."}])
    server = ServerProcess(smol_path, "--n-ctx", "1024", "--threads", "1", token="c")
    try:
        with EdgeSession(smol_path, smol_path, verifier=server.address, token="c", fallback=False, n_ctx=1024,
                         tree=TreeShape.chain(4), draft_threads=1) as remote, \
                EdgeSession(smol_path, smol_path, local=True, n_ctx=1024, tree=TreeShape.chain(4),
                            draft_threads=1, target_threads=1) as local:
            free = tokens(remote, SamplingParams())
            # A whole word the model wrote as one token, a few tokens in: ban it.
            i = next(i for i, t in enumerate(free) if i >= 3 and smol_model.detokenize([t]).startswith(" ")
                     and smol_model.detokenize([t]).strip().isalpha() and len(smol_model.detokenize([t]).strip()) >= 4)
            word = smol_model.detokenize([free[i]]).strip()
            constraint = TokenConstraint.from_phrases([word], tokenize)
            banned = SamplingParams(constraint=constraint)
            got, want = tokens(remote, banned), tokens(local, banned)
            text = remote.chat("Write three sentences about the sea.", max_tokens=40, banned_phrases=[word])
    finally:
        server.stop()
    assert got == want
    assert got[:i] == free[:i] and got[i] != free[i]
    for seq in constraint.banned:
        assert not any(tuple(got[j:j + len(seq)]) == seq for j in range(len(got))), word
    assert f" {word}" not in text
