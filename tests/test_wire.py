"""edgespec.common.wire: round trips through real serialised protobuf bytes, malformed input, error mapping."""
import grpc
import numpy as np
import pytest

from edgespec.common import wire
from edgespec.common.errors import (ContextOverflowError, EdgespecError, InvalidRequestError, InvalidTreeError,
                                    ModelError, TokenizerMismatchError, VerifierUnavailableError)
from edgespec.common.sampling import SamplingParams, quantize_draft
from edgespec.common.tree import TokenTree
from edgespec.v1 import edgespec_pb2 as pb


def through_bytes(msg):
    """Serialise and parse again, as the wire does."""
    return type(msg).FromString(msg.SerializeToString())


def sampled_tree() -> TokenTree:
    q_tok, q_w = quantize_draft(np.array([7, 3, 151935]), np.array([0.6, 0.3, 0.1]))
    q_tokens = np.full((4, 3), -1, np.int32)
    q_weights = np.zeros((4, 3), np.uint16)
    q_tokens[0], q_weights[0] = q_tok, q_w
    q_tokens[1, :2], q_weights[1, :2] = [9, 2], [40000, 25535]
    return TokenTree(tokens=np.array([5, 7, 3, 9]), parents=np.array([-1, 0, 0, 1]), q_tokens=q_tokens, q_weights=q_weights)


def assert_same_tree(a: TokenTree, b: TokenTree) -> None:
    for f in ("tokens", "parents", "q_tokens", "q_weights"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f


@pytest.mark.parametrize("tokens", [[], [0], [1, 2, 3], [151935, 0, 2**31 - 1], list(range(5000))])
def test_token_round_trip(tokens):
    data = wire.tokens_to_bytes(tokens)
    assert len(data) == 4 * len(tokens)
    assert wire.tokens_from_bytes(data) == tokens
    msg = through_bytes(wire.sync_message(tokens))
    assert wire.tokens_from_bytes(msg.sync.tokens) == tokens


def test_tokens_are_little_endian_int32():
    assert wire.tokens_to_bytes([1, 258, -1]) == b"\x01\x00\x00\x00\x02\x01\x00\x00\xff\xff\xff\xff"


@pytest.mark.parametrize("tree", [TokenTree.chain(42, []), TokenTree.chain(42, [1, 2, 3]),
                                  TokenTree(tokens=np.array([1, 2, 3, 4, 5]), parents=np.array([-1, 0, 0, 1, 1])),
                                  sampled_tree()])
def test_tree_round_trip(tree):
    msg = through_bytes(wire.verify_message(tree, SamplingParams(), step=3, deadline_ms=250, context_length=17))
    assert msg.verify.step == 3 and msg.verify.deadline_ms == 250 and msg.verify.context_length == 17
    back = wire.tree_from_proto(msg.verify.tree)
    assert_same_tree(tree, back)
    assert msg.verify.tree.k == tree.q_tokens.shape[1]
    # the wire size is what the arrays need, nothing more: 8 bytes per node plus 6 per q entry of
    # the nodes that have children (a leaf's q is never read, so it is not sent)
    n, k = tree.q_tokens.shape
    rows = len(set(tree.parents[1:].tolist())) if k else 0
    assert len(msg.verify.tree.tokens) + len(msg.verify.tree.parents) == 8 * n
    assert len(msg.verify.tree.q_tokens) + len(msg.verify.tree.q_weights) == 6 * rows * k


def test_leaf_q_rows_are_not_sent_and_bad_rows_are_refused():
    tree = sampled_tree()
    q_tokens, q_weights = tree.q_tokens.copy(), tree.q_weights.copy()
    q_tokens[3], q_weights[3] = [1, 2, 3], [1, 1, 1]            # a leaf with a (useless) q row
    msg = wire.tree_to_proto(TokenTree(tokens=tree.tokens, parents=tree.parents, q_tokens=q_tokens, q_weights=q_weights))
    assert_same_tree(tree, wire.tree_from_proto(through_bytes(msg)))
    msg.q_rows = wire.pack_i32(np.array([1, 0]))
    with pytest.raises(wire.WireFormatError, match="q_rows"):
        wire.tree_from_proto(msg)


def test_sampled_tree_still_validates_after_the_trip():
    back = wire.tree_from_proto(through_bytes(wire.tree_to_proto(sampled_tree())))
    back.validate(151936, require_q=True)
    np.testing.assert_array_equal(back.draft_distribution(0)[1], sampled_tree().draft_distribution(0)[1])


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.7, 40, 0.95, 12345),
                                    SamplingParams(1.3, 0, 1.0, 2**64 - 1), SamplingParams(0.1234567890123, 1, 0.3, 0)])
def test_sampling_round_trip_is_exact(params):
    assert wire.sampling_from_proto(through_bytes(wire.sampling_to_proto(params))) == params


def test_sampling_defaults_and_bad_values():
    assert wire.sampling_from_proto(pb.SamplingParams()) == SamplingParams()  # top_p 0 on the wire means 1
    with pytest.raises(InvalidRequestError, match="top_p"):
        wire.sampling_from_proto(pb.SamplingParams(top_p=1.5))
    with pytest.raises(InvalidRequestError, match="temperature"):
        wire.sampling_from_proto(pb.SamplingParams(temperature=float("nan")))


def test_verified_round_trip():
    msg = through_bytes(wire.verified_message(9, [1, 3], [7, 9, 11], [0.5, 1.25, 3.0], queue_ms=1.5, compute_ms=20.25))
    v = wire.verified_from_proto(msg.verified)
    assert (v.step, v.path, v.tokens, v.margins, v.queue_ms, v.compute_ms) == (9, [1, 3], [7, 9, 11], [0.5, 1.25, 3.0], 1.5, 20.25)


def good_tree_msg() -> pb.TokenTree:
    return wire.tree_to_proto(sampled_tree())


@pytest.mark.parametrize("corrupt,match", [
    (lambda m: setattr(m, "tokens", m.tokens + b"\x01"), "tree.tokens: 17 bytes"),
    (lambda m: setattr(m, "tokens", b""), "empty"),
    (lambda m: setattr(m, "parents", m.parents[:-4]), r"tree.parents: expected 4 int32"),
    (lambda m: setattr(m, "parents", m.parents + b"\x00\x00"), r"tree.parents: 18 bytes"),
    (lambda m: setattr(m, "q_tokens", m.q_tokens[:-4]), r"tree.q_tokens: expected 6 int32"),
    (lambda m: setattr(m, "q_weights", m.q_weights[:-1]), r"tree.q_weights: expected 6 uint16"),
    (lambda m: setattr(m, "k", 4), r"tree.q_tokens: expected 8"),
    (lambda m: setattr(m, "k", 0), "k is 0"),
])
def test_malformed_tree_bytes_are_rejected(corrupt, match):
    msg = good_tree_msg()
    corrupt(msg)
    with pytest.raises(wire.WireFormatError, match=match) as info:
        wire.tree_from_proto(through_bytes(msg))
    assert isinstance(info.value, InvalidRequestError)
    assert wire.status_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT


def test_malformed_token_bytes_are_rejected():
    with pytest.raises(wire.WireFormatError, match="sync.tokens: 7 bytes"):
        wire.tokens_from_bytes(b"\x00" * 7, "sync.tokens")
    with pytest.raises(wire.WireFormatError, match="verified.tokens is empty"):
        wire.verified_from_proto(pb.Verified())
    with pytest.raises(wire.WireFormatError, match="int32"):
        wire.tokens_to_bytes([2**31])


def test_limits_are_checked_before_decoding():
    big = wire.tree_to_proto(TokenTree.chain(1, list(range(2, 201))))
    with pytest.raises(wire.TreeTooLargeError, match="200 nodes, over this verifier's limit of 128"):
        wire.tree_from_proto(big, max_nodes=128)
    with pytest.raises(wire.TreeTooLargeError, match="k = 3"):
        wire.tree_from_proto(good_tree_msg(), max_k=2)


def test_structural_rules_stay_with_validate():
    """Bytes that decode fine but form a bad tree: decoding succeeds, validate refuses."""
    msg = pb.TokenTree(tokens=wire.pack_i32([1, 2, 3]), parents=wire.pack_i32([-1, 2, 0]))
    tree = wire.tree_from_proto(msg)
    with pytest.raises(InvalidTreeError, match="parents must precede"):
        tree.validate(100)


@pytest.mark.parametrize("exc,code", [
    (wire.UnauthenticatedError("x"), grpc.StatusCode.UNAUTHENTICATED),
    (wire.DeadlineExceededError("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (wire.VerifierBusyError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (wire.TreeTooLargeError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ContextOverflowError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TokenizerMismatchError("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (wire.ProtocolError("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (wire.ModelNotServedError("x"), grpc.StatusCode.NOT_FOUND),
    (InvalidTreeError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequestError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (wire.WireFormatError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (VerifierUnavailableError("x"), grpc.StatusCode.UNAVAILABLE),
    (ModelError("x"), grpc.StatusCode.INTERNAL),
    (RuntimeError("x"), grpc.StatusCode.INTERNAL),
])
def test_status_mapping_round_trip(exc, code):
    assert wire.status_of(exc) == code
    back = wire.error_from_status(code, "server says why", type(exc).__name__)
    assert isinstance(back, EdgespecError) and "server says why" in str(back)
    if isinstance(exc, EdgespecError):
        assert type(back) is type(exc)


@pytest.mark.parametrize("code,cls", [
    (grpc.StatusCode.UNAVAILABLE, VerifierUnavailableError),
    (grpc.StatusCode.CANCELLED, VerifierUnavailableError),
    (grpc.StatusCode.UNAUTHENTICATED, wire.UnauthenticatedError),
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidTreeError),
    (grpc.StatusCode.NOT_FOUND, ModelError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, wire.VerifierBusyError),
    (None, VerifierUnavailableError),
])
def test_status_without_trailer(code, cls):
    err = wire.error_from_status(code, "why", "NoSuchClass")
    assert isinstance(err, cls) and "why" in str(err)
