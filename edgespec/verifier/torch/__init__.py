"""The torch verifier backend: the float32 reference path (where losslessness is exact) and the
starting point of the GPU engine. Needs the optional extra `edgespec[torch]`.

One job per module, in the order data flows:
  model.py           the llama/qwen2 decoder (RMSNorm, RoPE, GQA, SwiGLU) in plain torch
  gguf_weights.py    GGUF -> config, dequantized weights, tokenizer fingerprint (the `gguf` package)
  tree_attention.py  tree masks and the reference attention over the paged cache (gather + SDPA)
  triton_attention.py the same attention as a Triton kernel (CUDA; block tables, ancestor bits)
  block_pool.py      free list and refcounts of KV blocks (bookkeeping only)
  kv_cache.py        the paged KV tensor, per-sequence block tables, reserve/truncate/share/close
  engine.py          prefill; the verify step: batched trees, CUDA graphs per shape bucket,
                     acceptance on the device, compaction of the accepted K/V
  backend.py         TorchBackend/TorchSession: the verifier service's Backend interface

Nothing here is imported by `edgespec` unless `edgespec verifier serve --backend torch` asks for it.
"""
