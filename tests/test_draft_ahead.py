"""Trees drafted ahead (while the previous tree is verified) must be the trees drafting at the step
would have made (issue 10). They used to go out as far as they had grown when the verifier
answered: with a fast verifier, depth 3 of 6 on the Qwen pair, half the accepted tokens.

Real llama.cpp (SmolLM2) throughout. The only harness is timing: the drafter waits for the
verifier's answer before drafting ahead, which makes "the answer arrives before the tree is
grown" (the case of a GPU verifier) happen on every step instead of by chance.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pytest
from lossless import assert_lossless, target_only_greedy

from edgespec.common.acceptance import VerifyResult
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.edge.decoder import Decoder, SessionStats
from edgespec.edge.drafting import Draft, Drafter, TreeShape
from edgespec.edge.pool import DraftPool, LookupExpert, ModelExpert
from edgespec.runtime.llama import ContextConfig, LlamaModel
from edgespec.runtime.tree_verifier import LocalVerifier

GREEDY = SamplingParams()
TREE = TreeShape(budget=16, max_depth=6, branching=4, width=4)
CONFIG = ContextConfig(n_ctx=512, max_tree_nodes=64, n_threads=1)
TOOLS = Path(__file__).resolve().parents[1] / "tools"


def tree_of(draft: Draft) -> tuple[list[int], list[int]]:
    return draft.tree.tokens.tolist(), draft.tree.parents.tolist()


def stop_after(n: int) -> Callable[[], bool]:
    """A stop() that lets `n` depths grow, then says stop (as a verifier's answer would)."""
    calls = iter(range(10**6))
    return lambda: next(calls) >= n


@pytest.fixture
def prompt(smol_model: LlamaModel) -> list[int]:
    return smol_model.chat_tokens([{"role": "user", "content": "List the planets of the solar system."}])


def test_a_tree_cut_short_is_resumed_to_the_uninterrupted_tree(smol_model, prompt):
    """grow(stop) returns the partial tree marked incomplete; the same call again finishes it into
    exactly the tree one uninterrupted call drafts (tokens, parents, scores); anything else starts over."""
    drafter, reference = Drafter(smol_model, CONFIG), Drafter(smol_model, CONFIG)
    try:
        whole = reference.grow(prompt, TREE, GREEDY, 0)
        assert whole.complete and whole.decodes >= 4 and len(whole.tree) == TREE.budget + 1

        cut = drafter.grow(prompt, TREE, GREEDY, 0, stop=stop_after(1))
        assert not cut.complete and cut.decodes == 2
        assert max(cut.tree.depths) == 2 < max(whole.tree.depths)
        finished = drafter.grow(list(prompt), TREE, GREEDY, 0)   # a copy: the same context
        assert finished.complete and finished.decodes == whole.decodes
        assert tree_of(finished) == tree_of(whole)
        assert finished.scores.tolist() == whole.scores.tolist()
        assert finished.seconds >= cut.seconds               # drafting time over both calls

        # A different context (a guess that did not come true) never resumes the cut tree.
        drafter.grow(prompt, TREE, GREEDY, 1, stop=stop_after(0))
        other = prompt[:-1]
        fresh = drafter.grow(other, TREE, GREEDY, 1)
        assert fresh.complete and tree_of(fresh) == tree_of(reference.grow(other, TREE, GREEDY, 1))
    finally:
        drafter.close()
        reference.close()


class AnswerFirst:
    """Drafter-side timing harness. answer_first: drafting ahead (a grow with a stop) starts only
    once the verifier has answered, so every tree drafted ahead is cut at its first depth. Else
    drafting ahead is never cut (the verifier's answer waits for it)."""

    def __init__(self, drafter: Drafter | DraftPool, answer_first: bool) -> None:
        self.inner, self.answer_first, self.ahead = drafter, answer_first, 0

    def grow(self, committed: list[int], shape: TreeShape, sampling: SamplingParams, step: int,
             stop: Callable[[], bool] | None = None) -> Draft:
        if stop is not None:   # drafting ahead
            self.ahead += 1
            while self.answer_first and not stop():
                threading.Event().wait(0.001)
            stop = stop if self.answer_first else None
        return self.inner.grow(committed, shape, sampling, step, stop=stop)

    def accept(self, draft: Draft, path: list[int]) -> None:
        self.inner.accept(draft, path)

    def predict_next(self, committed: list[int]) -> int:
        return self.inner.predict_next(committed)


class Recording:
    """The real LocalVerifier, noting each tree it is sent and whether the decoder had drafted it ahead."""

    def __init__(self, verifier: LocalVerifier, stats: SessionStats) -> None:
        self.inner, self.stats, self.sent, self._hits = verifier, stats, [], 0

    def sync(self, context: Sequence[int]) -> None:
        self.inner.sync(context)

    def verify(self, context: Sequence[int], tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        prepared, self._hits = self.stats.prepared_hits > self._hits, self.stats.prepared_hits
        self.sent.append((list(context), tree.tokens.tolist(), tree.parents.tolist(), prepared))
        return self.inner.verify(context, tree, sampling, step)

    def close(self) -> None:
        self.inner.close()


def decode_ahead(model: LlamaModel, prompt: list[int], pooled: bool, answer_first: bool,
                 n: int = 40) -> tuple[list[int], Recording, AnswerFirst]:
    """Pipelined decoding of `prompt` with real llama.cpp draft and target (both `model`)."""
    drafter = Drafter(model, CONFIG)
    harness = AnswerFirst(DraftPool([ModelExpert.around("draft", drafter), LookupExpert()]) if pooled else drafter,
                          answer_first)
    stats = SessionStats()
    verifier = Recording(LocalVerifier(model, CONFIG), stats)
    decoder = Decoder(harness, verifier, stats, TREE, model.is_end_of_generation, pipelined=True)
    try:
        out = [t for chunk in decoder.run(prompt, n, GREEDY) for t in chunk]
        return out + ([model.eos] if len(out) < n else []), verifier, harness
    finally:
        decoder.close()
        verifier.close()
        drafter.close()


@pytest.mark.parametrize("pooled", [False, True], ids=["drafter", "pool"])
def test_a_used_prepared_tree_is_the_tree_drafted_at_the_step(smol_model, prompt, pooled):
    """Pipelined decoding where the answer always arrives first. Every prepared tree that goes out
    is the tree an uninterrupted drafter makes: the same, step by step, as in a run whose drafting
    ahead is never cut, and as large and deep as a fresh drafter's at the step from the same context
    (before the fix they went out one depth deep: 4 nodes). Output stays the target's greedy output."""
    out, sent, harness = decode_ahead(smol_model, prompt, pooled, answer_first=True)
    whole_out, whole_sent, _ = decode_ahead(smol_model, prompt, pooled, answer_first=False)
    prepared = [s for s in sent.sent if s[3]]
    assert len(prepared) >= 3 and harness.ahead >= len(prepared)
    assert out == whole_out
    assert [s[:3] for s in sent.sent] == [s[:3] for s in whole_sent.sent]

    plain = Drafter(smol_model, CONFIG)
    at_step = DraftPool([ModelExpert.around("draft", plain), LookupExpert()]) if pooled else plain
    try:
        for context, tokens, parents, _ in prepared:
            fresh = at_step.grow(context, TREE, GREEDY, 0)
            assert len(tokens) == len(fresh.tree) == TREE.budget + 1
            assert max(TokenTree(tokens, parents).depths) == max(fresh.tree.depths)
    finally:
        plain.close()
    assert_lossless(out, target_only_greedy(smol_model, prompt, 40), "drafted ahead")


class SlowPrefill:
    """The real LocalVerifier behind a link whose prompt upload takes `delay` seconds."""

    def __init__(self, verifier: LocalVerifier, delay: float) -> None:
        self.inner, self.delay = verifier, delay

    def sync(self, context: Sequence[int]) -> None:
        threading.Event().wait(self.delay)
        self.inner.sync(context)

    def verify(self, context: Sequence[int], tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        return self.inner.verify(context, tree, sampling, step)

    def close(self) -> None:
        self.inner.close()


def test_the_planner_gets_a_timed_draft_decode_while_the_verifier_prefills(smol_model, prompt):
    """Before its first tree the planner knows a draft decode's cost only as a prior; the decoder times
    one decode while the verifier is still busy with the prompt (here a 0.5 s upload), once per
    session, and the answer is still target-only greedy."""
    drafter = Drafter(smol_model, CONFIG)
    stats = SessionStats()
    verifier = SlowPrefill(LocalVerifier(smol_model, CONFIG), delay=0.5)
    decoder = Decoder(drafter, verifier, stats, None, smol_model.is_end_of_generation, pipelined=True)
    timed = []
    calibrate = decoder.planner.calibrate_draft
    decoder.planner.calibrate_draft = lambda s: (timed.append(s), calibrate(s))
    outs, traces = [], []
    try:
        for _ in range(2):   # two requests, each step traced (SessionStats.trace)
            stats.trace = []
            outs.append([t for chunk in decoder.run(prompt, 12, GREEDY) for t in chunk])
            traces.append(stats.trace)
    finally:
        decoder.close()
        verifier.close()
        drafter.close()
    assert len(timed) == 1 and 0 < timed[0] < 0.5                 # once, and within the upload
    assert decoder.planner.draft_calibrated
    # the trace: one record a step, adding up to the counters; the planner counted the request's tokens down
    steps = [r for trace in traces for r in trace]
    assert len(steps) == stats.steps and sum(r["accepted"] for r in steps) == stats.accepted
    assert {label: sum(r["shape"] == label for r in steps) for label in stats.shapes} == stats.shapes
    assert all(0 <= r["draft_ms"] <= r["wall_ms"] and r["accepted"] <= r["nodes"] for r in steps)
    # and why the planner chose each step's shape, with the rates it compared (the chosen rung's is the best
    # unless the step was a try or an exploration)
    ladder = [s.label for s in decoder.planner.ladder]
    assert all(r["why"] in ("best", "try", "explore") and len(r["rates"]) == len(ladder) for r in steps)
    assert all(r["rates"][ladder.index(r["shape"])] == max(r["rates"]) for r in steps if r["why"] == "best")
    assert decoder.planner.requests == 2
    assert decoder.planner.request_left == max(0, 12 - sum(1 + r["accepted"] for r in traces[1]))
    ref = target_only_greedy(smol_model, prompt, 12)
    for out in outs:
        assert_lossless(out + ([smol_model.eos] if len(out) < 12 else []), ref, "timed draft decode")


def test_a_recorded_run_replays_to_the_planner_it_made(smol_model, prompt, tmp_path):
    """tools/replay_planner.py, fed a run's step traces as bench_link records them, ends with a planner that learned
    what the live one did (fits, acceptance bins, realized tokens, drafted-ahead shares): the trace holds every
    observation. Left out: the drafting cost per decode (the live planner timed one decode during the prefill; the
    replay calibrates from the first tree) and the choices (a replay prices the shapes the run drafted)."""
    import json
    import runpy

    drafter = Drafter(smol_model, CONFIG)
    stats = SessionStats()
    delayed = runpy.run_path(str(TOOLS / "bench_ahead_stop.py"))["DelayedVerifier"]   # a 60 ms link's round trip
    verifier = delayed(LocalVerifier(smol_model, CONFIG), delay=0.06)
    decoder = Decoder(drafter, verifier, stats, None, smol_model.is_end_of_generation, pipelined=True)
    traces = []
    try:
        for _ in range(2):
            stats.trace = []
            for _ in decoder.run(prompt, 24, GREEDY):
                pass
            traces.append(stats.trace)
    finally:
        decoder.close()
        verifier.close()
        drafter.close()
    live = decoder.planner
    tool = runpy.run_path(str(TOOLS / "replay_planner.py"))
    runs = [{"mode": "adaptive", "rtt_ms": 0.0, "mbit": 0.0, "trace": trace} for trace in traces]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"meta": {"max_tokens": 24, "runs": runs}}))
    steps, planners = tool["replay"](path)
    replayed = planners["0/0"]
    assert len(steps) == sum(r["obs"]["draft_decodes"] > 0 for trace in traces for r in trace) >= 4
    assert (replayed.steps, replayed.requests, replayed.request_left) == (live.steps, live.requests, live.request_left)
    assert replayed.realized.keys() == live.realized.keys()
    assert all(abs(replayed.realized[k][1] - live.realized[k][1]) < 1e-9 for k in live.realized)
    assert replayed.prepared_by_rung == live.prepared_by_rung and replayed.prepared_share == live.prepared_share
    assert np.array_equal(replayed.hits, live.hits) and np.array_equal(replayed.trials, live.trials)
    assert abs(replayed.verify(17) - live.verify(17)) < 1e-5 and abs(replayed.network(100) - live.network(100)) < 1e-5
    assert replayed.decode_s_by_rung.keys() == live.decode_s_by_rung.keys()
    assert all(s["predicted_s"] > 0 and s["wall_s"] > 0 for s in steps)
    assert tool["report"](steps)["overall"]["steps"] == len(steps)


def test_a_tree_says_how_many_committed_tokens_the_draft_prefilled_first(smol_model, prompt):
    """Draft.catchup_tokens: the whole prompt into an empty cache; the bonus token alone after an accepted step
    (adopt_branch kept the accepted path); a context that jumped ahead (turns the model sat out) its whole lag,
    which catching_up() tells from an ordinary step. Pruning keeps the count."""
    from edgespec.edge.planner import CATCHUP_TOKENS, catching_up

    drafter = Drafter(smol_model, CONFIG)
    try:
        first = drafter.grow(prompt, TREE, GREEDY, 0)
        assert first.catchup_tokens == len(prompt) and first.pruned(3).catchup_tokens == len(prompt)
        kids = first.tree.children()[0]
        drafter.accept(first, [kids[0]])
        committed = [*prompt, int(first.tree.tokens[kids[0]]), 42]   # the accepted node, then the bonus token
        second = drafter.grow(committed, TREE, GREEDY, 1)
        assert second.catchup_tokens == 1 and not catching_up(second.catchup_tokens)
        later = committed + prompt[: CATCHUP_TOKENS + 8]
        third = drafter.grow(later, TREE, GREEDY, 2)
        assert third.catchup_tokens == CATCHUP_TOKENS + 8 and catching_up(third.catchup_tokens)
    finally:
        drafter.close()


def test_drafting_ahead_stops_before_a_level_the_answer_would_overtake():
    """A level decoded past the expected answer delays its use whether the guess comes true or not; one left out
    costs its time later only if it does. With trees after this shape never drafted ahead (prose), drafting ahead
    stops once the time left is under a level's cost; when they nearly always are (code), only shortly before the
    answer is due."""
    from edgespec.edge.planner import StepObservation

    decoder = Decoder(None, None, SessionStats(), None, lambda t: False, pipelined=True)
    try:
        planner = decoder.planner
        tree16 = next(s for s in planner.ladder if s.label == "tree16")
        rung = planner.ladder.index(tree16)
        for _ in range(4):   # a 100 ms link, 2 ms verifier; tree16 levels cost 30 ms to draft
            planner.observe(StepObservation(nodes=16, draft_s=0.18, draft_decodes=6, network_s=0.1, bytes_up=176,
                                            verify_s=0.002, queue_s=0.0, scores=np.full(16, 0.5),
                                            accepted=np.zeros(16, bool), shape="tree16", prepared=False))
        in_flight = Draft(TokenTree.chain(1, [2] * 16), [0] * 17, np.ones(17), shape="tree16")
        answered = threading.Event()
        now = time.perf_counter()
        expected = planner.answer_seconds(16)
        assert 0.1 < expected < 0.11 and abs(planner.decode_seconds(rung) - 0.03) < 1e-9
        planner.prepared_by_rung[rung] = (8, 0.0)     # prose: never drafted ahead after tree16
        assert not decoder._ahead_stop(answered.is_set, in_flight, now, tree16)()            # 100 ms left
        assert decoder._ahead_stop(answered.is_set, in_flight, now - expected + 0.02, tree16)()   # 20 ms left
        planner.prepared_by_rung[rung] = (8, 0.95)    # code: nearly always drafted ahead
        assert not decoder._ahead_stop(answered.is_set, in_flight, now - expected + 0.01, tree16)()   # 10 ms left
        assert decoder._ahead_stop(answered.is_set, in_flight, now - expected, tree16)()   # due: a level costs 30 ms
        answered.set()
        assert decoder._ahead_stop(answered.is_set, in_flight, now, tree16)()
    finally:
        decoder.close()


def test_the_simulated_verifier_answers_as_the_target_does(smol_model, smol_path, prompt, tmp_path, monkeypatch):
    """tools/bench_planner_sim.py's ReferenceVerifier: the reference is the target's own greedy output (computed with
    the product's decoder, target-only), a tree is answered with its longest path along it plus the next reference
    token, and a pipelined run of trees through it (drafting ahead, after the RTT) commits exactly the reference."""
    import runpy

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))   # the references' cache
    tool = runpy.run_path(str(TOOLS / "bench_planner_sim.py"))
    [reference] = tool["references"](smol_path, [prompt], 24, 512, 1)
    assert reference == target_only_greedy(smol_model, prompt, 24).tokens[:len(reference)] and len(reference) >= 12
    verifier = tool["ReferenceVerifier"]({tuple(prompt): reference}, rtt_s=0.02)
    context = [*prompt, *reference[:3]]
    wrong = (reference[5] + 1) % smol_model.n_vocab
    tree = TokenTree(tokens=np.array([context[-1], reference[3], reference[4], wrong, reference[4]], np.int32),
                     parents=np.array([-1, 0, 1, 2, 0], np.int32))
    started = time.perf_counter()
    result = verifier.verify(context, tree, GREEDY, 0)
    assert time.perf_counter() - started >= 0.02 and result.network_s == 0.02
    assert result.path == [1, 2] and result.tokens == reference[3:6]
    with pytest.raises(ValueError, match="left the reference"):
        verifier.verify([*prompt, wrong], tree, GREEDY, 0)
    with pytest.raises(ValueError, match="greedy"):
        verifier.verify(context, tree, SamplingParams(temperature=0.7), 0)
    # a path to the end of a reference that stopped at the end token (shorter than asked) is answered; one that ran
    # out of a reference cut at its length is an error
    ended = tool["ReferenceVerifier"]({tuple(prompt): reference[:5]}, rtt_s=0.0, n_tokens=24)
    assert ended.verify(context, tree, GREEDY, 0).path == [1, 2]
    with pytest.raises(ValueError, match="too short"):
        tool["ReferenceVerifier"]({tuple(prompt): reference[:5]}, rtt_s=0.0, n_tokens=5).verify(context, tree, GREEDY, 0)

    drafter = Drafter(smol_model, CONFIG)
    tree16 = TreeShape(budget=16, max_depth=6, branching=4, width=4)
    decoder = Decoder(drafter, verifier, SessionStats(), tree16, smol_model.is_end_of_generation, pipelined=True)
    try:
        out = [t for step in decoder.run(prompt, len(reference) - 10, GREEDY) for t in step]
    finally:
        decoder.close()
        drafter.close()
    assert out == reference[:len(out)] and len(out) >= len(reference) - 10 - 1
    assert decoder.stats.accepted > 0 and decoder.stats.prepared_hits > 0


def test_the_simulators_ladder_option_names_shapes_by_their_labels():
    """tools/bench_planner_sim.py --ladder: chainK for any K, tree labels from the planner's LADDER, in the order
    given (the planner's rungs); a label it does not know stops the tool with the known ones named."""
    import runpy

    tool = runpy.run_path(str(TOOLS / "bench_planner_sim.py"))
    shapes = tool["parse_ladder"]("target-only,chain2,chain3,chain4,chain6,tree8")
    assert [s.label for s in shapes] == ["target-only", "chain2", "chain3", "chain4", "chain6", "tree8"]
    assert shapes[2].budget == shapes[2].max_depth == 3 and shapes[2].width == shapes[2].branching == 1
    with pytest.raises(SystemExit, match="tree12"):
        tool["parse_ladder"]("chain2,tree12")
