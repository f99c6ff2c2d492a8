"""Per-request drafter counts: how much a drafter drafted and how much of it was accepted.

``request.drafter_metrics`` (``RequestOutput.metrics["drafter"]``) maps a drafter's name to its
:class:`MemberStats`: the hybrid drafter fills one per member (:mod:`specdec.drafters.hybrid`), a drafter
that drafts alone one under its own name (:class:`DraftCounts`; suffix decoding), so the two report the
same keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from sampling.token_tree import TokenTree
from specdec.drafters.base import DraftInput, DraftProposal
from specdec.request import Request


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


@dataclass
class _Pending:
    position: int  # request length when drafted
    proposal: DraftProposal
    counted: bool = False  # on_verified counted its accepted drafts


class DraftCounts:
    """``request.drafter_metrics[name]`` of a drafter that drafts alone, counted as the hybrid counts its
    members: per step it drafted, the submitted depth; after verification, the accepted drafts; when the
    next step drafts (or the request finishes), what its proposal would have had accepted in hindsight
    (a request's last step has no ``on_verified``: its accepted drafts are the tokens the request kept).

    Args:
        name: the drafter's name (the key in ``request.drafter_metrics``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._pending: dict[str, _Pending] = {}

    def _stats(self, request: Request) -> MemberStats:
        if request.drafter_metrics is None:
            request.drafter_metrics = {self.name: MemberStats()}
        return request.drafter_metrics[self.name]

    def _score(self, request: Request) -> None:
        step = self._pending.pop(request.request_id, None)
        if step is None:
            return
        committed = request.token_ids[step.position :]
        got = accepted_length(step.proposal, committed)
        stats = self._stats(request)
        stats.hindsight_accepted += got
        if not step.counted:
            stats.num_accepted_tokens += min(got, len(committed))

    def proposed(self, x: DraftInput, proposal: DraftProposal) -> None:
        """The drafter submits ``proposal`` for ``x`` (empty: it drafts nothing this step)."""
        stats = self._stats(x.request)
        self._score(x.request)
        if x.max_drafts <= 0 or not proposal.token_ids:
            return
        stats.num_chosen += 1
        stats.num_draft_tokens += min(draft_depth(proposal), x.max_drafts)
        self._pending[x.request.request_id] = _Pending(len(x.request.token_ids), proposal)

    def verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """``on_verified``'s counts of the request's latest step."""
        step = self._pending.get(request.request_id)
        if step is not None and not step.counted and num_drafts:
            step.counted = True
            self._stats(request).num_accepted_tokens += num_accepted

    def finished(self, request: Request) -> None:
        """The request ended: its last step is scored and it is forgotten."""
        self._score(request)
