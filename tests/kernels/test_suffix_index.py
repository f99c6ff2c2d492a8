"""The C++ index of a request's own text (kernels/csrc/suffix_index.cpp) against its Python reference,
specdec.drafters.suffix_tree.RequestIndex: the same trie, and the same drafts (tokens, parents, score to
the bit, match length) after every growth, on random texts with many repeats, chains and trees."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import suffix_index
from specdec.drafters.suffix_tree import RequestIndex

pytestmark = pytest.mark.skipif(
    not suffix_index.available(), reason="the C++ index is off here (CPU kernels not built, or switched off)"
)


def _pair(depth: int) -> tuple[object, RequestIndex]:
    native = suffix_index.request_index(depth)
    assert native is not None
    return native, RequestIndex(depth)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(1, 6),
    length=st.integers(1, 120),
    depth=st.integers(1, 12),
    max_match=st.integers(1, 12),
    max_drafts=st.integers(0, 6),
    cap=st.integers(0, 16),
    spec_factor=st.sampled_from([0.25, 0.5, 1.0, 1.7, 4.0]),
    min_prob=st.sampled_from([0.0, 0.05, 0.1, 0.34, 1.0]),
    tree=st.booleans(),
)
def test_native_index_equals_the_reference(
    seed, vocab, length, depth, max_match, max_drafts, cap, spec_factor, min_prob, tree
):
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab) for _ in range(length)]
    native, ref = _pair(depth)
    done = 0
    while done < length:  # grown in chunks, as requests catch up
        n = rng.randint(1, 9)
        chunk = tokens[done : done + n]
        native.extend(chunk, done)
        ref.extend(chunk, done)
        done += len(chunk)
        args = (max_match, max_drafts, cap, spec_factor, min_prob, tree)
        assert native.best_draft(*args) == ref.best_draft(*args)
        assert native.num_indexed == ref.num_indexed == done
    assert native.num_nodes == ref.num_nodes
    assert native.to_dict() == ref.to_dict()


def test_a_draft_is_the_most_frequent_continuation_and_ties_go_to_the_most_recent():
    native, ref = _pair(6)
    text = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2, 5, 1, 2]  # after "1 2": 3 twice, 4 and 5 once each
    for index in (native, ref):
        index.extend(text, 0)
        tokens, parents, score, match = index.best_draft(2, 1, 4, 1.0, 0.0, False)
        assert (tokens, parents, match) == ([3], None, 2) and score == pytest.approx(0.5)
    native2, ref2 = _pair(6)
    for index in (native2, ref2):
        index.extend([1, 2, 4, 1, 2, 5, 1, 2], 0)  # 4 and 5 once each: 5 is more recent
        assert index.best_draft(2, 1, 4, 1.0, 0.0, False)[0] == [5]
        tokens, parents, score, match = index.best_draft(2, 1, 4, 1.0, 0.0, True)  # a tree of both
        assert tokens == [5, 4] and parents == [-1, -1] and score == pytest.approx(1.0)
        # Two deep: "5 1" (0.5, ends at 6) ties "4" (0.5, ends at 2), and is more recent.
        assert index.best_draft(2, 2, 2, 1.0, 0.0, True)[:2] == ([5, 1], [-1, 0])


def test_a_huge_spec_factor_is_capped_as_in_python():
    native, ref = _pair(8)
    for index in (native, ref):
        index.extend([1, 2, 3, 4, 1, 2], 0)
    for factor in (1e19, 1e300):
        assert native.best_draft(4, 4, 4, factor, 0.0, False) == ref.best_draft(4, 4, 4, factor, 0.0, False)
        assert native.best_draft(4, 4, 4, factor, 0.0, False)[0] == [3, 4, 1, 2]


def test_nothing_to_draft_and_bad_tokens():
    native, ref = _pair(4)
    for index in (native, ref):
        assert index.best_draft(4, 4, 4, 1.0, 0.0, False) is None  # empty
        index.extend([7, 8, 9], 0)
        assert index.best_draft(4, 4, 4, 1.0, 0.0, False) is None  # no repeat
    with pytest.raises(RuntimeError, match="token id out of range"):
        native.extend([7, 8, -1], 3)
    with pytest.raises(RuntimeError, match="token id out of range"):
        native.extend([2**32], 3)
    assert native.num_indexed == 3 and native.to_dict() == ref.to_dict()  # nothing indexed by a bad call
    native.extend([2**32 - 1, 2**31], 3)  # the largest ids are fine
    assert native.num_indexed == 5
    with pytest.raises(RuntimeError, match="max_depth must be >= 1"):
        suffix_index.request_index(0)
