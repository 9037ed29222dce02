"""Losslessness on the real Qwen2.5-Coder pair (0.5B draft, 1.5B target), greedy, bounded tokens.

Speculative output must equal target-only greedy output; a divergence must be explained by the
measured logits (tests/lossless.py: the verifier's own row for the deciding node picks the emitted
token, and target-only logits there differ from it by at least the margin between the two tokens).
"""
import pytest

import lossless
from edgespec import EdgeSession, TreeShape
from lossless import assert_lossless, spec_tokens, target_only_greedy

pytestmark = pytest.mark.qwen
N_TOKENS = 40
PROMPTS = [
    "Write a Python function is_prime(n).",
    "Write an SQL query that returns the ten most recent orders with their customer names.",
    "Explain in two sentences why the sky is blue.",
    "What is 17 * 23? Show the steps.",
]


@pytest.fixture(scope="module")
def references(qwen_models):
    _, target = qwen_models
    refs = {}
    for prompt in PROMPTS:
        tokens = target.chat_tokens([{"role": "user", "content": prompt}])
        refs[prompt] = (tokens, target_only_greedy(target, tokens, N_TOKENS))
    return refs


@pytest.mark.parametrize("shape", [TreeShape.chain(4), TreeShape(budget=16)], ids=["chain4", "tree16"])
def test_speculative_greedy_matches_target(qwen_paths, references, shape, record_property):
    exact, explained_before = 0, len(lossless.EXPLAINED)
    with EdgeSession(*qwen_paths, tree=shape, local=True, n_ctx=2048) as session:
        for prompt, (tokens, ref) in references.items():
            exact += assert_lossless(spec_tokens(session, tokens, N_TOKENS), ref, prompt)
        assert session.stats.tau > 1.5, f"the Qwen pair should accept drafts: tau {session.stats.tau:.2f}"
    explained = lossless.EXPLAINED[explained_before:]
    assert exact + len(explained) == len(PROMPTS)
    record_property("exact_matches", f"{exact}/{len(PROMPTS)}")
    record_property("explained_divergences", "; ".join(map(str, explained)))
    print(f"{exact}/{len(PROMPTS)} prompts identical to target-only greedy, {len(explained)} diverged where "
          f"numerics explain it; tau {session.stats.tau:.2f}")
