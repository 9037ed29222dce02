"""The speculative decode loop: draft a tree, have it verified, commit what the verifier returns.

With a remote verifier, and under the planner also with the local one, the loop is pipelined
(double buffering; the verifier runs on a worker thread or elsewhere): while a tree is in flight, the
drafter assumes the tree's most probable path will be accepted, predicts the target's next token
with the draft model, and drafts the following tree from there. Drafting ahead stops when the
answer arrives. If the answer matches the guess, the prepared tree goes out, finished first where
the answer cut it short (Drafter.grow resumes it), so it is the tree drafting at the step would have
made, sooner; otherwise the drafter's KV cache keeps whatever prefix is still valid
(TreeContext.sync) and drafting resumes from the real context.

Only the verifier's answers are ever committed, so whatever the drafter guesses, output is the
verifier's output: no token is lost or duplicated by the pipelining.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from edgespec.common.acceptance import VerifyResult
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.edge.drafting import Draft, Drafter, TreeShape
from edgespec.edge.planner import Planner, StepObservation, catching_up


class Verifier(Protocol):
    """What the decoder needs from a verifier (local target, FailoverVerifier over gRPC).

    The decoder owns the committed context and passes it, its own list, to every call; a verifier
    keeps no copy. It may keep the list to read (never to write), relying on this: between two
    syncs the list only grows, by the tokens of each verify answer, appended in full.
    """

    def sync(self, context: Sequence[int]) -> None:
        """A new context starts (prompt, next turn): process it now, ahead of the first step."""

    def verify(self, context: Sequence[int], tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        """Verify `tree` (rooted at context[-1]) after exactly `context`."""

    def close(self) -> None: ...


@dataclass
class SessionStats:
    """Cumulative over the session. τ counts the target's own token (EAGLE convention)."""

    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0       # drafting on the critical path (not overlapped with verification)
    verify_seconds: float = 0.0      # waiting for the verifier (round trip, queue, compute)
    prepared_hits: int = 0           # steps whose tree was drafted while the previous one was in flight
    prefill_seconds: float = 0.0     # prompt processing by both models (not in `seconds`)
    shapes: dict[str, int] = field(default_factory=dict)  # steps per tree shape (TreeShape.label)
    extra: dict = field(default_factory=dict)
    link: Any = None  # edgespec.edge.link.LinkStats when verifying over gRPC (None in local mode)
    # One record a step while a caller holds a list here (benchmarks; None: nothing kept): the shape, nodes sent,
    # nodes accepted, whether the tree was drafted ahead, drafting on the critical path and the step's wall time
    # (ms). The counters say how a run went; this says which choices made it so (the planner's, step by step)
    trace: list[dict] | None = None

    @property
    def tau(self) -> float:
        """Mean tokens committed per target step: accepted drafts + the target's own token, so >= 1.

        Counted from the verifier's answers (`accepted`), not from `tokens`: `tokens` are the tokens
        emitted to the caller, which leave out the end-of-generation token and whatever max_tokens
        cut from the last step, so tokens / steps fell below 1 on short answers (e.g. 0.93)."""
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens / drafted nodes (for trees this falls with width by design)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed after the prompt was processed (prefill is in prefill_seconds)."""
        return self.tokens / self.seconds if self.seconds else 0.0

    COUNTERS = ("tokens", "steps", "drafted", "accepted", "seconds", "draft_seconds", "verify_seconds",
                "prepared_hits", "prefill_seconds")

    def add(self, other: "SessionStats") -> None:
        """Accumulate another run's counters (benchmarks sum per category)."""
        for name in self.COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for label, n in other.shapes.items():
            self.shapes[label] = self.shapes.get(label, 0) + n

    def summary(self) -> str:
        return (f"{self.tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_second:.2f} tok/s) "
                f"after {self.prefill_seconds:.2f} s of prompt processing, "
                f"{self.steps} target steps, tau {self.tau:.2f}, acceptance {self.acceptance_rate:.2f}"
                + (", trees: " + ", ".join(f"{k} {v}" for k, v in sorted(self.shapes.items(), key=lambda kv: -kv[1]))
                   if len(self.shapes) > 1 else ""))


@dataclass
class _Prepared:
    context: list[int]   # the committed context this draft assumes
    draft: Draft
    shape: TreeShape     # the shape it was drafted with (to finish it in, if it was cut short)


SNAPSHOT_EVERY = 16   # steps between refreshes of stats.extra["planner"] (and at the end of each run)


class Decoder:
    """Runs the loop for one EdgeSession. `shape=None` lets the planner size every tree."""

    def __init__(self, drafter: Drafter, verifier: Verifier, stats: SessionStats, shape: TreeShape | None,
                 is_end: Callable[[int], bool], pipelined: bool) -> None:
        """pipelined: always draft ahead (remote verifier). Otherwise fixed shapes run step by
        step, so a seeded local run is reproducible; the planner, whose trees depend on timing
        anyway, drafts ahead in both modes."""
        self.drafter, self.verifier, self.stats = drafter, verifier, stats
        self.shape = shape
        self.planner = Planner() if shape is None else None
        self.is_end = is_end
        self.pipelined = pipelined
        # The committed context of the conversation being decoded: prompt + every verify answer,
        # in full (also what follows an end token or max_tokens). Its only owner and writer.
        self.committed: list[int] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="edgespec-verify")

    @property
    def drafts_ahead(self) -> bool:
        return self.pipelined or self.planner is not None

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def run(self, prompt: list[int], max_tokens: int, sampling: SamplingParams) -> Iterator[list[int]]:
        """Yields the tokens committed by each target step (end-of-generation token excluded)."""
        committed = self.committed = list(prompt)  # a new list: verifiers see a new context
        if self.planner is not None:
            self.planner.begin_request(max_tokens)
        started = time.perf_counter()
        if self.drafts_ahead:  # prefill both models at once (the verifier on its own thread or host)
            with self._on_verify_thread(self.verifier.sync, committed) as synced:
                guess = self.drafter.predict_next(committed)
                self._calibrate_draft(committed + [guess], synced.done)
            synced.result()
        else:
            self.verifier.sync(committed)
            if self.shape is None or self.shape.budget:
                self.drafter.predict_next(committed)
        self.stats.prefill_seconds += time.perf_counter() - started
        try:
            yield from self._steps(committed, max_tokens, sampling)
        finally:
            self._publish_planner()

    def _steps(self, committed: list[int], max_tokens: int, sampling: SamplingParams) -> Iterator[list[int]]:
        """The loop of run(): draft (or take the prepared tree), verify, commit, until done."""
        produced, step, prepared = 0, 0, None
        while produced < max_tokens:
            started = time.perf_counter()
            hit = prepared is not None and prepared.context == committed
            if hit:
                draft = prepared.draft if prepared.draft.complete else self._finish(prepared, sampling, step)
                self.stats.prepared_hits += 1
            else:
                draft = self._draft(committed, sampling, step)
            sent = time.perf_counter()
            # Pipelined: draft the next tree while this one is verified. Not around a target-only step:
            # its answer may come back long before one draft decode ends (4 ms against 35 ms on a GPU
            # verifier nearby), and the loop would wait for the draft. The draft model takes in the
            # tokens committed meanwhile when it drafts again (TreeContext.sync), at its next tree's cost.
            if self.drafts_ahead and len(draft.tree) > 1:
                with self._on_verify_thread(_timed, self.verifier.verify, committed, draft.tree, sampling, step) as future:
                    prepared = self._draft_ahead(committed, draft, sampling, step + 1, future.done, sent)
                result, came = future.result()
            else:
                result = self.verifier.verify(committed, draft.tree, sampling, step)
                prepared = None
                if len(draft.tree) > 1:
                    self.drafter.accept(draft, result.path)
                came = None
            answered = time.perf_counter()

            committed.extend(result.tokens)  # all of it: the verifier's context now ends so
            new = result.tokens[: max_tokens - produced]
            end = next((i for i, t in enumerate(new) if self.is_end(t)), None)
            emitted = new if end is None else new[:end]
            produced += len(emitted)
            self._record(draft, result, emitted, started, sent, answered, hit, 0.0 if came is None else answered - came)
            step += 1
            if emitted:
                yield emitted
            if end is not None:
                return

    @contextlib.contextmanager
    def _on_verify_thread(self, fn: Callable[..., Any], *args: Any) -> Iterator[Future]:
        """Run fn on the verify thread while the body drafts here. However the body ends (an
        error, Ctrl-C), the call has finished on exit: the verifier is never left working behind
        the caller's back, where the next request would meet it half-way through."""
        future = self._pool.submit(fn, *args)
        try:
            yield future
        finally:
            wait([future])

    def _calibrate_draft(self, context: list[int], verifier_done: Callable[[], bool]) -> None:
        """Time one draft decode (the guessed next token) for the planner, once per session and only
        while the verifier is still prefilling, so it costs no wall time: until it drafts a tree the
        planner has only a prior for a decode, and a prior too high keeps it from ever drafting."""
        if self.planner is None or self.planner.draft_calibrated or verifier_done():
            return
        started = time.perf_counter()
        self.drafter.predict_next(context)
        self.planner.calibrate_draft(time.perf_counter() - started)

    # -- drafting -----------------------------------------------------------------------------
    def _choose(self) -> tuple[TreeShape, tuple[str, tuple[float, ...]] | None]:
        """The next tree's shape: the planner's choice and why (Draft.plan), else the fixed shape."""
        if self.planner is None:
            return self.shape, None
        shape = self.planner.choose()
        return shape, (self.planner.last_why, tuple(self.planner.last_rates))

    def _draft(self, committed: list[int], sampling: SamplingParams, step: int,
               stop: Callable[[], bool] | None = None, shape: TreeShape | None = None,
               plan: tuple[str, tuple[float, ...]] | None = None) -> Draft:
        """Draft the step's tree in `shape` (default: _choose's). With `stop`, the tree may come back
        unfinished (complete=False): see _finish."""
        if shape is None:
            shape, plan = self._choose()
        if shape.budget == 0:  # target-only decoding (the baseline): one token per step
            return Draft(TokenTree.chain(committed[-1], []), [0], np.ones(1), shape=shape.label, plan=plan)
        draft = self.drafter.grow(committed, shape, sampling, step, stop=stop)
        draft.shape, draft.plan = shape.label, plan
        if not draft.complete:
            return draft   # cut by the planner once finished, never in between
        # The planner cuts the tree by the drafted scores. Under the sampled rejection rule a cut must
        # not depend on the drawn values (drafting.selection_order), so such trees go out whole.
        if self.planner and not self.planner.exploring and not draft.prefix_groups:
            q_per_node = float(draft.tree.q_tokens.shape[1])
            order = draft.order()
            draft = draft.pruned(self.planner.prune_size(draft.scores[order], q_per_node,
                                                         depths=draft.tree.depths[order]), order)
        return draft

    def _draft_ahead(self, committed: list[int], draft: Draft, sampling: SamplingParams, step: int,
                     answered: Callable[[], bool], sent: float) -> _Prepared | None:
        """Draft the next tree assuming the in-flight tree (sent at `sent`) has its most probable path accepted."""
        path = main_path(draft)
        self.drafter.accept(draft, path)
        guess = committed + draft.tree.tokens[path].tolist()
        guess.append(self.drafter.predict_next(guess))
        if answered():
            return None
        shape, plan = self._choose()
        stop = self._ahead_stop(answered, draft, sent, shape)
        return _Prepared(guess, self._draft(guess, sampling, step, stop=stop, shape=shape, plan=plan), shape)

    def _ahead_stop(self, answered: Callable[[], bool], in_flight: Draft, sent: float,
                    shape: TreeShape) -> Callable[[], bool]:
        """When drafting ahead stops before a level: at the answer, or, with a planner, when the level would end
        after the expected answer by more than it saves. A level the answer overtakes delays the answer's use by
        its overrun, hit or miss; one not decoded costs its time later only if the guess comes true (share p, the
        in-flight tree's rung's: Planner.prepared_for). So a level starts only while the time left until the
        expected answer is at least (1 - p) times the level's cost. Decoding on regardless, prose at 100 ms RTT
        on an H100 host used the answers of tree16 steps 120-137 ms after sending them, those of chains after
        105 ms, and almost none of the trees drafted ahead there came true (thirtieth session's e2e trace)."""
        planner = self.planner
        if planner is None:
            return answered
        expected = sent + planner.answer_seconds(len(in_flight.tree) - 1)
        level_s = planner.decode_seconds(planner.rung_of(shape.label))
        keep = 1.0 - planner.prepared_for(planner.rung_of(in_flight.shape))
        return lambda: answered() or expected - time.perf_counter() < keep * level_s

    def _finish(self, prepared: _Prepared, sampling: SamplingParams, step: int) -> Draft:
        """The guess came true but the answer cut the prepared tree short: grow it on to the full
        shape (the drafter resumes where it stopped, its KV cache untouched since), so what goes
        out is the tree drafting at this step would have made. Sent as cut, prepared trees
        accepted about half the tokens (docs/BENCHMARKS.md, issue 10)."""
        return self._draft(prepared.context, sampling, step, shape=prepared.shape, plan=prepared.draft.plan)

    # -- bookkeeping --------------------------------------------------------------------------
    def _record(self, draft: Draft, result: VerifyResult, emitted: list[int], started: float, sent: float,
                answered: float, prepared: bool, late: float) -> None:
        """Count the step, trace it (`late`: how long its answer waited for the drafting ahead to stop), and show
        the planner what it cost."""
        s = self.stats
        s.steps += 1
        s.shapes[draft.shape] = s.shapes.get(draft.shape, 0) + 1
        s.tokens += len(emitted)
        s.drafted += len(draft.tree) - 1
        s.accepted += len(result.path)
        s.draft_seconds += sent - started
        s.verify_seconds += answered - sent
        s.seconds += answered - started
        if self.planner is None and s.trace is None:
            return
        accepted = np.zeros(len(draft.tree) - 1, bool)
        accepted[np.array(result.path, int) - 1] = True
        obs = StepObservation(
            nodes=len(draft.tree) - 1, draft_s=draft.seconds, draft_decodes=draft.decodes,
            network_s=result.network_s, bytes_up=result.bytes_up, verify_s=result.compute_s,
            queue_s=result.queue_s, scores=draft.scores[1:], accepted=accepted,
            depths=draft.tree.depths[1:], shape=draft.shape, prepared=prepared, wall_s=answered - started,
            catchup=catching_up(draft.catchup_tokens))
        if s.trace is not None:   # what the planner saw too (obs), so a recorded run can be replayed through it
            s.trace.append({"shape": draft.shape, "nodes": len(draft.tree) - 1, "accepted": len(result.path),
                            "prepared": prepared, "draft_ms": round(1000 * (sent - started), 2),
                            "wall_ms": round(1000 * (answered - started), 2), "late_ms": round(1000 * late, 2),
                            **({"why": draft.plan[0], "rates": [round(r, 1) for r in draft.plan[1]]} if draft.plan else {}),
                            "obs": obs.to_record(),
                            # the tree as sent (root first): tools/explain_divergence.py verifies it again
                            "tree": {"tokens": draft.tree.tokens.tolist(), "parents": draft.tree.parents.tolist()}})
        if self.planner is not None:
            self.planner.observe(obs)
            if s.steps % SNAPSHOT_EVERY == 0:
                self._publish_planner()

    def _publish_planner(self) -> None:
        """The planner's model in stats.extra["planner"]: every SNAPSHOT_EVERY steps and when a run
        ends, not every step (building it cost ~10 µs of a 3.4 ms step next to a GPU verifier)."""
        if self.planner is not None:
            self.stats.extra["planner"] = self.planner.snapshot()


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """fn(*args) and the perf_counter() time it returned (when a verify answer came, on the verify thread)."""
    result = fn(*args)
    return result, time.perf_counter()


def main_path(draft: Draft) -> list[int]:
    """Nodes from the root following, at each node, the child with the highest draft score."""
    kids = draft.tree.children()
    path, node = [], 0
    while kids[node]:
        node = max(kids[node], key=lambda c: (draft.scores[c], -c))
        path.append(node)
    return path
