"""Pipelined drafting (next tree drafted while one is in flight) and adaptive trees stay lossless."""
import pytest

from edgespec import EdgeSession, TreeShape
from lossless import assert_lossless, spec_tokens, target_only_greedy

PROMPTS = ["Write a Python function that adds two numbers.", "List three fruits."]


@pytest.mark.parametrize("tree", [TreeShape(budget=16), None], ids=["tree16", "adaptive"])
def test_pipelined_remote_session_is_lossless(smol_path, smol_model, tree):
    with EdgeSession(smol_path, smol_path, tree=tree, n_ctx=1024) as session:   # bundled verifier, pipelined
        assert session.decoder._pool is not None
        for prompt in PROMPTS:
            tokens = session.draft_model.chat_tokens([{"role": "user", "content": prompt}])
            ref = target_only_greedy(smol_model, tokens, 48)
            assert_lossless(spec_tokens(session, tokens, 48), ref, prompt)
        stats = session.stats
        assert stats.prepared_hits > 0, "no tree drafted ahead was ever used"
        if tree is None:
            planner = stats.extra["planner"]
            assert planner["steps"] == stats.steps and planner["verify_ms_per_node"] > 0
