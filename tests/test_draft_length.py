"""Suffix decoding's chain cut (:mod:`specdec.drafters.draft_length`): the break-even from step costs,
the hindsight counts by match length and draft position, and where a chain is cut. No model; exact
values throughout. The engine-level checks (greedy equality and the distribution test with its negative
control under the cut, the engine handing the step costs over) are in ``tests/test_suffix_engine.py``."""

from __future__ import annotations

import pytest
import torch

from sampling.params import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.drafters.base import DrafterContext, DraftInput
from specdec.drafters.draft_length import MAX_MATCH_BUCKET, AcceptanceDraftLength, row_cost
from specdec.drafters.suffix import SuffixDrafter
from specdec.request import Request


def test_row_cost_is_the_extra_of_k_rows_over_a_one_token_step():
    costs = {1: 0.010, 2: 0.0101, 4: 0.011, 5: 0.012, 8: 0.013}
    assert row_cost(costs, 4) == pytest.approx((0.012 - 0.010) / (4 * 0.010))  # 5 rows against 1: 0.05
    assert row_cost(costs, 3) == pytest.approx((0.011 - 0.010) / (3 * 0.010))
    assert row_cost({1: 0.010, 2: 0.0101, 8: 0.013}, 4) == pytest.approx(0.003 / (7 * 0.010))  # next above
    assert row_cost({1: 0.010, 2: 0.012}, 4) == pytest.approx(0.2)  # only 2 profiled: the largest
    assert row_cost({1: 0.010}, 4) == 0.0 and row_cost({1: 0.010, 5: 0.009}, 4) == 0.0  # never negative


def test_auto_threshold_is_row_cost_times_mean_tokens_per_step():
    rule = AcceptanceDraftLength("auto", 4)
    assert rule.wants_step_costs and rule.threshold == 0.0  # before the costs: nothing is cut
    assert rule.length(1, 4) == 4
    rule.set_step_costs({1: 0.010, 5: 0.012})
    assert rule.row_cost == pytest.approx(0.05)
    assert rule.threshold == pytest.approx(0.05 * 2.0)  # the prior: 2 tokens a step
    rule.observe(3, 4, 4)  # 5 tokens committed
    rule.observe(3, 4, 0)  # 1
    assert rule.steps == 2 and rule.tokens == 6
    assert rule.threshold == pytest.approx(0.05 * (6 + 2) / (2 + 1))
    fixed = AcceptanceDraftLength(0.3, 4)
    assert not fixed.wants_step_costs and fixed.threshold == 0.3


def test_counts_follow_each_chain_as_far_as_it_was_verified():
    rule = AcceptanceDraftLength(0.0, 4)
    rule.observe(1, 4, 1)  # the first accepted, the second rejected: the third and fourth never reached
    assert rule.reached[1][1:] == [1, 1, 0, 0] and rule.accepted[1][1:] == [1, 0, 0, 0]
    rule.observe(20, 3, 3)  # a long match: the last bucket
    assert rule.reached[MAX_MATCH_BUCKET][1:] == [1, 1, 1, 0]
    assert rule.accepted[MAX_MATCH_BUCKET][1:] == [1, 1, 1, 0]
    rule.observe(2, 0, 0)  # nothing verified: nothing counted
    assert rule.steps == 2 and sum(map(sum, rule.reached)) == 5


def test_a_chain_is_cut_where_its_estimated_acceptance_falls_below_the_threshold():
    # After one-token matches: 100 chains of 4, 20 accepted whole, 80 rejected at the first draft.
    rule = AcceptanceDraftLength(0.19, 4)
    for i in range(100):
        rule.observe(1, 4, 4 if i < 20 else 0)
    a1, a_rest = 21 / 102, 21 / 22  # Laplace: (accepted + 1) / (reached + 2)
    assert rule.acceptance(1) == pytest.approx([a1, a1 * a_rest, a1 * a_rest**2, a1 * a_rest**3])
    # 0.2059, 0.1965, 0.1876, 0.1791: the first two are at least 0.19
    assert rule.length(1, 4) == 2 and rule.length(1, 1) == 1 and rule.length(1, 0) == 0
    assert rule.acceptance(2) == pytest.approx([0.5, 0.25, 0.125, 0.0625])  # no evidence yet
    assert rule.length(2, 4) == 2
    assert AcceptanceDraftLength(0.5, 4).length(1, 4) == 1  # at least one draft
    assert AcceptanceDraftLength(0.0, 4).length(1, 4) == 4  # 0: never cut


def _request(tokens: list[int], rid: str) -> Request:
    return Request(rid, list(tokens), SamplingParams(temperature=0, max_tokens=64), 0)


def test_the_suffix_drafter_cuts_its_chains_and_learns_from_their_verification():
    config = SpeculativeConfig("suffix", 4, suffix_accept_threshold=0.3)
    d = SuffixDrafter(DrafterContext(None, config, None, torch.float32, torch.device("cpu"), None))  # type: ignore[arg-type]
    req = _request([1, 2, 3, 4, 5, 6, 7, 1], "a")  # a one-token match: 2 3 4 5 follows
    (p,) = d.propose([DraftInput(req, 8, 4)])
    assert p.match_length == 1 and p.token_ids == [2]  # 0.5 then 0.25 < 0.3: one draft
    req.token_ids.extend([2, 3])  # accepted, then the bonus token
    d.on_verified(req, 1, 1)
    assert d.length_rule.reached[1][1:] == [1, 0, 0, 0] and d.length_rule.accepted[1][1:] == [1, 0, 0, 0]
    assert d.length_rule.acceptance(1)[:2] == pytest.approx([2 / 3, 1 / 3])  # both now at least 0.3
    (p,) = d.propose([DraftInput(_request([1, 2, 3, 4, 5, 6, 7, 1], "b"), 8, 4)])  # counts are engine-wide
    assert p.token_ids == [2, 3]  # 2/3, 1/3, then 1/6
    tree = SpeculativeConfig("suffix", 4, tree="dynamic", suffix_accept_threshold=0.3)
    t = SuffixDrafter(DrafterContext(None, tree, None, torch.float32, torch.device("cpu"), None))  # type: ignore[arg-type]
    assert t.length_rule is None and not t.wants_step_costs  # trees keep SuffixDecoding's budget alone
