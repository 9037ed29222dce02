"""Is a verifier service up? The standard gRPC health check, used by the failover's probe and by
the bundled verifier's start-up (edgespec/edge/embedded.py) alike."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgespec.common import wire
from edgespec.edge.link import make_channel
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc


def check_health(address: str, *, tls: None | bool | str | Path = None, server_name: str | None = None,
                 token: str | None = None, timeout_s: float = 2.0) -> tuple[bool, str]:
    """(serving, what was seen). Needs no token; a server that does not implement the health
    service is asked for Info instead (with the token). Never raises."""
    channel = make_channel(address, tls, server_name=server_name)
    try:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME), timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                return False, f"health check: {exc.code().name}"
            metadata = [(wire.AUTH_KEY, f"Bearer {token}")] if token else []
            pb_grpc.VerifierStub(channel).Info(pb.InfoRequest(), timeout=timeout_s, metadata=metadata)
            return True, "Info answered"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return reply.status == health_pb2.HealthCheckResponse.SERVING, f"health check: {status}"
    except grpc.RpcError as exc:
        return False, f"Info: {exc.code().name}"
    except Exception as exc:  # noqa: BLE001 - a health check reports, it does not raise
        return False, f"health check failed: {type(exc).__name__}: {exc}"
    finally:
        channel.close()


def wait_serving(address: str, timeout_s: float, alive: Callable[[], bool] = lambda: True,
                 interval_s: float = 0.05) -> tuple[bool, str]:
    """Check until the service is SERVING, `alive()` turns false, or timeout_s passes;
    returns the last (serving, what was seen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok, seen = check_health(address, timeout_s=max(0.1, min(2.0, deadline - time.monotonic())))
        if ok or not alive() or time.monotonic() > deadline:
            return ok, seen
        time.sleep(interval_s)
