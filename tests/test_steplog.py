"""The verifier's step log: compact shards that give back exactly what was recorded, and a real
`edgespec verifier serve --log-dir` run whose log agrees with the answers it produced."""
from __future__ import annotations

import numpy as np
import pytest
from steplog_helpers import record_steps

from edgespec.common.acceptance import Acceptance
from edgespec.common.tree import TokenTree
from edgespec.verifier.steplog import StepLog, read_meta, read_steps, top_logprobs


def test_top_logprobs_are_the_exact_log_softmax() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 1000)).astype(np.float32) * 4
    ids, lps = top_logprobs(logits, 8)
    full = logits - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    for r in range(3):
        assert list(ids[r]) == list(np.argsort(-logits[r])[:8])
        assert np.allclose(lps[r], full[r, ids[r]], atol=1e-4)


def test_shards_round_trip_with_compact_contexts(tmp_path) -> None:
    rng = np.random.default_rng(1)
    log = StepLog(tmp_path, top_k=4, shard_steps=3, meta={"model_id": "m", "vocab_size": 50})
    a, b = log.session(), log.session()
    expected = []
    contexts = {0: [1, 2, 3], 1: [9, 8]}
    for step in range(8):
        who = step % 2
        context = contexts[who]
        tree = TokenTree(np.array([context[-1], 5, 6, 7], np.int32), np.array([-1, 0, 1, 0], np.int32))
        path = [1, 2] if step % 3 else []
        acc = Acceptance(path, int(rng.integers(50)))
        logits = rng.normal(size=(4, 50)).astype(np.float32)
        (a if who == 0 else b)(list(context), tree, acc, logits)
        expected.append((who, list(context), [int(tree.tokens[i]) for i in path], acc.next_token,
                         top_logprobs(logits[[0, *path]], 4)))
        contexts[who] = context + expected[-1][2] + [acc.next_token]
        if step == 4:
            contexts[who] = contexts[who][:2] + [11]   # an edited history: only a prefix is shared
    log.close()
    assert len(list(tmp_path.glob("steps-*.npz"))) == 3 and not list(tmp_path.glob(".*tmp"))
    assert read_meta(tmp_path)["model_id"] == "m"
    got = list(read_steps(tmp_path))
    assert len(got) == 8 and len({s.session for s in got}) == 2
    for step, (who, context, path, nxt, (ids, lps)) in zip(got, expected):
        assert step.context.tolist() == context and step.path.tolist() == path and step.next_token == nxt
        assert np.array_equal(step.topk_ids, ids) and np.array_equal(step.topk_logprobs, lps)
    # Stored compactly: fewer context tokens on disk than contexts logged.
    stored = 0
    for shard in tmp_path.glob("steps-*.npz"):
        with np.load(shard) as z:
            stored += z["ctx_new"].size
    assert stored < sum(len(c) for _, c, *_ in expected)
    with pytest.raises(ValueError, match="another model"):
        StepLog(tmp_path, top_k=4, meta={"model_id": "other"})


def test_verifier_serve_logs_the_deciding_distributions(smol_path, tmp_path) -> None:
    """Greedy: at every decided row the target's top token is what was committed there."""
    prompts = ["Name three colours.", "What is 2 + 2?"]
    answers = record_steps(smol_path, smol_path, tmp_path, prompts, max_tokens=20)
    steps = list(read_steps(tmp_path))
    meta = read_meta(tmp_path)
    assert meta["vocab_size"] == 49152 and meta["top_k"] == 16
    assert len(steps) >= 2 * 3 and all(s.tree_nodes > 1 for s in steps)
    by_session: dict[str, list] = {}
    for s in steps:
        by_session.setdefault(s.session, []).append(s)
        assert s.topk_ids.shape == (s.path.size + 1, 16)
        committed = [*s.path.tolist(), s.next_token]
        assert s.topk_ids[:, 0].tolist() == committed          # greedy: the argmax decided every token
        assert np.all(np.diff(s.topk_logprobs, axis=1) <= 0) and np.all(s.topk_logprobs <= 0)
        assert np.all(np.exp(s.topk_logprobs).sum(axis=1) <= 1 + 1e-4)
    # Each step continues the previous one's commit, except where the next prompt's conversation starts.
    restarts = 0
    for session_steps in by_session.values():
        for prev, cur in zip(session_steps, session_steps[1:]):
            committed = [*prev.context.tolist(), *prev.path.tolist(), prev.next_token]
            restarts += cur.context.tolist()[: len(committed)] != committed
    assert restarts == len(prompts) - len(by_session)
    assert all(answers)
