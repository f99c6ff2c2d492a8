"""The hybrid drafter without a model: what its members are told after verification, and its counts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch

from sampling.params import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.drafters.base import DrafterBase, DrafterContext, DraftInput, DraftProposal, RequestStates
from specdec.drafters.draft_stats import draft_depth
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.registry import register_drafter, unregister_drafter
from specdec.request import Request


class _Toy(DrafterBase):
    """A stateful model-free drafter: proposes ``last + 1, last + 2, ...``; like a draft model's KV, its
    per-request state advances by the drafts ``on_verified`` says were accepted (``kept``)."""

    calls: ClassVar[list[tuple[str, int, int]]] = []

    def __init__(self, ctx: DrafterContext) -> None:
        self.k = ctx.config.num_speculative_tokens
        self.kept: RequestStates[list[int]] = RequestStates(lambda: [0])

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        out = []
        for x in batch:
            last = x.request.token_ids[-1]
            out.append(DraftProposal([last + i for i in range(1, min(self.k, x.max_drafts) + 1)]))
        return out

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        _Toy.calls.append((request.request_id, num_drafts, num_accepted))
        self.kept.get(request)[0] += num_accepted


@pytest.fixture
def toy() -> Iterator[str]:
    register_drafter("test_stateful_toy")(_Toy)
    _Toy.calls = []
    yield "test_stateful_toy"
    unregister_drafter("test_stateful_toy")


def _hybrid(members: list[str], k: int = 3) -> HybridDrafter:
    config = SpeculativeConfig("hybrid", k, hybrid_members=members)
    return HybridDrafter(DrafterContext(None, config, None, torch.float32, torch.device("cpu"), None))  # type: ignore[arg-type]


def _verify(drafter: HybridDrafter, req: Request, proposal: DraftProposal, committed: list[int]) -> None:
    """What the engine does after a step: commit ``committed`` (the accepted drafts and one more token),
    then tell the drafter how many drafts it verified and accepted."""
    req.token_ids.extend(committed)
    drafter.on_verified(req, len(proposal.token_ids), len(committed) - 1)


def test_the_member_that_drafted_is_told_its_counts_and_the_others_nothing(toy):
    """Issue #10: the chosen member gets ``on_verified(request, drafts, accepted)``, every other member
    ``(0, 0)`` (what the engine tells a drafter whose proposal it did not verify)."""
    hybrid = _hybrid(["ngram", toy])
    toy_member = hybrid.members[1]
    req = Request("r", [1, 2, 3, 1, 2], SamplingParams(temperature=0, max_tokens=20), 0)

    # Step 1: n-gram ([3, 1, 2]) and the toy ([3, 4, 5]) are both unscored: n-gram, listed first, drafts.
    (proposal,) = hybrid.propose([DraftInput(req, 1, 3)])
    assert proposal.token_ids == [3, 1, 2]
    _verify(hybrid, req, proposal, [3, 4])  # one draft accepted, then 4
    assert _Toy.calls == [("r", 0, 0)]  # the toy did not draft
    assert toy_member.kept.get(req)[0] == 0

    # Step 2: in hindsight the toy would have had 2 accepted, n-gram 1: the toy drafts [5, 6, 7].
    (proposal,) = hybrid.propose([DraftInput(req, 1, 3)])
    assert proposal.token_ids == [5, 6, 7]
    _verify(hybrid, req, proposal, [5, 6, 9])
    assert _Toy.calls == [("r", 0, 0), ("r", 3, 2)]
    assert toy_member.kept.get(req)[0] == 2  # its own two accepted drafts
    stats = req.drafter_metrics
    assert (stats[toy].num_chosen, stats[toy].num_draft_tokens, stats[toy].num_accepted_tokens) == (1, 3, 2)
    assert (stats["ngram"].num_chosen, stats["ngram"].num_accepted_tokens) == (1, 1)


def test_a_tree_member_is_counted_by_its_depth():
    """A tree's submitted drafts are its depth (``TokenTree.max_depth``), capped by the step's depth."""
    hybrid = _hybrid(["suffix"], k=2)
    req = Request("t", [8, 1, 2, 3, 8, 1, 2, 4, 8, 1, 2], SamplingParams(temperature=0, max_tokens=20), 0)
    tree = DraftProposal([4, 8, 3, 8, 5], parents=[-1, 0, -1, 2, 3])  # depth 3
    hybrid.members[0].propose = lambda batch: [tree for _ in batch]
    (proposal,) = hybrid.propose([DraftInput(req, 1, 2, 5)])
    assert proposal is tree and req.drafter_metrics["suffix"].num_draft_tokens == 2
    assert draft_depth(tree) == 3 and draft_depth(DraftProposal([1, 2])) == 2
    assert draft_depth(DraftProposal([1, 2], parents=[-1, 5])) == 0  # malformed: the engine drops it


def test_an_unchosen_member_is_credited_what_later_tokens_confirm(toy):
    """A step commits the chosen member's accepted drafts and one more token, so an unchosen member's
    proposal that those tokens confirm stays open: when later steps confirm more of it, its running score
    grows by the growth times that term's weight (exact EMA arithmetic, decay 0.7), and it closes once a
    token contradicts it or it is confirmed to its depth."""
    hybrid = _hybrid([toy, "ngram"])
    req = Request("c", [5, 6, 4, 5, 6], SamplingParams(temperature=0, max_tokens=20), 0)
    # Step 1: both unscored, the toy (listed first) drafts [7, 8, 9]; n-gram would have [4, 5, 6].
    (proposal,) = hybrid.propose([DraftInput(req, 1, 3)])
    assert proposal.token_ids == [7, 8, 9]
    _verify(hybrid, req, proposal, [4])  # its first draft rejected: one token committed
    # Step 2: toy 0, n-gram 1 so far (its [4, 5, 6] confirmed to the one committed token: open).
    (proposal,) = hybrid.propose([DraftInput(req, 1, 3)])
    state = hybrid.states["c"]
    assert state.scores == [0.0, 1.0] and [(o.member, o.got, o.weight) for o in state.open] == [(1, 1, 1.0)]
    assert proposal.token_ids == [5, 6, 4]  # n-gram drafts
    _verify(hybrid, req, proposal, [5, 6, 4, 5])  # all three accepted, then 5
    # Step 3: step 1's n-gram proposal is now confirmed to its depth (3, not 1: +2 at weight 1), then
    # step 2 is scored: n-gram 0.7 * 3 + 0.3 * 3, the toy's [5, 6, 7] 0.7 * 0 + 0.3 * 2.
    hybrid.propose([DraftInput(req, 1, 3)])
    assert state.scores == pytest.approx([0.6, 3.0])  # without the growth n-gram would score 1.6
    assert state.open == []  # both closed: confirmed to depth, or contradicted
