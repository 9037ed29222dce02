#!/usr/bin/env python3
"""netrelay: an asyncio TCP relay that injects latency, jitter, stalls, blackholes and resets.

Why this exists: the link-fault tests need a "bad network" between the edge device and the
verifier, but the test machines have no ``netem`` qdisc (only ``tbf``/``htb``, which shape rate
but cannot delay).  A user-space relay in the middle of the TCP path can add everything else:

* **delay / jitter** per direction.  Each direction has a FIFO queue of ``(release_time, chunk)``
  entries; the reader keeps reading as fast as the socket delivers and stamps every chunk with
  ``now + delay (+/- jitter)``, the writer sends each chunk once its release time has come.  So the
  relay behaves like a pipe of length D: it carries data continuously, throughput does *not*
  collapse to one chunk per delay (which is what "sleep(delay) before each read" would give).
  Release times are forced to be non-decreasing, so jitter never reorders bytes (TCP never would).
* **stall(seconds)**: data keeps being read (up to the buffer bound) but nothing is written until
  the stall ends -- connections stay open, like a link that queues but does not deliver.
* **blackhole(on)**: connections are still accepted, but every byte read (and every byte still
  queued) is discarded.  Unlike a stall the data is *lost*: a connection that lives through a
  blackhole has a gap in its byte stream, so applications will see it as broken afterwards.
* **reset_all()**: every current connection is closed with ``SO_LINGER {1, 0}``, which makes the
  kernel send a RST, on both sides (client and upstream).
* **refuse(on)**: new connections are closed as soon as they are accepted (FIN by default, RST
  with ``reset=True``).

Everything is bounded: each direction buffers at most ``max_buffer`` bytes (the reader stops
reading when that is reached, so TCP flow control pushes back on the sender), upstream connects
have a timeout, and shutdown cancels all tasks.

Use it from Python (the fault methods are thread-safe, so tests can drive a relay running in a
background thread)::

    with RelayThread(upstream=("127.0.0.1", 50051), delay_up_ms=20, delay_down_ms=20) as relay:
        host, port = relay.address
        relay.stall(1.0); relay.reset_all(); print(relay.stats())

or from the command line, with an optional line-based control port::

    python tools/netrelay.py --listen 127.0.0.1:0 --upstream 127.0.0.1:50051 \\
        --delay-up-ms 20 --delay-down-ms 20 --jitter-ms 5 --control 127.0.0.1:0

The CLI prints one JSON line ``{"listen": "H:P", "upstream": "H:P", "control": "H:P"|null}`` on
stdout once it is ready (useful with port 0).  Control commands (one per line, answer ``ok ...``
or ``err ...``): ``delay UP_MS DOWN_MS``, ``jitter MS``, ``stall SECONDS``, ``resume``,
``blackhole on|off``, ``refuse on|off [rst]``, ``reset``, ``stats``, ``ping``, ``quit``
(closes the control connection), ``shutdown`` (stops the relay).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import random
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "NetRelay",
    "RelayStats",
    "RelayThread",
    "control",
    "parse_hostport",
    "format_hostport",
    "main",
]

T = TypeVar("T")

#: Size of one read from a socket.  Small enough that delay granularity stays fine, large enough
#: that a fast loopback transfer is not dominated by per-chunk overhead.
READ_CHUNK = 64 * 1024
#: Default per-direction buffer bound.  With a 50 ms delay this still allows ~80 MB/s, i.e. the
#: relay is never the bottleneck of a test, while memory stays bounded per connection.
DEFAULT_MAX_BUFFER = 4 * 1024 * 1024
#: How long the thread-safe API waits for the event loop to apply a change.
API_TIMEOUT_S = 10.0


def parse_hostport(text: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` or ``[V6HOST]:PORT`` (the CLI's address syntax)."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"bad address {text!r}, expected [HOST]:PORT")
        port_s = rest[1:]
    else:
        host, sep, port_s = text.rpartition(":")
        if not sep:
            raise ValueError(f"bad address {text!r}, expected HOST:PORT")
    port = int(port_s)
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    return host or "127.0.0.1", port


def format_hostport(addr: tuple[str, int] | tuple[Any, ...]) -> str:
    """Inverse of :func:`parse_hostport` (brackets IPv6 literals)."""
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


@dataclasses.dataclass(frozen=True)
class RelayStats:
    """A snapshot of the relay's counters (all monotonic since start, except ``active``)."""

    bytes_up: int  # client -> upstream, bytes actually written to upstream
    bytes_down: int  # upstream -> client, bytes actually written to the client
    bytes_dropped_up: int  # discarded by blackhole (or by an aborted connection's queue)
    bytes_dropped_down: int
    connections: int  # accepted and forwarded to upstream
    active: int  # currently open relayed connections
    refused: int  # closed at once because refuse() was on
    upstream_failures: int  # upstream connect failed / timed out
    resets: int  # connections torn down by reset_all()

    def as_dict(self) -> dict[str, int]:
        """Plain dict, e.g. for JSON over the control port."""
        return dataclasses.asdict(self)


def _rst_close(writer: asyncio.StreamWriter | None) -> None:
    """Close a stream so the peer sees a RST instead of a FIN.

    ``SO_LINGER`` with a zero timeout makes ``close()`` discard unsent data and send RST; that is
    the only portable way to make a "connection reset by peer" happen on purpose.
    """
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # already closed: nothing to reset
    writer.transport.abort()


class _Pipe:
    """One direction of one connection: a reader task, a release-time FIFO, a writer task.

    Why a queue with release timestamps: the reader must never wait for the delay (that would
    turn a delay D into a throughput cap of one chunk per D); instead data waits in the queue,
    so many chunks are "on the wire" at once, exactly like a long pipe.
    """

    def __init__(
        self,
        relay: NetRelay,
        conn: _Conn,
        direction: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.relay = relay
        self.conn = conn
        self.direction = direction  # "up" (client -> upstream) or "down"
        self.reader = reader
        self.writer = writer
        # Entries are (release_time, chunk); chunk None marks EOF (to be forwarded as FIN).
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.queued_bytes = 0
        self.last_release = 0.0
        self.data_ready = asyncio.Event()  # set by the reader when the queue grows
        self.space = asyncio.Event()  # set by the writer when the queue shrinks
        self.wake = asyncio.Event()  # set by the relay when fault settings change
        self.eof_sent = False

    def drop_queued(self) -> None:
        """Discard queued data (blackhole): counted as dropped, EOF markers are kept."""
        kept: collections.deque[tuple[float, bytes | None]] = collections.deque()
        for release, chunk in self.queue:
            if chunk is None:
                kept.append((release, chunk))
            else:
                self.relay._count_dropped(self.direction, len(chunk))
        self.queue = kept
        self.queued_bytes = 0
        self.space.set()

    async def read_loop(self) -> None:
        """Read as fast as the sender and the buffer bound allow; never sleep for the delay."""
        relay = self.relay
        loop = asyncio.get_running_loop()
        while True:
            while self.queued_bytes >= relay.max_buffer:
                # Bounded buffer: stop reading so TCP flow control pushes back on the sender.
                self.space.clear()
                await self.space.wait()
            chunk = await self.reader.read(READ_CHUNK)
            if relay._blackholed and chunk:
                relay._count_dropped(self.direction, len(chunk))
                continue
            release = max(loop.time() + relay._sample_delay(self.direction), self.last_release)
            self.last_release = release
            self.queue.append((release, chunk if chunk else None))
            self.queued_bytes += len(chunk)
            self.data_ready.set()
            if not chunk:
                return  # EOF queued; the writer forwards it (as a FIN) after the delay

    async def write_loop(self) -> None:
        """Send each chunk once its release time (and any stall) has passed."""
        relay = self.relay
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.data_ready.clear()
                await self.data_ready.wait()
            release, chunk = self.queue[0]
            # Wait for max(release time, end of stall); re-evaluate when settings change.
            for _ in range(1_000_000):  # bounded; each iteration waits or exits
                now = loop.time()
                target = max(release, relay._stall_until)
                if target <= now:
                    break
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=target - now)
                except asyncio.TimeoutError:
                    pass
                if not self.queue or self.queue[0][0] != release or self.queue[0][1] is not chunk:
                    break  # queue was changed under us (blackhole dropped it): start over
            if not self.queue or self.queue[0][1] is not chunk:
                continue
            self.queue.popleft()
            if chunk is None:
                self.eof_sent = True
                if self.writer.can_write_eof():
                    self.writer.write_eof()  # forward the FIN; the socket stays open to read
                return
            self.queued_bytes -= len(chunk)
            self.space.set()
            if relay._blackholed:
                relay._count_dropped(self.direction, len(chunk))
                continue
            self.writer.write(chunk)
            relay._count_forwarded(self.direction, len(chunk))
            await self.writer.drain()


class _Conn:
    """A relayed connection: client stream, upstream stream, and the two pipes between them."""

    def __init__(
        self,
        relay: NetRelay,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.relay = relay
        self.client_writer = client[1]
        self.upstream_writer = upstream[1]
        self.up = _Pipe(relay, self, "up", client[0], upstream[1])
        self.down = _Pipe(relay, self, "down", upstream[0], client[1])
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False

    async def run(self) -> None:
        """Run both pipes; any error (reset, broken pipe) tears the whole connection down."""
        self.tasks = [
            asyncio.create_task(self.up.read_loop()),
            asyncio.create_task(self.up.write_loop()),
            asyncio.create_task(self.down.read_loop()),
            asyncio.create_task(self.down.write_loop()),
        ]
        graceful = False
        try:
            # Wait until a task fails or until all four are done (graceful FIN both ways).
            pending: set[asyncio.Task[None]] = set(self.tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                if any(t.exception() is not None for t in done if not t.cancelled()):
                    # A side reset or broke: mirror it to the other side as a RST, which is
                    # what a peer behind a real network would eventually observe too.
                    self.abort(rst=True)
                    break
            graceful = not self.closed and self.up.eof_sent and self.down.eof_sent
            if graceful:
                # Both FINs forwarded: close politely, letting buffered bytes flush first.
                self.closed = True
                for w in (self.client_writer, self.upstream_writer):
                    w.close()
                for w in (self.client_writer, self.upstream_writer):
                    try:
                        await asyncio.wait_for(w.wait_closed(), timeout=API_TIMEOUT_S)
                    except (OSError, asyncio.TimeoutError):
                        w.transport.abort()
        finally:
            if not graceful:
                self.abort(rst=False)
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def abort(self, rst: bool) -> None:
        """Stop all tasks and close both sockets (with RST if ``rst``)."""
        if self.closed:
            return
        self.closed = True
        for pipe in (self.up, self.down):
            self.relay._count_dropped(pipe.direction, pipe.queued_bytes)
            pipe.queued_bytes = 0
        for w in (self.client_writer, self.upstream_writer):
            if rst:
                _rst_close(w)
            else:
                w.transport.abort()
        try:
            current = asyncio.current_task()
        except RuntimeError:  # no running loop (cannot happen once started; be safe)
            current = None
        for t in self.tasks:
            if t is not current:
                t.cancel()

    def kick(self) -> None:
        """Wake the writers so they re-check stall/blackhole settings."""
        for pipe in (self.up, self.down):
            pipe.wake.set()


class NetRelay:
    """An asyncio TCP relay with runtime-controllable latency and faults.

    Lifecycle: ``await start()`` inside a running loop (or use :class:`RelayThread`), then
    ``await stop()``.  The fault/delay methods are synchronous and thread-safe: called from the
    loop's own thread they apply immediately, from any other thread they are marshalled onto the
    loop and wait until applied (so ``relay.reset_all()`` in a test returns after the RSTs went
    out).
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        listen: tuple[str, int] = ("127.0.0.1", 0),
        *,
        delay_up_ms: float = 0.0,
        delay_down_ms: float = 0.0,
        jitter_ms: float = 0.0,
        max_buffer: int = DEFAULT_MAX_BUFFER,
        connect_timeout_s: float = 10.0,
        control: tuple[str, int] | None = None,
        seed: int | None = None,
    ) -> None:
        """Configure (nothing is opened until :meth:`start`).

        ``jitter_ms`` is netem-like: each chunk gets ``delay + uniform(-jitter, +jitter)``
        (clamped at 0), then release times are made non-decreasing so order is preserved.
        ``control`` opens the line-based control port (see module docstring).
        """
        if max_buffer < READ_CHUNK:
            raise ValueError(f"max_buffer must be >= {READ_CHUNK}")
        self.upstream = upstream
        self.listen = listen
        self.control_listen = control
        self.max_buffer = max_buffer
        self.connect_timeout_s = connect_timeout_s
        self._delay_s = {"up": delay_up_ms / 1000.0, "down": delay_down_ms / 1000.0}
        self._jitter_s = jitter_ms / 1000.0
        self._rng = random.Random(seed)
        self._stall_until = 0.0
        self._blackholed = False
        self._refusing = False
        self._refuse_rst = False
        self._counters: dict[str, int] = {f.name: 0 for f in dataclasses.fields(RelayStats)}
        self._conns: set[_Conn] = set()
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._control_server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._stopped: asyncio.Event | None = None  # created in start() (needs a loop)
        self.address: tuple[str, int] | None = None
        self.control_address: tuple[str, int] | None = None

    # ----------------------------------------------------------------------------- lifecycle
    async def start(self) -> tuple[str, int]:
        """Bind the listening socket (and the control port); returns the bound address."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._stopped = asyncio.Event()
        self._server = await asyncio.start_server(
            self._on_client, self.listen[0], self.listen[1], reuse_address=True
        )
        self.address = self._server.sockets[0].getsockname()[:2]
        if self.control_listen is not None:
            self._control_server = await asyncio.start_server(
                self._on_control, self.control_listen[0], self.control_listen[1],
                reuse_address=True,
            )
            self.control_address = self._control_server.sockets[0].getsockname()[:2]
        return self.address

    async def stop(self) -> None:
        """Stop listening, close every relayed connection and wait for all tasks to finish."""
        for server in (self._server, self._control_server):
            if server is not None:
                server.close()
        for conn in list(self._conns):
            conn.abort(rst=False)
        tasks = list(self._handler_tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=API_TIMEOUT_S)
        for server in (self._server, self._control_server):
            if server is not None:
                try:
                    await asyncio.wait_for(server.wait_closed(), timeout=API_TIMEOUT_S)
                except asyncio.TimeoutError:
                    pass
        if self._stopped is not None:
            self._stopped.set()

    async def wait_stopped(self) -> None:
        """Block until :meth:`stop` ran (used by the CLI's ``shutdown`` command)."""
        assert self._stopped is not None, "start() first"
        await self._stopped.wait()

    # ------------------------------------------------------------------- thread-safe control
    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the relay's loop: directly if we are on it, else marshal and wait."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread or loop.is_closed():
            return fn()

        async def _run() -> T:
            return fn()

        fut = asyncio.run_coroutine_threadsafe(_run(), loop)
        return fut.result(timeout=API_TIMEOUT_S)

    def _kick_all(self) -> None:
        for conn in list(self._conns):
            conn.kick()

    def set_delay(
        self,
        up_ms: float | None = None,
        down_ms: float | None = None,
        jitter_ms: float | None = None,
    ) -> None:
        """Change delays/jitter; applies to data read from now on (queued data keeps its time)."""

        def apply() -> None:
            if up_ms is not None:
                self._delay_s["up"] = max(0.0, up_ms) / 1000.0
            if down_ms is not None:
                self._delay_s["down"] = max(0.0, down_ms) / 1000.0
            if jitter_ms is not None:
                self._jitter_s = max(0.0, jitter_ms) / 1000.0

        self._call(apply)

    def stall(self, seconds: float) -> None:
        """Hold all data (both ways, all connections) for ``seconds``; connections stay open.

        A second call extends the stall if it ends later; ``resume()`` ends it early.
        """

        def apply() -> None:
            assert self._loop is not None
            self._stall_until = max(self._stall_until, self._loop.time() + max(0.0, seconds))
            self._kick_all()

        if self._loop is None:
            raise RuntimeError("relay not started")
        self._call(apply)

    def resume(self) -> None:
        """End a stall now (held data is then released in order)."""

        def apply() -> None:
            self._stall_until = 0.0
            self._kick_all()

        self._call(apply)

    def blackhole(self, on: bool = True) -> None:
        """Drop everything (queued and newly read data) while ``on``; connections stay open."""

        def apply() -> None:
            self._blackholed = bool(on)
            if on:
                for conn in list(self._conns):
                    conn.up.drop_queued()
                    conn.down.drop_queued()
            self._kick_all()

        self._call(apply)

    def refuse(self, on: bool = True, reset: bool = False) -> None:
        """While ``on``, close new connections as soon as they are accepted (RST if ``reset``)."""

        def apply() -> None:
            self._refusing = bool(on)
            self._refuse_rst = bool(reset)

        self._call(apply)

    def reset_all(self) -> int:
        """RST every current connection on both sides; returns how many were reset."""

        def apply() -> int:
            conns = list(self._conns)
            for conn in conns:
                conn.abort(rst=True)
            self._counters["resets"] += len(conns)
            return len(conns)

        return self._call(apply)

    def stats(self) -> RelayStats:
        """Snapshot of the counters."""

        def snap() -> RelayStats:
            c = dict(self._counters)
            c["active"] = len(self._conns)
            return RelayStats(**c)

        return self._call(snap)

    @property
    def settings(self) -> dict[str, Any]:
        """Current fault settings (for logs and the control port)."""
        loop = self._loop
        now = loop.time() if loop is not None else 0.0
        return {
            "delay_up_ms": self._delay_s["up"] * 1000.0,
            "delay_down_ms": self._delay_s["down"] * 1000.0,
            "jitter_ms": self._jitter_s * 1000.0,
            "stall_left_s": max(0.0, self._stall_until - now),
            "blackhole": self._blackholed,
            "refuse": self._refusing,
        }

    # ------------------------------------------------------------------------------ internals
    def _sample_delay(self, direction: str) -> float:
        d = self._delay_s[direction]
        if self._jitter_s > 0:
            d += self._rng.uniform(-self._jitter_s, self._jitter_s)
        return max(0.0, d)

    def _count_forwarded(self, direction: str, n: int) -> None:
        self._counters["bytes_up" if direction == "up" else "bytes_down"] += n

    def _count_dropped(self, direction: str, n: int) -> None:
        if n:
            key = "bytes_dropped_up" if direction == "up" else "bytes_dropped_down"
            self._counters[key] += n

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handler_tasks.add(task)
        try:
            await self._relay_client(reader, writer)
        except asyncio.CancelledError:
            if not writer.is_closing():  # stopped while connecting upstream
                writer.transport.abort()
        finally:
            self._handler_tasks.discard(task)

    async def _relay_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if self._refusing:
            self._counters["refused"] += 1
            if self._refuse_rst:
                _rst_close(writer)
            else:
                writer.transport.abort()  # plain close: the client reads EOF
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.upstream[0], self.upstream[1]),
                timeout=self.connect_timeout_s,
            )
        except (OSError, asyncio.TimeoutError):
            # The client would have seen a refused/timed-out connect; RST is the closest we
            # can do after having accepted it.
            self._counters["upstream_failures"] += 1
            _rst_close(writer)
            return
        for w in (writer, up_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                try:  # latency is injected on purpose; do not add Nagle's on top
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
        conn = _Conn(self, (reader, writer), (up_reader, up_writer))
        self._conns.add(conn)
        self._counters["connections"] += 1
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)

    async def _on_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve the line-based control protocol on one connection."""
        task = asyncio.current_task()
        assert task is not None
        self._handler_tasks.add(task)
        try:
            for _ in range(1_000_000):  # bounded: one iteration per command line
                try:
                    line = await reader.readline()
                except (ConnectionError, asyncio.LimitOverrunError, ValueError):
                    break
                if not line:
                    break
                reply, action = self._control_command(line.decode("utf-8", "replace"))
                writer.write((reply + "\n").encode())
                try:
                    await writer.drain()
                except ConnectionError:
                    break
                if action == "quit":
                    break
                if action == "shutdown":
                    asyncio.get_running_loop().create_task(self.stop())
                    break
        finally:
            self._handler_tasks.discard(task)
            writer.close()

    def _control_command(self, line: str) -> tuple[str, str | None]:
        """Apply one control line; returns (reply, action)."""
        words = line.split()
        if not words:
            return "err empty command", None
        cmd, args = words[0].lower(), words[1:]

        def onoff(i: int = 0) -> bool:
            if len(args) <= i or args[i].lower() not in ("on", "off", "1", "0", "true", "false"):
                raise ValueError("expected on|off")
            return args[i].lower() in ("on", "1", "true")

        try:
            if cmd == "ping":
                return "ok pong", None
            if cmd == "delay":
                if len(args) != 2:
                    raise ValueError("usage: delay UP_MS DOWN_MS")
                self.set_delay(up_ms=float(args[0]), down_ms=float(args[1]))
            elif cmd == "jitter":
                if len(args) != 1:
                    raise ValueError("usage: jitter MS")
                self.set_delay(jitter_ms=float(args[0]))
            elif cmd == "stall":
                if len(args) != 1:
                    raise ValueError("usage: stall SECONDS")
                self.stall(float(args[0]))
            elif cmd == "resume":
                self.resume()
            elif cmd == "blackhole":
                self.blackhole(onoff())
            elif cmd == "refuse":
                self.refuse(onoff(), reset=len(args) > 1 and args[1].lower() == "rst")
            elif cmd == "reset":
                return f"ok {self.reset_all()}", None
            elif cmd == "stats":
                return "ok " + json.dumps({**self.stats().as_dict(), **self.settings}), None
            elif cmd == "quit":
                return "ok bye", "quit"
            elif cmd == "shutdown":
                return "ok shutting down", "shutdown"
            else:
                return f"err unknown command {cmd!r}", None
        except (ValueError, RuntimeError) as exc:
            return f"err {exc}", None
        return "ok", None


class RelayThread:
    """Run a :class:`NetRelay` on its own event loop in a daemon thread (for sync tests).

    ``thread_init`` runs first inside that thread; e.g. ``lambda: netlab.enter_netns("es-x")``
    puts the relay's sockets (listen, upstream, control) into a network namespace, because a
    network namespace is a per-thread property on Linux.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        listen: tuple[str, int] = ("127.0.0.1", 0),
        *,
        thread_init: Callable[[], None] | None = None,
        start_timeout_s: float = 10.0,
        **relay_kwargs: Any,
    ) -> None:
        self.relay = NetRelay(upstream, listen, **relay_kwargs)
        self._thread_init = thread_init
        self._start_timeout_s = start_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started: concurrent.futures.Future[None] = concurrent.futures.Future()

    def _main(self) -> None:
        try:
            if self._thread_init is not None:
                self._thread_init()
            loop = asyncio.new_event_loop()
        except BaseException as exc:  # report to start() instead of dying silently
            self._started.set_exception(exc)
            return
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            try:
                loop.run_until_complete(self.relay.start())
            except BaseException as exc:
                self._started.set_exception(exc)
                return
            self._started.set_result(None)
            loop.run_forever()
            loop.run_until_complete(self.relay.stop())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    def start(self) -> NetRelay:
        """Start the thread; returns the relay once it listens (raises if binding failed)."""
        self._thread = threading.Thread(target=self._main, name="netrelay", daemon=True)
        self._thread.start()
        self._started.result(timeout=self._start_timeout_s)
        return self.relay

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the relay, close all connections, join the thread."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=timeout_s)

    def __enter__(self) -> NetRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def control(address: tuple[str, int], command: str, timeout_s: float = 5.0) -> str:
    """Send one command to a relay's control port and return its reply line (without newline).

    Raises ``RuntimeError`` when the relay answers ``err ...``.
    """
    with socket.create_connection(address, timeout=timeout_s) as s:
        s.sendall(command.strip().encode() + b"\n")
        buf = b""
        for _ in range(10_000):  # bounded: replies are one short line
            part = s.recv(65536)
            if not part:
                break
            buf += part
            if b"\n" in buf:
                break
    reply = buf.split(b"\n", 1)[0].decode("utf-8", "replace")
    if not reply.startswith("ok"):
        raise RuntimeError(f"netrelay control {command!r}: {reply or 'no reply'}")
    return reply


async def _amain(args: argparse.Namespace) -> int:
    relay = NetRelay(
        parse_hostport(args.upstream),
        parse_hostport(args.listen),
        delay_up_ms=args.delay_up_ms,
        delay_down_ms=args.delay_down_ms,
        jitter_ms=args.jitter_ms,
        max_buffer=args.max_buffer_kb * 1024,
        connect_timeout_s=args.connect_timeout_s,
        control=parse_hostport(args.control) if args.control else None,
        seed=args.seed,
    )
    await relay.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, lambda: loop.create_task(relay.stop()))
        except (NotImplementedError, RuntimeError):
            pass
    assert relay.address is not None
    print(
        json.dumps(
            {
                "listen": format_hostport(relay.address),
                "upstream": format_hostport(relay.upstream),
                "control": format_hostport(relay.control_address)
                if relay.control_address
                else None,
            }
        ),
        flush=True,
    )
    await relay.wait_stopped()
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--listen", required=True, help="HOST:PORT to accept clients on (port 0: any)")
    p.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    p.add_argument("--delay-up-ms", type=float, default=0.0, help="client -> upstream delay")
    p.add_argument("--delay-down-ms", type=float, default=0.0, help="upstream -> client delay")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="+/- uniform jitter, both ways")
    p.add_argument("--control", default=None, help="HOST:PORT for the line-based control port")
    p.add_argument("--max-buffer-kb", type=int, default=DEFAULT_MAX_BUFFER // 1024,
                   help="per-direction buffer bound per connection")
    p.add_argument("--connect-timeout-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=None, help="jitter RNG seed (reproducible runs)")
    args = p.parse_args(argv)
    try:
        return asyncio.run(_amain(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
