"""What a step costs, for the policies that weigh drafts against time: target step seconds as a function
of the batched tokens, and drafting seconds per draft position.

:class:`StepCostModel` keeps a running mean of observed target steps per batched-token count and
interpolates between counts (linearly); beyond the counts seen it scales the nearest one by a prior
slope (``prior_slope``: the fraction of a one-token step that each extra token adds; small, since a
decode step is bound by reading the weights). Drafting costs
``draft_s_per_position`` seconds per draft position of the step (sequential draft steps: a draft model
or head drafts all requests' position d together), a running mean of observed drafting time divided by
the step's deepest draft.

``frozen=True`` (with the costs given up front) ignores observations: decisions then depend on the token
history alone, so seeded runs repeat exactly (the deterministic mode of the adaptive policies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.errors import ConfigError


@dataclass
class StepCostModel:
    """Step costs (see the module docstring).

    Attributes:
        step_s: ``{num_tokens: seconds}``, known target step times (the frozen costs, or a start);
            empty: nothing measured yet, and :meth:`target_s` is relative (1 for one token).
        draft_s_per_position: drafting seconds per draft position of a step.
        prior_slope: relative cost of one more batched token where nothing was measured.
        frozen: ignore observations.
        decay: weight of a new observation in the running means (0 < decay <= 1).

    Raises:
        ConfigError: negative or non-finite costs, token counts < 1, decay outside (0, 1].
    """

    step_s: dict[int, float] = field(default_factory=dict)
    draft_s_per_position: float = 0.0
    prior_slope: float = 1 / 64
    frozen: bool = False
    decay: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.step_s, dict):
            raise ConfigError(f"step_s must be a {{num_tokens: seconds}} dict, got {self.step_s!r}")
        clean: dict[int, float] = {}
        for n, s in self.step_s.items():
            if not isinstance(n, int) or n < 1 or not isinstance(s, (int, float)) or not 0 < s < math.inf:
                raise ConfigError(f"step_s entries must be num_tokens >= 1: seconds > 0, got {n!r}: {s!r}")
            clean[n] = float(s)
        self.step_s = clean
        for name in ("draft_s_per_position", "prior_slope"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.decay, (int, float)) or not 0 < self.decay <= 1:
            raise ConfigError(f"decay must be in (0, 1], got {self.decay!r}")

    def target_s(self, num_tokens: int) -> float:
        """Predicted seconds of a target step over ``num_tokens`` batched tokens."""
        known = sorted(self.step_s)
        if not known:
            return 1 + self.prior_slope * (num_tokens - 1)
        lo = [n for n in known if n <= num_tokens]
        hi = [n for n in known if n >= num_tokens]
        if lo and hi:
            a, b = lo[-1], hi[0]
            if a == b:
                return self.step_s[a]
            w = (num_tokens - a) / (b - a)
            return (1 - w) * self.step_s[a] + w * self.step_s[b]
        ref = lo[-1] if lo else hi[0]  # extrapolate from the nearest measured count with the prior slope
        base = self.step_s[ref] / (1 + self.prior_slope * (ref - 1))
        return base * (1 + self.prior_slope * (num_tokens - 1))

    def draft_s(self, depth: int) -> float:
        """Predicted drafting seconds of a step whose deepest draft is ``depth``."""
        return self.draft_s_per_position * depth

    def observe(self, num_tokens: int, target_s: float, depth: int, draft_s: float) -> None:
        """Fold one step's measured times in (ignored when frozen)."""
        if self.frozen or not (0 < target_s < math.inf):
            return
        old = self.step_s.get(num_tokens)
        self.step_s[num_tokens] = target_s if old is None else (1 - self.decay) * old + self.decay * target_s
        if depth > 0 and 0 <= draft_s < math.inf:
            per = draft_s / depth
            self.draft_s_per_position = (1 - self.decay) * self.draft_s_per_position + self.decay * per
