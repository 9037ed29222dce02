"""systemd's sd_notify protocol in a few lines (no libsystemd): datagrams to $NOTIFY_SOCKET.

READY=1 once the daemon serves, WATCHDOG=1 every WatchdogSec/2 while it is healthy, STOPPING=1 on
shutdown, STATUS=... for `systemctl status`. Outside systemd ($NOTIFY_SOCKET unset) every call is
a no-op. The watchdog pings only while `healthy()` says so: a decode loop that hangs stops the
pings, and systemd restarts the service (Restart=on-failure, WatchdogSec= in the unit).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Callable

log = logging.getLogger("edgespec.notify")


class Notifier:
    """Sends sd_notify messages; `Notifier.from_env()` reads NOTIFY_SOCKET and WATCHDOG_USEC."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        if address:
            if address.startswith("@"):          # abstract namespace socket
                address = "\0" + address[1:]
            self._target = address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, unset: bool = True) -> "Notifier":
        """From NOTIFY_SOCKET / WATCHDOG_USEC / WATCHDOG_PID; `unset` removes them from the environment
        (like sd_notify's unset_environment), so child processes (the bundled verifier) do not
        report READY or pings on our behalf."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        watchdog = int(usec) if usec and usec.isdigit() and (not pid or pid == str(os.getpid())) else None
        address = os.environ.get("NOTIFY_SOCKET")
        if unset:
            for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(name, None)
        return cls(address, watchdog)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> bool:
        """One datagram with newline-separated KEY=VALUE fields; False if it could not be sent."""
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self._target)
            return True
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self.address, exc)
            return False

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def start_watchdog(self, healthy: Callable[[], str | None]) -> None:
        """Ping WATCHDOG=1 every WATCHDOG_USEC/2 while healthy() returns None (it returns what is wrong)."""
        if not self.enabled or not self.watchdog_usec or self._thread is not None:
            return
        interval = self.watchdog_usec / 2e6

        def loop() -> None:
            reported = False
            while not self._stop.wait(interval):
                problem = healthy()
                if problem is None:
                    self.send("WATCHDOG=1")
                    reported = False
                elif not reported:   # once per episode; systemd restarts us at WatchdogSec
                    log.error("watchdog pings stopped: %s", problem)
                    self.status(f"unhealthy: {problem}")
                    reported = True

        self._thread = threading.Thread(target=loop, name="edgespec-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
