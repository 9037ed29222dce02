"""Verify a draft tree against the target with llama.cpp: one decode, lossless acceptance.

Two classes, because there are two kinds of caller:

- `LocalVerifier` is what the edge's decoder uses (local mode, local fallback). The decoder owns
  the committed context and passes it to every call; the verifier keeps only its KV cache and,
  before a decode, brings the cache to the context it was given (after steps verified elsewhere
  the cache is behind; the common prefix is reused). It never keeps a copy to reconcile.
- `Conversation` owns a committed context for callers that have no decoder: the verifier
  service's sessions (the server is the only holder of its client's context) and tests
  (edgespec/runtime/conversation.py). `LlamaTreeVerifier` is a Conversation over a LocalVerifier.

Invariant of the KV cache: it holds every committed token except the last one (the next tree's root).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from edgespec.common.acceptance import (
    Acceptance,
    VerifyResult,
    accept_logits,
    check_context,
    check_tree,
)
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.runtime.conversation import Conversation
from edgespec.runtime.llama import ContextConfig, LlamaModel, TreeContext


class LocalVerifier:
    """The target model in this process, verifying against the context its caller passes."""

    # Called after each verified tree with (context, tree, acceptance, per-node logits) while the
    # logits are at hand: the verifier's opt-in step log (verifier/steplog.py). None: no cost.
    on_verified: Callable[[Sequence[int], TokenTree, Acceptance, np.ndarray], None] | None = None

    def __init__(self, model: LlamaModel, config: ContextConfig = ContextConfig(), max_depth: int = 32) -> None:
        self.model = model
        self.ctx = TreeContext(model, config)
        self.max_nodes = min(config.max_tree_nodes, self.ctx.n_seq_max - 1)
        self.max_depth = max_depth

    def close(self) -> None:
        self.ctx.close()

    def sync(self, context: Sequence[int]) -> None:
        """Process a new context now (prompt prefill), so the first step does not pay for it."""
        self._hold(context)

    def verify(self, context: Sequence[int], tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        """Check the whole tree (rooted at context[-1]) in one decode: the accepted path plus one
        target token. The KV cache then holds context + those tokens, minus the new last one."""
        if sampling.constraint:   # a grammar from the wire is compiled over this model's token list
            sampling.constraint.bind(self.model.grammar_vocab)
        check_tree(tree, context, self.model.n_vocab, self.max_nodes, self.max_depth, sampling)
        self._hold(context)
        started = time.perf_counter()
        logits, leaf_seq = self.ctx.decode_tree(tree.tokens.tolist(), tree.parents.tolist())
        acc, margins = accept_logits(tree, sampling, step, logits.argmax(axis=1), logits.__getitem__, context)
        if self.on_verified is not None:
            self.on_verified(context, tree, acc, logits)
        accepted_tokens = tree.tokens[acc.path].tolist()
        self.ctx.adopt_branch(leaf_seq[acc.path[-1] if acc.path else 0], [int(tree.tokens[0]), *accepted_tokens])
        return VerifyResult(path=acc.path, tokens=[*accepted_tokens, acc.next_token], margins=margins,
                            compute_s=time.perf_counter() - started)

    def _hold(self, context: Sequence[int]) -> None:
        """Make the KV cache hold context[:-1] (a no-op when it already does)."""
        held = self.ctx.tokens
        if len(held) == len(context) - 1 and held == list(context[:-1]):
            return
        check_context(context, self.model.n_vocab, self.ctx.n_ctx, self.max_depth)
        self.ctx.sync(context[:-1]) if len(context) > 1 else self.ctx.truncate(0)


class LlamaTreeVerifier(Conversation):
    """The target model's view of one conversation that it owns (the verifier service, tests)."""

    def __init__(self, model: LlamaModel, config: ContextConfig = ContextConfig(), max_depth: int = 32) -> None:
        super().__init__(LocalVerifier(model, config, max_depth=max_depth))
        self.model = model
