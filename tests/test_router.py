"""Router: learns which expert pays in which context, prices drafting against the planner's cost
model, and keeps what it learned across restarts.

The embedding model is the real all-MiniLM-L6-v2 int8 ONNX (fetched by `edgespec models fetch
router`); only the experts are synthetic: each accepts drafted tokens with a known probability per
domain, so the better choice is known exactly.
"""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.edge.planner import Planner, StepObservation
from edgespec.edge.router import ArmSpec, Router

CODE = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Implement binary search over a sorted list in Python.",
    "Fix the bug in this JavaScript: for (let i = 0; i <= arr.length; i++) sum += arr[i];",
    "Write a SQL query that counts orders per customer and sorts by the count.",
    "def parse_csv(path):\n    with open(path) as f:\n        return [line.split(',') for line in f]\n# add error handling",
    "Write a Rust function that reverses a vector in place.",
    "Implement a linked list class with push and pop methods in Java.",
    "Write a bash script that renames every .txt file in a directory to .md.",
    "Refactor this Python loop into a list comprehension: out = []\nfor x in xs:\n    out.append(x * 2)",
    "Write a C function that computes the length of a null-terminated string.",
    "Write a Python class for a stack with push, pop and peek, with type hints.",
    "Implement quicksort in Go.",
]
PROSE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a walk through an autumn forest in the morning.",
    "Write a poem about the sea at night.",
    "Tell me about the history of the Roman Empire in a few paragraphs.",
    "Write a heartfelt letter to an old friend you have not seen in years.",
    "Explain to a child why the sky is blue, in a friendly tone.",
    "Summarise the plot of a novel about a family moving to a new country.",
    "Write a travel diary entry about a rainy day in Lisbon.",
    "Describe your perfect weekend in the countryside.",
    "Write a fairy tale about a fox and a clever crow.",
    "Write a motivational speech for a graduating class.",
    "Describe the feeling of the first snow of winter.",
]
TRUE = {"code-expert": {"code": 0.9, "prose": 0.35}, "prose-expert": {"code": 0.4, "prose": 0.85}}


@pytest.fixture(scope="module")
def embedder():
    from edgespec.edge.embedding import Embedder
    return Embedder()


def remote_planner(rtt_s: float = 0.1, per_node_s: float = 0.002) -> Planner:
    """A planner that has measured a far verifier with cheap nodes (trees pay there)."""
    planner = Planner()
    for nodes in (0, 16, 4, 32, 8) * 3:
        planner.observe(StepObservation(
            nodes=nodes, draft_s=0.0, draft_decodes=0, network_s=rtt_s, bytes_up=48 + 8 * nodes,
            verify_s=0.01 + per_node_s * (nodes + 1), queue_s=0.0, scores=np.zeros(0), accepted=np.zeros(0, bool)))
    return planner


def drafted_run(rng: np.random.Generator, acceptance: float, depth: int) -> int:
    """Accepted depth of a chain whose every token is accepted with `acceptance`."""
    accepted = 0
    while accepted < depth and rng.random() < acceptance:
        accepted += 1
    return accepted


def train(router: Router, rng: np.random.Generator, prompts: dict[str, list[str]], turns: int,
          steps_per_turn: int = 4) -> list[bool]:
    """Simulated turns; returns, per turn, whether the router's first pick was the truly better expert."""
    right = []
    for _ in range(turns):
        domain = "code" if rng.random() < 0.5 else "prose"
        route = router.route(prompts[domain][rng.integers(len(prompts[domain]))])
        for step in range(steps_per_turn):
            choice = router.choose(route)
            if step == 0:
                right.append(choice.arm == f"{domain}-expert")
            if choice.arm is None:
                continue
            accepted = drafted_run(rng, TRUE[choice.arm][domain], choice.shape.max_depth)
            router.observe(choice, accepted, draft_s=0.002 * choice.shape.max_depth, decodes=choice.shape.max_depth)
    return right


def test_router_learns_the_better_expert_per_domain_and_generalises(embedder, tmp_path) -> None:
    rng = np.random.default_rng(7)
    arms = [ArmSpec("code-expert", seconds_per_decode=0.002), ArmSpec("prose-expert", seconds_per_decode=0.002)]
    router = Router(arms, planner=remote_planner(), embedder=embedder, state_path=tmp_path / "r.npz", seed=1)
    train_set = {"code": CODE[:8], "prose": PROSE[:8]}
    right = train(router, rng, train_set, turns=120)
    assert np.mean(right[-40:]) >= 0.85, right
    # Held-out prompts (never routed before): the posterior mean picks the right expert for each.
    for domain, held_out in (("code", CODE[8:]), ("prose", PROSE[8:])):
        for prompt in held_out:
            route = router.route(prompt)
            choice = router.choose(route, explore=False)
            believed = router.predicted(route)
            assert choice.arm == f"{domain}-expert", (prompt, believed)
            other = "prose-expert" if domain == "code" else "code-expert"
            assert believed[f"{domain}-expert"] > believed[other] + 0.1, (prompt, believed)
            assert choice.shape.budget > 0    # far verifier, cheap nodes: speculation pays


def test_router_maximises_tokens_per_second_not_acceptance(embedder, tmp_path) -> None:
    """An expert that accepts more but drafts 100x slower loses; with a verifier next door and dear
    nodes, no draft at all wins (AR is always a choice)."""
    rng = np.random.default_rng(3)
    arms = [ArmSpec("slow-accurate", seconds_per_decode=0.3), ArmSpec("fast", seconds_per_decode=0.003)]
    router = Router(arms, planner=remote_planner(), embedder=embedder, state_path=tmp_path / "r.npz", seed=2)
    truth = {"slow-accurate": 0.95, "fast": 0.8}
    route = router.route(CODE[0])
    for _ in range(60):  # both measured: forced alternation, so each gets evidence
        for arm in truth:
            choice = router.choose(route)
            shape = router.planner.ladder[2]   # chain(4) for both
            choice = type(choice)(arm, shape, 2, choice.tokens, choice.seconds, choice.acceptance, route)
            router.observe(choice, drafted_run(rng, truth[arm], shape.max_depth), draft_s=router.arms[arm].spec.seconds_per_decode * 4, decodes=4)
    believed = router.predicted(route)
    assert believed["slow-accurate"] > believed["fast"]
    assert router.choose(route, explore=False).arm == "fast"

    near = Router(arms, planner=remote_planner(rtt_s=0.0, per_node_s=0.05), embedder=embedder,
                  state_path=tmp_path / "near.npz")
    choice = near.choose(near.route(CODE[0]), explore=False)
    assert choice.arm is None and choice.shape.budget == 0


def test_router_state_round_trips(embedder, tmp_path) -> None:
    rng = np.random.default_rng(5)
    path = tmp_path / "state" / "router.npz"
    arms = [ArmSpec("code-expert", 0.002), ArmSpec("prose-expert", 0.002)]
    router = Router(arms, planner=remote_planner(), embedder=embedder, state_path=path, seed=4, save_every=0)
    train(router, rng, {"code": CODE, "prose": PROSE}, turns=30)
    router.save()
    assert sorted(p.name for p in path.parent.iterdir()) == ["router.npz"]   # no temp file left behind

    again = Router([*arms, ArmSpec("new-expert", 0.002)], planner=remote_planner(), embedder=embedder, state_path=path)
    for prompt in (CODE[0], PROSE[0]):
        route = router.route(prompt)
        before, after = router.predicted(route), again.predicted(route)
        for name in ("code-expert", "prose-expert"):
            assert after[name] == pytest.approx(before[name], abs=1e-9)
        assert after["new-expert"] == pytest.approx(0.5, abs=0.05)   # unseen expert: the prior
    assert again.arms["code-expert"].steps == router.arms["code-expert"].steps > 0
    assert again.arms["code-expert"].per_decode_s == pytest.approx(router.arms["code-expert"].per_decode_s)

    # route_async gives the same context vector, computed off the caller's thread.
    assert np.allclose(again.route_async(PROSE[1]).result(timeout=60).x, again.route(PROSE[1]).x)
    again.close()

    # A state learned over another embedding model is not adopted: fresh start at the prior.
    with np.load(path) as z:
        arrays = dict(z)
    arrays["model_id"] = np.array("another-embedding-model")
    np.savez(path, **arrays)
    other = Router(arms, planner=remote_planner(), embedder=embedder, state_path=path)
    assert other.load() is False
    assert other.predicted(router.route(CODE[0]))["code-expert"] == pytest.approx(0.5)


def test_routed_planner_drives_a_real_session_losslessly(smol_path, smol_model, embedder, tmp_path) -> None:
    """The router in the planner's seat of a real EdgeSession with a draft pool (SmolLM2 as draft and
    target, lookup expert): each turn activates its arm's experts, every verified step is evidence
    for that arm, and the output is still the target's own greedy output."""
    from lossless import assert_lossless, spec_tokens, target_only_greedy

    from edgespec import EdgeSession
    from edgespec.edge.router import RoutedPlanner

    arms = [ArmSpec("draft", 0.02), ArmSpec("lookup", 0.0002), ArmSpec("lookup+draft", 0.02, members=("lookup", "draft"))]
    router = Router(arms, embedder=embedder, state_path=tmp_path / "router.npz", seed=3)
    text = "Repeat this list exactly twice: apples, pears, plums, cherries, figs, dates, limes."
    with EdgeSession(smol_path, smol_path, local=True, n_ctx=1024, lookup=True) as session:
        routed = RoutedPlanner(router, session.pool)
        session.decoder.planner = routed
        prompt = session.draft_model.chat_tokens([{"role": "user", "content": text}])
        ref = target_only_greedy(smol_model, prompt, 40)
        for _ in range(3):
            turn = routed.begin_turn(text)
            assert session.pool.active == list(router.arms[turn.arm].spec.experts)
            assert_lossless(spec_tokens(session, prompt, 40), ref, f"routed-{turn.arm}")
        snapshot = session.stats.extra["planner"]["router"]
    steps = sum(arm.steps for arm in router.arms.values())
    assert steps > 0 and snapshot["arm"] in router.arms
    router.close()
    assert (tmp_path / "router.npz").is_file()


def test_integer_graph_embeds_like_the_shipped_graph(embedder) -> None:
    """The rewritten graph (int8 arithmetic) points where the shipped one does, and a long text is
    cut head and tail to max_tokens ids ([CLS] ... [SEP])."""
    from edgespec.edge.embedding import Embedder

    shipped = Embedder(integer=False)
    assert embedder.model_id.endswith("+dqmatmul") and not shipped.model_id.endswith("+dqmatmul")
    texts = CODE[:4] + PROSE[:4]
    cosine = (embedder.embed(texts) * shipped.embed(texts)).sum(axis=1)
    assert cosine.min() > 0.98, cosine
    short = Embedder(max_tokens=16)
    ids = short.token_ids("alpha " * 5000 + "the final instruction")
    assert len(ids) == 16 and ids[0] == 101 and ids[-1] == 102
    assert short.tokenizer.decode(ids).endswith("the final instruction")


EDIT = ("Rename the variable total to running_sum in this code and show the whole code again:\n"
        "def add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n    return total\n")


def test_session_router_learns_persists_and_stays_lossless(smol_path, smol_model, tmp_path) -> None:
    """EdgeSession(router=path) on real llama.cpp (SmolLM2 as draft and target): every turn drafts with
    the arm the router picked, greedy output equals the target's own, the sampled rejection rule gets
    the model alone, and what was learned is adopted by the next session from the same file."""
    from lossless import assert_lossless, spec_tokens, target_only_greedy

    from edgespec import EdgeSession
    from edgespec.common.sampling import SamplingParams

    state = tmp_path / "router" / "state.npz"
    with EdgeSession(smol_path, smol_path, local=True, n_ctx=1024, router=state) as session:
        router = session.router
        assert set(router.arms) == {"draft", "lookup", "lookup+draft"}
        assert session.decoder.planner is session._routed
        for text in (EDIT, "Repeat this list exactly twice: apples, pears, plums, cherries, figs.", EDIT):
            prompt = session.draft_model.chat_tokens([{"role": "user", "content": text}])
            assert_lossless(spec_tokens(session, prompt, 40), target_only_greedy(smol_model, prompt, 40), "routed")
            turn = session._routed.turn
            assert session.pool.active == list(router.arms[turn.arm].spec.experts)
        answer = session.chat([{"role": "user", "content": EDIT}, {"role": "assistant", "content": "def add_all"},
                               {"role": "user", "content": "Now also rename values to numbers."}], max_tokens=24)
        assert answer.strip()
        session.chat("Write a haiku.", max_tokens=8, temperature=0.8, seed=1, sampling_rule="rejection")
        assert session._routed.turn.arm == "draft"   # the rejection rule needs the model's q
        assert SamplingParams(temperature=0.8, rule="rejection").needs_q
        learned = {name: (arm.steps, arm.A.copy()) for name, arm in router.arms.items()}
    assert sum(steps for steps, _ in learned.values()) > 0
    assert state.is_file()

    with EdgeSession(smol_path, smol_path, local=True, n_ctx=1024, router=state) as again:
        for name, (steps, A) in learned.items():
            assert again.router.arms[name].steps == steps
            assert np.allclose(again.router.arms[name].A, A)


def test_cli_router_flag(smol_path, tmp_path) -> None:
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edgespec", "run", *args], capture_output=True, text=True,
                              timeout=300)

    models = ("--local", "--draft", str(smol_path), "--target", str(smol_path), "--max-tokens", "40")
    state = tmp_path / "state.npz"
    # 40 tokens: past the planner's first exploring step (a CPU verifier next door: target-only
    # otherwise), so some step drafts, the router learns, and close() saves it.
    r = cli("Count from 1 to 40, separated by commas.", *models, "--router", str(state))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "router: chose " in r.stderr and str(state) in r.stderr
    assert state.is_file()
    for bad in (["--router", str(state), "--chain", "4"], ["--router", str(tmp_path)], ["--router", " "]):
        r = cli("Say hello.", *models, *bad)   # refused before any model loads
        assert r.returncode == 2, (bad, r.stderr)
        assert "--router" in r.stderr


def test_routed_planner_counts_a_lookup_without_match_as_a_miss(embedder, tmp_path) -> None:
    """A step that asked for a tree and got nothing from a model-free arm is evidence against it
    (otherwise the lookup's acceptance would be measured on its matching steps only); a model tree
    pruned to the root by the planner is not."""
    from edgespec.edge.router import RoutedPlanner

    router = Router([ArmSpec("lookup", 0.0, 0.002), ArmSpec("draft", 0.03)], embedder=embedder,
                    state_path=tmp_path / "r.npz", save_every=0)
    routed = RoutedPlanner(router)
    route = router.route(CODE[0])
    prior = router.predicted(route)["lookup"]

    def empty_step(decodes: int) -> StepObservation:
        return StepObservation(nodes=0, draft_s=0.002, draft_decodes=decodes, network_s=0.05, bytes_up=48,
                               verify_s=0.01, queue_s=0.0, scores=np.zeros(0), accepted=np.zeros(0, bool))

    routed.begin_turn(CODE[0], route=route, among=["lookup"])
    for _ in range(10):
        routed.last_choice = 2          # chain(4) was asked for
        routed.observe(empty_step(0))
    assert router.arms["lookup"].steps == 10 and router.predicted(route)["lookup"] < prior - 0.2
    routed.begin_turn(CODE[0], route=route, among=["draft"])
    routed.last_choice = 2
    routed.observe(empty_step(4))       # the model drafted; the planner sent nothing
    assert router.arms["draft"].steps == 0


def test_routed_planner_stays_target_only_when_no_arm_may_draft(embedder, tmp_path) -> None:
    """A turn with no eligible arm (begin_turn among none: e.g. no arm drafts alone under the sampled
    rule) is target-only on every step, however well the shared planner has seen trees accepted."""
    from edgespec.edge.router import RoutedPlanner

    router = Router([ArmSpec("lookup", 0.0, 0.002), ArmSpec("draft", 0.03)], embedder=embedder,
                    state_path=tmp_path / "r.npz", save_every=0)
    routed = RoutedPlanner(router)
    route = router.route(CODE[0])
    routed.begin_turn(CODE[0], route=route, among=["draft"])
    for _ in range(30):   # the draft arm's chains were all accepted
        routed.choose()
        routed.observe(StepObservation(nodes=4, draft_s=0.004, draft_decodes=4, network_s=0.05, bytes_up=80,
                                       verify_s=0.01, queue_s=0.0, scores=np.full(4, 0.95), accepted=np.ones(4, bool),
                                       depths=np.arange(1, 5), shape="chain4"))
    turn = routed.begin_turn(CODE[0], route=route, among=[])
    assert turn.arm is None
    assert all(routed.choose().budget == 0 and not routed.exploring for _ in range(2 * routed.explore_every))


def test_a_catch_up_step_teaches_the_arm_its_acceptance_but_not_its_drafting_cost(embedder, tmp_path) -> None:
    """A model arm's first tree after turns it sat out prefills the whole lag first (seconds on a CPU). That step's
    acceptance is evidence; its time is not what the arm's decodes cost (router mode learned 894 ms a decode
    from such steps on the 2-core box), so neither the arm nor the planner learns a cost from it."""
    from edgespec.edge.router import RoutedPlanner

    router = Router([ArmSpec("draft", 0.03)], embedder=embedder, state_path=tmp_path / "r.npz", save_every=0)
    routed = RoutedPlanner(router)
    route = router.route(CODE[0])

    def step(draft_s: float, catchup: bool) -> StepObservation:
        return StepObservation(nodes=4, draft_s=draft_s, draft_decodes=4, network_s=0.05, bytes_up=80,
                               verify_s=0.01, queue_s=0.0, scores=np.full(4, 0.9), accepted=np.ones(4, bool),
                               depths=np.arange(1, 5), shape="chain4", catchup=catchup)

    routed.begin_turn(CODE[0], route=route)
    routed.last_choice = routed.ladder.index(next(s for s in routed.ladder if s.label == "chain4"))
    routed.observe(step(0.12, catchup=False))          # 30 ms a decode, as the prior says
    arm = router.arms["draft"]
    cost, planner_cost, steps = arm.per_decode_s, routed.draft_per_decode_s, arm.steps
    routed.observe(step(3.0, catchup=True))            # 3 s: a prefill of the lagging context, then 4 decodes
    assert arm.steps == steps + 1                      # its acceptance counted
    assert arm.per_decode_s == cost and routed.draft_per_decode_s == planner_cost
    routed.observe(step(3.0, catchup=False))           # the same time from drafting would raise both
    assert arm.per_decode_s > cost and routed.draft_per_decode_s > planner_cost
