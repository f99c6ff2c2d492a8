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
from specdec.drafters.draft_length import (
    MAX_MATCH_BUCKET,
    AcceptanceCounts,
    AcceptanceDraftLength,
    ObservedRowCost,
    row_cost,
)
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
    assert rule.wants_step_costs and rule.threshold() == 0.0  # before the costs: nothing is cut
    assert rule.length(1, 4) == 4
    rule.set_step_costs({1: 0.010, 5: 0.012})
    assert rule.row_cost == pytest.approx(0.05)
    assert rule.threshold() == pytest.approx(0.05 * 2.0)  # the prior: 2 tokens a step
    rule.shared.observe(3, 4, 4)  # 5 tokens committed
    rule.shared.observe(3, 4, 0)  # 1
    assert rule.shared.steps == 2 and rule.shared.tokens == 6
    assert rule.threshold() == pytest.approx(0.05 * (6 + 2) / (2 + 1))
    own = rule.new_counts()  # a seeded request's: its own tokens per step
    assert rule.threshold(own) == pytest.approx(0.05 * 2.0)
    fixed = AcceptanceDraftLength(0.3, 4)
    assert not fixed.wants_step_costs and fixed.threshold() == 0.3


def test_the_observed_row_cost_is_a_rows_slope_over_a_one_row_step():
    obs = ObservedRowCost()
    for i in range(10):
        obs.observe(1 + i % 5, 0.010 + 0.0005 * (1 + i % 5))
    assert obs.row_cost is None  # fewer steps than ROW_COST_MIN_STEPS weigh
    for i in range(30):
        obs.observe(1 + i % 5, 0.010 + 0.0005 * (1 + i % 5))  # T(n) = 10 ms + 0.5 ms a row
    assert obs.row_cost == pytest.approx(0.0005 / 0.0105)  # a row over a one-row step: 4.8 %
    obs.observe(3, 0.5)  # a pause (garbage collection): left out
    obs.observe(0, 0.01)  # no rows, no time: ignored
    obs.observe(2, 0.0)
    assert obs.row_cost == pytest.approx(0.0005 / 0.0105)
    for i in range(640):  # rows now cost 1 ms: the line follows (old steps weigh 0.5 ** 10 by now)
        obs.observe(1 + i % 5, 0.010 + 0.001 * (1 + i % 5))
    assert obs.row_cost == pytest.approx(0.001 / 0.011, rel=0.01)
    for i in range(640):  # every step 3× dearer for good (a long context): not a pause, learned
        obs.observe(1 + i % 5, 0.030 + 0.003 * (1 + i % 5))
    assert obs.row_cost == pytest.approx(0.003 / 0.033, rel=0.01)
    for _ in range(400):  # then only two-row steps: no spread to fit, the last usable r stays
        obs.observe(2, 0.040)
    assert obs._line() is None and obs.row_cost == pytest.approx(0.003 / 0.033, rel=0.01)
    flat = ObservedRowCost()
    for _ in range(40):
        flat.observe(5, 0.012)  # every step the same rows: no slope to fit
    assert flat.row_cost is None
    cheaper = ObservedRowCost()
    for i in range(60):
        cheaper.observe(1 + i % 2, 0.012 - 0.001 * (i % 2))  # more rows, less time (noise): r is 0
    assert cheaper.row_cost == 0.0


def test_requests_without_a_seed_take_the_observed_row_cost_and_seeded_ones_the_profile():
    rule = AcceptanceDraftLength("auto", 4)
    rule.set_step_costs({1: 0.010, 5: 0.012})  # profiled r = 0.05
    for i in range(40):
        rule.observe_step_time(1 + i % 5, 0.010 + 0.002 * (1 + i % 5))  # observed r = 2 / 12
    assert rule.threshold() == pytest.approx(2 / 12 * 2.0)  # Ê at its prior, 2 tokens a step
    assert rule.threshold(rule.new_counts()) == pytest.approx(0.05 * 2.0)  # timing-free for seeded ones
    before = AcceptanceDraftLength("auto", 4)
    for i in range(40):
        before.observe_step_time(1 + i % 5, 0.010)
    assert before.threshold() == 0.0  # nothing is cut before the profile
    fixed = AcceptanceDraftLength(0.3, 4)
    for i in range(40):
        fixed.observe_step_time(1 + i % 5, 0.010 + 0.002 * (1 + i % 5))
    assert fixed.threshold() == 0.3 and fixed.observed.row_cost is None  # a number is θ itself


def test_counts_follow_each_chain_as_far_as_it_was_verified():
    counts = AcceptanceCounts(4)
    counts.observe(1, 4, 1)  # the first accepted, the second rejected: the third and fourth never reached
    assert counts.reached[1][1:] == [1, 1, 0, 0] and counts.accepted[1][1:] == [1, 0, 0, 0]
    counts.observe(20, 3, 3)  # a long match: the last bucket
    assert counts.reached[MAX_MATCH_BUCKET][1:] == [1, 1, 1, 0]
    assert counts.accepted[MAX_MATCH_BUCKET][1:] == [1, 1, 1, 0]
    counts.observe(2, 0, 0)  # nothing verified: nothing counted
    assert counts.steps == 2 and sum(map(sum, counts.reached)) == 5
    assert counts.reached_total[1:] == [2, 2, 1, 0] and counts.accepted_total[1:] == [2, 1, 1, 0]


def test_a_chain_is_cut_where_its_estimated_acceptance_falls_below_the_threshold():
    # After one-token matches: 100 chains of 4, 20 accepted whole, 80 rejected at the first draft.
    rule = AcceptanceDraftLength(0.0, 4)
    for i in range(100):
        rule.shared.observe(1, 4, 4 if i < 20 else 0)
    # Position 1 pooled over the buckets (only bucket 1 has counts): (20 + 1) / (100 + 2); positions 2-4:
    # (20 + 1) / (20 + 2). Each bucket's rate: (accepted + 2 pooled) / (reached + 2).
    p1, p2 = 21 / 102, 21 / 22
    a1, a_rest = (20 + 2 * p1) / 102, (20 + 2 * p2) / 22
    expected = [a1, a1 * a_rest, a1 * a_rest**2, a1 * a_rest**3]  # 0.2001, 0.1993, 0.1985, 0.1977
    assert rule.shared.acceptance(1) == pytest.approx(expected)
    assert rule.length(1, 4) == 4  # θ = 0: never cut
    rule.fixed = (expected[1] + expected[2]) / 2  # between the second draft's chance and the third's
    assert rule.length(1, 4) == 2 and rule.length(1, 1) == 1 and rule.length(1, 0) == 0
    # A bucket without counts takes the pooled rates: 0.206, 0.197, ...: one draft at this θ
    assert rule.shared.acceptance(2) == pytest.approx([p1, p1 * p2, p1 * p2**2, p1 * p2**3])
    assert rule.length(2, 4) == 1
    assert AcceptanceDraftLength(0.5, 4).length(1, 4) == 1  # at least one draft


def test_a_position_past_every_cut_still_learns_from_longer_matches():
    """One-token matches cut at one draft never reach position 2; the bucket of long matches does, and
    its acceptance there reopens the cut (the pooled prior)."""
    rule = AcceptanceDraftLength(0.1, 4)
    for _ in range(50):
        rule.shared.observe(1, 1, 0)  # one-token matches: one draft, rejected
        rule.shared.observe(1, 1, 1)  # ... or accepted
    assert rule.shared.reached[1][2] == 0
    before = rule.shared.acceptance(1)[1]  # position 2 at the uninformed prior: 0.5 × 0.5
    assert before == pytest.approx(0.5 * 0.5, rel=0.02)
    for _ in range(50):
        rule.shared.observe(9, 4, 4)  # long matches: every draft accepted
    after = rule.shared.acceptance(1)[1]
    assert after == pytest.approx(0.5 * (0 + 2 * (50 + 1) / (50 + 2)) / 2, rel=0.02)  # ~0.49
    assert rule.length(1, 4) == 4


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
    shared = d.length_rule.shared
    assert shared.reached[1][1:] == [1, 0, 0, 0] and shared.accepted[1][1:] == [1, 0, 0, 0]
    # pooled position 1: 2/3; bucket 1: (1 + 4/3) / 3 = 7/9; position 2 at the prior 1/2, 3 likewise
    assert shared.acceptance(1)[:3] == pytest.approx([7 / 9, 7 / 18, 7 / 36])
    (p,) = d.propose([DraftInput(_request([1, 2, 3, 4, 5, 6, 7, 1], "b"), 8, 4)])  # the shared counts
    assert p.token_ids == [2, 3]  # 0.78, 0.39, then 0.19 < 0.3
    seeded = Request("c", [1, 2, 3, 4, 5, 6, 7, 1], SamplingParams(temperature=1.0, seed=5, max_tokens=8), 0)
    (p,) = d.propose([DraftInput(seeded, 8, 4)])
    assert p.token_ids == [2]  # a seeded request's own counts: none yet (0.5, then 0.25)
    seeded.token_ids.extend([2, 3])
    d.on_verified(seeded, 1, 1)
    assert d._own_counts["c"].steps == 1 and shared.steps == 1  # its chains teach only itself
    tree = SpeculativeConfig("suffix", 4, tree="dynamic")
    t = SuffixDrafter(DrafterContext(None, tree, None, torch.float32, torch.device("cpu"), None))  # type: ignore[arg-type]
    assert t.length_rule is None and not t.wants_step_costs  # trees keep SuffixDecoding's budget alone
