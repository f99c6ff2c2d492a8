"""What a step costs, for the policies that weigh drafts against time: target step seconds as a function
of the batched tokens, and drafting seconds per draft position.

:class:`StepCostModel` starts from a base curve, ``step_s`` (the target forward profiled at start-up, or
costs given up front), interpolated linearly between its counts; beyond them it scales the nearest one
by a prior slope (``prior_slope``: the fraction of a one-token step that each extra token adds; small,
since a decode step is bound by reading the weights); with no curve at all it is relative (1 for one
token). Observed steps correct the curve multiplicatively: a running mean of observed ÷ base per
token count (each observation bounded first, see below), used for that count. A count not observed
yet is predicted as the profile (scaled by the drift index below) plus the excess over it of the
observed counts: the nearest one's above or below them all, the two neighbours' interpolated between
them (no cheaper than both), and below them all no less than the nearest one's cost scaled by the
profile (so an excess that is negative, steps cheaper than profiled, cannot
bring a small count to zero); with no curve at all (relative units, which cannot take an excess in
seconds), the observed counts' ratios to the relative curve, the nearest one's or the two neighbours'
interpolated. So a count the policy never plays carries what the played ones add to
the profile (the profile times the forward alone; a real step adds verification, commit and attention
over long contexts), rather than the raw profile, which would make untried counts look cheap; and that
excess is carried as an amount, not as a ratio: it is about constant across counts (SmolLM2-135M
bfloat16 at 4 clients, 2-core AMD EPYC: 3-4 ms over a profile of 8.4-15.1 ms at 1-12 tokens), so the
played counts' ratio (1.3) priced 16- and 20-token steps 20-24 % above their measured cost and the
goodput policy drafted too little (docs/concurrency.md, run 13). Before anything is observed, the
profile itself. Steps also grow dearer
as contexts grow, for every count alike: a drift index tracks that (each step moves it by its ratio
over its count's correction; a count's correction changes only at ``SHAPE_DECAY`` of that rate), and a
count's correction is carried along it from the step it was last observed on. The counts a policy
drafts at are observed rarely once drafting stops paying, and their corrections from earlier,
shorter-context steps made them look cheap against the plain count observed at every step (n-gram at
32 HumanEval requests: goodput drafted and ran at 0.91x plain). Steps with prefill
chunks keep corrections of their own: the profile runs from position 0, so a prompt chunk costs about
what was profiled, while a decode step also attends over its whole context; mixed into one correction,
prompt chunks would make the untried decode counts look cheap again.
Each observed step is first bounded against its count's prediction (``STEP_CLIP``; a count's first step only
above, ``FIRST_CLIP``, and only against a profile; a count's second step in a row beyond its bound the same
way is taken outright as its own cost, so a lasting change is learned in two steps): one pause must not
reprice every count, nor one count set far off (a first step that was a pause) drag the others along.
Drafting costs ``draft_s_per_position`` seconds per draft position of the step (sequential draft steps: a
draft model or head drafts all requests' position d together), a running mean of observed drafting time
divided by the step's deepest draft, learned per bucket of drafting requests (1, 2, 3-4, 5-8, ...); when it
was not given (0), a bucket's first drafting step sets it.

Catch-up: ``catch_up_s_per_token``, the seconds per token a draft model spends reading a request's
backlog before its first draft (its prompt, or the tokens since it last drafted; lazy catch-up in
:mod:`specdec.drafters.draft_model`), profiled at start-up and refreshed from observed catch-up forwards
(the first one taken outright when nothing was profiled).

``frozen=True`` (with the costs given up front) ignores observations: decisions then depend on the token
history alone, so seeded runs repeat exactly (the deterministic mode of the adaptive policies).
"""

from __future__ import annotations

import bisect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import ConfigError

#: A token count's own correction moves at this fraction of the drift index's rate (``decay``): a step
#: dearer than its count's correction is taken mostly as drift, shared by every count.
SHAPE_DECAY = 0.2
#: A step of a count observed before is taken at most this factor dearer or cheaper than the count's
#: prediction. A pause (a garbage-collector pass, a page fault, a busy neighbour: 1.7x and 15x steps at 16
#: HumanEval requests on SmolLM2, 2-core AMX) otherwise moved the drift index by 7 % and 140 % at once,
#: and the next normal step of an inflated count dragged every count down with it, so the goodput policy
#: priced 24- to 64-token steps below the 16-token plain step and drafted at 0.80x plain. A lasting change
#: is still learned: a count's second and further steps in a row beyond the bound the same way are taken
#: outright as its own cost (its correction set to them; the drift index, shared by every count, moves by
#: the bound at most, in log space, so that a pause's way in and way out cancel); a step within the bound
#: resets it. A lasting change of every count beyond the bound so reaches the counts not played since only
#: in part (about ``decay * log(STEP_CLIP)`` a step while their own steps are out of bound).
STEP_CLIP = 1.5
#: Where a profile was given, a count's first step is taken at most this factor dearer than its
#: prediction (the profile is the forward alone; real steps add verification and attention over long
#: contexts, 1.1-2x here); cheaper is taken outright (a step is not fast by accident), and without a
#: profile (the prior slope's relative guess) every first step is. Further steps of the count are taken as
#: ``STEP_CLIP`` says.
FIRST_CLIP = 3.0


@dataclass
class StepCostModel:
    """Step costs (see the module docstring).

    Attributes:
        step_s: ``{num_tokens: seconds}``, the base curve (the frozen costs, or a start);
            empty: nothing measured yet, and :meth:`target_s` is relative (1 for one token).
        draft_s_per_position: drafting seconds per draft position of a step.
        catch_up_s_per_token: a draft model's seconds per token of backlog read before drafting.
        prior_slope: relative cost of one more batched token where nothing was measured.
        frozen: ignore observations.
        decay: weight of a new observation in the running means (0 < decay <= 1).

    Raises:
        ConfigError: negative or non-finite costs, token counts < 1, decay outside (0, 1].
    """

    step_s: dict[int, float] = field(default_factory=dict)
    draft_s_per_position: float = 0.0
    catch_up_s_per_token: float = 0.0
    prior_slope: float = 1 / 64
    frozen: bool = False
    decay: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.step_s, dict):
            raise ConfigError(f"step_s must be a {{num_tokens: seconds}} dict, got {self.step_s!r}")
        clean: dict[int, float] = {}
        for n, s in self.step_s.items():
            if not _is_count(n) or not isinstance(s, (int, float)) or not 0 < s < math.inf:
                raise ConfigError(f"step_s entries must be num_tokens >= 1: seconds > 0, got {n!r}: {s!r}")
            clean[int(n)] = float(s)
        self.step_s = clean
        self._known: tuple[dict[int, float] | None, list[int]] = (None, [])  # (the curve, its counts)
        self._forget_corrections()
        self._draft_given = self.draft_s_per_position != 0  # a prior to correct, not an unknown
        self._draft_buckets: dict[int, float] = {}  # drafting seconds per position, by drafting rows
        for name in ("draft_s_per_position", "catch_up_s_per_token", "prior_slope"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.decay, (int, float)) or not 0 < self.decay <= 1:
            raise ConfigError(f"decay must be in (0, 1], got {self.decay!r}")

    def set_base(self, step_s: dict[int, float]) -> None:
        """Replace the base curve (the engine's profile) and forget the corrections learned so far.

        Raises:
            ConfigError: as the constructor, for bad entries.
        """
        self.step_s = StepCostModel(step_s=dict(step_s)).step_s
        self._forget_corrections()

    def _forget_corrections(self) -> None:
        # observed / base: running means per token count (with the drift index they were last updated at),
        # the observed counts sorted, and the drift index; index 0 for decode / verification steps, 1 for
        # steps with prefill chunks.
        self._memo: dict[tuple[int, bool], float] = {}  # (num_tokens, prefill) -> target_s, until observed
        self._memo_curve: tuple[dict[int, float], int, float] | None = None  # the curve the memo is of
        self._ratio: tuple[dict[int, tuple[float, float]], dict[int, tuple[float, float]]] = ({}, {})
        self._sorted_observed: list[list[int]] = [[], []]
        self._drift = [1.0, 1.0]
        # count -> +1 / -1: its last step was beyond its bound, dearer / cheaper
        self._streaks: tuple[dict[int, int], dict[int, int]] = ({}, {})

    def _known_counts(self) -> list[int]:
        """The base curve's token counts, ascending (sorted again when ``step_s`` was replaced or grew)."""
        curve, counts = self._known
        if curve is not self.step_s or len(counts) != len(self.step_s):
            self._known = (self.step_s, sorted(self.step_s))
        return self._known[1]

    def base_s(self, num_tokens: int) -> float:
        """The base curve at ``num_tokens`` (before the observed correction)."""
        known = self._known_counts()
        if not known:
            return 1 + self.prior_slope * (num_tokens - 1)
        i = bisect.bisect_left(known, num_tokens)  # known[i - 1] < num_tokens <= known[i]
        if i < len(known) and known[i] == num_tokens:
            return self.step_s[num_tokens]
        if 0 < i < len(known):
            a, b = known[i - 1], known[i]
            w = (num_tokens - a) / (b - a)
            return (1 - w) * self.step_s[a] + w * self.step_s[b]
        ref = known[-1] if i else known[0]  # extrapolate from the nearest known count with the prior slope
        base = self.step_s[ref] / (1 + self.prior_slope * (ref - 1))
        return base * (1 + self.prior_slope * (num_tokens - 1))

    def target_s(self, num_tokens: int, prefill: bool = False) -> float:
        """Predicted seconds of a target step over ``num_tokens`` batched tokens (``prefill``: the step
        holds prompt chunks).

        Raises:
            ConfigError: ``num_tokens`` not an integer >= 1 (a step batches at least one token).
        """
        if not _is_count(num_tokens):
            raise ConfigError(f"num_tokens must be an integer >= 1, got {num_tokens!r}")
        # A policy prices tens of candidate steps per decision over a few counts: predictions are kept
        # until the next observation or a new curve (``set_base``, or a ``step_s`` replaced or grown; a
        # value changed in place is not seen: replace the curve with ``set_base``).
        key = (int(num_tokens), bool(prefill))
        curve = self._memo_curve
        if curve is None or curve[0] is not self.step_s or curve[1:] != (len(self.step_s), self.prior_slope):
            self._memo.clear()
            self._memo_curve = (self.step_s, len(self.step_s), self.prior_slope)
        seconds = self._memo.get(key)
        if seconds is None:
            seconds = self._memo[key] = self._predict(key[0], key[1])
        return seconds

    def _predict(self, num_tokens: int, prefill: bool) -> float:
        """:meth:`target_s` for a count already checked (the calls it makes on observed counts too)."""
        kind = int(prefill)
        seen = self._ratio[kind].get(num_tokens)
        if seen is not None:
            return self.base_s(num_tokens) * seen[0] * self._drift[kind] / seen[1]
        counts = self._observed_counts(kind)
        base = self.base_s(num_tokens)
        if not counts:
            return base
        i = bisect.bisect_left(counts, num_tokens)  # counts[i - 1] < num_tokens < counts[i]
        lo, hi = (counts[i - 1] if i else None), (counts[i] if i < len(counts) else None)
        near = lo if lo is not None else hi

        def scaled() -> float:
            # The nearest observed count's cost scaled by the curve: with no curve (relative units, which
            # cannot take an excess in seconds) outside the observed counts, and as a floor below them (an
            # excess that is negative, steps cheaper than profiled, would otherwise reach zero there).
            return self._predict(near, prefill) * base / self.base_s(near)

        if not self._known_counts():
            if lo is None or hi is None:
                return scaled()
            w = (num_tokens - lo) / (hi - lo)  # between two: their ratios to the curve interpolated
            ratio_lo = self._predict(lo, prefill) / self.base_s(lo)
            return base * ((1 - w) * ratio_lo + w * self._predict(hi, prefill) / self.base_s(hi))
        drift = self._drift[kind]

        def excess(m: int) -> float:  # an observed count's seconds beyond the profile (at today's drift)
            return self._predict(m, prefill) - self.base_s(m) * drift

        if lo is None:  # below every observed count
            return max(base * drift + excess(hi), scaled())
        if hi is None:  # above every observed count
            return base * drift + excess(lo)
        w = (num_tokens - lo) / (hi - lo)  # between two: their excesses interpolated, no cheaper than both
        # (a profile far from linear between them could otherwise take it below zero)
        floor = min(self._predict(lo, prefill), self._predict(hi, prefill))
        return max(base * drift + (1 - w) * excess(lo) + w * excess(hi), floor)

    def _observed_counts(self, kind: int) -> list[int]:
        """The token counts observed for ``kind``, ascending (sorted again when a count was added)."""
        counts = self._sorted_observed[kind]
        if len(counts) != len(self._ratio[kind]):
            counts = self._sorted_observed[kind] = sorted(self._ratio[kind])
        return counts

    def _bounded(
        self, kind: int, num_tokens: int, r: float, expected: float, factor: float, cheaper: bool = True
    ) -> tuple[float, bool]:
        """The observed ratio ``r`` bounded against ``expected``, the count's predicted ratio (not bounded
        where that is not a positive finite number; ``cheaper=False``: bounded above only), and whether
        it is the count's second step in a row beyond ``factor`` the same way: a lone one is taken at
        ``factor`` (a pause), the second and further outright, as the count's own cost."""
        streaks = self._streaks[kind]
        if not 0 < expected < math.inf:
            streaks.pop(num_tokens, None)
            return r, False
        way = 1 if r > expected else -1
        if (not cheaper or expected / factor <= r) and r <= expected * factor:
            streaks.pop(num_tokens, None)
            return r, False
        if streaks.get(num_tokens) == way:
            return r, True
        streaks[num_tokens] = way
        return (expected * factor if way > 0 else expected / factor), False

    def set_draft_costs(self, per_position: dict[int, float], catch_up_s_per_token: float = 0.0) -> None:
        """Start the drafting cost per bucket from a profile ``{rows: seconds per draft position}`` (a
        draft model's forward over ``rows`` requests), as if observed, and the catch-up cost per token
        (when > 0); ignored when frozen or when ``draft_s_per_position`` was given (the frozen costs are
        the given ones)."""
        if self.frozen or self._draft_given:
            return
        if isinstance(catch_up_s_per_token, (int, float)) and 0 < catch_up_s_per_token < math.inf:
            self.catch_up_s_per_token = float(catch_up_s_per_token)
        for rows, s in per_position.items():
            if isinstance(rows, int) and rows >= 1 and isinstance(s, (int, float)) and 0 < s < math.inf:
                self._draft_buckets[row_bucket(rows)] = float(s)

    def draft_s(self, depth: int, rows: int = 1) -> float:
        """Predicted drafting seconds of a step whose deepest draft is ``depth``, drafted for ``rows``
        requests: ``depth`` times the seconds per draft position learned for ``rows``' bucket (the
        power of two at or above it), or for the nearest bucket observed (below it first), or
        ``draft_s_per_position``. A head's draft step costs about the same for 1 or 16 requests; a draft
        model's int8 step over 16 rows costs several times its one-row step, so buckets are learned
        apart."""
        if depth <= 0:
            return 0.0
        return self._per_position(rows) * depth

    def _per_position(self, rows: int) -> float:
        if not self._draft_buckets:
            return self.draft_s_per_position
        b = row_bucket(rows)
        if b in self._draft_buckets:
            return self._draft_buckets[b]
        below = [n for n in self._draft_buckets if n < b]
        return self._draft_buckets[max(below) if below else min(self._draft_buckets)]

    def observe(
        self,
        num_tokens: int,
        target_s: float,
        depth: int,
        draft_s: float,
        prefill: bool = False,
        draft_rows: int = 1,
        catch_up_s: float = 0.0,
        catch_up_tokens: int = 0,
    ) -> None:
        """Fold one step's measured times in (ignored when frozen); ``prefill``: the step held prompt
        chunks (corrected apart from decode steps); ``draft_rows``: the requests that drafted;
        ``catch_up_s`` / ``catch_up_tokens``: the drafter's catch-up forwards of the step."""
        if self.frozen:
            return
        self._memo.clear()
        if catch_up_tokens > 0 and 0 < catch_up_s < math.inf:
            per = catch_up_s / catch_up_tokens
            old = self.catch_up_s_per_token
            self.catch_up_s_per_token = per if old == 0 else (1 - self.decay) * old + self.decay * per
        if not (0 < target_s < math.inf) or not _is_count(num_tokens):
            return  # a step of no tokens, or a count that is not an integer: nothing to learn
        num_tokens = int(num_tokens)  # numpy integers are stored as Python ints
        target_s = float(target_s)  # numpy floats too (a float32 would turn the drift index float32)
        kind, d = int(prefill), self.decay
        base = self.base_s(num_tokens)
        ratio, old = self._ratio[kind], self._ratio[kind].get(num_tokens)
        if old is None:
            # a profile to bound a pause by (not the prior slope's guess)
            expected = self._predict(num_tokens, prefill) / base if self._known_counts() else 0.0
            r, _ = self._bounded(kind, num_tokens, target_s / base, expected, FIRST_CLIP, cheaper=False)
            mean = r
        else:
            drift = self._drift[kind]
            carried = old[0] * drift / old[1]  # the count's correction carried to the current drift
            r, persistent = self._bounded(kind, num_tokens, target_s / base, carried, STEP_CLIP)
            # The drift index moves by the step's ratio to the prediction, bounded, in log space: the
            # bound is symmetric in ratio, so a pause's way in and way out cancel (moved linearly, each
            # short pause left it 1.5 % higher, and it climbed for good).
            step = min(max(r / carried, 1 / STEP_CLIP), STEP_CLIP)
            self._drift[kind] = drift * step**d
            # The count's steps keep landing beyond its bound the same way: its own cost is off (a first
            # step that was a pause, a shape the profile missed), or every count's is. Its correction is
            # set to the step; the drift index moved by no more than its bound (moved by the whole
            # ratio, a count set far off dragged every other count along).
            ds = 1.0 if persistent else d * SHAPE_DECAY
            mean = (1 - ds) * carried * self._drift[kind] / drift + ds * r
        ratio[num_tokens] = (mean, self._drift[kind])
        if depth > 0 and 0 <= draft_s < math.inf:
            per = draft_s / depth
            b, d = row_bucket(max(1, draft_rows)), self.decay
            if b in self._draft_buckets:
                self._draft_buckets[b] = (1 - d) * self._draft_buckets[b] + d * per
            elif self._draft_given:  # a given cost is a prior to correct
                self._draft_buckets[b] = (1 - d) * self._per_position(draft_rows) + d * per
            else:
                # A bucket's first measurement is taken outright: a running mean from the unknown 0
                # would take tens of steps to learn that a draft model's steps cost a target step
                # each, and the policy would draft as if drafting were free meanwhile.
                self._draft_buckets[b] = per
            self.draft_s_per_position = self._draft_buckets[b]


def _is_count(n: Any) -> bool:
    """Whether ``n`` is a token count: an integer >= 1 (numpy integers too; not a bool)."""
    if type(n) is int:  # the common case, without the abstract-class check
        return n >= 1
    return isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1


def row_bucket(rows: int) -> int:
    """The power of two at or above ``rows`` (>= 1)."""
    return 1 << max(0, rows - 1).bit_length()


def cost_model_from_kwargs(
    policy: str,
    step_s: Any,
    draft_s_per_position: float,
    prior_slope: float,
    frozen: bool,
    profile: bool,
) -> StepCostModel:
    """The cost model of a policy's keyword arguments (shared by the policies that use one).

    ``step_s``: ``{num_tokens: seconds}`` or ``[[num_tokens, seconds], ...]`` (Hydra writes lists), or
    None. ``profile``: take the engine's profiled costs (``set_step_costs``) when ``step_s`` is None.

    Raises:
        ConfigError: a malformed ``step_s``; ``frozen`` with neither ``step_s`` nor ``profile``; the
            cost model's own checks.
    """
    if not isinstance(frozen, bool) or not isinstance(profile, bool):
        raise ConfigError(
            f"{policy} policy: frozen and profile must be booleans, got {frozen!r}, {profile!r}"
        )
    if frozen and step_s is None and not profile:
        raise ConfigError(f"{policy} policy: frozen=True needs step_s or profile=True (the costs to freeze)")
    if isinstance(step_s, (list, tuple)):
        try:
            step_s = {int(n): float(s) for n, s in step_s}
        except (TypeError, ValueError):
            raise ConfigError(
                f"{policy} policy: step_s must be [[num_tokens, seconds], ...], got {step_s!r}"
            ) from None
    kwargs: dict[str, Any] = {"draft_s_per_position": draft_s_per_position, "prior_slope": prior_slope}
    if step_s is not None:
        kwargs["step_s"] = step_s
    return StepCostModel(frozen=frozen, **kwargs)
