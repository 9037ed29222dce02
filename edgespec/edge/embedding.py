"""Sentence embeddings for the router: all-MiniLM-L6-v2 (int8 ONNX) through onnxruntime.

The router needs a cheap, local notion of "what kind of request is this" (code, prose, SQL, a
tool call...) to pick a drafter before the first token: a 384-d unit vector per text, computed in
a few milliseconds on one CPU thread. The weights and tokenizer are manifest models (role
"router", fetched by `edgespec models fetch router` / tools/setup.sh into the model cache); they
are never downloaded at run time.

Why it is fast (docs/BENCHMARKS.md, "Router decision time"):
- The shipped int8 ONNX stores int8 weights behind Cast + Mul, which onnxruntime folds into fp32
  weights at load: every run then streams ~42 MB of fp32 weights and multiplies in fp32 (about
  6 ms for 8 tokens on one core here, whatever the length). `integer_graph` rewrites those
  MatMuls into onnxruntime's DynamicQuantizeMatMul on the same int8 weights and scales (int8
  arithmetic, a quarter of the bytes), once, into $EDGESPEC_HOME/router/; cosine to the folded
  graph ≥ 0.99. Without the `onnx` package the shipped graph is used as it is.
- Texts are cut to `max_tokens` tokens, head and tail (the instruction after a pasted file is
  kept): the cost grows linearly with the tokens.

Needs the `router` extra (onnxruntime, tokenizers; onnx for the integer graph).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from edgespec.common import modelstore
from edgespec.common.errors import ModelError

MODEL = "all-minilm-l6-v2-int8"            # manifest names (models/manifest.json)
TOKENIZER = "all-minilm-l6-v2-tokenizer"
MAX_TOKENS = 256                           # the model's trained length; the shipped tokenizer.json says 128
DIM = 384
CHARS_PER_TOKEN = 8                        # texts longer than this many chars per kept token are cut first


class Embedder:
    """Mean-pooled, L2-normalised MiniLM embeddings on one intra-op thread (the edge's cores are
    the drafter's)."""

    def __init__(self, model: str | os.PathLike = MODEL, tokenizer: str | os.PathLike = TOKENIZER,
                 threads: int = 1, max_tokens: int = MAX_TOKENS, integer: bool = True) -> None:
        """max_tokens: tokens embedded per text (head and tail, special tokens included);
        integer: run the int8-arithmetic graph (integer_graph) when it can be built."""
        try:
            import onnxruntime as ort
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ModelError(f"the router needs onnxruntime and tokenizers (pip install 'edgespec[router]'): {exc}") \
                from exc
        model_path, tokenizer_path = _locate(model), _locate(tokenizer)
        self.model_id = Path(model_path).name   # recorded by whoever persists vectors (the router)
        if integer:
            rewritten = integer_graph(model_path)
            if rewritten is not None:
                model_path, self.model_id = rewritten, self.model_id + "+dqmatmul"
        self.max_tokens = max(3, max_tokens)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.tokenizer.no_truncation()   # cut head + tail in _ids, not head only
        self.tokenizer.no_padding()      # padding per batch below, to the longest text, not to 128
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self.session.get_inputs()}

    def token_ids(self, text: str) -> list[int]:
        """The ids embedded for `text`: [CLS] head ... tail [SEP], at most max_tokens of them."""
        keep = self.max_tokens
        if len(text) > CHARS_PER_TOKEN * keep:   # never tokenise a pasted file whole
            half = CHARS_PER_TOKEN * keep // 2
            text = text[:half] + " " + text[-half:]
        ids = self.tokenizer.encode(text).ids
        if len(ids) <= keep:
            return ids
        inner = keep - 2
        head = (inner + 1) // 2
        return ids[:1 + head] + ids[len(ids) - 1 - (inner - head):]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), 384) float32 unit vectors."""
        if not texts:
            return np.zeros((0, DIM), np.float32)
        rows = [self.token_ids(t) for t in texts]
        n = max(len(r) for r in rows)
        ids = np.zeros((len(texts), n), np.int64)
        mask = np.zeros((len(texts), n), np.int64)
        for row, r in enumerate(rows):
            ids[row, :len(r)] = r
            mask[row, :len(r)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self.session.run(None, feeds)[0]
        summed = (hidden * mask[:, :, None]).sum(axis=1)
        pooled = summed / np.maximum(mask.sum(axis=1, keepdims=True), 1)
        return (pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)).astype(np.float32)

    def embed_one(self, text: str) -> np.ndarray:
        return self.embed([text])[0]


def integer_graph(model_path: Path) -> Path | None:
    """The model with every MatMul on a Cast+Mul-dequantised int8 weight replaced by
    com.microsoft DynamicQuantizeMatMul on that weight (see the module docstring); built once per
    source file (keyed by its hash) under $EDGESPEC_HOME/router/. None without the onnx package,
    or when the graph has no such MatMul."""
    try:
        import onnx
        from onnx import helper, numpy_helper
    except ImportError:
        return None
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest()[:16]
    out = modelstore.home_dir() / "router" / f"{model_path.stem}.{digest}.dqmatmul.onnx"
    if out.is_file():
        return out
    graph_model = onnx.load(str(model_path))
    graph = graph_model.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    nodes, rewritten = [], 0
    for node in graph.node:
        mul = producer.get(node.input[1]) if node.op_type == "MatMul" else None
        cast = producer.get(mul.input[0]) if mul is not None and mul.op_type == "Mul" else None
        if cast is None or cast.op_type != "Cast" or cast.input[0] not in inits or mul.input[1] not in inits \
                or inits[cast.input[0]].data_type != onnx.TensorProto.INT8:
            nodes.append(node)
            continue
        scale = numpy_helper.to_array(inits[mul.input[1]]).astype(np.float32).reshape(-1)   # per column
        graph.initializer.append(numpy_helper.from_array(scale, mul.input[1] + "_per_column"))
        nodes.append(helper.make_node("DynamicQuantizeMatMul", [node.input[0], cast.input[0], mul.input[1] + "_per_column"],
                                      list(node.output), name=node.name + "_dq", domain="com.microsoft"))
        rewritten += 1
    if not rewritten:
        return None
    outputs = {o.name for o in graph.output}
    while True:   # drop what only fed the old MatMuls: the dequantising Cast/Mul and their inputs
        used = {i for n in nodes for i in n.input} | outputs
        alive = [n for n in nodes if any(o in used for o in n.output)]
        if len(alive) == len(nodes):
            break
        nodes = alive
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph_model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        onnx.save(graph_model, tmp)
        os.replace(tmp, out)   # atomic: a concurrent builder leaves one whole file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def _locate(spec: str | os.PathLike) -> Path:
    """A manifest name resolves to the verified file in the model cache (never fetched here: a
    missing file is a set-up error that names the fix); a path is used as it is."""
    if isinstance(spec, os.PathLike) or os.sep in str(spec):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelError(f"embedding model file not found: {path}")
        return path
    return modelstore.resolve(spec, fetch_missing=False, progress=False)
