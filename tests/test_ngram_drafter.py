"""Prompt-lookup drafter: what it proposes, and that its index grows incrementally."""

from __future__ import annotations

import pytest
import torch

from sampling.params import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.drafters.base import DrafterContext
from specdec.drafters.ngram import NgramDrafter
from specdec.request import Request


def _request(tokens: list[int]) -> Request:
    return Request("r", tokens, SamplingParams(temperature=0, max_tokens=100), 0)


def _drafter(n_max: int = 3, n_min: int = 1) -> NgramDrafter:
    config = SpeculativeConfig("ngram", 4, prompt_lookup_max=n_max, prompt_lookup_min=n_min)
    return NgramDrafter(DrafterContext(None, config, None, torch.float32, torch.device("cpu"), None))  # type: ignore[arg-type]


def test_proposes_what_followed_the_most_recent_match():
    req = _request([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # Suffix (2, 3) last occurred at positions 5-6, followed by 7, 8, 5, 2.
    assert _drafter().propose_one(req, 4) == [7, 8, 5, 2]
    assert _drafter().propose_one(req, 2) == [7, 8]


def test_continue_draft_looks_up_the_context_extended_by_drafts():
    req = _request([1, 2, 3, 9, 9, 1, 2, 4, 7])
    d = _drafter()
    # committed + [1, 2]: the suffix (7, 1, 2) never occurred, (1, 2) last at 5-6 -> 4, 7
    assert d.continue_draft(req, [1, 2], 4) == [4, 7]
    assert d.continue_draft(req, [9, 1, 2, 3], 2) == [9, 9]  # (1, 2, 3) at the start
    assert d.continue_draft(req, [5], 3) == []  # 5 never occurred
    assert d.continue_draft(req, [1], 0) == []
    assert req.token_ids == [1, 2, 3, 9, 9, 1, 2, 4, 7]  # nothing committed


def test_longest_ngram_wins():
    # Suffix (4, 5, 6): the 3-gram matches at the start (-> 10); the 1-gram (6) last occurred before 20.
    req = _request([4, 5, 6, 10, 11, 6, 20, 21, 4, 5, 6])
    assert _drafter(n_max=3).propose_one(req, 2) == [10, 11]
    assert _drafter(n_max=1).propose_one(req, 2) == [20, 21]


def test_no_match_and_zero_budget():
    assert _drafter().propose_one(_request([1, 2, 3, 4]), 4) == []
    assert _drafter().propose_one(_request([1, 2, 1, 2]), 0) == []
    assert _drafter(n_min=3).propose_one(_request([1, 2, 1, 2]), 4) == []  # only a 2-gram repeats


def test_never_proposes_the_suffix_itself_or_past_the_context():
    req = _request([5, 5])
    # The 1-gram (5) occurred at position 0; what followed is the last token only.
    assert _drafter().propose_one(req, 4) == [5]


@pytest.mark.parametrize("length", [1000, 20000])
def test_index_is_incremental(length):
    """Each committed token adds one entry per n-gram size; a proposal re-indexes only new tokens."""
    tokens = [(i * 7919) % 1009 for i in range(length)]
    req = _request(tokens)
    drafter = _drafter(n_max=4, n_min=2)
    drafter.propose_one(req, 4)
    index = drafter.states.peek(req)
    assert index.num_indexed == length - 1
    sizes = {n: len(t) for n, t in index.last_end.items()}
    req.token_ids.extend([3, 1, 4])
    drafter.propose_one(req, 4)
    assert index.num_indexed == length + 2
    assert all(len(index.last_end[n]) - sizes[n] <= 3 for n in sizes)
