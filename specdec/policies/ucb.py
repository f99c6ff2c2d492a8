"""The ``"ucb"`` policy: a bandit over draft depths, rewarded by committed tokens per second (UCBSpec).

BanditSpec (Hou et al., ICML 2025, arXiv 2505.15141) treats the speculation length as the arm of a
multi-armed bandit played once per step and rewarded by the step's throughput; its UCBSpec plays UCB1.
Here the arms are the depths ``0 .. k`` (``arms`` to restrict them; 0 is plain decoding), one depth per
step for the whole batch (each request capped by its own limit), with separate statistics per batch-size
bucket (1, 2-3, 4-7, ...: the best depth changes with load). A step's reward is the tokens it committed
over its seconds (target forward, verification and drafting), divided by the best reward seen in the
bucket so that rewards lie in [0, 1]; steps with prompt chunks are not credited (their time is the
prompt's). Statistics are discounted (``discount`` per step of the bucket;
Garivier and Moulines 2011) so that the policy follows the workload as requests come and go. Arms are
first played once each, in order; then the arm with the largest ``mean + exploration * sqrt(2 ln N / n)``.

Exact: the depth is chosen from earlier steps' rewards before this step's drafts exist. Deterministic
mode (``frozen=True``): a step's seconds are not measured but predicted by the frozen cost model (the
profiled or cached target costs, or ``step_s``; drafting at ``draft_s_per_position``), so choices depend
on the token history alone and seeded runs repeat exactly.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from specdec.errors import ConfigError
from specdec.policies.base import PolicyBase, PolicyContext, PolicyInput, StepObservation
from specdec.policies.cost_model import cost_model_from_kwargs
from specdec.policies.registry import register_policy

#: Decisions kept in ``history``.
HISTORY = 4096


class _Arms:
    """Discounted UCB1 statistics of one batch-size bucket."""

    def __init__(self, n: int) -> None:
        self.plays = [0.0] * n  # discounted play counts
        self.reward = [0.0] * n  # discounted sums of normalised rewards
        self.best = 0.0  # the best raw reward seen (tokens per second), the normaliser
        self.untried = list(range(n))


@register_policy("ucb")
class UCBPolicy(PolicyBase):
    """UCBSpec over draft depths (see the module docstring).

    Args:
        ctx: the engine's policy context.
        arms: the depths to choose from (default ``0 .. k``), each in ``[0, k]``, distinct.
        exploration: the UCB bonus's weight (> 0; 1 is UCB1).
        discount: each bucket's statistics are multiplied by this per step of the bucket (0 < d <= 1;
            1 never forgets).
        step_s, draft_s_per_position, prior_slope, frozen, profile: the cost model, used for the rewards
            in the deterministic mode (``frozen=True``); as in the ``"goodput"`` policy.

    Raises:
        ConfigError: a parameter out of range.
    """

    def __init__(
        self,
        ctx: PolicyContext,
        arms: Any = None,
        exploration: float = 1.0,
        discount: float = 0.99,
        step_s: Any = None,
        draft_s_per_position: float = 0.0,
        prior_slope: float = 1 / 64,
        frozen: bool = False,
        profile: bool = True,
    ) -> None:
        k = ctx.num_speculative_tokens
        arms = list(range(k + 1)) if arms is None else arms
        if (
            not isinstance(arms, (list, tuple))
            or not arms
            or any(type(a) is not int or not 0 <= a <= k for a in arms)
            or len(set(arms)) != len(arms)
        ):
            raise ConfigError(f"ucb policy: arms must be distinct depths in [0, {k}], got {arms!r}")
        if not isinstance(exploration, (int, float)) or not 0 < exploration < math.inf:
            raise ConfigError(f"ucb policy: exploration must be > 0, got {exploration!r}")
        if not isinstance(discount, (int, float)) or not 0 < discount <= 1:
            raise ConfigError(f"ucb policy: discount must be in (0, 1], got {discount!r}")
        self.arms = sorted(arms)
        self.exploration = float(exploration)
        self.discount = float(discount)
        self.costs = cost_model_from_kwargs("ucb", step_s, draft_s_per_position, prior_slope, frozen, profile)
        #: The engine hands over the profiled step costs (used in the deterministic mode only).
        self.wants_step_costs = bool(frozen) and profile and step_s is None
        self._buckets: dict[int, _Arms] = {}
        self._pending: tuple[int, int] | None = None  # (bucket, arm index) of the step being run
        #: (batch size, chosen depth) of the latest decisions (bounded), for the metrics and tests.
        self.history: deque[tuple[int, int]] = deque(maxlen=HISTORY)

    def set_step_costs(self, step_s: dict[int, float]) -> None:
        self.costs.set_base(step_s)

    def _choose(self, stats: _Arms) -> int:
        if stats.untried:
            return stats.untried[0]
        total = sum(stats.plays)
        scores = [
            r / n + self.exploration * math.sqrt(2 * math.log(max(total, 1.0)) / n)
            for r, n in zip(stats.reward, stats.plays)
        ]
        return max(range(len(scores)), key=lambda i: (scores[i], -i))  # ties: the shallower depth

    def decide(self, batch: list[PolicyInput]) -> list[int]:
        bucket = batch[0].batch_size.bit_length()
        stats = self._buckets.setdefault(bucket, _Arms(len(self.arms)))
        arm = self._choose(stats)
        self._pending = (bucket, arm)
        depth = self.arms[arm]
        self.history.append((batch[0].batch_size, depth))
        return [min(depth, x.max_drafts) for x in batch]

    def observe_step(self, step: StepObservation) -> None:
        """Credit the step's reward to the arm its decision played. Skipped: steps without a decision, and
        steps with prompt chunks (their seconds are the prompt's, whatever the arm)."""
        if self._pending is None:
            return
        (bucket, arm), self._pending = self._pending, None
        if step.prefill:
            return
        if self.costs.frozen:
            seconds = self.costs.target_s(step.num_tokens, step.prefill) + self.costs.draft_s(step.max_depth)
        else:
            seconds = step.target_s + step.draft_s
        if not 0 < seconds < math.inf:
            return
        raw = step.num_committed / seconds
        stats = self._buckets[bucket]
        stats.best = max(stats.best, raw)
        for i in range(len(self.arms)):
            stats.plays[i] *= self.discount
            stats.reward[i] *= self.discount
        stats.plays[arm] += 1
        stats.reward[arm] += raw / stats.best if stats.best > 0 else 0.0
        if arm in stats.untried:
            stats.untried.remove(arm)
