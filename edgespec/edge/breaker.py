"""The circuit breaker that decides who verifies the next step: only state, no I/O.

  CLOSED     Steps go to the verifier. `threshold` consecutive failures open the breaker.
  OPEN       Steps are verified locally; a probe looks for the verifier in the background.
  HALF_OPEN  The probe re-attached: the next step tries the verifier again. Success closes the
             breaker, a failure opens it again.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("edgespec.failover")
HISTORY = 64  # transitions kept for the published snapshot


class Breaker(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(frozen=True)
class BreakerEvent:
    from_state: str
    to_state: str
    reason: str
    time: float  # time.time()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class CircuitBreaker:
    """Counts consecutive failures and records every transition; thread-safe."""

    def __init__(self, threshold: int = 1) -> None:
        if threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {threshold}")
        self.threshold = threshold
        self.state = Breaker.CLOSED
        self.consecutive_failures = 0
        self.history: collections.deque[BreakerEvent] = collections.deque(maxlen=HISTORY)
        self._lock = threading.Lock()

    @property
    def allows_remote(self) -> bool:
        return self.state is not Breaker.OPEN

    def succeeded(self, reason: str) -> bool:
        """A remote step worked; True when that closed a half-open breaker."""
        with self._lock:
            self.consecutive_failures = 0
            return self._move(Breaker.HALF_OPEN, Breaker.CLOSED, reason)

    def failed(self, reason: str) -> bool:
        """A remote attempt failed; True when the breaker opened now."""
        with self._lock:
            self.consecutive_failures += 1
            if self.state is Breaker.HALF_OPEN:
                return self._move(Breaker.HALF_OPEN, Breaker.OPEN, f"re-attach failed: {reason}")
            if self.consecutive_failures >= self.threshold:
                return self._move(Breaker.CLOSED, Breaker.OPEN,
                                  f"{self.consecutive_failures} consecutive failure(s): {reason}")
            return False

    def trip(self, reason: str) -> bool:
        """Open at once (local-first start: the verifier is not there yet)."""
        with self._lock:
            return self._move(Breaker.CLOSED, Breaker.OPEN, reason)

    def half_open(self, reason: str) -> bool:
        """The probe attached a fresh link: let the next step try it."""
        with self._lock:
            return self._move(Breaker.OPEN, Breaker.HALF_OPEN, reason)

    def _move(self, old: Breaker, new: Breaker, reason: str) -> bool:
        if self.state is not old:
            return False
        self.state = new
        self.history.append(BreakerEvent(old.value, new.value, reason, time.time()))
        log.info("breaker %s -> %s: %s", old.value, new.value, reason)
        return True
