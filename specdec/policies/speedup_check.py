"""The realised-speedup check: a policy's drafting steps against its plain steps, as measured.

A cost model and acceptance estimates predict whether drafting pays; where drafting barely pays (a large
batch on a machine whose step cost grows with its rows) their errors of a few per cent decide, and at
32 HumanEval requests on SmolLM2 (2-core AMX) the goodput policy drafted on predictions that ran high
and decoded at 0.92x plain. This check compares what the steps did instead: per batch-size bucket (the
power of two at or above the step's requests), the decode steps in which the policy granted drafts
against those in which it granted none, each scored by its committed tokens per second relative to the
plain step the cost model predicted for it (``committed / seconds ÷ (requests / plain_s)``; the
relative score takes the step's batch size and context out of the comparison, and any bias of the
plain prediction is shared by both arms). Where both arms hold ``min_steps`` (decayed) steps and the
drafting arm's mean score is below the plain arm's, drafting is suspended in that bucket: the policy
drafts nothing there, except at every ``recheck_every``-th decision, which goes through unchanged so
that the drafting arm's evidence renews (acceptance changes with the text). A policy that drafts at
every step is given a plain step at every ``recheck_every``-th decision until its plain arm is measured.
It is a two-armed comparison with forced exploration, as in the bandit formulations of adaptive
speculation (BanditSpec, Hou et al. 2025), taken at the level of the whole step, whose measured seconds
include everything the cost model leaves out (drafting, verification, bookkeeping).

It reads measured times, so a policy leaves it off when its costs are frozen (seeded runs must repeat).
The output distribution is unaffected either way: the check only lowers depths, before the step's
drafts exist, from what earlier steps measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.errors import ConfigError
from specdec.policies.cost_model import row_bucket

#: A step's score is clipped to this factor of 1 either way: a pause (a garbage-collector pass of
#: 160-350 ms among 25-40 ms steps) must not decide an arm on its own.
SCORE_CLIP = 2.0


@dataclass
class _Arm:
    """A decayed sum of step scores and of step weights."""

    total: float = 0.0
    weight: float = 0.0

    def add(self, score: float, decay: float) -> None:
        self.total = decay * self.total + score
        self.weight = decay * self.weight + 1.0

    @property
    def mean(self) -> float:
        return self.total / self.weight if self.weight > 0 else math.nan


class RealisedSpeedupCheck:
    """Suspends drafting in the batch-size buckets where the policy's drafting steps measured slower than
    its plain steps (see the module docstring).

    Args:
        min_steps: decayed steps each arm needs before the arms are compared (>= 1).
        recheck_every: while suspended, every this many decisions in the bucket goes through (>= 2).
        decay: weight an arm's older steps keep at each new step of that arm (0 < decay <= 1).

    Raises:
        ConfigError: a parameter out of range.
    """

    def __init__(self, min_steps: float = 8.0, recheck_every: int = 16, decay: float = 0.97) -> None:
        number = isinstance(min_steps, (int, float)) and not isinstance(min_steps, bool)
        if not number or not 1 <= min_steps < math.inf:
            raise ConfigError(f"check_min_steps must be a number >= 1, got {min_steps!r}")
        if type(recheck_every) is not int or recheck_every < 2:
            raise ConfigError(f"check_recheck_every must be an integer >= 2, got {recheck_every!r}")
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0 < decay <= 1:
            raise ConfigError(f"check_decay must be in (0, 1], got {decay!r}")
        if decay < 1 and min_steps > 1 / (1 - decay):
            raise ConfigError(
                f"check_min_steps {min_steps} can never be reached: an arm's decayed weight stays below "
                f"1 / (1 - check_decay) = {1 / (1 - decay):.1f}"
            )
        self.min_steps = float(min_steps)
        self.recheck_every = recheck_every
        self.decay = float(decay)
        #: bucket -> (plain arm, drafting arm)
        self.arms: dict[int, tuple[_Arm, _Arm]] = {}
        self._decisions: dict[int, int] = {}  # bucket -> decisions taken once it had an arm measured
        #: (bucket, requests, predicted plain seconds, whether drafts were granted) of the latest decision
        #: not observed yet.
        self._pending: tuple[int, int, float, bool] | None = None
        #: Decisions suspended, let through as rechecks, and made plain steps to measure the plain arm
        #: (for the metrics and tests).
        self.num_suspended = 0
        self.num_rechecks = 0
        self.num_plain_probes = 0

    def suspended(self, batch_size: int) -> bool:
        """Whether drafting is suspended for a step of ``batch_size`` requests now: both arms measured
        and the drafting arm's mean score below the plain arm's."""
        arms = self.arms.get(row_bucket(batch_size))
        if arms is None:
            return False
        plain, drafting = arms
        return (
            plain.weight >= self.min_steps
            and drafting.weight >= self.min_steps
            and drafting.mean < plain.mean
        )

    def allow(self, batch_size: int) -> bool:
        """Whether the policy's decision for a step of ``batch_size`` requests goes through (True) or the
        step drafts nothing (False). Call once per decision. Suspended: every ``recheck_every``-th
        decision of the bucket goes through. A bucket whose drafting arm is measured but whose plain arm
        is not (a policy that drafts at every step) gets a plain step at every ``recheck_every``-th
        decision until it is: once per bucket, as an arm's weight decays only with its own steps."""
        b = row_bucket(batch_size)
        arms = self.arms.get(b)
        if arms is None:
            return True
        n = self._decisions[b] = self._decisions.get(b, 0) + 1
        due = n % self.recheck_every == 0
        plain, drafting = arms
        if drafting.weight >= self.min_steps and plain.weight < self.min_steps:
            self.num_plain_probes += due
            return not due
        if not self.suspended(batch_size):
            return True
        self.num_rechecks += due
        self.num_suspended += not due
        return due

    def record(self, batch_size: int, plain_s: float, drafted: bool, prefill: bool) -> None:
        """The decision just taken: ``batch_size`` requests, the cost model's seconds ``plain_s`` for the
        step without drafts, whether it granted any drafts. Steps with prompt chunks are not scored."""
        ok = not prefill and 0 < plain_s < math.inf and batch_size >= 1
        self._pending = (row_bucket(batch_size), batch_size, plain_s, drafted) if ok else None

    def observe(self, num_committed: int, seconds: float, prefill: bool) -> None:
        """Score the step of the latest recorded decision: ``num_committed`` tokens in ``seconds``
        (everything the step measured: drafting, forward, verification, commit)."""
        pending, self._pending = self._pending, None
        if pending is None or prefill or not 0 < seconds < math.inf or num_committed <= 0:
            return
        bucket, requests, plain_s, drafted = pending
        score = (num_committed / seconds) / (requests / plain_s)
        score = min(SCORE_CLIP, max(1 / SCORE_CLIP, score))
        arms = self.arms.setdefault(bucket, (_Arm(), _Arm()))
        arms[int(drafted)].add(score, self.decay)
