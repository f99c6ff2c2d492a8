"""The ``"goodput"`` policy: the draft depth that maximises expected committed tokens per second.

For a request whose draft at position ``i`` is accepted with probability ``alpha_i`` given that the ones
before it were, ``k`` drafts commit in expectation ``E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j`` tokens
(the bonus or recovered token included; Leviathan et al. 2023, with position-dependent acceptance as in
SpecDec++ and vLLM's per-position metrics). The products ``q_i`` are estimated per request from its
``request.spec_stats`` (steps that accepted position ``i`` ÷ steps that drafted it) shrunk by
``prior_weight`` pseudo-steps towards the engine's figure over all requests so far, itself shrunk
towards ``prior_acceptance ** i``.

Each step the policy picks one depth ``k`` for the batch (each request capped by its own limit) that
maximises ``sum_r E_r(min(k, cap_r)) / (target_s(T(k)) + draft_s(k))``, where ``T(k)`` is the step's
batched tokens and the costs come from :class:`~specdec.policies.cost_model.StepCostModel` (observed
steps, or frozen costs given up front), then, least promising first, drops a request's drafts wherever
the step's rate is higher without them. ``k = 0`` (plain decoding) is always a candidate, so under a
cost model that matches the machine speculation never loses on expectation.

Exact: the depth is decided from committed history and costs before the step's drafts exist. With
``frozen=True`` (and ``step_s`` / ``draft_s_per_position`` given) decisions depend on the token history
alone and seeded runs repeat exactly; otherwise they depend on measured times too (the output
distribution is the target's either way; only which seeded tokens are drawn can differ).
"""

from __future__ import annotations

import math
from typing import Any

from specdec.errors import ConfigError
from specdec.policies.base import PolicyContext, PolicyInput, StepObservation
from specdec.policies.cost_model import StepCostModel
from specdec.policies.registry import register_policy


def expected_tokens(prefix_acceptance: list[float], k: int) -> float:
    """``1 + sum_{i<=k} q_i``: expected committed tokens of ``k`` drafts, where ``q_i`` is the probability
    that the first ``i`` drafts are all accepted (``prod_{j<=i} alpha_j``)."""
    return 1.0 + sum(prefix_acceptance[:k])


@register_policy("goodput")
class GoodputPolicy:
    """Expected committed tokens per second, maximised per step (see the module docstring).

    Args:
        ctx: the engine's policy context.
        prior_acceptance: acceptance per position assumed before anything is observed (0..1).
        prior_weight: pseudo-steps of the prior in each request's estimate (>= 0).
        step_s, draft_s_per_position, prior_slope, frozen: :class:`StepCostModel`'s fields (``step_s``
            as ``{num_tokens: seconds}`` or ``[[num_tokens, seconds], ...]``).

    Raises:
        ConfigError: a parameter out of range.
    """

    def __init__(
        self,
        ctx: PolicyContext,
        prior_acceptance: float = 0.5,
        prior_weight: float = 2.0,
        step_s: Any = None,
        draft_s_per_position: float = 0.0,
        prior_slope: float = 1 / 64,
        frozen: bool = False,
    ) -> None:
        if not isinstance(prior_acceptance, (int, float)) or not 0 <= prior_acceptance <= 1:
            raise ConfigError(f"goodput policy: prior_acceptance must be in [0, 1], got {prior_acceptance!r}")
        if not isinstance(prior_weight, (int, float)) or not 0 <= prior_weight < math.inf:
            raise ConfigError(f"goodput policy: prior_weight must be >= 0, got {prior_weight!r}")
        if frozen and step_s is None:
            raise ConfigError("goodput policy: frozen=True needs step_s (the costs to freeze)")
        if isinstance(step_s, (list, tuple)):
            try:
                step_s = {int(n): float(s) for n, s in step_s}
            except (TypeError, ValueError):
                raise ConfigError(
                    f"goodput policy: step_s must be [[num_tokens, seconds], ...], got {step_s!r}"
                ) from None
        kwargs: dict[str, Any] = {"draft_s_per_position": draft_s_per_position, "prior_slope": prior_slope}
        if step_s is not None:
            kwargs["step_s"] = step_s
        self.costs = StepCostModel(frozen=bool(frozen), **kwargs)
        self.k = ctx.num_speculative_tokens
        self.prior_acceptance = float(prior_acceptance)
        self.prior_weight = float(prior_weight)
        self._accepted = [0] * self.k  # over all requests, per position
        self._drafted = [0] * self.k
        #: (batch size, chosen depth) per decision, for the metrics and tests.
        self.history: list[tuple[int, int]] = []

    def _shrunk(self, accepted: int, drafted: int, prior: float) -> float:
        w = self.prior_weight
        return (accepted + w * prior) / (drafted + w) if drafted + w > 0 else prior

    def acceptance(self, x: PolicyInput) -> list[float]:
        """``q_1 .. q_k``: the estimated probability that the request's first ``i`` drafts are all
        accepted (its ``spec_stats``: steps that accepted position ``i`` ÷ steps that drafted it, shrunk
        towards the population's figure, itself shrunk towards ``prior_acceptance ** i``), made
        non-increasing."""
        stats = x.request.spec_stats
        out: list[float] = []
        for j in range(self.k):
            population = self._shrunk(self._accepted[j], self._drafted[j], self.prior_acceptance ** (j + 1))
            acc = drafted = 0
            if stats is not None and j < len(stats.accepted_per_position):
                acc, drafted = stats.accepted_per_position[j], stats.drafted_per_position[j]
            q = self._shrunk(acc, drafted, population)
            out.append(min(q, out[-1]) if out else q)
        return out

    def _rate(self, alphas: list[list[float]], depths: list[int], others: int) -> float:
        tokens = others + sum(1 + d for d in depths)
        seconds = self.costs.target_s(tokens) + self.costs.draft_s(max(depths, default=0))
        return sum(expected_tokens(a, d) for a, d in zip(alphas, depths)) / seconds

    def decide(self, batch: list[PolicyInput]) -> list[int]:
        alphas = [self.acceptance(x) for x in batch]
        others = batch[0].batch_size - len(batch)  # requests that do not draft this step: one token each
        best, best_rate = [0] * len(batch), self._rate(alphas, [0] * len(batch), others)
        for k in range(1, self.k + 1):
            depths = [min(k, x.max_drafts) for x in batch]
            rate = self._rate(alphas, depths, others)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = depths, rate
        # Then each request's drafts alone, least promising first: dropped where the step does better
        # without them.
        for r in sorted(range(len(batch)), key=lambda r: expected_tokens(alphas[r], best[r]) / (1 + best[r])):
            if best[r] == 0:
                continue
            trial = best[:r] + [0] + best[r + 1 :]
            rate = self._rate(alphas, trial, others)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = trial, rate
        self.history.append((batch[0].batch_size, max(best, default=0)))
        return best

    def observe_step(self, step: StepObservation) -> None:
        """Fold a step's times and acceptance into the cost model and the population prior."""
        self.costs.observe(step.num_tokens, step.target_s, step.max_depth, step.draft_s)
        for drafted, accepted in step.per_request:
            for j in range(min(drafted, self.k)):
                self._drafted[j] += 1
                self._accepted[j] += j < accepted
