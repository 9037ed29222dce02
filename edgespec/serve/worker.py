"""Requests queued onto a fixed pool of EdgeSessions, each driven by its own thread.

Why a queue and not a session per request: an EdgeSession holds the draft model (and, for the
fallback, a copy of the target) plus their KV caches. Creating one per request would reload the
models (seconds) and multiply memory, which a robot does not have; and on one CPU or one edge GPU
two decode loops mostly share the same compute anyway. So the daemon loads `serve.sessions`
sessions (default 1) at start and every request waits in one FIFO queue for the next free one
(at most `serve.max_queue` waiting, the rest refused with 429). docs/BENCHMARKS.md measures 1 and
4 clients.

Each session lives on one thread: EdgeSession serialises requests anyway, and a stream must be
read to the end (or closed) by whoever opened it, so one thread per session keeps that trivially
true. The thread hands chunks to the asyncio side with call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

from edgespec.common.constraints import Grammar

log = logging.getLogger("edgespec.serve")


@dataclasses.dataclass
class Params:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    response_format: Grammar | None = None   # compiled by the app from the request's response_format


@dataclasses.dataclass
class Outcome:
    """How a request ended, with its per-request statistics (SessionStats of that request)."""

    finish_reason: str            # OpenAI terms: "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    stats: Any


class Job:
    """One request: the worker puts ("chunk", text), then ("done", Outcome) or ("error", exc)."""

    def __init__(self, messages: list[dict[str, str]], params: Params, loop: asyncio.AbstractEventLoop) -> None:
        self.messages = messages
        self.params = params
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()    # the client went away: stop after the current step
        self._loop = loop
        self.enqueued = time.monotonic()
        self.on_release: Callable[[], None] | None = None

    def release(self) -> None:
        """The job's session is free again (called once, by the session thread)."""
        if self.on_release is not None:
            try:
                self.on_release()
            except RuntimeError:   # the event loop is gone (shutdown)
                pass

    def emit(self, kind: str, value: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:   # the event loop is gone (shutdown): nobody is listening any more
            self.cancelled.set()


class StopScanner:
    """Cuts a text stream at the first stop sequence, across chunk boundaries.

    Holds back the last len(longest stop) - 1 characters, which may be the start of a stop, so
    a streamed client never sees text that a later chunk turns into a stop sequence."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop sequence was found)."""
        if not self.stops:
            return text, False
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending = self.pending[:cut], ""
            return out, True
        if self.keep == 0:
            out, self.pending = self.pending, ""
        else:
            out, self.pending = self.pending[:-self.keep], self.pending[-self.keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Heartbeat:
    """What the watchdog looks at: is a request running, and when did it last make progress."""

    def __init__(self, steps: Callable[[], int] | None = None) -> None:
        self.busy = False
        self.last_progress = time.monotonic()
        self._steps = steps
        self._last_steps = -1

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def stalled_for(self) -> float:
        """Seconds without progress while busy (0 when idle). A target step counts as progress
        even before its text reaches a chunk (e.g. a partial UTF-8 character)."""
        if not self.busy:
            return 0.0
        if self._steps is not None:
            try:
                steps = self._steps()
            except Exception:  # noqa: BLE001 - the session is being replaced
                steps = self._last_steps
            if steps != self._last_steps:
                self._last_steps = steps
                self.progress()
        return time.monotonic() - self.last_progress


def pii_counts(masker: Any) -> dict[str, int]:
    """Entities masked in this request, per type, from the vault's placeholders ([EMAIL_1] -> EMAIL);
    never the values."""
    from edgespec.edge.privacy.vault import PLACEHOLDER

    counts: dict[str, int] = {}
    for _, placeholder in masker.vault.known_values():
        m = PLACEHOLDER.fullmatch(placeholder)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


class SessionWorker:
    """A thread that answers jobs from the shared queue with one EdgeSession."""

    def __init__(self, index: int, session: Any, jobs: "queue.Queue[Job | None]",
                 on_start: Callable[[Job], None],
                 on_done: Callable[[int, Job, Outcome | None, BaseException | None], None]) -> None:
        """on_start(job) when a job leaves the queue; on_done(...) exactly once per job taken from
        the queue, also for one cancelled while it waited (outcome and exception None)."""
        self.index = index
        self.session = session
        self.jobs = jobs
        self.on_start = on_start
        self.on_done = on_done
        self.heartbeat = Heartbeat(lambda: self.session.stats.steps)
        self.thread = threading.Thread(target=self._loop, name=f"edgespec-serve-{index}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.on_start(job)
            if job.cancelled.is_set():     # the client left while it waited
                self.on_done(self.index, job, None, None)
                continue
            self.heartbeat.busy = True
            self.heartbeat.progress()
            try:
                outcome = self._answer(job)
            except BaseException as exc:  # noqa: BLE001 - reported to the client; the worker keeps serving
                log.warning("request failed on session %d: %s: %s", self.index, type(exc).__name__, exc)
                self.heartbeat.busy = False
                self.on_done(self.index, job, None, exc)   # bookkeeping first: the client may ask right after
                job.emit("error", exc)
            else:
                self.heartbeat.busy = False
                self.on_done(self.index, job, outcome, None)
                job.emit("done", outcome)

    def _answer(self, job: Job) -> Outcome:
        session, p = self.session, job.params
        session.reset_stats()
        masker = getattr(session, "privacy", None)
        if masker is not None:
            # A fresh placeholder vault per request (the analyzer stays loaded): requests come from
            # different clients, and a shared vault would restore one client's values into another's answer.
            from edgespec.edge.privacy import Vault

            masker.vault = Vault()
        prompt_tokens = len(session.draft_model.chat_tokens(job.messages))
        scanner = StopScanner(p.stop)
        chunks = session.chat(job.messages, stream=True, max_tokens=p.max_tokens, temperature=p.temperature,
                              top_p=p.top_p, seed=p.seed, response_format=p.response_format)
        stopped = False
        try:
            for chunk in chunks:
                self.heartbeat.progress()
                text, stopped = scanner.push(chunk)
                if text:
                    job.emit("chunk", text)
                if stopped or job.cancelled.is_set():
                    break
        finally:
            chunks.close()
        if not stopped:
            rest = scanner.flush()
            if rest:
                job.emit("chunk", rest)
        reason = "stop" if stopped or session.finish_reason == "stop" else "length"
        stats = session.stats
        if session_masker := getattr(session, "privacy", None):
            stats.extra["pii"] = {"entities": pii_counts(session_masker)}
        return Outcome(reason, prompt_tokens, stats.tokens, stats)
