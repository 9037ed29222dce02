"""Routing edge sessions over a fleet of verifier replicas: sticky, least-loaded, failover by resync.

    fleet = Fleet.shared("gpu1:50051,gpu2:50051")          # or "fleet:verifier.ns.svc:50051" (DNS)
    link = FleetLink(fleet, session_id, tokenizer_hash=..., model_id=...)   # a drop-in for Link
    EdgeSession(verifier="gpu1:50051,gpu2:50051")          # the same, through the session

Why the edge routes, not an ingress: a session is ONE bidirectional gRPC stream, and the replica at
its other end holds the session's KV cache. An L7 balancer (Envoy, an ingress controller, Ray
Serve's proxy) balances per call, not per message, so it can only pin the whole stream; it cannot
move a session when load shifts, cannot bring a session back to the replica that still holds its
prefix after a reconnect, and Ray Serve's proxies do not carry client-streaming gRPC at all. So the
fleet publishes its replica list (a comma list, or a DNS name with one record per replica: a
Kubernetes headless Service, see deploy/k8s/) and the edge chooses:

- Sticky by consistent hashing: the replicas are ranked by rendezvous (highest-random-weight)
  hashing of (session id, replica address). The same session id always ranks the replicas the same
  way, whichever edge process asks and whenever, so a reconnecting robot returns to the replica that
  kept its KV as a prefix cache; adding or removing a replica moves only the sessions that ranked it
  first. A session keeps its replica for as long as that replica works.
- Least-loaded among the first `choices` (default 2) of that ranking ("power of two choices"): load
  = open streams (the replica's Info) + sessions this edge placed there since + the replica's queue
  time over its compute time as the edge's sessions observed them (Verified.queue_ms/compute_ms).
  Two choices keep placement nearly as balanced as a global minimum while a session id still has
  only two possible homes.
- Full replicas are skipped: one whose Info shows every stream taken (open_streams >= max_streams)
  or that answered RESOURCE_EXHAUSTED within `dead_s` would refuse the session, and one with every
  KV slot taken (live_sessions >= max_sessions) would evict another session to take it. Placement
  goes down the ranking past them to a replica with room; only when none has any room does it use
  a KV-full one (eviction is how such a replica makes room), and when every replica is full it
  raises FleetFullError (a VerifierBusyError), which FailoverVerifier treats like an outage: the
  local fallback, and a probe that re-attaches once a replica has room (no fallback: the error).
- Slow is not dead: an Info probe opens a fresh channel (TCP, TLS, the HTTP/2 settings exchange,
  the call: 1.2 s through a relay of 400 ms each way), so its timeout follows what this edge
  measured of the replica -- INFO_TIMEOUT_FACTOR x the longer of its past probes (smoothed) and
  SETUP_ROUND_TRIPS of its sessions' round trips, at least `info_timeout_s` (1 s), at most
  `info_timeout_cap_s`: the link's connect timeout (link.CONNECT_TIMEOUT_S, 10 s), which is also
  the timeout before anything is measured. A probe that times out doubles the next one's timeout
  (up to the cap). A replica that answers within that is slow, and is used; one that does not,
  or refuses the connection (at once), is dead for `dead_s`. The candidates are probed in
  parallel, and a move's probes within what is left of the step's deadline.
- Failover by resync: a failure of the current replica (broken stream, refused connection) marks
  it dead for `dead_s` (a RESOURCE_EXHAUSTED answer: full for `dead_s`), and the SAME call
  continues on the next replica with room within the same deadline: Link.attach there (Open +
  Sync of the caller's committed context), then the verify. The decoder owns the committed
  context and passes it to every call, and the failed attempt returned nothing, so no token is
  lost or duplicated: the step is verified again, against exactly that context, on the new
  replica. Only when every replica fails (or is full: FleetFullError) does the error reach
  FailoverVerifier, whose local fallback and probe (through `revive`) take over.
"""
from __future__ import annotations

import hashlib
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import grpc

from edgespec.common import wire
from edgespec.common.acceptance import VerifyResult
from edgespec.common.errors import VerifierConfigError, VerifierUnavailableError
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.common.wire import VerifierBusyError
from edgespec.edge.first_contact import check_address, is_refusal
from edgespec.edge.link import CLIENT_ERRORS, CONNECT_TIMEOUT_S, Deadline, Link, LinkStats, make_channel
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

T = TypeVar("T")
DNS_PREFIX = "fleet:"
INFO_TIMEOUT_FACTOR = 3.0    # an Info probe may take this many times what it is expected to take
SETUP_ROUND_TRIPS = 3.0      # a fresh channel's Info in round trips: TCP, HTTP/2 settings, the call


class FleetFullError(VerifierBusyError):
    """No replica of the fleet has room for the session now (each is full, or unreachable)."""


def is_fleet_spec(spec: str | None) -> bool:
    """A fleet: several comma-separated HOST:PORTs, `fleet:NAME:PORT` (every DNS record of NAME), or
    `http(s)://...` (a replica directory answering {"replicas": ["host:port", ...]}: fleet_ray.py)."""
    return isinstance(spec, str) and ("," in spec or spec.startswith((DNS_PREFIX, "http://", "https://")))


def parse_fleet(spec: str) -> tuple[list[str], str | None]:
    """(static addresses, DNS name:port or directory URL, or None)."""
    if spec.startswith(("http://", "https://")):
        return [], spec
    if spec.startswith(DNS_PREFIX):
        target = spec[len(DNS_PREFIX):].removeprefix("//")
        check_address(target)
        return [], target
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    if not addresses:
        raise VerifierConfigError(f"no replica address in {spec!r}")
    for a in addresses:
        check_address(a)
    return list(dict.fromkeys(addresses)), None


def resolve_all(target: str) -> list[str]:
    """Every address a DNS name resolves to (one per replica behind a headless Service), or the
    replicas a directory URL lists."""
    if target.startswith(("http://", "https://")):
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(target, timeout=5) as reply:  # noqa: S310 - an operator's URL
                listed = json.load(reply)["replicas"]
        except Exception as exc:  # noqa: BLE001 - any failure: the directory cannot be read now
            raise VerifierUnavailableError(f"cannot read the replica list at {target}: {exc}") from exc
        return sorted(dict.fromkeys(str(a) for a in listed))
    host, _, port = target.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except OSError as exc:
        raise VerifierUnavailableError(f"cannot resolve the fleet name {host}: {exc}") from exc
    out = []
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        out.append(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(dict.fromkeys(out))


def hrw_score(key: str, address: str) -> int:
    """Rendezvous hash weight of (session, replica)."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{address}".encode(), digest_size=8).digest(), "big")


@dataclass
class Replica:
    """What the edge knows of one replica; `load` is what placement minimises."""

    address: str
    dead_until: float = 0.0       # monotonic; failed recently, not chosen before then
    failures: int = 0
    last_error: str = ""
    open_streams: int = 0         # from its last Info
    info_at: float = -1e9
    placed: int = 0               # sessions this edge placed here since that Info
    sessions: int = 0             # this edge's sessions on it now
    max_streams: int = 0          # from its last Info (0: not known)
    live_sessions: int = 0        # sessions holding a KV slot, from its last Info
    max_sessions: int = 0         # its KV slots, from its last Info (0: not known)
    full_until: float = 0.0       # monotonic; answered RESOURCE_EXHAUSTED, not chosen before then
    full_error: str = ""
    queue_ms: float = 0.0         # EWMA of Verified.queue_ms seen by this edge's sessions
    compute_ms: float = 0.0       # EWMA of Verified.compute_ms
    rtt_ms: float = 0.0           # EWMA of the network share of its Verify round trips (an open stream)
    steps: int = 0
    info_s: float = 0.0           # EWMA of how long this edge's Info probes of it took (a fresh channel)
    info_probes: int = 0          # probes answered
    info_backoff_s: float = 0.0   # after a probe timed out: the next one's timeout is at least this

    def alive(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.dead_until

    def full(self, now: float | None = None) -> str:
        """Why a new session cannot be opened here ("" when it can): a recent RESOURCE_EXHAUSTED
        answer, or every stream taken (its last Info plus the sessions placed here since)."""
        if (time.monotonic() if now is None else now) < self.full_until:
            return f"answered {self.full_error}"
        if self.max_streams and self.open_streams + self.placed >= self.max_streams:
            return f"full: {self.open_streams + self.placed}/{self.max_streams} open streams"
        return ""

    @property
    def kv_full(self) -> bool:
        """Every KV slot is taken: a new session would evict another (its next step resyncs)."""
        return bool(self.max_sessions) and self.live_sessions + self.placed >= self.max_sessions

    @property
    def load(self) -> float:
        queued = self.queue_ms / self.compute_ms if self.compute_ms > 0 else 0.0
        return self.open_streams + self.placed + queued


@dataclass
class Move:
    """A session moved from one replica to another (or was first placed: `old` empty)."""

    at: float                     # wall clock
    old: str
    new: str
    reason: str


class Fleet:
    """The replicas one edge process routes over (shared by its sessions: `Fleet.shared`)."""

    _shared: dict[tuple, "Fleet"] = {}
    _shared_lock = threading.Lock()

    def __init__(self, spec: str, *, token: str | None = None, tls: None | bool | str | Path = None,
                 server_name: str | None = None, choices: int = 2, dead_s: float = 5.0,
                 info_timeout_s: float = 1.0, info_timeout_cap_s: float = CONNECT_TIMEOUT_S,
                 info_max_age_s: float = 2.0, resolve_interval_s: float = 30.0) -> None:
        """info_timeout_s / info_timeout_cap_s: the least and the most an Info probe of a replica
        waits (`info_timeout`); dead_s: how long a failed replica, or a full one, is passed over."""
        self.spec = spec
        self._static, self._dns = parse_fleet(spec)
        self.token, self.tls, self.server_name = token, tls, server_name
        self.choices = max(1, int(choices))
        self.dead_s, self.info_timeout_s, self.info_max_age_s = dead_s, info_timeout_s, info_max_age_s
        self.info_timeout_cap_s = max(info_timeout_s, info_timeout_cap_s)
        self.resolve_interval_s = resolve_interval_s
        self._lock = threading.RLock()
        self._replicas: dict[str, Replica] = {}
        self._resolved_at = -1e9
        self._metadata = [(wire.AUTH_KEY, f"Bearer {token}")] if token else []
        self._refresh_list(force=True)

    @classmethod
    def shared(cls, spec: str, **kwargs) -> "Fleet":
        """One Fleet per (spec, token, tls) in this process, so concurrent sessions see each other's placements."""
        key = (spec, kwargs.get("token"), str(kwargs.get("tls")), kwargs.get("server_name"))
        with cls._shared_lock:
            fleet = cls._shared.get(key)
            if fleet is None:
                fleet = cls._shared[key] = cls(spec, **kwargs)
            return fleet

    # -- the replica list ------------------------------------------------------------------------
    def _refresh_list(self, force: bool = False) -> None:
        if self._dns is None:
            addresses = self._static
        else:
            if not force and time.monotonic() - self._resolved_at < self.resolve_interval_s:
                return
            try:
                addresses = resolve_all(self._dns)
            except VerifierUnavailableError:
                if self._replicas:  # keep the last known list through a DNS blip
                    return
                raise
            self._resolved_at = time.monotonic()
        with self._lock:
            for a in addresses:
                self._replicas.setdefault(a, Replica(a))
            for a in list(self._replicas):
                if a not in addresses and self._replicas[a].sessions == 0:
                    del self._replicas[a]

    @property
    def replicas(self) -> list[Replica]:
        with self._lock:
            return list(self._replicas.values())

    def replica(self, address: str) -> Replica:
        with self._lock:
            return self._replicas.setdefault(address, Replica(address))

    def ranking(self, key: str) -> list[Replica]:
        """Every replica in rendezvous-hash order for `key`, live ones first."""
        self._refresh_list()
        now = time.monotonic()
        ranked = sorted(self.replicas, key=lambda r: hrw_score(key, r.address), reverse=True)
        return [r for r in ranked if r.alive(now)] + [r for r in ranked if not r.alive(now)]

    # -- placement ---------------------------------------------------------------------------------
    def place(self, key: str, exclude: Sequence[str] = (), deadline: Deadline | None = None) -> Replica | None:
        """The replica for a new (or moving) session: the least loaded of the first `choices` live
        replicas in its ranking that have room (module docstring: full replicas are passed over,
        further down the ranking if need be); None when every replica is excluded. When none is
        live, the ranking's first not excluded one (it may be back). FleetFullError when no live
        replica has room. `deadline`: the Info probes end with it (a move within a step)."""
        ranked = [r for r in self.ranking(key) if r.address not in exclude]
        if self._dns is not None and not any(r.alive() for r in ranked):  # a replaced replica may be listed now
            try:
                self._refresh_list(force=True)
            except VerifierUnavailableError:
                pass
            ranked = [r for r in self.ranking(key) if r.address not in exclude]
        if not ranked:
            return None
        live = [r for r in ranked if r.alive()]
        if not live:
            return ranked[0]
        roomy: list[Replica] = []     # streams and KV slots free
        crowded: list[Replica] = []   # streams free, every KV slot taken (the replica would evict)
        full: list[Replica] = []
        i = 0
        while not roomy and i < len(live):  # past full replicas, `choices` at a time, until one has room
            batch, i = live[i:i + self.choices], i + self.choices
            for r, ok in zip(batch, self._refresh_infos(batch, deadline)):
                with self._lock:
                    if not ok:
                        continue
                    (full if r.full() else crowded if r.kv_full else roomy).append(r)
        pool = roomy or crowded[:self.choices]
        if not pool:
            if full:
                raise FleetFullError(f"no replica of the fleet {self.spec} has room for a session now: "
                                     f"{self.describe(exclude)}")
            return live[0]  # no probe answered: the first of the ranking (the Link's own attempt will tell)
        with self._lock:
            best = min(pool, key=lambda r: (r.load, ranked.index(r)))
            best.placed += 1
            return best

    def info_timeout(self, r: Replica) -> float:
        """How long an Info probe of `r` may take before `r` counts as dead (module docstring):
        INFO_TIMEOUT_FACTOR x the probe time expected from what this edge measured, within
        [info_timeout_s, info_timeout_cap_s]; the cap before anything is measured."""
        with self._lock:
            expected = max(r.info_s if r.info_probes else 0.0, SETUP_ROUND_TRIPS * r.rtt_ms / 1000)
            timeout = INFO_TIMEOUT_FACTOR * expected if expected > 0 else self.info_timeout_cap_s
            return min(self.info_timeout_cap_s, max(self.info_timeout_s, timeout, r.info_backoff_s))

    def _refresh_infos(self, rs: Sequence[Replica], deadline: Deadline | None) -> list[bool]:
        """`_refresh_info` of each, in parallel (a placement waits for the slowest, not the sum)."""
        if len(rs) <= 1:
            return [self._refresh_info(r, deadline) for r in rs]
        out = [False] * len(rs)

        def probe(n: int) -> None:
            out[n] = self._refresh_info(rs[n], deadline)

        threads = [threading.Thread(target=probe, args=(n,), name="edgespec-fleet-info", daemon=True)
                   for n in range(len(rs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # each probe ends within its timeout
        return out

    def _refresh_info(self, r: Replica, deadline: Deadline | None = None) -> bool:
        """The replica's load and capacity from its Info, unless fresh enough; False when it did not
        answer (then it is marked dead, unless only the caller's deadline cut the wait short)."""
        if time.monotonic() - r.info_at < self.info_max_age_s:
            return True
        timeout = self.info_timeout(r)
        cut = deadline is not None and deadline.remaining() < timeout
        if cut:
            timeout = deadline.remaining()
            if timeout <= 0:
                return False
        started = time.monotonic()
        try:
            reply = self.info(r.address, timeout)
        except Exception as exc:  # noqa: BLE001 - any failure: not a candidate for now
            timed_out = isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if timed_out and cut:
                return False  # the caller ran out of time; that says nothing about the replica
            if timed_out:
                with self._lock:
                    r.info_backoff_s = min(self.info_timeout_cap_s, 2 * timeout)
            self.failed(r, exc)
            return False
        took = time.monotonic() - started
        with self._lock:
            r.info_s += (0.25 if r.info_probes else 1.0) * (took - r.info_s)
            r.info_probes += 1
            r.info_backoff_s = 0.0
            r.open_streams, r.max_streams = int(reply.open_streams), int(reply.max_streams)
            r.live_sessions, r.max_sessions = int(reply.live_sessions), int(reply.max_sessions)
            r.placed, r.info_at = 0, time.monotonic()
        return True

    def info(self, address: str, timeout_s: float = 5.0) -> pb.InfoReply:
        channel = make_channel(address, self.tls, server_name=self.server_name)
        try:
            return pb_grpc.VerifierStub(channel).Info(pb.InfoRequest(), timeout=timeout_s, metadata=self._metadata)
        finally:
            channel.close()

    # -- what sessions report ------------------------------------------------------------------------
    def failed(self, r: Replica, exc: BaseException) -> None:
        with self._lock:
            r.failures += 1
            r.last_error = f"{type(exc).__name__}: {exc}"[:300]
            r.dead_until = time.monotonic() + self.dead_s
            r.info_at = -1e9

    def refused(self, r: Replica, exc: BaseException) -> None:
        """`r` answered RESOURCE_EXHAUSTED (VerifierBusyError): full, not dead; passed over by
        placement for `dead_s`."""
        with self._lock:
            r.full_error = f"{type(exc).__name__}: {exc}"[:300]
            r.full_until = time.monotonic() + self.dead_s
            r.info_at = -1e9

    def observe(self, r: Replica, result: VerifyResult) -> None:
        with self._lock:
            a = 0.2 if r.steps else 1.0
            r.queue_ms += a * (1000 * result.queue_s - r.queue_ms)
            r.compute_ms += a * (1000 * result.compute_s - r.compute_ms)
            r.rtt_ms += a * (1000 * getattr(result, "network_s", 0.0) - r.rtt_ms)
            r.steps += 1
            r.dead_until = 0.0

    def describe(self, exclude: Sequence[str] = ()) -> str:
        """Each replica's state in a few words, for errors."""
        now, out = time.monotonic(), []
        with self._lock:
            for r in sorted(self._replicas.values(), key=lambda r: r.address):
                if r.full(now):
                    state = r.full(now)
                elif not r.alive(now):
                    state = f"unreachable ({r.last_error})"
                elif r.kv_full:
                    state = f"every KV slot taken ({r.live_sessions}/{r.max_sessions})"
                else:
                    state = f"{r.open_streams + r.placed}/{r.max_streams or '?'} open streams"
                out.append(f"{r.address}: {state}{' (tried)' if r.address in exclude else ''}")
        return "; ".join(out)

    # -- aggregate metrics ---------------------------------------------------------------------------
    def metrics(self, timeout_s: float = 5.0) -> dict:
        """Every replica's Info plus what this edge saw, and fleet totals (a dead replica counts as down).

        Load, as this edge's sessions saw it in every Verified (the replica's queue and compute time
        per request, EWMA): per replica, and in the totals the step-weighted mean over the replicas
        and the worst queue, the figures an autoscaler or an operator compares with a target."""
        rows, totals = [], {"replicas": 0, "up": 0, "open_streams": 0, "live_sessions": 0, "max_sessions": 0,
                            "verifies": 0, "evictions": 0, "resyncs": 0, "prefix_hits": 0}
        with self._lock:
            seen = [(r.steps, r.queue_ms, r.compute_ms) for r in self._replicas.values() if r.steps]
        steps = sum(n for n, _, _ in seen)
        totals.update(edge_steps=steps,
                      edge_queue_ms=round(sum(n * q for n, q, _ in seen) / steps, 2) if steps else 0.0,
                      edge_compute_ms=round(sum(n * c for n, _, c in seen) / steps, 2) if steps else 0.0,
                      max_edge_queue_ms=round(max((q for _, q, _ in seen), default=0.0), 2))
        for r in sorted(self.replicas, key=lambda r: r.address):
            row = {"address": r.address, "up": False, "edge_sessions": r.sessions, "edge_failures": r.failures,
                   "edge_steps": r.steps, "edge_queue_ms": round(r.queue_ms, 2),
                   "edge_compute_ms": round(r.compute_ms, 2), "load": round(r.load, 3), "last_error": r.last_error}
            try:
                i = self.info(r.address, timeout_s)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            else:
                row.update(up=True, open_streams=i.open_streams, live_sessions=i.live_sessions,
                           max_sessions=i.max_sessions, verifies=i.verifies, evictions=i.evictions,
                           resyncs=i.resyncs, prefix_hits=i.prefix_hits, backend=i.backend, model_id=i.model_id)
                totals["up"] += 1
                for k in ("open_streams", "live_sessions", "max_sessions", "verifies", "evictions", "resyncs",
                          "prefix_hits"):
                    totals[k] += int(row[k])
            totals["replicas"] += 1
            rows.append(row)
        return {"fleet": self.spec, "totals": totals, "replicas": rows}


def movable(exc: BaseException) -> bool:
    """A failure of the replica (try another), not of the request or of this edge's credentials."""
    from edgespec.edge.failover import is_failure

    return is_failure(exc) and not isinstance(exc, CLIENT_ERRORS) and not is_refusal(exc)


class FleetLink:
    """A Link over a fleet: the same calls (sync, verify, attach, retarget, close), one replica at a
    time, moving the session (resync of the caller's context) when its replica fails."""

    def __init__(self, fleet: Fleet, key: str, *, tokenizer_hash: str, model_id: str = "",
                 client_name: str = "edgespec", timeout_s: float = 60.0) -> None:
        self.fleet, self.key, self.timeout_s = fleet, key, timeout_s
        self._link_kwargs = dict(tokenizer_hash=tokenizer_hash, model_id=model_id, client_name=client_name,
                                 server_name=fleet.server_name, timeout_s=timeout_s)
        self._lock = threading.RLock()
        self.stats = LinkStats()       # one for the session, whichever replica answered
        self.moves: list[Move] = []
        self._reached = False
        self._closed = False
        try:
            replica = fleet.place(key)
        except FleetFullError:  # the first contact asks them (a stream may have ended) and fails with it
            replica = fleet.ranking(key)[0]
        if replica is None:
            raise VerifierConfigError(f"the fleet {fleet.spec!r} has no replica")
        self.replica = replica
        self._link = self._make(replica, "placed")

    def _make(self, replica: Replica, reason: str) -> Link:
        link = Link(replica.address, self.fleet.token, self.fleet.tls, **self._link_kwargs)
        link.stats = self.stats
        with self.fleet._lock:
            replica.sessions += 1
        self.moves.append(Move(time.time(), self.replica.address if self.moves else "", replica.address, reason))
        return link

    # -- Link's interface --------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self._link.address

    @property
    def reached(self) -> bool:
        return self._reached or self._link.reached

    @property
    def opened(self) -> pb.Opened | None:
        return self._link.opened

    @property
    def server_len(self) -> int:
        return self._link.server_len

    @property
    def attached(self) -> bool:
        return self._link.attached

    def sync(self, context: Sequence[int], deadline: Deadline | None = None) -> None:
        deadline = deadline or Deadline(self.timeout_s, "sync")
        self._routed(lambda link: link.sync(context, deadline), deadline)

    def attach(self, context: Sequence[int] | None, deadline: Deadline) -> None:
        self._routed(lambda link: link.attach(context, deadline), deadline)

    def verify(self, context: Sequence[int], tree: TokenTree, sampling: SamplingParams, step: int,
               deadline: Deadline | None = None) -> VerifyResult:
        deadline = deadline or Deadline(self.timeout_s, f"step {step}")
        result = self._routed(lambda link: link.verify(context, tree, sampling, step, deadline), deadline)
        self.fleet.observe(self.replica, result)
        return result

    def retarget(self, address: str) -> None:
        """Use the replica at `address` from now on (the failover probe, through `revive`)."""
        with self._lock:
            if address != self._link.address:
                self._move(self.fleet.replica(address), "probe")

    def revive(self) -> str:
        """For FailoverVerifier's probe: the address to health-check and re-attach next -- the current
        replica while it is not known dead or full, else the best live one with room (FleetFullError
        when none has room: the probe tries again at its next interval)."""
        with self._lock:
            now = time.monotonic()
            if self.replica.alive(now) and now >= self.replica.full_until:
                return self.replica.address
        best = self.fleet.place(self.key)
        return self.replica.address if best is None else best.address

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._link.close()
                with self.fleet._lock:
                    self.replica.sessions -= 1

    def snapshot(self) -> dict:
        return {"key": self.key, "replica": self.replica.address, "moves": len(self.moves) - 1,
                "history": [m.__dict__ for m in self.moves[-8:]]}

    # -- routing -------------------------------------------------------------------------------------
    def _routed(self, op: Callable[[Link], T], deadline: Deadline) -> T:
        """Run `op` on the current replica; on a replica failure, move to the next and run it again,
        while the deadline lasts and replicas are left. A replica that answers RESOURCE_EXHAUSTED
        is full, not dead; when no replica has room, FleetFullError."""
        with self._lock:
            tried: set[str] = set()
            busy = False
            while True:
                try:
                    result = op(self._link)
                    self._reached = self._reached or self._link.reached
                    return result
                except Exception as exc:
                    self._reached = self._reached or self._link.reached
                    if self._closed or not movable(exc):
                        raise
                    tried.add(self.replica.address)
                    if isinstance(exc, VerifierBusyError):
                        busy = True
                        self.fleet.refused(self.replica, exc)
                    else:
                        self.fleet.failed(self.replica, exc)
                    try:
                        nxt = (self.fleet.place(self.key, exclude=tuple(tried), deadline=deadline)
                               if deadline.remaining() > 0 else None)
                    except FleetFullError as full:
                        raise full from exc
                    if nxt is None:
                        if busy and not isinstance(exc, FleetFullError):
                            raise FleetFullError(f"no replica of the fleet {self.fleet.spec} has room for a session "
                                                 f"now: {self.fleet.describe(tried)}") from exc
                        raise
                    self._move(nxt, f"{self.replica.address} failed: {type(exc).__name__}: {exc}"[:300])

    def _move(self, replica: Replica, reason: str) -> None:
        old = self._link
        old.close()
        with self.fleet._lock:
            self.replica.sessions -= 1
        self._link = self._make(replica, reason)
        self.replica = replica

