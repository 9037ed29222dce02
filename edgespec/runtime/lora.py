"""LoRA adapters on a loaded GGUF model, applied per KV context at run time (llama.cpp's adapter API).

An adapter is loaded once onto its base model (`llama_adapter_lora_init`, a few MB next to the
base's weights) and switched on a context with `llama_set_adapters_lora` (an empty list clears it).
Switching never reloads the base. The KV cache computed under one adapter is wrong under another,
so `set_adapters` empties the context: the caller re-ingests its committed tokens (TreeContext.sync
does that on the next call).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path
from typing import Sequence

import llama_cpp as C

from edgespec.common.errors import ModelError, SessionClosedError
from edgespec.runtime.llama import LlamaModel, TreeContext


class LoraAdapter:
    """One GGUF LoRA adapter loaded onto `base` (freed by close(), or with the base model)."""

    def __init__(self, base: LlamaModel, path: str | os.PathLike) -> None:
        self._adapter = None
        self.base, self.path = base, Path(path)
        if not self.path.is_file():
            raise ModelError(f"LoRA adapter not found: {self.path}")
        base._check_open()
        self._adapter = C.llama_adapter_lora_init(base._model, str(self.path).encode())
        if not self._adapter:
            raise ModelError(f"llama.cpp could not load the LoRA adapter {self.path} onto {base.path.name} "
                             "(wrong base architecture or tensor shapes?)")
        self.nbytes = self.path.stat().st_size

    @property
    def closed(self) -> bool:
        return not self._adapter or self.base.closed

    def close(self) -> None:
        """Free the adapter now (llama.cpp frees it with the base model otherwise). Detach it from
        every context first: a context must never point at a freed adapter."""
        if self._adapter and not self.base.closed:
            C.llama_adapter_lora_free(self._adapter)
        self._adapter = None


def set_adapters(ctx: TreeContext, adapters: Sequence[tuple[LoraAdapter, float]]) -> None:
    """Apply exactly `adapters` (with their scales) to `ctx`, or none for an empty list, and empty
    the KV cache (it was computed with the previous adapters). Same adapters as before: no-op."""
    key = tuple((id(a), float(s)) for a, s in adapters)
    if getattr(ctx, "_lora_key", ()) == key:
        return
    for adapter, _ in adapters:
        if adapter.closed or adapter.base is not ctx.model:
            raise ModelError(f"adapter {adapter.path.name} is closed or belongs to another base model")
    lock = getattr(ctx, "_lock", None) or contextlib.nullcontext()
    with lock:
        if ctx.closed:
            raise SessionClosedError(f"the KV context of {ctx.model.path.name} was closed")
        n = len(adapters)
        array = (C.llama_adapter_lora_p_ctypes * max(n, 1))(*[a._adapter for a, _ in adapters])
        scales = (ctypes.c_float * max(n, 1))(*[s for _, s in adapters])
        rc = C.llama_set_adapters_lora(ctx._ctx, array if n else None, n, scales if n else None)
        if rc != 0:
            raise ModelError(f"llama.cpp refused the LoRA adapters (code {rc})")
        # A full reset (not seq_rm): cells are refilled from the start, so logits after switching
        # back are bit-identical to those before switching.
        C.llama_memory_clear(C.llama_get_memory(ctx._ctx), True)
        ctx.tokens.clear()
        ctx._lora_key = key
