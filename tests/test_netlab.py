"""Tests for the network test lab: tools/netrelay.py (loopback) and tests/netlab.py (netns).

The relay tests only need loopback.  The netns tests need root + iproute2 and skip (with the
reason from ``netns_available()``) elsewhere.  Every wait is bounded; the file runs in ~15 s.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(HERE), str(ROOT / "tools")):
    if p not in sys.path:
        sys.path.insert(0, p)

import netlab  # noqa: E402
from netlab import wait_for  # noqa: E402
import netrelay  # noqa: E402

NETRELAY = ROOT / "tools" / "netrelay.py"


# --------------------------------------------------------------------------------- helpers
class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(30)
        for _ in range(10_000_000):  # bounded; exits on EOF/error
            try:
                data = sock.recv(256 * 1024)
            except OSError:
                return
            if not data:
                return
            try:
                sock.sendall(data)
            except OSError:
                return


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture(scope="module")
def echo_addr() -> Iterator[tuple[str, int]]:
    """A threaded TCP echo server on loopback."""
    srv = _EchoServer(("127.0.0.1", 0), _EchoHandler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    try:
        yield srv.server_address[:2]
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def echo_roundtrip(
    sock: socket.socket, data: bytes, timeout_s: float = 15.0
) -> tuple[bytes, float]:
    """Send ``data`` (from a thread, so both directions flow at once) and read it all back."""
    sock.settimeout(timeout_s)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            sock.sendall(data)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    got = bytearray()
    t0 = time.monotonic()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    deadline = t0 + timeout_s
    while len(got) < len(data):
        if time.monotonic() > deadline:
            raise TimeoutError(f"echo: got {len(got)}/{len(data)} bytes in {timeout_s}s")
        part = sock.recv(1 << 20)
        if not part:
            raise ConnectionError(f"EOF after {len(got)}/{len(data)} bytes")
        got += part
    elapsed = time.monotonic() - t0
    sender.join(timeout_s)
    if errors:
        raise errors[0]
    return bytes(got), elapsed


def rtt(sock: socket.socket, payload: bytes = b"ping") -> float:
    got, elapsed = echo_roundtrip(sock, payload, timeout_s=5.0)
    assert got == payload
    return elapsed


# A round trip on a path that works takes milliseconds here; asserts of the form `rtt(s) < FLOWS_S`
# only say "data flows again", so the bound leaves room for a loaded CI machine (rtt() itself gives
# up after 5 s).
FLOWS_S = 2.0


def rtts(sock: socket.socket, n: int = 3) -> list[float]:
    """``n`` round trips, sorted.  Every sample carries the configured delay (check the smallest);
    CPU load only ever adds to a sample, so upper bounds about the relay check the median."""
    return sorted(rtt(sock) for _ in range(n))


def median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def expect_no_data(sock: socket.socket, wait_s: float) -> None:
    sock.settimeout(wait_s)
    with pytest.raises((socket.timeout, TimeoutError)):
        sock.recv(1)




# ------------------------------------------------------------------------- relay (loopback)
def test_relay_rtt_matches_configured_delay(echo_addr: tuple[str, int]) -> None:
    with netrelay.RelayThread(echo_addr, delay_up_ms=50, delay_down_ms=50) as relay:
        with socket.create_connection(relay.address, timeout=5) as s:
            samples = rtts(s, 5)
    assert min(samples) >= 0.100, samples
    assert median(samples) < 0.300, samples


def test_relay_preserves_bytes_and_order_with_jitter(echo_addr: tuple[str, int]) -> None:
    data = os.urandom(4 * 1024 * 1024)
    with netrelay.RelayThread(
        echo_addr, delay_up_ms=10, delay_down_ms=10, jitter_ms=8, seed=1
    ) as relay:
        with socket.create_connection(relay.address, timeout=5) as s:
            got, _ = echo_roundtrip(s, data)
            # Half-close travels through too: our FIN reaches the echo server, its FIN comes back.
            s.shutdown(socket.SHUT_WR)
            s.settimeout(3)
            assert s.recv(10) == b""
        assert got == data
        assert wait_for(lambda: relay.stats().active == 0, 10)
        st = relay.stats()
        assert st.bytes_up == len(data) and st.bytes_down == len(data), st
        assert st.connections == 1 and st.bytes_dropped_up == 0 and st.bytes_dropped_down == 0


def test_relay_throughput_not_one_chunk_per_delay(echo_addr: tuple[str, int]) -> None:
    # One 64 KiB chunk per 50 ms would be ~1.3 MB/s: 8 MB would need > 6 s each way.
    data = os.urandom(8 * 1024 * 1024)
    with netrelay.RelayThread(echo_addr, delay_up_ms=50, delay_down_ms=50) as relay:
        with socket.create_connection(relay.address, timeout=5) as s:
            got, elapsed = echo_roundtrip(s, data)
    assert got == data
    assert elapsed >= 0.100  # the delay is still there...
    assert elapsed < 2.0, f"8 MB echo through a 50 ms relay took {elapsed:.2f}s"  # ...but piped


def test_relay_stall_holds_then_releases(echo_addr: tuple[str, int]) -> None:
    stall_s = 1.5  # well past the 0.5 s no-data window below, even if this thread is descheduled a while
    with netrelay.RelayThread(echo_addr, delay_up_ms=5, delay_down_ms=5) as relay:
        with socket.create_connection(relay.address, timeout=5) as s:
            assert rtt(s) < FLOWS_S
            t0 = time.monotonic()  # before stall(): the stall ends >= stall_s after t0 (same clock)
            relay.stall(stall_s)
            s.sendall(b"held data")
            expect_no_data(s, 0.5)  # held, connection open
            assert relay.stats().active == 1
            s.settimeout(3)
            got = b""
            for _ in range(100):
                got += s.recv(100)
                if len(got) >= 9:
                    break
            assert got == b"held data"
            assert stall_s <= time.monotonic() - t0 < stall_s + 1.5
            # resume() ends a stall early
            relay.stall(30)
            s.sendall(b"x")
            expect_no_data(s, 0.2)
            relay.resume()
            s.settimeout(3)
            assert s.recv(10) == b"x"


def test_relay_blackhole_drops_but_keeps_connections(echo_addr: tuple[str, int]) -> None:
    with netrelay.RelayThread(echo_addr, delay_up_ms=5, delay_down_ms=5) as relay:
        with socket.create_connection(relay.address, timeout=5) as s:
            assert rtt(s) < FLOWS_S
            relay.blackhole(True)
            s.sendall(b"lost" * 1000)
            expect_no_data(s, 0.4)
            # the relay may not have read all of it yet on a busy machine: wait for the count
            assert wait_for(lambda: relay.stats().bytes_dropped_up >= 4000, 10), relay.stats()
            st = relay.stats()
            assert st.bytes_dropped_up == 4000 and st.active == 1, st
            # new connections are accepted during a blackhole, but nothing flows
            with socket.create_connection(relay.address, timeout=5) as s2:
                s2.sendall(b"y")
                expect_no_data(s2, 0.2)
            relay.blackhole(False)
            with socket.create_connection(relay.address, timeout=5) as s3:
                assert rtt(s3) < FLOWS_S


def test_relay_reset_all_gives_connection_reset(echo_addr: tuple[str, int]) -> None:
    with netrelay.RelayThread(echo_addr, delay_up_ms=5, delay_down_ms=5) as relay:
        with socket.create_connection(relay.address, timeout=5) as s:
            assert rtt(s) < FLOWS_S
            assert relay.reset_all() == 1
            s.settimeout(3)
            with pytest.raises(ConnectionResetError):
                for _ in range(10):
                    s.recv(10)
                    s.sendall(b"z")
        assert wait_for(lambda: relay.stats().active == 0, 10)
        assert relay.stats().resets == 1
        with socket.create_connection(relay.address, timeout=5) as s:  # relay still serves
            assert rtt(s) < FLOWS_S


def test_relay_refuse_closes_new_connections(echo_addr: tuple[str, int]) -> None:
    with netrelay.RelayThread(echo_addr) as relay:
        with socket.create_connection(relay.address, timeout=5) as old:
            assert rtt(old) < FLOWS_S  # (also makes sure the relay has taken it over)
            relay.refuse(True)
            with socket.create_connection(relay.address, timeout=5) as s:
                s.settimeout(3)
                assert s.recv(10) == b""  # closed at once (FIN)
            relay.refuse(True, reset=True)
            assert_connection_reset(relay.address)
            assert rtt(old) < FLOWS_S  # existing connections are untouched
            relay.refuse(False)
            with socket.create_connection(relay.address, timeout=5) as s:
                assert rtt(s) < FLOWS_S
        assert relay.stats().refused == 2


def assert_connection_reset(address: tuple[str, int]) -> None:
    """Connect and expect an RST. On loopback the relay can reset the connection before
    connect() returns, so the reset may surface from connect() or from the first recv()."""
    with pytest.raises(ConnectionResetError):
        with socket.create_connection(address, timeout=5) as s:
            s.settimeout(3)
            s.recv(10)


def bind_unused(sock: socket.socket) -> tuple[str, int]:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[:2]


def test_relay_upstream_down_resets_client() -> None:
    # A bound but never listening socket: connections to it are refused, and while we hold it no
    # other process (or the relay's own listener) can be given the same port.
    with socket.socket() as tmp, netrelay.RelayThread(bind_unused(tmp), connect_timeout_s=2) as relay:
        assert_connection_reset(relay.address)
        assert relay.stats().upstream_failures == 1


def test_relay_cli_and_control_port(echo_addr: tuple[str, int]) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(NETRELAY), "--listen", "127.0.0.1:0",
         "--upstream", netrelay.format_hostport(echo_addr), "--delay-up-ms", "0",
         "--delay-down-ms", "0", "--jitter-ms", "0", "--control", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(30)
        if not (line and line[0]):
            err = proc.stderr.read() if proc.poll() is not None else ""
            pytest.fail(f"netrelay CLI printed no ready line; stderr: {err}")
        info = json.loads(line[0])
        listen = netrelay.parse_hostport(info["listen"])
        ctl = netrelay.parse_hostport(info["control"])
        assert netrelay.control(ctl, "ping") == "ok pong"
        with socket.create_connection(listen, timeout=5) as s:
            assert median(rtts(s)) < 0.1
            netrelay.control(ctl, "delay 60 60")
            delayed = rtts(s)
            assert min(delayed) >= 0.120 and median(delayed) < 0.4, delayed
            netrelay.control(ctl, "delay 0 0")
            stats = json.loads(netrelay.control(ctl, "stats")[3:])
            assert stats["connections"] == 1 and stats["bytes_up"] == 6 * len(b"ping")
            with pytest.raises(RuntimeError):
                netrelay.control(ctl, "bogus")
            assert netrelay.control(ctl, "reset") == "ok 1"
            s.settimeout(3)
            with pytest.raises(ConnectionResetError):
                s.recv(10)
        assert netrelay.control(ctl, "shutdown").startswith("ok")
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        for f in (proc.stdout, proc.stderr):
            if f:
                f.close()


def test_parse_hostport() -> None:
    assert netrelay.parse_hostport("127.0.0.1:80") == ("127.0.0.1", 80)
    assert netrelay.parse_hostport("[::1]:8080") == ("::1", 8080)
    assert netrelay.format_hostport(("::1", 1)) == "[::1]:1"
    with pytest.raises(ValueError):
        netrelay.parse_hostport("nohost")


# ------------------------------------------------------------------------------ namespaces
_NS_ECHO = r"""
import socket, sys, threading
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
def handle(c):
    with c:
        while True:
            try:
                d = c.recv(262144)
                if not d:
                    return
                c.sendall(d)
            except OSError:
                return
while True:
    c, _ = srv.accept()
    threading.Thread(target=handle, args=(c,), daemon=True).start()
"""


@pytest.fixture
def pair() -> Iterator[netlab.NetnsPair]:
    ok, why = netlab.netns_available()
    if not ok:
        pytest.skip(why)
    with netlab.netns_pair() as p:
        yield p


def start_ns_echo(ns: str, host: str) -> tuple[subprocess.Popen[str], int]:
    """Start the echo server inside ``ns``; returns (process, port)."""
    proc = netlab.run_in(ns, [sys.executable, "-c", _NS_ECHO, host],
                         stdout=subprocess.PIPE, text=True)
    line: list[str] = []
    t = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(10)
    assert line and line[0].strip().isdigit(), f"echo server in {ns} did not start"
    return proc, int(line[0])


@pytest.mark.netns
def test_netns_echo_and_link_down(pair: netlab.NetnsPair) -> None:
    proc, port = start_ns_echo(pair.ns_b, pair.ip_b)
    with netlab.connect_from(pair.ns_a, (pair.ip_b, port), timeout_s=3) as s:
        assert rtt(s) < FLOWS_S
    # The host namespace cannot reach it: the address exists only inside the pair.
    with pytest.raises(OSError):
        socket.create_connection((pair.ip_b, port), timeout=0.5).close()

    netlab.set_link(pair.ns_b, up=False)
    t0 = time.monotonic()
    with pytest.raises(OSError):  # TimeoutError or "network unreachable"
        netlab.connect_from(pair.ns_a, (pair.ip_b, port), timeout_s=1.0).close()
    assert time.monotonic() - t0 < 3

    netlab.set_link(pair.ns_b, up=True)
    sock = None
    deadline = time.monotonic() + 10
    while sock is None and time.monotonic() < deadline:
        try:
            sock = netlab.connect_from(pair.ns_a, (pair.ip_b, port), timeout_s=1.0)
        except OSError:
            time.sleep(0.1)
    assert sock is not None, "link came back up but connect still fails"
    with sock:
        assert rtt(sock) < FLOWS_S
    assert proc.poll() is None


@pytest.mark.netns
def test_netns_tbf_limits_bulk_transfer(pair: netlab.NetnsPair) -> None:
    _, port = start_ns_echo(pair.ns_b, pair.ip_b)
    data = os.urandom(2 * 1024 * 1024)
    with netlab.connect_from(pair.ns_a, (pair.ip_b, port), timeout_s=5) as s:
        got, fast = echo_roundtrip(s, data)
        assert got == data
        netlab.set_rate(pair.ns_a, mbit=10)  # shapes a -> b, which the echo must cross
        got, slow = echo_roundtrip(s, data, timeout_s=20)
        assert got == data
        netlab.clear_rate(pair.ns_a)
        got, again = echo_roundtrip(s, data)
        assert got == data
    # 2 MiB at 10 Mbit/s is ~1.7 s; unshaped veth is far faster. Before and after the shaping, bounded against the
    # shaped transfer, not by an absolute time: on a loaded 2-core CI box the transfer after clear_rate took 0.65 s
    # once (TCP's window still recovering from the shaped one)
    assert slow > 1.0, (fast, slow)
    assert fast < slow / 2 and again < slow / 2, (fast, slow, again)


@pytest.mark.netns
def test_netns_relay_inside_namespace(pair: netlab.NetnsPair) -> None:
    _, port = start_ns_echo(pair.ns_b, pair.ip_b)
    with netrelay.RelayThread(
        (pair.ip_b, port), ("127.0.0.1", 0), delay_up_ms=30, delay_down_ms=30,
        thread_init=lambda: netlab.enter_netns(pair.ns_a),
    ) as relay:
        with netlab.connect_from(pair.ns_a, relay.address, timeout_s=3) as s:
            samples = rtts(s)
            assert min(samples) >= 0.060 and median(samples) < 0.3, samples


@pytest.mark.netns
def test_netns_block_firewall(pair: netlab.NetnsPair) -> None:
    ok, why = netlab.firewall_available()
    if not ok:  # namespaces work here (root), so a missing firewall is a set-up gap, not a reason to skip
        pytest.fail(f"{why}; tools/setup.sh installs nftables when run as root")
    _, port = start_ns_echo(pair.ns_b, pair.ip_b)
    netlab.block(pair.ns_b, True)
    with pytest.raises(OSError):
        netlab.connect_from(pair.ns_a, (pair.ip_b, port), timeout_s=1.0).close()
    netlab.block(pair.ns_b, False)
    with netlab.connect_from(pair.ns_a, (pair.ip_b, port), timeout_s=3) as s:
        assert rtt(s) < FLOWS_S


@pytest.mark.netns
def test_netns_teardown_leaves_nothing() -> None:
    ok, why = netlab.netns_available()
    if not ok:
        pytest.skip(why)
    before = set(netlab.list_netns())
    with netlab.netns_pair() as p:
        names = {p.ns_a, p.ns_b}
        assert names <= set(netlab.list_netns())
        proc, _ = start_ns_echo(p.ns_a, p.ip_a)
    assert not names & set(netlab.list_netns())
    assert proc.poll() is not None, "process started with run_in survived teardown"
    # ...also when the body raises
    with pytest.raises(ZeroDivisionError):
        with netlab.netns_pair() as p2:
            names2 = {p2.ns_a, p2.ns_b}
            start_ns_echo(p2.ns_b, p2.ip_b)
            1 / 0
    assert not names2 & set(netlab.list_netns())
    assert set(netlab.list_netns()) == before
    host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                                timeout=10).stdout
    assert p.veth_a not in host_links and p2.veth_b not in host_links
