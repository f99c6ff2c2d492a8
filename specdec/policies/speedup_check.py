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
every step is given a plain step at every ``recheck_every``-th decision until its plain arm is measured,
and, unless suspended, again whenever the plain arm's newest step is ``recheck_every * min_steps``
decisions old. A lazy drafter's catch-up on the backlog of the steps it did not draft in is taken out of
a drafting step's seconds (at the cost model's predicted seconds per token), so that a suspension does
not make its own rechecks look slow. Steps with prompt chunks are not scored (they follow their bucket's
suspension).
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

#: ``min_steps`` must be reachable within this many steps of an arm.
REACH_STEPS = 200
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
            raise ConfigError(f"min_steps must be a number >= 1, got {min_steps!r}")
        if type(recheck_every) is not int or recheck_every < 2:
            raise ConfigError(f"recheck_every must be an integer >= 2, got {recheck_every!r}")
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0 < decay <= 1:
            raise ConfigError(f"decay must be in (0, 1], got {decay!r}")
        reachable = REACH_STEPS if decay == 1 else (1 - decay**REACH_STEPS) / (1 - decay)
        if min_steps > reachable:
            raise ConfigError(
                f"min_steps {min_steps} is not reached in {REACH_STEPS} steps of an arm at decay {decay} "
                f"(its weight then: {reachable:.4f})"
            )
        self.min_steps = float(min_steps)
        self.recheck_every = recheck_every
        self.decay = float(decay)
        #: bucket -> (plain arm, drafting arm)
        self.arms: dict[int, tuple[_Arm, _Arm]] = {}
        self._decisions: dict[int, int] = {}  # bucket -> decode decisions since it had an arm measured
        self._plain_seen: dict[int, int] = {}  # bucket -> its decision count at the plain arm's newest step
        #: The step's verdict (:meth:`allow`) and its decision (:meth:`record`: requests, predicted plain
        #: seconds, predicted catch-up seconds, whether drafts were granted) until :meth:`observe` scores
        #: the step.
        self._verdict: bool | None = None
        self._pending: tuple[int, float, float, bool] | None = None
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

    def begin_step(self) -> None:
        """A new step's decision begins: forget a verdict and a decision the last step left unobserved (a
        step whose requests all failed while drafting, or a policy whose ``observe_step`` the engine no
        longer calls). Call it once per step, before :meth:`allow`."""
        self._verdict = None
        self._pending = None

    def allow(self, batch_size: int, prefill: bool = False) -> bool:
        """Whether the policy's decision for a step of ``batch_size`` requests goes through (True) or the
        step drafts nothing (False). Suspended: every ``recheck_every``-th decode decision of the bucket
        goes through. A bucket whose drafting arm is measured but whose plain arm is not, or not for
        ``recheck_every * min_steps`` decisions (a policy that drafts at every step), gets a plain step at
        every ``recheck_every``-th decision until it is. A step with prompt chunks (``prefill``) is not
        scored: it is suspended with its bucket, and neither rechecks nor probes. The verdict holds for
        the step (a policy asked request by request, after its batch call raised, asks again) until
        :meth:`observe`."""
        if self._verdict is not None:
            return self._verdict
        b = row_bucket(batch_size)
        arms = self.arms.get(b)
        if arms is None:
            verdict = True
        elif prefill:
            verdict = not self.suspended(batch_size)
        else:
            n = self._decisions[b] = self._decisions.get(b, 0) + 1
            due = n % self.recheck_every == 0
            plain, drafting = arms
            suspended = self.suspended(batch_size)
            stale = n - self._plain_seen.get(b, 0) > self.recheck_every * self.min_steps
            unmeasured = plain.weight < self.min_steps or (stale and not suspended)
            if drafting.weight >= self.min_steps and unmeasured:
                self.num_plain_probes += due
                verdict = not due
            elif not suspended:
                verdict = True
            else:
                self.num_rechecks += due
                self.num_suspended += not due
                verdict = due
        self._verdict = verdict
        return verdict

    def record(
        self, batch_size: int, plain_s: float, drafted: bool, prefill: bool, catch_up_s: float = 0.0
    ) -> None:
        """The decision just taken: ``batch_size`` requests, the cost model's seconds ``plain_s`` for the
        step without drafts, whether it granted any drafts, and the predicted seconds of the drafter's
        catch-up on the granted requests' backlogs (``catch_up_s``; taken out of the step's drafting
        seconds: a lazy drafter reads the tokens of the steps it did not draft in, and a suspension must
        not make its rechecks look slow). Steps with prompt chunks are not scored. Several calls before
        :meth:`observe` (a policy asked request by request) make one decision: drafted if any did."""
        ok = not prefill and 0 < plain_s < math.inf and batch_size >= 1
        if not ok:
            self._pending = None
            return
        if self._pending is not None and self._verdict is not None:  # the same step, request by request
            _, _, earlier_s, earlier = self._pending
            drafted, catch_up_s = drafted or earlier, catch_up_s + earlier_s
        self._pending = (batch_size, plain_s, catch_up_s, drafted)

    def observe(
        self, num_committed: int, target_s: float, draft_s: float, prefill: bool, drafts: bool
    ) -> None:
        """Score the step of the latest recorded decision: ``num_committed`` tokens in ``target_s``
        seconds of forward, verification and commit plus ``draft_s`` of drafting (the policy's own work
        and the drafter's catch-up forwards included), less the catch-up :meth:`record` was told to
        expect. ``drafts``: the step verified drafts; a step recorded as plain that did (drafts a grammar
        forced) is not scored."""
        pending, self._pending, self._verdict = self._pending, None, None
        if pending is None or prefill or num_committed <= 0:
            return
        requests, plain_s, catch_up_s, drafted = pending
        bucket = row_bucket(requests)
        seconds = target_s + max(0.0, draft_s - catch_up_s)
        if not 0 < seconds < math.inf or (drafts and not drafted):
            return
        score = (num_committed / seconds) / (requests / plain_s)
        score = min(SCORE_CLIP, max(1 / SCORE_CLIP, score))
        arms = self.arms.setdefault(bucket, (_Arm(), _Arm()))
        arms[int(drafted)].add(score, self.decay)
        if not drafted:
            self._plain_seen[bucket] = self._decisions.get(bucket, 0)
