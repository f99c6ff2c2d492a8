"""Grammars on token trees (issue 20): :func:`specdec.structured.tree_bitmask` gives every node the mask
of a fresh matcher fed the committed tokens plus that node's own path, :func:`grammar_tree_keep` keeps
exactly the nodes whose whole path the grammar accepts, and both leave the matcher where it was; random
trees over a mix of allowed and forbidden tokens, for every backend (the ``compiled`` fixture)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grammars import allocate_token_bitmask
from sampling.token_tree import TokenTree
from specdec.structured import grammar_tree_keep, tree_bitmask
from tests.test_grammar_helpers import allowed_ids, tiny_byte_level_tokenizer
from tests.test_grammar_rollback import compiled, snapshot  # noqa: F401  (the fixture, per backend)


def fresh_row(compiled, tokens: list[int]) -> torch.Tensor | None:  # noqa: F811
    """A fresh matcher's mask after ``tokens``, or None when it rejects one of them."""
    g = compiled.matcher()
    for t in tokens:
        if not g.accept_token(t):
            return None
    row = allocate_token_bitmask(1, compiled.vocab_size)
    g.fill_bitmask(row, 0)
    return row[0]


@st.composite
def trees(draw, candidates: list[int]) -> TokenTree:
    n = draw(st.integers(0, 12), label="nodes")
    parents = [draw(st.integers(-1, i - 1), label="parent") for i in range(n)]
    tokens = [draw(st.sampled_from(candidates), label="token") for _ in range(n)]
    return TokenTree(tuple(tokens), tuple(parents))


def _candidates() -> list[int]:
    tok = tiny_byte_level_tokenizer()
    return [tok.convert_tokens_to_ids(t) for t in ("ab", "1", "2", "Ġwo", "a", "b")] + [0]  # 0: EOS


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_tree_masks_follow_each_nodes_own_path(compiled, data):  # noqa: F811
    g = compiled.matcher()
    committed = []
    for _ in range(data.draw(st.integers(0, 3), label="committed")):
        allowed = allowed_ids(g).tolist()
        t = data.draw(st.sampled_from(allowed), label="committed token")
        assert g.accept_token(t)
        committed.append(t)
    tree = data.draw(trees(_candidates()), label="tree")
    before = snapshot(g)

    keep = grammar_tree_keep(g, tree)
    assert snapshot(g) == before
    masks = tree_bitmask(g, tree, compiled.vocab_size)
    assert snapshot(g) == before
    assert masks.shape == (1 + tree.num_nodes, allocate_token_bitmask(1, compiled.vocab_size).shape[1])

    assert torch.equal(masks[0], fresh_row(compiled, committed))
    for i in range(tree.num_nodes):
        ref = fresh_row(compiled, committed + tree.path_tokens(i))
        assert keep[i] == (ref is not None), i
        if ref is not None:
            assert torch.equal(masks[1 + i], ref), i
        else:  # a forbidden path: its row is never used and stays all-allowed
            assert bool((masks[1 + i] == -1).all())

    pruned = tree.pruned(keep)
    assert pruned.num_nodes == sum(keep)
    for i in range(pruned.num_nodes):
        assert fresh_row(compiled, committed + pruned.path_tokens(i)) is not None


def test_pruned_drops_subtrees_and_renumbers():
    tree = TokenTree((10, 11, 12, 13, 14), (-1, 0, -1, 2, 1))
    assert tree.pruned([True, True, False, True, True]) == TokenTree((10, 11, 14), (-1, 0, 1))
    assert tree.pruned([False, True, True, True, True]) == TokenTree((12, 13), (-1, 0))
    assert tree.pruned([True] * 5) == tree
    with pytest.raises(ValueError, match="keep has 2 entries for 5 nodes"):
        tree.pruned([True, False])
