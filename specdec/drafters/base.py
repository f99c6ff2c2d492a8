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
        max_drafts: most drafts on one path: a chain's length, a tree's depth (0: propose nothing,
            e.g. a prefill chunk that is not the prompt's last; the last chunk may carry drafts).
        max_tree_nodes: most nodes of a token tree (the KV slots reserved for drafts); chain drafters
            ignore it.
    """

    request: Request
    num_new_tokens: int
    max_drafts: int
    max_tree_nodes: int = 0


@dataclass
class DraftProposal:
    """Draft tokens for one request.

    Attributes:
        token_ids: up to ``max_drafts`` proposed tokens continuing ``request.token_ids`` (a chain), or the
            nodes of a token tree (see ``parents``).
        draft_probs: ``[len(token_ids), vocab_size]`` float32, the distribution each token was drawn
            from (the verifier divides by exactly these), or None for a deterministic drafter. Trees
            are deterministic (their children are top-k candidates): None.
        parents: None for a chain; for a token tree, each node's parent (-1 = the last committed token),
            in topological order (see :class:`specdec.drafters.tree.TokenTree`). The engine keeps at most
            ``max_tree_nodes`` nodes of depth at most ``max_drafts``.
    """

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None
    parents: list[int] | None = None


class Drafter(Protocol):
    """Proposes draft tokens for running requests (``specdec/drafters/<method>.py``)."""

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        """One proposal per input, in order (empty where ``max_drafts`` is 0)."""
        ...

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Called after verification, before the request's next step (to roll back drafter state)."""
        ...


class HiddenStateDrafter(Drafter, Protocol):
    """A drafter that reads the target's features (Medusa, EAGLE): the engine computes the final-norm
    hidden states of every row and hands over those of the committed tokens after each forward."""

    uses_hidden_states: bool

    def observe(self, request: Request, start_position: int, hidden_states: torch.Tensor) -> None:
        """``hidden_states`` ``[n, hidden_size]``: the target's features at positions ``start_position ...
        start_position + n - 1`` of the request (committed tokens computed this step: a prefill chunk,
        or the root and the accepted drafts of a verification), in order."""
        ...
