"""Speculation policies (``specdec/policies/``): the registry and config errors, the batch-size schedule,
and exactness with the draft depth varying step to step and request to request: greedy output equal to
plain decoding under every policy, and a chi-square test of the sampled distribution (with a negative
control that must fail) under a policy that varies the depth."""

from __future__ import annotations

import itertools
import logging
import zlib

import numpy as np
import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from specdec.config import SpeculativeConfig
from specdec.errors import ConfigError
from specdec.policies import PolicyContext, PolicyInput, build_policy, policy_names, register_policy
from specdec.policies.batch_size import BatchSizePolicy, default_schedule
from tests.conftest import first_three_logits, first_two_token_counts, save_target_and_draft
from tests.stats import ALPHA, assert_differs, goodness_of_fit
from tests.test_rejection_sampler import AcceptEverything

V = 8
PROMPT = [3, 4, 5, 6, 7, 3, 4, 5]


@register_policy("test_varying")
class VaryingPolicy:
    """A depth in ``0 .. max_drafts`` from a hash of the request id and its length: varies step to step
    and request to request, from the committed history alone. Records its answers."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.answers: list[tuple[int, int]] = []

    def decide(self, batch: list[PolicyInput]) -> list[int]:
        out = []
        for x in batch:
            key = f"{x.request.request_id}/{len(x.request.token_ids)}".encode()
            out.append(zlib.crc32(key) % (x.max_drafts + 1))
            self.answers.append((x.max_drafts, out[-1]))
        return out


@register_policy("test_faulty")
class FaultyPolicy:
    """Raises for requests whose prompt starts with token 7, answers -1 for those starting with 6."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.k = ctx.num_speculative_tokens

    def decide(self, batch: list[PolicyInput]) -> list[int]:
        out = []
        for x in batch:
            if x.request.prompt_token_ids[0] == 7:
                raise RuntimeError("policy bug")
            out.append(-1 if x.request.prompt_token_ids[0] == 6 else x.max_drafts)
        return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    target = save_target_and_draft(root, V, 1, 2)
    l1, l2, _ = first_three_logits(target, PROMPT, V)
    exact = (torch.softmax(l1, -1)[:, None] * torch.softmax(l2, -1)).numpy()  # joint of t1, t2 at T = 1
    return {"target": root / "target", "draft": root / "draft", "exact": exact}


def _spec(setup, method: str, policy: str, k: int = 3, **kwargs) -> dict:
    spec = {"method": method, "num_speculative_tokens": k, "policy": policy, **kwargs}
    if method == "draft_model":
        spec["model"] = str(setup["draft"])
    return spec


# ----------------------------------------------------------------------------------- config errors
def test_registry_and_config_errors_name_the_field():
    assert {"static", "batch_size", "goodput", "ucb"} <= set(policy_names())
    with pytest.raises(ConfigError, match=r"unknown speculation policy 'nope'; registered: .*batch_size"):
        SpeculativeConfig(method="ngram", policy="nope")
    with pytest.raises(ConfigError, match=r"k in 0\.\.4"):
        SpeculativeConfig(method="ngram", policy="batch_size", policy_kwargs={"schedule": [[4, 9]]})
    with pytest.raises(ConfigError, match="batch sizes must increase"):
        SpeculativeConfig(method="ngram", policy="batch_size", policy_kwargs={"schedule": [[8, 2], [4, 1]]})
    with pytest.raises(ConfigError, match="bad policy_kwargs"):
        SpeculativeConfig(method="ngram", policy="batch_size", policy_kwargs={"shedule": [[4, 1]]})
    with pytest.raises(ConfigError, match="policy_kwargs must be a dict"):
        SpeculativeConfig(method="ngram", policy="static", policy_kwargs=[1])
    with pytest.raises(ConfigError, match="policy must be"):
        SpeculativeConfig(method="ngram", policy=3)
    with pytest.raises(ConfigError, match="already registered"):
        register_policy("static")(VaryingPolicy)


def test_llm_rejects_a_bad_policy_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="unknown speculation policy"):
        LLM(tmp_path / "missing", speculative_config={"method": "ngram", "policy": "nope"})


def test_batch_size_schedule():
    policy = build_policy("batch_size", PolicyContext(4), {"schedule": [[1, 4], [4, 2], [16, 1]]})
    assert [policy.depth_for(b) for b in (1, 2, 4, 5, 16, 17, 64)] == [4, 2, 2, 1, 1, 0, 0]
    assert default_schedule(5) == [[4, 5], [8, 3], [16, 1]]
    assert BatchSizePolicy(PolicyContext(1)).schedule == [(4, 1), (8, 1), (16, 1)]


# ----------------------------------------------------------------------------------- goodput
def _inputs(spec_stats_list, batch_size=None, cap=4, out=0):
    from types import SimpleNamespace

    n = len(spec_stats_list)
    reqs = [
        SimpleNamespace(spec_stats=st, request_id=str(i), token_ids=[1], num_output_tokens=out)
        for i, st in enumerate(spec_stats_list)
    ]
    return [PolicyInput(r, cap, batch_size or n, n) for r in reqs]


def _stats(accepted, drafted):
    from specdec.metrics import SpecStats

    st = SpecStats(len(accepted))
    st.accepted_per_position, st.drafted_per_position = list(accepted), list(drafted)
    return st


def test_expected_tokens_is_leviathans_formula():
    from specdec.policies.goodput import expected_tokens

    alpha = 0.7
    q = [alpha ** (i + 1) for i in range(4)]
    # Leviathan et al. 2023, eq. (1): (1 - alpha^(k+1)) / (1 - alpha) for i.i.d. acceptance
    for k in range(5):
        assert expected_tokens(q, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))


def test_goodput_weighs_acceptance_against_the_step_cost():
    cheap = {"step_s": [[1, 0.010], [64, 0.012]], "frozen": True}
    steep = {"step_s": [[1, 0.010], [2, 0.020], [64, 0.64]], "frozen": True}  # each token costs a whole step
    good = _stats([90, 80, 70, 60], [100, 100, 100, 100])
    bad = _stats([2, 0, 0, 0], [100, 90, 80, 70])
    policy = build_policy("goodput", PolicyContext(4), cheap)
    assert policy.decide(_inputs([good])) == [4]  # verification nearly free, acceptance high: all of k
    assert policy.decide(_inputs([good, bad])) == [4, 0]  # the hopeless request alone drafts nothing
    assert build_policy("goodput", PolicyContext(4), steep).decide(_inputs([good, good])) == [0, 0]
    from specdec.policies import StepObservation

    # A request granted one draft at a time, always accepted, expects the same deeper on (its figure at
    # position 1 times the population's acceptance at i given i - 1, i.i.d. where nobody drafted that
    # deep): with each token at a quarter of a step, 4 drafts (E = 4.8) beat 1 (E = 1.98). Shrunk towards
    # prior_acceptance ** i instead (0.25, 0.125, ...), one draft looked best and it never went deeper.
    quarter = {"step_s": [[n, 0.0075 + 0.0025 * n] for n in range(1, 9)], "frozen": True}
    sure = _stats([50, 0, 0, 0], [50, 0, 0, 0])
    sure_policy = build_policy("goodput", PolicyContext(4), quarter)
    for _ in range(50):
        sure_policy.observe_step(StepObservation(2, 0.0125, 0.0, 1, ((1, 1),)))
    assert sure_policy.decide(_inputs([sure])) == [4]
    # A fresh request starts from the population's figures, learned from the steps observed.
    learner = build_policy("goodput", PolicyContext(4), {**cheap, "prior_acceptance": 0.0})
    assert learner.decide(_inputs([None])) == [0]  # prior: nothing is ever accepted
    for _ in range(50):
        learner.observe_step(StepObservation(5, 0.01, 0.0, 4, ((4, 4),)))
    assert learner.decide(_inputs([None])) == [4]
    assert learner.costs.step_s == {1: 0.010, 64: 0.012}  # frozen: observed times ignored


def test_goodput_learns_step_costs_when_not_frozen():
    from specdec.policies import StepObservation

    policy = build_policy("goodput", PolicyContext(4), {"prior_acceptance": 0.6})
    for _ in range(30):
        policy.observe_step(StepObservation(1, 0.010, 0.0, 0, ()))
        policy.observe_step(StepObservation(5, 0.060, 0.0, 4, ((4, 1),)))
    assert policy.costs.target_s(5) == pytest.approx(0.060, rel=0.05)
    assert policy.decide(_inputs([None])) == [0]  # 5 tokens cost 6 steps here: drafting cannot pay
    # Drafting seconds: the first drafting step observed sets them (a running mean from the unknown 0
    # would let a slow drafter draft as if free for tens of steps); later steps move them by the decay.
    from specdec.policies.cost_model import StepCostModel

    costs = StepCostModel({1: 0.010})
    costs.observe(1, 0.010, 0, 0.5)  # no drafts: no drafting cost learned
    assert costs.draft_s(4) == 0.0
    costs.observe(5, 0.012, 4, 0.040)
    assert costs.draft_s(4) == pytest.approx(0.040)
    costs.observe(5, 0.012, 4, 0.080)
    assert costs.draft_s(4) == pytest.approx(0.9 * 0.040 + 0.1 * 0.080)
    # Per bucket of drafting requests: 16 rows of a draft model cost more than one; 9-16 rows learn
    # apart from 1, 2-8 rows take the nearest bucket below (1), 32 the nearest below (16).
    costs.observe(20, 0.02, 4, 0.400, draft_rows=16)
    assert costs.draft_s(4, rows=16) == pytest.approx(0.400)
    assert costs.draft_s(4, rows=9) == pytest.approx(0.400)
    assert costs.draft_s(4, rows=1) == costs.draft_s(4, rows=8) == pytest.approx(0.9 * 0.040 + 0.1 * 0.080)
    assert costs.draft_s(4, rows=32) == pytest.approx(0.400)
    assert costs.draft_s(0, rows=16) == 0.0
    given = StepCostModel({1: 0.010}, draft_s_per_position=0.001)  # given: a prior, corrected gradually
    given.observe(5, 0.012, 4, 0.040)
    assert given.draft_s_per_position == pytest.approx(0.9 * 0.001 + 0.1 * 0.010)


def test_cost_model_carries_the_observed_excess_to_untried_counts():
    from specdec.policies.cost_model import StepCostModel

    model = StepCostModel(step_s={1: 0.02, 8: 0.04, 16: 0.06})  # a profile of the forward alone
    assert model.target_s(16) == pytest.approx(0.06)  # nothing observed: the profile
    for _ in range(50):
        model.observe(8, 0.08, 0, 0.0)  # real steps of 8 tokens cost 40 ms more than the profile
    assert model.target_s(8) == pytest.approx(0.08)
    # Never played: the nearest played count plus the profile's increment (the excess as an amount; as
    # a ratio, 2x, it would price 16 tokens at 0.12 and 12 at 0.10).
    assert model.target_s(16) == pytest.approx(0.10)
    assert model.target_s(12) == pytest.approx(0.09)  # the profile interpolated, then the excess added
    assert model.target_s(1) == pytest.approx(0.06)  # below every played count: from the nearest above
    model.observe(16, 0.09, 0, 0.0)  # once played, a count follows its own steps
    assert model.target_s(16) == pytest.approx(0.09)
    assert model.target_s(12) == pytest.approx(0.05 + 0.035)  # between two: their excesses interpolated
    model.set_base({1: 0.01})  # a new profile forgets the corrections
    assert model.target_s(1) == 0.01 and model.target_s(2) == pytest.approx(0.01 * (1 + 1 / 64))
    frozen = StepCostModel(step_s={1: 0.02}, frozen=True)
    frozen.observe(1, 0.5, 0, 0.0)
    assert frozen.target_s(1) == 0.02


def test_cost_model_untried_counts_stay_positive_ordered_and_in_seconds():
    from specdec.policies.cost_model import StepCostModel

    # No curve (relative units): the nearest observed count's seconds scaled by the relative curve, not
    # an excess in seconds added to unitless numbers (which priced 5 tokens 2.6x a played 4).
    relative = StepCostModel()
    relative.observe(4, 0.010, 0, 0.0)
    assert relative.target_s(5) == pytest.approx(0.010 * (1 + 4 / 64) / (1 + 3 / 64))
    assert relative.target_s(1) == pytest.approx(0.010 / (1 + 3 / 64))
    relative.observe(8, 0.030, 0, 0.0)  # between two: their ratios to the relative curve interpolated
    ratios = (0.010 / (1 + 3 / 64), 0.030 / (1 + 7 / 64))
    assert relative.target_s(6) == pytest.approx((1 + 5 / 64) * (ratios[0] + ratios[1]) / 2)
    # Steps cheaper than profiled: below the observed counts the cost scaled by the profile is the floor
    # (the negative excess alone would leave 0.003 s, or nothing with a larger gap).
    cheap = StepCostModel({1: 0.018, 8: 0.020})
    cheap.observe(8, 0.005, 0, 0.0)
    assert cheap.target_s(1) == pytest.approx(0.005 * 0.018 / 0.020)
    # Between two observed counts: their excesses interpolated, so an untried count is not dearer than
    # the observed one above it (from the nearest below alone, 12 tokens came to 0.050 against 16's 0.041).
    between = StepCostModel({1: 0.010, 16: 0.030})
    between.observe(1, 0.030, 0, 0.0)
    between.observe(16, 0.041, 0, 0.0)
    assert between.target_s(1) < between.target_s(12) < between.target_s(16)
    assert between.target_s(12) == pytest.approx(0.010 + 11 / 15 * 0.020 + 4 / 15 * 0.020 + 11 / 15 * 0.011)
    # A step batches at least one token: anything else is a caller's mistake, named.
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="num_tokens"):
            between.target_s(bad)
    assert between.target_s(np.int64(12)) == between.target_s(12)
    # A step observed with a count that is not one teaches nothing (it would otherwise be stored and
    # break later predictions that look it up); numpy integers are counts, stored as Python ints.
    learner = StepCostModel({np.int64(1): 0.010, 16: 0.030})
    learner.observe(2.5, 0.5, 0, 0.0)
    learner.observe(True, 0.5, 0, 0.0)
    assert learner.target_s(3) == pytest.approx(0.010 + 2 / 15 * 0.020)
    learner.observe(np.int64(4), 0.020, 0, 0.0)
    assert learner.target_s(4) == pytest.approx(0.020)
    assert [type(c) for c in learner._observed_counts(0)] == [int]
    with pytest.raises(ConfigError, match="step_s entries"):
        StepCostModel({True: 0.010})


def test_a_count_observed_long_ago_follows_steps_growing_dearer():
    from specdec.policies.cost_model import StepCostModel

    # 32 requests: plain steps of 32 tokens, drafting steps of 48 early on (shorter contexts), then
    # plain only while attention over the growing contexts makes every step dearer (1.6x -> 2.4x the
    # profile). The 48-token steps' correction follows: they stay dearer than plain ones by about the
    # profile's factor (1.29 here), where an absolute correction made them 0.86x a plain step (drafting
    # looked free).
    model = StepCostModel({32: 0.0186, 33: 0.0218, 64: 0.0263})
    for _ in range(20):
        model.observe(32, 0.0186 * 1.6, 0, 0.0)
        model.observe(48, 0.0240 * 1.6, 1, 0.0)
    assert model.target_s(48) / model.target_s(32) == pytest.approx(0.024 / 0.0186)
    for _ in range(40):
        model.observe(32, 0.0186 * 2.4, 0, 0.0)
    assert model.target_s(32) == pytest.approx(0.0186 * 2.4, rel=0.05)
    assert 1.2 < model.target_s(48) / model.target_s(32) < 0.024 / 0.0186 + 1e-9


def test_a_pause_does_not_reprice_every_count():
    from specdec.policies.cost_model import FIRST_CLIP, STEP_CLIP, StepCostModel

    # 16 requests decoding (16 tokens) and drafting (40), then one 16x pause at 16 tokens (the engine's
    # 360 ms step among 21 ms ones at 16 HumanEval requests). Unbounded, it moved the drift index by
    # 150 % at once, and the next normal 16-token step dragged every count down by as much.
    model = StepCostModel({16: 0.020, 32: 0.025, 64: 0.030})
    for _ in range(30):
        model.observe(16, 0.022, 0, 0.0)
        model.observe(40, 0.031, 2, 0.0)
    counts = (16, 24, 40, 64)
    before = {n: model.target_s(n) for n in counts}
    model.observe(16, 16 * 0.022, 0, 0.0)
    # the drift index moves by decay * (STEP_CLIP - 1) at most; the count's own correction a little more
    bound = (1 + 0.1 * (STEP_CLIP - 1)) * (1 + 0.2 * 0.1 * (STEP_CLIP - 1))
    for n in counts:
        assert before[n] < model.target_s(n) <= before[n] * bound + 1e-12
    model.observe(16, 0.022, 0, 0.0)  # a normal step again: nothing is dragged below where it was
    for n in (24, 40, 64):
        assert model.target_s(n) >= before[n] * 0.999
    # A count's first step, a pause too: taken at FIRST_CLIP times its prediction at most; a cheaper one
    # outright (a step is not fast by accident).
    predicted = model.target_s(48)
    model.observe(48, 10 * predicted, 2, 0.0)
    assert model.target_s(48) == pytest.approx(FIRST_CLIP * predicted)
    cheap = model.target_s(56) / 2
    model.observe(56, cheap, 2, 0.0)
    assert model.target_s(56) == pytest.approx(cheap)
    # numpy times are stored as Python floats
    model.observe(16, np.float32(0.022), 0, 0.0)
    assert type(model._drift[0]) is float


def test_a_lasting_change_is_still_learned_through_the_bound():
    from specdec.policies.cost_model import StepCostModel

    # Every step becomes 3x dearer (a neighbour process): the count's second step in a row beyond its
    # bound is taken as its cost, so the model follows it within two steps.
    model = StepCostModel({16: 0.020, 64: 0.030})
    for _ in range(20):
        model.observe(16, 0.022, 0, 0.0)
    for _ in range(40):
        model.observe(16, 0.066, 0, 0.0)
    assert model.target_s(16) == pytest.approx(0.066, rel=0.03)
    assert 0.066 + 0.0099 < model.target_s(64) < 0.066 * 0.030 / 0.020  # the excess carried as an amount
    # and back: the bound widens the other way too
    for _ in range(40):
        model.observe(16, 0.022, 0, 0.0)
    assert model.target_s(16) == pytest.approx(0.022, rel=0.03)
    # One count set far off (its first step a 3x pause, as dear as the bound lets it) learns its own cost
    # from its next steps, and does not drag the count played beside it along (through the drift index,
    # the plain count's price rose 3x before).
    model.observe(24, 3 * model.target_s(24), 1, 0.0)
    worst = 0.0
    for _ in range(10):
        model.observe(24, 0.025, 1, 0.0)
        model.observe(16, 0.022, 0, 0.0)
        worst = max(worst, model.target_s(16) / 0.022)
    assert worst < 1.06
    assert model.target_s(24) == pytest.approx(0.025, rel=0.05)


def test_an_untried_count_between_two_observed_ones_is_never_below_both():
    from specdec.policies.cost_model import StepCostModel

    # A profile far from linear between two observed counts: their excesses interpolated would price
    # 50 tokens below zero (and bound its first step there); no cheaper than both observed counts.
    model = StepCostModel({1: 0.010, 50: 0.011, 100: 1.0})
    model.observe(1, 0.010, 0, 0.0)
    model.observe(100, 0.010, 0, 0.0)
    assert model.target_s(50) >= min(model.target_s(1), model.target_s(100)) > 0
    model.observe(50, 0.011, 0, 0.0)
    assert model.target_s(50) == pytest.approx(0.011)


def test_goodput_never_prices_a_step_with_drafts_below_the_step_without():
    from specdec.policies import StepObservation

    # A cost curve whose plain count runs dear (a correction gone high) and whose drafting counts run
    # cheap: with nothing ever accepted, drafts must not look like a faster step.
    curve = {16: 0.040, 17: 0.020, 80: 0.022}
    frozen = {"step_s": curve, "frozen": True, "explore_every": 0}
    policy = build_policy("goodput", PolicyContext(4), {**frozen, "prior_acceptance": 0.0})
    assert policy.costs.target_s(24) < policy.costs.target_s(16)
    assert policy.decide(_inputs([None] * 16)) == [0] * 16
    # Learning costs: steps that cost what the policy priced them (the plain step's seconds, floored)
    # settle at a cost calibration of 1; settled unfloored, it climbed to its cap of 4 (drafting priced
    # four times too dear) within 50 steps.
    learner = build_policy("goodput", PolicyContext(4), {"step_s": curve, "prior_acceptance": 0.9})
    drafted = 0
    for _ in range(50):
        depths = learner.decide(_inputs([None] * 16))
        tokens = 16 + sum(depths)
        seconds = max(learner.costs.target_s(tokens), learner.costs.target_s(16))
        per_request = tuple((d, d) for d in depths if d)
        learner.observe_step(StepObservation(tokens, seconds, 0.0, max(depths), per_request, tokens))
        drafted += any(depths)
    assert drafted >= 40
    assert learner.cost_calibration == pytest.approx(1.0, abs=0.05)


def test_prompt_chunks_do_not_make_untried_decode_counts_look_cheap():
    from specdec.policies.cost_model import StepCostModel

    model = StepCostModel(step_s={1: 0.02, 8: 0.04, 512: 0.5})
    for _ in range(50):
        model.observe(8, 0.08, 0, 0.0)  # decode steps: twice the profile (attention over long contexts)
        model.observe(512, 0.5, 0, 0.0, prefill=True)  # prompt chunks: what the profile said
    # from the decode steps alone: their excess over the profile carried from 8 tokens
    assert model.target_s(16) == pytest.approx(0.08 + model.base_s(16) - model.base_s(8))
    assert model.target_s(16, prefill=True) == pytest.approx(model.base_s(16))
    assert model.target_s(512, prefill=True) == pytest.approx(0.5)
    # Through the engine: a step with a prompt chunk is reported as one.
    from specdec.policies import StepObservation

    policy = build_policy("goodput", PolicyContext(4), {"step_s": {1: 0.02, 8: 0.04}})
    policy.observe_step(StepObservation(300, 0.3, 0.0, 0, prefill=True))
    assert policy.costs.target_s(8) == pytest.approx(0.04)  # decode counts untouched


def test_profiled_costs_never_fall_with_more_tokens():
    from specdec.engine.cost_profile import monotone

    # A 5-token forward timed above an 8-token one (host noise) takes the 8-token figure.
    profiled = {1: 0.129, 2: 0.133, 4: 0.132, 5: 0.158, 8: 0.132, 16: 0.150}
    assert monotone(profiled) == {1: 0.129, 2: 0.132, 4: 0.132, 5: 0.132, 8: 0.132, 16: 0.150}
    assert monotone({}) == {}


def test_cost_model_learns_the_catch_up_cost_per_token():
    from specdec.policies.cost_model import StepCostModel

    costs = StepCostModel({1: 0.01})
    costs.observe(1, 0.01, 0, 0.0, catch_up_s=0.3, catch_up_tokens=100)  # nothing profiled: outright
    assert costs.catch_up_s_per_token == pytest.approx(0.003)
    costs.observe(1, 0.01, 0, 0.0, catch_up_s=0.1, catch_up_tokens=100)
    assert costs.catch_up_s_per_token == pytest.approx(0.9 * 0.003 + 0.1 * 0.001)
    costs.observe(1, 0.01, 0, 0.0)  # no catch-up this step: unchanged
    assert costs.catch_up_s_per_token == pytest.approx(0.9 * 0.003 + 0.1 * 0.001)
    profiled = StepCostModel({1: 0.01})
    profiled.set_draft_costs({1: 0.004}, catch_up_s_per_token=0.002)
    assert profiled.catch_up_s_per_token == 0.002 and profiled.draft_s(1) == 0.004
    frozen = StepCostModel({1: 0.01}, frozen=True)
    frozen.set_draft_costs({1: 0.004}, catch_up_s_per_token=0.002)
    frozen.observe(1, 0.01, 0, 0.0, catch_up_s=0.3, catch_up_tokens=100)
    assert frozen.catch_up_s_per_token == 0.0 and frozen.draft_s(1) == 0.0


def test_goodput_charges_the_catch_up_over_the_tokens_left():
    from types import SimpleNamespace

    def inputs(backlog, out, max_tokens=64):
        req = SimpleNamespace(
            spec_stats=_stats([95, 90, 85, 80], [100, 100, 100, 100]), request_id="r", token_ids=[1],
            num_output_tokens=out, sampling_params=SimpleNamespace(max_tokens=max_tokens),
        )  # fmt: skip
        return [PolicyInput(req, 4, 1, 1, 1, backlog)]

    # A draft position costs half a step; a draft model reads a backlog at 1 ms per token.
    kwargs = {"step_s": [[n, 0.010] for n in range(1, 9)], "draft_s_per_position": 0.005, "explore_every": 0}
    policy = build_policy("goodput", PolicyContext(4), kwargs)
    policy.costs.catch_up_s_per_token = 0.001
    # 150 tokens of prompt over 64 tokens left: 2.3 ms per committed token.
    assert policy.charges(inputs(150, 0)) == [pytest.approx(0.001 * 150 / 64)]
    assert policy.charges(inputs(0, 0)) == [0.0]
    assert policy.decide(inputs(0, 0)) == [4]  # caught up: E(4) = 4.5 tokens in 30 ms beats 1 in 10
    assert policy.decide(inputs(150, 0)) == [4]  # the prompt's catch-up spread over 64 tokens: still pays
    # The same backlog with 4 tokens left: 37.5 ms per committed token, drafting cannot repay it.
    assert policy.charges(inputs(150, 60)) == [pytest.approx(0.001 * 150 / 4)]
    assert policy.decide(inputs(150, 60)) == [0]
    off = build_policy("goodput", PolicyContext(4), {**kwargs, "charge_catch_up": False})
    off.costs.catch_up_s_per_token = 0.001
    assert off.charges(inputs(150, 60)) == [0.0] and off.decide(inputs(150, 60)) == [4]


def test_goodput_config_errors():
    for kwargs, match in [
        ({"prior_acceptance": 1.5}, "prior_acceptance"),
        ({"prior_weight": -1}, "prior_weight"),
        ({"frozen": True, "profile": False}, "frozen=True needs step_s or profile"),
        ({"charge_catch_up": 1}, "charge_catch_up"),
        ({"frozen": 1}, "booleans"),
        ({"explore_every": -1}, "explore_every"),
        ({"step_s": [[0, 0.01]]}, "step_s entries"),
        ({"step_s": "fast"}, "step_s"),
        ({"draft_s_per_position": -1.0}, "draft_s_per_position"),
    ]:
        with pytest.raises(ConfigError, match=match):
            SpeculativeConfig(method="ngram", policy="goodput", policy_kwargs=kwargs)


def test_frozen_goodput_repeats_seeded_runs_exactly(setup):
    spec = _spec(
        setup,
        "draft_model",
        "goodput",
        k=3,
        policy_kwargs={"step_s": [[1, 0.01], [32, 0.02]], "frozen": True},
    )
    runs = []
    for _ in range(2):
        llm = LLM(setup["target"], skip_tokenizer_init=True, block_size=4, speculative_config=spec)
        params = [
            SamplingParams(temperature=1.0, max_tokens=12, seed=100 + i, ignore_eos=True) for i in range(4)
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params)
        runs.append(([list(o.outputs[0].token_ids) for o in outs], list(llm.engine.policy.history)))
    assert runs[0] == runs[1]
    assert {k for _, k in runs[0][1]} != {0}  # it did speculate


def test_goodput_explores_a_request_whose_estimate_sank():
    dear = {"step_s": [[1, 0.010], [2, 0.012], [64, 0.5]], "frozen": True, "explore_every": 8}
    hopeless = _stats([0, 0, 0, 0], [100, 100, 100, 100])
    policy = build_policy("goodput", PolicyContext(4), dear)
    answers = [policy.decide(_inputs([hopeless], out=n))[0] for n in range(20)]
    assert answers == [0] * 8 + [1] + [0] * 7 + [1] + [0] * 3  # one probe per 8 of its tokens
    never = build_policy("goodput", PolicyContext(4), {**dear, "explore_every": 0})
    assert [never.decide(_inputs([hopeless], out=n))[0] for n in range(20)] == [0] * 20
    # A request held at one draft (one rejection at position 2 sank its estimate there) drafts two every
    # 8 of its tokens, at its own q_1 times the acceptance hoped for at position 2: one rejection would
    # otherwise keep it at one draft for good.
    quarter = {"step_s": [[n, 0.0075 + 0.0025 * n] for n in range(1, 9)], "frozen": True, "explore_every": 8}
    once = _stats([50, 0, 0, 0], [50, 1, 0, 0])
    policy = build_policy("goodput", PolicyContext(4), {**quarter, "prior_acceptance": 0.6})
    answers = [policy.decide(_inputs([once], out=n))[0] for n in range(20)]
    assert answers == [1] * 8 + [2] + [1] * 7 + [2] + [1] * 3
    # No probe where even the hoped-for acceptance cannot pay for the token (a step of 2 tokens costs 2).
    steep = {**dear, "step_s": [[1, 0.010], [2, 0.020], [64, 0.64]]}
    policy = build_policy("goodput", PolicyContext(4), steep)
    assert [policy.decide(_inputs([hopeless], out=n))[0] for n in range(20)] == [0] * 20


def test_goodput_probes_a_batch_together_where_one_probe_alone_cannot_pay():
    # A draft model's forward costs 8 ms for 1 or 8 rows and a step 10 ms up to 16 tokens: one request's
    # probe (+1 token hoped for 8 ms) cannot pay at 8 tokens per 10 ms, the 8 requests' together can
    # (16 tokens in 18 ms). Frozen costs, nothing drafted yet (the hope is the prior plus the bonus: 1).
    flat = {"step_s": [[1, 0.010], [16, 0.010], [64, 0.05]], "draft_s_per_position": 0.008}
    policy = build_policy("goodput", PolicyContext(4), {**flat, "frozen": True, "explore_every": 8})
    answers = [policy.decide(_inputs([None] * 8, out=n)) for n in range(10)]
    assert answers == [[0] * 8] * 8 + [[1] * 8] + [[0] * 8]
    alone = build_policy("goodput", PolicyContext(4), {**flat, "frozen": True, "explore_every": 8})
    assert [alone.decide(_inputs([None], batch_size=8, out=n))[0] for n in range(10)] == [0] * 10


def test_goodput_decides_a_large_batch_that_cannot_draft_in_linear_time(monkeypatch):
    # 32 requests, all due for a probe, on a step whose every token costs a plain step's share: no
    # probe pays. Probes alike in depth, hoped tokens and charge are scored once, so a decision takes a
    # few step scores, not one per request (the policy's Python sat on every step of a busy engine).
    steep = {"step_s": [[1, 0.010], [64, 0.64]], "frozen": True, "explore_every": 8}
    policy = build_policy("goodput", PolicyContext(4), steep)
    assert policy.decide(_inputs([None] * 32, out=0)) == [0] * 32
    calls = []
    score = policy._rate
    monkeypatch.setattr(policy, "_rate", lambda *a, **k: calls.append(a) or score(*a, **k))
    assert policy.decide(_inputs([None] * 32, out=8)) == [0] * 32
    assert len(calls) <= 8  # plain, k = 1..4, the step so far, all probes together, one probe
    # Probes scored one by one: a granted probe makes the next equal one worth scoring again. Steps cost
    # the same up to 6 tokens, then 100x: of 4 requests' equal probes (hoping for 1 token each) the first
    # two pay, the third does not, and the fourth, its equal, is not scored; all four together do not pay.
    knee = {"step_s": [[1, 0.010], [6, 0.010], [7, 1.0]], "frozen": True, "explore_every": 8}
    policy = build_policy("goodput", PolicyContext(4), {**knee, "prior_acceptance": 0.0})
    hopeless = _stats([0, 0, 0, 0], [100, 100, 100, 100])
    assert policy.decide(_inputs([hopeless] * 4, out=0)) == [0] * 4
    calls.clear()
    score = policy._rate
    monkeypatch.setattr(policy, "_rate", lambda *a, **k: calls.append(a) or score(*a, **k))
    assert policy.decide(_inputs([hopeless] * 4, out=8)) == [1, 1, 0, 0]
    assert len(calls) == 1 + 4 + 1 + 1 + 3  # plain, k = 1..4, the step so far, all together, 3 probes


def test_cost_model_predictions_are_kept_until_the_next_observation():
    from specdec.policies.cost_model import StepCostModel

    model = StepCostModel(step_s={1: 0.01, 8: 0.02})
    calls = []
    predict = model._predict
    model._predict = lambda n, prefill: calls.append(n) or predict(n, prefill)
    first = model.target_s(4)
    assert [model.target_s(4) for _ in range(3)] == [first] * 3 and calls == [4]  # predicted once
    assert first == pytest.approx(0.01 + 3 / 7 * 0.01)
    model.observe(4, 0.03, 0, 0.0)  # a step dearer than predicted: the prediction moves at once
    before = len(calls)
    assert model.target_s(4) == model.target_s(4) > first and len(calls) == before + 1
    model.set_base({1: 0.02, 8: 0.04})
    assert model.target_s(4) == pytest.approx(2 * first)
    model.step_s = {1: 0.01, 8: 0.02}  # a curve replaced outright
    assert model.target_s(4) == pytest.approx(first)
    model.step_s[2] = 0.011  # grown
    assert model.target_s(2) == 0.011
    frozen = StepCostModel(step_s={1: 0.01, 8: 0.02}, frozen=True)
    frozen.observe(4, 0.03, 0, 0.0)
    assert frozen.target_s(4) == pytest.approx(first)


def test_cost_model_follows_a_replaced_or_grown_base_curve():
    from specdec.policies.cost_model import StepCostModel

    model = StepCostModel(step_s={1: 0.01, 9: 0.03})
    assert model.base_s(5) == pytest.approx(0.02)
    model.step_s[5] = 0.05  # grown in place
    assert model.base_s(5) == pytest.approx(0.05) and model.base_s(7) == pytest.approx(0.04)
    model.step_s = {1: 0.02, 3: 0.04}  # replaced
    assert model.base_s(2) == pytest.approx(0.03)
    assert model.base_s(5) == pytest.approx(0.04 / (1 + 2 / 64) * (1 + 4 / 64))  # the prior slope past 3


def test_goodput_calibration_stops_drafts_whose_estimates_run_high():
    # Each token costs a quarter of a step; the request's history says 90 % acceptance, but the drafts
    # granted on it are never accepted (the winner's curse, exaggerated): settled against its spec_stats,
    # the calibration falls and the policy stops drafting; without calibration it drafts on.
    costs = {
        "step_s": [[n, 0.0075 + 0.0025 * n] for n in range(1, 9)],
        "frozen": True,
        "explore_every": 0,
        "margin": 0.0,  # the calibration alone (the margin: next test)
    }
    answers = {}
    for calibrate in (True, False):
        policy = build_policy("goodput", PolicyContext(4), {**costs, "calibrate": calibrate})
        stats = _stats([90, 81, 73, 66], [100, 100, 100, 100])
        inputs = _inputs([stats])
        answers[calibrate] = []
        for _ in range(14):
            (depth,) = policy.decide(inputs)
            answers[calibrate].append(depth)
            stats.num_drafts += depth > 0  # verified, nothing accepted
            stats.num_draft_tokens += depth
    # Granted 4 drafts predict 3.1 accepted tokens, 0 realised: the ratio (0 + 8) / (3.1 + 8) = 0.72
    # after one step, and so on; the depth falls, until one draft (0.9 predicted) no longer pays for a
    # quarter of a step (ratio < 0.28).
    assert answers[True] == [4, 4, 4, 4, 3, 2, 2, 1, 1, 1, 1, 1, 0, 0]
    assert answers[False] == [4] * 14
    assert policy.calibration == 1.0
    # A drafter that found nothing (no verification) is no evidence either way; one that proposed a
    # single token of the 4 granted, accepted, is settled on that token alone (predicted 0.9, realised
    # 1): the ratio rises.
    policy = build_policy("goodput", PolicyContext(4), costs)
    stats = _stats([90, 81, 73, 66], [100, 100, 100, 100])
    assert [policy.decide(_inputs([stats]))[0] for _ in range(8)] == [4] * 8
    assert policy.calibration == 1.0
    for _ in range(8):
        assert policy.decide(_inputs([stats])) == [4]
        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens = (
            stats.num_drafts + 1,
            stats.num_draft_tokens + 1,
            stats.num_accepted_tokens + 1,
        )
    assert policy.calibration > 1.0
    with pytest.raises(ConfigError, match="calibration_weight"):
        build_policy("goodput", PolicyContext(4), {"calibration_weight": 0})
    with pytest.raises(ConfigError, match="calibration_decay"):
        build_policy("goodput", PolicyContext(4), {"calibration_decay": 1.5})
    with pytest.raises(ConfigError, match="calibrate"):
        build_policy("goodput", PolicyContext(4), {"calibrate": "yes"})


def test_goodput_calibration_per_position_finds_the_depth_a_pooled_one_misses():
    # The request's history says 90 % acceptance at every position; its granted drafts are accepted at
    # position 1 and never further on. A quarter of a step per token: one draft pays (2 tokens for 1.25
    # steps), deeper ones do not (2 tokens for 1.5 steps or more). One calibration for all positions mixes
    # the first position's success with the others' failure and keeps drafting 3; one per position settles
    # at 1, its deeper factors falling while the first stays near 1 (aged at every decision, the deeper
    # ones recover now and then and a second draft is tried again).
    costs = {
        "step_s": [[n, 0.0075 + 0.0025 * n] for n in range(1, 9)],
        "frozen": True,
        "explore_every": 0,
        "margin": 0.0,
    }
    answers, factors = {}, {}
    for per_position in (True, False):
        kwargs = {**costs, "calibration_per_position": per_position}
        policy = build_policy("goodput", PolicyContext(4), kwargs)
        stats = _stats([90, 81, 73, 66], [100, 100, 100, 100])
        inputs = _inputs([stats])
        answers[per_position] = []
        for _ in range(40):
            (depth,) = policy.decide(inputs)
            answers[per_position].append(depth)
            stats.num_drafts += depth > 0  # verified: the first draft accepted, the rest rejected
            stats.num_draft_tokens += depth
            stats.num_accepted_tokens += depth > 0
        factors[per_position] = policy.calibrations
    assert answers[False] == [4] * 11 + [3] * 29
    assert answers[True][:16] == [4, 4, 3, 3] + [2] * 9 + [1] * 3
    assert answers[True][16:].count(1) == 20 and set(answers[True][16:]) == {1, 2}
    assert factors[False] == [pytest.approx(0.441, abs=1e-3)] * 4
    assert factors[True][0] > 1 > 0.5 > factors[True][1] > factors[True][2] > factors[True][3]
    with pytest.raises(ConfigError, match="calibration_per_position"):
        build_policy("goodput", PolicyContext(4), {"calibration_per_position": 1})


def _simulated_goodput(
    calibrate_costs: bool,
    acceptance: float,
    batch: int = 16,
    steps: int = 400,
    pause_at: int = -1,
    check: bool = False,
):
    """A goodput policy over ``steps`` simulated decode steps of ``batch`` requests: its profile prices
    each extra batched token at 1 % of a one-token step, the machine at 3 % (plus drafting, 0.5 ms a
    position), and the drafter proposes 1 .. granted drafts, each accepted with ``acceptance`` (seeded);
    step ``pause_at`` takes 20 times its time (a pause); ``check``: the realised-speedup check on. Returns
    (committed tokens per second ÷ plain decoding's, the policy)."""
    import random
    from types import SimpleNamespace

    from specdec.metrics import SpecStats
    from specdec.policies import StepObservation

    rng = random.Random(0)
    profile = [[n, 0.010 * (1 + 0.01 * (n - 1))] for n in (1, 8, 16, 32, 64, 96)]
    policy = build_policy(
        "goodput", PolicyContext(4), {"step_s": profile, "calibrate_costs": calibrate_costs, "check": check}
    )
    reqs = [
        SimpleNamespace(
            spec_stats=SpecStats(4), request_id=str(i), token_ids=[1], num_output_tokens=0,
            sampling_params=SimpleNamespace(max_tokens=10**6),
        )
        for i in range(batch)
    ]  # fmt: skip
    seconds = committed = 0.0
    for step in range(steps):
        depths = policy.decide([PolicyInput(r, 4, batch, batch) for r in reqs])
        tokens, per_request, step_committed = batch, [], batch
        for r, d in zip(reqs, depths):
            r.num_output_tokens += 1
            committed += 1
            if d:
                proposed = rng.randint(1, d)
                accepted = 0
                while accepted < proposed and rng.random() < acceptance:
                    accepted += 1
                st = r.spec_stats
                st.num_drafts, st.num_draft_tokens = st.num_drafts + 1, st.num_draft_tokens + proposed
                st.num_accepted_tokens += accepted
                for j in range(proposed):
                    st.drafted_per_position[j] += 1
                    st.accepted_per_position[j] += j < accepted
                tokens += proposed
                committed += accepted
                step_committed += accepted
                per_request.append((proposed, accepted))
        target_s = (
            0.010 * (1 + 0.03 * (tokens - 1)) * rng.uniform(0.95, 1.05) * (20 if step == pause_at else 1)
        )
        draft_s = 0.0005 * max(depths)
        seconds += target_s + draft_s
        depth = max((p for p, _ in per_request), default=0)
        policy.observe_step(
            StepObservation(tokens, target_s, draft_s, depth, tuple(per_request), step_committed)
        )
    plain = batch / (0.010 * (1 + 0.03 * (batch - 1)))
    return committed / seconds / plain, policy


def test_goodput_cost_calibration_stops_drafts_the_cost_model_prices_low():
    # The profile prices drafts at a third of what they cost, and a drafting step's shape (how many drafts
    # the drafter found) seldom repeats: the cost model's corrections follow the plain steps, and without
    # the cost calibration goodput drafts at every step at 30 % acceptance, below plain decoding. Settling
    # the drafting steps' extra seconds against their prediction stops it after its first drafting step;
    # as that evidence ages it tries again now and then (19 of 400 steps here; 9 before the cost model
    # bounded its observations), and stops again.
    speed, policy = _simulated_goodput(False, 0.3)
    assert speed < 0.97 and sum(d > 0 for _, d in policy.history) == 400 and policy.cost_calibration == 1.0
    speed, policy = _simulated_goodput(True, 0.3, steps=1)
    assert policy.cost_calibration > 1.2  # after one drafting step
    speed, policy = _simulated_goodput(True, 0.3)
    assert speed > 0.99 and sum(d > 0 for _, d in policy.history) <= 20
    # One pause (a drafting step at 20x its time) does not end drafting where drafts pay: its extra
    # seconds are capped, and the evidence ages.
    _, policy = _simulated_goodput(True, 0.6, pause_at=50)
    assert sum(d > 0 for _, d in list(policy.history)[200:]) == 200
    # Where drafts pay (60 %), it drafts on, as fast as without it (the realised extra seconds match the
    # corrected predictions: calibration ~1).
    fast, policy = _simulated_goodput(True, 0.6)
    assert fast > 1.1 and fast == pytest.approx(_simulated_goodput(False, 0.6)[0], rel=0.02)
    assert policy.cost_calibration == pytest.approx(1.0, abs=0.1)
    # Frozen costs (the deterministic mode) take no measured time: no cost calibration.
    frozen = build_policy("goodput", PolicyContext(4), {"step_s": [[1, 0.01]], "frozen": True})
    assert not frozen.calibrate_costs and frozen.cost_calibration == 1.0
    for bad in ({"calibrate_costs": 1}, {"cost_calibration_weight": 0}, {"cost_calibration_weight": True}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            build_policy("goodput", PolicyContext(4), bad)


def test_realised_speedup_check_compares_the_arms_per_bucket():
    from specdec.policies.speedup_check import RealisedSpeedupCheck

    check = RealisedSpeedupCheck(min_steps=3, recheck_every=4, decay=1.0)

    def step(batch, drafting, plain=(16, 0.009), prefill=False):
        """One step that wants to draft: the verdict, the decision (drafted where the verdict let it) and
        the measurement, ``drafting`` or ``plain`` (tokens, seconds) as it went."""
        verdict = check.allow(batch, prefill)
        check.record(batch, 0.01, verdict, prefill)
        committed, seconds = drafting if verdict else plain
        check.observe(committed, seconds, 0.0, prefill, verdict)
        return verdict

    assert step(16, (20, 0.011))  # nothing measured: drafting goes through
    for _ in range(2):
        step(16, (20, 0.011))  # drafting: 20 tokens in 11 ms against 16 in 10 ms predicted: 1.136
    assert [round(a.mean, 3) for a in check.arms[16]] == [pytest.approx(float("nan"), nan_ok=True), 1.136]
    # Drafting measured, plain not: every 4th decision of the bucket (counted from its first measured
    # step) a plain step (16 tokens in 9 ms: 1.111), until the plain arm holds 3 steps.
    got = [step(16, (20, 0.011)) for _ in range(12)]
    assert [i for i, v in enumerate(got) if not v] == [1, 5, 9] and check.num_plain_probes == 3
    assert not check.suspended(16) and step(16, (20, 0.011))  # drafting ahead (1.136): it goes on
    for _ in range(9):
        step(16, (17, 0.012))  # drafting now measured 0.885: the mean of 21 steps 1.039 < 1.111
    assert check.suspended(16)
    assert not check.suspended(8) and not check.suspended(32)  # other buckets are their own (9-16 is 16)
    assert check.suspended(9) and check.suspended(10)
    counts = (check.num_rechecks, check.num_suspended)
    got = [step(12, (17, 0.012), plain=(12, 0.0075)) for _ in range(8)]  # suspended: plain steps (1.0)
    assert got.count(True) == 2
    assert (check.num_rechecks, check.num_suspended) == (counts[0] + 2, counts[1] + 6)
    # A step with prompt chunks follows the suspension without advancing the count of decisions (so it
    # neither rechecks nor probes) and is not scored; nor are steps of no tokens, a step recorded plain
    # that verified drafts (a grammar's forced drafts), or a step with no decision recorded.
    before = ([(a.total, a.weight) for a in check.arms[16]], dict(check._decisions))
    assert not any(step(16, (40, 0.011), plain=(40, 0.011), prefill=True) for _ in range(8))
    assert dict(check._decisions) == before[1]
    step(16, (0, 0.011), plain=(0, 0.011))
    check.record(16, 0.01, False, False)
    check.observe(16, 0.01, 0.0, False, True)
    check.observe(16, 0.01, 0.0, False, False)
    assert [(a.total, a.weight) for a in check.arms[16]] == before[0]
    # A pause is clipped at half the plain prediction's speed.
    check.record(16, 0.01, False, False)
    check.observe(16, 1.0, 0.0, False, False)
    assert check.arms[16][0].total == pytest.approx(before[0][0][0] + 0.5)
    # The catch-up a lazy drafter was expected to pay (its backlog) comes out of the drafting seconds.
    other = RealisedSpeedupCheck(min_steps=1, recheck_every=4, decay=1.0)
    other.allow(4)
    other.record(4, 0.01, True, False, catch_up_s=0.004)
    other.observe(6, 0.01, 0.005, False, True)  # 6 tokens in 10 ms + 5 ms of drafting, 4 of it catch-up
    assert other.arms[4][1].mean == pytest.approx(6 / 0.011 / (4 / 0.01))
    # Asked request by request within one step (a policy whose batch call raised): one verdict, one
    # decision, drafted if any request drafted.
    for _ in range(5):
        other.allow(4)
    other.record(4, 0.01, False, False, catch_up_s=0.001)
    other.record(4, 0.01, True, False, catch_up_s=0.002)
    other.record(4, 0.01, False, False)
    assert other._pending[2:] == (pytest.approx(0.003), True)  # the catch-ups summed, drafted
    other.observe(4, 0.01, 0.003, False, True)
    assert other.arms[4][1].weight == 2 and other._decisions[4] == 1  # one step, one decision
    # A step left unobserved (its requests all failed while drafting, or observe_step no longer called)
    # does not carry its verdict or decision into the next: the policy begins each step afresh.
    other.allow(4)
    other.record(4, 0.01, True, False)
    other.begin_step()
    assert other._verdict is None and other._pending is None
    for kwargs, field in (
        ({"min_steps": 0}, "min_steps"),
        ({"min_steps": True}, "min_steps"),
        ({"recheck_every": 1}, "recheck_every"),
        ({"recheck_every": 2.0}, "recheck_every"),
        ({"decay": 0}, "decay"),
        ({"decay": 0.9, "min_steps": 10}, "not reached in 200 steps"),  # its weight stays below 10
    ):
        with pytest.raises(ConfigError, match=field):
            RealisedSpeedupCheck(**kwargs)


def test_realised_speedup_check_measures_a_stale_plain_arm_again():
    from specdec.policies.speedup_check import RealisedSpeedupCheck

    # A policy that drafts at every step: its plain arm is measured by probes, then again once its newest
    # plain step is recheck_every * min_steps = 8 decisions old.
    check = RealisedSpeedupCheck(min_steps=2, recheck_every=4, decay=1.0)
    got = []
    for _ in range(40):
        verdict = check.allow(8)
        check.record(8, 0.01, verdict, False)
        check.observe(10, 0.01, 0.0, False, verdict)
        got.append(verdict)
    plain = [i for i, v in enumerate(got) if not v]
    assert plain[:2] == [4, 8]  # the first two probes (decisions 4 and 8 of the bucket: indices 4, 8)
    assert all(b - a == 12 for a, b in itertools.pairwise(plain[1:]))  # then one every 12 decisions


def test_a_stale_plain_arm_does_not_lift_a_suspension():
    from specdec.policies.speedup_check import RealisedSpeedupCheck

    # Suspended, and its plain steps not scored (each verified drafts a grammar forced): the plain arm
    # goes stale, and a probe for it must not let drafting through at the other decisions.
    check = RealisedSpeedupCheck(min_steps=2, recheck_every=4, decay=1.0)
    for drafted, committed in ((True, 10), (True, 10), (False, 16), (False, 16)):
        check.allow(16)
        check.record(16, 0.01, drafted, False)
        check.observe(committed, 0.01, 0.0, False, drafted)
    assert check.suspended(16)
    got = []
    for _ in range(200):
        verdict = check.allow(16)
        check.record(16, 0.01, verdict, False)
        check.observe(16, 0.01, 0.0, False, True)  # forced drafts in the plain steps: not scored
        got.append(verdict)
    assert check.suspended(16) and sum(got) == 50  # only the rechecks (every 4th decision) drafted


def test_goodput_realised_speedup_check_stops_drafting_that_measures_slower():
    from specdec.policies import StepObservation

    # Acceptance estimates that run high (90 % at position 1 where nothing is accepted) and no calibration
    # to correct them: the policy drafts at every step, 16 requests at depth 4, on a machine where each
    # batched token costs 3 % of a one-token step. The check measures its drafting steps (after plain
    # probes: a policy that always drafts has no plain steps of its own) at 0.43 of its plain steps and
    # suspends drafting, but for a recheck at every 8th decision (which costs where drafting loses this
    # much; on the real engine it loses a few per cent).
    profile = [[n, 0.010 * (1 + 0.03 * (n - 1))] for n in (1, 16, 32, 64, 80)]
    kwargs = {"step_s": profile, "calibrate": False, "calibrate_costs": False, "explore_every": 0}
    inputs = _inputs([_stats([90, 81, 73, 66], [100] * 4)] * 16)
    for check in (False, True):
        extra = {"check": check, "check_min_steps": 4, "check_recheck_every": 8}
        policy = build_policy("goodput", PolicyContext(4), {**kwargs, **extra})
        seconds = 0.0
        for _ in range(200):
            depths = policy.decide(inputs)
            step_s = 0.010 * (1 + 0.03 * (16 + sum(depths) - 1))
            seconds += step_s
            per_request = tuple((d, 0) for d in depths if d)
            policy.observe_step(StepObservation(16 + sum(depths), step_s, 0.0, max(depths), per_request, 16))
        drafting = sum(d > 0 for _, d in policy.history)
        speed = 200 * 16 / seconds / (16 / profile[1][1])  # against plain decoding
        if not check:
            assert drafting == 200 and speed < 0.45
    # 4 drafting steps, then a plain probe at every 8th decision until the plain arm weighs 4 (5 probes
    # at decay 0.97), then suspended: 19 rechecks in the 160 decisions left.
    check = policy.speedup_check
    assert (check.num_plain_probes, check.num_rechecks, check.num_suspended) == (5, 19, 140)
    assert drafting == 200 - 5 - 140 and speed > 0.7
    # Where the policy's own cost model is off because it never saw a plain step (its profile prices
    # drafts at a third of their cost, the simulation of the cost calibration's test, calibration off), the
    # plain probes put it right: it stops drafting itself, 0.957 -> 0.995 of plain decoding here.
    slow, _ = _simulated_goodput(False, 0.3)
    speed, policy = _simulated_goodput(False, 0.3, check=True)
    assert slow < 0.97 and speed > 0.98 and policy.speedup_check.num_plain_probes >= 1
    # Where drafts pay (60 %) it never suspends, and the run is as fast as without it.
    fast, policy = _simulated_goodput(True, 0.6, check=True)
    assert policy.speedup_check.num_suspended == 0
    assert fast == pytest.approx(_simulated_goodput(True, 0.6)[0], rel=0.02)
    # Frozen costs (the deterministic mode): no check, as it reads measured times.
    frozen = build_policy("goodput", PolicyContext(4), {"step_s": [[1, 0.01]], "frozen": True})
    assert frozen.speedup_check is None
    bad_kwargs = (
        ({"check": 1}, "check"),
        ({"check_min_steps": 0}, "min_steps"),
        ({"check_recheck_every": 1}, "recheck_every"),
        ({"check_decay": 2}, "decay"),
    )
    for bad, field in bad_kwargs:
        with pytest.raises(ConfigError, match=field):
            build_policy("goodput", PolicyContext(4), bad)


def test_goodput_drafts_only_by_its_margin_over_plain_decoding():
    # One request, each token a quarter of a step (1 + 0.25 d steps for d drafts), every draft accepted
    # with probability q: one draft's rate (1 + q) / 1.25 beats plain's 1 by 2.4 % at q = 0.28, by 4 %
    # at q = 0.30. The default margin (3 %) drafts at 0.30 and not at 0.28; margin 0 drafts at both.
    costs = {"step_s": [[n, 0.0075 + 0.0025 * n] for n in range(1, 9)], "frozen": True, "explore_every": 0}
    cases = {}
    for margin in (0.03, 0.0):
        for q in (28, 30):
            policy = build_policy(
                "goodput",
                PolicyContext(1),
                {**costs, "calibrate": False, "prior_weight": 0.0, "margin": margin},
            )
            cases[margin, q] = policy.decide(_inputs([_stats([q], [100])], cap=1))[0]
    assert cases == {(0.03, 28): 0, (0.03, 30): 1, (0.0, 28): 1, (0.0, 30): 1}
    for bad in (-0.1, True, "0.1"):
        with pytest.raises(ConfigError, match="margin"):
            build_policy("goodput", PolicyContext(4), {"margin": bad})


def test_goodput_history_is_bounded():
    from specdec.policies.goodput import HISTORY

    policy = build_policy("goodput", PolicyContext(2), {"step_s": [[1, 0.01]], "frozen": True})
    for n in range(HISTORY + 10):
        policy.decide(_inputs([None], out=n))
    assert len(policy.history) == HISTORY


def test_step_costs_are_profiled_once_cached_and_keyed(setup, monkeypatch, tmp_path):
    import json

    from specdec.engine import cost_profile

    monkeypatch.setenv("SPECDEC_STEP_COSTS", str(tmp_path / "step_costs.json"))
    spec = _spec(setup, "ngram", "goodput", k=3)
    llm = LLM(setup["target"], skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    engine = llm.engine
    _greedy(llm, PROMPTS[:2])
    profiled = dict(engine._step_costs)
    counts = cost_profile.token_counts(engine)
    assert sorted(profiled) == counts and counts[:3] == [1, 2, 4] and 4 in counts  # 4 = k + 1
    assert all(0 < s < 1 for s in profiled.values())
    assert set(counts) <= set(engine.policy.costs.step_s)  # the policy started from them
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks  # the scratch blocks came back
    key, what = cost_profile.cost_key(engine)
    assert what["dtype"] == "torch.float32" and what["compiled"] is None
    data = json.loads((tmp_path / "step_costs.json").read_text())
    assert {int(n): s for n, s in data[key]["step_s"].items()} == profiled
    # A second engine with the same key loads the costs instead of profiling.
    monkeypatch.setattr(cost_profile, "profile_target", lambda *a, **k: pytest.fail("profiled again"))
    llm2 = LLM(setup["target"], skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    _greedy(llm2, PROMPTS[:1])
    assert llm2.engine._step_costs == profiled
    # Another thread count is another key; "off" disables the cache.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert cost_profile.cost_key(engine)[0] != key
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("SPECDEC_STEP_COSTS", "off")
    assert cost_profile.cache_path() is None
    monkeypatch.delenv("SPECDEC_STEP_COSTS")  # default: beside the zoo's converted models
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "zoo"))
    assert cost_profile.cache_path() == tmp_path / "zoo" / "step_costs.json"


def test_the_profile_spreads_each_counts_repeats_over_a_slow_spell(setup, monkeypatch):
    # The host's slow spells outlast a count's back-to-back repeats (all 5 forwards of a 65-token step once
    # ran at 50 ms against 33 ms). Repeats taken round-robin over the counts: a spell of 8 slow forwards
    # (here the 9th to 16th calls, 3x dearer) meets at most two repeats of any count, and the fastest of
    # the others is the profile. Back to back, the spell would have covered every timed repeat of the
    # 4-token step.
    from types import SimpleNamespace

    from specdec.engine import cost_profile

    spec = _spec(setup, "ngram", "goodput")
    engine = LLM(setup["target"], skip_tokenizer_init=True, block_size=4, speculative_config=spec).engine
    calls: list[int] = []
    fake_clock = [0.0]

    def execute(inputs):
        n = int(inputs.input_ids.numel())
        calls.append(n)
        slow = 9 <= len(calls) <= 16
        fake_clock[0] += 0.001 * n * (3 if slow else 1)

    runner = SimpleNamespace(block_size=4, device=torch.device("cpu"), execute=execute)
    counts = [1, 2, 4, 8]
    monkeypatch.setattr(cost_profile, "time", SimpleNamespace(perf_counter=lambda: fake_clock[0]))
    out = cost_profile.profile_target(engine, counts, repeats=4, runner=runner)
    monkeypatch.undo()
    assert calls == counts * 5  # a warm-up round, then 4 timed rounds, each over every count
    assert out == pytest.approx({1: 0.001, 2: 0.002, 4: 0.004, 8: 0.008})
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_frozen_profiled_goodput_repeats_across_engines(setup, monkeypatch, tmp_path):
    # the first engine profiles, the second loads
    monkeypatch.setenv("SPECDEC_STEP_COSTS", str(tmp_path / "step_costs.json"))
    spec = _spec(setup, "draft_model", "goodput", k=3, policy_kwargs={"frozen": True})
    runs = []
    for _ in range(2):
        llm = LLM(setup["target"], skip_tokenizer_init=True, block_size=4, speculative_config=spec)
        params = [
            SamplingParams(temperature=1.0, max_tokens=12, seed=7 + i, ignore_eos=True) for i in range(4)
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params)
        runs.append(([list(o.outputs[0].token_ids) for o in outs], list(llm.engine.policy.history)))
        assert llm.engine.policy.costs.frozen and llm.engine.policy.costs.step_s == llm.engine._step_costs
    assert runs[0] == runs[1]


# ----------------------------------------------------------------------------------- ucb
def _ucb_play(policy, batch_size: int, steps: int, commits: list[int], cost) -> list[int]:
    from specdec.policies import StepObservation

    chosen = []
    for _ in range(steps):
        (d,) = policy.decide(_inputs([None], batch_size=batch_size))
        chosen.append(d)
        step = StepObservation(
            batch_size * (1 + d), cost(batch_size, d), 0.0, d, (), num_committed=batch_size * commits[d]
        )
        policy.observe_step(step)
    return chosen


def test_ucb_learns_the_best_depth_per_batch_size():
    from collections import Counter

    commits = [1, 2, 2, 4, 3]  # tokens per request committed at depth d (a synthetic drafter)
    # batch 1: drafting is nearly free, depth 3 commits the most per second (348 vs 250, 190, 181, 100);
    # batch 16: each extra token costs, plain decoding wins (1600 vs 1454, 1043...).
    cost = lambda b, d: 0.010 + 0.0005 * d if b == 1 else 0.010 * (1 + 1.2 * d)  # noqa: E731
    policy = build_policy("ucb", PolicyContext(4), {"exploration": 0.3, "discount": 1.0})
    first = _ucb_play(policy, 1, 5, commits, cost)
    assert first == [0, 1, 2, 3, 4]  # every arm once, in order
    b1, b16 = [], []
    for _ in range(60):
        b1 += _ucb_play(policy, 1, 5, commits, cost)
        b16 += _ucb_play(policy, 16, 5, commits, cost)
    # Deterministic rewards: the best arm takes most of the last 100 plays (UCB keeps probing the rest).
    (arm1, n1), (arm16, n16) = Counter(b1[-100:]).most_common(1)[0], Counter(b16[-100:]).most_common(1)[0]
    assert (arm1, arm16) == (3, 0) and n1 >= 70 and n16 >= 70, (n1, n16)
    assert policy.decide(_inputs([None], batch_size=1, cap=2)) in ([0], [1], [2])  # capped per request


def test_frozen_ucb_depends_on_the_token_history_alone():
    import random

    from specdec.policies import StepObservation

    def run(kwargs):
        a, b = build_policy("ucb", PolicyContext(4), kwargs), build_policy("ucb", PolicyContext(4), kwargs)
        rng = random.Random(0)
        for step in range(200):
            (da,), (db,) = a.decide(_inputs([None])), b.decide(_inputs([None]))
            if da != db:
                return False
            committed = 1 + min(da, step % 4)  # the same tokens for both; different measured seconds
            for p in (a, b):
                p.observe_step(
                    StepObservation(1 + da, rng.uniform(0.001, 1.0), 0.0, da, (), num_committed=committed)
                )
        return True

    assert run({"frozen": True, "step_s": [[1, 0.01], [64, 0.02]]})
    assert not run({})  # negative control: measuring the time makes the choices differ


def test_ucb_config_errors():
    for kwargs, match in [
        ({"arms": [0, 5]}, "arms"),
        ({"arms": [1, 1]}, "arms"),
        ({"arms": []}, "arms"),
        ({"exploration": 0}, "exploration"),
        ({"discount": 1.5}, "discount"),
        ({"frozen": True, "profile": False}, "frozen=True needs step_s or profile"),
        ({"bogus": 1}, "bad policy_kwargs"),
    ]:
        with pytest.raises(ConfigError, match=match):
            SpeculativeConfig(method="ngram", num_speculative_tokens=4, policy="ucb", policy_kwargs=kwargs)
    with pytest.raises(ConfigError, match="depth must be an integer in"):
        SpeculativeConfig(
            method="ngram", num_speculative_tokens=4, policy="static", policy_kwargs={"depth": 5}
        )


# ----------------------------------------------------------------------------------- greedy equality
def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = [
        SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(len(prompts))
    ]
    return [
        list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]


PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [1, 2, 1, 2, 1], [5, 6, 7, 5, 6], [2, 2, 3, 2, 2, 3, 2], [4, 1, 4, 1, 4, 1]]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize(
    "policy, kwargs",
    [
        ("static", None),
        ("batch_size", {"schedule": [[2, 3], [4, 1]]}),
        ("test_varying", None),
        ("goodput", None),
        ("goodput", {"step_s": [[1, 0.01], [8, 0.012], [32, 0.05]], "frozen": True}),
        ("goodput", {"frozen": True}),  # frozen at the profiled costs
        ("ucb", None),
        ("ucb", {"frozen": True, "arms": [0, 1, 3]}),
        ("static", {"depth": 1}),
    ],
)
def test_greedy_output_equals_plain_decoding_under_every_policy(setup, method, policy, kwargs):
    common = dict(skip_tokenizer_init=True, block_size=4)
    base = _greedy(LLM(setup["target"], **common), PROMPTS)
    llm = LLM(
        setup["target"], speculative_config=_spec(setup, method, policy, policy_kwargs=kwargs), **common
    )
    seen: list[tuple[int, int, int]] = []  # (batch size, scheduler's cap, answer)
    decide = llm.engine.policy.decide
    llm.engine.policy.decide = lambda batch: [
        seen.append((x.batch_size, x.max_drafts, a)) or a for x, a in zip(batch, decide(batch))
    ]
    assert _greedy(llm, PROMPTS) == base
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    if policy == "batch_size":  # 5 requests: no drafts; 3-4: 1 draft; 1-2: 3 drafts
        assert all(a == min(cap, 3 if b <= 2 else 1 if b <= 4 else 0) for b, cap, a in seen)
        assert {0, 1, 3} <= {a for _, _, a in seen}
    if policy == "test_varying":
        answers = llm.engine.policy.answers
        assert {a for _, a in answers} == {0, 1, 2, 3}  # depths varied over the whole range
        assert stats.num_accepted_tokens > 0


LONG_PROMPTS = [[(3 * i + j) % 7 + 1 for j in range(9 + 3 * i)] for i in range(6)]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("policy, kwargs", [("static", {"depth": 0}), ("test_varying", None)])
def test_slots_a_policy_leaves_unused_go_to_prompt_chunks(setup, method, policy, kwargs):
    # 6 prompts of 9-24 tokens, 32 tokens a step: prompts are chunked beside decoding requests. Draft
    # slots the policy leaves unused lengthen this step's prompt chunks, so with depth 0 everywhere the
    # speculative engine takes plain decoding's steps exactly (before: one more, the slots held back
    # prompt tokens), and outputs stay plain decoding's whatever the depths.
    common = dict(skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=32)
    plain = LLM(setup["target"], **common)
    base = _greedy(plain, LONG_PROMPTS)
    llm = LLM(
        setup["target"], speculative_config=_spec(setup, method, policy, policy_kwargs=kwargs), **common
    )
    added = []
    reclaim = llm.engine.scheduler.reclaim_draft_slots
    llm.engine.scheduler.reclaim_draft_slots = lambda scheduled: added.append(reclaim(scheduled)) or added[-1]
    assert _greedy(llm, LONG_PROMPTS) == base
    assert sum(added) > 0  # some chunks grew
    if policy == "static":
        assert llm.engine.num_steps == plain.engine.num_steps
    else:
        assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_goodput_drafts_nothing_in_prompt_steps_of_a_large_batch(setup):
    # 6 prompts of 9-24 tokens, 32 tokens a step: prompts are chunked beside decoding requests. From
    # prompt_steps_plain_from requests on, goodput drafts nothing in a step with prompt chunks (their slots
    # lengthen the chunks); in the other steps it drafts, and the output is plain decoding's.
    common = dict(skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=32)
    base = _greedy(LLM(setup["target"], **common), LONG_PROMPTS)
    kwargs = {"step_s": [[1, 0.01], [64, 0.011]], "frozen": True, "prior_acceptance": 0.9}
    for start, expect_prompt_drafts in ((2, False), (0, True)):
        policy_kwargs = {**kwargs, "prompt_steps_plain_from": start}
        spec = _spec(setup, "ngram", "goodput", policy_kwargs=policy_kwargs)
        llm = LLM(setup["target"], speculative_config=spec, **common)
        policy = llm.engine.policy
        seen = []
        decide = policy.decide

        def recording(batch, decide=decide, seen=seen):
            depths = decide(batch)
            prefill = (batch[0].num_scheduled_tokens or 0) > batch[0].batch_size
            seen.append((prefill, batch[0].batch_size, max(depths)))
            return depths

        policy.decide = recording
        assert _greedy(llm, LONG_PROMPTS) == base
        prompt_steps = [d for prefill, size, d in seen if prefill and size >= 2]
        assert prompt_steps and any(prompt_steps) == expect_prompt_drafts
        assert any(d for prefill, _, d in seen if not prefill)  # decode steps draft either way
    with pytest.raises(ConfigError, match="prompt_steps_plain_from"):
        build_policy("goodput", PolicyContext(4), {"prompt_steps_plain_from": True})


@register_policy("test_late")
class LatePolicy:
    """No drafts until a request has written 12 tokens, then all it may."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.backlogs: list[tuple[str, int, int]] = []  # (request, output tokens, draft_backlog)
        self.catch_up_tokens = 0  # reported by the engine's step observations

    def decide(self, batch: list[PolicyInput]) -> list[int]:
        self.backlogs += [(x.request.request_id, x.request.num_output_tokens, x.draft_backlog) for x in batch]
        return [x.max_drafts if x.request.num_output_tokens >= 12 else 0 for x in batch]

    def observe_step(self, step) -> None:
        self.catch_up_tokens += step.catch_up_tokens


def test_draft_model_catches_up_lazily_in_chunks(setup, monkeypatch):
    # The target drafts for itself, so every draft is accepted iff the draft KV caught up correctly: the
    # draft model runs for nobody until a request may draft (prompts included), then catches up on its
    # backlog in separate forwards of at most CATCH_UP_CHUNK tokens per request.
    import specdec.drafters.draft_model as dm

    monkeypatch.setattr(dm, "CATCH_UP_SEPARATE", 2)
    monkeypatch.setattr(dm, "CATCH_UP_CHUNK", 3)
    common = dict(skip_tokenizer_init=True, block_size=4)
    prompts = [PROMPT * 3, [1, 2, 3, 4, 5, 6, 7] * 2, [2, 5]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = LLM(setup["target"], **common).generate([{"prompt_token_ids": p} for p in prompts], params)
    spec = {"method": "draft_model", "model": str(setup["target"]), "num_speculative_tokens": 3}
    llm = LLM(setup["target"], speculative_config={**spec, "policy": "test_late"}, **common)
    drafter = llm.engine.drafter
    calls: list[tuple[int, int]] = []  # (segments, tokens) of each draft-model forward
    execute = drafter.runner.execute

    def counted(inputs):
        calls.append((len(inputs.metadata.query_lens), int(inputs.input_ids.numel())))
        return execute(inputs)

    monkeypatch.setattr(drafter.runner, "execute", counted)
    catch_ups: list[float] = []
    propose = drafter.propose

    def timed(batch):
        out = propose(batch)
        catch_ups.append(drafter.catch_up_s)
        return out

    monkeypatch.setattr(drafter, "propose", timed)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens  # all accepted
    # Nothing ran before the first drafting step; the first catch-up covered prompt + 12 tokens per
    # request in forwards of <= 3 tokens per request (up to 3 requests: <= 9 tokens each).
    first_catch_up = [c for c in calls if c[1] > 0]
    assert calls and all(tokens <= 3 * segments for segments, tokens in first_catch_up[:-1])
    assert len(calls) >= (len(PROMPT * 3) + 12 - 2) // 3
    assert any(t > 0 for t in catch_ups)
    # The policy saw each request's backlog: everything but the last token until its first draft
    # (prompt + output - 1), at most 1 once it drafts every step (its last accepted draft, never fed to
    # the draft model, rides in the next drafting forward beside the bonus token); the catch-up
    # forwards read each backlog but the CATCH_UP_SEPARATE (2) tokens left for the drafting forward:
    # backlog + 1 - 2 tokens per request, as the engine reported to the policy.
    policy = llm.engine.policy
    lens = {o.request_id: len(p) for o, p in zip(outs, prompts)}
    first = {}
    for rid, n, backlog in policy.backlogs:
        if n < 12:
            assert backlog == lens[rid] + n - 1
        elif rid in first:
            assert backlog <= 1
        else:
            first[rid] = backlog
    assert sorted(first.values()) == sorted(lens[rid] + 11 for rid in lens)
    assert policy.catch_up_tokens == sum(b - 1 for b in first.values())


def test_a_faulty_policy_ends_speculation_for_its_requests_only(setup, caplog):
    common = dict(skip_tokenizer_init=True, block_size=4)
    prompts = [[7, 1, 2, 7, 1, 2], [6, 3, 6, 3, 6], [3, 4, 5, 3, 4, 5, 3], [4, 1, 4, 1, 4, 1]]
    base = _greedy(LLM(setup["target"], **common), prompts)
    llm = LLM(setup["target"], speculative_config=_spec(setup, "ngram", "test_faulty"), **common)
    with caplog.at_level(logging.WARNING, logger="specdec.engine"):
        got = _greedy(llm, prompts)
    assert got == base  # every request finished, with the plain output
    faults = [r.getMessage() for r in caplog.records if "speculation policy" in r.getMessage()]
    assert len(faults) == 2  # once per faulty request, not once per step
    assert any("raised RuntimeError: policy bug" in m for m in faults)
    assert any("answered -1" in m for m in faults)
    assert llm.engine.spec_stats.num_drafts > 0  # the other requests kept speculating
    assert not llm.engine._policy_disabled  # forgotten when the requests ended


# ----------------------------------------------------------------------------------- distribution
BATCH = 48
CALLS = 200  # 9,600 samples of the first two tokens


def _counts(llm: LLM, calls: int, seed_base: int = 0) -> np.ndarray:
    return first_two_token_counts(llm, PROMPT, V, BATCH, calls, seed_base)


def _dist_llm(setup) -> LLM:
    return LLM(
        setup["target"], skip_tokenizer_init=True, seed=7, block_size=4, max_model_len=32,
        max_num_batched_tokens=512, speculative_config=_spec(setup, "draft_model", "test_varying", k=2),
    )  # fmt: skip


def test_sampling_under_a_varying_depth_matches_the_target(setup):
    llm = _dist_llm(setup)
    counts = _counts(llm, CALLS)
    res = goodness_of_fit(setup["exact"], counts)
    print(f"[gof] draft_model, varying depth: {res.describe()}")
    assert res.pvalue >= ALPHA, res.describe()
    assert {a for _, a in llm.engine.policy.answers} == {0, 1, 2}
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize(
    "policy, kwargs",
    [
        # Frozen on given step costs, not on a start-up profile: timed costs would make the depth (and so
        # the "depth varied" check) depend on the machine's load (it once stayed at one depth in CI).
        ("goodput", {"step_s": [[1, 0.01], [32, 0.02]], "frozen": True}),
        ("ucb", {"step_s": [[1, 0.01], [32, 0.02]], "frozen": True}),
        # Learning from measured times (so not repeatable), probing after every undrafted token so that
        # it drafts in many steps: exact all the same, the depth being chosen before the drafts exist.
        # Requests of two tokens would never repay the draft model's catch-up on their prompt: no charge.
        ("goodput", {"explore_every": 1, "charge_catch_up": False}),
    ],
    ids=["goodput-frozen", "ucb-frozen", "goodput-learning"],
)
def test_sampling_under_the_adaptive_policies_matches_the_target(setup, policy, kwargs):
    llm = LLM(
        setup["target"], skip_tokenizer_init=True, seed=7, block_size=4, max_model_len=32,
        max_num_batched_tokens=512,
        speculative_config=_spec(setup, "draft_model", policy, k=2, policy_kwargs=kwargs),
    )  # fmt: skip
    # A seeded half of its own (seed_base): with the varying-depth test's half (seed_base 0) the learning
    # policy's sample sat at p = 5e-5 .. 1e-3 run after run, a fixed draw: with five other engine seeds
    # and seeded halves p was 0.15 .. 0.98, and with 48,000 samples (two seeds) 0.28 and 0.36 (issue 19).
    counts = _counts(llm, CALLS, seed_base=10**6)
    res = goodness_of_fit(setup["exact"], counts)
    print(f"[gof] draft_model, {policy} {kwargs}: {res.describe()}")
    assert res.pvalue >= ALPHA, res.describe()
    assert len({d for _, d in llm.engine.policy.history}) >= 2  # the depth varied
    assert llm.engine.spec_stats.num_drafts > 0


def test_varying_depth_negative_control_fails(setup):
    llm = _dist_llm(setup)
    llm.engine.verifier = AcceptEverything()
    counts = _counts(llm, 40)
    res = assert_differs(setup["exact"], counts, label="varying depth, accept every draft")
    assert res.pvalue < ALPHA * 1e-3


# ----------------------------------------------------------------------------------- Hydra and the CLI
def test_hydra_and_cli_take_the_policy():
    from hydra import compose, initialize_config_module

    from experiments.config import register_configs, to_experiment_config
    from specdec.cli import build_parser

    register_configs()
    with initialize_config_module("experiments.conf", version_base=None):
        cfg = to_experiment_config(
            compose(
                "config",
                overrides=[
                    "drafter=ngram",
                    "drafter.policy=batch_size",
                    "+drafter.policy_kwargs.schedule=[[2,4],[8,1]]",
                ],
            )
        )
        plain = to_experiment_config(compose("config", overrides=["drafter=ngram"]))
    spec = cfg.drafter.speculative_config()
    assert spec["policy"] == "batch_size" and spec["policy_kwargs"] == {"schedule": [[2, 4], [8, 1]]}
    assert SpeculativeConfig(**spec).build_policy().schedule == [(2, 4), (8, 1)]
    assert "policy" not in plain.drafter.speculative_config()  # the default leaves the dict as before
    args = build_parser().parse_args(["generate", "--drafter", "ngram", "--spec-policy", "batch_size"])
    assert args.spec_policy == "batch_size"
