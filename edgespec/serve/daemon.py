"""The device daemon: bind, load the sessions, tell systemd READY, serve until SIGTERM.

Order matters for systemd and for operators: the port is bound first, so a busy port fails in a
second (exit 2) instead of after a model load; the HTTP server answers /health ("loading", 503)
while the models load in a thread; READY=1 goes out only once every session is loaded; a model
that cannot be loaded ends the daemon with exit 2 (the unit's RestartPreventExitStatus=2 keeps
systemd from looping on a configuration mistake). Stdout gets two machine-readable lines:

    edgespec-serve listening on http://HOST:PORT
    edgespec-serve ready
"""
from __future__ import annotations

import errno
import logging
import signal
import socket
import sys
import threading
from typing import Any

from edgespec.config import Config
from edgespec.serve.app import Service, build_app
from edgespec.serve.notify import Notifier

log = logging.getLogger("edgespec.serve")
LISTENING = "edgespec-serve listening on "
READY = "edgespec-serve ready"


class BindError(OSError):
    """The configured address cannot be bound (in use, not local, no permission)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; one daemon per port (SO_REUSEADDR only, never SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        why = {errno.EADDRINUSE: "the port is in use (another edgespec serve?)",
               errno.EADDRNOTAVAIL: "the address is not one of this machine's",
               errno.EACCES: "permission denied (ports below 1024 need privileges)"}.get(exc.errno, exc.strerror)
        raise BindError(exc.errno, f"cannot listen on {host}:{port} (serve.host, serve.port): {why}") from None
    sock.set_inheritable(True)
    return sock


def make_session(cfg: Config) -> Any:
    """One EdgeSession from the [edge] settings; fallback switches go to the log (the journal)."""
    from edgespec.config import session_kwargs
    from edgespec.edge.session import EdgeSession

    kwargs = session_kwargs(cfg)
    if not kwargs.get("local"):
        kwargs["on_switch"] = lambda e: log.warning("verifying %s from step %s: %s", e.to_mode, e.step, e.reason)
    return EdgeSession(cfg.get("edge.draft"), cfg.get("edge.target"), **kwargs)


def run(cfg: Config, out: Any = sys.stdout) -> int:
    """Serve until SIGTERM/SIGINT; 0 on a clean stop, 2 when the models cannot be loaded."""
    import uvicorn

    notifier = Notifier.from_env()
    sock = bind(cfg.get("serve.host"), cfg.get("serve.port"))
    host, port = sock.getsockname()[:2]
    service = Service(cfg)
    server = uvicorn.Server(uvicorn.Config(build_app(service), log_config=None, access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=5, timeout_keep_alive=30))
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            server.force_exit = True
        stop.set()
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    shown = f"[{host}]" if ":" in host else host
    print(f"{LISTENING}http://{shown}:{port}", file=out, flush=True)
    notifier.status(f"loading {cfg.get('serve.sessions')} session(s): {cfg.get('edge.draft')} drafting "
                    f"for {cfg.get('edge.target')}")

    def load() -> None:
        try:
            for i in range(cfg.get("serve.sessions")):
                if stop.is_set():
                    return
                log.info("loading session %d of %d", i + 1, cfg.get("serve.sessions"))
                service.add_session(make_session(cfg))
        except BaseException as exc:  # noqa: BLE001 - reported, then the daemon exits 2
            service.load_error = f"cannot load the models: {type(exc).__name__}: {exc}"
            log.error("%s", service.load_error)
            notifier.status(service.load_error)
            server.should_exit = True
            return
        if stop.is_set():
            return
        service.ready = True
        service.metrics.ready.set(1)
        mode = (f"verifier {cfg.get('edge.verifier')}" if cfg.get("edge.verifier") else
                "local target" if cfg.get("edge.local") else "bundled verifier")
        notifier.ready(f"serving {cfg.get('serve.model_name')} on {shown}:{port} ({mode})")
        notifier.start_watchdog(service.stalled)
        print(READY, file=out, flush=True)
        log.info("ready: http://%s:%s (%s)", shown, port, mode)

    loader = threading.Thread(target=load, name="edgespec-serve-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        stop.set()
        notifier.stopping()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        loader.join(timeout=60)
        service.close()
        notifier.close()
        sock.close()
    if service.load_error:
        print(f"edgespec: error: {service.load_error}", file=sys.stderr)
        return 2
    return 0
