"""The tree planner's cost model: it learns link, verifier and acceptance figures from observations
and picks bigger trees when round trips are expensive, smaller ones when nodes are expensive."""
import numpy as np

from edgespec.edge.drafting import TreeShape
from edgespec.edge.planner import EXPLORE_SHARE, Planner, StepObservation


def feed(planner, rtt_s, bandwidth_bps, verify_fixed_s, verify_per_node_s, accept_fn, steps=60, seed=0, queue_s=0.0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        shape = planner.choose()
        nodes = shape.budget
        scores = np.sort(rng.uniform(0, 1, nodes))[::-1]
        bytes_up = 40 + 12 * nodes
        planner.observe(StepObservation(
            nodes=nodes, draft_s=0.02 * shape.max_depth, draft_decodes=shape.max_depth,
            network_s=rtt_s + bytes_up / bandwidth_bps, bytes_up=bytes_up,
            verify_s=verify_fixed_s + verify_per_node_s * (nodes + 1), queue_s=queue_s,
            scores=scores, accepted=rng.uniform(size=nodes) < accept_fn(scores)))
    return planner


def test_learns_link_and_verifier_costs():
    p = feed(Planner(explore_every=3), rtt_s=0.05, bandwidth_bps=1.25e6, verify_fixed_s=0.01,
             verify_per_node_s=0.002, accept_fn=lambda s: s)
    snap = p.snapshot()
    assert abs(snap["rtt_ms"] - 50) < 5
    assert abs(snap["uplink_mbit_s"] - 10) < 2
    assert abs(snap["verify_ms_per_node"] - 2) < 0.3
    # calibration: acceptance rises with the draft score (accept_fn = identity)
    acc = p.acceptance(np.array([0.03, 0.4, 0.95]))
    assert acc[0] < acc[1] < acc[2]


def test_expensive_round_trips_favour_big_trees_and_expensive_nodes_small_ones():
    far = feed(Planner(), rtt_s=0.2, bandwidth_bps=12.5e6, verify_fixed_s=0.01, verify_per_node_s=0.0002,
               accept_fn=lambda s: s)
    near = feed(Planner(), rtt_s=0.0, bandwidth_bps=12.5e6, verify_fixed_s=0.01, verify_per_node_s=0.05,
                accept_fn=lambda s: s)
    assert far.choose().budget > near.choose().budget
    # 50 ms per verified node and no round trip to save: drafting cannot pay, plain decoding wins
    assert near.choose().budget == 0
    assert far.choose().budget >= 16


def test_load_makes_nodes_dearer_and_prunes():
    args = dict(rtt_s=0.02, bandwidth_bps=12.5e6, verify_fixed_s=0.01, verify_per_node_s=0.003, accept_fn=lambda s: s)
    p = feed(Planner(), **args)
    scores = np.linspace(1, 0.01, 64)
    calm = p.prune_size(scores)
    feed(p, **args, steps=20, queue_s=1.0)   # same costs, but the verifier now reports long queues
    assert p.load_factor > 1.5
    assert p.prune_size(scores) < calm


def test_acceptance_is_corrected_per_depth():
    """A draft that is over-confident deep in the tree: the score bins alone cannot see it (the same
    scores occur at every depth), the per-depth correction does, and pruning then sends fewer deep
    nodes."""
    rng = np.random.default_rng(1)
    p = Planner()
    for _ in range(80):
        scores = rng.uniform(0, 1, 24)
        depths = rng.integers(1, 7, 24)
        accept = rng.uniform(size=24) < np.where(depths <= 2, scores, 0.1 * scores)
        p.observe(StepObservation(nodes=24, draft_s=0.1, draft_decodes=6, network_s=0.05, bytes_up=300,
                                  verify_s=0.05 + 0.004 * 25, queue_s=0.0, scores=scores, accepted=accept,
                                  depths=depths))
    corr = p.depth_correction
    assert corr[1] > 1.2 and corr[2] > 1.2 and (corr[3:7] < 0.4).all(), corr
    probe = np.array([0.6, 0.6])
    shallow, deep = p.acceptance(probe, np.array([1, 5]))
    assert shallow > 0.45 and deep < 0.15, (shallow, deep)
    assert abs(p.acceptance(np.array([0.6]))[0] - 0.6 * (2 + 4 * 0.1) / 6) < 0.1  # bins: the mix of depths
    by_depth = p.snapshot()["acceptance_by_depth"]
    assert sorted(by_depth) == [1, 2, 3, 4, 5, 6] and by_depth[5]["correction"] < 0.4
    scores = np.linspace(0.95, 0.3, 30)
    chain_depths = np.arange(1, 31)   # a long chain: everything past depth 2 is worth little
    wide_depths = np.repeat([1, 2], 15)
    assert p.prune_size(scores, depths=chain_depths) < p.prune_size(scores, depths=wide_depths)


def test_exploration_is_rarer_when_the_neighbour_is_known_to_be_far_worse():
    """Round trips cost nothing and nodes a lot: target-only is best; once chain(2) has been tried
    and found far worse it is tried every 4th exploration slot only. With a far link and cheap
    nodes (a GPU verifier far away) the planner leaves target-only and keeps exploring."""
    def explorations(planner: Planner, steps: int, **costs) -> tuple[int, Planner]:
        tried, choose = 0, planner.choose

        def counting_choose():
            nonlocal tried
            shape = choose()
            tried += planner.exploring
            assert planner.last_why == ("explore" if planner.exploring else "best")   # no request: no try
            return shape

        planner.choose = counting_choose
        feed(planner, **costs, steps=steps)
        return tried, planner

    near, p = explorations(Planner(), 500, rtt_s=0.0, bandwidth_bps=12.5e6, verify_fixed_s=0.03,
                           verify_per_node_s=0.02, accept_fn=lambda s: 0.1 * s)
    assert p.choose().budget == 0 and p.realized[1][0] >= 3
    # 3 tries to learn, then only within EXPLORE_SHARE of the time (each try here ~0.1 s of ~25 s)
    assert 3 < near < 500 // 16 and p.explore_seconds <= EXPLORE_SHARE * p.wall_seconds + 0.3
    # every cost per node and no round trip: while the verifier's slope is known from a tried chain,
    # even a chain accepted 90 % of the time cannot beat plain decoding and is not tried; it is tried
    # again only once the tried sizes have left the fit's window (64 steps)
    rare, p = explorations(Planner(), 500, rtt_s=0.0, bandwidth_bps=12.5e6, verify_fixed_s=0.0,
                           verify_per_node_s=0.06, accept_fn=lambda s: 0.5 * s)
    assert p.choose().budget == 0 and 1 <= rare <= 500 // 64 + 1
    far, p = explorations(Planner(), 500, rtt_s=0.2, bandwidth_bps=12.5e6, verify_fixed_s=0.01,
                          verify_per_node_s=0.0005, accept_fn=lambda s: s)
    assert p.choose().budget >= 16
    assert p.explore_seconds <= EXPLORE_SHARE * p.wall_seconds + 1.0   # trying shapes is paid in time: capped


def test_fast_verifier_and_slow_draft_stay_target_only_within_the_exploration_cap():
    """A GPU verifier next door (4 ms per target-only step) and a draft model at 35 ms per decode
    (measured so on the H200 host, docs/BENCHMARKS.md): every drafted tree costs far more than
    the tokens it saves. The planner must stay target-only, and what it spends trying other shapes
    must stay within EXPLORE_SHARE of the time: otherwise it falls below plain decoding."""
    p = Planner()
    rng = np.random.default_rng(2)
    for _ in range(400):
        shape = p.choose()
        nodes = shape.budget
        scores = np.sort(rng.uniform(0, 1, nodes))[::-1]
        p.observe(StepObservation(nodes=nodes, draft_s=0.035 * (shape.max_depth if nodes else 0),
                                  draft_decodes=shape.max_depth if nodes else 0, network_s=0.0015,
                                  bytes_up=40 + 8 * nodes, verify_s=0.0022 + 0.00001 * nodes, queue_s=0.0,
                                  scores=scores, accepted=rng.uniform(size=nodes) < 0.8 * scores,
                                  shape=shape.label))
    assert p.choose().budget == 0
    assert p.explore_seconds <= EXPLORE_SHARE * p.wall_seconds


def test_drafting_ahead_hides_the_draft_behind_the_round_trip():
    """Trees that were drafted ahead and sent cost max(draft, round trip), not the sum: at 100 ms
    RTT and 4 x 35 ms of drafting, chain(4) costs ~140 ms a step when every prepared tree is a hit,
    245 ms when none is."""
    p = Planner(network=Planner().network)
    for _ in range(5):
        p.network.add(48, 0.1)
    p.verify.add(1, 0.002)
    p.draft_per_decode_s = 0.035
    p.prepared_share = 1.0
    hidden = p.step_seconds(4, 4)
    p.prepared_share = 0.0
    exposed = p.step_seconds(4, 4)
    assert abs(hidden - 0.14) < 0.01 and abs(exposed - 0.245) < 0.01, (hidden, exposed)


def test_realized_tokens_go_to_the_rung_that_drafted_the_tree():
    """A pipelined decoder chooses (and drafts) the next tree before this one is answered: what a
    tree achieved is credited to the shape it was drafted with, not to the newer choice. Credited to
    target-only, a deep tree's tokens made plain decoding look several tokens per step, and the
    planner then stayed target-only (it never observes itself there to correct it)."""
    p = Planner()
    tree32 = next(i for i, s in enumerate(p.ladder) if s.label == "tree32")
    p.last_choice = 0  # the next tree (drafted ahead) is target-only
    for _ in range(4):
        p.observe(StepObservation(nodes=32, draft_s=0.2, draft_decodes=8, network_s=0.4, bytes_up=300,
                                  verify_s=0.1, queue_s=0.0, scores=np.full(32, 0.9),
                                  accepted=np.arange(32) < 7, shape="tree32"))
    assert 0 not in p.realized and p.realized[tree32] == (4, 8.0)
    assert p.expected_tokens(0) == 1.0


def test_each_shape_is_priced_with_its_own_drafting_cost():
    """One 8-wide tree level cost 5x a chain's decode on the H200 host's CPU (195 vs 35 ms). After
    one such tree, chains must still be priced at their own decode cost, and the wide tree at its
    own: one shared per-decode figure kept the planner away from chain(4), 1.5x faster there."""
    p = Planner()
    rungs = {s.label: i for i, s in enumerate(p.ladder)}
    for _ in range(5):
        p.observe(StepObservation(nodes=0, draft_s=0.0, draft_decodes=0, network_s=0.05, bytes_up=48,
                                  verify_s=0.002, queue_s=0.0, scores=np.zeros(0), accepted=np.zeros(0, bool)))
    p.observe(StepObservation(nodes=64, draft_s=10 * 0.195, draft_decodes=10, network_s=0.05, bytes_up=560,
                              verify_s=0.0025, queue_s=0.0, scores=np.full(64, 0.3), accepted=np.arange(64) < 2,
                              shape="tree64"))
    for _ in range(3):
        p.observe(StepObservation(nodes=4, draft_s=4 * 0.035, draft_decodes=4, network_s=0.05, bytes_up=80,
                                  verify_s=0.002, queue_s=0.0, scores=np.full(4, 0.9), accepted=np.ones(4, bool),
                                  shape="chain4"))
    assert p._seconds(rungs["tree64"]) > 1.0 > 0.3 > p._seconds(rungs["chain4"])
    assert p.choose().label == "chain4"


def test_line_fit_is_least_squares_over_its_window():
    """The fits run on every step in O(1) sums (no numpy): they must equal np.polyfit over the
    window whenever x spreads enough to tell slope from intercept."""
    from edgespec.edge.planner import _LineFit

    rng = np.random.default_rng(0)
    for fixed_first in (False, True):
        fit, checked = _LineFit(window=8, fixed_first=fixed_first), 0
        for _ in range(300):
            fit.add(float(rng.integers(1, 40)), float(rng.uniform(0, 1)))
            xs, ys = np.array(fit.points).T
            if len(xs) >= 3 and np.ptp(xs) > 0.25 * xs.mean():
                b, a = np.polyfit(xs, ys, 1)
                assert abs(max(b, 0.0) - fit.b) < 1e-9
                assert abs(max(ys.mean() - max(b, 0.0) * xs.mean(), 0.0) - fit.a) < 1e-9
                checked += 1
        assert checked > 250


def test_a_tree_cut_to_the_root_counts_against_its_shape():
    """A chain drafted (and paid for) but pruned to the root yields one token: that is what the
    shape achieved. Left out, chain2 looked as good as its few confident trees and was chosen on 55
    of 56 steps at τ 1.14 (H200 host, 50 ms, 2026-12-01)."""
    p = Planner()
    chain2 = next(i for i, s in enumerate(p.ladder) if s.label == "chain2")
    cut = StepObservation(nodes=0, draft_s=0.07, draft_decodes=2, network_s=0.05, bytes_up=48, verify_s=0.002,
                          queue_s=0.0, scores=np.zeros(0), accepted=np.zeros(0, bool), shape="chain2")
    full = StepObservation(nodes=2, draft_s=0.07, draft_decodes=2, network_s=0.05, bytes_up=64, verify_s=0.002,
                           queue_s=0.0, scores=np.array([0.9, 0.8]), accepted=np.ones(2, bool),
                           depths=np.array([1, 2]), shape="chain2")
    for obs in (full, cut, cut, cut):
        p.observe(obs)
    count, mean = p.realized[chain2]
    assert count == 4 and abs(mean - (3 + 1 + 1 + 1) / 4) < 1e-9
    assert abs(p.decode_s_by_rung[chain2] - 0.035) < 1e-9


def test_pruning_does_not_price_the_drafting_already_spent():
    """Once a tree is drafted its drafting is spent whatever is sent: with a slow draft (35 ms a
    decode) and a verifier whose nodes are nearly free, confident nodes are sent, not cut to the
    root (which also stops the next tree being drafted ahead)."""
    p = Planner(network=Planner().network)
    for _ in range(5):
        p.network.add(48, 0.05)
    p.verify.add(1, 0.002)
    p.verify.add(65, 0.003)
    p.draft_per_decode_s = 0.035
    p.prepared_share = 0.0
    assert p.prune_size(np.array([0.9, 0.8, 0.6, 0.4])) >= 3


def test_a_ladder_of_one_shape_never_explores_past_its_end():
    """A planner given one shape (e.g. target-only alone) keeps choosing it, exploration steps included."""
    only = TreeShape.target_only()
    p = Planner(ladder=(only,), last_choice=0)
    for _ in range(3 * p.explore_every):
        assert p.choose() == only
        p.observe(StepObservation(nodes=0, draft_s=0.0, draft_decodes=0, network_s=0.05, bytes_up=48,
                                  verify_s=0.08, queue_s=0.0, scores=np.zeros(0), accepted=np.zeros(0, bool)))


def observe_tree(p, shape, nodes, accepted, steps=1, per_node_s=0.06):
    for _ in range(steps):
        p.observe(StepObservation(nodes=nodes, draft_s=0.03 * nodes, draft_decodes=nodes, network_s=0.05,
                                  bytes_up=48 + 8 * nodes, verify_s=0.2 + per_node_s * nodes, queue_s=0.0,
                                  scores=np.full(nodes, 0.8), accepted=np.arange(nodes) < accepted, shape=shape))


def remote_step(p, label, nodes, accepted, decode_s, verify_fixed_s=0.002, verify_node_s=0.0, score=0.6):
    """One verified tree 100 ms away: `decode_s` a drafting decode (one per depth), verification taking
    verify_fixed_s + verify_node_s a node (root included), the path's first `accepted` nodes accepted."""
    verify_s = verify_fixed_s + verify_node_s * (nodes + 1)
    p.observe(StepObservation(nodes=nodes, draft_s=decode_s * nodes, draft_decodes=nodes, network_s=0.1,
                              bytes_up=48 + 8 * nodes, verify_s=verify_s, queue_s=0.0, scores=np.full(nodes, score),
                              accepted=np.arange(nodes) < accepted, depths=np.arange(1, nodes + 1), shape=label,
                              wall_s=0.1 + decode_s * nodes + verify_s))


def test_a_new_request_relearns_what_drafting_realizes_from_its_first_trees():
    """Acceptance depends on the text: after a prose request where chain4 realized 1 token, a code
    request's first chain4 tree (5 tokens) replaces the shape's figure, not moving it by 1/8 per
    tree; later trees of the request average in; on prose after code the first tree halves the
    gap and the request's next trees take it down to what they realize."""
    p = Planner()
    chain4 = next(i for i, s in enumerate(p.ladder) if s.label == "chain4")
    p.begin_request()
    observe_tree(p, "chain4", 4, 0, steps=10)            # prose: nothing accepted
    assert p.realized[chain4] == (10, 1.0)
    p.begin_request()
    observe_tree(p, "chain4", 4, 4)                       # code: all four accepted
    assert p.realized[chain4] == (11, 5.0)
    observe_tree(p, "chain4", 4, 2)                       # 3 tokens: the mean of the request's two trees
    assert p.realized[chain4] == (12, 4.0)
    for _ in range(20):
        observe_tree(p, "chain4", 4, 4)
    assert p.realized[chain4][1] > 4.9
    p.begin_request()                                     # prose again: a first tree that did worse
    before = p.realized[chain4][1]                        # halves the gap (one unlucky tree does not
    observe_tree(p, "chain4", 4, 0)                       # write the shape off for the request) ...
    assert p.realized[chain4][1] == (before + 1.0) / 2
    observe_tree(p, "chain4", 4, 0, steps=3)              # ... and the request's later trees average in
    assert p.realized[chain4][1] < 1.5


def test_a_new_request_first_tries_a_drafted_shape_when_target_only_is_chosen():
    """After prose taught the planner that drafting does not pay, a new request still starts with one
    small drafted tree (unpruned, as an exploration) instead of a whole answer of target-only steps;
    accepted to its depth, it tries the next shape up; if drafting pays the planner keeps drafting,
    otherwise it goes back to target-only."""
    p = Planner(ladder=(TreeShape.target_only(), TreeShape.chain(2), TreeShape.chain(4)))
    chain2, chain4 = 1, 2
    for _ in range(20):   # target-only steps: 50 ms round trip, 200 ms verify
        p.observe(StepObservation(nodes=0, draft_s=0.0, draft_decodes=0, network_s=0.05, bytes_up=48,
                                  verify_s=0.2, queue_s=0.0, scores=np.zeros(0), accepted=np.zeros(0, bool)))
    for label, n in (("chain2", 2), ("chain4", 4)):
        observe_tree(p, label, n, 0, steps=4, per_node_s=0.02)
    assert p.choose() == TreeShape.target_only()
    p.begin_request()
    first = p.choose()
    assert first.budget > 0 and p.exploring and p.last_choice == chain2   # the smallest drafted shape
    assert p.last_why == "try"
    assert p.choose() == TreeShape.target_only() and p.last_why == "best"   # one try per request
    observe_tree(p, first.label, first.budget, first.budget, per_node_s=0.02)
    assert p.choose() == p.ladder[chain4] and p.exploring    # accepted to its depth: one shape up
    observe_tree(p, "chain4", 4, 4, per_node_s=0.02)
    assert p.choose().budget > 0                          # it paid: keep drafting
    p.begin_request()                                     # prose again: trees that accept nothing
    drafted = []
    for _ in range(12):
        shape = p.choose()
        if not shape.budget:
            break
        drafted.append(shape.label)
        observe_tree(p, shape.label, shape.budget, 0, per_node_s=0.02)
    assert not shape.budget, f"still drafting after {drafted}"
    assert len(drafted) >= 3, "written off after one or two unlucky trees"


def test_shapes_a_request_has_not_drafted_are_priced_with_its_acceptance():
    """A code answer drafted with chain2 accepting every node predicts chain4 from that acceptance,
    not from what chain4 realized on the prose before (1 token), so the planner can move up to it."""
    from edgespec.edge.planner import tree_tokens

    p = Planner(ladder=(TreeShape.target_only(), TreeShape.chain(2), TreeShape.chain(4)))
    p.begin_request()
    observe_tree(p, "chain4", 4, 0, steps=4)              # prose: chain4 realizes 1 token
    assert p.expected_tokens(2) == 1.0
    p.begin_request()
    assert p.expected_tokens(2) == 1.0                    # no evidence in this request yet: the old figure
    observe_tree(p, "chain2", 2, 2, steps=2)              # code: 4 of 4 path nodes accepted
    a_sibling = p.typical_acceptance()[1]
    assert p.expected_tokens(1) == 3.0
    assert abs(p.expected_tokens(2) - tree_tokens(p.ladder[2], 5 / 6, a_sibling)) < 1e-9 and p.expected_tokens(2) > 3.5


def test_a_shape_with_one_poor_tree_in_a_request_is_raised_by_the_requests_acceptance():
    """A code answer whose first chain4 tree missed at its root, then whose chain2 trees were accepted whole: chain4
    is priced from the request's path acceptance (as a shape it never drafted would be) until it has drafted
    REQUEST_RETRIES trees, not held at its halved figure. Held there, a simulated 200 ms link kept code answers on
    tree8 (~400 ms a step for 6 tokens) where chain4 steps took ~205 ms for 5 (tools/bench_planner_sim.py)."""
    from edgespec.edge.planner import REQUEST_RETRIES, tree_tokens

    p = Planner(ladder=(TreeShape.target_only(), TreeShape.chain(2), TreeShape.chain(4)))
    p.begin_request()
    observe_tree(p, "chain4", 4, 4, steps=6)              # code: chain4 realizes 5 tokens
    p.begin_request()
    observe_tree(p, "chain4", 4, 0)                       # this answer's first tree misses at the root ...
    halved = p.realized[2][1]
    assert halved == 3.0
    observe_tree(p, "chain2", 2, 2, steps=3)              # ... and its chain2 trees are accepted whole
    a_sibling = p.typical_acceptance()[1]
    raised = tree_tokens(p.ladder[2], (6 + 1) / (7 + 2), a_sibling)   # 6 of 7 path nodes accepted
    assert abs(p.expected_tokens(2) - raised) < 1e-9 and raised > halved
    observe_tree(p, "chain4", 4, 0, steps=REQUEST_RETRIES - 1)   # its own trees decide once it has enough of them
    assert p.expected_tokens(2) == p.realized[2][1] < halved


def test_shapes_a_request_has_not_drafted_are_scaled_by_what_its_trees_achieved():
    """Prose after code: the request's chain4 trees accept nothing of the ~4 drafts earlier requests predicted
    for them, so tree32, never drafted, is priced down by the same shortfall instead of at the confidence
    code taught the score bins (which made every untried shape look better than the ones prose had tried).
    chain2, smaller than any shape drafted, keeps its earlier price: cheap to find out about, it is not written off."""
    from edgespec.edge.planner import REQUEST_RATIO_PRIOR

    p = Planner()
    chain2, chain4, tree32 = p.rung_of("chain2"), p.rung_of("chain4"), p.rung_of("tree32")
    p.begin_request()
    observe_tree(p, "chain4", 4, 4, steps=12)             # code: every node accepted
    observe_tree(p, "chain2", 2, 2, steps=3)
    assert p.realized[chain4][1] == 5.0 and p.realized[chain2][1] == 3.0
    p.begin_request()
    untried = p.expected_tokens(tree32)
    assert untried > 3 and p._request_ratio() == 1.0      # nothing drafted yet: earlier requests' price
    observe_tree(p, "chain4", 4, 0, steps=6)              # prose: nothing accepted
    ratio = REQUEST_RATIO_PRIOR / (6 * 4 + REQUEST_RATIO_PRIOR)   # 0 of 6 × 4 predicted drafts accepted
    assert abs(p._request_ratio() - ratio) < 1e-9
    assert p.expected_tokens(tree32) < 1 + 0.25 * (untried - 1)
    assert p.expected_tokens(chain2) == 3.0
    p.begin_request()                                     # a request doing better than predicted: no raise
    observe_tree(p, "chain4", 4, 4, steps=3)
    assert p._request_ratio() == 1.0
    p.requests = 0                                        # one open-ended run: no per-request scaling
    assert p._request_ratio() == 1.0


def test_a_pruned_tree_accepted_whole_does_not_climb():
    """A chain2 tree that pruning cut to one node, accepted, says nothing about chain4 (on prose that
    climbed to tree8 and tree16 and cost seconds of drafting)."""
    p = Planner(ladder=(TreeShape.target_only(), TreeShape.chain(2), TreeShape.chain(4)))
    p.begin_request()
    p.choose()
    p.observe(StepObservation(nodes=1, draft_s=0.06, draft_decodes=2, network_s=0.05, bytes_up=56, verify_s=0.22,
                              queue_s=0.0, scores=np.array([0.9]), accepted=np.ones(1, bool),
                              depths=np.array([1]), shape="chain2"))
    assert p._try_next != 2                               # no climb (the request's own try may still wait)
    observe_tree(p, "chain2", 2, 2)                       # a whole chain2 accepted: this one counts
    assert p._try_next == 2


def test_a_fresh_session_tries_a_drafted_shape_only_after_one_measured_step():
    """The first request's try of a small drafted shape waits for one measured step: with only the
    priors (a CPU-like 50 ms per verified node) drafting looks worth a try even next to a GPU
    verifier, where a target-only step takes 3.5 ms and a draft decode 15 ms; measured, it is not
    tried there, and it still is where a target-only step takes 250 ms."""
    def first_two(verify_s, network_s):
        p = Planner()
        p.begin_request()
        first = p.choose()
        p.observe(StepObservation(nodes=0, draft_s=0.0, draft_decodes=0, network_s=network_s, bytes_up=48,
                                  verify_s=verify_s, queue_s=0.0, scores=np.zeros(0), accepted=np.zeros(0, bool)))
        p.draft_per_decode_s = 0.015
        return first, p.choose()

    first, second = first_two(verify_s=0.0025, network_s=0.001)   # a GPU verifier nearby
    assert first == TreeShape.target_only() and second == TreeShape.target_only()
    first, second = first_two(verify_s=0.2, network_s=0.05)        # a CPU verifier 50 ms away
    assert first == TreeShape.target_only() and second.budget > 0


def test_a_measured_draft_decode_replaces_the_prior_before_any_tree():
    """With the prior (30 ms a draft decode) a small chain cannot pay at 20 ms RTT next to a 2 ms
    verifier, so it is never tried and the prior never corrected (H200 host: 1.00x cloud AR where
    chain4 ran 1.22x). One decode timed at the start (8 ms) prices it right: the request drafts."""
    def second_choice(calibrated_s):
        p = Planner()
        if calibrated_s is not None:
            p.calibrate_draft(calibrated_s)
        p.begin_request()
        p.choose()
        p.observe(StepObservation(nodes=0, draft_s=0.0, draft_decodes=0, network_s=0.022, bytes_up=48,
                                  verify_s=0.002, queue_s=0.0, scores=np.zeros(0), accepted=np.zeros(0, bool)))
        return p, p.choose()

    p, shape = second_choice(None)
    assert shape == TreeShape.target_only() and not p.draft_calibrated
    p, shape = second_choice(0.008)
    assert shape.budget > 0 and p.draft_per_decode_s == 0.008   # drafting is now the best choice outright
    p.calibrate_draft(0.5)                                 # once only
    assert p.draft_per_decode_s == 0.008
    p, shape = second_choice(0.008)
    assert shape.budget > 0
    p.observe(StepObservation(nodes=2, draft_s=0.03, draft_decodes=2, network_s=0.022, bytes_up=64, verify_s=0.002,
                              queue_s=0.0, scores=np.array([0.9, 0.8]), accepted=np.ones(2, bool),
                              depths=np.array([1, 2]), shape=shape.label))
    assert abs(p.draft_per_decode_s - (0.8 * 0.008 + 0.2 * 0.015)) < 1e-12   # trees then refine it


def test_the_first_drafted_tree_replaces_the_prior_outright():
    p = Planner()
    p.observe(StepObservation(nodes=2, draft_s=0.02, draft_decodes=2, network_s=0.05, bytes_up=64, verify_s=0.01,
                              queue_s=0.0, scores=np.array([0.9, 0.8]), accepted=np.ones(2, bool),
                              depths=np.array([1, 2]), shape="chain2"))
    assert p.draft_calibrated and abs(p.draft_per_decode_s - 0.01) < 1e-12


def test_an_untried_wide_shape_is_priced_with_the_row_cost_wide_shapes_measured():
    """On the H200 host (2026-12-03, 100 ms RTT) a chain decode of the 0.5B draft took 14 ms and a tree8 level (2
    rows) 18.6 ms. A code answer accepted tree8 to its depth, so the planner tried the next shape up: priced at a
    chain's cost per decode (6 x 14 ms), tree16 (4 rows a level) looked like it paid, and so did tree32 and tree64
    after it; drafted, tree16 took 29 ms a level. Its optimistic price now uses tree8's measured cost per extra row
    (0.33 chain decodes), and the climb stops where drafting would cost more than the round trip it saves."""
    p = Planner()
    rungs = {s.label: i for i, s in enumerate(p.ladder)}
    p.begin_request()

    def tree(label, nodes, depth, accepted, decode_s, prepared=False):
        p.observe(StepObservation(nodes=nodes, draft_s=depth * decode_s, draft_decodes=depth, network_s=0.1,
                                  bytes_up=48 + 8 * nodes, verify_s=0.002 + 0.000015 * (nodes + 1), queue_s=0.0,
                                  scores=np.full(nodes, 0.9), accepted=np.arange(nodes) < accepted,
                                  depths=np.minimum(np.arange(nodes) + 1, depth), shape=label, prepared=prepared,
                                  wall_s=0.1 + (0 if prepared else depth * decode_s)))

    for _ in range(6):
        tree("chain4", 4, 4, 4, 0.014)
    chain_s, row_cost = p._wide_row_cost(optimistic=True)     # no wide shape drafted yet: a chain's price
    assert abs(chain_s - 0.014) < 1e-9 and row_cost == 0.0
    tree("tree8", 8, 5, 5, 0.0186)                         # accepted to its depth: the next shape up is the try
    assert p._try_next == rungs["tree16"]
    chain_s, row_cost = p._wide_row_cost(optimistic=True)
    assert abs(chain_s - 0.014) < 1e-9 and abs(row_cost - (0.0186 / 0.014 - 1)) < 1e-9
    priced = p.step_seconds(16, 6, draft_s=6 * 0.014 * (1 + 3 * row_cost), flat_verify=p.verify_flat(True))
    assert abs(p._seconds(rungs["tree16"], True) - priced) < 1e-9
    assert p.choose().label in ("chain4", "tree8") and not p.exploring
    assert abs(p._wide_row_cost(optimistic=False)[1] - row_cost) < 1e-9   # one wide shape: the mean is it


def test_a_request_tries_a_bigger_shape_only_while_what_is_left_can_pay_for_it():
    """A tree accepted to its depth tries the next shape up (begin_request), but the try may cost at most
    TRY_SHARE of the request's remaining time over a step of the current shape: on a 64-token prose answer at 100
    ms RTT (H200 host, twenty-sixth session) the climb to tree32 and tree64 cost ~0.6 s of a 5 s answer. The same
    try is made in a long answer, and in an open-ended run, where the rest of it can pay the try back."""
    from edgespec.edge.planner import TRY_SHARE

    def step(p, label, nodes, accepted):   # a fast verifier, a 25 ms drafting decode
        remote_step(p, label, nodes, accepted, decode_s=0.025, score=0.3)

    def climbed(max_tokens):
        p = Planner(ladder=(TreeShape.target_only(), TreeShape.chain(2), TreeShape.chain(4)))
        p.begin_request()
        for _ in range(4):   # prose: chain4 realized 1 token a step
            step(p, "chain4", 4, 0)
        p.begin_request(max_tokens)
        for _ in range(2):   # code: chain2 accepted whole
            step(p, "chain2", 2, 2)
        assert p._try_next == 2                                # accepted to its depth: chain4 is next
        return p, p.choose()

    p, best = climbed(None)
    assert best.label == "chain4" and p.exploring            # open-ended: tried
    p, best = climbed(2000)
    assert best.label == "chain4" and p.exploring            # a long answer: tried
    assert p.request_left == 2000 - 2 * 3                    # each step took 1 + accepted tokens off
    p, best = climbed(6 + 5)
    assert best.label == "chain2" and not p.exploring        # 5 tokens left: the try cannot pay back
    # the rule: the try's extra seconds over a step of the best shape, against TRY_SHARE of what is left
    rates = [t / p._seconds(i) for i, t in enumerate(p._tokens_by_rung)]
    assert int(np.argmax(rates)) == 1
    extra = p._seconds(2) - p._seconds(1)
    assert TRY_SHARE * 5 / rates[1] < extra <= TRY_SHARE * 100 / rates[1]   # 100 tokens left would pay it


def test_a_tree_accepted_to_its_depth_tries_the_next_shape_at_that_shapes_whole_depth():
    """After chain2 trees accepted whole, chain4 is worth a try if four accepted nodes would beat chain2, not only
    if 0.9 a node would: where a chain4 step costs 1.5x a chain2 step (a CPU verifier), a code answer drafted
    chain2 for nine steps, each accepted whole, before chain4 was tried, which then accepted 4 of 4 six times
    (2-core box, 2026-12-05). The request's first try of a drafted shape keeps OPTIMISTIC_ACCEPTANCE."""
    from edgespec.edge.planner import OPTIMISTIC_ACCEPTANCE, tree_tokens

    def step(p, label, nodes, accepted):   # a CPU verifier (50 ms a node), 40 ms a drafting decode
        remote_step(p, label, nodes, accepted, decode_s=0.04, verify_fixed_s=0.1, verify_node_s=0.05)

    p = Planner(ladder=(TreeShape.target_only(), TreeShape.chain(2), TreeShape.chain(4)))
    p.begin_request()
    for _ in range(4):   # prose: chain4 accepted one node a tree
        step(p, "chain4", 4, 1)
    p.begin_request(200)
    step(p, "chain2", 2, 2)                                # code: chain2 accepted whole
    assert p._try_next == 2 and p._try_full
    rates = [t / p._seconds(i) for i, t in enumerate(
        [p.expected_tokens(i) for i in range(3)])]
    assert int(np.argmax(rates)) == 1                      # chain2 is the choice on what is known
    assert tree_tokens(p.ladder[2], *OPTIMISTIC_ACCEPTANCE) / p._seconds(2, True) < rates[1]   # 0.9 a node: no try
    assert p.choose() == p.ladder[2] and p.exploring       # four of four could pay: tried
    step(p, "chain4", 4, 4)
    assert p.choose() == p.ladder[2]                       # it did: kept


def test_one_poor_tree_does_not_lock_a_request_below_a_shape_it_drafted():
    """A chain4 tree that accepted one node, then chain2 trees accepted whole: chain4 is tried again (a shape the
    request drafted is priced by its own trees, so without the re-try the answer stayed on chain2 to its end: 17
    of 18 chain2 trees accepted whole, twenty-seventh session's trace), and kept once its trees accept whole.
    A shape that keeps failing is re-tried at growing intervals (the request's path acceptance since its last
    miss must cover twice as many nodes each time: _since_last_miss), so it is left for longer and longer."""

    def step(p, label, nodes, accepted):   # a fast verifier, a 10 ms drafting decode
        remote_step(p, label, nodes, accepted, decode_s=0.01)

    def run(chain4_accepts):
        p = Planner(ladder=(TreeShape.target_only(), TreeShape.chain(2), TreeShape.chain(4)))
        p.begin_request()
        for _ in range(4):   # prose before: chain4 accepted one node a tree
            step(p, "chain4", 4, 1)
        p.begin_request(400)
        step(p, "chain2", 2, 2)
        assert p.choose() == p.ladder[2]          # the climb
        step(p, "chain4", 4, 1)                   # one poor chain4 tree
        chosen = []
        for _ in range(30):
            shape = p.choose()
            chosen.append(shape.label)
            step(p, shape.label, shape.budget, chain4_accepts if shape.label == "chain4" else shape.budget)
        return p, chosen

    p, chosen = run(chain4_accepts=4)             # code: chain4 accepts whole when tried again
    assert chosen[:2] == ["chain2", "chain4"], chosen   # re-tried after the next whole chain2
    assert chosen[-4:] == ["chain4"] * 4, chosen  # and kept
    p, chosen = run(chain4_accepts=1)             # chain4 keeps failing: each re-try comes later than the last
    tries = [i for i, label in enumerate(chosen) if label == "chain4"]
    gaps = np.diff(tries)
    assert len(tries) <= 6 and all(later > earlier for earlier, later in zip(gaps[1:], gaps[2:])), chosen
    assert chosen[-8:] == ["chain2"] * 8 or gaps[-1] >= 8, chosen


def _tree_step(shape: TreeShape, accepted: int, prepared: bool, decode_s: float) -> StepObservation:
    """One observed tree step of `shape` at 100 ms RTT: `accepted` nodes of its main path accepted."""
    nodes = shape.budget
    return StepObservation(nodes=nodes, draft_s=shape.max_depth * decode_s, draft_decodes=shape.max_depth,
                           network_s=0.1, bytes_up=48 + 8 * nodes, verify_s=0.002, queue_s=0.0,
                           scores=np.full(nodes, 0.6), accepted=np.arange(nodes) < accepted, shape=shape.label,
                           prepared=prepared, wall_s=0.1 + (0 if prepared else shape.max_depth * decode_s))


def test_each_rung_prices_its_steps_with_its_own_drafted_ahead_share():
    """A tree step is drafted ahead when the tree in flight before it had its whole main path accepted,
    so the share belongs to that tree's rung. After a code answer whose chain4 trees came true, prose
    whose tree16 trees never did must price tree16 as drafted on the step's path (an H100 host's e2e,
    thirtieth session: 306 ms a tree16 step, none drafted ahead, where chain4's steps on code were)."""
    p = Planner()
    rungs = {s.label: i for i, s in enumerate(p.ladder)}
    chain4, tree16 = p.ladder[rungs["chain4"]], p.ladder[rungs["tree16"]]
    p.begin_request(64)
    for i in range(12):   # code: after the first, every chain4 tree was drafted ahead
        p.observe(_tree_step(chain4, 4, prepared=i > 0, decode_s=0.012))
    code_share = p.prepared_for(rungs["chain4"])
    assert code_share > 0.8 and rungs["tree16"] not in p.prepared_by_rung
    p.begin_request(64)   # prose: the request's first tree is not a miss of the code answer's last chain4
    assert p.prepared_for(rungs["chain4"]) == code_share
    for _ in range(8):
        p.observe(_tree_step(tree16, 2, prepared=False, decode_s=0.03))
    assert p.prepared_for(rungs["tree16"]) < 0.25 < p.prepared_for(rungs["chain4"]) == code_share
    draft = tree16.max_depth * p.decode_s_by_rung[rungs["tree16"]]
    exposed = p.step_seconds(tree16.budget, tree16.max_depth, draft_s=draft, prepared=0.0)
    hidden = p.step_seconds(tree16.budget, tree16.max_depth, draft_s=draft, prepared=1.0)
    assert (p._seconds(rungs["tree16"]) - hidden) > 0.75 * (exposed - hidden)
    # the all-steps share, still up from the code answer, would have hidden more of it
    assert p.prepared_share > p.prepared_for(rungs["tree16"]) + 0.1


def test_steps_after_a_target_only_step_are_no_miss_of_any_rung():
    """Nothing is drafted ahead behind a target-only step: the tree step after one says nothing about the rung
    before it."""
    p = Planner()
    chain2 = p.ladder[1]
    p.observe(_tree_step(chain2, 2, prepared=False, decode_s=0.01))
    p.observe(StepObservation(nodes=0, draft_s=0.0, draft_decodes=0, network_s=0.1, bytes_up=48, verify_s=0.002,
                              queue_s=0.0, scores=np.zeros(0), accepted=np.zeros(0, bool)))
    p.observe(_tree_step(chain2, 2, prepared=False, decode_s=0.01))
    assert p.prepared_by_rung == {}
    p.observe(_tree_step(chain2, 2, prepared=True, decode_s=0.01))
    assert p.prepared_by_rung[1][0] == p.prepared_steps == 1 and p.prepared_for(1) > 0.5


def test_a_request_gone_target_only_tries_drafting_again_at_growing_intervals():
    """A request whose first trees accepted nothing goes target-only, but tries the smallest drafted shape again after
    TARGET_ONLY_RETRY target-only steps, then after twice as many, and so on: a code answer whose first two chain2
    trees missed ran target-only to its end (62 steps) without it. Once a try is accepted whole, drafting goes on."""
    from edgespec.edge.planner import TARGET_ONLY_RETRY

    def run(accepts_after: int) -> list[tuple[int, str, str]]:
        p = Planner(ladder=(TreeShape.target_only(), TreeShape.chain(2), TreeShape.chain(4)))
        p.begin_request()
        for _ in range(6):   # an earlier answer: chain2 trees accepted one node of two
            remote_step(p, "chain2", 2, 1, decode_s=0.03)
        p.begin_request(400)
        drafted = []
        for i in range(64):
            shape = p.choose()
            if shape.budget:
                drafted.append((i, shape.label, p.last_why))
            remote_step(p, shape.label, shape.budget, shape.budget if i >= accepts_after else 0, decode_s=0.03)
        return drafted

    drafted = run(accepts_after=10 ** 6)   # nothing is ever accepted
    tries = [(i, label) for i, label, why in drafted if why == "try"]
    assert len(tries) == 3 and {label for _, label in tries} == {"chain2"}, drafted
    steps = [i for i, _, _ in drafted]
    first_try = steps.index(tries[0][0])
    gaps = [b - a - 1 for a, b in zip(steps[first_try - 1:], steps[first_try:])]   # target-only steps before each
    assert gaps == [TARGET_ONLY_RETRY, 2 * TARGET_ONLY_RETRY, 4 * TARGET_ONLY_RETRY], drafted

    drafted = run(accepts_after=12)       # code from the 12th step on: a try finds it and drafting goes on
    assert any(why == "try" for _, _, why in drafted), drafted
    assert len(drafted) >= 20, drafted


def test_newer_path_acceptance_lifts_a_shape_whose_own_trees_missed_early_in_the_request():
    """A code answer whose first chain4 trees missed (its preamble), then whose chain2 trees are accepted whole
    step after step: chain4 has REQUEST_RETRIES trees of its own in the request, but the path acceptance since
    its last miss is newer evidence, and chain4 comes back. Priced by its own early trees, the simulated 200 ms
    link kept such an answer on chain2 for its last 13 steps at 0.78x fixed chain4 (thirty-second session)."""
    from edgespec.edge.planner import REQUEST_RETRIES

    def step(p, label, nodes, accepted):
        remote_step(p, label, nodes, accepted, decode_s=0.05)

    p = Planner(ladder=(TreeShape.target_only(), TreeShape.chain(2), TreeShape.chain(4)))
    p.begin_request()
    for _ in range(4):    # an earlier answer: chain4 accepted 3 of 4
        step(p, "chain4", 4, 3)
    p.begin_request(400)
    for accepted in (0, 0, 1):   # this answer's chain4 trees miss early on
        step(p, "chain4", 4, accepted)
    assert p._request_trees[2] == REQUEST_RETRIES
    chosen = []
    for _ in range(12):
        shape = p.choose()
        chosen.append(shape.label)
        step(p, shape.label, shape.budget, shape.budget)   # from here on every tree is accepted whole
    assert chosen[0] == "chain2", chosen
    assert chosen[-4:] == ["chain4"] * 4, chosen


def test_drafted_rungs_are_ranked_by_their_measured_wall_time():
    """chain4 steps that run 30 % over what the model's parts add up to (a decode before drafting ahead, a level the
    answer waited for), chain2 steps that match it: chain4 gets dearer against chain2, relative to the drafted
    rungs' mean, while target-only's price and that of a drafted rung never run stay the model's. With one drafted
    rung measured there is nothing to rank."""
    from edgespec.edge.planner import WALL_PRIOR_STEPS

    p = Planner(ladder=(TreeShape.target_only(), TreeShape.chain(2), TreeShape.chain(4), TreeShape.chain(6)))

    def step(label, nodes, over):
        decode_s, network_s, verify_s = 0.05, 0.1, 0.002
        p.observe(StepObservation(nodes=nodes, draft_s=decode_s * nodes, draft_decodes=nodes, network_s=network_s,
                                  bytes_up=48 + 8 * nodes, verify_s=verify_s, queue_s=0.0, scores=np.full(nodes, 0.6),
                                  accepted=np.arange(nodes) < nodes, depths=np.arange(1, nodes + 1), shape=label,
                                  wall_s=over * (network_s + verify_s + decode_s * nodes)))

    for _ in range(3):
        step("target-only", 0, 1.5)
    for _ in range(20):
        step("chain4", 4, 1.3)
    assert p.wall_factor(2) == 1.0 and p.wall_factor(0) == 1.0   # one drafted rung: nothing to rank
    before = p._seconds(2), p._seconds(1), p._seconds(0)
    for _ in range(20):
        step("chain2", 2, 1.0)
    own4 = (20 * 1.3 + WALL_PRIOR_STEPS) / (20 + WALL_PRIOR_STEPS)
    mean = (own4 + 1.0) / 2
    assert abs(p.wall_factor(2) - own4 / mean) < 0.01 and abs(p.wall_factor(1) - 1.0 / mean) < 0.01
    assert p.wall_factor(0) == 1.0 and abs(p.wall_factor(3) - 1.0) < 1e-9   # target-only; chain6, never run
    assert p._seconds(2) / p._seconds(1) > 1.2 * before[0] / before[1]
    assert p._seconds(2, optimistic=True) < p._seconds(2)
