"""Test-only recorder of the llama.cpp verifier's logits, per tree node, as the verifier had them.

Why: a greedy divergence of speculative output from target-only output is acceptable only if it is
explained by numerics (tests/lossless.py). That needs the logits the verifier really used for the
deciding node, in the batch shape and KV-cache layout of that step, which only the verifying
process has. So `install()` wraps `TreeContext.decode_tree` (the one call that verifies a tree)
and keeps, for every node, the top-TOP_K logits of its row keyed by the node's full context
(committed tokens + path). Production code is untouched; nothing is recorded unless a test process
installed the wrapper.

Verifier child processes (`edgespec verifier serve`, the bundled verifier) record too:
`enable_children()` puts tests/logit_site on PYTHONPATH, whose sitecustomize installs the wrapper
when `edgespec.runtime.llama` is imported, and each tree is written to a file in ENV_DIR.
"""
from __future__ import annotations

import atexit
import hashlib
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ENV_DIR = "EDGESPEC_TEST_LOGITS_DIR"
TOP_K = 64            # logits kept per node row: a near-tie's two tokens are always among them
MAX_IN_PROCESS = 100_000  # node rows kept in this process (oldest dropped first), ~60 MB at most
SITE_DIR = Path(__file__).resolve().parent / "logit_site"


@dataclass(frozen=True)
class Row:
    """The top TOP_K logits of one node's row, best first."""

    ids: np.ndarray    # int32 token ids
    vals: np.ndarray   # float32 logits

    @staticmethod
    def of(logits: np.ndarray) -> Row:
        return _top_rows(logits[None, :])[0]

    @property
    def argmax(self) -> int:
        return int(self.ids[0])

    def value(self, token: int) -> float | None:
        """The logit of `token`, or None if it is not among the row's top TOP_K."""
        hit = np.flatnonzero(self.ids == token)
        return float(self.vals[hit[0]]) if hit.size else None


@dataclass(frozen=True)
class TreeRecord:
    """One verified tree: its committed context, nodes, and each node's top logits."""

    t_ns: int            # CLOCK_MONOTONIC, comparable across processes of this machine
    pid: int
    model: str           # model file name
    base_len: int        # committed tokens before the root (sequence 0 of the KV cache) ...
    base_hash: bytes     # ... and their digest (base_digest), not the tokens: records stay small
    tokens: np.ndarray
    parents: np.ndarray
    top_ids: np.ndarray  # (nodes, TOP_K)
    top_vals: np.ndarray

    def node_for(self, context: Sequence[int], prefix_digest: Callable[[int], bytes] | None = None) -> int | None:
        """The node whose row predicts the token after `context` (base + root + path), if any;
        prefix_digest(n): base_digest(context[:n]), cached by the caller."""
        nb = self.base_len
        if not nb < len(context) <= nb + len(self.tokens):
            return None
        if (prefix_digest(nb) if prefix_digest else base_digest(context[:nb])) != self.base_hash:
            return None
        node = 0
        if self.tokens[0] != context[nb]:
            return None
        for token in context[nb + 1:]:
            children = np.flatnonzero((self.parents == node) & (self.tokens == token))
            if not children.size:
                return None
            node = int(children[0])
        return node

    def row(self, node: int) -> Row:
        return Row(self.top_ids[node], self.top_vals[node])

    def describe(self, node: int) -> str:
        depth, n = 0, node
        while n > 0:
            n, depth = int(self.parents[n]), depth + 1
        where = "this process" if self.pid == os.getpid() else f"verifier process {self.pid}"
        return f"{where}, tree of {len(self.tokens)} nodes, node {node} at depth {depth}"


_lock = threading.Lock()
_records: list[TreeRecord] = []
_n_rows = 0
_local = threading.local()
_seq = itertools.count()
_loaded: dict[str, TreeRecord] = {}
_out_dir: str | None = None   # set in verifier children: records go to files there


def base_digest(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()


def _top_rows(logits: np.ndarray) -> list[Row]:
    k = min(TOP_K, logits.shape[1])
    part = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(logits, part, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    ids = np.take_along_axis(part, order, axis=1).astype(np.int32)
    vals = np.take_along_axis(vals, order, axis=1).astype(np.float32)
    return [Row(ids[i], vals[i]) for i in range(len(ids))]


def _store(ctx, base: list[int], tokens: Sequence[int], parents: Sequence[int], logits: np.ndarray) -> None:
    global _n_rows
    rows = _top_rows(logits)
    rec = TreeRecord(time.monotonic_ns(), os.getpid(), Path(str(ctx.model.path)).name,
                     len(base), base_digest(base), np.asarray(tokens, np.int32), np.asarray(parents, np.int32),
                     np.stack([r.ids for r in rows]), np.stack([r.vals for r in rows]))
    captured = getattr(_local, "capture", None)
    if captured is not None:        # a reference computation: kept apart from the verifier's records
        captured.append(rec)
        return
    if _out_dir is not None:   # a verifier child: hand the record to the test process
        path = Path(_out_dir) / f"{rec.pid}-{next(_seq):07d}.npz"
        np.savez(path.with_suffix(".tmp.npz"), t_ns=rec.t_ns, pid=rec.pid, model=rec.model, base_len=rec.base_len,
                 base_hash=np.frombuffer(rec.base_hash, np.uint8), tokens=rec.tokens, parents=rec.parents, top_ids=rec.top_ids, top_vals=rec.top_vals)
        os.replace(path.with_suffix(".tmp.npz"), path)
        return
    with _lock:
        _records.append(rec)
        _n_rows += len(rec.tokens)
        while _n_rows > MAX_IN_PROCESS and len(_records) > 1:
            _n_rows -= len(_records.pop(0).tokens)


def install(out_dir: str | None = None) -> None:
    """Wrap TreeContext.decode_tree (idempotent); the wrapped call returns exactly what it did.
    `out_dir`: write each record there (a verifier child) instead of keeping it in memory."""
    global _out_dir
    from edgespec.runtime.llama import TreeContext

    _out_dir = out_dir

    original = TreeContext.decode_tree
    if getattr(original, "_records_logits", False):
        return

    def decode_tree(self, tokens, parents):
        with getattr(self, "_lock", None) or nullcontext():   # the context's own (reentrant) lock, if any
            base = list(self.tokens)
            logits, leaf_seq = original(self, tokens, parents)
        _store(self, base, tokens, parents, logits)
        return logits, leaf_seq

    decode_tree._records_logits = True  # type: ignore[attr-defined]
    TreeContext.decode_tree = decode_tree


def enable_children() -> None:
    """Make verifier child processes started from now on record into a fresh directory."""
    if os.environ.get(ENV_DIR) and str(SITE_DIR) in os.environ.get("PYTHONPATH", ""):
        return
    out_dir = tempfile.mkdtemp(prefix="edgespec-logits-")
    atexit.register(shutil.rmtree, out_dir, True)
    os.environ[ENV_DIR] = out_dir
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), os.environ.get("PYTHONPATH")) if p)


@contextmanager
def capture() -> Iterator[list[TreeRecord]]:
    """Trees decoded by this thread inside the block go to the returned list, not to the records
    that explain a verifier's choices (reference computations must not be mistaken for them)."""
    outer = getattr(_local, "capture", None)
    _local.capture = captured = []
    try:
        yield captured
    finally:
        _local.capture = outer


def _child_records() -> list[TreeRecord]:
    out_dir = os.environ.get(ENV_DIR)
    if not out_dir or not os.path.isdir(out_dir):
        return []
    for name in os.listdir(out_dir):
        if name.endswith(".npz") and not name.endswith(".tmp.npz") and name not in _loaded:
            with np.load(os.path.join(out_dir, name)) as z:
                _loaded[name] = TreeRecord(int(z["t_ns"]), int(z["pid"]), str(z["model"]), int(z["base_len"]),
                                           z["base_hash"].tobytes(), z["tokens"], z["parents"], z["top_ids"],
                                           z["top_vals"])
    return list(_loaded.values())


def latest(context: Sequence[int], model: str | None = None, *, here: bool | None = None,
           records: Sequence[TreeRecord] | None = None) -> tuple[TreeRecord, int] | None:
    """The most recent recorded node whose context is `context`, as (record, node). Searched:
    `records` if given (e.g. a capture()), else this process (here=True), verifier children
    (here=False) or both (None)."""
    if records is None:
        with _lock:
            records = list(_records) if here is not False else []
        if here is not True:
            records += _child_records()
    context = np.asarray(context, np.int32)
    digests: dict[int, bytes] = {}

    def prefix_digest(n: int) -> bytes:
        if n not in digests:
            digests[n] = base_digest(context[:n])
        return digests[n]

    for rec in sorted(records, key=lambda r: r.t_ns, reverse=True):
        if model is not None and rec.model != model:
            continue
        node = rec.node_for(context, prefix_digest)
        if node is not None:
            return rec, node
    return None
