"""TokenTree structure and validation: bad trees are refused with a message that says why."""
import numpy as np
import pytest

from edgespec.common.errors import InvalidTreeError
from edgespec.common.sampling import quantize_draft
from edgespec.common.tree import TokenTree

VOCAB = 100


def tree(tokens, parents, **kw):
    return TokenTree(tokens=np.array(tokens), parents=np.array(parents), **kw)


def test_structure_helpers():
    t = tree([5, 6, 7, 8, 9], [-1, 0, 0, 1, 1])
    t.validate(VOCAB)
    assert t.depths.tolist() == [0, 1, 1, 2, 2]
    assert t.children() == [[1, 2], [3, 4], [], [], []]
    assert t.leaves() == [2, 3, 4]
    assert t.path_to(4) == [1, 4]
    assert TokenTree.chain(5, [6, 7]).parents.tolist() == [-1, 0, 1]


@pytest.mark.parametrize("tokens,parents,message", [
    ([], [], "empty"),
    ([1, 2], [0, 0], "root"),
    ([1, 2, 3], [-1, 2, 1], "parents must precede"),      # cycle 1 <-> 2
    ([1, 2, 3], [-1, 0, 7], "parents must precede"),      # orphan: parent does not exist
    ([1, 2, 3], [-1, 0, -1], "parents must precede"),     # second root
    ([1, 2, VOCAB], [-1, 0, 1], "outside the vocabulary"),
    ([1, -3], [-1, 0], "outside the vocabulary"),
    ([1, 2, 2], [-1, 0, 0], "duplicate child"),
])
def test_malformed_trees_are_rejected(tokens, parents, message):
    with pytest.raises(InvalidTreeError, match=message):
        tree(tokens, parents).validate(VOCAB)


def test_limits():
    big = TokenTree.chain(1, list(range(2, 40)))
    with pytest.raises(InvalidTreeError, match="over the limit"):
        big.validate(VOCAB, max_nodes=16)
    with pytest.raises(InvalidTreeError, match="depth"):
        big.validate(VOCAB, max_depth=8)


def test_sampled_trees_need_a_draft_distribution():
    t = tree([1, 2, 3], [-1, 0, 0])
    with pytest.raises(InvalidTreeError, match="no draft distribution"):
        t.validate(VOCAB, require_q=True)
    q_tok, q_w = quantize_draft(np.array([2, 3, 4]), np.array([0.5, 0.3, 0.2]))
    pad = np.full(3, -1), np.zeros(3, np.uint16)
    ok = tree([1, 2, 3], [-1, 0, 0], q_tokens=np.stack([q_tok, pad[0], pad[0]]), q_weights=np.stack([q_w, pad[1], pad[1]]))
    ok.validate(VOCAB, require_q=True)
    bad = tree([1, 2, 9], [-1, 0, 0], q_tokens=ok.q_tokens, q_weights=ok.q_weights)
    with pytest.raises(InvalidTreeError, match="not in its draft distribution"):
        bad.validate(VOCAB, require_q=True)


def test_a_tree_is_immutable_and_validate_remembers_what_it_checked():
    mine = np.array([5, 6, 7], np.int32)
    tree = TokenTree(tokens=mine, parents=np.array([-1, 0, 1], np.int32))
    mine[0] = 9                                   # the caller's array is not the tree's
    assert tree.tokens[0] == 5 and mine.flags.writeable
    with pytest.raises(ValueError):
        tree.tokens[0] = 1                        # read-only: a checked tree cannot change afterwards
    with pytest.raises(ValueError):
        tree.depths[0] = 1
    tree.validate(100, max_nodes=8)
    assert tree.max_depth == 2 and tree.depths.tolist() == [0, 1, 2]
    tree.validate(100, max_nodes=8, max_depth=2)  # remembered checks, depth compared with the cached depths
    with pytest.raises(InvalidTreeError, match="tree depth 2 exceeds the limit of 1"):
        tree.validate(100, max_nodes=8, max_depth=1)
    with pytest.raises(InvalidTreeError, match="outside the vocabulary"):
        tree.validate(7, max_nodes=8)             # other limits: checked again
    with pytest.raises(InvalidTreeError, match="over the limit"):
        tree.validate(100, max_nodes=2)
    with pytest.raises(InvalidTreeError, match="no draft distribution"):
        tree.validate(100, max_nodes=8, require_q=True)
    tree.validate(100, max_nodes=8)               # the first set of limits still holds


def test_a_failed_validation_is_not_remembered():
    tree = TokenTree(tokens=np.array([1, 2], np.int32), parents=np.array([-1, 5], np.int32))
    for _ in range(2):
        with pytest.raises(InvalidTreeError, match="parents must precede children"):
            tree.validate(100)
