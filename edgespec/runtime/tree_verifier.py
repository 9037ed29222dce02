"""Verify a draft tree against the target with llama.cpp: one decode, lossless acceptance.

Serves the edge's local fallback and the verifier service's CPU backend alike.
Invariant: the KV cache holds every committed token except the last one (the next tree's root).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from edgespec.common.acceptance import accept_greedy, accept_sampled
from edgespec.common.errors import ContextOverflowError, InvalidTreeError
from edgespec.common.sampling import SamplingParams, probabilities, top2_margin
from edgespec.common.tree import TokenTree
from edgespec.runtime.llama import ContextConfig, LlamaModel, TreeContext


@dataclass(frozen=True)
class VerifyResult:
    path: list[int]              # accepted drafted nodes (root excluded)
    tokens: list[int]            # what is committed: accepted tokens + the target's next token
    margins: list[float] = field(default_factory=list)  # target top-2 logit gap per committed token
    compute_s: float = 0.0       # the target's decode + acceptance time
    queue_s: float = 0.0         # time the request waited at a (remote) verifier
    network_s: float = 0.0       # round-trip wall time minus queue and compute (0 in-process)
    bytes_up: int = 0            # serialized request size (0 in-process)
    bytes_down: int = 0


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
        if not committed:
            raise InvalidTreeError("the committed context is empty")
        bad = [t for t in committed if not 0 <= t < self.model.n_vocab]
        if bad:
            raise InvalidTreeError(f"context token id {bad[0]} outside the vocabulary [0, {self.model.n_vocab})")
        if len(committed) + self.max_depth + 1 > self.ctx.n_ctx:
            raise ContextOverflowError(f"context of {len(committed)} tokens does not fit n_ctx={self.ctx.n_ctx}")
        self.ctx.sync(committed[:-1]) if len(committed) > 1 else self.ctx.truncate(0)
        self.committed = list(committed)

    def verify(self, tree: TokenTree, sampling: SamplingParams, step: int) -> VerifyResult:
        """Check the whole tree in one decode and commit the accepted path plus one target token."""
        tree.validate(self.model.n_vocab, max_nodes=self.max_nodes, max_depth=self.max_depth,
                      require_q=not sampling.greedy)
        if not self.committed or tree.tokens[0] != self.committed[-1]:
            raise InvalidTreeError(f"tree root {int(tree.tokens[0])} is not the last committed token")
        started = time.perf_counter()
        logits, leaf_seq = self.ctx.decode_tree(tree.tokens.tolist(), tree.parents.tolist())
        if sampling.greedy:
            acc = accept_greedy(tree, logits.argmax(axis=1))
        else:
            acc = accept_sampled(tree, lambda node: probabilities(logits[node], sampling), sampling.seed, step)
        decided_at = [0, *acc.path]
        accepted_tokens = tree.tokens[acc.path].tolist()
        self.ctx.adopt_branch(leaf_seq[decided_at[-1]], [int(tree.tokens[0]), *accepted_tokens])
        committed = [*accepted_tokens, acc.next_token]
        self.committed.extend(committed)
        return VerifyResult(path=acc.path, tokens=committed,
                            margins=[top2_margin(logits[n]) for n in decided_at],
                            compute_s=time.perf_counter() - started)
