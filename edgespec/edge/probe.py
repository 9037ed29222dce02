"""A background loop that looks for the verifier while the breaker is open.

Every `interval_s` it calls `attempt()` (revive a bundled verifier, health check, re-attach: see
FailoverVerifier._probe_once) until one succeeds or the probe is stopped. One thread per open
period; the decoder never waits for it.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("edgespec.failover")


class Probe:
    def __init__(self, interval_s: float, attempt: Callable[[], bool]) -> None:
        self.interval_s = interval_s
        self._attempt = attempt
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start probing; a previous loop (done, or about to be) is told to stop."""
        with self._lock:
            if self._stop is not None:
                self._stop.set()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._loop, args=(self._stop,), name="edgespec-failover-probe",
                                            daemon=True)
            self._thread.start()

    def stop(self, wait_s: float = 2.0) -> None:
        with self._lock:
            stop, thread = self._stop, self._thread
        if stop is not None:
            stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=wait_s)

    def _loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval_s):
            try:
                if self._attempt():
                    return
            except Exception:  # noqa: BLE001 - a probe never dies of one bad attempt
                log.exception("failover probe attempt failed")
