"""Acceptance statistics of speculative decoding, per request and aggregated.

Vocabulary: a *draft step* is one verification of >= 1 draft tokens for one request. Of its drafts, a
prefix (for a token tree: one root-to-node path) is *accepted*; the step then emits one more token
(recovered or bonus, see :class:`sampling.rejection_sampler.RejectionSampler`). A step's *draft length*
is the number of positions it drafted ahead: a chain's length, or a token tree's depth (``max_depth``),
the most tokens the step could accept.

Figures, defined the same way for chains and trees so that they compare (trees as in the Medusa, EAGLE
and SpecInfer papers: per verification step and per depth, not per node):

- ``mean_acceptance_length`` τ = 1 + accepted draft tokens / draft steps: tokens emitted per target
  forward (Leviathan et al. 2023 call its expectation the "expected number of tokens per run").
- ``acceptance_rate`` = accepted draft tokens / ``num_draft_tokens``, the summed draft lengths. For a
  chain that is accepted ÷ drafted; for a tree it is accepted ÷ depth, not ÷ nodes.
- ``accepted_per_position[d]`` = draft steps whose draft at position (tree: depth) ``d + 1`` was accepted;
  ``drafted_per_position[d]`` = draft steps that drafted that position (a chain of >= d + 1 tokens, a tree
  of depth >= d + 1); ``acceptance_rate_per_position[d]`` = their ratio, the acceptance at depth d + 1
  (None where no step drafted it).
- ``num_draft_nodes`` = draft tokens the target verified: equal to ``num_draft_tokens`` for chains, the
  node count for trees. ``num_accepted_tokens / num_draft_nodes`` is how much of the verification work
  was kept; it is not an acceptance rate (a 16-node tree of depth 4 cannot keep more than 4 of 16).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters of speculative decoding; per request, or summed over an engine's requests.

    Attributes:
        num_speculative_tokens: k, the longest chain (deepest tree) a step may draft.
        num_drafts: draft steps (verifications of >= 1 draft token).
        num_draft_tokens: summed draft lengths: tokens drafted per position, a chain's length or a token
            tree's depth per step (the denominator of ``acceptance_rate``).
        num_accepted_tokens: accepted draft tokens.
        accepted_per_position: per position (tree: depth) ``d + 1``, the steps that accepted a draft there.
        drafted_per_position: per position (tree: depth) ``d + 1``, the steps that drafted it.
        num_draft_nodes: draft tokens verified by the target (a tree's nodes; a chain's tokens).
        num_steps: sampling steps: target forwards that emitted tokens, drafting or not (the step that
            ends a prompt included); the denominator of ``tokens_per_step``.
        draft_time_s, verify_time_s: wall time spent drafting and verifying (engine-wide figures).
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    drafted_per_position: list[int] = field(default_factory=list)
    num_draft_nodes: int = 0
    num_steps: int = 0

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens
        if not self.drafted_per_position:
            self.drafted_per_position = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int, num_draft_nodes: int | None = None) -> None:
        """Record one sampling step: a draft step, or (no token drafted) a step counted in ``num_steps``
        alone.

        Args:
            num_draft_tokens: the step's draft length: a chain's length, or a token tree's depth.
            num_accepted: draft tokens accepted (<= ``num_draft_tokens``).
            num_draft_nodes: draft tokens verified (a tree's node count); None: ``num_draft_tokens`` (a
                chain).
        """
        self.num_steps += 1
        if num_draft_tokens == 0:
            return
        nodes = num_draft_tokens if num_draft_nodes is None else num_draft_nodes
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_draft_nodes += nodes
        self.num_accepted_tokens += num_accepted
        for counts, n in (
            (self.accepted_per_position, num_accepted),
            (self.drafted_per_position, num_draft_tokens),
        ):
            if n > len(counts):
                counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / summed draft lengths (a tree's depth, not its nodes); None before any
        draft step."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """τ = 1 + accepted draft tokens / draft steps: tokens emitted per verification step."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def tokens_per_step(self) -> float | None:
        """1 + accepted draft tokens / sampling steps: tokens emitted per target forward over every step,
        drafting or not (a request's last step counted in full, as for τ). τ counts draft steps only, so
        a drafter that drafts only where it matches (prompt lookup) has a higher τ than one that drafts
        every step for the same tokens per forward; compare drafters that draft at different rates by
        this figure (or by speed)."""
        return 1 + self.num_accepted_tokens / self.num_steps if self.num_steps else None

    @property
    def acceptance_rate_per_position(self) -> list[float | None]:
        """Per position (tree: depth) ``d + 1``: steps that accepted it / steps that drafted it (None where
        no step drafted it)."""
        return [a / n if n else None for a, n in zip(self.accepted_per_position, self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_draft_nodes": self.num_draft_nodes,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "mean_acceptance_length": self.mean_acceptance_length,
            "num_steps": self.num_steps,
            "tokens_per_step": self.tokens_per_step,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
        }

    def __repr__(self) -> str:
        """The counters and the derived figures (rates rounded to 4 digits, times to 3)."""

        def r(x: float | None, digits: int = 4) -> float | None:
            return None if x is None else round(x, digits)

        per_position = [r(x, 3) for x in self.acceptance_rate_per_position]
        return (
            f"SpecStats(num_drafts={self.num_drafts}, num_draft_tokens={self.num_draft_tokens}, "
            f"num_accepted_tokens={self.num_accepted_tokens}, acceptance_rate={r(self.acceptance_rate)}, "
            f"mean_acceptance_length={r(self.mean_acceptance_length)}, "
            f"tokens_per_step={r(self.tokens_per_step)}, "
            f"accepted_per_position={self.accepted_per_position}, "
            f"acceptance_rate_per_position={per_position}, num_draft_nodes={self.num_draft_nodes}, "
            f"num_speculative_tokens={self.num_speculative_tokens}, draft_time_s={r(self.draft_time_s, 3)}, "
            f"verify_time_s={r(self.verify_time_s, 3)})"
        )
