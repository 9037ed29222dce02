"""Session churn (tools/churn.py) on a real verifier: a few hundred sessions opened and closed, or
abandoned mid-stream (cancelled mid-request, connection dropped, opened and left, refused), leave
the KV pool, the thread count and the open file descriptors where they were after the warm-up.
The 10,000-session run is recorded in docs/BENCHMARKS.md."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import churn  # noqa: E402
from grpc_helpers import ServerProcess  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def test_churn_leaves_pool_threads_and_fds_where_they_started(smol_path):
    srv = ServerProcess(smol_path, "--n-ctx", "256", "--max-sessions", "4", "--max-nodes", "16", "--max-depth", "8",
                        "--max-streams", "16", token=churn.TOKEN)
    try:
        report = churn.churn(srv, n=300, concurrency=4, seed=3)
        assert srv.alive, "".join(srv.stderr)[-3000:]
    finally:
        assert srv.stop() == 0, "".join(srv.stderr)[-3000:]
    print(report)
    assert sum(report["per_kind"].values()) == 300
    assert {"clean", "cancel", "drop", "open-only", "refused"} <= set(report["per_kind"]), report["per_kind"]
    assert report["leaks"] == [], report
    after, base = report["after"], report["baseline"]
    assert after["fds"] <= base["fds"], (base, after)
    assert after["threads"] <= base["threads"] + 16 + 8, (base, after)   # at most gRPC's pool warming up
    assert after["open_streams"] == 0 and after["live_sessions"] == 0, after
    assert after["retained_slots"] <= report["max_sessions"], after
