"""`create_backend`: the verifier backend called by name (`edgespec verifier serve --backend`).

Apart from backends.py on purpose: the backends import the interface from there, and a factory
in the same module would import them back (an import cycle).
"""
from __future__ import annotations

import os

from edgespec.verifier.backends import Backend

BACKENDS = ("llama", "torch")


def create_backend(kind: str, model_path: str | os.PathLike, *, n_ctx: int = 4096, max_nodes: int = 128,
                   max_depth: int = 32, threads: int = 1, n_gpu_layers: int = 0, device: str = "cpu",
                   dtype: str | None = None, max_sessions: int = 4, prefill_chunk: int | None = None,
                   compact_threshold: float | None = None, warmup: bool | None = None) -> Backend:
    """The backend called `kind` ("llama" or "torch"); ValueError for bad settings. prefill_chunk and
    compact_threshold and warmup are the torch backend's (None: its defaults).

    Each backend is imported only when asked for: a host without llama-cpp-python can still serve
    the torch backend, and one without torch the llama.cpp backend."""
    if kind == "llama":
        from edgespec.verifier.llama_backend import LlamaCppBackend
        return LlamaCppBackend(model_path, n_ctx=n_ctx, max_nodes=max_nodes, max_depth=max_depth, n_threads=threads,
                               n_gpu_layers=n_gpu_layers)
    if kind == "torch":
        try:
            from edgespec.verifier.torch.backend import TorchBackend
        except ImportError as exc:
            raise ValueError(f"the torch backend needs torch ({exc}): pip install 'edgespec[torch]'") from None
        tuning = {k: v for k, v in (("prefill_chunk", prefill_chunk), ("compact_threshold", compact_threshold),
                                    ("warmup", warmup)) if v is not None}
        return TorchBackend(model_path, device=device, dtype=dtype, n_ctx=n_ctx, max_nodes=max_nodes,
                            max_depth=max_depth, max_sessions=max_sessions, threads=threads, **tuning)
    raise ValueError(f"unknown backend {kind!r} (choose from {', '.join(BACKENDS)})")
