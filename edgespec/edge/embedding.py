"""Sentence embeddings for the router: all-MiniLM-L6-v2 (int8 ONNX) through onnxruntime.

The router needs a cheap, local notion of "what kind of request is this" (code, prose, SQL, a
tool call...) to pick a drafter before the first token: a 384-d unit vector per text, computed in
a few milliseconds on one CPU thread. The weights and tokenizer are manifest models (role
"router", fetched by `edgespec models fetch router` / tools/setup.sh into the model cache); they
are never downloaded at run time.

Needs the `router` extra (onnxruntime, tokenizers).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from edgespec.common import modelstore
from edgespec.common.errors import ModelError

MODEL = "all-minilm-l6-v2-int8"            # manifest names (models/manifest.json)
TOKENIZER = "all-minilm-l6-v2-tokenizer"
MAX_TOKENS = 256                           # the model's trained length; the shipped tokenizer.json says 128
DIM = 384


class Embedder:
    """Mean-pooled, L2-normalised MiniLM embeddings on one intra-op thread (the edge's cores are
    the drafter's)."""

    def __init__(self, model: str | os.PathLike = MODEL, tokenizer: str | os.PathLike = TOKENIZER,
                 threads: int = 1, max_tokens: int = MAX_TOKENS) -> None:
        try:
            import onnxruntime as ort
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ModelError(f"the router needs onnxruntime and tokenizers (pip install 'edgespec[router]'): {exc}") \
                from exc
        model_path, tokenizer_path = _locate(model), _locate(tokenizer)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.tokenizer.enable_truncation(max_tokens)
        self.tokenizer.no_padding()   # padding per batch below, to the longest text, not to 128
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self.session.get_inputs()}
        self.model_id = Path(model_path).name   # recorded by whoever persists vectors (centroids)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), 384) float32 unit vectors."""
        if not texts:
            return np.zeros((0, DIM), np.float32)
        encodings = self.tokenizer.encode_batch(list(texts))
        n = max(len(e.ids) for e in encodings)
        ids = np.zeros((len(texts), n), np.int64)
        mask = np.zeros((len(texts), n), np.int64)
        for row, e in enumerate(encodings):
            ids[row, :len(e.ids)] = e.ids
            mask[row, :len(e.ids)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self.session.run(None, feeds)[0]
        summed = (hidden * mask[:, :, None]).sum(axis=1)
        pooled = summed / np.maximum(mask.sum(axis=1, keepdims=True), 1)
        return (pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)).astype(np.float32)

    def embed_one(self, text: str) -> np.ndarray:
        return self.embed([text])[0]


def _locate(spec: str | os.PathLike) -> Path:
    """A manifest name resolves to the verified file in the model cache (never fetched here: a
    missing file is a set-up error that names the fix); a path is used as it is."""
    if isinstance(spec, os.PathLike) or os.sep in str(spec):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelError(f"embedding model file not found: {path}")
        return path
    return modelstore.resolve(spec, fetch_missing=False, progress=False)
