"""The ``"goodput"`` policy: the draft depth that maximises expected committed tokens per second.

For a request whose draft at position ``i`` is accepted with probability ``alpha_i`` given that the ones
before it were, ``k`` drafts commit in expectation ``E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j`` tokens
(the bonus or recovered token included; Leviathan et al. 2023, with position-dependent acceptance as in
SpecDec++ and vLLM's per-position metrics). The products ``q_i`` are estimated per request from its
``request.spec_stats`` (steps that accepted position ``i`` ÷ steps that drafted it) shrunk by
``prior_weight`` pseudo-steps towards the engine's figure over all requests so far, itself shrunk
towards ``prior_acceptance ** i``.

Each step the policy picks one depth ``k`` for the batch (each request capped by its own limit) that
maximises ``(n_0 + sum_r E_r(min(k, cap_r))) / (max(target_s(T(k)), target_s(T(0))) + draft_s(k))`` (a
step with drafts never priced below the same step without them; in a step with prompt chunks: the
expected tokens minus what its seconds would commit by plain decoding, see ``_rate``), where
``n_0`` counts the step's requests that do not draft (one token each), ``T(k)`` is the step's batched
tokens (prefill chunks included: ``PolicyInput.num_scheduled_tokens`` plus the drafts) and the costs come
from :class:`~specdec.policies.cost_model.StepCostModel` (the target's step profiled at start-up or loaded
from the cache, :mod:`specdec.engine.cost_profile`, refreshed from observed steps; or costs given up
front; drafting seconds by drafting requests, a draft model's profiled at start-up), then, least
promising first, drops a request's drafts wherever the step's rate is higher without them.
A drafter that reads committed tokens lazily (a draft model) must first read a request's backlog, its
prompt before the first draft: that one-off cost (``PolicyInput.draft_backlog`` tokens at the cost
model's ``catch_up_s_per_token``) is charged to the request's drafting steps per token they commit,
spread over the tokens it may still write (:meth:`GoodputPolicy.charges`).
``k = 0`` (plain decoding) is always a candidate, so under a
cost model that matches the machine speculation never loses on expectation. Exploration: a request that
drafted nothing for ``explore_every`` of its tokens drafts one (its estimate can then recover), where
that token would pay at the acceptance hoped for (the better of the population's figure and the prior).

Calibration (``calibrate``): the policy drafts where its estimates are high, so the drafts it grants are
chosen on estimates that run high (the winner's curse: at 16 requests on SmolLM2 with n-gram drafts, the
granted drafts were predicted to add 12.1 accepted tokens and added 2). Each granted draft's prediction,
``E - 1`` accepted tokens over the drafts the drafter actually proposed, is settled against what its
request's ``spec_stats`` show at the request's next decision, and the expected accepted tokens of every
candidate are scaled by ``(accepted + w) / (predicted + w)`` over the settled decisions
(``w = calibration_weight`` pseudo-tokens, older decisions weighed down by ``calibration_decay`` each),
capped at the depth. Probes are not settled (their prediction is the hope, not the estimate); their hoped
acceptance is scaled like every estimate. A function of the token history.

Per draft position (``calibration_per_position``): estimates run high by different amounts at different
depths (EAGLE-3 at 16 requests on SmolLM2: first drafts predicted within 3 %, second ones 52 % high), and
one factor for all prices a batch's single drafts with the deep drafts' error. Each position ``j`` then has
its own factor ``(accepted_j + w c_{j-1}) / (predicted_j + w)``, shrunk towards the factor before it
(``c_0 = 1``); position ``j``'s probability ``q_j`` becomes ``min(1, c_j q_j)``, made non-increasing.
These sums age by ``calibration_decay`` at every decision, settled or not, so a factor that stopped
drafting returns towards its prior and drafting is tried again (aged only as decisions settle, a factor
set low by a bad start froze: n-gram at 8 clients never drafted again).

Cost calibration (``calibrate_costs``): the same curse may reach the costs. A step shape the policy picks may
be one whose cost it priced low, and the cost model learns per token count, while a drafting step's count
seldom repeats and the plain count is observed at every step (a trace at 32 requests on SmolLM2, suffix
decoding, 2-core AMX, had it price a 64-token step 1.17x a 32-token one where the engine's took about 1.26x;
in a later trace its predictions of the steps as they ran were within 10 %). So each decode step that drafted
settles its cost: the cost model's prediction of the step as it ran (the drafts proposed; no cheaper than the
plain step, as candidates are priced), before the step corrects it, against its measured seconds (forward,
verification, commit and drafting; catch-up forwards aside), both as the fraction beyond the plain step's
predicted seconds (``target_s`` of the step's tokens without drafts, at decision time; the plain count is
observed at nearly every step, so its prediction is the accurate one), the measured one floored at 0 like the
prediction and capped at twice the prediction plus 0.1 (a pause must not end drafting). Both sums age by
``calibration_decay`` at every decode step, drafting or not, so a calibration that stopped drafting returns
towards 1 and drafting is tried again. Every candidate's seconds beyond the plain step's, in steps with prompt
chunks too, are scaled by ``(realised + w) / (predicted + w)`` (``w = cost_calibration_weight`` plain steps;
clipped to ``[1/4, 4]``). A token tree is priced by its nodes at decision time, as the policy counts its
drafts, and settled by the nodes it verified. Measured times, so off when the costs are frozen.

Prompt steps plain (``prompt_steps_plain_from``, 16): from that batch size on, a step with prompt chunks
drafts nothing; the draft slots the scheduler reserved go back to the chunks. The policy scores such a
step by the tokens it gains over plain decoding (see ``_rate``), step by step, and a draft there costs
more than the step shows: it takes prompt tokens from the chunks cut by the token budget (each deferred
to a further step, which reads the weights again) and moves the requests' finishing times apart. At 32
HumanEval clients on SmolLM2 (prompts prefilled afresh, 2-core AMX; 6 interleaved passes) goodput ran
0.957x and 0.982x plain decoding drafting in those steps, 1.000x and 1.020x not; at 8 clients drafting
there paid (1.181x against 1.169x), and at 1 (1.645x against 1.633x).

Realised-speedup check (``check``): both calibrations correct one estimate each; the check compares what
the steps did, per batch-size bucket: the decode steps the policy let draft against those it did not,
each scored by committed tokens per second over the cost model's plain step, and suspends drafting in a
bucket whose drafting steps measured slower, but for a recheck at every ``check_recheck_every``-th
decision (:class:`~specdec.policies.speedup_check.RealisedSpeedupCheck`). A suspended step skips the
decision. Measured times, so off when the costs are frozen.

Exact: the depth is decided from committed history and costs before the step's drafts exist. With
``frozen=True`` the costs are fixed (given as ``step_s``, or the profiled / cached ones) and decisions
depend on the token history alone, so seeded runs over the same costs repeat exactly; otherwise they
depend on measured times too (the output distribution is the target's either way; only which seeded
tokens are drawn can differ).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

from specdec.errors import ConfigError
from specdec.policies.base import PolicyBase, PolicyContext, PolicyInput, StepObservation
from specdec.policies.cost_model import cost_model_from_kwargs
from specdec.policies.registry import register_policy
from specdec.policies.speedup_check import RealisedSpeedupCheck

#: Decisions kept in ``history``, and requests the exploration clock remembers.
HISTORY = 4096


def expected_tokens(prefix_acceptance: list[float], k: int) -> float:
    """``1 + sum_{i<=k} q_i``: expected committed tokens of ``k`` drafts, where ``q_i`` is the probability
    that the first ``i`` drafts are all accepted (``prod_{j<=i} alpha_j``)."""
    return 1.0 + sum(prefix_acceptance[:k])


def _better(score: float, best: float) -> bool:
    return score > best + 1e-9 * abs(best)


@register_policy("goodput")
class GoodputPolicy(PolicyBase):
    """Expected committed tokens per second, maximised per step (see the module docstring).

    Args:
        ctx: the engine's policy context.
        prior_acceptance: acceptance per position assumed before anything is observed (0..1).
        prior_weight: pseudo-steps of the prior in each request's estimate (>= 0).
        explore_every: a request that drafted nothing for this many of its tokens drafts one token where
            it would pay at the hoped-for acceptance (0: never). Without it a request whose estimate
            sank to 0 would never draft again.
        step_s, draft_s_per_position, prior_slope, frozen: :class:`StepCostModel`'s fields (``step_s``
            as ``{num_tokens: seconds}`` or ``[[num_tokens, seconds], ...]``).
        profile: when ``step_s`` is not given, start from the target's step costs the engine profiles
            at start-up or loads from its cache (:mod:`specdec.engine.cost_profile`); with ``frozen``
            these are the frozen costs.
        calibrate: scale expected accepted tokens by the realised ÷ predicted ratio of the policy's
            settled decisions (see the module docstring).
        calibration_weight: pseudo-tokens (accepted = predicted) the ratio starts from (> 0).
        calibration_decay: weight kept by older settled decisions at each new one (0 < decay <= 1; 1:
            every decision counts alike); with ``calibration_per_position``, at each decision (step)
            instead, whatever the number of requests it settles.
        calibration_per_position: one calibration per draft position instead of one for all, each
            shrunk towards the one before it, all aged at every decision (see the module docstring).
            It changes the ageing too: at 16 requests all drafting, the pooled sums keep 0.99^16 = 0.85
            a step, these 0.99, so they remember about 16 times as many grants.
        charge_catch_up: charge a request's drafting steps for the drafter's catch-up on its backlog
            (:meth:`charges`); False: drafting looks as cheap as it does once caught up.
        calibrate_costs: scale each candidate's seconds beyond the plain step's by the realised ÷
            predicted ratio of the drafting steps' extra seconds (see the module docstring; ignored when
            the costs are frozen).
        cost_calibration_weight: pseudo plain steps of extra seconds (realised = predicted) that ratio
            starts from (> 0).
        check: suspend drafting in the batch sizes where the policy's drafting steps measured slower
            than its plain steps (:class:`~specdec.policies.speedup_check.RealisedSpeedupCheck`; off when
            the costs are frozen, as it reads measured times).
        check_min_steps, check_recheck_every, check_decay: the check's ``min_steps``, ``recheck_every``
            and ``decay``.
        prompt_steps_plain_from: from this batch size on, a step with prompt chunks drafts nothing (its
            draft slots go to the prompts; see the module docstring; 0: off).
        margin: a step drafts only where its expected rate beats the plain step's by this fraction
            (>= 0; probes aside). The expectations are estimates: where drafting barely pays, their
            errors decide, and they erred towards drafting (n-gram at 16 HumanEval requests: goodput
            drafted for 7-16 requests a step, expecting a small gain, and ran at 0.96-0.97x plain).

    Raises:
        ConfigError: a parameter out of range.
    """

    def __init__(
        self,
        ctx: PolicyContext,
        prior_acceptance: float = 0.5,
        prior_weight: float = 2.0,
        explore_every: int = 16,
        step_s: Any = None,
        draft_s_per_position: float = 0.0,
        prior_slope: float = 1 / 64,
        frozen: bool = False,
        profile: bool = True,
        calibrate: bool = True,
        calibration_weight: float = 8.0,
        calibration_decay: float = 0.99,
        calibration_per_position: bool = False,
        charge_catch_up: bool = True,
        margin: float = 0.03,
        calibrate_costs: bool = True,
        cost_calibration_weight: float = 1.0,
        check: bool = True,
        check_min_steps: float = 8.0,
        check_recheck_every: int = 16,
        check_decay: float = 0.97,
        prompt_steps_plain_from: int = 16,
    ) -> None:
        if not isinstance(prior_acceptance, (int, float)) or not 0 <= prior_acceptance <= 1:
            raise ConfigError(f"goodput policy: prior_acceptance must be in [0, 1], got {prior_acceptance!r}")
        if not isinstance(prior_weight, (int, float)) or not 0 <= prior_weight < math.inf:
            raise ConfigError(f"goodput policy: prior_weight must be >= 0, got {prior_weight!r}")
        if type(explore_every) is not int or explore_every < 0:
            raise ConfigError(f"goodput policy: explore_every must be an integer >= 0, got {explore_every!r}")
        if not isinstance(calibrate, bool):
            raise ConfigError(f"goodput policy: calibrate must be a boolean, got {calibrate!r}")
        if not isinstance(calibrate_costs, bool):
            raise ConfigError(f"goodput policy: calibrate_costs must be a boolean, got {calibrate_costs!r}")
        if not isinstance(calibration_per_position, bool):
            got = calibration_per_position
            raise ConfigError(f"goodput policy: calibration_per_position must be a boolean, got {got!r}")
        if (
            not isinstance(cost_calibration_weight, (int, float))
            or isinstance(cost_calibration_weight, bool)
            or not 0 < cost_calibration_weight < math.inf
        ):
            raise ConfigError(
                f"goodput policy: cost_calibration_weight must be > 0, got {cost_calibration_weight!r}"
            )
        if type(prompt_steps_plain_from) is not int or prompt_steps_plain_from < 0:
            got = prompt_steps_plain_from
            raise ConfigError(f"goodput policy: prompt_steps_plain_from must be an integer >= 0, got {got!r}")
        if not isinstance(check, bool):
            raise ConfigError(f"goodput policy: check must be a boolean, got {check!r}")
        try:
            speedup_check = RealisedSpeedupCheck(check_min_steps, check_recheck_every, check_decay)
        except ConfigError as e:
            raise ConfigError(f"goodput policy: check_{e}") from None
        if not isinstance(charge_catch_up, bool):
            raise ConfigError(f"goodput policy: charge_catch_up must be a boolean, got {charge_catch_up!r}")
        if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 0 <= margin < math.inf:
            raise ConfigError(f"goodput policy: margin must be a number >= 0, got {margin!r}")
        if not isinstance(calibration_weight, (int, float)) or not 0 < calibration_weight < math.inf:
            raise ConfigError(f"goodput policy: calibration_weight must be > 0, got {calibration_weight!r}")
        if not isinstance(calibration_decay, (int, float)) or not 0 < calibration_decay <= 1:
            raise ConfigError(
                f"goodput policy: calibration_decay must be in (0, 1], got {calibration_decay!r}"
            )
        self.costs = cost_model_from_kwargs(
            "goodput", step_s, draft_s_per_position, prior_slope, frozen, profile
        )
        #: The engine hands over the profiled step costs (when ``step_s`` was not given).
        self.wants_step_costs = profile and step_s is None
        self.k = ctx.num_speculative_tokens
        self.prior_acceptance = float(prior_acceptance)
        self.prior_weight = float(prior_weight)
        self.explore_every = explore_every
        self._accepted = [0] * self.k  # over all requests, per position
        self._drafted = [0] * self.k
        # request id -> per depth j + 1, its output length when it last drafted >= j + 1 tokens (LRU-bounded):
        # the exploration clocks.
        self._last_draft: OrderedDict[str, list[int]] = OrderedDict()
        #: (batch size, chosen depth) of the latest decisions (bounded), for the metrics and tests.
        self.history: deque[tuple[int, int]] = deque(maxlen=HISTORY)
        self.calibrate = calibrate
        self.calibration_weight = float(calibration_weight)
        self.calibration_decay = float(calibration_decay)
        self.charge_catch_up = charge_catch_up
        self.margin = float(margin)
        # request id -> (q_1 .. q_d of its granted depth d, its accepted tokens, draft steps and drafted
        # tokens then) of its latest granted draft not settled yet (LRU-bounded).
        self._pending: OrderedDict[str, tuple[list[float], int, int, int]] = OrderedDict()
        self._predicted = 0.0  # settled decisions, decayed: predicted and realised accepted tokens
        self._realised = 0.0
        self.calibration_per_position = calibration_per_position
        # calibration_per_position: the same per draft position (aged at every decision)
        self._predicted_at = [0.0] * self.k
        self._realised_at = [0.0] * self.k
        self.calibrate_costs = calibrate_costs and not self.costs.frozen
        self.cost_calibration_weight = float(cost_calibration_weight)
        # The latest drafting decode step's (plain step seconds, tokens without drafts) while the step is
        # not observed yet; the settled drafting steps' extra seconds, decayed, in plain steps.
        self._cost_pending: tuple[float, int] | None = None
        self._extra_predicted = 0.0
        self._extra_realised = 0.0
        #: The realised-speedup check (None: off, or the costs are frozen).
        self.speedup_check = speedup_check if check and not self.costs.frozen else None
        self.prompt_steps_plain_from = prompt_steps_plain_from

    @property
    def calibration(self) -> float:
        """Realised ÷ predicted accepted tokens of the settled decisions, shrunk towards 1 (1 when
        ``calibrate`` is off; with ``calibration_per_position``, the first position's)."""
        if not self.calibrate:
            return 1.0
        if self.calibration_per_position:
            return self.calibrations[0] if self.k else 1.0
        w = self.calibration_weight
        return (self._realised + w) / (self._predicted + w)

    @property
    def calibrations(self) -> list[float]:
        """Per draft position ``1 .. k``, the factor its expected acceptance is scaled by: with
        ``calibration_per_position``, realised ÷ predicted accepted drafts at that position, shrunk
        towards the position before it (the first towards 1) by ``calibration_weight`` pseudo-drafts;
        else :attr:`calibration` at every position."""
        if not (self.calibrate and self.calibration_per_position):
            return [self.calibration] * self.k
        w = self.calibration_weight
        out: list[float] = []
        for p, r in zip(self._predicted_at, self._realised_at):
            out.append((r + w * (out[-1] if out else 1.0)) / (p + w))
        return out

    @property
    def cost_calibration(self) -> float:
        """Realised ÷ predicted seconds beyond the plain step of the settled drafting steps, shrunk towards
        1 and clipped to ``[1/4, 4]`` (1 when ``calibrate_costs`` is off)."""
        if not self.calibrate_costs:
            return 1.0
        w = self.cost_calibration_weight
        return min(4.0, max(0.25, (self._extra_realised + w) / (self._extra_predicted + w)))

    def _settle(self, batch: list[PolicyInput]) -> None:
        """Settle the pending predictions of the batch's requests whose drafts were verified since: the
        prediction over the drafts actually proposed (a drafter may find fewer than granted, n-gram
        lookup often does; those cost less too) against the tokens accepted."""
        d = self.calibration_decay
        per_position = self.calibration_per_position
        if per_position:  # aged at every decision, settled or not: a factor that stopped drafting recovers
            self._predicted_at = [d * p for p in self._predicted_at]
            self._realised_at = [d * r for r in self._realised_at]
        for x in batch:
            rid, stats = x.request.request_id, x.request.spec_stats
            pending = self._pending.pop(rid, None)
            if pending is None or stats is None:
                continue
            q, accepted, drafts, drafted = pending
            if stats.num_drafts > drafts:  # verified (a drafter that found nothing leaves no evidence)
                proposed = min(len(q), stats.num_draft_tokens - drafted)
                gained = stats.num_accepted_tokens - accepted
                if per_position:  # position j + 1 predicted q[j], realised when gained > j
                    for j in range(proposed):
                        self._predicted_at[j] += q[j]
                        self._realised_at[j] += gained > j
                else:
                    self._predicted = d * self._predicted + sum(q[:proposed])
                    self._realised = d * self._realised + gained

    def set_step_costs(self, step_s: dict[int, float]) -> None:
        """Take the engine's profiled target step costs (frozen ones too: they are the costs to freeze)."""
        self.costs.set_base(step_s)

    def set_draft_costs(self, per_position: dict[int, float], catch_up_s_per_token: float = 0.0) -> None:
        """Take a draft model's profiled forward by drafting rows, and its catch-up seconds per token, as
        the starting drafting costs (not when frozen: the profile is not cached, so it would differ
        between runs)."""
        self.costs.set_draft_costs(per_position, catch_up_s_per_token)

    def _shrunk(self, accepted: int, drafted: int, prior: float) -> float:
        w = self.prior_weight
        return (accepted + w * prior) / (drafted + w) if drafted + w > 0 else prior

    def population(self) -> list[float]:
        """``q_1 .. q_k`` over all requests so far: steps that accepted position ``i`` ÷ steps that
        drafted it, shrunk towards ``prior_acceptance`` at position 1 and, further on, towards the
        figure before it times the first position's (acceptance i.i.d. over positions, Leviathan et al.,
        where nothing was drafted that deep yet), made non-increasing."""
        out: list[float] = []
        for j in range(self.k):
            prior = self.prior_acceptance if j == 0 else out[-1] * out[0]
            q = self._shrunk(self._accepted[j], self._drafted[j], prior)
            out.append(min(q, out[-1]) if out else q)
        return out

    def acceptance(self, x: PolicyInput, population: list[float] | None = None) -> list[float]:
        """``q_1 .. q_k``: the estimated probability that the request's first ``i`` drafts are all
        accepted (its ``spec_stats``: steps that accepted position ``i`` ÷ steps that drafted it, shrunk
        towards its own figure at ``i - 1`` times the population's acceptance at ``i`` given ``i - 1``;
        at position 1 towards the population's figure, :meth:`population`), made non-increasing. A
        request whose first drafts are nearly always accepted so expects the same further on, and a
        policy that granted it one draft at a time learns whether deeper drafts pay."""
        pop = population if population is not None else self.population()
        stats = x.request.spec_stats
        if stats is None:
            return self._acceptance((), (), pop)
        return self._acceptance(stats.accepted_per_position, stats.drafted_per_position, pop)

    def _acceptance(self, accepted: Sequence[int], drafted: Sequence[int], pop: list[float]) -> list[float]:
        """:meth:`acceptance` of a request whose steps accepted / drafted position ``j`` are
        ``accepted[j]`` / ``drafted[j]`` (0 past their end)."""
        out: list[float] = []
        for j in range(self.k):
            acc, num = (accepted[j], drafted[j]) if j < len(accepted) else (0, 0)
            if j == 0:
                prior = pop[0]
            else:
                prior = out[-1] * (pop[j] / pop[j - 1]) if pop[j - 1] > 0 else 0.0
            q = self._shrunk(acc, num, prior)
            out.append(min(q, out[-1]) if out else q)
        return out

    def _batch_acceptance(self, batch: list[PolicyInput], population: list[float]) -> list[list[float]]:
        """:meth:`acceptance` of every request of ``batch``, computed once per distinct history (in a
        large batch that seldom drafts, most requests share theirs)."""
        seen: dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]] = {}
        out = []
        for x in batch:
            stats = x.request.spec_stats
            key = (
                ((), ())
                if stats is None
                else (
                    tuple(stats.accepted_per_position),
                    tuple(stats.drafted_per_position),
                )
            )
            q = seen.get(key)
            if q is None:
                q = seen[key] = self._acceptance(key[0], key[1], population)
            out.append(q)
        return out

    def _rate(
        self,
        gain: float,
        tokens: int,
        depths: list[int],
        prefill: bool,
        value: float | None = None,
        extra_s: float = 0.0,
    ) -> float:
        """The score of a step whose requests draft ``depths``: ``gain`` expected committed tokens over
        ``tokens`` batched tokens, plus ``extra_s`` seconds (the drafting requests' catch-up charges). A
        decode step: its expected committed tokens per second. A step with prompt chunks (``value``: the
        tokens per second a plain decode step of the batch would commit): ``gain - value * seconds``, the
        tokens gained beyond what that time buys by plain decoding. A prompt chunk makes the step slow,
        so by its own rate any drafts would look cheap (16 requests' drafts from a draft model in their
        prompt's last step cost more per token than decoding)."""
        seconds = self._seconds(tokens, depths, prefill) + extra_s
        return gain / seconds if value is None else gain - value * seconds

    def _seconds(self, tokens: int, depths: list[int], prefill: bool) -> float:
        """Predicted seconds of a step of ``tokens`` batched tokens whose requests draft ``depths``:
        the target step (no cheaper than the same step without drafts, the plain step) and the drafting,
        the part beyond the plain step's scaled by :attr:`cost_calibration`."""
        rows = len(depths) - depths.count(0)  # the drafting requests (depths are >= 0)
        target = self.costs.target_s(tokens, prefill)
        drafted = sum(depths)
        if not drafted:
            return target
        plain = self.costs.target_s(tokens - drafted, prefill)
        seconds = self._drafting_step_s(target, plain, max(depths, default=0), rows)
        return plain + self.cost_calibration * (seconds - plain)

    def _drafting_step_s(self, target_s: float, plain_s: float, depth: int, rows: int) -> float:
        """A drafting step's uncalibrated seconds: the cost model's target step ``target_s``, no cheaper
        than the same step without drafts ``plain_s`` (a count whose correction ran low, or the plain
        count's high, must not make drafting look cheaper than free), plus drafting to ``depth`` for
        ``rows`` requests. How candidates are priced (:meth:`_seconds`) and drafting steps settled
        (:meth:`observe_step`) alike."""
        return max(target_s, plain_s) + self.costs.draft_s(depth, rows)

    def charges(self, batch: list[PolicyInput]) -> list[float]:
        """Per request, the seconds charged per token it commits while drafting: reading its draft
        backlog (``PolicyInput.draft_backlog`` tokens at the cost model's ``catch_up_s_per_token``; a
        draft model that has not drafted for the request yet reads its prompt first) spread over the
        tokens it may still write (``max_tokens`` less its output so far). The catch-up is paid once
        and pays off over the rest of the request, so a request near its end, or one whose drafts
        barely pay, does not start drafting (at 16 requests on Qwen2.5-Coder 1.5B ← 0.5B the draft
        model's catch-up of the prompts cost more than drafting saved in decoding)."""
        per_token = self.costs.catch_up_s_per_token if self.charge_catch_up else 0.0
        out = []
        for x in batch:
            if x.draft_backlog <= 0 or per_token <= 0:
                out.append(0.0)
                continue
            left = x.request.sampling_params.max_tokens - x.request.num_output_tokens
            out.append(per_token * x.draft_backlog / max(1, left))
        return out

    def decide(self, batch: list[PolicyInput]) -> list[int]:
        # The step's tokens without drafts (prefill chunks included; else one per request).
        base = batch[0].num_scheduled_tokens or batch[0].batch_size
        size = batch[0].batch_size
        prefill = base > size  # prompt chunks in the step
        check = self.speedup_check
        if check is not None and len(batch) == batch[0].num_drafting:
            check.begin_step()  # a batch call (not the engine asking request by request)
        # No decision: a prompt step of a large batch (its draft slots go to the prompts), or drafting
        # measured slower here.
        prompt_step = prefill and 0 < self.prompt_steps_plain_from <= size
        if prompt_step or (check is not None and not check.allow(size, prefill)):
            if check is not None:
                check.record(size, self.costs.target_s(base, prefill), False, prefill)
            self._cost_pending = None
            self.history.append((size, 0))
            return [0] * len(batch)
        if self.calibrate:
            self._settle(batch)
        scale = self.calibration
        factors = self.calibrations if self.calibration_per_position else None
        population = self.population()
        alphas = self._batch_acceptance(batch, population)
        # gains[r][d]: request r's expected committed tokens with d drafts, its expected accepted tokens
        # scaled by the calibration and capped at d (per position: each q_j scaled by its factor, capped at
        # 1 and made non-increasing).
        # (computed once per distinct estimate: requests with the same history share their list)
        by_estimate: dict[int, list[float]] = {}
        gains = []
        for a in alphas:
            g = by_estimate.get(id(a))
            if g is None:
                if factors is None:
                    expected = enumerate(accumulate(a), 1)  # (d, q_1 + ... + q_d)
                    g = [1.0] + [1 + min(d, scale * q) for d, q in expected]
                else:
                    scaled = list(accumulate((min(1.0, f * q) for f, q in zip(factors, a)), min))
                    g = [1.0] + [1 + q for q in accumulate(scaled)]
                by_estimate[id(a)] = g
            gains.append(g)
        others = size - len(batch)  # requests that do not draft: about one token each
        value = size / self.costs.target_s(size) if prefill else None
        charge = self.charges(batch)

        def extra_s(depths: list[int]) -> float:  # the drafting requests' catch-up charges
            return sum(c * g[d] for c, g, d in zip(charge, gains, depths) if d and c)

        best = [0] * len(batch)
        best_gain, best_extra = others + float(len(batch)), 0.0
        best_rate = self._rate(best_gain, base, best, prefill, value)
        plain = (list(best), best_gain, best_extra, best_rate)
        for k in range(1, self.k + 1):
            depths = [min(k, x.max_drafts) for x in batch]
            gain = others + sum(g[d] for g, d in zip(gains, depths))
            extra = extra_s(depths)
            rate = self._rate(gain, base + sum(depths), depths, prefill, value, extra)
            if _better(rate, best_rate):
                best, best_gain, best_extra, best_rate = depths, gain, extra, rate
        # Then each request's drafts alone, least promising first: dropped where the step does better
        # without them.
        drafting = [r for r in range(len(batch)) if best[r]]
        for r in sorted(drafting, key=lambda r: gains[r][best[r]] / (1 + best[r])):
            trial = best[:r] + [0] + best[r + 1 :]
            gain = best_gain - gains[r][best[r]] + 1
            extra = best_extra - charge[r] * gains[r][best[r]]
            rate = self._rate(gain, base + sum(trial), trial, prefill, value, extra)
            if _better(rate, best_rate):
                best, best_gain, best_extra, best_rate = trial, gain, extra, rate
        # Drafts only by a margin over the plain step (a decode step's rate; a step with prompt chunks
        # scores tokens gained over plain decoding: the margin of its plain tokens).
        bar = plain[3] + self.margin * (abs(plain[3]) if value is None else plain[1])
        if any(best) and not _better(best_rate, bar):
            best, best_gain, best_extra, best_rate = plain
        if self.calibrate:
            for x, a, d in zip(batch, alphas, best):
                if d > 0:
                    self._remember(x, a[:d])
        if self.explore_every:
            best = self._explore(
                batch, best, best_gain, base, prefill, value, alphas, population, charge, best_extra
            )
        if self.calibrate_costs:  # the plain step's seconds this step's extra seconds are counted from
            self._cost_pending = (self.costs.target_s(base), base) if any(best) and not prefill else None
        if check is not None:
            per_token = self.costs.catch_up_s_per_token  # the granted requests' backlogs, read lazily
            catch_up_s = per_token * sum(x.draft_backlog for x, d in zip(batch, best) if d)
            check.record(size, self.costs.target_s(base, prefill), any(best), prefill, catch_up_s)
        self.history.append((size, max(best, default=0)))
        return best

    def _remember(self, x: PolicyInput, q: list[float]) -> None:
        stats = x.request.spec_stats
        rid = x.request.request_id
        self._pending[rid] = (
            q,
            stats.num_accepted_tokens if stats is not None else 0,
            stats.num_drafts if stats is not None else 0,
            stats.num_draft_tokens if stats is not None else 0,
        )
        self._pending.move_to_end(rid)
        while len(self._pending) > HISTORY:
            self._pending.popitem(last=False)

    def _hope(self) -> list[float]:
        """The acceptance a probe hopes to find: per position the better of the population's figure and
        the prior, plus an optimism bonus ``1 / sqrt(n + 1)`` over the ``n`` steps that drafted position 1
        (capped at 1; ``q_1 .. q_k``, non-increasing): with nothing drafted yet a probe hopes for
        everything, so a drafter whose acceptance is far above the prior (self-drafting: 0.95 against
        0.5) is tried even where the prior says drafting cannot pay, and the hope settles on the measured
        figure as probes accumulate."""
        bonus = 1 / math.sqrt(self._drafted[0] + 1) if self.k else 0.0
        out: list[float] = []
        for j in range(self.k):
            prior = self.prior_acceptance ** (j + 1)
            q = min(1.0, max(prior, self._shrunk(self._accepted[j], self._drafted[j], prior)) + bonus)
            out.append(min(q, out[-1]) if out else q)
        return out

    def _explore(
        self,
        batch: list[PolicyInput],
        depths: list[int],
        gain: float,
        base: int,
        prefill: bool,
        value: float | None,
        alphas: list[list[float]],
        population: list[float],
        charge: list[float],
        extra_s: float,
    ) -> list[int]:
        """A request that has not drafted for ``explore_every`` of its tokens drafts one token (its
        estimate sank, perhaps on a stretch of text the drafter cannot predict: a probe lets it recover),
        if the step (expected committed tokens ``gain`` with ``depths``) would gain from that token at
        the acceptance it hopes for (:meth:`_hope`); where the step's cost forbids drafting whatever the
        acceptance (a large batch on a compute-bound machine), probes would only cost. Likewise a request
        held at depth ``d`` for ``explore_every`` tokens drafts ``d + 1`` where that pays at its own
        ``q_d`` times the acceptance hoped for at the next position (the better of the prior and the
        population's conditional figure): one rejection at position 2 would otherwise keep a request at
        one draft for good, its position-2 estimate never seeing another draft. A function of the token
        history and the costs, so deterministic when frozen. The due probes are tried together first (a
        draft model's forward over 8 rows costs about one row's), then one by one. ``charge`` /
        ``extra_s``: the requests'
        catch-up charges per committed token and the step's total so far (:meth:`charges`)."""
        out = list(depths)
        tokens = base + sum(out)
        spent = extra_s
        hope: float | None = None
        # A probe's hoped acceptance runs as high as the estimates the calibration corrects: scaled alike
        # (n-gram at 16 requests: probes of 8 rows at a time, valued uncorrected, cost ~2 % of the run).
        factors = self.calibrations
        # the probes due: (index, its extra expected tokens, its extra catch-up seconds)
        due: list[tuple[int, float, float]] = []
        clocks: list[list[int]] = []
        for i, x in enumerate(batch):
            rid, n = x.request.request_id, x.request.num_output_tokens
            last = self._last_draft.get(rid)  # per depth j + 1: output length when it last drafted >= j + 1
            if last is None:
                last = self._last_draft[rid] = [n] * self.k
            self._last_draft.move_to_end(rid)
            clocks.append(last)
            d = out[i]
            if d < min(x.max_drafts, self.k) and n - last[d] >= self.explore_every:
                if d == 0:
                    hope = self._hope()[0] if hope is None else hope
                    extra = min(1.0, factors[0] * hope)
                else:  # position d + 1's acceptance, scaled by its factor
                    cond = population[d] / population[d - 1] if population[d - 1] > 0 else 0.0
                    extra = min(1.0, factors[d] * alphas[i][d - 1] * max(self.prior_acceptance, cond))
                due.append((i, extra, charge[i] * (extra + (1 if d == 0 else 0))))

        def with_probes(probes: list[tuple[int, float, float]]) -> tuple[list[int], float, int, float]:
            trial = list(out)
            for i, _, _ in probes:
                trial[i] += 1
            return (
                trial,
                gain + sum(e for _, e, _ in probes),
                tokens + len(probes),
                spent + sum(c for _, _, c in probes),
            )

        # All due probes together first: a draft model's forward costs about the same for 1 or 8 rows,
        # so one request's probe may not pay where every request's would (Qwen2.5-Coder 1.5B <- 0.5B at 8
        # requests: no request alone ever probed, and plain decoding ran at 0.81 of static k = 4's speed).
        current = self._rate(gain, tokens, out, prefill, value, spent)  # the step's score so far
        if len(due) > 1:
            trial, g, t, sp = with_probes(due)
            rate = self._rate(g, t, trial, prefill, value, sp)
            if _better(rate, current):
                out, gain, tokens, spent, current = trial, g, t, sp, rate
                due = []
        # Else one by one, each where it pays. A probe's score depends on the step so far and on its
        # depth, hoped tokens and charge alone: one that did not pay rules out its equals until a probe
        # is granted (in a large batch that cannot draft, every request is due and they are alike).
        failed: set[tuple[int, float, float]] = set()
        for probe in due:
            i, e, c = probe
            if (out[i], e, c) in failed:
                continue
            trial, g, t, sp = with_probes([probe])
            rate = self._rate(g, t, trial, prefill, value, sp)
            if _better(rate, current):
                out, gain, tokens, spent, current = trial, g, t, sp, rate
                failed.clear()
            else:
                failed.add((out[i], e, c))
        n_out = [x.request.num_output_tokens for x in batch]
        for i, last in enumerate(clocks):
            for j in range(out[i]):
                last[j] = n_out[i]
        while len(self._last_draft) > HISTORY:
            self._last_draft.popitem(last=False)
        return out

    def observe_step(self, step: StepObservation) -> None:
        """Fold a step's times and acceptance into the cost model, the cost calibration and the
        population prior."""
        pending, self._cost_pending = self._cost_pending, None
        if self.speedup_check is not None:
            # all of the drafting, catch-up included: the check takes out the catch-up it was told to expect
            drafting_s = step.draft_s + step.catch_up_s
            self.speedup_check.observe(
                step.num_committed, step.target_s, drafting_s, step.prefill, step.max_depth > 0
            )
        if self.calibrate_costs and not step.prefill:
            # Every decode step ages the evidence, drafting or not: a calibration that stopped drafting
            # drifts back towards 1 and drafting is tried again, so one slow step cannot end it for good.
            d = self.calibration_decay
            self._extra_predicted *= d
            self._extra_realised *= d
            if pending is not None and step.max_depth > 0 and step.num_tokens > pending[1]:
                # The cost model's prediction of the step as it ran (the drafts proposed, which may be
                # fewer than granted), before this step corrects it, against its measured seconds.
                plain_s = pending[0]
                rows = max(1, len(step.per_request))
                target_s = self.costs.target_s(step.num_tokens)
                predicted_s = self._drafting_step_s(target_s, plain_s, step.max_depth, rows)
                realised_s = step.target_s + step.draft_s
                if 0 < plain_s < math.inf and 0 <= realised_s < math.inf:
                    predicted = max(0.0, predicted_s / plain_s - 1)
                    # floored at 0 like the prediction; capped, so that a pause (a page fault, a busy
                    # neighbour) weighs as a step at most twice as dear as predicted, plus a tenth of a step
                    realised = min(max(0.0, realised_s / plain_s - 1), 2 * predicted + 0.1)
                    self._extra_predicted += predicted
                    self._extra_realised += realised
        self.costs.observe(
            step.num_tokens,
            step.target_s,
            step.max_depth,
            step.draft_s,
            step.prefill,
            len(step.per_request),
            step.catch_up_s,
            step.catch_up_tokens,
        )
        for drafted, accepted in step.per_request:
            for j in range(min(drafted, self.k)):
                self._drafted[j] += 1
                self._accepted[j] += j < accepted
