"""Router: which drafter (expert, or a mix the pool offers) and which tree, for this request.

One decision, seen from two sides. The planner (planner.py) prices a step: round trip, uplink,
the verifier's cost per node, all fitted from the traffic. The router adds what the planner cannot
know: how well each expert drafts *this kind of request*, and what that expert's drafting costs.
For every (expert, ladder shape) pair it predicts

    tokens/s = tree_tokens(shape, a_e(x), a_sibling) / planner.step_seconds(shape, draft_s=draft_e(shape))

and takes the best; plain target decoding (no draft) is always on the ladder, so the router never
chooses to be slower than AR as far as its model knows. `tree_tokens` is the planner's own token
model, `a_sibling` the planner's calibrated acceptance of an unlikely node.

a_e(x) is the probability that a node on expert e's best path is accepted given its parent was,
in the context x (the MiniLM embedding of the request and recent turns, plus a bias term): a
Bayesian linear regression per expert over x (LinUCB/linear Thompson sampling), learned online
from what the verifier accepted: a step whose best path survived L of D depths counts L accepted
trials and one rejected one (none when L = D). Exploration is Thompson sampling of a_e(x) from its
posterior (one draw per expert and decision), so an expert with few observations in a region of
embedding space gets tried there, and stops being tried once the evidence says it is worse.
Regression over the embedding (rather than clusters) generalises to requests never seen: a new
code prompt lands near earlier code prompts.

Drafting cost per expert: seconds = fixed + per_decode * depth, running averages of measured
proposals (a lookup or template costs ~0, a draft model one decode per depth).

What was learned persists across restarts in `$EDGESPEC_HOME/router/state.npz` (atomic replace),
keyed by expert name and the embedding model; experts not seen before start from the prior.

Cost of a decision: embedding the request dominates. It runs MiniLM's integer graph
(embedding.integer_graph) on `route_tokens` = 16 tokens of the request (head and tail), and the
recent turns are embedded once each and cached (EdgeSession passes the earlier user turns, so a
turn embeds one new text): about 3-5 ms on one thread of this 2-core box, against 60 ms for 64
tokens on the folded fp32 graph. Cutting to 16 tokens did not change what the router learns on
the two-domain workload of tests/test_router.py (held-out margins equal at 16, 24, 32, 64
tokens). Scoring is about 0.5 ms for 4 arms x 7 shapes. tools/bench_router.py measures both.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Sequence

import numpy as np

from edgespec.common import modelstore
from edgespec.edge.drafting import TreeShape
from edgespec.edge.planner import Planner, StepObservation, tree_tokens

if TYPE_CHECKING:
    from edgespec.edge.embedding import Embedder
    from edgespec.edge.pool import DraftPool

STATE_VERSION = 1
NOISE = 0.5            # std of one Bernoulli trial at most: scales the posterior of a_e(x)
PRIOR_TRIALS = 1.0     # ridge strength: pseudo-trials per direction pulling a_e(x) to the prior
LEARNING_STEPS = 3     # an arm observed fewer times than this is explored whatever its predicted cost
PRIOR_ACCEPTANCE = 0.5
ROUTE_TOKENS = 16      # tokens of each text embedded (head and tail): see "Cost of a decision" above
RECENT_WEIGHT = 0.5    # weight of the previous turn in the context vector (halved per turn further back)


def default_state_path() -> Path:
    return modelstore.home_dir() / "router" / "state.npz"


@dataclass(frozen=True)
class ArmSpec:
    """An option the router chooses among: an expert of the pool or a mix of them (the pool names
    it), with its drafting cost as known before any measurement."""

    name: str
    seconds_per_decode: float = 0.03   # one draft-model decode per tree depth; ~0 for lookup/templates
    seconds_fixed: float = 0.0
    members: tuple[str, ...] = ()      # the pool's experts this arm activates (default: (name,))

    @property
    def experts(self) -> tuple[str, ...]:
        return self.members or (self.name,)


@dataclass
class _Arm:
    """Posterior of a_e(x) = w . x (ridge regression, A = prior + sum n x x^T) and measured cost."""

    spec: ArmSpec
    dim: int
    A: np.ndarray = field(init=False)
    b: np.ndarray = field(init=False)
    A_inv: np.ndarray = field(init=False)
    per_decode_s: float = field(init=False)
    fixed_s: float = field(init=False)
    steps: int = 0

    def __post_init__(self) -> None:
        self.A = PRIOR_TRIALS * np.eye(self.dim)
        self.b = np.zeros(self.dim)
        self.b[-1] = PRIOR_TRIALS * PRIOR_ACCEPTANCE   # bias term: a_e = prior everywhere at first
        self.A_inv = np.linalg.inv(self.A)
        self.per_decode_s, self.fixed_s = self.spec.seconds_per_decode, self.spec.seconds_fixed

    @property
    def w(self) -> np.ndarray:
        return self.A_inv @ self.b

    def acceptance(self, x: np.ndarray, rng: np.random.Generator | None, explore: float) -> float:
        mean = float(self.w @ x)
        if rng is not None and explore > 0:
            sd = NOISE * float(np.sqrt(max(x @ self.A_inv @ x, 0.0)))
            mean += explore * sd * float(rng.standard_normal())
        return min(max(mean, 0.0), 0.99)

    def update(self, x: np.ndarray, hits: float, trials: float) -> None:
        if trials <= 0:
            return
        self.A += trials * np.outer(x, x)
        self.b += hits * x
        ax = self.A_inv @ x   # Sherman-Morrison: A_inv stays exact without an O(d^3) inverse per step
        self.A_inv -= trials * np.outer(ax, ax) / (1.0 + trials * float(x @ ax))
        self.steps += 1

    def draft_seconds(self, shape: TreeShape) -> float:
        return 0.0 if shape.budget == 0 else self.fixed_s + self.per_decode_s * shape.max_depth

    def observe_cost(self, draft_s: float, decodes: int) -> None:
        """Running average of measured proposals: per decode for experts that decode, else fixed."""
        if decodes > 0:
            self.per_decode_s = 0.8 * self.per_decode_s + 0.2 * (draft_s - self.fixed_s) / decodes
        else:
            self.fixed_s = 0.8 * self.fixed_s + 0.2 * draft_s


def pool_arms(pool: "DraftPool", seconds_per_decode: float = 0.03, cheap_seconds: float = 0.002) -> list[ArmSpec]:
    """The options a pool offers the router: each expert alone, and each model expert under all
    the model-free experts (merged trees; the pool skips the model on steps where the cheap tree
    already suffices, DraftPool.skip_models_at). Costs are priors; measured costs replace them."""
    from edgespec.edge.pool.pool import MODEL_KINDS

    models = [n for n in pool.names if pool.expert(n).kind in MODEL_KINDS]
    cheap = [n for n in pool.names if pool.expert(n).kind not in MODEL_KINDS]
    arms = [ArmSpec(n, seconds_per_decode) for n in models]
    arms += [ArmSpec(n, 0.0, cheap_seconds) for n in cheap]
    arms += [ArmSpec("+".join([*cheap, m]), seconds_per_decode, cheap_seconds, members=(*cheap, m))
             for m in models if cheap]
    return arms


@dataclass(frozen=True)
class Route:
    """A turn's context: computed once per turn, reused by every step's `choose`."""

    x: np.ndarray          # unit embedding + bias term


@dataclass(frozen=True)
class Choice:
    arm: str | None        # None: no draft this step (plain target decoding)
    shape: TreeShape
    rung: int              # index in the planner's ladder
    tokens: float          # predicted tokens per step
    seconds: float         # predicted step time
    acceptance: float      # a_e(x) used (sampled when exploring)
    route: Route

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


class Router:
    """Chooses (expert, tree shape) per step; learns a_e(x) from the verifier's answers."""

    def __init__(self, arms: Sequence[ArmSpec | str], *, planner: Planner | None = None,
                 embedder: "Embedder | None" = None, state_path: str | os.PathLike | None = None,
                 explore: float = 1.0, seed: int | None = None, route_tokens: int = ROUTE_TOKENS,
                 save_every: int = 32) -> None:
        if embedder is None:
            from edgespec.edge.embedding import Embedder
            embedder = Embedder(max_tokens=route_tokens)
        self.embedder = embedder
        self.planner = planner or Planner()
        self.dim = int(embedder.embed_one("").shape[0]) + 1
        self.arms: dict[str, _Arm] = {}
        for arm in arms:
            spec = ArmSpec(arm) if isinstance(arm, str) else arm
            self.arms[spec.name] = _Arm(spec, self.dim)
        self.explore = explore
        self.rng = np.random.default_rng(seed)
        self.state_path = Path(state_path) if state_path is not None else default_state_path()
        self.save_every = save_every
        self._unsaved = 0
        self._turn_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self.load()

    # -- context --------------------------------------------------------------------------------
    def route(self, request: str, recent: Sequence[str] = ()) -> Route:
        """Embed the request (and, weighted down, the recent turns, most recent first: each is
        embedded once and cached) into the context vector of this turn."""
        vec = self._embed(request).astype(np.float64)
        weight = RECENT_WEIGHT
        for turn in recent:
            vec = vec + weight * self._embed(turn)
            weight *= 0.5
        norm = float(np.linalg.norm(vec))
        return Route(np.append(vec / norm if norm > 0 else vec, 1.0))

    def route_async(self, request: str, recent: Sequence[str] = ()) -> "Future[Route]":
        """`route` on a background thread (onnxruntime releases the GIL): start it with the
        turn, next to the prompt prefill that the first step waits for anyway, so the embedding
        is off the critical path and the turn's decision costs one `choose`."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgespec-router")
        return self._pool.submit(self.route, request, tuple(recent))

    def _embed(self, text: str) -> np.ndarray:
        key = hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=16).hexdigest()
        hit = self._turn_cache.get(key)
        if hit is None:
            hit = self._turn_cache[key] = self.embedder.embed_one(text)
            if len(self._turn_cache) > 256:
                self._turn_cache.popitem(last=False)
        else:
            self._turn_cache.move_to_end(key)
        return hit

    # -- decision -------------------------------------------------------------------------------
    def choose(self, route: Route, explore: bool = True, arm: str | None = None,
               acceptance: float | None = None, drafting_only: bool = False,
               among: Collection[str] | None = None) -> Choice:
        """Best predicted tokens/s over every (arm, ladder shape), target-only included.

        arm/acceptance: score that arm alone, with that a_e(x) (a turn's draw, see RoutedPlanner);
        drafting_only: leave target-only out (to rank arms against each other); among: only these
        arms (e.g. those that can draft under the sampled rejection rule)."""
        planner = self.planner
        a_sibling = planner.typical_acceptance()[1]
        rng = self.rng if explore else None
        best: Choice | None = None
        for name, arm_state in self.arms.items():
            if (arm is not None and name != arm) or (among is not None and name not in among):
                continue
            a = arm_state.acceptance(route.x, rng, self.explore) if acceptance is None else acceptance
            for rung, shape in enumerate(planner.ladder):
                if drafting_only and shape.budget == 0:
                    continue
                tokens = tree_tokens(shape, a, a_sibling)
                seconds = self.step_seconds(arm_state, rung)
                if best is None or tokens / seconds > best.rate:
                    best = Choice(name if shape.budget else None, shape, rung, tokens, seconds, a, route)
        if best is None:  # no arms: target-only
            shape = TreeShape.target_only()
            seconds = planner.step_seconds(0, 0)
            best = Choice(None, shape, planner.ladder.index(shape), 1.0, seconds, 0.0, route)
        return best

    def step_seconds(self, arm_state: _Arm, rung: int, flat_verify: bool = False) -> float:
        """A step of the ladder's `rung` drafted by this arm, priced by the planner's live fits."""
        shape = self.planner.ladder[rung]
        return self.planner.step_seconds(shape.budget, 0, draft_s=arm_state.draft_seconds(shape), flat_verify=flat_verify,
                                         prepared=self.planner.prepared_for(rung))

    def predicted(self, route: Route) -> dict[str, float]:
        """Posterior mean a_e(x) per arm (no exploration): what the router believes."""
        return {name: arm.acceptance(route.x, None, 0.0) for name, arm in self.arms.items()}

    # -- learning -------------------------------------------------------------------------------
    def observe(self, choice: Choice, accepted: int, depth: int | None = None,
                draft_s: float | None = None, decodes: int | None = None) -> None:
        """The verifier accepted `accepted` nodes of the `depth`-deep best path that `choice.arm`
        drafted (depth defaults to the shape's max depth); draft_s/decodes: what drafting cost."""
        if choice.arm is None:
            return
        arm = self.arms[choice.arm]
        depth = choice.shape.max_depth if depth is None else depth
        accepted = max(0, min(int(accepted), depth))
        arm.update(choice.route.x, float(accepted), float(accepted + (1 if accepted < depth else 0)))
        if draft_s is not None:
            arm.observe_cost(draft_s, decodes or 0)
        self._unsaved += 1
        if self.save_every and self._unsaved >= self.save_every:
            self.save()

    # -- persistence ----------------------------------------------------------------------------
    def save(self) -> Path:
        """Atomically replace the state file (a crash leaves the old one or the new one)."""
        path = self.state_path
        path.parent.mkdir(parents=True, exist_ok=True)
        names = list(self.arms)
        arrays = {
            "version": np.array(STATE_VERSION), "model_id": np.array(self.embedder.model_id),
            "names": np.array(names, dtype=str),
            "A": np.stack([self.arms[n].A for n in names]) if names else np.zeros((0, self.dim, self.dim)),
            "b": np.stack([self.arms[n].b for n in names]) if names else np.zeros((0, self.dim)),
            "cost": np.array([[self.arms[n].fixed_s, self.arms[n].per_decode_s, self.arms[n].steps]
                              for n in names]).reshape(-1, 3),
        }
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._unsaved = 0
        return path

    def load(self) -> bool:
        """Adopt a saved state for the arms known by name; False (fresh start) when there is none,
        it is unreadable, or it was learned over another embedding model or dimension."""
        try:
            with np.load(self.state_path, allow_pickle=False) as z:
                if int(z["version"]) != STATE_VERSION or str(z["model_id"]) != self.embedder.model_id \
                        or z["A"].shape[1:] != (self.dim, self.dim):
                    return False
                names, A, b, cost = list(z["names"]), z["A"], z["b"], z["cost"]
        except (OSError, KeyError, ValueError):
            return False
        for i, name in enumerate(names):
            arm = self.arms.get(str(name))
            if arm is None:
                continue
            arm.A, arm.b = A[i].astype(np.float64), b[i].astype(np.float64)
            arm.A_inv = np.linalg.inv(arm.A)
            arm.fixed_s, arm.per_decode_s, arm.steps = float(cost[i, 0]), float(cost[i, 1]), int(cost[i, 2])
        return True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._unsaved:
            self.save()

    def snapshot(self) -> dict:
        return {name: {"steps": arm.steps, "ms_per_decode": round(1000 * arm.per_decode_s, 3),
                       "ms_fixed": round(1000 * arm.fixed_s, 3),
                       "acceptance_bias": round(float(arm.w[-1]), 3)} for name, arm in self.arms.items()}


class RoutedPlanner(Planner):
    """The router in the decoder's seat of the planner: one decision, which drafter and which tree.

    The decoder asks its planner for a shape every step (`choose`) and reports every verified step
    (`observe`); this planner answers with the router's model. Per turn (`begin_turn`, with the
    request text) it draws each arm's acceptance from its posterior once (Thompson sampling, one
    draw per turn: the turn is the bandit's round, so every step of it is evidence for the arm that
    drafted it, even when trees are drafted ahead), picks the arm with the best drafting rate and
    activates its experts in the pool. Per step it picks that arm's best ladder shape, target-only
    included, from the planner's live cost fits; like Planner it tries a neighbouring shape every
    `explore_every` steps so the link and verifier fits keep seeing different tree sizes.

        routed = RoutedPlanner(router, session.pool)
        session.decoder.planner = routed
        routed.begin_turn(prompt)
        session.chat(prompt)
    """

    def __init__(self, router: Router, pool=None, **planner_fields) -> None:  # noqa: ANN001 - a DraftPool
        super().__init__(**planner_fields)
        router.planner = self            # one cost model: the router prices shapes with these fits
        self.router, self.pool = router, pool
        self.turn: Choice | None = None

    def begin_turn(self, request: str, recent: Sequence[str] = (), route: Route | None = None,
                   among: Collection[str] | None = None) -> Choice:
        """Route the turn (embedding unless `route` is given) and fix its arm (one of `among`)."""
        route = route or self.router.route(request, recent)
        self.turn = self.router.choose(route, drafting_only=True, among=among)
        if self.pool is not None and self.turn.arm is not None:
            self.pool.set_active(self.router.arms[self.turn.arm].spec.experts)
        return self.turn

    def choose(self) -> TreeShape:
        """The turn's arm's best shape by the router's rates (its draws of a_e(x), its drafting
        cost), exploring a neighbour under the same gate as Planner.choose once the arm has been
        observed LEARNING_STEPS times: only a shape that could pay, within EXPLORE_SHARE of the time
        (tried unconditionally, on a GPU verifier nearby every 16th step cost about a third of the speed)."""
        if self.turn is None:
            return super().choose()
        if self.turn.arm is None:   # no arm may draft this turn (e.g. none drafts alone under the sampled rule):
            # the router's choice, target-only, every step
            self.last_choice, self.last_why, self.last_rates = self.turn.rung, "arm", []
            return self.ladder[self.turn.rung]
        arm = self.router.arms[self.turn.arm]
        a_sibling = self.typical_acceptance()[1]

        def seconds(rung: int, optimistic: bool = False) -> float:
            return self.router.step_seconds(arm, rung, self.verify_flat(optimistic))

        rates = [tree_tokens(shape, self.turn.acceptance, a_sibling) / seconds(i) for i, shape in enumerate(self.ladder)]
        # an arm the router has seen fewer than LEARNING_STEPS times is tried regardless: its a_e(x)
        # is a prior, and only steps it drafts teach the router (and persist for the next session)
        return self._pick(rates, seconds, learning=arm.steps < LEARNING_STEPS)

    def observe(self, obs: StepObservation) -> None:
        shape = self.ladder[self.last_choice]
        super().observe(obs)
        if self.turn is None:
            return
        if obs.nodes > 0:
            depth = int(obs.depths.max()) if obs.depths is not None and obs.depths.size else obs.nodes
            cost = None if obs.catchup else obs.draft_s   # a catch-up's time is prefill, not this arm's drafting
            self.router.observe(self.turn, int(obs.accepted.sum()), depth, cost, obs.draft_decodes)
        elif shape.budget > 0 and obs.draft_decodes == 0:
            # A tree was asked for and the arm proposed nothing (a lookup without a match): for the
            # arm that is a rejected first node, or its acceptance would count only the steps it matched.
            self.router.observe(self.turn, 0, shape.max_depth, obs.draft_s, 0)

    def snapshot(self) -> dict:
        return {**super().snapshot(), "router": {"arm": self.turn.arm if self.turn else None,
                                                 "arms": self.router.snapshot()}}
