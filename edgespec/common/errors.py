"""Error types with messages meant for users; the CLI prints them and exits non-zero."""
from __future__ import annotations


class EdgespecError(Exception):
    """Base of every error edgespec raises on purpose (bad input, missing model, ...)."""


class ModelError(EdgespecError):
    """A model file is missing, corrupt, or cannot be loaded."""


class TokenizerMismatchError(EdgespecError):
    """Draft and target do not share a tokenizer, so draft tokens mean nothing to the target."""


class InvalidRequestError(EdgespecError, ValueError):
    """The caller asked for something impossible (empty prompt, max_tokens <= 0, ...)."""


class InvalidTreeError(InvalidRequestError):
    """A draft tree breaks a structural rule (orphan node, bad token id, over budget, ...)."""


class ContextOverflowError(EdgespecError):
    """The conversation no longer fits into the model's context window."""


class VerifierUnavailableError(EdgespecError):
    """The remote verifier cannot be reached or refused the session."""


class SessionClosedError(EdgespecError, RuntimeError):
    """A session, model or KV context was used after `close()` (its native memory is gone)."""


class SessionBusyError(EdgespecError, RuntimeError):
    """A session is already answering a request that this call would corrupt (e.g. a second
    stream opened on the same thread while the first one is still open)."""


class VerifierConfigError(VerifierUnavailableError):
    """A verifier that was never reached (wrong address, TLS settings, ...): a configuration
    error, so no local fallback hides it."""
