"""Why a verifier was never reached, in words a user can act on.

A verifier that never answered an Open is a configuration mistake (address, port, TLS, token,
model), not an outage: falling back to the local target would hide it behind a slow, quiet
success. FailoverVerifier raises what `unreached` makes of the first failure instead (the CLI
exits with code 2); only a verifier that worked and then failed is replaced by the local target,
or one the user chose to start without (local-first).
"""
from __future__ import annotations

import re
from pathlib import Path

from edgespec.common.errors import (
    EdgespecError,
    ModelError,
    TokenizerMismatchError,
    VerifierConfigError,
)
from edgespec.common.wire import DeadlineExceededError, ProtocolError, UnauthenticatedError, VerifierBusyError

_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")

# Errors whose message already names the cause; their type is kept (callers catch them by type).
REFUSALS = (UnauthenticatedError, TokenizerMismatchError, ModelError, ProtocolError)


def check_address(address: str) -> None:
    """Raise VerifierConfigError unless `address` looks like HOST:PORT (or a gRPC target URI)."""
    if address.startswith(_SCHEMES):
        return
    m = _HOST_PORT.match(address.strip())
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise VerifierConfigError(f"verifier address {address!r} is not HOST:PORT (e.g. gpu-box:50051)")


def is_refusal(exc: BaseException) -> bool:
    """The verifier answered and refused this edge: a configuration error even with local-first."""
    return isinstance(exc, REFUSALS)


def unreached(address: str, tls: None | bool | str | Path, exc: BaseException) -> EdgespecError:
    """The configuration error for a verifier that never answered an Open, naming the likely cause."""
    if isinstance(exc, UnauthenticatedError):
        return UnauthenticatedError(f"the verifier at {address} refused the bearer token (check --token or "
                                    f"EDGESPEC_TOKEN): {exc}")
    if isinstance(exc, REFUSALS):
        return type(exc)(f"the verifier at {address} refused this edge: {exc}")
    if isinstance(exc, VerifierBusyError):  # it answered: full now, not a configuration mistake
        text = str(exc) if address in str(exc) else f"the verifier at {address} has no room for this session: {exc}"
        return type(exc)(text if "retry later" in text else f"{text} (retry later)")
    text = str(exc)
    if isinstance(exc, DeadlineExceededError):
        cause = ("no answer at all: a wrong host or port, a firewall dropping the packets, or a TLS "
                 "server waiting for a handshake")
    elif "Connection refused" in text:
        cause = "connection refused: nothing listens on that port (is the verifier running, is the port right?)"
    elif "resolving" in text or "lookup" in text:
        cause = "the host name does not resolve"
    elif "WRONG_VERSION_NUMBER" in text and tls:
        cause = "the TLS handshake failed: the verifier does not speak TLS (leave out --tls-ca)"
    elif "CERTIFICATE_VERIFY_FAILED" in text or "certificate signature failure" in text:
        cause = ("its TLS certificate is not signed by the CA trusted here (--tls-ca), or the host name "
                 "does not match it")
    elif "handshake" in text.lower():
        cause = "the TLS handshake failed"
    elif "Socket closed" in text and not tls:
        cause = "it closed the connection at once: it probably serves TLS (pass --tls-ca CA.pem)"
    else:
        cause = "it could not be reached"
    return VerifierConfigError(f"cannot use the verifier at {address}: {cause}. It never answered, so the local "
                               f"fallback does not stand in for it. ({type(exc).__name__}: {exc})")
