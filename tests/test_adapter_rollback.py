"""The adapter rollback policy on synthetic acceptance streams with known rates."""
from __future__ import annotations

import numpy as np

from edgespec.edge.adapter_rollback import AdapterRollback, Verdict


def run(policy: AdapterRollback, rng: np.random.Generator, rate: float, steps: int, nodes: int = 4) -> list[Verdict]:
    return [policy.observe(nodes, int(rng.binomial(nodes, rate))) for _ in range(steps)]


def test_a_worse_adapter_is_rolled_back_and_the_previous_one_restored() -> None:
    rng = np.random.default_rng(0)
    policy = AdapterRollback(current="v1")
    assert set(run(policy, rng, 0.70, 800)) == {Verdict.STEADY}   # no trial: nothing to decide
    policy.swapped("v2")
    verdicts = run(policy, rng, 0.55, 800)
    assert Verdict.ROLL_BACK in verdicts and Verdict.KEEP not in verdicts
    first = verdicts.index(Verdict.ROLL_BACK)
    assert 300 / 4 <= first + 1 < 400 / 4 + 30   # not before min_nodes, and soon after for a 15-point drop
    assert policy.current == "v1" and policy.previous is None
    assert set(verdicts[first + 1:]) == {Verdict.STEADY}
    assert policy.history[-1][:2] == ("v2", "roll_back")


def test_a_better_or_equal_adapter_is_kept() -> None:
    rng = np.random.default_rng(1)
    policy = AdapterRollback(current=None)   # the bare base model
    run(policy, rng, 0.60, 800)
    policy.swapped("v1")
    verdicts = run(policy, rng, 0.70, 800)
    assert Verdict.KEEP in verdicts and Verdict.ROLL_BACK not in verdicts
    assert policy.current == "v1" and policy.previous is None and policy.history[-1][1] == "keep"

    policy.swapped("v2")          # as good as v1: kept at the latest after max_nodes, never rolled back
    verdicts = run(policy, rng, 0.70, 1000)
    assert Verdict.ROLL_BACK not in verdicts and Verdict.KEEP in verdicts
    assert verdicts.index(Verdict.KEEP) + 1 <= policy.max_nodes / 4
    assert policy.current == "v2" and policy.previous == "v1"


def test_no_false_rollbacks_between_equal_adapters() -> None:
    """Same true acceptance before and after: over many trials a rollback is rare (one-sided 1 %
    plus the tolerance)."""
    rollbacks = 0
    for seed in range(40):
        rng = np.random.default_rng(100 + seed)
        policy = AdapterRollback(current="a")
        run(policy, rng, 0.65, 750)
        policy.swapped("b")
        rollbacks += Verdict.ROLL_BACK in run(policy, rng, 0.65, 750)
    assert rollbacks <= 2, rollbacks
