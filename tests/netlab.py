"""netlab: helpers (not tests) for link-fault tests in throw-away Linux network namespaces.

Why namespaces: they give each test its own, isolated pair of "hosts" joined by a veth cable that
we can unplug (``set_link``), shape (``set_rate`` with ``tbf``) or firewall (``block``), without
touching the machine's real interfaces, routes or firewall.  Everything lives *inside* the two
namespaces we create (the veth is created directly in them; the addresses are 10.231.X.0/30 and
exist nowhere else) and is destroyed on exit, even when the test fails.

Latency/jitter cannot come from here (no ``netem`` on the target machines): put
``tools/netrelay.py`` in the path for that.

Typical use::

    ok, why = netns_available()
    if not ok: pytest.skip(why)
    with netns_pair() as pair:
        server = run_in(pair.ns_b, [sys.executable, "server.py", pair.ip_b])
        sock = connect_from(pair.ns_a, (pair.ip_b, 8000), timeout_s=2)
        set_link(pair.ns_a, up=False)    # partition
        set_rate(pair.ns_a, mbit=10)     # shape ns_a -> ns_b

Processes started with :func:`run_in` are killed at teardown: a live process inside a namespace
would otherwise keep it (and its veth) alive after ``ip netns del``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

__all__ = [
    "NetnsPair",
    "NetlabError",
    "netns_available",
    "firewall_available",
    "netns_pair",
    "netns_star",
    "NetnsStar",
    "run_in",
    "set_link",
    "set_rate",
    "clear_rate",
    "block",
    "enter_netns",
    "in_netns",
    "socket_in",
    "connect_from",
    "list_netns",
    "drain",
    "read_line",
    "start_verifier",
]

T = TypeVar("T")

NS_PREFIX = "es-"
CMD_TIMEOUT_S = 10.0  # every ip/tc/iptables call is bounded
CLONE_NEWNET = 0x40000000


class NetlabError(RuntimeError):
    """A namespace/link/qdisc command failed (message includes the command and its stderr)."""


@dataclasses.dataclass(frozen=True)
class NetnsPair:
    """Two namespaces joined by one veth pair: ``ns_a`` (``veth_a``, ``ip_a``) <-> ``ns_b``."""

    ns_a: str
    ns_b: str
    veth_a: str
    veth_b: str
    ip_a: str
    ip_b: str
    prefixlen: int = 30

    def peer_ip(self, ns: str) -> str:
        """The address of the *other* end, as seen from ``ns``."""
        return self.ip_b if ns == self.ns_a else self.ip_a


# Registry of live namespaces we created: ns -> veth device inside it, and processes started
# there.  Module level so that set_link(ns, ...) / run_in(ns, ...) can take just the name.
_LOCK = threading.Lock()
_VETH: dict[str, str] = {}
_PROCS: dict[str, list[subprocess.Popen[Any]]] = {}


def _run(
    argv: Sequence[str],
    check: bool = True,
    timeout_s: float = CMD_TIMEOUT_S,
    stdin_text: str | None = None,
) -> str:
    """Run a short admin command with a timeout; raise NetlabError with stderr on failure."""
    try:
        cp = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False,
            input=stdin_text, stdin=None if stdin_text is not None else subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetlabError(f"{' '.join(argv)}: {exc}") from exc
    if check and cp.returncode != 0:
        raise NetlabError(f"{' '.join(argv)} -> rc {cp.returncode}: {cp.stderr.strip()}")
    return cp.stdout


def list_netns() -> list[str]:
    """Names from ``ip netns list`` (the first word of each line)."""
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@functools.lru_cache(maxsize=1)
def netns_available() -> tuple[bool, str]:
    """Can this process create namespaces + veth + tbf?  Returns (ok, reason-if-not).

    Checked by actually doing it once (cached), because being root is not enough: containers
    often lack CAP_SYS_ADMIN/CAP_NET_ADMIN or the veth/sch_tbf modules.
    """
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "network namespace tests need root (euid != 0)"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found (apt-get install {pkg})"
    ns = f"{NS_PREFIX}probe-{secrets.token_hex(3)}"
    try:
        _run(["ip", "netns", "add", ns])
    except NetlabError as exc:
        return False, f"kernel refused a network namespace: {exc}"
    try:
        _run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["ip", "-n", ns, "link", "set", "p0", "up"])
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", "p0", "root", "tbf",
              "rate", "10mbit", "burst", "32kb", "latency", "50ms"])
    except NetlabError as exc:
        return False, f"veth/tbf not usable: {exc}"
    finally:
        _run(["ip", "netns", "del", ns], check=False)
    return True, ""


@functools.lru_cache(maxsize=1)
def firewall_available() -> tuple[bool, str]:
    """Is there a firewall tool for :func:`block`?  Returns (ok, tool-or-reason).

    Optional on purpose: CI images may lack iptables/nft; ``set_link`` partitions without it.
    """
    ok, why = netns_available()
    if not ok:
        return False, why
    ns = f"{NS_PREFIX}fwprobe-{secrets.token_hex(3)}"
    _run(["ip", "netns", "add", ns])
    try:
        for tool in ("nft", "iptables"):
            if shutil.which(tool) is None:
                continue
            argv = ["nft", "list", "tables"] if tool == "nft" else ["iptables", "-S"]
            try:
                _run(["ip", "netns", "exec", ns, *argv])
                return True, tool
            except NetlabError:
                continue
        return False, "no working nft/iptables (apt-get install nftables or iptables)"
    finally:
        _run(["ip", "netns", "del", ns], check=False)


def _kill_procs(ns: str, grace_s: float = 3.0) -> None:
    """Terminate (then kill) processes started in ``ns`` by run_in; bounded waits."""
    with _LOCK:
        procs = _PROCS.pop(ns, [])
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(OSError):
                if p.pid and _is_group_leader(p.pid):
                    os.killpg(p.pid, signal.SIGTERM)
                else:
                    p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                if _is_group_leader(p.pid):
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace_s)
    for p in procs:  # pipes the caller asked for are ours to close once the process is gone
        for f in (p.stdin, p.stdout, p.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


def _is_group_leader(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _pids_in_netns(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False)
    return [int(w) for w in out.split() if w.isdigit()]


@contextlib.contextmanager
def netns_pair(
    prefix: str = NS_PREFIX, subnet_octet: int | None = None, mtu: int | None = None
) -> Iterator[NetnsPair]:
    """Create two fresh namespaces joined by a veth pair; tear everything down on exit.

    Names are ``{prefix}{6 hex}a`` / ``...b`` (unique; veth names fit IFNAMSIZ).  Addresses are
    ``10.231.{subnet_octet}.1/30`` and ``.2/30`` -- only inside the namespaces, so the octet (random
    by default) never clashes with the host.  ``lo`` is brought up in both (servers binding to
    127.0.0.1 in a namespace need it).  Teardown kills processes started with :func:`run_in`
    (and any stray pid still in the namespace), then deletes both namespaces, which destroys the
    veth with them.
    """
    tag = secrets.token_hex(3)
    octet = _octet(subnet_octet)
    pair = NetnsPair(f"{prefix}{tag}a", f"{prefix}{tag}b", f"{prefix}{tag}va"[:15], f"{prefix}{tag}vb"[:15],
                     f"10.231.{octet}.1", f"10.231.{octet}.2")
    with _topology([pair.ns_a, pair.ns_b], [pair], mtu):
        yield pair


@dataclasses.dataclass(frozen=True)
class NetnsStar:
    """One hub namespace joined to each leaf by its own veth: ``links[i]`` is hub (``ns_a``) <->
    leaf i (``ns_b``), so one leaf's link can be cut (``set_link(leaf, up=False)``) or shaped
    (``set_rate(hub, dev=links[i].veth_a)``) while the others keep working."""

    hub: str
    links: tuple[NetnsPair, ...]

    @property
    def leaves(self) -> list[str]:
        return [link.ns_b for link in self.links]


@contextlib.contextmanager
def netns_star(
    n: int, prefix: str = NS_PREFIX, subnet_octet: int | None = None, mtu: int | None = None
) -> Iterator[NetnsStar]:
    """A hub and ``n`` leaf namespaces, each leaf on its own veth (e.g. an edge in the hub and one
    verifier replica per leaf); torn down like :func:`netns_pair`.  Names: ``{prefix}{6 hex}h``
    and ``...0``, ``...1``, ...; leaf i is 10.231.{octet}.{4i+2}/30, its hub side .{4i+1}/30."""
    if not 1 <= n <= 63:
        raise ValueError("a star has 1..63 leaves (one /30 each in a /24)")
    tag = secrets.token_hex(3)
    octet = _octet(subnet_octet)
    hub = f"{prefix}{tag}h"
    links = tuple(NetnsPair(hub, f"{prefix}{tag}{i}", f"{prefix}{tag}h{i}"[:15], f"{prefix}{tag}v{i}"[:15],
                            f"10.231.{octet}.{4 * i + 1}", f"10.231.{octet}.{4 * i + 2}") for i in range(n))
    with _topology([hub, *(link.ns_b for link in links)], list(links), mtu):
        yield NetnsStar(hub, links)


def _octet(subnet_octet: int | None) -> int:
    octet = secrets.randbelow(256) if subnet_octet is None else int(subnet_octet)
    if not 0 <= octet <= 255:
        raise ValueError("subnet_octet must be 0..255")
    return octet


@contextlib.contextmanager
def _topology(names: list[str], links: list[NetnsPair], mtu: int | None) -> Iterator[None]:
    """Create the namespaces and veth links, and always tear down what was created (the one
    set-up/teardown path of netns_pair and netns_star).  A namespace with one veth gets it as its
    default device for set_link/set_rate; a hub with several needs ``dev=``."""
    created: list[str] = []
    body_failed = False
    try:
        for ns in names:
            _run(["ip", "netns", "add", ns])
            created.append(ns)
        ends = [(lk.ns_a, lk.veth_a, lk.ip_a) for lk in links] + [(lk.ns_b, lk.veth_b, lk.ip_b) for lk in links]
        with _LOCK:
            for ns in names:
                devs = [dev for n, dev, _ in ends if n == ns]
                if len(devs) == 1:
                    _VETH[ns] = devs[0]
        for ns in names:
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        for lk in links:
            # Created directly inside the namespaces: the host namespace never sees the devices.
            _run(["ip", "link", "add", lk.veth_a, "netns", lk.ns_a, "type", "veth",
                  "peer", "name", lk.veth_b, "netns", lk.ns_b])
        for ns, dev, ip in ends:
            if mtu is not None:
                _run(["ip", "-n", ns, "link", "set", dev, "mtu", str(int(mtu))])
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
        try:
            yield
        except BaseException:
            body_failed = True
            raise
    finally:
        errors: list[str] = []
        for ns in reversed(created):
            try:
                _kill_procs(ns)
                for pid in _pids_in_netns(ns):  # strays (e.g. grandchildren of run_in)
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            except Exception as exc:  # keep tearing down the rest
                errors.append(f"{ns}: {exc}")
            try:
                _run(["ip", "netns", "del", ns])
            except NetlabError as exc:
                errors.append(str(exc))
        with _LOCK:
            for ns in names:
                _VETH.pop(ns, None)
                _PROCS.pop(ns, None)
        if errors and not body_failed:  # never mask the test's own failure
            raise NetlabError("netns teardown: " + "; ".join(errors))


def _veth(ns: str, dev: str | None) -> str:
    if dev is not None:
        return dev
    with _LOCK:
        try:
            return _VETH[ns]
        except KeyError:
            raise NetlabError(f"{ns!r} has no default veth (not from netns_pair/netns_star, or a hub: pass dev=)") from None


def run_in(ns: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` inside namespace ``ns`` (via ``ip netns exec``); returns the Popen.

    The process gets its own process group (unless ``start_new_session`` is given) so teardown
    can signal it together with its children; it is killed when the ``netns_pair`` exits.
    """
    popen_kwargs.setdefault("start_new_session", True)
    proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **popen_kwargs)
    with _LOCK:
        _PROCS.setdefault(ns, []).append(proc)
    return proc


def set_link(ns: str, up: bool, dev: str | None = None) -> None:
    """Bring the namespace's veth end up or down (down = cable pulled: both directions dead).

    On a veth, taking one end down also drops the carrier of the peer, so connects from either
    side fail (or time out) until it is back up; addresses/routes return with ``up=True``.
    """
    _run(["ip", "-n", ns, "link", "set", _veth(ns, dev), "up" if up else "down"])


def set_rate(
    ns: str,
    mbit: float,
    burst_bytes: int | None = None,
    latency_ms: float = 50.0,
    dev: str | None = None,
) -> None:
    """Shape traffic *leaving* ``ns`` on its veth to ``mbit`` with a ``tbf`` root qdisc.

    Only egress can be shaped with tbf, so this limits ns -> peer; call it for both namespaces
    to limit both directions.  ``burst`` defaults to max(16 KiB, rate/250 s) -- tbf needs at
    least one timer tick's worth of tokens or it cannot reach the configured rate.
    ``latency`` bounds the tbf queue (packets waiting longer are dropped).
    """
    if mbit <= 0:
        raise ValueError("mbit must be > 0")
    if burst_bytes is None:
        burst_bytes = max(16 * 1024, int(mbit * 1e6 / 8 / 250))
    _run(["tc", "-n", ns, "qdisc", "replace", "dev", _veth(ns, dev), "root", "tbf",
          "rate", f"{int(mbit * 1000)}kbit", "burst", str(int(burst_bytes)),
          "latency", f"{latency_ms:g}ms"])


def clear_rate(ns: str, dev: str | None = None) -> None:
    """Remove the shaping qdisc (back to the default); no error if none was set."""
    _run(["tc", "-n", ns, "qdisc", "del", "dev", _veth(ns, dev), "root"], check=False)


_NFT_TABLE = "edgespec_netlab"


def block(ns: str, on: bool, dev: str | None = None) -> None:
    """Firewall partition: drop all packets in and out of the namespace's veth while ``on``.

    Unlike ``set_link`` the link stays up, so the kernel does not report "network unreachable":
    peers see silent loss (connect/send time out), like a real partition.  Needs nft or
    iptables inside the namespace (see :func:`firewall_available`); raises NetlabError if
    neither works, so callers should check ``firewall_available()`` and skip.
    """
    ok, tool = firewall_available()
    if not ok:
        raise NetlabError(tool)
    d = _veth(ns, dev)
    exec_ = ["ip", "netns", "exec", ns]
    if tool == "nft":
        if on:
            script = (
                f"table inet {_NFT_TABLE} {{\n"
                f"  chain input {{ type filter hook input priority -300; "
                f'iifname "{d}" drop; }}\n'
                f"  chain output {{ type filter hook output priority -300; "
                f'oifname "{d}" drop; }}\n'
                f"}}\n"
            )
            _run([*exec_, "nft", "delete", "table", "inet", _NFT_TABLE], check=False)
            _run([*exec_, "nft", "-f", "-"], stdin_text=script)
        else:
            _run([*exec_, "nft", "delete", "table", "inet", _NFT_TABLE], check=False)
        return
    # iptables: idempotent by deleting first (-D fails harmlessly when absent).
    for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
        rule = [chain, flag, d, "-j", "DROP"]
        for _ in range(10):  # bounded: remove any duplicates
            try:
                _run([*exec_, "iptables", "-D", *rule])
            except NetlabError:
                break
        if on:
            _run([*exec_, "iptables", "-I", *rule])


# ------------------------------------------------------------------ sockets inside a namespace
_libc: Any = None


def _setns(fd: int) -> None:
    global _libc
    if hasattr(os, "setns"):  # Python >= 3.12
        os.setns(fd, CLONE_NEWNET)
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def enter_netns(ns: str) -> None:
    """Move the *calling thread* into namespace ``ns`` (permanently, for that thread).

    A network namespace is a per-thread attribute on Linux, so a dedicated thread can create
    sockets (or run an event loop, e.g. ``netrelay.RelayThread(thread_init=...)``) inside a
    namespace while the rest of the test process stays in the host namespace.  Do not call this
    on a thread you need back (use :func:`in_netns` / :func:`socket_in` for that).
    """
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd)
    finally:
        os.close(fd)


def _in_thread(ns: str, fn: Callable[[], T], timeout_s: float) -> T:
    """Run ``fn`` in a short-lived thread that first enters ``ns``; return its result."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            enter_netns(ns)
            box["ok"] = fn()
        except BaseException as exc:  # re-raised in the caller
            box["err"] = exc

    t = threading.Thread(target=body, name=f"netns-{ns}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"operation in {ns} did not finish in {timeout_s}s")
    if "err" in box:
        raise box["err"]
    return box["ok"]


@contextlib.contextmanager
def in_netns(ns: str) -> Iterator[None]:
    """Temporarily move the calling thread into ``ns``; restores the previous one on exit.

    Sockets created inside the block stay in ``ns`` forever (a socket's namespace is fixed at
    creation), and keep working after the thread returns to its own namespace.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        enter_netns(ns)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def socket_in(
    ns: str, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM, proto: int = 0
) -> socket.socket:
    """An unconnected socket that lives in namespace ``ns`` (created from a helper thread)."""
    return _in_thread(ns, lambda: socket.socket(family, type, proto), CMD_TIMEOUT_S)


def connect_from(ns: str, address: tuple[str, int], timeout_s: float = 5.0) -> socket.socket:
    """A TCP connection made from inside ``ns`` (the calling thread stays where it is).

    The returned socket has ``timeout_s`` set; raises ``OSError``/``TimeoutError`` when the
    connect fails, e.g. while the link is down.
    """
    s = socket_in(ns)
    try:
        s.settimeout(timeout_s)
        s.connect(address)
        return s
    except BaseException:
        s.close()
        raise


def wait_for(cond: Callable[[], bool], timeout_s: float, interval_s: float = 0.02) -> bool:
    """Poll `cond` until it holds or `timeout_s` passes (bounded); returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval_s)
    return bool(cond())


VERIFIER_READY = "edgespec-verifier listening on "   # `edgespec verifier serve`'s first stdout line


def drain(stream: Any, sink: list[str]) -> None:
    """Read a child's text pipe to its end into `sink` (so that the child never blocks on a full pipe)."""
    for line in stream:
        sink.append(line)


def read_line(stream: Any, timeout_s: float) -> str:
    """The next line of a child's text pipe, stripped ("" if none came within timeout_s)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0].strip() if box else ""


def start_verifier(ns: str, host: str, model: os.PathLike | str, port: int = 0, *extra: str, n_ctx: int = 2048,
                   timeout_s: float = 60.0) -> tuple[subprocess.Popen[str], int]:
    """`python -m edgespec verifier serve` inside namespace `ns` on host:port (0: a free port), with the
    `extra` flags; returns the process and its port once it listens. A verifier that does not say
    so within `timeout_s` is killed: RuntimeError with the end of its stderr."""
    proc = run_in(ns, [sys.executable, "-m", "edgespec", "verifier", "serve", "--model", str(model), "--host", host,
                       "--port", str(port), "--n-ctx", str(n_ctx), "--exit-with-parent", *extra],
                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    threading.Thread(target=drain, args=(proc.stderr, err), daemon=True).start()
    line = read_line(proc.stdout, timeout_s)
    if not line.startswith(VERIFIER_READY):
        proc.kill()
        raise RuntimeError(f"verifier did not start in {ns}: {line!r} {''.join(err)[-2000:]}")
    threading.Thread(target=drain, args=(proc.stdout, []), daemon=True).start()
    return proc, int(line.rsplit(":", 1)[1])
