"""Step log: what the target said at the positions that decided each verified step (opt-in,
`edgespec verifier serve --log-dir DIR`), the training data of tools/distill.py.

Per verified step it keeps the committed context, the accepted drafted tokens, the target's own
next token, and at every decided position (the root and each accepted node: the rows whose
logits chose a committed token) the target's top-k token ids and log-probabilities (log-softmax
over the whole vocabulary at temperature 1, so the mass outside the top-k is known too). A draft
trained to match these distributions (KL(target || draft)) accepts more exactly where the
verifier had to decide.

Format: append-only shards `steps-<start>-<pid>-<n>.npz` in DIR, each written whole to a temp file
and renamed (a reader never sees half a shard; a crash loses at most the unflushed steps), plus
`meta.json` (model, tokenizer fingerprint, vocabulary, k). Contexts are stored compactly: within a
shard a session's step stores only the tokens beyond the prefix it shares with that session's
previous step (the first step of a session in each shard stores its whole context), so a shard
stays readable on its own and a long conversation does not cost O(n^2).
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from edgespec.common.acceptance import Acceptance
from edgespec.common.tokens import common_prefix_length
from edgespec.common.tree import TokenTree

FORMAT_VERSION = 1
Observer = Callable[[Sequence[int], TokenTree, Acceptance, np.ndarray], None]


@dataclass(frozen=True)
class LoggedStep:
    """One verified step. Row j of topk_* is the target's distribution of the token that follows
    context + path[:j] (j = 0: the root's row, which decided path[0] or the next token)."""

    session: str               # "<writer>/<n>": unique across restarts and writers
    context: np.ndarray        # int32 committed tokens before the step (last one = the tree's root)
    path: np.ndarray           # int32 accepted drafted tokens
    next_token: int            # the target's own token after the path
    tree_nodes: int            # size of the tree that was verified (root included)
    topk_ids: np.ndarray       # int32 (len(path) + 1, k)
    topk_logprobs: np.ndarray  # float32 (len(path) + 1, k), best first


def top_logprobs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (ids, log-probabilities) per row of `logits`, best first."""
    logits = np.asarray(logits, dtype=np.float32)
    k = min(k, logits.shape[-1])
    ids = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logits, ids, axis=-1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    ids, vals = np.take_along_axis(ids, order, axis=-1), np.take_along_axis(vals, order, axis=-1)
    m = logits.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    return ids.astype(np.int32), (vals - lse).astype(np.float32)


class StepLog:
    """Writer; thread-safe. `session()` gives each backend session its observer."""

    def __init__(self, directory: str | os.PathLike, *, top_k: int = 32, shard_steps: int = 256,
                 meta: dict | None = None) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.top_k, self.shard_steps = top_k, shard_steps
        self._lock = threading.Lock()
        self._sessions = count(1)
        self._prefix = f"steps-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        self._shards = count()
        self.steps_written = 0
        self._reset()
        meta_path = self.dir / "meta.json"
        meta = {"format": FORMAT_VERSION, "top_k": top_k, **(meta or {})}
        if meta_path.exists():
            old = json.loads(meta_path.read_text(encoding="utf-8"))
            clash = {key: (old.get(key), value) for key, value in meta.items()
                     if key in ("format", "model_id", "tokenizer_hash", "vocab_size") and old.get(key) != value}
            if clash:
                raise ValueError(f"{self.dir} holds a step log of another model or format: {clash}")
        else:
            _atomic_write(meta_path, json.dumps(meta, indent=2).encode())

    def _reset(self) -> None:
        self._rows: list[dict] = []
        self._last: dict[int, list[int]] = {}   # session -> context of its previous step in this shard

    def session(self) -> Observer:
        """An observer for one backend session (LocalVerifier.on_verified)."""
        key = next(self._sessions)
        return lambda context, tree, acc, logits: self.record(key, context, tree, acc, logits)

    def record(self, session: int, context: Sequence[int], tree: TokenTree, acc: Acceptance,
               logits: np.ndarray) -> None:
        decided = [0, *acc.path]
        ids, logprobs = top_logprobs(np.asarray(logits)[decided], self.top_k)
        context = [int(t) for t in context]
        with self._lock:
            prev = self._last.get(session)
            base = common_prefix_length(prev, context) if prev is not None else 0
            self._last[session] = context
            self._rows.append({"session": session, "base": base, "new": context[base:],
                               "path": tree.tokens[acc.path].astype(np.int32), "next": int(acc.next_token),
                               "nodes": len(tree), "ids": ids, "logprobs": logprobs})
            if len(self._rows) >= self.shard_steps:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        rows = self._rows
        if not rows:
            return
        self._reset()
        path = self.dir / f"{self._prefix}-{next(self._shards):06d}.npz"
        arrays = {
            "version": np.array(FORMAT_VERSION),
            "session": np.array([r["session"] for r in rows], np.int64),
            "ctx_base": np.array([r["base"] for r in rows], np.int64),
            "ctx_offsets": np.cumsum([0, *(len(r["new"]) for r in rows)]).astype(np.int64),
            "ctx_new": np.array([t for r in rows for t in r["new"]], np.int32),
            "path_offsets": np.cumsum([0, *(len(r["path"]) for r in rows)]).astype(np.int64),
            "path": np.concatenate([r["path"] for r in rows]).astype(np.int32),
            "next_token": np.array([r["next"] for r in rows], np.int32),
            "tree_nodes": np.array([r["nodes"] for r in rows], np.int32),
            "topk_ids": np.concatenate([r["ids"] for r in rows]),
            "topk_logprobs": np.concatenate([r["logprobs"] for r in rows]),
        }
        fd, tmp = tempfile.mkstemp(prefix=".steps-", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez_compressed(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.steps_written += len(rows)

    def close(self) -> None:
        self.flush()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix="." + path.name, dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def read_meta(directory: str | os.PathLike) -> dict:
    return json.loads((Path(directory) / "meta.json").read_text(encoding="utf-8"))


def read_steps(directory: str | os.PathLike) -> Iterator[LoggedStep]:
    """Every logged step, shard by shard in the order they were written."""
    for shard in sorted(Path(directory).glob("steps-*.npz")):
        with np.load(shard, allow_pickle=False) as z:
            if int(z["version"]) != FORMAT_VERSION:
                raise ValueError(f"{shard}: step-log format {int(z['version'])}, expected {FORMAT_VERSION}")
            session, base, co, cn = z["session"], z["ctx_base"], z["ctx_offsets"], z["ctx_new"]
            po, paths, nxt, nodes, ids, lps = (z["path_offsets"], z["path"], z["next_token"], z["tree_nodes"],
                                               z["topk_ids"], z["topk_logprobs"])
        writer = shard.name.rsplit("-", 1)[0]
        last: dict[int, np.ndarray] = {}
        row = 0
        for i in range(session.size):
            s = int(session[i])
            context = np.concatenate([last.get(s, np.zeros(0, np.int32))[: base[i]], cn[co[i]:co[i + 1]]])
            last[s] = context
            path = paths[po[i]:po[i + 1]]
            n_rows = path.size + 1
            yield LoggedStep(f"{writer}/{s}", context, path, int(nxt[i]), int(nodes[i]), ids[row:row + n_rows], lps[row:row + n_rows])
            row += n_rows
