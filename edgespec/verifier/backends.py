"""Verifier backends: the target model behind the service.

A `Backend` owns the model (weights, vocabulary) and opens `BackendSession`s, each with its own
KV state (one conversation). The service serialises all calls into a backend through one compute
worker, so implementations need not be thread-safe; they must only free a session's memory on
`BackendSession.close()`. `LlamaCpuBackend` runs llama.cpp on the CPU; `TorchBackend`
(verifier/torch/, optional extra `edgespec[torch]`) runs the model in torch on the CPU (float32: the
exact reference) or a GPU. `create_backend` picks one by name.
"""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from pathlib import Path

from edgespec.common import modelstore
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import MAX_TREE_NODES, TokenTree
from edgespec.runtime.llama import ContextConfig, LlamaModel
from edgespec.runtime.tree_verifier import LlamaTreeVerifier, VerifyResult


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
    extra: dict = field(default_factory=dict)

    def serves(self, model_id: str) -> bool:
        """Whether Open.model_id names this model ('' = any)."""
        return not model_id or model_id == self.model_id or model_id in self.aliases


class BackendSession(abc.ABC):
    """The target's view of one conversation (its own KV cache)."""

    @abc.abstractmethod
    def sync(self, tokens: list[int]) -> None:
        """Make the committed context exactly `tokens` (reusing any common prefix)."""

    @abc.abstractmethod
    def verify(self, tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        """Verify `tree` (root = last committed token) and commit the accepted path + one token."""

    @property
    @abc.abstractmethod
    def committed_length(self) -> int:
        """Number of committed tokens (the edge's count must match before a Verify)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the KV state; the session is unusable afterwards."""


class Backend(abc.ABC):
    info: ModelInfo

    @abc.abstractmethod
    def open_session(self) -> BackendSession: ...

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


class _LlamaSession(BackendSession):
    def __init__(self, model: LlamaModel, config: ContextConfig, max_depth: int) -> None:
        self._verifier = LlamaTreeVerifier(model, config, max_depth=max_depth)

    def sync(self, tokens: list[int]) -> None:
        self._verifier.sync(tokens)

    def verify(self, tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        return self._verifier.verify(tree, sampling, step)

    @property
    def committed_length(self) -> int:
        return len(self._verifier.committed)

    def close(self) -> None:
        self._verifier.close()


class LlamaCpuBackend(Backend):
    """llama.cpp on the CPU: one LlamaModel shared by every session, one TreeContext per session."""

    def __init__(self, model_path: str | os.PathLike, *, n_ctx: int = 4096, max_nodes: int = 128,
                 max_depth: int = 32, max_k: int = 64, n_threads: int = 1, n_gpu_layers: int = 0,
                 model_id: str | None = None) -> None:
        if not 2 <= max_nodes <= MAX_TREE_NODES:
            raise ValueError(f"max_nodes must be in [2, {MAX_TREE_NODES}], got {max_nodes}")
        if n_ctx < max(max_nodes + 1, max_depth + 2):
            # llama.cpp clamps n_batch to n_ctx and then aborts the process on a tree batch that
            # does not fit (GGML_ASSERT n_outputs_max): refuse such configurations up front.
            raise ValueError(f"n_ctx {n_ctx} is too small for trees of {max_nodes} nodes / depth {max_depth}: "
                             f"use n_ctx >= {max(max_nodes + 1, max_depth + 2)} or lower --max-nodes")
        self.model = LlamaModel(model_path, n_gpu_layers=n_gpu_layers)
        # max_tree_nodes counts the root too: the context gets max_nodes + 1 sequences.
        self.config = ContextConfig(n_ctx=n_ctx, n_threads=n_threads, max_tree_nodes=max_nodes)
        self.max_depth = max_depth
        mid, aliases = model_identity(self.model.path)
        import llama_cpp as C

        n_layer = C.llama_model_n_layer(self.model._model)
        n_head = max(1, C.llama_model_n_head(self.model._model))
        n_head_kv = C.llama_model_n_head_kv(self.model._model)
        n_embd = C.llama_model_n_embd(self.model._model)
        kv = 2 * 2 * n_layer * n_ctx * n_head_kv * (n_embd // n_head)   # K and V, f16
        logits = 4 * (max_nodes + 1) * self.model.n_vocab                # float32 output rows
        self.info = ModelInfo(
            model_id=model_id or mid, aliases=aliases if model_id is None else (mid, *aliases),
            tokenizer_hash=self.model.tokenizer_fingerprint(), vocab_size=self.model.n_vocab, n_ctx=n_ctx,
            max_nodes=max_nodes, max_depth=max_depth, max_k=max_k, backend="llama-cpu",
            kv_bytes_per_session=kv + logits, extra={"path": str(self.model.path)})

    def open_session(self) -> BackendSession:
        return _LlamaSession(self.model, self.config, self.max_depth)

    def close(self) -> None:
        self.model.close()


BACKENDS = ("llama", "torch")


def create_backend(kind: str, model_path: str | os.PathLike, *, n_ctx: int = 4096, max_nodes: int = 128,
                   max_depth: int = 32, threads: int = 1, n_gpu_layers: int = 0, device: str = "cpu",
                   dtype: str | None = None, max_sessions: int = 4) -> Backend:
    """The backend called `kind` ("llama" or "torch"); ValueError for bad settings."""
    if kind == "llama":
        return LlamaCpuBackend(model_path, n_ctx=n_ctx, max_nodes=max_nodes, max_depth=max_depth, n_threads=threads,
                               n_gpu_layers=n_gpu_layers)
    if kind == "torch":
        try:
            from edgespec.verifier.torch.backend import TorchBackend
        except ImportError as exc:
            raise ValueError(f"the torch backend needs torch ({exc}): pip install 'edgespec[torch]'") from None
        return TorchBackend(model_path, device=device, dtype=dtype, n_ctx=n_ctx, max_nodes=max_nodes,
                            max_depth=max_depth, max_sessions=max_sessions, threads=threads)
    raise ValueError(f"unknown backend {kind!r} (choose from {', '.join(BACKENDS)})")
