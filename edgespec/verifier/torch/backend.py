"""TorchBackend: the verifier's target model in torch, over a paged KV cache (CPU or CUDA).

    backend = TorchBackend(path)                                   # float32 on the CPU: exact reference
    backend = TorchBackend(path, device="cuda")                    # bfloat16 on a GPU
    session = backend.open_session(); session.sync(prompt); session.verify(tree, sampling, step)

Same contract as LlamaCppBackend (verifier/llama_backend.py), same acceptance code (common/acceptance.py:
check_context, check_tree, accept_logits), so the service cannot tell them apart except by
`ModelInfo.backend`. Invariant, as in the llama.cpp verifier: a session's KV sequence holds every
committed token except the last one, which is the root of the next tree.

Between steps (after each batch and each sync) the engine compacts the KV cache when its
fragmentation index passes `compact_threshold`. A sync prefills in chunks (`sync_chunks`), so the
service can run other sessions' verify batches between them.

Prefix sharing: when a session syncs, it adopts the full blocks of the longest common prefix held
by any other live session (system prompts, a resent conversation) instead of recomputing them.

Grammar constraints (common/constraints.py): a request with a TokenConstraint is decided on the
host (engine.decided_on_device), where acceptance masks the logits rows exactly as the llama.cpp
verifier does; grammars are compiled over llama.cpp's vocabulary of the same GGUF (`grammar_vocab`),
so the masks are the edge's.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import threading
import time
from typing import Iterator, Sequence

import torch

from edgespec.common.acceptance import (
    VerifyResult,
    accept_logits,
    check_context,
    check_tree,
)
from edgespec.common.constraints import GrammarVocab
from edgespec.common.errors import InvalidRequestError
from edgespec.common.sampling import SamplingParams
from edgespec.common.tokens import common_prefix_length
from edgespec.common.tree import MAX_TREE_NODES, TokenTree
from edgespec.verifier.backends import (
    Backend,
    BackendSession,
    KVUsage,
    ModelInfo,
    model_identity,
)
from edgespec.verifier.torch import gguf_weights
from edgespec.verifier.torch.block_pool import OutOfBlocksError
from edgespec.verifier.torch.engine import Decision, Engine, TreeStep, bucket, decided_on_device
from edgespec.verifier.torch.model import TransformerLM

# Tokens of a sync's chunk riding in a verify step: min(this, prefill_chunk), or the trees' bucket when
# larger. Small because the step pads every row to the same length: a longer chunk would pad every
# tree of the batch to it (a ragged row layout would lift this).
MIXED_CHUNK = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchSession(BackendSession):
    def __init__(self, backend: "TorchBackend") -> None:
        self.backend = backend
        self.engine = backend.engine
        self.seq = self.engine.new_sequence()
        self.committed: list[int] = []
        backend._sessions.add(self)

    @property
    def cached_tokens(self) -> list[int]:
        """The tokens whose K/V the sequence holds (committed minus the pending root)."""
        return self.committed[:self.seq.length]

    def sync(self, tokens: list[int]) -> None:
        for _ in self.sync_chunks(tokens):
            pass

    def sync_chunks(self, tokens: list[int]) -> Iterator[int]:
        work = self.begin_sync(tokens)
        while not work.finished:
            work.run_chunk()
            if work.finished:
                self.engine.between_steps()
            yield work.committed_so_far

    def begin_sync(self, tokens: list[int]) -> "PrefillWork":
        """Start making `tokens` the committed context: check them, reuse the longest cached prefix
        (this session's own, or full blocks of another live session's), and return the prefill
        still to do. Until it finishes the context is in doubt (committed is empty)."""
        b = self.backend
        check_context(tokens, b.info.vocab_size, b.info.n_ctx, b.info.max_depth)
        target = list(tokens[:-1])
        own = common_prefix_length(self.cached_tokens, target)
        donor, shared = None, 0
        for other in b._sessions:
            if other is not self and not other.seq.closed:
                n = common_prefix_length(other.cached_tokens, target) // self.engine.cache.block_size
                if n * self.engine.cache.block_size > max(shared, own):
                    donor, shared = other, n * self.engine.cache.block_size
        self.committed = []  # in doubt until the prefill has finished
        if donor is not None:
            self.seq.truncate(0)
            self.seq.share_prefix(donor.seq, shared)
        else:
            self.seq.truncate(own)
        return PrefillWork(self, list(tokens))

    def verify(self, tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        [result] = self.backend.verify_many([(self, tree, sampling, step)])
        if isinstance(result, BaseException):
            raise result
        return result

    def _tree_step(self, tree: TokenTree, sampling: SamplingParams, step: int) -> TreeStep:
        b = self.backend
        if sampling.constraint:   # a grammar from the wire is compiled over this model's token list
            sampling.constraint.bind(b.grammar_vocab)
        check_tree(tree, self.committed, b.info.vocab_size, b.info.max_nodes, b.info.max_depth, sampling)
        host_rule = None
        if not decided_on_device(sampling):  # the rejection rule needs q: decided from logits rows on the host
            def host_rule(argmax, row):  # noqa: ANN001, ANN202
                return accept_logits(tree, sampling, step, argmax, row, self.committed)[0]
        return TreeStep(self.seq, tree.tokens, tree.parents, sampling, step, host_rule)   # arrays: copied whole

    def _commit(self, tree: TokenTree, decision: Decision, compute_s: float) -> VerifyResult:
        committed = [*tree.tokens[decision.path].tolist(), decision.next_token]
        self.committed.extend(committed)
        return VerifyResult(path=decision.path, tokens=committed, margins=decision.margins, compute_s=compute_s)

    @property
    def committed_tokens(self) -> list[int]:
        return self.committed

    def close(self) -> None:
        self.seq.close()
        self.backend._sessions.discard(self)


class PrefillWork:
    """A sync in progress: the committed context's K/V still to compute (all tokens but the last,
    which is the root of the next tree). Advanced one chunk at a time, either alone (run_chunk, or
    verify_many with no trees) or as a chain riding in a verify step (TorchBackend.verify_many
    with prefills=...); `finished` commits the context."""

    def __init__(self, session: TorchSession, tokens: list[int]) -> None:
        self.session = session
        self.tokens = tokens
        self.error: BaseException | None = None
        self.ran = False     # a chunk of it ran in the last verify_many call (for the service's figures)
        self.rode = False    # ... inside a verify step

    @property
    def remaining(self) -> int:
        return len(self.tokens) - 1 - self.session.seq.length

    @property
    def finished(self) -> bool:
        return self.error is None and self.remaining <= 0 and self.session.committed is self.tokens

    @property
    def committed_so_far(self) -> int:
        return len(self.tokens) if self.finished else self.session.seq.length

    def next_chunk(self, n: int) -> list[int]:
        start = self.session.seq.length
        return self.tokens[start:start + min(n, self.remaining)]

    def advanced(self) -> None:
        """After a chunk's forward: commit the context once every token's K/V is in place."""
        if self.remaining <= 0:
            self.session.committed = self.tokens

    def run_chunk(self) -> None:
        """One standalone chunk, raising what fails it (the work stays retryable): where the backend
        runs prefill as verify-step rows (mixed_prefill: CUDA), a chain of `alone_chunk` tokens
        verified as its own step, i.e. a replayed CUDA graph, by the same code as verify_many's syncs
        alone; else an eager forward of `prefill_chunk` tokens without logits."""
        backend = self.session.backend
        if backend.mixed_prefill:
            backend._run_riders(backend._riders([self], backend.alone_chunk, limit=1, mixed=False))
            error, self.error = self.error, None
            if error is not None:
                raise error
            return
        if self.remaining > 0:
            backend.engine.append(self.session.seq, self.next_chunk(backend.engine.prefill_chunk))
        self.advanced()


class TorchBackend(Backend):
    """One TransformerLM and one paged KV cache, sized for `max_sessions` full contexts, shared by all sessions."""

    def __init__(self, model_path: str | os.PathLike, *, device: str = "cpu", dtype: str | None = None,
                 n_ctx: int = 4096, max_nodes: int = 128, max_depth: int = 32, max_k: int = 64,
                 max_sessions: int = 4, block_size: int = 16, threads: int | None = None,
                 model_id: str | None = None, cuda_graphs: bool | None = None, attention: str = "auto",
                 prefill_chunk: int = 256, compact_threshold: float = 0.5, compact_check_every: int = 16,
                 warmup: bool | None = None) -> None:
        """warmup: capture every (batch, tree) bucket's step graph now (Engine.warmup), not while
        serving; default: when the engine uses CUDA graphs."""
        if not 2 <= max_nodes <= MAX_TREE_NODES:
            raise ValueError(f"max_nodes must be in [2, {MAX_TREE_NODES}], got {max_nodes}")
        if n_ctx < max_depth + 2:
            raise ValueError(f"n_ctx {n_ctx} is too small for trees of depth {max_depth}")
        dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but torch sees no CUDA device")
        if threads:
            torch.set_num_threads(threads)
        reader = gguf_weights.open_gguf(model_path)
        fingerprint = gguf_weights.tokenizer_fingerprint(reader)
        model = gguf_weights.load_model(reader, dtype=DTYPES[dtype], device=device, max_positions=n_ctx)
        del reader
        mid, aliases = model_identity(model_path)
        self._setup(model, model_id=model_id or mid, aliases=aliases if model_id is None else (mid, *aliases),
                    tokenizer_hash=fingerprint, n_ctx=n_ctx, max_nodes=max_nodes, max_depth=max_depth, max_k=max_k,
                    max_sessions=max_sessions, block_size=block_size, cuda_graphs=cuda_graphs, attention=attention,
                    prefill_chunk=prefill_chunk, compact_threshold=compact_threshold,
                    compact_check_every=compact_check_every, extra={"path": str(model_path)})
        self._model_path = model_path
        if self.engine.cuda_graphs if warmup is None else warmup:
            self.warm_up(max_sessions, max_nodes)
        if importlib.util.find_spec("llama_cpp") is not None:   # grammar_vocab reads the vocabulary with it
            self.info = dataclasses.replace(self.info, grammar_constraints=True)

    @classmethod
    def from_model(cls, model: TransformerLM, *, model_id: str = "random", tokenizer_hash: str = "",
                   n_ctx: int = 4096, max_nodes: int = 128, max_depth: int = 32, max_k: int = 64,
                   max_sessions: int = 4, block_size: int = 16, cuda_graphs: bool | None = None,
                   attention: str = "auto", prefill_chunk: int = 256,
                   compact_threshold: float = 0.5, compact_check_every: int = 16) -> "TorchBackend":
        """A backend around a model already in memory (benchmarks with random weights)."""
        backend = cls.__new__(cls)
        backend._setup(model, model_id=model_id, aliases=(), tokenizer_hash=tokenizer_hash, n_ctx=n_ctx,
                       max_nodes=max_nodes, max_depth=max_depth, max_k=max_k, max_sessions=max_sessions,
                       block_size=block_size, cuda_graphs=cuda_graphs, attention=attention,
                       prefill_chunk=prefill_chunk, compact_threshold=compact_threshold,
                       compact_check_every=compact_check_every, extra={})
        return backend

    def _setup(self, model: TransformerLM, *, model_id: str, aliases: tuple[str, ...], tokenizer_hash: str,
               n_ctx: int, max_nodes: int, max_depth: int, max_k: int, max_sessions: int, block_size: int,
               cuda_graphs: bool | None, attention: str, prefill_chunk: int, compact_threshold: float,
               compact_check_every: int, extra: dict) -> None:
        self.model = model
        blocks_per_session = -(-n_ctx // block_size)
        # Each session may hold n_ctx positions plus a tree of max_nodes in reserved slots; one spare
        # block per session lets a truncate copy a shared tail block (kv_cache.KVSequence.truncate);
        # block 0 is the null block.
        step_blocks = -(-(n_ctx + max_nodes) // block_size) + 1
        self.engine = Engine(model, num_blocks=max_sessions * (step_blocks + 1) + 1, block_size=block_size,
                             cuda_graphs=cuda_graphs, attention=attention, prefill_chunk=prefill_chunk,
                             compact_threshold=compact_threshold, compact_check_every=compact_check_every)
        # Prefill rides in verify steps on a GPU, where a step's padded rows cost little next to
        # reading the weights; on the CPU every padded row is computed, and turns were measured faster
        # there (docs/BENCHMARKS.md, 2026-12-01: verify p50 during a sync 58 vs 26 ms).
        self.mixed_prefill = model.device.type == "cuda"
        self._sessions: set[TorchSession] = set()
        self._model_path: str | os.PathLike | None = None   # where grammar_vocab reads the token list
        self._grammar_vocab: GrammarVocab | None = None
        self._vocab_model = None   # llama.cpp's vocabulary of the model (no weights), for grammar_vocab
        self._grammar_lock = threading.Lock()
        c = model.config
        dtype = next(k for k, v in DTYPES.items() if v == model.dtype)
        self.info = ModelInfo(
            model_id=model_id, aliases=aliases, tokenizer_hash=tokenizer_hash, vocab_size=c.vocab_size, n_ctx=n_ctx,
            max_nodes=max_nodes, max_depth=max_depth, max_k=max_k, backend=f"torch-{model.device.type}-{dtype}",
            kv_bytes_per_session=blocks_per_session * self.engine.cache.bytes_per_block,
            extra={**extra, "arch": c.arch, "block_size": block_size, "num_blocks": self.engine.cache.pool.num_blocks,
                   "attention": self.engine.attention, "cuda_graphs": self.engine.cuda_graphs,
                   "fused_kernels": self.engine.fused, "prefill_chunk": prefill_chunk,
                   "compact_threshold": compact_threshold})

    def warm_up(self, max_sessions: int, max_nodes: int) -> None:
        """Step every batch bucket up to max_sessions sequences with every tree bucket up to max_nodes
        nodes, root included, in each decision mode (Engine.warmup; prefill chunks ride in buckets of
        at most 64 rows or the trees' size); the count and time go into info.extra["warmup"]."""
        started = time.perf_counter()
        def up_to(n: int) -> list[int]:
            return [1 << i for i in range(bucket(n).bit_length())]
        buckets = self.engine.warmup(up_to(max_sessions), up_to(max_nodes))
        self.info.extra["warmup"] = {"buckets": buckets, "seconds": round(time.perf_counter() - started, 2)}

    def open_session(self) -> TorchSession:
        return TorchSession(self)

    def grammar_vocab(self) -> GrammarVocab:
        """The token list llguidance compiles grammars over: built exactly as the edge builds it
        (LlamaModel.grammar_vocab) from llama.cpp's vocabulary of the same GGUF, loaded without its
        weights. Not from tokenizer.ggml.tokens alone: llama.cpp renders tokens by attribute and
        decodes byte-level text, makes "control-looking" tokens (e.g. Qwen's NORMAL "</s>") CONTROL
        and end-of-generation, and llguidance allows forced text (a JSON key the schema fixes) only
        in the tokenizer's own tokenization ("languages" is "l" + "anguages" for SmolLM2), so the
        masks equal the edge's only with llama.cpp's tokenizer too. Built on the first grammar
        (about a second per 50k tokens), then kept."""
        with self._grammar_lock:
            if self._grammar_vocab is None:
                if not self.info.grammar_constraints or self._model_path is None:
                    raise InvalidRequestError(f"the {self.info.backend} backend of {self.info.model_id} does not "
                                              "apply grammar constraints")
                from edgespec.runtime.llama import LlamaModel

                self._vocab_model = LlamaModel(self._model_path, vocab_only=True)
                self._grammar_vocab = self._vocab_model.grammar_vocab()
            return self._grammar_vocab

    def verify_many(self, requests: list[tuple[TorchSession, TokenTree, SamplingParams, int]],
                    prefills: Sequence[PrefillWork] = ()) -> list[VerifyResult | BaseException]:
        """Verify several sessions' trees in one forward (the service's batching worker calls this),
        and advance syncs in `prefills` by one chunk each: in the same forward as a chain of up to
        max(min(MIXED_CHUNK, prefill_chunk), the trees' bucket) tokens (as many as fit the rows the
        batch bucket pads to, and at least one; the rest wait for a later batch), or, when there
        is no tree to verify, alone: on CUDA all of them as one step of prefill rows (`alone_chunk`
        tokens each, a replayed graph), elsewhere each an eager chunk of `prefill_chunk` tokens.

        A request that fails its checks gets its exception back and the others still run; if the
        forward itself fails, every request in it gets that exception (their sessions are then in
        doubt, as after any failed verify). A prefill that fails gets it as `work.error`."""
        results: list[VerifyResult | BaseException | None] = [None] * len(requests)
        for work in prefills:   # what this call does to each, for the service's figures
            work.rode = work.ran = False
        steps, index = [], []
        for i, (session, tree, sampling, step) in enumerate(requests):
            try:
                steps.append(session._tree_step(tree, sampling, step))
                index.append(i)
            except Exception as exc:  # noqa: BLE001 - that request alone fails
                results[i] = exc
        # Reserve each tree's blocks first, one request at a time: a pool that cannot hold a tree
        # fails that request alone (OutOfBlocksError: RESOURCE_EXHAUSTED), not the whole batch.
        kept_steps, kept_index = [], []
        for i, step in zip(index, steps):
            try:
                step.seq.reserve(step.seq.length + len(step.tokens))
            except OutOfBlocksError as exc:
                results[i] = exc
                continue
            kept_steps.append(step)
            kept_index.append(i)
        steps, index = kept_steps, kept_index
        if not steps:   # syncs alone: on CUDA one step of prefill rows for all of them, else eager chunks
            if self.mixed_prefill:
                self._run_riders(self._riders(prefills, self.alone_chunk, limit=len(prefills), mixed=False))
            else:
                for work in prefills:
                    work.ran = True
                    try:
                        work.run_chunk()
                    except Exception as exc:  # noqa: BLE001 - that sync alone fails
                        work.error = exc
            self.engine.between_steps()
            return results  # type: ignore[return-value]
        chunk = max(min(MIXED_CHUNK, self.engine.prefill_chunk), bucket(max(len(s.tokens) for s in steps)))
        # Chunks fill the rows the step pads to anyway (its batch bucket), and at least one rides.
        riders = self._riders(prefills, chunk, limit=max(1, bucket(len(steps)) - len(steps)))
        started = time.perf_counter()
        try:
            decisions = self.engine.verify(steps + [step for _, step in riders])
        except Exception as exc:  # noqa: BLE001
            for i in index:
                results[i] = exc
            for work, _ in riders:
                work.error = exc
            return results  # type: ignore[return-value]
        elapsed = time.perf_counter() - started
        for i, decision in zip(index, decisions):
            session, tree, _, _ = requests[i]
            results[i] = session._commit(tree, decision, elapsed)
        for work, _ in riders:
            work.advanced()
        self.engine.between_steps()
        return results  # type: ignore[return-value]

    @property
    def alone_chunk(self) -> int:
        """Tokens per chunk of a sync prefilled as a step of its own (rows of the trees' T = 64 bucket,
        so no graph beyond the verify steps' own is captured for it)."""
        return min(MIXED_CHUNK, self.engine.prefill_chunk)

    def _run_riders(self, riders: list[tuple[PrefillWork, TreeStep]]) -> None:
        """Prefill rows with no tree beside them, as one step; a failure fails those syncs."""
        if not riders:
            return
        try:
            self.engine.verify([step for _, step in riders])
        except Exception as exc:  # noqa: BLE001 - these syncs fail, the service goes on
            for work, _ in riders:
                work.error = exc
            return
        for work, _ in riders:
            work.advanced()

    @staticmethod
    def _riders(prefills: Sequence[PrefillWork], chunk: int, limit: int,
                mixed: bool = True) -> list[tuple[PrefillWork, TreeStep]]:
        """Up to `limit` unfinished syncs' next chunks as prefill rows of a step (blocks reserved),
        beside verify trees (`mixed`) or alone; the others wait for a later batch."""
        riders = []
        for work in prefills:
            if work.remaining <= 0:
                work.advanced()
                continue
            if len(riders) == limit:
                continue
            step = TreeStep.prefill_chunk(work.session.seq, work.next_chunk(chunk))
            try:
                step.seq.reserve(step.seq.length + len(step.tokens))
            except OutOfBlocksError as exc:
                work.error = exc
                continue
            riders.append((work, step))
            work.ran, work.rode = True, mixed
        return riders

    def kv_usage(self) -> KVUsage:
        pool, stats = self.engine.cache.stats(), self.engine.stats
        return KVUsage(blocks=pool.num_blocks, used_blocks=pool.used, shared_blocks=pool.shared,
                       fragmentation=self.engine.cache.pool.fragmentation(), compactions=stats["compactions"],
                       blocks_moved=stats["blocks_moved"], compact_seconds=stats["compact_seconds"],
                       spare_blocks=pool.spare)

    def close(self) -> None:
        for s in list(self._sessions):
            s.close()
        if self._vocab_model is not None:
            self._grammar_vocab = None
            self._vocab_model.close()
