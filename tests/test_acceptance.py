"""The lossless acceptance rules as pure functions, checked statistically (fixed seeds).

Sampled mode: children are drawn without replacement from q; `resolve_siblings` must emit tokens
distributed exactly as the target's p, whatever q looks like. A chi-square goodness-of-fit test
over many draws checks that, and a classic mistake (the min(1, p/q) rule applied to children that
were picked top-k by q rather than drawn from it) is shown to fail the same test: the test has power.
"""
import numpy as np
import pytest
from scipy.stats import chisquare

from edgespec.common.acceptance import accept_greedy, accept_target_sample, draw_without_replacement, resolve_siblings
from edgespec.common.rng import Purpose, generator
from edgespec.common.sampling import SamplingParams, dequantize, probabilities, quantize_draft, sample_inverse_cdf
from edgespec.common.tree import TokenTree

DRAWS = 20_000


def emitted_distribution(p, q_tokens, q, m, drawn=True, seed=1):
    rng = np.random.default_rng(seed)
    counts = np.zeros(p.size)
    for _ in range(DRAWS):
        picked = draw_without_replacement(q, m, rng) if drawn else np.argsort(-q, kind="stable")[:m]
        token, _ = resolve_siblings(p, q_tokens, q, q_tokens[picked], rng, rng)
        counts[token] += 1
    return counts


def chi2_pvalue(counts, p):
    support = p > 0
    assert counts[~support].sum() == 0, "emitted a token the target gives probability 0"
    return chisquare(counts[support], DRAWS * p[support]).pvalue


def dist(*values):
    v = np.array(values, dtype=np.float64)
    return v / v.sum()


CASES = {
    "identical": (dist(4, 3, 2, 1, 0, 0), [0, 1, 2, 3], dist(4, 3, 2, 1)),
    "disjoint": (dist(0, 0, 0, 1, 2, 3), [0, 1, 2], dist(1, 1, 1)),
    "peaked draft, flat target": (dist(1, 1, 1, 1, 1, 1), [0, 1, 2], dist(90, 5, 5)),
    "flat draft, peaked target": (dist(20, 1, 1, 1, 0, 1), [0, 1, 2, 3, 4, 5], dist(1, 1, 1, 1, 1, 1)),
    "partial overlap": (dist(0, 5, 1, 0, 3, 1), [1, 3, 5, 2], dist(2, 6, 1, 1)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("m", [1, 2, 4])
def test_sibling_rule_is_lossless(case, m):
    p, q_tokens, q = CASES[case]
    q_tokens = np.array(q_tokens)
    m = min(m, q.size)
    counts = emitted_distribution(p, q_tokens, q, m)
    assert chi2_pvalue(counts, p) > 1e-3


def test_wrong_rule_is_detected():
    """min(1, p/q) over children *picked* top-k by q instead of *drawn* from q biases the output."""
    p, q_tokens, q = CASES["peaked draft, flat target"]
    counts = emitted_distribution(p, np.array(q_tokens), q, 2, drawn=False)
    assert chi2_pvalue(counts, p) < 1e-6


def test_acceptance_rate_beats_single_draft():
    """Several siblings accept more often than one (that is why trees help)."""
    p, q_tokens, q = CASES["partial overlap"]
    rng = np.random.default_rng(0)
    rates = []
    for m in (1, 3):
        hits = 0
        for _ in range(4000):
            children = np.array(q_tokens)[draw_without_replacement(q, m, rng)]
            hits += resolve_siblings(p, np.array(q_tokens), q, children, rng, rng)[1] is not None
        rates.append(hits / 4000)
    assert rates[1] > rates[0] + 0.05


def test_greedy_walk():
    t = TokenTree(tokens=np.array([0, 5, 6, 7, 8]), parents=np.array([-1, 0, 0, 1, 1]))
    argmax = np.array([5, 8, 1, 1, 3])       # root->5, node1->8 (node 4), node4 -> 3 (bonus)
    acc = accept_greedy(t, argmax)
    assert acc.path == [1, 4] and acc.next_token == 3
    assert accept_greedy(t, np.array([9, 0, 0, 0, 0])).path == []


def test_rng_is_counter_based():
    a = generator(7, 3, 2, Purpose.ACCEPT).random(4)
    assert np.array_equal(a, generator(7, 3, 2, Purpose.ACCEPT).random(4))
    assert not np.array_equal(a, generator(7, 3, 2, Purpose.RESIDUAL).random(4))
    assert not np.array_equal(a, generator(7, 4, 2, Purpose.ACCEPT).random(4))
    assert not np.array_equal(a, generator(8, 3, 2, Purpose.ACCEPT).random(4))


def test_sampling_transforms():
    logits = np.array([3.0, 2.0, 1.0, 0.0])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p[2] == p[3] == 0 and abs(p.sum() - 1) < 1e-12
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0] == 1.0
    tok, w = quantize_draft(np.array([4, 9]), np.array([0.999999, 0.000001]))
    assert w.min() >= 1 and abs(dequantize(w).sum() - 1) < 1e-12


def test_inverse_cdf_sampling_reaches_exactly_the_support():
    p = dist(0, 3, 0, 1, 0)
    assert sample_inverse_cdf(p, 0.0) == 1
    assert sample_inverse_cdf(p, 0.7499) == 1
    assert sample_inverse_cdf(p, 0.75) == 3
    assert sample_inverse_cdf(p, 1.0 - 1e-17) == 3      # never a zero-probability tail token
    rng = np.random.default_rng(5)
    counts = np.bincount([sample_inverse_cdf(p, u) for u in rng.random(DRAWS)], minlength=p.size)
    assert chi2_pvalue(counts.astype(float), p) > 1e-3


def test_target_sample_rule_emits_p_from_a_deterministic_top_k_tree():
    """The target-sample rule needs no q: children picked top-k by the draft are fine."""
    p = dist(5, 1, 3, 0, 1)
    tree = TokenTree(tokens=np.array([9, 0, 2]), parents=np.array([-1, 0, 0]))  # the two likeliest
    counts = np.zeros(p.size)
    for step in range(DRAWS):
        acc = accept_target_sample(tree, lambda node: p if node == 0 else dist(1, 1, 1, 1, 1), seed=3, step=step)
        counts[tree.tokens[acc.path[0]] if acc.path else acc.next_token] += 1
    assert chi2_pvalue(counts, p) > 1e-3
