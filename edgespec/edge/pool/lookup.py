"""Model-free drafting by lookup (prompt lookup, SuffixDecoding): continue the text as it went on
the last times its recent suffix occurred.

`SuffixIndex` maps every n-gram (n = 1..max_n) of its documents to where it ended, and is
incremental: appending a token adds max_n entries, dropping the last tokens removes theirs. Its
documents are the conversation so far (document 0: prompt, history, tool outputs, the answer being
written) and a local corpus (earlier conversations, files, anything `add_document` is given).

`LookupExpert.propose` finds the longest suffix of the committed context (at least min_n tokens)
that occurred before, takes what followed its most recent occurrences, and merges them into a tree
whose node scores are the fraction of occurrences that continued that way, times the expert's
calibrated acceptance per node (experts.ExpertStats): frequent, long matches score high.
"""
from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from edgespec.common.sampling import SamplingParams
from edgespec.common.tokens import common_prefix_length
from edgespec.common.tree import TokenTree
from edgespec.edge.drafting import Draft, TreeShape
from edgespec.edge.pool.experts import ExpertStats, Stop, root_only

Position = tuple[int, int]   # (document id, index just after the n-gram)
CONVERSATION = 0


class SuffixIndex:
    """n-gram -> positions over token documents; document 0 can grow and shrink at its end."""

    def __init__(self, max_n: int = 8, max_corpus_tokens: int = 1_000_000) -> None:
        self.max_n = max_n
        self.max_corpus_tokens = max_corpus_tokens
        self.docs: dict[int, list[int]] = {CONVERSATION: []}
        self._table: dict[tuple[int, ...], list[Position]] = defaultdict(list)
        self._next_doc = 1

    # -- building -----------------------------------------------------------------------------
    def add_document(self, tokens: list[int]) -> int:
        """Index a corpus document (frozen); the oldest are forgotten past max_corpus_tokens."""
        doc = self._next_doc
        self._next_doc += 1
        self.docs[doc] = []
        self._append(doc, tokens)
        corpus = sum(len(t) for d, t in self.docs.items() if d != CONVERSATION)
        if corpus > self.max_corpus_tokens:
            for old in sorted(d for d in self.docs if d != CONVERSATION):
                if corpus <= self.max_corpus_tokens or old == doc:
                    break
                corpus -= len(self.docs.pop(old))
            self._rebuild()
        return doc

    def sync_conversation(self, tokens: list[int]) -> None:
        """Make document 0 exactly `tokens`: append what is new, drop what no longer holds (a
        wrong guess drafted ahead, an edited history). A new conversation (little in common with
        the old one) moves the old one into the corpus, where it stays searchable."""
        doc = self.docs[CONVERSATION]
        if tokens[: len(doc)] != doc:
            keep = common_prefix_length(doc, tokens)
            if keep < len(doc) // 2:
                old = list(doc)
                self._truncate(0)
                self.add_document(old)
            else:
                self._truncate(keep)
        self._append(CONVERSATION, tokens[len(self.docs[CONVERSATION]):])

    def _append(self, doc: int, tokens: list[int]) -> None:
        seq = self.docs[doc]
        for token in tokens:
            seq.append(int(token))
            end = len(seq)
            for n in range(1, min(self.max_n, end) + 1):
                self._table[tuple(seq[end - n:end])].append((doc, end))

    def _truncate(self, keep: int) -> None:
        seq = self.docs[CONVERSATION]
        for end in range(len(seq), keep, -1):
            for n in range(1, min(self.max_n, end) + 1):
                key = tuple(seq[end - n:end])
                entries = self._table[key]
                for i in range(len(entries) - 1, -1, -1):  # it is among the latest entries
                    if entries[i] == (CONVERSATION, end):
                        del entries[i]
                        break
                if not entries:
                    del self._table[key]
        del seq[keep:]

    def _rebuild(self) -> None:
        docs = self.docs
        self.docs, self._table = {d: [] for d in docs}, defaultdict(list)
        for d in sorted(docs):
            self._append(d, docs[d])

    # -- querying -----------------------------------------------------------------------------
    def continuations(self, context: list[int], min_n: int, depth: int, max_matches: int) -> tuple[int, list[list[int]]]:
        """(n, continuations): the longest n >= min_n such that context's last n tokens occurred
        before with something after them, and up to `max_matches` of those continuations (most
        recent first, each up to `depth` tokens)."""
        for n in range(min(self.max_n, len(context)), min_n - 1, -1):
            entries = self._table.get(tuple(context[-n:]))
            if not entries:
                continue
            found = []
            for doc, end in reversed(entries):
                follow = self.docs[doc][end:end + depth]   # empty for the suffix itself
                if follow:
                    found.append(follow)
                    if len(found) == max_matches:
                        break
            if found:
                return n, found
        return 0, []

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.docs.values())

    def nbytes(self) -> int:
        """Rough resident size: ~100 bytes per table entry (tuple key share, list slot, position)."""
        return 100 * self.max_n * self.n_tokens


class LookupExpert:
    """Drafts what followed the longest earlier occurrence(s) of the context's suffix."""

    kind = "lookup"

    def __init__(self, name: str = "lookup", max_n: int = 8, min_n: int = 2, max_matches: int = 16,
                 index: SuffixIndex | None = None) -> None:
        self.name = name
        self.index = index if index is not None else SuffixIndex(max_n=max_n)
        self.min_n, self.max_matches = min_n, max_matches
        self.stats = ExpertStats()   # the pool counts; the scores read the calibrated acceptance

    def add_document(self, tokens: list[int]) -> int:
        """Add text the answer may quote (a file, a tool's output, an earlier answer)."""
        return self.index.add_document(list(tokens))

    def propose(self, committed: list[int], shape: TreeShape, sampling: SamplingParams, step: int,
                stop: Stop = None) -> Draft:
        started = time.perf_counter()
        self.index.sync_conversation(committed)
        n, follows = self.index.continuations(committed, self.min_n, shape.max_depth, self.max_matches)
        if not follows:
            draft = root_only(committed)
        else:
            draft = self._tree(committed[-1], follows, shape.budget)
        draft.seconds = time.perf_counter() - started
        return draft

    def _tree(self, root: int, follows: list[list[int]], budget: int) -> Draft:
        """Trie of the continuations; a node's score = fraction of continuations through it times
        the calibrated per-node acceptance to the power of its depth."""
        per_node = self.stats.acceptance
        tokens, parents, counts, depths = [root], [-1], [len(follows)], [0]
        index: dict[tuple[int, int], int] = {}
        for follow in follows:
            node = 0
            for token in follow:
                child = index.get((node, token))
                if child is None:
                    child = index[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                    counts.append(0)
                    depths.append(depths[node] + 1)
                counts[child] += 1
                node = child
        scores = np.array(counts, np.float64) / len(follows) * per_node ** np.array(depths, np.float64)
        tree = TokenTree(tokens=np.array(tokens, np.int32), parents=np.array(parents, np.int32))
        return Draft(tree, [0] + [-1] * (len(tokens) - 1), scores).pruned(budget)

    def accept(self, draft: Draft, path: list[int]) -> None:
        pass   # nothing to keep in step: the next propose() syncs the index to the context

    def predict_next(self, committed: list[int]) -> int | None:
        self.index.sync_conversation(committed)
        _, follows = self.index.continuations(committed, self.min_n, 1, self.max_matches)
        if not follows:
            return None
        values, counts = np.unique([f[0] for f in follows], return_counts=True)
        return int(values[np.argmax(counts)])

    def nbytes(self) -> int:
        return self.index.nbytes()

    def close(self) -> None:
        pass
