"""Sampled decoding is exact end to end: drafting + selection + planner pruning + acceptance.

A rule proven for one node is not proven for the pipeline: which children a tree keeps, and how
many, can depend on the values the draft drew, and that alone biases the output (issue 8). So
the real `Drafter`, the real `Decoder` (its planner prunes trees; drafting ahead in pipelined
mode) and the real acceptance code run here over two small fixed "models": logit tables indexed
by the last two tokens, one for the draft and a different one for the target, behind the same
interfaces llama.cpp sits behind (`drafting.DraftContext`, the decoder's `Verifier`). Thousands of
seeded runs give the empirical distribution of the first tokens, compared by chi-square with the
exact target distribution, enumerated from the target table. A known-wrong pipeline (rejection
rule with value-based pruning, the code before this test) must fail the same test: the test has power.
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

from edgespec.common.acceptance import VerifyResult, accept_logits, check_tree
from edgespec.common.sampling import AcceptanceRule, SamplingParams, probabilities
from edgespec.common.tree import TokenTree
from edgespec.edge.decoder import Decoder, SessionStats
from edgespec.edge.drafting import Draft, Drafter, TreeShape
from edgespec.edge.planner import Planner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from chi2 import chi2_gof  # noqa: E402  (tools/chi2.py)

VOCAB = 6
EMITTED = 2           # compare the distribution of the first two emitted tokens
PROMPT = [0, 1]


def logit_table(seed: int, scale: float) -> np.ndarray:
    """logits[a, b] = next-token logits after the tokens (..., a, b)."""
    return np.random.default_rng(seed).normal(0.0, scale, size=(VOCAB, VOCAB, VOCAB))


def with_first_step(table: np.ndarray, probs: list[float]) -> np.ndarray:
    """The table with the first step after PROMPT set to `probs` over tokens 0, 1, 2 (others ~0)."""
    table = table.copy()
    table[PROMPT[-2], PROMPT[-1]] = np.log(np.array([*probs, 1e-9, 1e-9, 1e-9]))
    return table


# The first step is the reviewer's reproduction from issue 8 (draft q and target p over A, B, C;
# with the root's first drawn child expanded and a budget of 2 nodes the old value-based pruning
# emitted A with probability 0.604 instead of 0.543). A budget of 3 shows the bias more strongly.
DRAFT_TABLE = with_first_step(logit_table(11, 2.0), [0.314, 0.114, 0.571])
TARGET_TABLE = with_first_step(logit_table(12, 2.0), [0.543, 0.371, 0.086])


def logits_after(table: np.ndarray, tokens: list[int]) -> np.ndarray:
    return table[tokens[-2], tokens[-1]].astype(np.float32)


class TableDraftContext:
    """A draft 'KV cache': each sequence holds its token list; logits come from the table."""

    n_seq_max = 256

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}

    def sync(self, tokens: list[int]) -> np.ndarray:
        self.seqs = {0: list(tokens)}
        return logits_after(DRAFT_TABLE, self.seqs[0])

    def decode_frontier(self, tokens: list[int], parent_seqs: list[int], depth: int, first_seq: int) -> np.ndarray:
        rows = []
        for i, (token, parent) in enumerate(zip(tokens, parent_seqs)):
            self.seqs[first_seq + i] = self.seqs[parent] + [int(token)]
            rows.append(logits_after(DRAFT_TABLE, self.seqs[first_seq + i]))
        return np.stack(rows)

    def adopt_branch(self, seq: int, new_tokens: list[int]) -> None:
        self.seqs = {0: self.seqs[0] + list(new_tokens)}

    def drop_branches(self) -> None:
        self.seqs = {0: self.seqs[0]}

    def close(self) -> None:
        pass


class TableModel:
    def is_end_of_generation(self, token: int) -> bool:
        return False


class TableVerifier:
    """The target side: the same check/accept code every verifier backend runs, over the table
    (the context goes to acceptance too, for constrained sampling)."""

    def sync(self, context: list[int]) -> None:
        pass

    def verify(self, context: list[int], tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        context = list(context)
        check_tree(tree, context, VOCAB, max_nodes=256, max_depth=64, sampling=sampling)
        rows = np.stack([logits_after(TARGET_TABLE, context + tree.tokens[tree.path_to(n)].tolist())
                         for n in range(len(tree))])
        acc, margins = accept_logits(tree, sampling, step, rows.argmax(axis=1), rows.__getitem__, context)
        # Report the costs of a GPU verifier behind a 50 ms link (fixed cost per step, nearly free
        # nodes), so the planner chooses, and prunes, real trees rather than target-only steps.
        return VerifyResult(path=acc.path, tokens=[*tree.tokens[acc.path].tolist(), acc.next_token], margins=margins,
                            compute_s=0.002 + 1e-5 * len(tree), network_s=0.05, bytes_up=100 + 12 * len(tree))

    def close(self) -> None:
        pass


def exact_distribution(sampling: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first EMITTED tokens) under plain sampling from the target table."""
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=EMITTED):
        ctx, prob = list(PROMPT), 1.0
        for t in seq:
            prob *= probabilities(logits_after(TARGET_TABLE, ctx), sampling)[t]
            ctx.append(t)
        out[seq] = prob
    return out


def emitted_counts(decoder: Decoder, sampling: SamplingParams, runs: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(runs):
        s = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                           seed=10_000 + seed, rule=sampling.rule)
        out = [t for chunk in decoder.run(list(PROMPT), EMITTED, s) for t in chunk][:EMITTED]
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    return counts


def _chi2(observed: np.ndarray, expected: np.ndarray) -> float:
    impossible = expected == 0  # e.g. first tokens that top-k or a constraint rules out
    assert observed[impossible].sum() == 0, "emitted a token the target gives probability 0"
    return chi2_gof(observed, expected)[0]


def chi2_pvalue(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float]) -> float:
    """Bonferroni-combined p-value of two goodness-of-fit tests: the joint distribution of the
    emitted tokens, and the first token alone (sharper where a bias sits in the first step)."""
    runs = sum(counts.values())
    impossible = [seq for seq in counts if exact.get(seq, 0.0) == 0.0]
    assert not impossible, f"emitted sequences the target gives probability 0: {impossible}"
    cells = [seq for seq, p in exact.items() if p > 0]
    joint = _chi2(np.array([counts.get(seq, 0) for seq in cells], float), np.array([exact[seq] * runs for seq in cells]))
    first_observed, first_expected = np.zeros(VOCAB), np.zeros(VOCAB)
    for seq in cells:
        first_observed[seq[0]] += counts.get(seq, 0)
        first_expected[seq[0]] += exact[seq] * runs
    first = _chi2(first_observed, first_expected)
    return min(1.0, 2 * min(joint, first))


# The planner's own ladder, scaled down so that thousands of runs stay quick (same code paths), and
# branching from its first drafted rung up: every run here is a request of a few tokens, where the
# planner's per-request probe and climb start from the first drafted rung, and the test is about
# trees that the planner prunes.
SMALL_LADDER = (TreeShape.target_only(), TreeShape(budget=4, max_depth=2, branching=2, width=2),
                TreeShape(budget=6, max_depth=3, branching=2, width=2), TreeShape(budget=12, max_depth=4, branching=3, width=3))


def make_decoder(shape: TreeShape | None, pipelined: bool) -> Decoder:
    drafter = Drafter(TableModel(), context=TableDraftContext())  # type: ignore[arg-type]
    decoder = Decoder(drafter, TableVerifier(), SessionStats(), shape, lambda t: False, pipelined=pipelined)
    if decoder.planner is not None:
        decoder.planner = Planner(ladder=SMALL_LADDER, last_choice=1)
    return decoder


SHAPES = {
    "chain3": TreeShape.chain(3),
    "tree6-d3-b2": TreeShape(budget=6, max_depth=3, branching=2, width=2),
    "tree16-d4-b4": TreeShape(budget=16, max_depth=4, branching=4, width=4),
    "tree5-d2-b3": TreeShape(budget=5, max_depth=2, branching=3, width=3),
    "tree3-d2-b3-w1": TreeShape(budget=3, max_depth=2, branching=3, width=1),  # after the reproduction
}
SAMPLINGS = {"T0.7": (0.7, 0, 1.0), "T1.0": (1.0, 0, 1.0), "T1.0-topk4-topp0.9": (1.0, 4, 0.9)}
CASES = [("chain3", "T0.7"), ("tree3-d2-b3-w1", "T1.0"), ("tree6-d3-b2", "T1.0"), ("tree5-d2-b3", "T1.0-topk4-topp0.9"),
         ("tree16-d4-b4", "T0.7"), ("planner", "T1.0"), ("planner", "T1.0-topk4-topp0.9")]
RUNS = 2500


@pytest.mark.parametrize("rule", list(AcceptanceRule), ids=lambda r: r.value)
@pytest.mark.parametrize("shape,sampling", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_pipeline_output_has_the_target_distribution(shape, sampling, rule):
    temperature, top_k, top_p = SAMPLINGS[sampling]
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, rule=rule)
    decoder = make_decoder(None if shape == "planner" else SHAPES[shape], pipelined=shape == "planner")
    try:
        counts = emitted_counts(decoder, sampling, RUNS)
    finally:
        decoder.close()
    assert chi2_pvalue(counts, exact_distribution(sampling)) > 1e-4
    assert decoder.stats.accepted > 0  # the trees were used, not just the target's own tokens
    if shape == "planner":  # it chose real trees, not only target-only steps
        assert sum(n for label, n in decoder.stats.shapes.items() if label.startswith("tree")) > RUNS / 4


def test_value_based_pruning_fails_the_same_test(monkeypatch):
    """The pre-fix pipeline: rejection rule, but the tree is cut to its best nodes by drawn score.

    Whether a later sibling survives then depends on its own drawn value, and the output is biased.
    """
    real_pruned = Draft.pruned

    def best_by_value(self: Draft, n: int) -> Draft:
        self.prefix_groups = False  # rank every node by its own drawn score, as before the fix
        return real_pruned(self, n)

    monkeypatch.setattr(Draft, "pruned", best_by_value)
    sampling = SamplingParams(temperature=1.0, rule=AcceptanceRule.REJECTION)
    decoder = make_decoder(SHAPES["tree3-d2-b3-w1"], pipelined=False)
    try:
        counts = emitted_counts(decoder, sampling, 3000)
    finally:
        decoder.close()
    assert chi2_pvalue(counts, exact_distribution(sampling)) < 1e-4


def test_rejection_trees_carry_q_and_target_sample_trees_do_not():
    """The rule decides the wire payload: q rows only where the verifier reads them."""
    drafter = Drafter(TableModel(), context=TableDraftContext())  # type: ignore[arg-type]
    shape = TreeShape(budget=6, max_depth=3, branching=2, width=2)
    rejection = drafter.grow(list(PROMPT), shape, SamplingParams(temperature=1.0, rule=AcceptanceRule.REJECTION), 0)
    target = drafter.grow(list(PROMPT), shape, SamplingParams(temperature=1.0), 0)
    assert rejection.tree.q_tokens.shape[1] == 2 and rejection.prefix_groups
    assert target.tree.q_tokens.shape[1] == 0 and not target.prefix_groups
    assert len(target.tree) == len(rejection.tree) == 7
