"""Verifier backends: the target model behind the service.

A `Backend` owns the model (weights, vocabulary) and opens `BackendSession`s, each with its own
KV state (one conversation). The service serialises all calls into a backend through one compute
worker, so implementations need not be thread-safe; they must only free a session's memory on
`BackendSession.close()`. `LlamaCppBackend` (verifier/llama_backend.py) runs llama.cpp on the CPU or,
with GPU layers, a GPU; `TorchBackend` (verifier/torch/, optional extra `edgespec[torch]`) runs the
model in torch on the CPU (float32: the exact reference) or a GPU. `verifier/factory.py`
(`create_backend`) picks one by name; this module imports neither, so the backends can import it.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

from edgespec.common import modelstore
from edgespec.common.acceptance import VerifyResult
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree


@dataclass(frozen=True)
class ModelInfo:
    """What a backend serves; sent to the edge in `Opened` and `InfoReply`."""

    model_id: str
    aliases: tuple[str, ...]
    tokenizer_hash: str
    vocab_size: int
    n_ctx: int
    max_nodes: int
    max_depth: int
    max_k: int
    backend: str
    kv_bytes_per_session: int = 0   # estimate used by the session registry's memory budget
    grammar_constraints: bool = False   # applies TokenConstraint.grammar (it knows its token bytes)
    extra: dict = field(default_factory=dict)

    def serves(self, model_id: str) -> bool:
        """Whether Open.model_id names this model ('' = any)."""
        return not model_id or model_id == self.model_id or model_id in self.aliases


class BackendSession(abc.ABC):
    """The target's view of one conversation (its own KV cache)."""

    @abc.abstractmethod
    def sync(self, tokens: list[int]) -> None:
        """Make the committed context exactly `tokens` (reusing any common prefix)."""

    def sync_chunks(self, tokens: list[int]) -> Iterator[int]:
        """sync in pieces: yields after each piece of work (the tokens done so far), so that the
        service can let other sessions' requests run in between; the context is committed once the
        iterator is exhausted, and is in doubt if it is abandoned. Default: one piece."""
        self.sync(tokens)
        yield len(tokens)

    @abc.abstractmethod
    def verify(self, tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        """Verify `tree` (root = last committed token) and commit the accepted path + one token."""

    @property
    @abc.abstractmethod
    def committed_tokens(self) -> list[int]:
        """The committed context (read-only: callers must not modify it)."""

    @property
    def committed_length(self) -> int:
        """Number of committed tokens (the edge's count must match before a Verify)."""
        return len(self.committed_tokens)

    @abc.abstractmethod
    def close(self) -> None:
        """Free the KV state; the session is unusable afterwards."""


@dataclass(frozen=True)
class KVUsage:
    """A paged KV cache's occupancy and upkeep, for the service's metrics."""

    blocks: int                 # usable blocks
    used_blocks: int
    shared_blocks: int
    fragmentation: float        # F = 1 - largest free run / free blocks
    compactions: int
    blocks_moved: int
    compact_seconds: float
    spare_blocks: int = 0       # kept by sessions for their next trees: neither used nor free, reclaimable


class PrefillProgress(Protocol):
    """A Sync in progress in a backend with `mixed_prefill`: its sessions' `begin_sync(tokens)` returns
    one, and each `verify_many(requests, prefills=[...])` call advances it by at most one chunk."""

    error: BaseException | None   # the Sync failed (its session's KV is then in doubt)
    ran: bool    # a chunk of it ran in the last verify_many call (that call's time is the Sync's compute)
    rode: bool   # ... in the same step as verify trees (edgespec_verifier_prefill_chunks_mixed_total)

    @property
    def finished(self) -> bool: ...


class Backend(abc.ABC):
    info: ModelInfo
    mixed_prefill: bool = False
    """True when `verify_many(requests, prefills=...)` takes sessions' `begin_sync` work
    (PrefillProgress): the service then prefills Syncs inside verify batches (chunked prefill in the
    same forward)."""

    @abc.abstractmethod
    def open_session(self) -> BackendSession: ...

    def kv_usage(self) -> KVUsage | None:
        """The KV cache's figures, for backends with a paged cache (None: not reported)."""
        return None

    @abc.abstractmethod
    def close(self) -> None: ...


def model_identity(path: Path) -> tuple[str, tuple[str, ...]]:
    """(canonical id, aliases) of a model file: its manifest name when it is a manifest model,
    else its file name; aliases are the file name, its stem and the manifest role aliases."""
    path = Path(path).resolve()
    names = {path.name, path.stem}
    model_id = path.name
    try:
        manifest = modelstore.load_manifest()
        for spec in manifest.models:
            if modelstore.model_path(spec).resolve() == path:
                model_id = spec.name
                names |= {role for role, name in manifest.defaults.items() if name == spec.name}
                break
    except Exception:  # noqa: BLE001 - a broken manifest must not stop serving a user's GGUF
        pass
    names.discard(model_id)
    return model_id, tuple(sorted(names))
