"""Thin, explicit wrapper over llama.cpp's C API (through llama-cpp-python's ctypes bindings).

We use the low-level API because the high-level `Llama` class gives one sequence only, and tree
decoding needs many: one llama_decode evaluates a whole token tree when every node carries the
sequence ids of all leaves below it (a unified KV cache then masks attention exactly like a tree).
"""
from __future__ import annotations

import codecs
import ctypes
import functools
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import llama_cpp as C  # noqa: E402  (after numpy: its import prints nothing but is slow)
import numpy as np

from edgespec.common.errors import ContextOverflowError, InvalidRequestError, ModelError, SessionClosedError
from edgespec.common.constraints import GrammarVocab
from edgespec.common.tokens import common_prefix_length, tokenizer_fingerprint

_BACKEND_LOCK = threading.Lock()
_BACKEND_READY = False
ALL_LAYERS = -1   # n_gpu_layers: offload every layer (llama.cpp's own `-ngl -1` / llama-cpp-python convention)


@C.llama_log_callback
def _print_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:  # pragma: no cover
    print(text.decode("utf-8", "replace"), end="", flush=True)


# Silence llama.cpp's logging without running Python code. llama.cpp logs from inside its C calls
# (hundreds of lines per model load or graph reservation, also mid-generation), and a Ctrl-C whose
# handler runs inside a Python callback raises KeyboardInterrupt there, where ctypes prints
# "Exception ignored on calling ctypes callback function" and drops it: the interrupt was lost and
# `edgespec run` went on generating (the flaky Ctrl-C test). A builtin type as the callback
# (`slice(level, text, user_data)`: builds a throw-away object, no side effects) runs no bytecode,
# so signal handlers never run inside it. EDGESPEC_LLAMA_LOG=1 prints the log (debugging only: a
# Ctrl-C can then be lost that way).
_SILENT_LOG = C.llama_log_callback(slice)


def _init_backend() -> None:
    global _BACKEND_READY
    with _BACKEND_LOCK:
        if not _BACKEND_READY:
            C.llama_log_set(_print_log if os.environ.get("EDGESPEC_LLAMA_LOG") else _SILENT_LOG, ctypes.c_void_p())
            C.llama_backend_init()
            _BACKEND_READY = True


def gpu_offload_supported() -> bool:
    """Whether this llama.cpp build can put layers on a GPU (CUDA, Metal, ...; see README)."""
    _init_backend()
    return bool(C.llama_supports_gpu_offload())


class LlamaModel:
    """Weights and vocabulary of one GGUF model; contexts (KV caches) are created from it."""

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 0, vocab_only: bool = False) -> None:
        """`n_gpu_layers`: layers offloaded to the GPU (ALL_LAYERS = -1: every layer). Asking for
        layers from a build without GPU support is refused: silently running on the CPU would hide it.
        `vocab_only`: the vocabulary (and hyper-parameters) without the weights, for tokenizing and
        grammar_vocab only (the torch verifier's grammars); no context can be created from it."""
        # Both set first: a Ctrl-C can land anywhere below (the load takes seconds), and close()
        # (also run from __del__) must then find them.
        self._model = None
        self._contexts: weakref.WeakSet[TreeContext] = weakref.WeakSet()
        path = Path(path)
        if not path.is_file():
            raise ModelError(f"model file not found: {path}")
        if n_gpu_layers < ALL_LAYERS:
            raise InvalidRequestError(f"n_gpu_layers must be >= 0 (or -1 for all layers), got {n_gpu_layers}")
        if n_gpu_layers and not gpu_offload_supported():
            raise InvalidRequestError(
                f"n_gpu_layers={n_gpu_layers} asks for a GPU, but this llama.cpp build cannot offload "
                "(rebuild it: EDGESPEC_LLAMA_FLAVOR=cuda tools/setup.sh, see README)")
        _init_backend()
        params = C.llama_model_default_params()
        params.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers == ALL_LAYERS else n_gpu_layers
        params.vocab_only = vocab_only
        self._model = C.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ModelError(f"llama.cpp could not load {path} (not a valid GGUF model?)")
        self.path = path
        self.n_layer: int = C.llama_model_n_layer(self._model)
        # llama.cpp offloads the repeating layers first, then the output layer: n_layer + 1 in all.
        self.gpu_layers: int = min(params.n_gpu_layers, self.n_layer + 1)
        self._vocab = C.llama_model_get_vocab(self._model)
        self.n_vocab: int = C.llama_vocab_n_tokens(self._vocab)
        self.eos: int = C.llama_vocab_eos(self._vocab)
        self.bos: int = C.llama_vocab_bos(self._vocab)
        self._eog = np.array([C.llama_vocab_is_eog(self._vocab, t) for t in range(self.n_vocab)], bool)
        self._fingerprint: str | None = None
        self._grammar_vocab: GrammarVocab | None = None

    @property
    def closed(self) -> bool:
        return not getattr(self, "_model", None)

    def close(self) -> None:
        """Free the weights, after closing every context still open on them (llama.cpp contexts
        point into the model: freeing it first would leave them dangling). Idempotent."""
        if getattr(self, "_model", None):
            for ctx in list(self._contexts):
                ctx.close()
            C.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        self.close()

    def _check_open(self) -> None:
        if not getattr(self, "_model", None):
            raise SessionClosedError(f"model {getattr(self, 'path', '?')} was closed")

    # -- vocabulary ---------------------------------------------------------------------------
    def is_end_of_generation(self, token: int) -> bool:
        return bool(self._eog[token])

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self._check_open()
        data = text.encode("utf-8")
        buf = (C.llama_token * (len(data) + 16))()
        n = C.llama_tokenize(self._vocab, data, len(data), buf, len(buf), add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            buf = (C.llama_token * -n)()
            n = C.llama_tokenize(self._vocab, data, len(data), buf, len(buf), add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token adds to the output text (special tokens render as nothing)."""
        self._check_open()
        buf = ctypes.create_string_buffer(64)
        n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def tokenizer_fingerprint(self) -> str:
        """sha256 over the token list: equal fingerprints mean draft tokens mean the same to the target."""
        if self._fingerprint is None:
            self._check_open()
            self._fingerprint = tokenizer_fingerprint(
                C.llama_vocab_get_text(self._vocab, t) or b"" for t in range(self.n_vocab))
        return self._fingerprint

    def grammar_vocab(self) -> GrammarVocab:
        """The token list as llguidance needs it for grammar constraints (common/constraints.py):
        each token's bytes and the end-of-generation ids. Built on first use (about a second per
        50k tokens), then kept with the model."""
        self._check_open()
        if self._grammar_vocab is None:
            import warnings

            from llguidance.llamacpp import lltokenizer_from_vocab

            eog = np.flatnonzero(self._eog).tolist()
            with warnings.catch_warnings():   # it calls llama_token_get_attr, deprecated, once per token
                warnings.simplefilter("ignore", DeprecationWarning)
                tokenizer = lltokenizer_from_vocab(self._vocab, eos_token=eog)
            self._grammar_vocab = GrammarVocab(tokenizer, self.n_vocab)
        return self._grammar_vocab

    # -- chat ---------------------------------------------------------------------------------
    def chat_template(self) -> str | None:
        self._check_open()
        raw = C.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8") if raw else None

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """Apply the GGUF's own Jinja chat template (the model's training format)."""
        template = self.chat_template()
        if template is None:  # base models: plain concatenation of the contents
            return "\n".join(m["content"] for m in messages)
        import jinja2.sandbox

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=True, raise_exception=raise_exception,
            bos_token=self.token_bytes(self.bos).decode("utf-8", "replace") if self.bos >= 0 else "",
            eos_token=self.token_bytes(self.eos).decode("utf-8", "replace"))

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        tokens = self.tokenize(self.render_chat(messages), add_special=True, parse_special=True)
        if len(tokens) >= 2 and tokens[0] == tokens[1] == self.bos:  # template wrote BOS too
            tokens = tokens[1:]
        return tokens


class TextStream:
    """Turns tokens into text chunks that never split a UTF-8 character; chunks concatenate to the text."""

    def __init__(self, model: LlamaModel) -> None:
        self._model = model
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, tokens: Sequence[int]) -> str:
        return self._decoder.decode(b"".join(self._model.token_bytes(t) for t in tokens))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


@dataclass(frozen=True)
class ContextConfig:
    n_ctx: int = 4096
    n_batch: int = 512
    # One thread by default: llama.cpp's worker threads spin while they wait, so on a small shared
    # machine (the 2-core CI VM) two threads per model stall each other; callers size it per mode
    # (edge/session.py default_threads).
    n_threads: int = 1
    max_tree_nodes: int = 128  # upper bound of one tree decode (also the number of sequences)
    flash_attention: bool = True


_F = TypeVar("_F", bound=Callable[..., Any])


def _exclusive(method: _F) -> _F:
    """Run a TreeContext method under the context's lock, refusing a closed context.

    llama.cpp contexts are not thread-safe: two threads decoding into one (or one freeing it while
    another decodes) abort or crash the process. The lock serialises such calls instead, and a call
    after close() raises SessionClosedError rather than touching freed memory.
    """
    @functools.wraps(method)
    def guarded(self: "TreeContext", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._ctx is None:
                raise SessionClosedError(f"the KV context of {self.model.path.name} was closed")
            return method(self, *args, **kwargs)
    return guarded  # type: ignore[return-value]


class TreeContext:
    """One KV cache. Sequence 0 holds the committed context; other sequences are tree branches.

    Thread-safe in the sense that matters for the process: calls are serialised, and a closed
    context raises SessionClosedError. Interleaving two conversations in one context is still the
    caller's business (each call sees whatever the last one left).
    """

    def __init__(self, model: LlamaModel, config: ContextConfig = ContextConfig()) -> None:
        self.model = model
        self.config = config
        self._lock = threading.RLock()
        self._ctx = None
        if config.n_ctx <= 0 or config.n_threads <= 0:
            raise InvalidRequestError(f"n_ctx and n_threads must be > 0, got n_ctx={config.n_ctx}, "
                                      f"n_threads={config.n_threads}")
        if config.n_ctx < config.max_tree_nodes + 1:  # llama.cpp would abort the process (GGML_ASSERT)
            raise InvalidRequestError(f"n_ctx={config.n_ctx} must exceed max_tree_nodes={config.max_tree_nodes}")
        model._check_open()
        params = C.llama_context_default_params()
        params.n_ctx = config.n_ctx
        params.n_batch = max(config.n_batch, config.max_tree_nodes + 1)
        params.n_ubatch = params.n_batch
        params.n_seq_max = min(256, config.max_tree_nodes + 1)
        params.kv_unified = True  # otherwise llama.cpp refuses batches whose sequences share cells
        params.n_threads = params.n_threads_batch = config.n_threads
        params.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attention else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        ctx = C.llama_init_from_model(model._model, params)
        if not ctx:
            raise ModelError(f"llama.cpp could not create a context for {model.path} (n_ctx={config.n_ctx})")
        self._ctx = ctx
        # llama.cpp pads the KV cache (to a multiple of 256); the window is what was asked for, so
        # that a context of n_ctx tokens behaves the same whatever the padding.
        self.n_ctx = min(config.n_ctx, C.llama_n_ctx(ctx))
        self.n_seq_max = params.n_seq_max
        self._mem = C.llama_get_memory(self._ctx)
        self._batch = C.llama_batch_init(params.n_batch, 0, self.n_seq_max)
        self._batch_capacity = params.n_batch
        self.tokens: list[int] = []  # committed tokens held by sequence 0
        model._contexts.add(self)

    @property
    def closed(self) -> bool:
        return self._ctx is None

    def close(self) -> None:
        """Free the KV cache, after any call running in another thread has finished. Idempotent."""
        lock = getattr(self, "_lock", None)
        if lock is None:  # __init__ failed before the lock existed: nothing was allocated
            return
        with lock:
            if getattr(self, "_ctx", None):
                # A Ctrl-C inside __init__ can land between creating the context and its batch.
                if getattr(self, "_batch", None) is not None:
                    C.llama_batch_free(self._batch)
                C.llama_free(self._ctx)
                self._ctx = None

    def __del__(self) -> None:  # pragma: no cover
        self.close()

    # -- low level ----------------------------------------------------------------------------
    def _decode(self, tokens: Sequence[int], positions: Sequence[int], seq_sets: Sequence[Sequence[int]],
                want_logits: Sequence[bool]) -> np.ndarray:
        """One llama_decode; returns the logits rows that were asked for, in batch order."""
        n = len(tokens)
        if n > self._batch_capacity:
            raise ValueError(f"batch of {n} tokens exceeds capacity {self._batch_capacity}")
        if max(positions) >= self.n_ctx:
            raise ContextOverflowError(f"context of {self.n_ctx} tokens is full (needs position {max(positions)})")
        b = self._batch
        b.n_tokens = n
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            b.n_seq_id[i] = len(seq_sets[i])
            for j, s in enumerate(seq_sets[i]):
                b.seq_id[i][j] = s
            b.logits[i] = bool(want_logits[i])
        rc = C.llama_decode(self._ctx, b)
        if rc != 0:
            raise ContextOverflowError(f"llama_decode failed with code {rc} (KV cache full or batch refused)")
        rows = [i for i in range(n) if want_logits[i]]
        out = np.empty((len(rows), self.model.n_vocab), np.float32)
        for k, i in enumerate(rows):
            ptr = C.llama_get_logits_ith(self._ctx, i)
            out[k] = np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))
        return out

    # -- committed context --------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @_exclusive
    def ingest(self, tokens: Sequence[int]) -> np.ndarray | None:
        """Append committed tokens to sequence 0; returns the logits after the last one."""
        logits = None
        step = self._batch_capacity
        for start in range(0, len(tokens), step):
            chunk = list(tokens[start:start + step])
            last = start + len(chunk) == len(tokens)
            positions = range(self.n_past, self.n_past + len(chunk))
            rows = self._decode(chunk, positions, [(0,)] * len(chunk), [last and i == len(chunk) - 1 for i in range(len(chunk))])
            self.tokens.extend(chunk)
            if last:
                logits = rows[0]
        return logits

    @_exclusive
    def sync(self, tokens: Sequence[int]) -> np.ndarray:
        """Make sequence 0 hold exactly `tokens`, reusing the common prefix; logits after the last.

        This one call serves a new conversation, a new user turn and a resync after a failure.
        """
        if not tokens:
            raise ValueError("cannot sync to an empty context")
        common = self.kept_prefix(tokens)
        self.truncate(common)
        return self.ingest(tokens[common:])

    def kept_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` sync(tokens) keeps from the cache; it decodes the rest. The last token is always
        decoded again: its logits are what sync returns."""
        return min(common_prefix_length(self.tokens, tokens), len(tokens) - 1)

    @_exclusive
    def truncate(self, n_keep: int) -> None:
        """Drop committed tokens from position n_keep on, and every tree branch."""
        C.llama_memory_seq_rm(self._mem, -1, n_keep, -1)
        self.drop_branches()
        del self.tokens[n_keep:]

    # -- trees --------------------------------------------------------------------------------
    @_exclusive
    def decode_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[np.ndarray, list[int]]:
        """Decode a whole tree (node 0 = next committed token) in one call; logits for every node.

        Each leaf gets its own sequence holding a copy of the committed context; every node
        carries the sequences of all leaves below it, so it attends exactly to its ancestors.
        Returns (logits[n, vocab], leaf_seq) where leaf_seq[i] is a sequence id containing node i.
        """
        n = len(tokens)
        if n + 1 > self.n_seq_max:
            raise ValueError(f"tree of {n} nodes needs more than {self.n_seq_max} sequences")
        has_child = [False] * n
        for i in range(1, n):
            has_child[parents[i]] = True
        leaves = [i for i in range(n) if not has_child[i]]
        seq_sets: list[list[int]] = [[] for _ in range(n)]
        for seq, leaf in enumerate(leaves, start=1):
            C.llama_memory_seq_cp(self._mem, 0, seq, -1, -1)
            node = leaf
            while node >= 0:
                seq_sets[node].append(seq)
                node = parents[node]
        depths = [0] * n
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
        positions = [self.n_past + d for d in depths]
        logits = self._decode(tokens, positions, seq_sets, [True] * n)
        return logits, [s[0] for s in seq_sets]

    @_exclusive
    def decode_frontier(self, tokens: Sequence[int], parent_seqs: Sequence[int], depth: int,
                        first_seq: int) -> np.ndarray:
        """Decode one depth of a growing tree: node i continues sequence parent_seqs[i].

        Node i gets the fresh sequence first_seq + i, first filled with a copy of its parent's
        sequence (committed context plus ancestors), so it attends to exactly its path.
        """
        if first_seq + len(tokens) > self.n_seq_max:
            raise ValueError("draft tree needs more sequences than the context was created with")
        for i, parent_seq in enumerate(parent_seqs):
            C.llama_memory_seq_cp(self._mem, parent_seq, first_seq + i, -1, -1)
        seqs = [(first_seq + i,) for i in range(len(tokens))]
        return self._decode(tokens, [self.n_past - 1 + depth] * len(tokens), seqs, [True] * len(tokens))

    @_exclusive
    def adopt_branch(self, seq: int, new_tokens: Sequence[int]) -> None:
        """Commit `new_tokens`, the first tokens of branch `seq` after the committed context.

        Everything else of the tree is dropped: keep(seq) frees all other cells, rm trims the
        branch after the accepted part, cp makes it sequence 0, and the branch id is released.
        """
        if seq != 0:
            C.llama_memory_seq_keep(self._mem, seq)
            C.llama_memory_seq_rm(self._mem, seq, self.n_past + len(new_tokens), -1)
            C.llama_memory_seq_cp(self._mem, seq, 0, -1, -1)
            C.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self.tokens.extend(new_tokens)

    @_exclusive
    def drop_branches(self) -> None:
        """Forget every tree branch, keeping only the committed context."""
        C.llama_memory_seq_rm(self._mem, -1, self.n_past, -1)
        for s in range(1, self.n_seq_max):
            C.llama_memory_seq_rm(self._mem, s, -1, -1)
