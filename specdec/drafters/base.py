"""The drafter plug-in point."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.request import Request


@dataclass
class DraftInput:
    """What a drafter sees of one scheduled request in a step.

    Attributes:
        request: the request; ``request.token_ids`` are its committed tokens.
        num_new_tokens: committed tokens the target computes this step, from
            ``request.num_computed_tokens`` (a drafter with its own KV catches up on these).
        max_drafts: most tokens to propose (0: the request is prefilling, propose nothing).
    """

    request: Request
    num_new_tokens: int
    max_drafts: int


@dataclass
class DraftProposal:
    """Draft tokens for one request.

    Attributes:
        token_ids: up to ``max_drafts`` proposed tokens, continuing ``request.token_ids``.
        draft_probs: ``[len(token_ids), vocab_size]`` float32, the distribution each token was drawn
            from (the verifier divides by exactly these), or None for a deterministic drafter.
    """

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes draft tokens for running requests (``specdec/drafters/<method>.py``)."""

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        """One proposal per input, in order (empty where ``max_drafts`` is 0)."""
        ...

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Called after verification, before the request's next step (to roll back drafter state)."""
        ...
