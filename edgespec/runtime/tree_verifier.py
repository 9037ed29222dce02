"""Verify a draft tree against the target with llama.cpp: one decode, lossless acceptance.

Serves the edge's local fallback and the verifier service's CPU backend alike.
Invariant: the KV cache holds every committed token except the last one (the next tree's root).
"""
from __future__ import annotations

import time

from edgespec.common.acceptance import (
    VerifyResult,
    accept_logits,
    check_context,
    check_tree,
)
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.runtime.llama import ContextConfig, LlamaModel, TreeContext


class LlamaTreeVerifier:
    """The target model's view of one conversation."""

    def __init__(self, model: LlamaModel, config: ContextConfig = ContextConfig(), max_depth: int = 32) -> None:
        self.model = model
        self.ctx = TreeContext(model, config)
        self.max_nodes = min(config.max_tree_nodes, self.ctx.n_seq_max - 1)
        self.max_depth = max_depth
        self.committed: list[int] = []

    def close(self) -> None:
        self.ctx.close()

    def sync(self, committed: list[int]) -> None:
        """Adopt the caller's committed context (new conversation, new turn, or resync)."""
        check_context(committed, self.model.n_vocab, self.ctx.n_ctx, self.max_depth)
        self.ctx.sync(committed[:-1]) if len(committed) > 1 else self.ctx.truncate(0)
        self.committed = list(committed)

    def verify(self, tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        """Check the whole tree in one decode and commit the accepted path plus one target token."""
        check_tree(tree, self.committed, self.model.n_vocab, self.max_nodes, self.max_depth, sampling)
        started = time.perf_counter()
        logits, leaf_seq = self.ctx.decode_tree(tree.tokens.tolist(), tree.parents.tolist())
        acc, margins = accept_logits(tree, sampling, step, logits.argmax(axis=1), logits.__getitem__)
        accepted_tokens = tree.tokens[acc.path].tolist()
        self.ctx.adopt_branch(leaf_seq[acc.path[-1] if acc.path else 0], [int(tree.tokens[0]), *accepted_tokens])
        committed = [*accepted_tokens, acc.next_token]
        self.committed.extend(committed)
        return VerifyResult(path=acc.path, tokens=committed, margins=margins, compute_s=time.perf_counter() - started)
