"""A copying drafter's draft length from the acceptance its matches have had (suffix decoding).

SuffixDecoding (Oliaro et al. 2024) lets a match of ``p`` tokens draft ``α p`` tokens: a long match
repeats, a short one may not. How far a short match's continuation is accepted depends on the text, and
whether a draft that may be rejected is worth its verification row depends on what a row costs on this
machine. Measured on SmolLM2-135M (greedy, suffix decoding drafting 4 after every match; 6 multi-turn
conversations of 3 turns and 39 Spec-Bench questions): after a one-token match the first draft was
accepted 17-21 % of the time, all four 5 %, alike on both workloads; a verification row cost 1.3 % of
a bfloat16 step and 6.4 % of a float32 one (the engine's profiled step costs, batch 1). So α alone
drafts too little for bfloat16 (factor 1) or too much for float32 (factor 4); this rule cuts the chain
where a draft stops paying.

Rule (chains only):

- Hindsight counts per match-length bucket ``b = min(p, MAX_MATCH_BUCKET)`` and draft position ``j``:
  how often draft ``j`` was verified with every draft before it accepted (``reached``), and how often it
  was accepted. Position ``j``'s rate pooled over the buckets, ``ᾱ(j) = (Σ accepted + 1) / (Σ reached +
  2)`` (Laplace's rule), is the prior of each bucket's: ``α̂(b, j) = (accepted + 2 ᾱ(j)) / (reached +
  2)``, and the chance that draft ``j`` is accepted is ``A(b, j) = α̂(b, 1) · … · α̂(b, j)``.
- A chain keeps its drafts while ``A(b, j) >= θ`` (always at least one). A position a bucket never
  reaches keeps learning through the pooled prior: the buckets of longer matches reach it, so a cut
  reopens when they accept there.
- Break-even ``θ``: at batch 1 a step of ``T`` seconds commits ``E`` tokens on average; one more draft
  adds ``A`` expected tokens and ``r · T₁`` seconds (``r``: a verification row's cost as a fraction of a
  one-token step ``T₁``), which raises tokens per second iff ``A > r · E · T₁ / T ≈ r · E``. With
  ``threshold="auto"``, ``θ = r · Ê``: ``r`` from the target's profiled step costs
  (:mod:`specdec.engine.cost_profile`: ``(cost(k + 1) − cost(1)) / (k · cost(1))``), then from the
  engine's own steps (below), ``Ê`` the drafter's mean committed tokens per verified step (a prior of 2
  tokens weighing one step). A number is ``θ`` itself; 0 keeps every draft (α p alone).

The counts are the drafter's, over every request (:attr:`AcceptanceDraftLength.shared`), except for a
request with a seed (``SamplingParams.seed``), which learns from its own chains alone
(:class:`AcceptanceCounts` of its own, from the same prior): a sampled request draws one random number
per draft, so its tokens would otherwise depend on the requests that ran before it. A seeded request
thus draws the same tokens alone or in any batch, in one process and, once the step costs are cached
(:mod:`specdec.engine.cost_profile`), across processes on one machine: the guarantee the speculation
policies give in their frozen mode. The cut depends on committed tokens and earlier verifications only,
before the step's drafts are verified, so the output distribution is unchanged.

The break-even is batch 1's. With many requests in a step, one more row buys tokens for one request
while the step's time is every request's, so the break-even is higher (about ten times at 32 requests
on this project's host) and the cut keeps drafts that do not pay; there the speculation policy
``"goodput"`` weighs each request's depth against the batch's cost.

The profile times short contexts: at long ones a row costs more (attention; float32 SmolLM2 multi-turn
chats at 200-1,000 tokens of context: 1.7 % profiled against 10-13 % observed, bfloat16 1.6 % against
4 %). So ``r`` for requests without a seed comes from the
steps themselves once there are enough (:class:`ObservedRowCost`: a least-squares line through the
recent one-request decode steps' seconds against their rows, the engine's ``observe_step_time``); a
seeded request keeps the profiled ``r``, fixed for the engine (profiled once, then cached), so its
tokens do not depend on how long the steps took.
"""

from __future__ import annotations

#: Matches of this many tokens or more share one bucket of counts.
MAX_MATCH_BUCKET = 8
#: Committed tokens a verified step is assumed to give before any (``Ê``'s prior), and its weight in steps.
PRIOR_TOKENS_PER_STEP = 2.0
PRIOR_STEPS = 1.0
#: The observed row cost forgets a step's weight by half over this many steps.
ROW_COST_HALF_LIFE = 64
#: It is used once the steps it weighs count at least this many and, with ``var``, the variance of
#: their rows, ``steps × var`` (the slope's precision, in units of the steps' scatter) is at least this.
ROW_COST_MIN_STEPS = 16.0
ROW_COST_MIN_SPREAD = 8.0
#: A step over this many times the line's prediction (a pause: garbage collection, another process) is
#: left out, unless the step before was too: a lasting change is then learned.
ROW_COST_OUTLIER = 2.0


def row_cost(step_s: dict[int, float], num_speculative_tokens: int) -> float:
    """A verification row's cost as a fraction of a one-token step, from profiled step costs.

    Args:
        step_s: seconds of one target forward by batched-token count (at least two counts), as
            :func:`specdec.engine.cost_profile.step_costs` returns.
        num_speculative_tokens: k; the rows compared are 1 and ``k + 1`` (or the nearest profiled count
            above 1, at most the largest).

    Returns:
        ``max(0, (cost(n) − cost(1)) / ((n − 1) · cost(1)))``, ``n`` that count; 0.0 when fewer than two
        counts were profiled.
    """
    counts = sorted(t for t in step_s if t >= 1)
    if len(counts) < 2 or step_s[counts[0]] <= 0:
        return 0.0
    base = counts[0]
    above = [t for t in counts if t >= base + num_speculative_tokens]
    n = above[0] if above else counts[-1]
    return max(0.0, (step_s[n] - step_s[base]) / ((n - base) * step_s[base]))


class ObservedRowCost:
    """``r`` from the engine's own steps: a least-squares line ``T(n) = a + b n`` through the seconds
    ``T`` of recent one-request decode steps against their rows ``n`` (weights halving every
    :data:`ROW_COST_HALF_LIFE` steps), and ``r = b / (a + b)``: a row's seconds over a one-row step's.

    The steps' rows vary with the drafts the cut keeps (1 row when nothing matched, up to ``k + 1``).
    Within a request the context grows by a few tokens a step, so over the ~100 steps weighed the slope
    is a row's cost at the contexts being decoded; across requests of different lengths it averages
    them. A step's seconds run from the forward to the commit, so a row's share of processing,
    verification and commit counts too (drafting does not). A step far above the line (a pause) is
    left out unless the one before was too. Once the line has been usable, a spell too short or too
    uniform to fit (a cut keeping one draft after every match) keeps the last usable ``r``.
    """

    def __init__(self) -> None:
        self._decay = 0.5 ** (1.0 / ROW_COST_HALF_LIFE)
        self._w = self._n = self._nn = self._t = self._nt = 0.0
        self._last: float | None = None  # the latest usable r
        self._rejected = False  # the latest step was left out as a pause

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Count one decode step of one request: ``num_tokens`` rows (1 plus its verified drafts) in
        ``seconds`` (the target's forward, sampling or verification and commit)."""
        if num_tokens < 1 or not seconds > 0:
            return
        fit = self._line()
        pause = fit is not None and seconds > ROW_COST_OUTLIER * max(fit[0] + fit[1] * num_tokens, 1e-9)
        if pause and not self._rejected:
            self._rejected = True
            return
        self._rejected = False
        d = self._decay
        self._w = self._w * d + 1.0
        self._n = self._n * d + num_tokens
        self._nn = self._nn * d + num_tokens * num_tokens
        self._t = self._t * d + seconds
        self._nt = self._nt * d + num_tokens * seconds

    def _line(self) -> tuple[float, float] | None:
        """``(a, b)`` once the steps weigh :data:`ROW_COST_MIN_STEPS` and their spread of rows suffices
        (:data:`ROW_COST_MIN_SPREAD`), else None."""
        if self._w < ROW_COST_MIN_STEPS:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if self._w * var_n < ROW_COST_MIN_SPREAD:
            return None
        b = (self._nt / self._w - mean_n * mean_t) / var_n
        return mean_t - b * mean_n, b

    @property
    def weight(self) -> float:
        """The counted steps' total weight (each counted step 1, halving every :data:`ROW_COST_HALF_LIFE`
        counted steps after it; pauses left out neither count nor age it); the line is fitted from
        :data:`ROW_COST_MIN_STEPS` on."""
        return self._w

    @property
    def row_cost(self) -> float | None:
        """``r`` in [0, 1]: from the line when it is usable (see :meth:`_line`), else the latest usable
        one; None before the line was ever usable."""
        fit = self._line()
        if fit is not None and fit[0] + fit[1] > 0:
            self._last = min(1.0, max(0.0, fit[1] / (fit[0] + fit[1])))
        return self._last


class AcceptanceCounts:
    """Hindsight counts of verified chains by match-length bucket and draft position.

    Attributes:
        reached, accepted: ``[MAX_MATCH_BUCKET + 1][k + 1]`` (index 0 of each unused): how often draft
            ``j`` after a match in bucket ``b`` was verified with every draft before it accepted, and how
            often it was accepted.
        reached_total, accepted_total: ``[k + 1]``: the same summed over the buckets (kept as the
            counts grow, so a draft's estimate does not sum them again).
        steps, tokens: verified chains, and the tokens they committed (accepted drafts plus one).
    """

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self.reached = [[0] * (self.k + 1) for _ in range(MAX_MATCH_BUCKET + 1)]
        self.accepted = [[0] * (self.k + 1) for _ in range(MAX_MATCH_BUCKET + 1)]
        self.reached_total = [0] * (self.k + 1)
        self.accepted_total = [0] * (self.k + 1)
        self.steps = 0
        self.tokens = 0

    def observe(self, match_length: int, num_drafts: int, num_accepted: int) -> None:
        """Count a verified chain: ``num_drafts`` proposed after a match of ``match_length`` tokens, the
        first ``num_accepted`` accepted."""
        if num_drafts <= 0:
            return
        b = _bucket(match_length)
        for j in range(1, min(num_drafts, self.k) + 1):
            if j > num_accepted + 1:
                break
            accepted = j <= num_accepted
            self.reached[b][j] += 1
            self.accepted[b][j] += accepted
            self.reached_total[j] += 1
            self.accepted_total[j] += accepted
        self.steps += 1
        self.tokens += num_accepted + 1

    def acceptance(self, match_length: int) -> list[float]:
        """``A(b, j)`` for ``j = 1 .. k``: the estimated chance that the j-th draft after a match of
        ``match_length`` tokens is accepted (see the module docstring)."""
        b = _bucket(match_length)
        reached, accepted = self.reached[b], self.accepted[b]
        out, a = [], 1.0
        for j in range(1, self.k + 1):
            pooled = (self.accepted_total[j] + 1) / (self.reached_total[j] + 2)
            a *= (accepted[j] + 2 * pooled) / (reached[j] + 2)
            out.append(a)
        return out

    @property
    def mean_tokens(self) -> float:
        """``Ê``: committed tokens per verified chain, with a prior of 2 tokens weighing one chain."""
        return (self.tokens + PRIOR_TOKENS_PER_STEP * PRIOR_STEPS) / (self.steps + PRIOR_STEPS)


def _bucket(match_length: int) -> int:
    return min(max(match_length, 0), MAX_MATCH_BUCKET)


class AcceptanceDraftLength:
    """Chooses how many of a copying drafter's chain drafts to propose, from the acceptance earlier
    drafts after matches of the same length had (see the module docstring for the rule and its source).

    Args:
        threshold: ``"auto"`` (θ from the profiled step costs, see :meth:`set_step_costs`; until they
            arrive nothing is cut) or θ itself, a number in [0, 1] (0: never cut).
        num_speculative_tokens: k, the longest chain.

    Attributes:
        row_cost: ``r``, a verification row's cost over a one-token step, profiled (None until
            :meth:`set_step_costs`); what seeded requests use.
        observed: ``r`` from the engine's steps (:class:`ObservedRowCost`, fed by
            :meth:`observe_step_time`), what requests without a seed use once it has enough steps.
        shared: the counts of every request without a seed (:class:`AcceptanceCounts`); a seeded request
            keeps its own (:meth:`new_counts`).
    """

    def __init__(self, threshold: float | str, num_speculative_tokens: int) -> None:
        self.auto = threshold == "auto"
        self.fixed = 0.0 if self.auto else float(threshold)
        self.k = num_speculative_tokens
        self.row_cost: float | None = None
        self.observed = ObservedRowCost()
        self.shared = AcceptanceCounts(num_speculative_tokens)

    def new_counts(self) -> AcceptanceCounts:
        """Empty counts (a seeded request's own)."""
        return AcceptanceCounts(self.k)

    @property
    def wants_step_costs(self) -> bool:
        return self.auto

    def set_step_costs(self, step_s: dict[int, float]) -> None:
        """Take ``r`` from the target's profiled step costs (seconds by batched-token count)."""
        self.row_cost = row_cost(step_s, self.k)

    def observe_step_time(self, num_tokens: int, seconds: float) -> None:
        """One decode step of one request (no prefill): ``num_tokens`` rows in ``seconds``; ``r`` for
        requests without a seed follows these steps once there are enough (:class:`ObservedRowCost`)."""
        if self.auto:
            self.observed.observe(num_tokens, seconds)

    def threshold(self, counts: AcceptanceCounts | None = None) -> float:
        """θ: the smallest chance of acceptance a draft is proposed at (``counts``: whose ``Ê``, a
        seeded request's own; the shared counts when None). ``r`` is the observed one for the shared
        counts once it exists and the profiled one for a seeded request's (0 before the profile)."""
        if not self.auto:
            return self.fixed
        if self.row_cost is None:
            return 0.0
        counts = counts or self.shared
        r = self.observed.row_cost if counts is self.shared else None
        return (self.row_cost if r is None else r) * counts.mean_tokens

    def length(self, match_length: int, num_drafts: int, counts: AcceptanceCounts | None = None) -> int:
        """Drafts to keep of a chain of ``num_drafts`` after a match of ``match_length`` tokens: those
        whose chance of acceptance (from ``counts``, the shared counts when None) is at least θ, at least
        one (0 only for an empty chain)."""
        counts = counts or self.shared
        theta = self.threshold(counts)
        if num_drafts <= 1 or theta <= 0:
            return num_drafts
        keep = 1
        for j, a in enumerate(counts.acceptance(match_length)[:num_drafts], start=1):
            if a >= theta:
                keep = j
            else:
                break
        return keep


def check_threshold(value: object, field: str) -> str | None:
    """None if ``value`` is ``"auto"`` or a number in [0, 1], else the error message naming ``field``."""
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        return f'{field} must be "auto" or a number in [0, 1], got {value!r}'
    return None
