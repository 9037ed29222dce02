"""The llama.cpp backend: one LlamaModel shared by every session, one TreeContext per session.

Kept apart from backends.py so that a host without llama-cpp-python can still serve the torch backend.
Runs on the CPU, or with `n_gpu_layers` on a GPU build of llama.cpp; `info.backend` says which.
"""
from __future__ import annotations

import os

from edgespec.common.acceptance import VerifyResult
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import MAX_TREE_NODES, TokenTree
from edgespec.runtime.llama import ContextConfig, LlamaModel
from edgespec.runtime.tree_verifier import LlamaTreeVerifier
from edgespec.verifier.backends import (
    Backend,
    BackendSession,
    ModelInfo,
    model_identity,
)
from edgespec.verifier.steplog import StepLog


class _LlamaSession(BackendSession):
    def __init__(self, model: LlamaModel, config: ContextConfig, max_depth: int, step_log: StepLog | None) -> None:
        self._verifier = LlamaTreeVerifier(model, config, max_depth=max_depth)
        if step_log is not None:
            self._verifier.verifier.on_verified = step_log.session()

    def sync(self, tokens: list[int]) -> None:
        self._verifier.sync(tokens)

    def verify(self, tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        return self._verifier.verify(tree, sampling, step)

    @property
    def committed_tokens(self) -> list[int]:
        return self._verifier.committed

    def close(self) -> None:
        self._verifier.close()


def device_label(gpu_layers: int, n_layer: int) -> str:
    """Where a model of `n_layer` blocks with `gpu_layers` offloaded runs, for ModelInfo.backend:
    "llama-cpu", "llama-gpu" (every layer offloaded, the output layer included) or
    "llama-cpu+gpu:K/N" (K of its N layers on the GPU)."""
    layers = n_layer + 1   # the repeating blocks plus the output layer
    if gpu_layers <= 0:
        return "llama-cpu"
    if gpu_layers >= layers:
        return "llama-gpu"
    return f"llama-cpu+gpu:{gpu_layers}/{layers}"


class LlamaCppBackend(Backend):
    """llama.cpp (CPU, or GPU with n_gpu_layers): one LlamaModel shared by every session, one
    TreeContext per session."""

    def __init__(self, model_path: str | os.PathLike, *, n_ctx: int = 4096, max_nodes: int = 128,
                 max_depth: int = 32, max_k: int = 64, n_threads: int = 1, n_gpu_layers: int = 0,
                 model_id: str | None = None) -> None:
        if n_threads < 1:
            raise ValueError(f"threads must be >= 1, got {n_threads}")
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
            max_nodes=max_nodes, max_depth=max_depth, max_k=max_k, backend=device_label(self.model.gpu_layers, self.model.n_layer),
            kv_bytes_per_session=kv + logits, grammar_constraints=True,   # runtime/tree_verifier.py binds grammars
            extra={"path": str(self.model.path), "gpu_layers": self.model.gpu_layers, "threads": n_threads})

    step_log: StepLog | None = None   # set to record every verified step (`verifier serve --log-dir`)

    def open_session(self) -> BackendSession:
        return _LlamaSession(self.model, self.config, self.max_depth, self.step_log)

    def close(self) -> None:
        self.model.close()
