"""``SpecStats``: acceptance figures defined alike for chains and token trees (issue 24, item 4).

A tree's acceptance is per verification step and per depth, as in the Medusa / EAGLE / SpecInfer papers:
accepted tokens over the tree's depth, not over its nodes (a 16-node tree of depth 4 can keep at most 4).
The nodes verified stay a figure of their own (``num_draft_nodes``).
"""

from __future__ import annotations

import pytest

from specdec.metrics import SpecStats


def test_chain_figures_are_unchanged():
    s = SpecStats(4)
    s.observe(4, 2)  # a chain of 4, 2 accepted
    s.observe(3, 3)  # a chain of 3 (capped), all accepted
    s.observe(0, 0)  # no drafts: not a draft step, but a sampling step
    assert (s.num_drafts, s.num_draft_tokens, s.num_draft_nodes, s.num_accepted_tokens) == (2, 7, 7, 5)
    assert s.acceptance_rate == pytest.approx(5 / 7)
    assert s.mean_acceptance_length == pytest.approx(1 + 5 / 2)
    assert (s.num_steps, s.tokens_per_step) == (3, pytest.approx(1 + 5 / 3))  # 8 tokens in 3 forwards
    assert s.accepted_per_position == [2, 2, 1, 0]
    assert s.drafted_per_position == [2, 2, 2, 1]
    assert s.acceptance_rate_per_position == pytest.approx([1.0, 1.0, 0.5, 0.0])


def test_tree_acceptance_is_per_depth_not_per_node():
    s = SpecStats(4)
    s.observe(4, 3, num_draft_nodes=16)  # a 16-node tree of depth 4, a path of 3 accepted
    s.observe(2, 0, num_draft_nodes=6)  # a 6-node tree of depth 2, nothing accepted
    assert (s.num_drafts, s.num_draft_tokens, s.num_draft_nodes, s.num_accepted_tokens) == (2, 6, 22, 3)
    assert s.acceptance_rate == pytest.approx(3 / 6)  # not 3 / 22
    assert s.mean_acceptance_length == pytest.approx(2.5)
    assert s.accepted_per_position == [1, 1, 1, 0]
    assert s.drafted_per_position == [2, 2, 1, 1]
    assert s.acceptance_rate_per_position == pytest.approx([0.5, 0.5, 1.0, 0.0])


def test_no_drafts_gives_none():
    s = SpecStats(3)
    assert s.acceptance_rate is None and s.mean_acceptance_length is None and s.tokens_per_step is None
    assert s.acceptance_rate_per_position == [None, None, None]


def test_as_dict_has_every_figure():
    s = SpecStats(2)
    s.observe(2, 1, num_draft_nodes=5)
    d = s.as_dict()
    assert d["num_draft_tokens"] == 2 and d["num_draft_nodes"] == 5
    assert d["acceptance_rate"] == 0.5 and d["mean_acceptance_length"] == 2.0
    assert d["accepted_per_position"] == [1, 0] and d["drafted_per_position"] == [1, 1]
    assert d["acceptance_rate_per_position"] == [1.0, 0.0]
    assert (d["num_steps"], d["tokens_per_step"]) == (1, 2.0)
    assert {"num_drafts", "num_accepted_tokens", "draft_time_s", "verify_time_s"} <= d.keys()


def test_print_shows_the_derived_figures():
    s = SpecStats(4)
    for _ in range(11):
        s.observe(4, 2)
    s.observe(4, 3)
    text = str(s)
    assert text == repr(s) and text.startswith("SpecStats(")
    assert f"acceptance_rate={round(s.acceptance_rate, 4)}" in text
    assert f"mean_acceptance_length={round(s.mean_acceptance_length, 4)}" in text
    assert "accepted_per_position=[12, 12, 1, 0]" in text
    assert "acceptance_rate_per_position=[1.0, 1.0, 0.083, 0.0]" in text
    assert "num_draft_nodes=48" in text
    assert "acceptance_rate=None" in str(SpecStats(2))
