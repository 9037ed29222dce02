"""Ray Serve manages the verifier replicas; the edge routes over the replica list it publishes.

    python -m edgespec.verifier.fleet_ray --model PATH --replicas 2 --http-port 8000 \\
        [--verifier-python /path/to/venv/bin/python] [-- extra `edgespec verifier serve` arguments]
    edgespec run "..." --verifier http://ray-head:8000/replicas

Why not through Ray Serve's proxy: a Session is one bidirectional gRPC stream whose replica holds
its KV cache; Ray Serve's gRPC proxy long carried only unary and server-streaming calls, and any
proxy balances per call with no session affinity. So each Serve replica (`VerifierReplica`) owns
one `edgespec verifier serve` process (one model copy) on its own port; Ray Serve keeps
`--replicas` of them alive (its health check asks the process's gRPC health service every
`health_check_period_s`, and a failed check makes Ray replace the replica, which starts a new
process), and the ingress (`FleetDirectory`, plain HTTP) publishes the live replicas' addresses.
The edge routes over that list (edgespec/edge/fleet.py: rendezvous hashing, least-loaded
placement, resync on a replica's death) and re-reads it when its replicas fail.

Only Ray (and grpcio, which Ray depends on) is needed in the Ray environment: the replica runs the
verifier with `--verifier-python` (an environment that has edgespec), and the health check speaks
grpc.health.v1 with hand-encoded messages.
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import signal
import subprocess
import sys
import threading
import time

import ray
from ray import serve

SERVICE = "edgespec.v1.Verifier"
REGISTRY = "edgespec-fleet-registry"
NAMESPACE = "edgespec"
STALE_S = 6.0  # a replica that has not reported for this long is not listed
TARGET_QUEUE_MS = float(os.environ.get("EDGESPEC_FLEET_TARGET_QUEUE_MS", "50"))


def queue_time_policy(ctx) -> tuple[int, dict]:  # noqa: ANN001 - ray.serve.config.AutoscalingContext
    """Ray Serve autoscaling on the replicas' mean queue time per request (each replica reports it
    from its verifier's Prometheus histogram: `record_autoscaling_stats`). Serve's own signal, its
    count of ongoing requests, sees nothing here: the edges' streams do not go through Serve. Scale
    up towards queue / target (at most doubling per decision), down by one below a quarter of it.
    The target comes from $EDGESPEC_FLEET_TARGET_QUEUE_MS in the Serve controller's environment."""
    n = ctx.current_num_replicas
    lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    queues = list(((ctx.aggregated_metrics or {}).get("queue_ms") or {}).values())
    if not queues:
        return max(lo, min(hi, n)), ctx.policy_state
    q = sum(queues) / len(queues)
    if q > TARGET_QUEUE_MS:
        want = min(2 * n, math.ceil(n * q / TARGET_QUEUE_MS))
    elif q < TARGET_QUEUE_MS / 4:
        want = n - 1
    else:
        want = n
    return max(lo, min(hi, want)), ctx.policy_state


def grpc_healthy(address: str, timeout_s: float = 3.0) -> bool:
    """grpc.health.v1.Health/Check for SERVICE: HealthCheckRequest{service} in, status SERVING (1) out."""
    import grpc

    name = SERVICE.encode()
    request = b"\n" + bytes([len(name)]) + name
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            reply = check(request, timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply == b"\x08\x01"


@ray.remote(num_cpus=0)
class Registry:
    """Where replicas report their address (every 2 s); the directory lists the fresh ones."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[str, float]] = {}

    def put(self, replica: str, address: str) -> None:
        self.entries[replica] = (address, time.time())

    def drop(self, replica: str) -> None:
        self.entries.pop(replica, None)

    def fresh(self) -> dict[str, str]:
        now = time.time()
        return {r: a for r, (a, t) in self.entries.items() if now - t < STALE_S}


def registry() -> "ray.actor.ActorHandle":
    return Registry.options(name=REGISTRY, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()


@serve.deployment(health_check_period_s=2, health_check_timeout_s=10, graceful_shutdown_timeout_s=5,
                  ray_actor_options={"num_cpus": 0})
class VerifierReplica:
    """One model copy: an `edgespec verifier serve` process this replica starts, reports and checks."""

    def __init__(self, python: str, model: str, serve_args: list[str], host: str = "127.0.0.1") -> None:
        with socket.socket() as s:  # a free port for the verifier's /metrics (its queue-time histogram)
            s.bind(("127.0.0.1", 0))
            self.metrics_port = s.getsockname()[1]
        self._queue_seen = (0.0, 0.0)
        cmd = [python, "-m", "edgespec", "verifier", "serve", "--model", model, "--host", host, "--port", "0",
               "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1", "--exit-with-parent",
               *serve_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.address = ""
        for line in self.proc.stdout:
            if line.startswith("edgespec-verifier listening on "):
                self.address = line.split()[-1]
                break
        if not self.address:
            raise RuntimeError(f"the verifier process exited with {self.proc.wait()}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        self.replica_id = serve.get_replica_context().replica_tag
        self.registry = registry()
        self._stop = threading.Event()
        threading.Thread(target=self._report, daemon=True).start()

    def _report(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            self.registry.put.remote(self.replica_id, self.address)
            self._stop.wait(2.0)

    def check_health(self) -> None:
        """Ray Serve calls this every health_check_period_s; raising makes it replace the replica."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the verifier process at {self.address} exited with {self.proc.returncode}")
        if not grpc_healthy(self.address):
            raise RuntimeError(f"the verifier at {self.address} is not SERVING")

    def get_address(self) -> str:
        return self.address

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Mean queue time per request since the last call, from the verifier's /metrics."""
        import urllib.request

        total = count = 0.0
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("edgespec_verifier_queue_seconds_sum"):
                    total += float(line.split()[-1])
                elif line.startswith("edgespec_verifier_queue_seconds_count"):
                    count += float(line.split()[-1])
        (t0, c0), self._queue_seen = self._queue_seen, (total, count)
        return {"queue_ms": 1000 * (total - t0) / (count - c0) if count > c0 else 0.0}

    def __del__(self) -> None:
        self._stop.set()
        try:
            self.registry.drop.remote(self.replica_id)
        except Exception:  # noqa: BLE001 - Ray may be shutting down
            pass
        if self.proc.poll() is None:
            self.proc.terminate()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class FleetDirectory:
    """GET /replicas -> {"replicas": [...]}: the addresses of replicas that reported recently."""

    def __init__(self, replicas: "serve.handle.DeploymentHandle") -> None:
        self.replicas = replicas  # bound so that Serve deploys the replicas with the directory
        self.registry = registry()

    async def __call__(self, request) -> dict:  # noqa: ANN001 - a starlette Request
        fresh = await self.registry.fresh.remote()
        return {"replicas": sorted(set(fresh.values())), "count": len(fresh)}


def build(python: str, model: str, replicas: int, serve_args: list[str], max_replicas: int | None = None):  # noqa: ANN201
    """The Serve application: the directory bound to `replicas` verifier replicas, or to an autoscaled
    deployment of `replicas`..`max_replicas` on queue time (`queue_time_policy`)."""
    if max_replicas and max_replicas > replicas:
        options = {"autoscaling_config": {
            "min_replicas": replicas, "max_replicas": max_replicas, "initial_replicas": replicas,
            "look_back_period_s": 20, "upscale_delay_s": 5, "downscale_delay_s": 120,
            "policy": {"policy_function": queue_time_policy}}}
    else:
        options = {"num_replicas": replicas}
    return FleetDirectory.bind(VerifierReplica.options(**options).bind(python, model, serve_args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the target model (a GGUF path or manifest name)")
    ap.add_argument("--replicas", type=int, default=2, help="replicas (the minimum when autoscaling)")
    ap.add_argument("--max-replicas", type=int, default=None,
                    help="autoscale up to this many on queue time (target: --target-queue-ms)")
    ap.add_argument("--target-queue-ms", type=float, default=TARGET_QUEUE_MS)
    ap.add_argument("--http-host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--verifier-python", default=sys.executable, help="a Python that has edgespec installed")
    ap.add_argument("--num-cpus", type=int, default=None, help="Ray's CPU count (default: the machine's)")
    args = ap.parse_args(argv)
    os.environ["EDGESPEC_FLEET_TARGET_QUEUE_MS"] = str(args.target_queue_ms)  # for the Serve controller
    ray.init(namespace=NAMESPACE, include_dashboard=False, num_cpus=args.num_cpus, log_to_driver=False)
    serve.start(http_options={"host": args.http_host, "port": args.http_port})
    serve.run(build(args.verifier_python, args.model, args.replicas, extra, args.max_replicas), name="edgespec-fleet",
              route_prefix="/replicas")
    print(f"edgespec-fleet directory on http://{args.http_host}:{args.http_port}/replicas", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0):  # a bounded wait, so the signal handler runs promptly
        pass
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
