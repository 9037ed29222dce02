"""The device's own copy of the target model, for the steps the verifier service cannot take.

Lazy on purpose: a device whose verifier keeps answering never pays the target's memory (about
1.1 GB for the default 1.5B target, plus its KV cache) nor its load time. Loading eagerly would
not make the first local step much faster anyway: an idle local target's KV cache is empty, so
the first switch has to prefill the committed context either way (keeping it current would mean
running the target on every step, i.e. local mode). The price of laziness is the model load
(memory-mapped GGUF: well under a second from the page cache) on the first failure, once.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from edgespec.common import modelstore
from edgespec.common.errors import EdgespecError, TokenizerMismatchError, VerifierUnavailableError
from edgespec.runtime.conversation import ContextVerifier
from edgespec.runtime.llama import ContextConfig, LlamaModel
from edgespec.runtime.tree_verifier import LocalVerifier

log = logging.getLogger("edgespec.failover")


class LocalFallback:
    """Makes the local verifier: loads the target on first call and checks its tokenizer against
    the draft's (a mismatch makes the fallback unusable)."""

    def __init__(self, target: str | os.PathLike, *, tokenizer_hash: str, config: ContextConfig = ContextConfig(),
                 max_depth: int = 32, n_gpu_layers: int = 0) -> None:
        self.target = Path(target)
        self.n_gpu_layers = n_gpu_layers
        self.tokenizer_hash = tokenizer_hash
        self.config = config
        self.max_depth = max_depth
        self.model: LlamaModel | None = None
        self.load_seconds = 0.0

    @classmethod
    def for_target(cls, target: str | os.PathLike, **kwargs: Any) -> tuple["LocalFallback | None", str]:
        """(fallback, "") if this device has the target model file, else (None, why not).

        Never downloads: a manifest model that is not in the local cache means "no local target".
        """
        try:
            path = modelstore.resolve(target, fetch_missing=False, progress=False)
        except EdgespecError as exc:
            return None, f"no local target model ({exc})"
        return cls(path, **kwargs), ""

    def __call__(self) -> LocalVerifier:
        started = time.perf_counter()
        if self.model is None:
            model = LlamaModel(self.target, n_gpu_layers=self.n_gpu_layers)
            if model.tokenizer_fingerprint() != self.tokenizer_hash:
                model.close()
                raise TokenizerMismatchError(
                    f"the local target {self.target.name} does not share the draft's tokenizer; it cannot "
                    "verify the draft's trees")
            self.model = model
        verifier = LocalVerifier(self.model, self.config, max_depth=self.max_depth)
        self.load_seconds += time.perf_counter() - started
        return verifier

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
            self.model = None


class LocalSide:
    """The fallback verifier, made on first need by `factory` (None: no fallback, for `reason`)."""

    def __init__(self, factory: Callable[[], ContextVerifier] | None, reason: str = "none configured") -> None:
        self._factory = factory
        self.reason = "" if factory is not None else (reason or "none configured")
        self._verifier: ContextVerifier | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def available(self) -> bool:
        return self._factory is not None

    @property
    def loaded(self) -> bool:
        return self._verifier is not None

    def why_not(self) -> str:
        return f"no local fallback on this device ({self.reason})"

    def get(self, cause: str) -> ContextVerifier:
        """The local verifier, loaded now if needed. Raises VerifierUnavailableError (with `cause`,
        why the remote side could not be used) when there is none or it cannot be loaded."""
        with self._lock:
            if self._closed:
                raise VerifierUnavailableError("the failover verifier is closed")
            if self._verifier is not None:
                return self._verifier
            if self._factory is None:
                raise VerifierUnavailableError(f"{cause}; {self.why_not()}")
            try:
                self._verifier = self._factory()
            except EdgespecError as exc:
                self._factory = None
                self.reason = f"the local target cannot be used: {type(exc).__name__}: {exc}"
                raise VerifierUnavailableError(f"{cause}, and {self.reason}") from exc
            log.info("local fallback target loaded")
            return self._verifier

    def close(self) -> None:
        with self._lock:
            self._closed = True
            verifier, self._verifier = self._verifier, None
            factory = self._factory
        if verifier is not None:
            verifier.close()
        if factory is not None and hasattr(factory, "close"):
            factory.close()
