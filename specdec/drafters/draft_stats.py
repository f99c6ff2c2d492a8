"""Per-request drafter counts: how much a drafter drafted and how much of it was accepted.

``request.drafter_metrics`` (``RequestOutput.metrics["drafter"]``) maps a drafter's name to its
:class:`MemberStats`: the hybrid drafter fills one per member (:mod:`specdec.drafters.hybrid`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sampling.token_tree import TokenTree
from specdec.drafters.base import DraftProposal


@dataclass
class MemberStats:
    """Counters of one drafter (a hybrid member engine-wide, or one request's).

    Attributes:
        num_chosen: steps its proposal was submitted.
        num_draft_tokens: drafted tokens submitted (a tree's depth).
        num_accepted_tokens: its accepted drafts: the verifier's count, except in a request's last step,
            where the tokens the request kept are counted (a stop rule may cut an accepted run).
        hindsight_accepted: tokens its proposal would have had accepted, summed over every step that any
            member drafted (its τ had it drafted alone: ``1 + hindsight_accepted / oracle steps``); for a
            drafter alone, over the steps it drafted.
    """

    num_chosen: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    hindsight_accepted: int = 0


def accepted_length(proposal: DraftProposal, committed: list[int]) -> int:
    """Drafts of ``proposal`` (chain or tree) that ``committed`` (the tokens after its position) confirms:
    a chain's longest equal prefix, a tree's longest root path."""
    tokens = proposal.token_ids
    if proposal.parents is None:
        n = 0
        while n < len(tokens) and n < len(committed) and int(tokens[n]) == committed[n]:
            n += 1
        return n
    depth_of: dict[int, int] = {}
    best = 0
    for i, (t, p) in enumerate(zip(tokens, proposal.parents)):
        d = 1 if p < 0 else depth_of.get(p, 0) + 1 if p in depth_of else 0
        if d and d <= len(committed) and int(t) == committed[d - 1]:
            depth_of[i] = d
            best = max(best, d)
    return best


def draft_depth(proposal: DraftProposal) -> int:
    """Drafts on a proposal's longest path: a chain's length, a tree's :attr:`TokenTree.max_depth` (0 for
    a malformed tree, which the engine drops)."""
    if proposal.parents is None:
        return len(proposal.token_ids)
    try:
        return TokenTree(tuple(proposal.token_ids), tuple(proposal.parents)).max_depth
    except (TypeError, ValueError):
        return 0
