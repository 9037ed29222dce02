"""Read a llama/qwen2 GGUF file into a `TransformerLM`: configuration, dequantized weights, tokenizer hash.

Everything comes from the file through the `gguf` package (no llama.cpp): hyper-parameters from the
`{arch}.*` metadata, tensors dequantized with `gguf.quants.dequantize` (numpy, float32) one at a
time and cast to the requested dtype on the requested device, so peak host memory is the model in
that dtype plus one tensor.

llama.cpp conventions handled here:
- GGUF lists a 2-D tensor's shape as (in, out) (ggml's ne0 first); the reader's numpy array is
  already (out, in), the layout of torch's Linear.weight.
- `llama` GGUFs store Q and K with the rows of each head permuted (the HF->GGUF converter does it
  so that llama.cpp's interleaved "normal" RoPE equals HF's rotate-half); `unpermute` restores HF's
  order so the model can use rotate-half RoPE for every architecture. `qwen2` (NEOX RoPE in
  llama.cpp) is stored unpermuted.
- No `output.weight` means the LM head is tied to `token_embd.weight`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from edgespec.common import tokens
from edgespec.common.errors import ModelError
from edgespec.verifier.torch.model import ARCHITECTURES, TransformerLM, ModelConfig


def open_gguf(path: str | Path):
    """A gguf.GGUFReader of `path` (ModelError if it is missing or not GGUF)."""
    import gguf

    class FastReader(gguf.GGUFReader):
        """GGUFReader slices np.memmap once per value; a 150k-token vocabulary then takes ~20 s to
        parse here. Slicing a plain ndarray view of the same mapping is ~5x faster (same bytes)."""

        def _get(self, offset, dtype, count=1, override_order=None):  # noqa: ANN001, ANN202
            raw = self.__dict__.get("_raw")
            if raw is None:
                raw = self._raw = self.data.view(np.ndarray)
            count = int(count)
            arr = raw[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    path = Path(path)
    if not path.is_file():
        raise ModelError(f"model file not found: {path}")
    try:
        try:
            return FastReader(path)
        except (AttributeError, TypeError):  # a gguf release whose internals differ: the plain reader
            return gguf.GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure means "not a GGUF we can read"
        raise ModelError(f"cannot read {path} as GGUF: {exc}") from exc


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(f"GGUF architecture {arch!r} is not supported by the torch backend "
                         f"(only {', '.join(ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    d_model = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = int(_field(reader, f"{arch}.rope.dimension_count", d_model // n_head))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        arch=arch, n_layer=int(_field(reader, f"{arch}.block_count")), d_model=d_model, n_head=n_head,
        n_head_kv=int(_field(reader, f"{arch}.attention.head_count_kv", n_head)), head_dim=head_dim,
        d_ff=int(_field(reader, f"{arch}.feed_forward_length")), vocab_size=n_vocab,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        qkv_bias="blk.0.attn_q.bias" in names, tied_embeddings="output.weight" not in names)


def tokenizer_fingerprint(reader) -> str:
    """The sha256 LlamaModel.tokenizer_fingerprint() computes, from the GGUF token list directly."""
    field = reader.fields["tokenizer.ggml.tokens"]
    return tokens.tokenizer_fingerprint(bytes(field.parts[idx]) for idx in field.data)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's LlamaModel.permute on Q or K rows (weights [out, in] or biases [out])."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


ROWS_PER_CHUNK = 8192  # dequantize big matrices this many rows at a time (bounds temporaries)


def load_model(source, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 max_positions: int = 4096) -> TransformerLM:
    """source: a GGUF path or an `open_gguf` reader."""
    from gguf.quants import dequantize

    reader = open_gguf(source) if isinstance(source, (str, Path)) else source
    name = Path(getattr(reader.data, "filename", None) or "model.gguf").name
    config = c = read_config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def put(dest: torch.Tensor, tensor: str, heads: int = 0) -> None:
        """Copy `tensor` (dequantized) into `dest`, a parameter or a block of its rows; with heads > 0,
        undo the llama converter's Q/K row permutation for that many heads."""
        if tensor not in tensors:
            raise ModelError(f"{name}: tensor {tensor} is missing")
        t = tensors[tensor]
        n = int(t.data.shape[0])
        if n != dest.shape[0]:
            raise ModelError(f"{name}: {tensor} has {n} rows where {dest.shape[0]} were expected")
        step = n if heads else ROWS_PER_CHUNK  # the numpy dequantizers make temporaries of their input's size
        for r in range(0, n, step):
            a = np.asarray(dequantize(t.data[r:r + step], t.tensor_type), dtype=np.float32)
            if heads:
                a = unpermute(a, heads)
            if a.shape[1:] != tuple(dest.shape[1:]):
                raise ModelError(f"{name}: {tensor} has rows of shape {a.shape[1:]}, expected {tuple(dest.shape[1:])}")
            dest[r:r + a.shape[0]].copy_(torch.from_numpy(a if a.flags.writeable else a.copy()))

    model = TransformerLM.empty(config, dtype=dtype, device=device, max_positions=max_positions)
    hq, hk = (c.n_head, c.n_head_kv) if c.arch == "llama" else (0, 0)  # llama GGUFs store Q/K rows permuted
    q_rows, k_rows = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    with torch.no_grad():
        put(model.embed.weight, "token_embd.weight")
        put(model.norm.weight, "output_norm.weight")
        if model.lm_head is not None:
            put(model.lm_head.weight, "output.weight")
        for i, layer in enumerate(model.layers):
            p = f"blk.{i}."
            fused = [(layer.wqkv.weight, "weight")] + ([(layer.wqkv.bias, "bias")] if c.qkv_bias else [])
            for w, kind in fused:  # wqkv = [q; k; v] rows
                put(w[:q_rows], f"{p}attn_q.{kind}", hq)
                put(w[q_rows:q_rows + k_rows], f"{p}attn_k.{kind}", hk)
                put(w[q_rows + k_rows:], f"{p}attn_v.{kind}")
            put(layer.wo.weight, p + "attn_output.weight")
            put(layer.attn_norm.weight, p + "attn_norm.weight")
            put(layer.ffn_norm.weight, p + "ffn_norm.weight")
            put(layer.w13.weight[:c.d_ff], p + "ffn_gate.weight")   # w13 = [gate; up] rows
            put(layer.w13.weight[c.d_ff:], p + "ffn_up.weight")
            put(layer.w2.weight, p + "ffn_down.weight")
    return model


def read_gguf_info(path: str | Path) -> tuple[ModelConfig, str]:
    """(config, tokenizer fingerprint) without loading any weights."""
    reader = open_gguf(path)
    return read_config(reader), tokenizer_fingerprint(reader)
