"""Prometheus metrics of the verifier service: `edgespec verifier serve --metrics-port PORT`.

Counts come straight from the session registry at scrape time (one source of truth, the same
figures `Info` reports), KV use from the backend (`Backend.kv_usage`: blocks used and shared,
fragmentation, compactions) and its settings where it has them (ModelInfo.extra: prefill chunk,
compaction threshold); distributions (queue and compute time, tree size, tokens per verify) are
histograms observed by the servicer, batch size and step time (one batched forward) by the
batch worker. Each server owns its own CollectorRegistry, so several
servers can live in one process (tests) without clashing.
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from edgespec.verifier.sessions import SessionRegistry

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _SessionFigures:
    """Gauges and counters read from the SessionRegistry when Prometheus scrapes."""

    def __init__(self, sessions: SessionRegistry) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[Metric]:
        r = self.sessions
        for name, doc, value in (
                ("open_streams", "Session streams open now", r.open_streams),
                ("live_sessions", "sessions holding a KV slot now", r.live_sessions),
                ("retained_slots", "KV states of ended streams kept as a prefix cache", r.retained_slots),
                ("kv_slots", "KV slots this verifier can hold (live + retained)", r.max_live),
                ("queued_requests", "requests waiting for the compute worker now",
                 r.compute_lock.queued + (r.batcher.queued if r.batcher is not None else 0))):
            yield GaugeMetricFamily(f"edgespec_verifier_{name}", doc, value=value)
        kv = r.backend.kv_usage()
        if kv is not None:
            for name, doc, value in (
                    ("kv_blocks", "usable KV cache blocks", kv.blocks),
                    ("kv_used_blocks", "KV blocks holding some session's context now", kv.used_blocks),
                    ("kv_shared_blocks", "KV blocks shared by several sessions (common prefixes)", kv.shared_blocks),
                    ("kv_spare_blocks", "KV blocks sessions keep for their next trees (reclaimed when short)",
                     kv.spare_blocks),
                    ("kv_fragmentation", "F = 1 - largest free run / free blocks", kv.fragmentation)):
                yield GaugeMetricFamily(f"edgespec_verifier_{name}", doc, value=value)
            for name, doc, value in (
                    ("kv_compactions", "KV cache compactions (between steps, F over its threshold)", kv.compactions),
                    ("kv_blocks_moved", "KV blocks moved by compactions", kv.blocks_moved),
                    ("kv_compact_seconds", "time spent compacting the KV cache", kv.compact_seconds)):
                yield CounterMetricFamily(f"edgespec_verifier_{name}", doc, value=value)
        extra = r.backend.info.extra   # the paged backend's settings (verifier serve --prefill-chunk, ...)
        for key, name, doc in (
                ("prefill_chunk", "prefill_chunk_tokens", "tokens a Sync prefills per chunk (--prefill-chunk)"),
                ("compact_threshold", "kv_compact_threshold",
                 "F above which the KV cache is compacted between steps (--compact-threshold)")):
            if isinstance(extra.get(key), (int, float)):
                yield GaugeMetricFamily(f"edgespec_verifier_{name}", doc, value=extra[key])
        s = r.stats
        for name, doc, value in (
                ("syncs", "Sync requests served", s.syncs),
                ("verifies", "trees verified", s.verifies),
                ("evictions", "KV slots taken from idle sessions for others (LRU)", s.evictions),
                ("idle_evictions", "KV slots freed after the idle timeout", s.idle_evictions),
                ("resyncs", "ResyncRequired answers", s.resyncs),
                ("rejected_streams", "streams refused at the stream limit", s.rejected_streams),
                ("prefix_hits", "Syncs that adopted a retained KV state", s.prefix_hits),
                ("prefix_tokens_reused", "context tokens not prefilled thanks to the prefix cache",
                 s.prefix_tokens_reused),
                ("prefill_turns", "times a chunked Sync let queued requests run between its chunks",
                 s.prefill_turns),
                ("prefill_chunks_mixed", "Sync chunks prefilled in the same forward as verify trees",
                 s.prefill_chunks_mixed)):
            yield CounterMetricFamily(f"edgespec_verifier_{name}", doc, value=value)


class VerifierMetrics:
    """What the servicer observes per request, plus the registry's figures, in one registry."""

    def __init__(self, sessions: SessionRegistry) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_SessionFigures(sessions))
        self.queue_seconds = Histogram("edgespec_verifier_queue_seconds", "wait for the compute worker",
                                       ["kind"], buckets=SECONDS, registry=self.registry)
        self.compute_seconds = Histogram("edgespec_verifier_compute_seconds", "model time of a request",
                                         ["kind"], buckets=SECONDS, registry=self.registry)
        self.tree_nodes = Histogram("edgespec_verifier_tree_nodes", "nodes per verified tree (root included)",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self.tokens_per_verify = Histogram("edgespec_verifier_tokens_per_verify",
                                           "tokens committed per verified tree (accepted drafts + 1)",
                                           buckets=(1, 2, 3, 4, 5, 6, 8, 12, 16, 32), registry=self.registry)
        self.batch_size = Histogram("edgespec_verifier_batch_size", "trees verified in one forward",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.step_seconds = Histogram("edgespec_verifier_step_seconds", "one batched verify step (checks, "
                                      "forward, acceptance, commit)", buckets=SECONDS, registry=self.registry)
        if sessions.batcher is not None:
            sessions.batcher.on_batch = self.observe_batch
        self.errors = Counter("edgespec_verifier_errors", "streams ended with an error status", ["code"],
                              registry=self.registry)
        self.auth_failures = Counter("edgespec_verifier_auth_failures", "calls refused for a missing or invalid "
                                     "bearer token (failed logins)", ["reason"], registry=self.registry)
        self._http = None

    def observe(self, kind: str, queue_s: float, compute_s: float) -> None:
        self.queue_seconds.labels(kind).observe(queue_s)
        self.compute_seconds.labels(kind).observe(compute_s)

    def auth_failure(self, reason: str) -> None:
        self.auth_failures.labels(reason).inc()

    def observe_tree(self, nodes: int, tokens: int) -> None:
        self.tree_nodes.observe(nodes)
        self.tokens_per_verify.observe(tokens)

    def observe_batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.step_seconds.observe(seconds)

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the port (port 0 picks a free one)."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
