"""The circuit breaker on its own (edgespec/edge/breaker.py): pure state, so every transition can
be walked through exactly; tests/test_failover.py drives the same transitions with real failures."""
from __future__ import annotations

import pytest

from edgespec.edge.breaker import Breaker, CircuitBreaker


def test_threshold_half_open_and_reopen():
    b = CircuitBreaker(threshold=2)
    assert b.state is Breaker.CLOSED and b.allows_remote
    assert not b.failed("first")                      # 1 of 2: still closed
    assert b.succeeded("ok") is False and b.consecutive_failures == 0  # a success resets the count
    assert not b.failed("again") and b.failed("twice")  # 2 consecutive: opens now, and only now
    assert b.state is Breaker.OPEN and not b.allows_remote
    assert not b.failed("while open")                 # already open: no new transition
    assert b.half_open("probe attached") and b.allows_remote
    assert b.failed("re-attach failed")               # one failure when half-open reopens it
    assert b.half_open("probe attached again") and b.succeeded("re-attached")
    assert b.state is Breaker.CLOSED
    assert [(h.from_state, h.to_state) for h in b.history] == [
        ("closed", "open"), ("open", "half-open"), ("half-open", "open"), ("open", "half-open"),
        ("half-open", "closed")]
    assert b.history[2].reason == "re-attach failed: re-attach failed"


def test_trip_only_from_closed_and_half_open_only_from_open():
    b = CircuitBreaker()
    assert not b.half_open("nothing to re-attach")    # closed: a probe result means nothing
    assert b.trip("local-first") and b.state is Breaker.OPEN
    assert not b.trip("again")
    with pytest.raises(ValueError):
        CircuitBreaker(threshold=0)
