"""Choose each step's tree from a cost model: maximise expected tokens per second of wall time.

Inputs, all measured from the traffic itself and refreshed every step:
- link: round-trip time and uplink bandwidth, fitted as network_s = rtt + bytes_up / bandwidth
  over recent steps (network_s = wall time of the Verify minus the server's queue + compute);
- verifier: compute time as a line in the number of tree nodes, plus its reported queue time
  (load: when requests queue, every extra node costs other users too, so nodes get dearer);
- draft: seconds per drafting decode (one decode per depth);
- acceptance: the probability that a drafted node ends up on the accepted path, as a function
  of the draft's own path probability, calibrated online per score bin (EAGLE-2/Sequoia idea),
  times a per-depth correction: observed / predicted acceptances at that depth, so a draft whose
  confidence is systematically off deep in the tree (or near the root) is corrected there.

Drafting uses the shape the planner picks; afterwards `prune` keeps the best-scoring prefix of
nodes whose size maximises (1 + expected accepted) / predicted step time.

The decoder drafts the next tree while this one is in flight (decoder.py). When that prepared tree
is the one sent (its guess of the answer came true), the step costs the longer of drafting and the
round trip, not their sum; the planner keeps the share of such hits per shape (of the tree in flight
before them: its whole main path must come true) and prices each shape's steps with its own.
Trying other shapes (exploration) is paid in real time: where target-only steps take 4 ms and a
drafted chain 75 ms, exploring every 16th step alone would cost a third of the speed. So a shape is
tried only if it could beat the current choice with an optimistic acceptance (0.9 on the best path),
and, once tried three times, only within EXPLORE_SHARE of the wall time observed.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edgespec.edge.drafting import TreeShape

# Candidate shapes, from no draft at all (plain target decoding: the right choice when verified
# nodes are dear and round trips cheap, e.g. a CPU verifier nearby) to a wide tree; the planner
# picks one each step.
LADDER: tuple[TreeShape, ...] = (
    TreeShape.target_only(), TreeShape.chain(2), TreeShape.chain(4),
    TreeShape(budget=8, max_depth=5, branching=2, width=2),
    TreeShape(budget=16, max_depth=6, branching=4, width=4),
    TreeShape(budget=32, max_depth=8, branching=4, width=6),
    TreeShape(budget=64, max_depth=10, branching=6, width=8),
)
BYTES_PER_NODE = 8         # tokens + parents (int32), greedy trees (measured: docs/BENCHMARKS.md)
BYTES_PER_Q_ENTRY = 6      # token (int32) + weight (uint16), sampled trees (rejection rule)
BYTES_PER_MESSAGE = 48     # framing, step, sampling parameters: paid by target-only steps too
SCORE_BINS = np.array([0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 1.01])
MAX_TRACKED_DEPTH = 16     # depths beyond share the last depth's correction
EXPLORE_SHARE = 0.03       # at most this share of the observed wall time goes to trying other shapes
OPTIMISTIC_ACCEPTANCE = (0.9, 0.3)  # (best path, sibling): a shape that cannot pay even so is not tried
DEPTH_PRIOR = 4.0          # pseudo-observations pulling a depth's correction towards 1
# An untried shape's decode of `width` rows costs (1 + WIDE_ROW_COST * (width - 1)) chain decodes
# (a prior: each shape's measured cost replaces it once tried). Priced as one chain decode, the first
# tree32 steps on the H200 host took 1.3 s where a chain step took 0.15 s (2026-12-01, 34 ms a chain
# decode, 162 ms a 6-wide one, when every row still sorted the vocabulary); llama_decode alone of
# the 0.5B draft on one core of the 2-core box: 50 ms for one row, 286 ms for eight.
WIDE_ROW_COST = 0.75
REALIZED_WINDOW = 8        # realized tokens per rung: a running mean over about this many steps
# A request's one-off try of a bigger shape (begin_request; a tree accepted to its depth) may cost at most this share
# of what is left of the request at the current rate, over a step of the current choice. Uncapped, prose at 100 ms
# RTT on the H200 host climbed tree8, tree16, tree32 and tree64 in a 64-token answer (one tree64 is ten 8-row
# decodes, ~0.5 s) and ran 10 % behind fixed chain4 (docs/BENCHMARKS.md, twenty-sixth session's e2e)
TRY_SHARE = 0.1
# Shapes bigger than any a request has drafted are priced from earlier requests, scaled by how much of that its own
# trees achieved (Planner._request_ratio, never above 1), with this many accepted drafts of agreement before any.
# Priced without it, prose after a code answer (whose confident nodes were accepted 99 % of the time) found every
# untried shape better than the ones its trees had tried: on a simulated 200 ms link (tools/bench_planner_sim.py) it
# climbed tree16, tree32 and tree64 as `best` and ran 0.78x fixed chain4 on that prompt. With 2 drafts of agreement,
# two poor trees wrote drafting off for the rest of an answer (_request_ratio).
REQUEST_RATIO_PRIOR = 6.0
REQUEST_EVIDENCE = 4       # path nodes a request must have tried before its acceptance prices other shapes
# A tree accepted to its depth re-tries the next shape up while the request has drafted fewer than this many trees of
# it. A shape the request drafted is priced by its own trees, so one poor chain4 tree kept a code answer on chain2 to
# its end while chain2 trees were accepted whole (17 of 18; 2-core box, twenty-seventh session's trace)
REQUEST_RETRIES = 3
# A request decoding target-only tries the smallest drafted shape again after this many target-only steps, then after
# twice as many, and so on (each try only where it could pay and TRY_SHARE allows). Without it, two first trees that
# accepted nothing kept a code answer target-only to its end: 62 steps at 0.6x fixed chain4 (simulated 100 ms link,
# tools/bench_planner_sim.py, thirty-second session)
TARGET_ONLY_RETRY = 8
# A drafted rung's measured over modelled step time (Planner.wall_factor) is shrunk towards 1 as if this many of its
# steps had matched the model
WALL_PRIOR_STEPS = 2
# Whether a step's tree was drafted ahead depends on the tree in flight before it: the guess is that tree's whole main
# path (and the token after it), so a deep tree on prose rarely comes true and a short chain on code mostly does. Each
# rung keeps its own share, starting from the all-steps share as worth this many steps. With one share for all, prose
# at 100 ms RTT on an H100 host after a code answer (whose chain4 and tree8 steps were 80-90 % drafted ahead) drafted
# tree16 for 8 steps, none drafted ahead: 306 ms a step, and the planner ran that answer at 0.84x fixed chain4
# (docs/BENCHMARKS.md, thirtieth session's e2e)
PREPARED_PRIOR_STEPS = 2
# A draft model that prefilled more committed tokens than this before drafting a tree was catching up (after turns
# a router arm without it ran, or a resync), not drafting: that step's time would price every decode as a prefill
# (router mode on the 2-core box learned 894 ms a decode after one, docs/BENCHMARKS.md), so costs skip it. An
# ordinary step prefills the one bonus token; the deepest ladder shape's whole path is well under this.
CATCHUP_TOKENS = 16


def catching_up(catchup_tokens: int) -> bool:
    """Whether a draft that prefilled `catchup_tokens` committed tokens first was catching up (CATCHUP_TOKENS)."""
    return catchup_tokens > CATCHUP_TOKENS


@dataclass
class StepObservation:
    """What one verified step tells the planner (seconds and bytes)."""

    nodes: int                 # drafted nodes (root excluded)
    draft_s: float
    draft_decodes: int
    network_s: float           # wall - server queue - server compute (0 when local)
    bytes_up: int
    verify_s: float            # server compute
    queue_s: float
    scores: np.ndarray         # draft path probability of each drafted node
    accepted: np.ndarray       # bool per drafted node: on the accepted path
    depths: np.ndarray | None = None  # depth of each drafted node (1 = child of the root)
    shape: str = ""            # TreeShape.label it was drafted with; "" = the last choice
    prepared: bool = False     # the tree was drafted ahead, while the previous step was in flight
    wall_s: float = 0.0        # the step's wall time on the edge (at least draft + network + queue + verify)
    catchup: bool = False      # the draft model first prefilled a context it lagged (catching_up): draft_s is
                               # mostly that prefill, not what drafting the shape costs

    def to_record(self) -> dict:
        """A JSON-able copy (a step trace's `obs`): tools/replay_planner.py feeds it back with from_record, so
        recorded runs (a GPU host's e2e) can be replayed through another planner version on any machine."""
        return {"nodes": self.nodes, "draft_s": round(self.draft_s, 6), "draft_decodes": self.draft_decodes,
                "network_s": round(self.network_s, 6), "bytes_up": self.bytes_up, "verify_s": round(self.verify_s, 6),
                "queue_s": round(self.queue_s, 6), "scores": np.round(self.scores, 5).tolist(),
                "accepted": np.flatnonzero(self.accepted).tolist(),
                "depths": None if self.depths is None else np.asarray(self.depths).tolist(), "shape": self.shape,
                "prepared": self.prepared, "wall_s": round(self.wall_s, 6), "catchup": self.catchup}

    @classmethod
    def from_record(cls, record: dict) -> "StepObservation":
        """The observation to_record wrote (scores rounded to 5 decimals, seconds to the microsecond)."""
        fields = dict(record)
        fields["scores"] = np.array(record["scores"], np.float64)
        fields["accepted"] = np.zeros(record["nodes"], bool)
        fields["accepted"][record["accepted"]] = True
        fields["depths"] = None if record["depths"] is None else np.array(record["depths"], np.int64)
        return cls(**fields)


def _prepared_mean(share: float, count: int, hit: float) -> float:
    """A drafted-ahead share after its count-th observation `hit`: a mean with the share before the first worth
    PREPARED_PRIOR_STEPS steps, then a running mean over about REALIZED_WINDOW steps."""
    return share + (hit - share) * max(1 / (count + 1 + PREPARED_PRIOR_STEPS), 1 / REALIZED_WINDOW)


def tree_tokens(shape: TreeShape, a: float, a_sibling: float) -> float:
    """1 + expected accepted drafts of a typical tree of `shape`: a node on the drafter's best
    path is accepted with probability `a`, each extra sibling with `a_sibling`, so depth d is
    reached with probability a_eff^d. Shared by the planner (its drafter's calibrated acceptance)
    and the router (an expert's acceptance in the request's context)."""
    if shape.budget == 0:
        return 1.0
    per_depth = shape.budget / shape.max_depth
    # extra siblings raise the chance that some child is accepted at each depth
    a_eff = 1 - (1 - a) * (1 - a_sibling) ** max(per_depth - 1, 0)
    return 1 + sum(a_eff ** d for d in range(1, shape.max_depth + 1))


class _LineFit:
    """y = a + b·x over a window of recent points.

    Least squares when the x values spread enough to tell slope from intercept; otherwise a
    one-parameter model: proportional (a = 0, b = mean y / mean x), which charges all cost to x and
    errs towards small trees (right for a CPU verifier, whose cost grows with the nodes), or, with
    fixed_first, all cost fixed (right for a link: a round trip costs the same for 100 bytes or
    600, and a proportional fit would make a target-only step look free of the round trip). The
    change in tree size that follows then reveals the slope.
    """

    def __init__(self, window: int = 64, a: float = 0.0, b: float = 0.0, fixed_first: bool = False) -> None:
        self.points: deque[tuple[float, float]] = deque(maxlen=window)
        self.a, self.b = a, b
        self.fixed_first = fixed_first
        self._sums = [0.0, 0.0, 0.0, 0.0]   # Σx, Σy, Σx², Σxy over the window
        self._x_counts: dict[float, int] = {}   # x -> points in the window (its spread, without a scan)

    def add(self, x: float, y: float) -> None:
        """O(window) at most, no numpy: it runs on every step, and a target-only step on a GPU verifier
        nearby takes ~3.5 ms (np.polyfit here cost ~60 µs of it)."""
        x, y = float(x), float(y)
        if len(self.points) == self.points.maxlen:
            ox, oy = self.points[0]
            self._update(ox, oy, -1.0)
            if self._x_counts[ox] == 1:
                del self._x_counts[ox]
            else:
                self._x_counts[ox] -= 1
        self.points.append((x, y))
        self._update(x, y, 1.0)
        self._x_counts[x] = self._x_counts.get(x, 0) + 1
        n = len(self.points)
        sx, sy, sxx, sxy = self._sums
        mx, my = sx / n, sy / n
        if n >= 3 and self.x_spread() > 0.25 * mx:
            var = sxx / n - mx * mx
            b = (sxy / n - mx * my) / var if var > 0 else 0.0   # least squares, as np.polyfit(xs, ys, 1)
            self.b = max(b, 0.0)
            self.a = max(my - self.b * mx, 0.0)
        elif self.fixed_first:
            self.a, self.b = my, 0.0
        elif mx > 0:
            self.a, self.b = 0.0, my / mx

    def x_spread(self) -> float:
        """Largest minus smallest x in the window (0: one size seen, so no slope can be told)."""
        xs = self._x_counts
        return max(xs) - min(xs) if xs else 0.0

    def _update(self, x: float, y: float, sign: float) -> None:
        """Add (sign 1) or remove (sign -1) one point's terms of the sums."""
        s = self._sums
        s[0] += sign * x
        s[1] += sign * y
        s[2] += sign * x * x
        s[3] += sign * x * y

    def __call__(self, x: float) -> float:
        return max(self.a + self.b * x, 0.0)


@dataclass
class Planner:
    """Per-session cost model and tree chooser (see module docstring)."""

    ladder: tuple[TreeShape, ...] = LADDER
    explore_every: int = 16
    network: _LineFit = field(default_factory=lambda: _LineFit(a=0.0, b=1 / 12.5e6, fixed_first=True))  # 100 Mbit/s prior
    # Prior: a CPU-like 50 ms per node, so the first trees are small until measurements arrive.
    verify: _LineFit = field(default_factory=lambda: _LineFit(a=0.0, b=0.05))
    draft_per_decode_s: float = 0.03
    draft_calibrated: bool = False   # draft_per_decode_s is a measurement (calibrate_draft or a drafted tree)
    queue_s: float = 0.0
    # Prior: the draft's own path probability is the acceptance (bin midpoints, worth 2 trials each).
    # A flat 0.5 made every sibling look half likely, so a 64-node tree looked worth ~10 tokens
    # before anything was measured, and the first step drafted one (2 s of drafting on the H200 host).
    hits: np.ndarray = field(default_factory=lambda: 2 * np.minimum((SCORE_BINS[:-1] + SCORE_BINS[1:]) / 2, 0.95))
    trials: np.ndarray = field(default_factory=lambda: np.ones(len(SCORE_BINS) - 1) * 2)
    steps: int = 0
    last_choice: int = 2     # chain(4) until the first choice
    # why the last choice was made ("best", "try": a request's one-off try, "explore", "arm": the router's turn without
    # an arm) and the predicted tokens/s per rung it compared: what a step trace records
    last_why: str = "best"
    last_rates: list[float] = field(default_factory=list, repr=False)
    realized: dict[int, tuple[int, float]] = field(default_factory=dict)  # rung -> (count, mean tokens/step)
    # per depth: acceptances observed and predicted by the score bins (index 0 unused: the root)
    depth_hits: np.ndarray = field(default_factory=lambda: np.zeros(MAX_TRACKED_DEPTH + 1))
    depth_predicted: np.ndarray = field(default_factory=lambda: np.zeros(MAX_TRACKED_DEPTH + 1))
    # seconds per drafting decode by ladder rung (non-prepared tree steps): a decode of an 8-wide
    # tree level cost 5x a chain's on the H200 host's CPU (195 vs 35 ms), so one figure for all
    # shapes made wide trees look cheap after chains, or chains dear after one wide tree
    decode_s_by_rung: dict[int, float] = field(default_factory=dict)
    # of tree steps after a tree step, those that sent a tree drafted ahead (running mean over prepared_steps)
    prepared_share: float = 0.5
    prepared_steps: int = 0
    # rung -> (its trees followed by a tree step, running mean of those drafted ahead): see PREPARED_PRIOR_STEPS
    prepared_by_rung: dict[int, tuple[int, float]] = field(default_factory=dict)
    # drafted rung -> (steps, running mean of their wall time, running mean of what the model predicted for them), and
    # the wall_factor of each rung that has steps (None: to be computed; choose() prices every rung on every step)
    wall_by_rung: dict[int, tuple[int, float, float]] = field(default_factory=dict)
    _wall_factors: dict[int, float] | None = field(default=None, repr=False)
    wall_seconds: float = 0.0     # observed step wall time, all steps
    explore_seconds: float = 0.0  # predicted wall time of the steps spent exploring
    # expected tokens per rung; they change only when a drafted tree is observed, and choose() runs
    # on every step (80 µs recomputing them, against a 3.4 ms target-only step on a GPU nearby)
    _tokens_by_rung: list[float] | None = field(default=None, repr=False)
    # trees observed per rung in the current request (begin_request), and a larger rung to try at
    # the next choice (the request's first drafted shape; one up after a tree accepted to its depth)
    _request_trees: dict[int, int] = field(default_factory=dict, repr=False)
    # per rung drafted in the current request: its price from earlier requests at its first tree (_earlier_tokens,
    # for _request_ratio)
    _request_prior: dict[int, float] = field(default_factory=dict, repr=False)
    _try_next: int | None = field(default=None, repr=False)
    _try_full: bool = field(default=False, repr=False)   # _try_next follows a tree accepted to its depth
    # the current request's target-only steps since its last tree, and how many of them start the next try (doubled
    # at each: TARGET_ONLY_RETRY)
    _target_only_run: int = field(default=0, repr=False)
    _target_only_retry: int = field(default=TARGET_ONLY_RETRY, repr=False)
    # this request's acceptance along the path: [accepted nodes, nodes the walk tried] (a tree whose
    # path stopped at depth k < its depth tried k + 1 nodes), for the shapes it has not drafted yet
    _request_path: list[int] = field(default_factory=lambda: [0, 0], repr=False)
    # per rung drafted in the current request: its trees whose path stopped inside them, and _request_path as it stood
    # after the last of those (what came since is newer evidence than the misses: _since_last_miss)
    _request_misses: dict[int, int] = field(default_factory=dict, repr=False)
    _path_at_last_miss: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)
    _in_flight_rung: int | None = field(default=None, repr=False)  # the last tree step's rung (None: no tree before)
    requests: int = 0        # begin_request calls (0: one open-ended run, no per-request figures)
    request_left: int | None = None   # tokens the current request may still produce (None: open-ended)

    # -- learning -----------------------------------------------------------------------------
    def observe(self, obs: StepObservation) -> None:
        self.steps += 1
        # never less than its parts: a verifier that reports its times (a test double, a clock step)
        # must not make exploring look free or unaffordable
        self.wall_seconds += max(obs.wall_s, obs.draft_s + obs.network_s + obs.queue_s + obs.verify_s)
        self.network.add(obs.bytes_up, obs.network_s)
        self.queue_s = 0.8 * self.queue_s + 0.2 * obs.queue_s
        self.verify.add(obs.nodes + 1, obs.verify_s)
        if self.request_left is not None:
            self.request_left = max(0, self.request_left - 1 - int(obs.accepted.sum()))
        if obs.draft_decodes == 0:  # target-only: only link and verifier figures are news
            self._in_flight_rung = None   # (and nothing is drafted ahead behind a target-only step)
            self._target_only_run += 1
            if self.requests and self._target_only_run >= self._target_only_retry and self._try_next is None:
                self._try_next, self._try_full = 1, False
                self._target_only_run, self._target_only_retry = 0, 2 * self._target_only_retry
            return
        self._target_only_run = 0
        self._tokens_by_rung = None
        # A drafted tree that pruning cut to the root still cost its drafting and yielded one token:
        # it counts against its shape. Left out, a shape whose trees were mostly cut looked as good
        # as its few confident trees (GPU host, 2026-12-01: chain2 chosen on 55 of 56 steps at τ 1.14).
        # Credited to the rung the tree was drafted with: a pipelined decoder has already chosen (and
        # drafted) the next tree when this one is answered, so the last choice may be another rung.
        rung = self.rung_of(obs.shape)
        if self._in_flight_rung is not None:   # a tree was in flight before this one: was this one drafted behind it?
            hit = float(obs.prepared)
            count, share = self.prepared_by_rung.get(self._in_flight_rung, (0, self.prepared_share))
            self.prepared_by_rung[self._in_flight_rung] = (count + 1, _prepared_mean(share, count, hit))
            self.prepared_share = _prepared_mean(self.prepared_share, self.prepared_steps, hit)
            self.prepared_steps += 1
        self._in_flight_rung = rung
        # a prepared tree's drafting was hidden, a catch-up's was mostly prefill: neither draft_s is the shape's cost
        if obs.draft_decodes and not obs.prepared and not obs.catchup:
            per_decode = obs.draft_s / obs.draft_decodes
            if self.draft_calibrated:
                self.draft_per_decode_s = 0.8 * self.draft_per_decode_s + 0.2 * per_decode
            else:   # the first measurement replaces the prior outright
                self.calibrate_draft(per_decode)
            old = self.decode_s_by_rung.get(rung)
            self.decode_s_by_rung[rung] = per_decode if old is None else 0.7 * old + 0.3 * per_decode
        self._learn_wall(rung, obs)
        count, mean = self.realized.get(rung, (0, 0.0))
        tokens = 1.0 + float(obs.accepted.sum())
        # Acceptance depends on the text: a request's first tree of a shape replaces what the shape
        # realized on earlier requests when it did better, its later trees average in (1/2, 1/3, ...)
        # down to the window's weight. (Weighted 1/2, a code request's first chain4 tree after prose left
        # chain4 below target-only decoding, and the answer ran target-only at 0.93x cloud AR where chain4
        # ran 1.74x: 2-core box, 2026-12-01.) A first tree that did worse only halves the gap: one unlucky
        # tree would write the shape off for the whole request, and a shape not chosen gets no evidence,
        # while an overrated one corrects itself on its next tree. (Replaced outright, prose after code
        # went target-only after a few trees at 100 ms and ran 1.0x AR where chain4 ran 1.7x: H200 host.)
        seen = self._request_trees.get(rung, 0)
        if not seen:   # what earlier requests predicted for this shape, before this request's trees of it
            self._request_prior[rung] = self._earlier_tokens(rung)
        self._request_trees[rung] = seen + 1
        if obs.nodes:
            k = int(obs.accepted.sum())
            deepest = int(obs.depths.max()) if obs.depths is not None else obs.nodes
            self._request_path[0] += k
            self._request_path[1] += k + (k < deepest)
            # accepted to the shape's full depth (not only a pruned tree's): does the next shape up pay too?
            if (self.requests and k >= self.ladder[rung].max_depth
                    and self._request_trees.get(rung + 1, 0) < REQUEST_RETRIES):
                self._try_next, self._try_full = rung + 1, True
            if k < deepest:
                self._request_misses[rung] = self._request_misses.get(rung, 0) + 1
                self._path_at_last_miss[rung] = (self._request_path[0], self._request_path[1])
        first_worse = seen == 0 and count and tokens < mean
        weight = max(1 / min(count + 1, REALIZED_WINDOW), 1 / (seen + 2) if first_worse else 1 / (seen + 1))
        self.realized[rung] = (count + 1, mean + (tokens - mean) * weight)
        if obs.depths is not None:  # before the bins learn from this step: predicted out of sample
            d = np.minimum(obs.depths, MAX_TRACKED_DEPTH)
            np.add.at(self.depth_predicted, d, self.acceptance(obs.scores))
            np.add.at(self.depth_hits, d, obs.accepted.astype(float))
        bins = np.clip(np.digitize(obs.scores, SCORE_BINS) - 1, 0, len(self.hits) - 1)
        np.add.at(self.trials, bins, 1.0)
        np.add.at(self.hits, bins, obs.accepted.astype(float))

    def rung_of(self, label: str) -> int:
        """The ladder rung of a shape label (the last choice when unknown or not given)."""
        return next((i for i, s in enumerate(self.ladder) if s.label == label), self.last_choice) if label \
            else self.last_choice

    @property
    def depth_correction(self) -> np.ndarray:
        """Per depth, observed / predicted acceptances, shrunk towards 1 while evidence is thin;
        a depth never observed takes the correction of the deepest observed depth above it."""
        corr = (self.depth_hits + DEPTH_PRIOR) / (self.depth_predicted + DEPTH_PRIOR)
        for d in range(2, corr.size):
            if self.depth_predicted[d] == 0:
                corr[d] = corr[d - 1]
        return corr

    def acceptance(self, scores: np.ndarray, depths: np.ndarray | None = None) -> np.ndarray:
        """Calibrated probability that nodes with these draft path probabilities (and depths, when
        given) get accepted."""
        bins = np.clip(np.digitize(scores, SCORE_BINS) - 1, 0, len(self.hits) - 1)
        p = (self.hits / self.trials)[bins]
        if depths is not None:
            p = np.clip(p * self.depth_correction[np.minimum(depths, MAX_TRACKED_DEPTH)], 0.0, 1.0)
        return p

    def calibrate_draft(self, decode_s: float) -> None:
        """One draft decode timed outside any step (the decoder times one while the verifier
        prefills the prompt). Until a tree has been drafted, drafting is priced with the prior
        (30 ms a decode), and a shape that does not pay at that price is never tried, so the prior
        never gets corrected: on the H200 host a decode took 6-10 ms, and at 20 ms RTT the planner
        decoded every answer target-only (1.00x cloud AR) where chain4 ran 1.22x (2026-12-01)."""
        if not self.draft_calibrated:
            self.draft_per_decode_s, self.draft_calibrated = float(decode_s), True
            self._tokens_by_rung = None

    # -- predictions --------------------------------------------------------------------------
    @property
    def load_factor(self) -> float:
        """>1 when the verifier queues requests: nodes then cost other sessions too."""
        per_step = self.verify(17)
        return 1.0 + (self.queue_s / per_step if per_step > 0 else 0.0)

    def step_seconds(self, nodes: int, decodes: int, q_entries: int = 0, draft_s: float | None = None,
                     flat_verify: bool = False, prepared: float | None = None) -> float:
        """Predicted wall time of a step sending `nodes` drafted nodes; drafting costs `decodes` of
        this session's draft model, or `draft_s` when given (the router's per-expert cost).
        flat_verify: price the tree's verification like a target-only step's (the optimistic case).
        prepared: the share of such steps drafted ahead (prepared_for(rung)); default the all-steps share."""
        draft = decodes * self.draft_per_decode_s if draft_s is None else draft_s
        answer = self.answer_seconds(nodes, q_entries, flat_verify)
        if nodes:   # drafted ahead and sent (share p): the drafting overlapped the previous round trip
            p = self.prepared_share if prepared is None else prepared
            return max(p * max(draft, answer) + (1 - p) * (draft + answer), 1e-9)
        return max(answer, 1e-9)  # never 0: rates divide by it

    def answer_seconds(self, nodes: int, q_entries: int = 0, flat_verify: bool = False) -> float:
        """Predicted time from sending a tree of `nodes` drafted nodes to its answer: link and verifier."""
        up = BYTES_PER_MESSAGE + nodes * BYTES_PER_NODE + q_entries * BYTES_PER_Q_ENTRY
        # Queueing is the symptom of a shared, saturated verifier: rather than a fixed delay (which
        # would favour ever bigger trees), it scales what our nodes cost, so trees shrink under load.
        verify = (self.verify.a + self.verify.b * (1 if flat_verify else nodes + 1)) * self.load_factor
        return self.network(up) + verify

    def expected_tokens(self, rung: int, typical: tuple[float, float] | None = None) -> float:
        """1 + expected accepted drafts for a ladder rung, from the evidence nearest to it:
        - once this request has drafted REQUEST_RETRIES trees of the shape: what the shape realized (observe), or
          more where the request's path acceptance since its last miss predicts more (_since_last_miss);
        - before that, a base figure: the shape's realized figure if the request drafted it, else earlier requests'
          (_earlier_tokens), scaled down by _request_ratio when it is bigger than every shape the request drafted;
        - raised to what this request's acceptance along its paths predicts for the shape, once the request has
          tried REQUEST_EVIDENCE path nodes (a code answer drafted with chain2 accepting 0.95 of its nodes
          predicts chain4's 4.5).
        typical: (a, a_sibling) when the caller has them already."""
        mean = self.realized.get(rung, (0, 0.0))[1]
        drafted = self._request_trees.get(rung, 0) if self.requests else 0
        if drafted >= REQUEST_RETRIES:
            return max(mean, self._since_last_miss(rung, typical))
        if drafted:
            base = mean
        else:
            base = self._earlier_tokens(rung, typical)
            if self._request_trees and rung > max(self._request_trees):   # bigger than any tree the request drafted
                base = 1 + self._request_ratio() * (base - 1)
        a, a_sibling = typical or self.typical_acceptance()
        accepted, tried = self._request_path
        if self.requests and tried >= REQUEST_EVIDENCE:   # this request's acceptance raises a shape it has drafted
            # fewer than REQUEST_RETRIES trees of (code after prose; a first tree that missed where the request's
            # others were accepted whole), but does not write it off before its own trees have been seen (prose
            # after code: as for a first tree that did worse, see observe)
            return max(tree_tokens(self.ladder[rung], (accepted + 1) / (tried + 2), a_sibling), base)
        return base

    def _since_last_miss(self, rung: int, typical: tuple[float, float] | None = None) -> float:
        """What the request's path acceptance since the rung's last tree that missed (its path stopped inside the
        tree) predicts for the rung, once enough path nodes have been tried since (else 0): REQUEST_EVIDENCE, twice
        that for each further miss past REQUEST_RETRIES - 1, so a shape that keeps missing is re-tried ever later.
        A shape's own trees are its best evidence only until the text changes: a code answer whose first chain4
        trees missed (its prose preamble) priced chain4 by them to its end while 13 chain2 trees in a row were
        accepted whole, and ran 0.78x fixed chain4 (simulated 200 ms link, tools/bench_planner_sim.py, thirty-second
        session)."""
        then = self._path_at_last_miss.get(rung)
        if then is None:
            return 0.0
        accepted, tried = self._request_path[0] - then[0], self._request_path[1] - then[1]
        if tried < REQUEST_EVIDENCE << max(0, self._request_misses[rung] - REQUEST_RETRIES + 1):
            return 0.0
        a_sibling = (typical or self.typical_acceptance())[1]
        return tree_tokens(self.ladder[rung], (accepted + 1) / (tried + 2), a_sibling)

    def _earlier_tokens(self, rung: int, typical: tuple[float, float] | None = None) -> float:
        """1 + expected accepted drafts for a rung from earlier requests alone: its running mean after 3 uses, else
        the calibrated acceptance of a typical tree."""
        count, mean = self.realized.get(rung, (0, 0.0))
        return mean if count >= 3 else tree_tokens(self.ladder[rung], *(typical or self.typical_acceptance()))

    def _request_ratio(self) -> float:
        """How much of what earlier requests predicted this request's trees accepted (≤ 1; 1 before any tree):
        accepted drafts over predicted, summed over the shapes drafted, with REQUEST_RATIO_PRIOR drafts of
        agreement. It scales the prices of the shapes above every one this request has drafted, as the request's
        own trees rescaled the ones it did (observe). Not those below: they are cheap to find out about, and
        scaled, two chain4 trees that accepted nothing priced chain2 under target-only, and a code answer ran
        target-only to its end at 0.55x fixed chain4 (simulated 100 ms link, tools/bench_planner_sim.py)."""
        if not self.requests:   # one open-ended run: its trees are what `realized` already holds
            return 1.0
        accepted = self._request_path[0]   # every accepted draft lies on its tree's path
        predicted = sum(n * (self._request_prior[r] - 1) for r, n in self._request_trees.items())
        return min(1.0, (accepted + REQUEST_RATIO_PRIOR) / (predicted + REQUEST_RATIO_PRIOR))

    def typical_acceptance(self) -> tuple[float, float]:
        """Calibrated acceptance of a confident node (score 0.9) and of an unlikely one (0.1)."""
        a, a_sibling = self.acceptance(np.array([0.9, 0.1]))
        return float(a), float(a_sibling)

    # -- decisions ----------------------------------------------------------------------------
    def begin_request(self, max_tokens: int | None = None) -> None:
        """A new prompt: acceptance depends on the text, so what each shape realized on earlier
        requests is only a default. This request's first tree of a shape replaces it (observe),
        and when plain target decoding is the choice, the first step tries the smallest drafted
        shape (if it could pay at all); a tree accepted to its depth then tries the next shape up
        (again, until the request has REQUEST_RETRIES trees of it). So a code prompt after prose
        finds out that drafting pays, and a prose prompt pays for one small tree. Measured on the
        2-core box (2026-12-01): after a prose prompt the planner decoded a whole HumanEval answer
        target-only (1.00x cloud AR) where chain4 ran 1.74x.
        max_tokens: the most the request may produce; each such try then costs at most TRY_SHARE of what is left."""
        self.requests += 1
        self.request_left = max_tokens
        self._request_trees, self._request_prior = {}, {}
        self._request_path = [0, 0]
        self._request_misses, self._path_at_last_miss = {}, {}
        self._tokens_by_rung = None
        self._try_next, self._try_full = 1, False
        self._target_only_run, self._target_only_retry = 0, TARGET_ONLY_RETRY
        self._in_flight_rung = None   # a request's first tree is never drafted ahead

    @property
    def exploring(self) -> bool:
        """The last choice tries a shape other than the best (a request's one-off try or an exploration; see
        choose): such a tree goes out unpruned."""
        return self.last_why in ("try", "explore")

    def choose(self) -> TreeShape:
        """The ladder shape with the best predicted tokens/second. Every explore_every steps a
        neighbouring shape is tried instead, unpruned (`exploring`), so estimates stay fresh. Each
        try costs real time, so a neighbour is tried only if it could beat the best with optimistic
        acceptance; after 3 tries, only while exploring stays within EXPLORE_SHARE of the wall time,
        and, if still predicted at under half the best rate, only every 4th time."""
        if self._tokens_by_rung is None:
            typical = self.typical_acceptance()
            self._tokens_by_rung = [self.expected_tokens(i, typical) for i in range(len(self.ladder))]
        rates = [tokens / self._seconds(i) for i, tokens in enumerate(self._tokens_by_rung)]
        return self._pick(rates, self._seconds)

    def _pick(self, rates: list[float], seconds: Callable[[int, bool], float], learning: bool = False) -> TreeShape:
        """The best rung by `rates`, or on an exploration step a neighbour that passes choose()'s
        gate (`learning`: tried whatever the gate says); seconds(rung, optimistic) prices a rung
        (the router's planner passes its arm's)."""
        best = int(np.argmax(rates))
        self.last_why, self.last_rates = "best", rates
        # A try waits for one measured step: before it every price is a prior. (On the H200 host the
        # priors' 50 ms target-only step let a fresh session draft at 0 ms, where a target-only step
        # takes 3.5 ms: 0.04 s of the answer's 0.75 s, 2026-12-01.)
        n = None
        if self.steps:
            n, self._try_next = self._try_next, None
        if (n is not None and best < n < len(self.ladder) and not learning    # begin_request / a full tree
                and self._try_tokens(n) / seconds(n, True) > rates[best]
                and self._try_affordable(n, best, rates[best], seconds)):
            self.explore_seconds += seconds(n, False)
            best, self.last_why = n, "try"
        elif len(self.ladder) > 1 and self.steps > 0 and self.steps % self.explore_every == 0:
            e = self.explore_every
            up = best == 0 or (self.steps % (2 * e) and best + 1 < len(self.ladder))  # alternate; turn at the ends
            n = best + 1 if up else best - 1
            tried = self.realized.get(n, (0, 0.0))[0]
            known_bad = tried >= 3 and rates[n] < 0.5 * rates[best]
            cost = seconds(n, False)
            could_pay = tree_tokens(self.ladder[n], *OPTIMISTIC_ACCEPTANCE) / seconds(n, True) > rates[best]
            # the first tries are free while they cost no more than two steps of the best shape
            # (a wide tree's first try could take a second where a step takes 0.1 s)
            cheap = tried < 3 and cost <= 2 * seconds(best, False)
            affordable = cheap or self.explore_seconds + cost <= EXPLORE_SHARE * (self.wall_seconds + cost)
            if learning or (could_pay and affordable and (not known_bad or self.steps % (4 * e) == 0)):
                best, self.last_why = n, "explore"
                self.explore_seconds += cost
        self.last_choice = best
        return self.ladder[best]

    def _try_tokens(self, n: int) -> float:
        """Tokens a try of rung n could yield at best: after a tree accepted to its depth, rung n's whole depth
        (what the tree below it just did); else OPTIMISTIC_ACCEPTANCE. Priced at 0.9 a node, a chain4 after
        chain2 trees accepted whole could not beat them where a chain4 step costs 1.5x a chain2 step (the CPU
        verifier here): a code answer drafted chain2 for nine steps, each accepted whole, before its path
        acceptance priced chain4 up, and chain4 then accepted 4 of 4 six times (2-core box, 2026-12-05)."""
        if self._try_full:
            return 1.0 + self.ladder[n].max_depth
        return tree_tokens(self.ladder[n], *OPTIMISTIC_ACCEPTANCE)

    def _try_affordable(self, n: int, best: int, best_rate: float, seconds: Callable[[int, bool], float]) -> bool:
        """Whether a request's try of rung n costs, over a step of rung `best`, at most TRY_SHARE of the
        request's remaining time at the best rate (always, for an open-ended request). What a try can win is a
        share of what is left: near the end of an answer, or in a short one, a wide tree's try cannot pay back."""
        if self.request_left is None:
            return True
        extra = seconds(n, False) - seconds(best, False)
        return extra <= TRY_SHARE * self.request_left / max(best_rate, 1e-9)

    def _seconds(self, rung: int, optimistic: bool = False) -> float:
        """A rung's predicted step time, with its own measured drafting cost once it has one.
        optimistic (may it be worth trying?): until trees of several sizes have been verified (the
        verifier's slope is unknown) verified at a target-only step's cost, and an untried shape
        drafted at the cheapest wide-row cost measured so far (a chain's cost per decode before any)."""
        shape = self.ladder[rung]
        flat_verify = self.verify_flat(optimistic)
        if not shape.budget:
            return self.step_seconds(0, 0, flat_verify=flat_verify)
        factor = 1.0 if optimistic else self.wall_factor(rung)
        return factor * self.step_seconds(shape.budget, shape.max_depth, flat_verify=flat_verify,
                                          draft_s=shape.max_depth * self.decode_seconds(rung, optimistic),
                                          prepared=self.prepared_for(rung))

    def _learn_wall(self, rung: int, obs: StepObservation) -> None:
        """Keep a drafted step's wall time beside what the model, fitted with this step, says such a step costs
        (drafted ahead: max(drafting, answer); else their sum). The gap is what the components leave out: the draft
        decode that guesses the next tree's root before drafting ahead, a drafting-ahead level the answer waited for,
        the finishing of a tree the answer cut short, the host's own time."""
        if obs.wall_s <= 0 or obs.catchup:
            return
        answer = self.answer_seconds(obs.nodes)
        draft = self.ladder[rung].max_depth * self.decode_seconds(rung)
        predicted = max(draft, answer) if obs.prepared else draft + answer
        count, wall, pred = self.wall_by_rung.get(rung, (0, 0.0, 0.0))
        w = 1 / min(count + 1, REALIZED_WINDOW)
        self.wall_by_rung[rung] = (count + 1, wall + (obs.wall_s - wall) * w, pred + (predicted - pred) * w)
        self._wall_factors = None

    def wall_factor(self, rung: int) -> float:
        """How much dearer a drafted rung's steps run than the model says, relative to the drafted rungs' mean
        (_own_wall_factor of each; 1 for target-only, for a rung without steps, and while only one drafted rung has
        any). Relative only: it ranks the drafted shapes against each other (a wide tree whose drafting outlasts the
        round trip waits on its levels more than a chain), but leaves the level of drafting against target-only
        decoding to the model. On the simulated links of tools/bench_planner_sim.py (thirty-third session) the
        factor applied in full made the 200 ms runs 0.93-0.94x fixed chain4 against 0.85-0.94x (fewer tree8 steps),
        but the 100 ms runs 0.98-1.05x against 1.00-1.11x (short prose went target-only after two poor trees);
        relative, 0.88-0.96x and 1.02-1.08x."""
        if self._wall_factors is None:
            own = {r: self._own_wall_factor(r) for r in self.wall_by_rung}
            mean = float(np.mean(list(own.values()))) if len(own) >= 2 else 0.0
            self._wall_factors = {r: f / mean for r, f in own.items()} if mean else {}
        return self._wall_factors.get(rung, 1.0) if self.ladder[rung].budget else 1.0

    def _own_wall_factor(self, rung: int) -> float:
        """A rung's measured over modelled step time (running means of its steps), shrunk towards 1 by
        WALL_PRIOR_STEPS."""
        count, wall, pred = self.wall_by_rung[rung]
        ratio = min(2.0, max(0.5, wall / pred)) if pred > 0 else 1.0
        return (count * ratio + WALL_PRIOR_STEPS) / (count + WALL_PRIOR_STEPS)

    def decode_seconds(self, rung: int, optimistic: bool = False) -> float:
        """One drafting decode (a tree level) of this rung's shape: its own measured cost, else priced from the
        shapes drafted so far (_wide_row_cost)."""
        per_decode = self.decode_s_by_rung.get(rung)
        if per_decode is None:   # untried: a level of `width` rows costs more than a chain's one row
            chain_s, row_cost = self._wide_row_cost(optimistic)
            per_decode = chain_s * (1 + row_cost * (self.ladder[rung].width - 1))
        return per_decode

    def prepared_for(self, rung: int) -> float:
        """The share of steps after a tree of this rung that sent a tree drafted ahead (the all-steps share
        until the rung has been followed by a tree step): what hides a step's drafting when this rung is kept."""
        return self.prepared_by_rung.get(rung, (0, self.prepared_share))[1]

    def _wide_row_cost(self, optimistic: bool) -> tuple[float, float]:
        """(seconds of a one-row drafting decode, what each further row of a level adds in such decodes) for
        pricing an untried shape: from the shapes drafted so far (chains' own decode cost; each wide shape's
        cost per extra row, the cheapest of them when optimistic, their mean otherwise), else the priors
        (draft_per_decode_s; WIDE_ROW_COST, 0 when optimistic). An untried wide shape priced at a chain's
        cost made every step up look free: on the H200 host (2026-12-03, 100 ms RTT) a code answer that a
        chain accepted whole climbed tree8, tree16, tree32, tree64 (10 decodes of 6-8 rows each) and took
        3.0 s where chain4 took 1.7 s; tree8 had measured its extra row at 0.31 chain decodes by then."""
        chains = [s for r, s in self.decode_s_by_rung.items() if self.ladder[r].width == 1]
        chain_s = float(np.mean(chains)) if chains else self.draft_per_decode_s
        rows = [(s / chain_s - 1) / (self.ladder[r].width - 1)
                for r, s in self.decode_s_by_rung.items() if self.ladder[r].width > 1]
        if not rows:
            return chain_s, 0.0 if optimistic else WIDE_ROW_COST
        return chain_s, max(0.0, min(rows) if optimistic else float(np.mean(rows)))

    def verify_flat(self, optimistic: bool) -> bool:
        """Whether an optimistic price verifies a tree at a target-only step's cost: only while every
        tree in the verify fit's window had one size (its slope per node is unknown)."""
        return optimistic and self.verify.x_spread() == 0

    def prune_size(self, scores: np.ndarray, q_entries_per_node: float = 0.0,
                   depths: np.ndarray | None = None) -> int:
        """How many nodes to send: argmax of expected tokens per second of what is still to pay.

        The tree is drafted already: its drafting is spent whatever is sent, so only the round trip
        and the verification are priced. (Pricing the drafting made an empty tree look cheaper than
        any drafted one, and a step cut to the root also stops the next tree being drafted ahead.)
        scores (and depths) are the non-root nodes in the order pruning keeps them
        (Draft.order()), so the first n of them are what a cut to n sends."""
        scores = np.asarray(scores)
        value = self.acceptance(scores, None if depths is None else np.asarray(depths))
        gain = 1 + np.concatenate([[0.0], np.cumsum(value)])
        sizes = np.arange(scores.size + 1)
        seconds = np.array([self.step_seconds(int(n), 0, int(n * q_entries_per_node), draft_s=0.0) for n in sizes])
        return int(sizes[np.argmax(gain / seconds)])

    def snapshot(self) -> dict:
        """The model and its inputs, for `stats` (milliseconds, Mbit/s)."""
        bw = 8 / self.network.b / 1e6 if self.network.b > 0 else math.inf
        return {"rtt_ms": 1000 * self.network.a, "uplink_mbit_s": bw,
                "verify_ms_fixed": 1000 * self.verify.a, "verify_ms_per_node": 1000 * self.verify.b,
                "verifier_queue_ms": 1000 * self.queue_s, "load_factor": self.load_factor,
                "draft_ms_per_decode": 1000 * self.draft_per_decode_s, "prepared_share": self.prepared_share,
                "prepared_share_by_shape": {self.ladder[r].label: round(v, 3)
                                            for r, (_, v) in sorted(self.prepared_by_rung.items())},
                "draft_ms_per_decode_by_shape": {self.ladder[r].label: round(1000 * v, 2)
                                                 for r, v in sorted(self.decode_s_by_rung.items())},
                "explore_share": self.explore_seconds / self.wall_seconds if self.wall_seconds else 0.0,
                "acceptance_by_score_bin": (self.hits / self.trials).round(3).tolist(),
                "acceptance_by_depth": self._acceptance_by_depth(),
                "shape": self.ladder[self.last_choice].__dict__, "steps": self.steps}

    def _acceptance_by_depth(self) -> dict[int, dict[str, float]]:
        """Depths seen so far: accepted nodes per step, what the score bins predicted, correction."""
        seen = np.flatnonzero(self.depth_predicted > 0)
        steps = max(self.steps, 1)
        return {int(d): {"accepted_per_step": round(float(self.depth_hits[d]) / steps, 3),
                         "predicted_per_step": round(float(self.depth_predicted[d]) / steps, 3),
                         "correction": round(float(self.depth_correction[d]), 3)} for d in seen}
