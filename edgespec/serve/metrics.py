"""Prometheus metrics of the device daemon, served at /metrics on the API port.

Counters accumulate over requests (so τ over any window is 1 + rate(accepted)/rate(steps) in
PromQL); gauges hold the last request's figures and the planner's and failover's current view.
Updated by the session threads when a request ends (SessionStats of that request), and the
queue gauges by the HTTP side. One registry per daemon, so tests can run several in a process.
"""
from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from edgespec.edge.switches import COUNTERS as FAILOVER_COUNTERS

BREAKER_STATES = ("closed", "open", "half_open")


def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        p = "edgespec_edge_"
        self.requests = Counter(p + "requests", "Chat completion requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.tokens = Counter(p + "completion_tokens", "Tokens emitted to clients", registry=r)
        self.steps = Counter(p + "target_steps", "Target (verify) steps", registry=r)
        self.drafted = Counter(p + "drafted_tokens", "Draft tree nodes sent for verification", registry=r)
        self.accepted = Counter(p + "accepted_tokens", "Drafted tokens the target accepted", registry=r)
        self.phase_seconds = Counter(p + "step_seconds", "Time per phase summed over steps "
                                     "(draft: on the critical path; verify: waiting for the verifier; "
                                     "network: verify minus the verifier's queue and compute; decode: whole steps)",
                                     ["phase"], registry=r)
        self.tau = Gauge(p + "tau", "Mean tokens per target step of the last request (incl. the target's own)",
                         registry=r)
        self.acceptance = Gauge(p + "acceptance_rate", "Accepted / drafted nodes of the last request", registry=r)
        self.tokens_per_second = Gauge(p + "tokens_per_second", "Decode speed of the last request", registry=r)
        self.request_tps = Histogram(p + "request_tokens_per_second", "Decode speed per request", registry=r,
                                     buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500))
        self.step_ms = Gauge(p + "last_step_ms", "Mean per-step time of the last request by phase",
                             ["phase"], registry=r)
        self.rtt_ms = Gauge(p + "rtt_ms", "Round-trip time to the verifier (planner estimate)", registry=r)
        self.link_rtt_ms = Gauge(p + "link_rtt_ms", "Mean measured round trip of the link (last request)", registry=r)
        self.uplink = Gauge(p + "uplink_mbit_s", "Uplink bandwidth estimate of the planner (absent until measured)",
                            registry=r)
        self.verify_ms_per_node = Gauge(p + "verify_ms_per_node", "Verifier compute per tree node (planner)",
                                        registry=r)
        self.queue_ms = Gauge(p + "verifier_queue_ms", "Verifier queue time (planner)", registry=r)
        self.shape_steps = Counter(p + "tree_shape_steps", "Target steps per tree shape the planner chose",
                                   ["shape"], registry=r)
        self.fallback_active = Gauge(p + "fallback_active", "1 while steps are verified on the device", registry=r)
        self.breaker = Gauge(p + "breaker_state", "Circuit breaker state (1 for the current one)", ["state"],
                             registry=r)
        self.switches = Counter(p + "failover_switches", "Switches between remote and local verification",
                                registry=r)
        self.failover_counts = Counter(p + "failover_events", "Failover counters (failures, deadline misses, ...)",
                                       ["event"], registry=r)
        self.pii_masked = Counter(p + "pii_entities_masked", "PII entities masked before leaving the device "
                                  "(counts only)", ["entity"], registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a session", registry=r)
        self.in_flight = Gauge(p + "requests_in_flight", "Requests being answered", registry=r)
        self.queue_seconds = Histogram(p + "queue_wait_seconds", "Time a request waited for a session", registry=r,
                                       buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.ready = Gauge(p + "ready", "1 once the models are loaded and requests are served", registry=r)
        self._failover_seen: dict[int, dict[str, int]] = {}   # per session: its counters are cumulative

    def observe_request(self, stats: Any, prompt_tokens: int, session: int = 0) -> None:
        """Fold one request's SessionStats in (called by the session thread when it ends)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.tokens.inc(stats.tokens)
        self.steps.inc(stats.steps)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.phase_seconds.labels("draft").inc(stats.draft_seconds)
        self.phase_seconds.labels("verify").inc(stats.verify_seconds)
        self.phase_seconds.labels("decode").inc(stats.seconds)
        self.phase_seconds.labels("prefill").inc(stats.prefill_seconds)
        if stats.steps:
            self.tau.set(stats.tau)
            self.acceptance.set(stats.acceptance_rate)
            self.step_ms.labels("draft").set(1000 * stats.draft_seconds / stats.steps)
            self.step_ms.labels("verify").set(1000 * stats.verify_seconds / stats.steps)
            self.step_ms.labels("decode").set(1000 * stats.seconds / stats.steps)
        if stats.seconds:
            self.tokens_per_second.set(stats.tokens_per_second)
            self.request_tps.observe(stats.tokens_per_second)
        for label, n in stats.shapes.items():
            self.shape_steps.labels(label).inc(n)
        link = getattr(stats, "link", None)
        if link is not None and getattr(link, "steps", 0):
            rtt = _finite(link.mean_rtt_ms)
            if rtt is not None:
                self.link_rtt_ms.set(rtt)
            server_s = (link.mean_queue_ms + link.mean_compute_ms) / 1000 * min(link.steps, stats.steps)
            network = max(0.0, stats.verify_seconds - server_s)
            self.phase_seconds.labels("network").inc(network)
            if stats.steps:
                self.step_ms.labels("network").set(1000 * network / stats.steps)
        self._planner(stats.extra.get("planner"))
        self._failover(stats.extra.get("failover"), session)
        self._pii(stats.extra.get("pii"))

    def _planner(self, planner: dict | None) -> None:
        if not planner:
            return
        for gauge, key in ((self.rtt_ms, "rtt_ms"), (self.uplink, "uplink_mbit_s"),
                           (self.verify_ms_per_node, "verify_ms_per_node"), (self.queue_ms, "verifier_queue_ms")):
            value = _finite(planner.get(key))
            if value is not None:   # an unmeasured bandwidth is inf: leave the gauge as it was
                gauge.set(value)

    def _failover(self, failover: dict | None, session: int) -> None:
        if not failover:
            return
        seen = self._failover_seen.setdefault(session, {})
        self.fallback_active.set(1 if failover.get("mode") == "local" else 0)
        state = str(failover.get("breaker", "closed")).replace("-", "_")
        for s in BREAKER_STATES:
            self.breaker.labels(s).set(1 if s == state else 0)
        # the snapshot's counters are cumulative over the session: add what is new
        for name in ("switches", *FAILOVER_COUNTERS):
            value = int(failover.get(name, 0))
            before = seen.get(name, 0)
            if value > before:
                (self.switches if name == "switches" else self.failover_counts.labels(name)).inc(value - before)
            seen[name] = max(before, value)

    def _pii(self, pii: dict | None) -> None:
        """PII masking (another part of the edge) publishes {"entities": {TYPE: count}} per request."""
        entities = (pii or {}).get("entities") if isinstance(pii, dict) else None
        if isinstance(entities, dict):
            for entity, n in entities.items():
                if isinstance(n, int) and n > 0:
                    self.pii_masked.labels(str(entity)).inc(n)
