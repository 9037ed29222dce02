"""When to keep a freshly distilled LoRA adapter and when to roll back to the previous one.

tools/distill.py measures an adapter on held-out logs, but what counts is acceptance on this
device's live traffic. After a hot swap (pool.experts.LoraExpert.swap) the edge keeps the previous
adapter at hand and compares the new one's measured acceptance (accepted / drafted nodes) with the
previous one's over its recent window:

- ROLL_BACK as soon as the new adapter is worse by more than `tolerance` with confidence (one-sided
  z-test on the difference of the two proportions): the caller swaps the previous adapter back.
- KEEP once it is not worse with the same confidence, or after `max_nodes` drafted nodes without
  evidence either way (an adapter that is not measurably worse stays).
- TRIAL until then; never a verdict before `min_nodes`, so a few unlucky steps decide nothing.

Labels are opaque (adapter paths or versions; None is the bare base model). One policy per adapter
expert:

    policy.swapped(new_path)                 # right after expert.swap(new_path)
    verdict = policy.observe(drafted, accepted)   # every step that used the expert
    if verdict is Verdict.ROLL_BACK:
        expert.swap(policy.current)          # policy.current is the previous adapter again
"""
from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable


class Verdict(enum.Enum):
    STEADY = "steady"        # no trial running
    TRIAL = "trial"
    KEEP = "keep"
    ROLL_BACK = "roll_back"


@dataclass
class _Window:
    """Drafted and accepted node counts over the most recent `limit` drafted nodes (by step)."""

    limit: int
    steps: deque = field(default_factory=deque)
    drafted: int = 0
    accepted: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.steps.append((drafted, accepted))
        self.drafted += drafted
        self.accepted += accepted
        while self.steps and self.drafted - self.steps[0][0] >= self.limit:
            d, a = self.steps.popleft()
            self.drafted -= d
            self.accepted -= a

    @property
    def rate(self) -> float:
        return (self.accepted + 1) / (self.drafted + 2)   # Laplace: defined on an empty window


@dataclass
class AdapterRollback:
    """Keep-or-roll-back decisions for one adapter expert (see the module docstring)."""

    current: Hashable | None = None
    min_nodes: int = 300
    max_nodes: int = 3000
    z: float = 2.33          # one-sided 99 %
    tolerance: float = 0.01  # acceptance drop ignored (prompt mix drifts between the two windows)
    window_nodes: int = 3000
    previous: Hashable | None = None
    verdict: Verdict = Verdict.STEADY
    history: list = field(default_factory=list)   # (label, verdict, new rate, baseline rate, nodes)

    def __post_init__(self) -> None:
        self._live = _Window(self.window_nodes)
        self._baseline = _Window(self.window_nodes)
        self._trial_nodes = 0

    def swapped(self, new: Hashable | None) -> None:
        """`new` was just swapped in: the outgoing adapter's recent window becomes the baseline."""
        self.previous, self.current = self.current, new
        self._baseline, self._live = self._live, _Window(self.window_nodes)
        self._trial_nodes = 0
        self.verdict = Verdict.TRIAL

    def observe(self, drafted: int, accepted: int) -> Verdict:
        """One step drafted by the current adapter: `accepted` of its `drafted` nodes were accepted."""
        if drafted <= 0:
            return self.verdict
        self._live.add(drafted, min(accepted, drafted))
        if self.verdict is not Verdict.TRIAL:
            return Verdict.STEADY
        self._trial_nodes += drafted
        if self._trial_nodes < self.min_nodes:
            return Verdict.TRIAL
        new, old = self._live.rate, self._baseline.rate
        se = math.sqrt(new * (1 - new) / self._live.drafted + old * (1 - old) / max(self._baseline.drafted, 1))
        score = (new - old + self.tolerance) / max(se, 1e-9)   # how far above "worse by the tolerance"
        if score < -self.z:
            self._decide(Verdict.ROLL_BACK, new, old)
            self.current, self.previous = self.previous, None
            self._live, self._baseline = self._baseline, _Window(self.window_nodes)
            return Verdict.ROLL_BACK
        if score > self.z or self._trial_nodes >= self.max_nodes:
            self._decide(Verdict.KEEP, new, old)
            return Verdict.KEEP
        return Verdict.TRIAL

    def _decide(self, verdict: Verdict, new: float, old: float) -> None:
        self.history.append((self.current, verdict.value, round(new, 4), round(old, 4), self._trial_nodes))
        self.verdict = Verdict.STEADY
