"""Telling the user which side verifies: switch events, counters, the published snapshot.

Every change of the verifying side (remote <-> local) becomes one `SwitchEvent`, passed to the
session's `on_switch` callback (called from the decoder's verify thread; exceptions in it are
logged and ignored) and kept in `events`. Counters and recent history go to
`stats.extra["failover"]` after every step (see FailoverVerifier.snapshot).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("edgespec.failover")


@dataclass(frozen=True)
class SwitchEvent:
    """The verifying side changed: `from_mode` -> `to_mode` ("remote" / "local") at decode `step`
    (-1: before the first step, e.g. a local-first session whose verifier was not there yet)."""

    from_mode: str
    to_mode: str
    reason: str
    step: int
    time: float      # time.time()
    breaker: str     # the breaker state after the switch

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


COUNTERS = ("remote_steps", "local_steps", "failures", "deadline_misses", "probes", "probe_failures", "attaches",
            "reattaches")


class SwitchLog:
    """Which side verified the last step, why the next switch happens, and what was counted."""

    def __init__(self, on_switch: Callable[[SwitchEvent], None] | None = None) -> None:
        self.on_switch = on_switch
        self.mode = "remote"            # the side that verified the last step
        self.reason = ""                # why the next switch happens (set on failure / re-attach)
        self.events: list[SwitchEvent] = []
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.last_error = ""
        self.last_probe = ""
        self._lock = threading.Lock()

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def answered(self, side: str, step: int, breaker: str) -> None:
        """A step was verified by `side`; a switch is reported when that is not the last side."""
        self.count(f"{side}_steps")
        if side != self.mode:
            self.switch(side, step, breaker)

    def switch(self, to_mode: str, step: int, breaker: str) -> None:
        with self._lock:
            event = SwitchEvent(from_mode=self.mode, to_mode=to_mode, reason=self.reason, step=step,
                                time=time.time(), breaker=breaker)
            self.mode = to_mode
            self.events.append(event)
        log.warning("verification switched %s -> %s at step %d: %s", event.from_mode, event.to_mode, step,
                    event.reason)
        if self.on_switch is not None:
            try:
                self.on_switch(event)
            except Exception:  # noqa: BLE001 - a reporting callback must not break decoding
                log.exception("on_switch callback failed")
