"""The tree planner's cost model: it learns link, verifier and acceptance figures from observations
and picks bigger trees when round trips are expensive, smaller ones when nodes are expensive."""
import numpy as np

from edgespec.edge.planner import Planner, StepObservation


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


def test_load_makes_nodes_dearer_and_prunes():
    args = dict(rtt_s=0.02, bandwidth_bps=12.5e6, verify_fixed_s=0.01, verify_per_node_s=0.003, accept_fn=lambda s: s)
    p = feed(Planner(), **args)
    scores = np.linspace(1, 0.01, 64)
    calm = p.prune_size(scores, decodes=8)
    feed(p, **args, steps=20, queue_s=0.2)   # same costs, but the verifier now reports long queues
    assert p.load_factor > 2
    assert p.prune_size(scores, decodes=8) < calm
