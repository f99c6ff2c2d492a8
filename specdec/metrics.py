"""Acceptance statistics of speculative decoding, per request and aggregated.

Vocabulary: a *draft step* is one verification of >= 1 draft tokens for one request. Of its drafts, a
prefix is *accepted*; the step then emits one more token (recovered or bonus, see
:class:`sampling.rejection_sampler.RejectionSampler`).

- ``acceptance_rate`` = accepted draft tokens / draft tokens proposed.
- ``mean_acceptance_length`` τ = 1 + accepted draft tokens / draft steps: tokens emitted per target
  forward (Leviathan et al. 2023 call its expectation the "expected number of tokens per run").
- ``accepted_per_position[i]`` = number of draft steps whose draft at position i (0-based) was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters of speculative decoding; per request, or summed over an engine's requests."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Record one draft step (nothing when no token was drafted)."""
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
        }
