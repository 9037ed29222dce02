"""The one place that converts edgespec values to and from the v1 protocol messages.

Both the edge (edgespec.edge.link) and the verifier service (edgespec.verifier) use this module;
they never import each other, they meet here and on the wire. The message definitions live in
proto/edgespec/v1/edgespec.proto (generated into edgespec.v1 at install time).

Token ids and tree arrays travel as packed little-endian bytes (int32 tokens/parents/q tokens,
uint16 q weights). Decoding checks lengths and shapes and raises `WireFormatError` (an
InvalidRequestError, so INVALID_ARGUMENT on the wire) with a message saying which field is wrong;
structural tree rules (parents precede children, token ids in the vocabulary, ...) are checked by
`TokenTree.validate` where the vocabulary is known.

Errors: `STATUS_OF` maps every edgespec.common.errors class to the gRPC status code the server
answers with; the server puts the class name into the trailing metadata `edgespec-error`, and
`error_from_status` turns a status (plus that name) back into the same exception class on the edge.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import grpc
import numpy as np

from edgespec.common import errors
from edgespec.common.constraints import Grammar, TokenConstraint
from edgespec.common.errors import (
    ContextOverflowError,
    EdgespecError,
    InvalidRequestError,
    InvalidTreeError,
    ModelError,
    TokenizerMismatchError,
    VerifierUnavailableError,
)
from edgespec.common.sampling import AcceptanceRule, SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.v1 import edgespec_pb2 as pb

PROTOCOL_VERSION = 1
SERVICE_NAME = "edgespec.v1.Verifier"  # full gRPC service name (reflection, health)
ERROR_CLASS_KEY = "edgespec-error"     # trailing metadata: the edgespec error class to raise
AUTH_KEY = "authorization"             # request metadata: "Bearer <token>"

_I32 = np.dtype("<i4")
_U16 = np.dtype("<u2")


class WireFormatError(InvalidRequestError):
    """A message's bytes do not decode (wrong length, shapes that do not match, ...)."""


class ModelNotServedError(ModelError):
    """The edge asked for a target model this verifier does not serve (NOT_FOUND)."""


class ProtocolError(EdgespecError):
    """Messages out of order (Verify before Open/Sync, second Open) or a version mismatch."""


class TreeTooLargeError(InvalidTreeError):
    """A tree over the verifier's node/depth/k limits (RESOURCE_EXHAUSTED, not INVALID_ARGUMENT)."""


class VerifierBusyError(VerifierUnavailableError):
    """Every stream or KV slot of the verifier is taken (RESOURCE_EXHAUSTED); retry later."""


class DeadlineExceededError(VerifierUnavailableError):
    """The verifier did not start on a request within its deadline (DEADLINE_EXCEEDED)."""


class UnauthenticatedError(VerifierUnavailableError):
    """Missing or wrong bearer token (UNAUTHENTICATED)."""


# -- error <-> status -------------------------------------------------------------------------
# Most specific classes first: `status_of` walks this list and takes the first isinstance match.
STATUS_OF: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (VerifierBusyError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TreeTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ContextOverflowError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TokenizerMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (ProtocolError, grpc.StatusCode.FAILED_PRECONDITION),
    (ModelNotServedError, grpc.StatusCode.NOT_FOUND),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),  # InvalidTreeError, WireFormatError
    (VerifierUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (ModelError, grpc.StatusCode.INTERNAL),  # the server's own model failed (e.g. out of memory)
]

# Status codes the edge sees without an `edgespec-error` trailer (or with an unknown one).
ERROR_OF_STATUS: dict[grpc.StatusCode, type[EdgespecError]] = {
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: UnauthenticatedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: VerifierBusyError,
    grpc.StatusCode.FAILED_PRECONDITION: ProtocolError,
    grpc.StatusCode.NOT_FOUND: ModelNotServedError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidTreeError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidTreeError,
}

_ERROR_CLASSES: dict[str, type[EdgespecError]] = {
    cls.__name__: cls
    for cls in [*(c for c, _ in STATUS_OF), WireFormatError, *(getattr(errors, n) for n in dir(errors))]
    if isinstance(cls, type) and issubclass(cls, EdgespecError)
}


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code the verifier answers an exception with (INTERNAL if unknown)."""
    for cls, code in STATUS_OF:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_from_status(code: grpc.StatusCode | None, details: str | None,
                      error_class: str | None = None) -> EdgespecError:
    """The edgespec exception for a failed RPC: the class the server named, else by status code.

    Anything unexpected (UNAVAILABLE, CANCELLED, INTERNAL, UNKNOWN, ...) is a
    VerifierUnavailableError: the edge may fall back to local decoding or retry.
    """
    cls = _ERROR_CLASSES.get(error_class or "") or ERROR_OF_STATUS.get(code, VerifierUnavailableError)
    name = code.name if code is not None else "UNKNOWN"
    return cls(f"verifier: {details or 'no details'} ({name})")


# -- packed arrays ----------------------------------------------------------------------------
def pack_i32(values: Sequence[int] | np.ndarray) -> bytes:
    """Little-endian int32 bytes of a token list (or any int array)."""
    arr = np.asarray(values, dtype=np.int64)
    if arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
        raise WireFormatError("value does not fit into int32")
    return arr.astype(_I32).tobytes()


def unpack_i32(data: bytes, field: str = "tokens", count: int | None = None) -> np.ndarray:
    """int32 array from packed bytes; WireFormatError if the length is wrong."""
    if len(data) % 4:
        raise WireFormatError(f"{field}: {len(data)} bytes is not a whole number of int32 values")
    if count is not None and len(data) != 4 * count:
        raise WireFormatError(f"{field}: expected {count} int32 values ({4 * count} bytes), got {len(data)} bytes")
    return np.frombuffer(data, dtype=_I32).astype(np.int32)


def pack_u16(values: np.ndarray) -> bytes:
    return np.asarray(values, dtype=np.uint16).astype(_U16).tobytes()


def unpack_u16(data: bytes, field: str, count: int) -> np.ndarray:
    if len(data) != 2 * count:
        raise WireFormatError(f"{field}: expected {count} uint16 values ({2 * count} bytes), got {len(data)} bytes")
    return np.frombuffer(data, dtype=_U16).astype(np.uint16)


def tokens_to_bytes(tokens: Iterable[int]) -> bytes:
    return pack_i32(list(tokens))


def tokens_from_bytes(data: bytes, field: str = "tokens") -> list[int]:
    return unpack_i32(data, field).tolist()


# -- sampling ---------------------------------------------------------------------------------
_RULE_TO_WIRE = {AcceptanceRule.TARGET_SAMPLE: pb.ACCEPTANCE_RULE_TARGET_SAMPLE,
                 AcceptanceRule.REJECTION: pb.ACCEPTANCE_RULE_REJECTION}
_RULE_FROM_WIRE = {v: k for k, v in _RULE_TO_WIRE.items()}


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            seed=params.seed & ((1 << 64) - 1), rule=_RULE_TO_WIRE[params.rule])
    if params.constraint:
        banned, grammar = params.constraint.banned, params.constraint.grammar
        msg.constraint.CopyFrom(pb.TokenConstraint(tokens=pack_i32([t for seq in banned for t in seq]),
                                                   lengths=pack_i32([len(seq) for seq in banned])))
        if grammar is not None:
            if grammar.start < 0:
                raise InvalidRequestError("the grammar's start position was never placed")
            msg.constraint.grammar, msg.constraint.grammar_start = grammar.text, grammar.start
    return msg


def constraint_from_proto(msg: pb.TokenConstraint) -> TokenConstraint | None:
    """The banned sequences and grammar of a SamplingParams.constraint; None when there are none.
    The grammar comes back unbound: the backend binds it to its token list."""
    tokens = unpack_i32(msg.tokens, "constraint.tokens")
    lengths = unpack_i32(msg.lengths, "constraint.lengths")
    grammar = Grammar(msg.grammar, start=int(msg.grammar_start)) if msg.grammar else None
    if not lengths.size and grammar is None:
        return None
    if (lengths < 1).any() or int(lengths.sum()) != tokens.size:
        raise WireFormatError(f"constraint.lengths sum to {int(lengths.sum())}, but constraint.tokens holds "
                              f"{tokens.size} ids (and every length must be >= 1)")
    bounds = np.cumsum(lengths)[:-1]
    banned = tuple(tuple(seq.tolist()) for seq in np.split(tokens, bounds)) if lengths.size else ()
    return TokenConstraint(banned, grammar=grammar)


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """SamplingParams from the wire; InvalidRequestError for out-of-range values."""
    top_p = msg.top_p if msg.top_p != 0 else 1.0
    if msg.rule not in _RULE_FROM_WIRE:
        raise InvalidRequestError(f"unknown acceptance rule {msg.rule}")
    constraint = constraint_from_proto(msg.constraint) if msg.HasField("constraint") else None
    return SamplingParams(temperature=float(msg.temperature), top_k=int(msg.top_k), top_p=float(top_p),
                          seed=int(msg.seed), rule=_RULE_FROM_WIRE[msg.rule], constraint=constraint)


# -- trees ------------------------------------------------------------------------------------
def tree_to_proto(tree: TokenTree) -> pb.TokenTree:
    n, k = tree.q_tokens.shape if tree.q_tokens.ndim == 2 else (len(tree), 0)
    if not k:
        return pb.TokenTree(tokens=pack_i32(tree.tokens), parents=pack_i32(tree.parents))
    rows = np.unique(tree.parents[1:])  # only nodes with children: leaves' q is never read
    return pb.TokenTree(tokens=pack_i32(tree.tokens), parents=pack_i32(tree.parents), k=k,
                        q_rows=pack_i32(rows), q_tokens=pack_i32(tree.q_tokens[rows].reshape(-1)),
                        q_weights=pack_u16(tree.q_weights[rows].reshape(-1)))


def tree_from_proto(msg: pb.TokenTree, max_nodes: int | None = None, max_k: int | None = None) -> TokenTree:
    """TokenTree from the wire; checks byte lengths and shapes (not tree structure: see validate).

    With max_nodes/max_k, a larger tree raises TreeTooLargeError before anything is allocated.
    """
    if len(msg.tokens) % 4:
        raise WireFormatError(f"tree.tokens: {len(msg.tokens)} bytes is not a whole number of int32 values")
    n = len(msg.tokens) // 4
    if n == 0:
        raise WireFormatError("tree.tokens is empty: a tree needs at least its root")
    if max_nodes is not None and n > max_nodes:
        raise TreeTooLargeError(f"tree has {n} nodes, over this verifier's limit of {max_nodes}")
    if max_k is not None and msg.k > max_k:
        raise TreeTooLargeError(f"tree.k = {msg.k} is over this verifier's limit of {max_k}")
    tokens = unpack_i32(msg.tokens, "tree.tokens")
    parents = unpack_i32(msg.parents, "tree.parents", count=n)
    k = int(msg.k)
    if k:
        rows = unpack_i32(msg.q_rows, "tree.q_rows") if msg.q_rows else np.arange(n, dtype=np.int32)
        if rows.size and (rows[0] < 0 or rows[-1] >= n or (np.diff(rows) <= 0).any()):
            raise WireFormatError(f"tree.q_rows must be ascending node indices in [0, {n})")
        q_tokens = np.full((n, k), -1, np.int32)
        q_weights = np.zeros((n, k), np.uint16)
        q_tokens[rows] = unpack_i32(msg.q_tokens, "tree.q_tokens", count=rows.size * k).reshape(rows.size, k)
        q_weights[rows] = unpack_u16(msg.q_weights, "tree.q_weights", count=rows.size * k).reshape(rows.size, k)
    else:
        if msg.q_tokens or msg.q_weights or msg.q_rows:
            raise WireFormatError("tree.q_tokens/q_weights/q_rows given but tree.k is 0")
        q_tokens, q_weights = np.zeros((n, 0), np.int32), np.zeros((n, 0), np.uint16)
    return TokenTree(tokens=tokens, parents=parents, q_tokens=q_tokens, q_weights=q_weights)


# -- whole messages ---------------------------------------------------------------------------
def open_message(model_id: str, tokenizer_hash: str, client_name: str = "edgespec") -> pb.EdgeMessage:
    return pb.EdgeMessage(open=pb.Open(protocol_version=PROTOCOL_VERSION, model_id=model_id,
                                       tokenizer_hash=tokenizer_hash, client_name=client_name))


def sync_message(tokens: Sequence[int], deadline_ms: int = 0) -> pb.EdgeMessage:
    return pb.EdgeMessage(sync=pb.Sync(tokens=tokens_to_bytes(tokens), deadline_ms=max(0, int(deadline_ms))))


def verify_message(tree: TokenTree, sampling: SamplingParams, step: int, deadline_ms: int = 0,
                   context_length: int = 0) -> pb.EdgeMessage:
    return pb.EdgeMessage(verify=pb.Verify(step=step, sampling=sampling_to_proto(sampling), tree=tree_to_proto(tree),
                                           deadline_ms=max(0, int(deadline_ms)), context_length=context_length))


@dataclass(frozen=True)
class Verified:
    """A decoded `Verified` message (the edge turns it into a runtime VerifyResult)."""

    step: int
    path: list[int]
    tokens: list[int]
    margins: list[float]
    queue_ms: float
    compute_ms: float


def verified_message(step: int, path: Sequence[int], tokens: Sequence[int], margins: Sequence[float],
                     queue_ms: float, compute_ms: float) -> pb.VerifierMessage:
    return pb.VerifierMessage(verified=pb.Verified(step=step, path=pack_i32(list(path)), tokens=pack_i32(list(tokens)),
                                                   margins=list(margins), queue_ms=queue_ms, compute_ms=compute_ms))


def verified_from_proto(msg: pb.Verified) -> Verified:
    tokens = tokens_from_bytes(msg.tokens, "verified.tokens")
    if not tokens:
        raise WireFormatError("verified.tokens is empty: every step commits at least one token")
    return Verified(step=int(msg.step), path=tokens_from_bytes(msg.path, "verified.path"), tokens=tokens,
                    margins=list(msg.margins), queue_ms=float(msg.queue_ms), compute_ms=float(msg.compute_ms))
