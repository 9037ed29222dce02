"""Helpers (not tests) for the protocol fuzzing, abuse and memory tests: an oracle that says which
answer the verifier owes a message, a witness session whose every answer must equal a reference
bit for bit, and the process counters (threads, file descriptors) of a server process."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import grpc

from edgespec.common import wire
from edgespec.common.acceptance import check_context
from edgespec.common.errors import EdgespecError, InvalidTreeError
from edgespec.common.sampling import SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.v1 import edgespec_pb2 as pb
from grpc_helpers import RawStream, ServerProcess

GREEDY = SamplingParams()


def verify_outcome(msg: pb.Verify, committed: list[int], info: pb.InfoReply) -> str:
    """What the server must answer this Verify after `committed`: "verified", "resync" or a status name.

    The same checks in the same order as the server (decode, sampling, structure, depth, then in
    the compute worker: context length, root, context room)."""
    try:
        tree = wire.tree_from_proto(msg.tree, max_nodes=info.max_nodes, max_k=info.max_k)
        sampling = wire.sampling_from_proto(msg.sampling)
        tree.validate(info.vocab_size, max_nodes=info.max_nodes, require_q=sampling.needs_q)
        depth = int(tree.depths.max())
        if depth > info.max_depth:
            raise wire.TreeTooLargeError("too deep")
        if msg.context_length and msg.context_length != len(committed):
            return "resync"
        if tree.tokens[0] != committed[-1]:
            raise InvalidTreeError("root")
    except EdgespecError as exc:
        return wire.status_of(exc).name
    return "verified"


def sync_outcome(data: bytes, info: pb.InfoReply) -> str:
    """What the server must answer a Sync carrying these bytes: "synced" or a status name."""
    try:
        tokens = wire.tokens_from_bytes(data, "sync.tokens")
        if not tokens:
            raise wire.WireFormatError("empty")
        if len(tokens) > info.n_ctx:
            return "RESOURCE_EXHAUSTED"
        check_context(tokens, info.vocab_size, info.n_ctx, info.max_depth)
    except EdgespecError as exc:
        return wire.status_of(exc).name
    return "synced"


def check_verified(reply: pb.Verified, msg: pb.Verify, info: pb.InfoReply) -> list[int]:
    """A Verified answer is well formed for its tree; returns the committed tokens."""
    tree = wire.tree_from_proto(msg.tree)
    path, tokens = wire.tokens_from_bytes(reply.path), wire.tokens_from_bytes(reply.tokens)
    assert reply.step == msg.step
    assert len(tokens) == len(path) + 1 and len(reply.margins) == len(tokens), reply
    parent = 0
    for node in path:                      # a chain from the root, in the tree
        assert 0 < node < len(tree) and tree.parents[node] == parent, (path, tree.parents)
        parent = node
    assert tokens[:-1] == tree.tokens[path].tolist()
    assert 0 <= tokens[-1] < info.vocab_size
    return tokens


def answer(reply) -> str:  # noqa: ANN001
    """"opened"/"synced"/"verified"/"resync", a status code name, or "end"."""
    if isinstance(reply, grpc.RpcError):
        return reply.code().name
    if reply == "end":
        return "end"
    kind = reply.WhichOneof("kind")
    return "resync" if kind == "resync_required" else kind


def witness_tree(context: list[int]) -> TokenTree:
    """A small fixed-shape tree that depends on the context only (so equal runs send equal trees)."""
    r = context[-1]
    a, b, c = (r * 7 + 11) % 900 + 10, (r * 13 + 5) % 900 + 10, (r * 3 + 1) % 900 + 10
    if len({a, b, c}) < 3:
        b, c = a + 1, a + 2
    return TokenTree(tokens=[r, a, b, c, a], parents=[-1, 0, 0, 1, 3])


@dataclass
class Witness:
    """A well-behaved session stepping a fixed sequence of trees; each answer must equal the
    reference run's bit for bit (tokens, path, margins as float32), whatever the others send."""

    server: ServerProcess
    fingerprint: str
    prompt: list[int]
    steps: int = 24
    reference: list[bytes] = field(default_factory=list)
    done: int = 0            # steps compared against the reference so far

    def __post_init__(self) -> None:
        self._ch = self._s = None
        self._i = 0

    def _start(self) -> None:
        self._ch = self.server.channel()
        self._s = RawStream(self._ch)
        assert answer(self._s.ask(wire.open_message("test", self.fingerprint))) == "opened"
        reply = self._s.ask(wire.sync_message(self.prompt))
        assert answer(reply) == "synced", reply
        self._context = list(self.prompt)
        self._i = 0

    def record(self) -> None:
        """The reference run (on a quiet server)."""
        self._start()
        for _ in range(self.steps):
            self.reference.append(self._step())
        self.close()

    def _step(self) -> bytes:
        reply = self._s.ask(wire.verify_message(witness_tree(self._context), GREEDY, self._i,
                                                context_length=len(self._context)), timeout_s=120)
        assert answer(reply) == "verified", f"the witness session was disturbed: {reply}"
        self._context += wire.tokens_from_bytes(reply.verified.tokens)
        self._i += 1
        v = reply.verified
        return pb.Verified(step=v.step, path=v.path, tokens=v.tokens, margins=v.margins).SerializeToString()

    def step(self) -> None:
        """One step, compared with the reference; a new stream after `steps` steps."""
        if self._s is None or self._i >= self.steps:
            self.close()
            self._start()
        i = self._i
        got = self._step()
        assert got == self.reference[i], (f"witness step {i} differs from the reference run:\n"
                                          f"{pb.Verified.FromString(got)}\nvs\n{pb.Verified.FromString(self.reference[i])}")
        self.done += 1

    def close(self) -> None:
        if self._s is not None:
            self._s.close()
            self._ch.close()
        self._s = self._ch = None


def proc_counters(pid: int) -> dict[str, int]:
    """Threads, open file descriptors and resident memory (kB) of a process."""
    threads = rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"threads": threads, "fds": len(os.listdir(f"/proc/{pid}/fd")), "rss_kb": rss}


def settled(srv: ServerProcess, open_streams: int, live_sessions: int | None = None, timeout_s: float = 30) -> pb.InfoReply:
    """Wait until the server reports that many open streams (and live KV slots); the last Info."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = srv.info()
        ok = info.open_streams == open_streams and (live_sessions is None or info.live_sessions == live_sessions)
        if ok or time.monotonic() > deadline:
            return info
        time.sleep(0.05)
