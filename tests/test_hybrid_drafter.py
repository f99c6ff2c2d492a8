"""The hybrid drafter without a model: what its members are told after verification, and its counts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch

from sampling.params import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.drafters.base import DrafterBase, DrafterContext, DraftInput, DraftProposal, RequestStates
from specdec.drafters.draft_stats import accepted_length, draft_depth
from specdec.drafters.hybrid import (
    MIN_CALIBRATION,
    HybridDrafter,
    Kept,
    confidence_bucket,
    union_proposal,
    well_formed,
)
from specdec.drafters.registry import register_drafter, unregister_drafter
from specdec.errors import ConfigError
from specdec.request import Request, RequestStatus


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


def test_copiers_report_their_match_length_and_buckets_classify_it():
    """n-gram lookup and suffix decoding give the length of the context suffix they matched; the hybrid's
    buckets: match lengths 1..4 (longer share 4), five draft-probability bins, and 'none'."""
    hybrid = _hybrid(["ngram", "suffix"], k=2)
    req = Request("m", [7, 1, 2, 3, 9, 1, 2, 3], SamplingParams(temperature=0, max_tokens=20), 0)
    ngram, suffix = (m.propose([DraftInput(req, 1, 2)])[0] for m in hybrid.members)
    assert (ngram.token_ids, ngram.match_length) == ([9, 1], 3)  # "1 2 3" matched (prompt_lookup_max 3)
    assert (suffix.token_ids, suffix.match_length) == ([9, 1], 3)
    assert ngram.first_draft_prob is None
    assert hybrid.members[0].propose([DraftInput(req, 1, 0)])[0].match_length is None  # no drafts
    assert confidence_bucket(DraftProposal([1], match_length=9)) == ("match", 4)
    assert confidence_bucket(DraftProposal([1], first_draft_prob=0.39)) == ("prob", 1)
    assert confidence_bucket(DraftProposal([1], first_draft_prob=1.0)) == ("prob", 4)
    assert confidence_bucket(DraftProposal([1])) == ("none", 0)


class _Fixed(DrafterBase):
    """Proposes the next proposal the test put in its ``queue`` (one per request and step)."""

    def __init__(self, ctx: DrafterContext) -> None:
        self.queue: list[DraftProposal] = []

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        return [self.queue.pop(0) for _ in batch]


def test_the_choice_follows_the_calibrated_confidence_of_each_proposal():
    """Per step the member with the highest expected accepted drafts for its proposal's confidence bucket
    is chosen: the engine-wide mean hindsight score of the bucket (after MIN_CALIBRATION proposals) as a
    prior worth CALIBRATION_WEIGHT proposals, blended with the request's own running score there. A copier
    whose long matches were always confirmed beats a head whose running score is higher, only when its
    match is long."""
    register_drafter("test_fixed_a")(_Fixed)
    register_drafter("test_fixed_b")(_Fixed)
    try:
        hybrid = _hybrid(["test_fixed_a", "test_fixed_b"], k=2)
    finally:
        unregister_drafter("test_fixed_a")
        unregister_drafter("test_fixed_b")
    head, copier = hybrid.members
    params = SamplingParams(temperature=0, max_tokens=100)
    # Calibration from 8 earlier requests of one step each: the copier's match-3 proposals confirmed to
    # their depth (2), its match-1 proposals never; the head's prob-4 proposals 1 of 2 drafts.
    for r in range(MIN_CALIBRATION):
        req = Request(f"cal{r}", [0], params, 0)
        for length in (3, 1):
            head.queue.append(DraftProposal([5, 9], first_draft_prob=0.9))
            copier.queue.append(DraftProposal([5, 6] if length == 3 else [7, 7], match_length=length))
            hybrid.propose([DraftInput(req, 1, 2)])
            req.token_ids.extend([5, 6])
            hybrid.on_verified(req, 2, 1)
        req.status = RequestStatus.FINISHED_LENGTH
        hybrid.reset(req)
    assert hybrid.calibration[0][("prob", 4)] == [2 * MIN_CALIBRATION, 2 * MIN_CALIBRATION]
    assert hybrid.calibration[1][("match", 3)] == [2 * MIN_CALIBRATION, MIN_CALIBRATION]
    assert hybrid.calibration[1][("match", 1)] == [0, MIN_CALIBRATION]
    # A new request: the head is confident, the copier matched 1 token: head (1.0 against 0.0).
    req = Request("new", [0], params, 0)
    state = hybrid._state(req)
    head_p, short = DraftProposal([5, 9], first_draft_prob=0.9), DraftProposal([5, 6], match_length=1)
    assert hybrid.choose(state, [head_p, short]) == 0
    # The copier matched 3 tokens: 2.0 beats 1.0, although neither has a running score in this request.
    assert hybrid.choose(state, [head_p, DraftProposal([5, 6], match_length=3)]) == 1
    # The request's own running score for the bucket moves the estimate: after one match-3 proposal of the
    # copier with nothing accepted here, (4 * 2.0 + 1 * 0.0) / 5 = 1.6, still above the head's 1.0.
    state.bucket_scores[1][("match", 3)], state.bucket_counts[1][("match", 3)] = 0.0, 1
    assert hybrid.estimate(state, 1, ("match", 3)) == pytest.approx(1.6)
    # An uncalibrated bucket falls back to the member's running score in the request (none yet: 0).
    assert hybrid.estimate(state, 1, ("match", 2)) == 0.0


class _FixedHead(_Fixed):
    """A learned member (reads the target's features): records the depth it was asked for."""

    uses_hidden_states = True

    def __init__(self, ctx: DrafterContext) -> None:
        super().__init__(ctx)
        self.asked: list[int] = []

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        self.asked.extend(x.max_drafts for x in batch)
        return [self.queue.pop(0) if x.max_drafts > 0 else DraftProposal([]) for x in batch]

    def observe(self, request, start_position, hidden_states) -> None:
        pass


def _head_and_copier(skip: bool) -> HybridDrafter:
    """A hybrid of a :class:`_FixedHead` and a :class:`_Fixed` copier, k = 2."""
    register_drafter("test_fixed_head")(_FixedHead)
    register_drafter("test_fixed_copier")(_Fixed)
    try:
        config = SpeculativeConfig(
            "hybrid", 2, hybrid_members=["test_fixed_head", "test_fixed_copier"], hybrid_skip_outranked=skip
        )
        return HybridDrafter(DrafterContext(None, config, None, torch.float32, torch.device("cpu"), None))  # type: ignore[arg-type]
    finally:
        unregister_drafter("test_fixed_head")
        unregister_drafter("test_fixed_copier")


@pytest.mark.parametrize("skip", [True, False])
def test_the_head_skips_steps_a_copier_outranks(skip):
    """With ``hybrid_skip_outranked`` the learned member is asked for no drafts (depth 0) for a request
    whose model-free proposal has a higher estimate than any first-draft probability could give the head;
    otherwise it drafts every step."""
    hybrid = _head_and_copier(skip)
    head, copier = hybrid.members
    req = Request("s", [0], SamplingParams(temperature=0, max_tokens=100), 0)
    # Step 1: the head drafts [5, 9] (1 accepted); the copier's match-3 proposal [5, 6] would have had 2.
    head.queue.append(DraftProposal([5, 9], first_draft_prob=0.9))
    copier.queue.append(DraftProposal([5, 6], match_length=3))
    assert hybrid.propose([DraftInput(req, 1, 2)])[0].token_ids == [5, 9]
    req.token_ids.extend([5, 6])
    hybrid.on_verified(req, 2, 1)
    # Step 2: the copier's match-3 bucket scores 2 in this request, the head's best is its running score 1.
    head.queue.append(DraftProposal([7, 7], first_draft_prob=0.9))
    copier.queue.append(DraftProposal([8, 8], match_length=3))
    assert hybrid.propose([DraftInput(req, 1, 2)])[0].token_ids == [8, 8]
    assert head.asked == ([2, 0] if skip else [2, 2])
    # Step 3: a copier with nothing to propose never makes the head skip.
    req.token_ids.extend([8])
    hybrid.on_verified(req, 2, 0)
    head.queue[:] = [DraftProposal([3], first_draft_prob=0.5)]  # (step 2's [7, 7] was never asked for)
    copier.queue.append(DraftProposal([]))
    assert hybrid.propose([DraftInput(req, 1, 2)])[0].token_ids == [3]
    assert head.asked[-1] == 2


def test_a_skipped_head_drafts_again_after_max_skips():
    """A head the copier outranks is skipped at most MAX_SKIPS steps in a row, then drafts (and is scored)
    once: a head whose figures were frozen by skipping would otherwise never be measured again. A head's
    non-finite probability falls in the lowest bin."""
    hybrid = _head_and_copier(True)
    head, copier = hybrid.members
    req = Request("k", [0], SamplingParams(temperature=0, max_tokens=100), 0)
    for step in range(9):
        # The copier (match 3) was right at step 0 only; the head is never right: it is skipped while the
        # copier's running score (2, decaying 0.7 a step) beats the head's (0), except every 4th step.
        head.queue[:] = [DraftProposal([1, 1], first_draft_prob=0.9)]
        copier.queue.append(DraftProposal([5, 6] if step == 0 else [7, 7], match_length=3))
        hybrid.propose([DraftInput(req, 1, 2)])
        req.token_ids.extend([5, 6])
        hybrid.on_verified(req, 2, 0)
    assert head.asked == [2, 0, 0, 0, 2, 0, 0, 0, 2]
    assert confidence_bucket(DraftProposal([1], first_draft_prob=float("nan"))) == ("prob", 0)


class _LazyHead(_FixedHead):
    """A learned member with a fixed backlog (5 tokens) and catch-up report (0.25 s over 5 tokens)."""

    def draft_backlog(self, request: Request, num_new_tokens: int) -> int:
        return 5

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        self.catch_up_s, self.catch_up_tokens = 0.25, 5
        return [DraftProposal([]) for _ in batch]


def test_the_backlog_is_the_longest_members_and_catch_up_seconds_add_up():
    """Members that read committed tokens lazily (a learned head, suffix decoding's trie) read the same
    backlog before a request's next draft: the hybrid tells the policy the longest member backlog, and
    reports their catch-up seconds summed over the most tokens a member caught up on."""
    register_drafter("test_lazy_head")(_LazyHead)
    try:
        config = SpeculativeConfig("hybrid", 3, hybrid_members=["test_lazy_head", "suffix"])
        hybrid = HybridDrafter(DrafterContext(None, config, None, torch.float32, torch.device("cpu"), None))  # type: ignore[arg-type]
    finally:
        unregister_drafter("test_lazy_head")
    suffix = hybrid.members[1]
    short = Request("short", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8), 0)
    long = Request("long", list(range(30)) * 2, SamplingParams(temperature=0, max_tokens=8), 0)
    assert hybrid.draft_backlog(short, 3) == 5  # the head's; the suffix trie's is 2
    assert hybrid.draft_backlog(long, 60) == 59  # the suffix trie's: the whole prompt but its last token
    hybrid.propose([DraftInput(long, 60, 3, 0)])
    assert suffix.catch_up_tokens == 59 and suffix.catch_up_s > 0
    assert hybrid.catch_up_tokens == 59 and hybrid.catch_up_s == pytest.approx(0.25 + suffix.catch_up_s)
    long.num_computed_tokens = 60
    assert hybrid.draft_backlog(long, 1) == 5  # the suffix trie keeps up now


# ----------------------------------------------------------------------------------- union (hybrid_union)
def test_the_union_shares_common_prefixes_and_keeps_every_path():
    """Two chains that agree on their first draft share that node; the result's root paths are exactly
    the chains' (each kept whole within the budget), with the first proposal's confidence."""
    a = DraftProposal([5, 6, 7], match_length=3)
    b = DraftProposal([5, 9, 4], first_draft_prob=0.4)
    tree, kept = union_proposal([a, b], max_nodes=6, max_depth=3)
    assert (tree.token_ids, tree.parents) == ([5, 6, 7, 9, 4], [-1, 0, 1, 0, 3])
    assert kept == [Kept(3, 3), Kept(3, 3)] and tree.match_length == 3 and tree.first_draft_prob is None
    committed = [5, 9, 4, 2]
    assert accepted_length(tree, committed) == max(accepted_length(p, committed) for p in (a, b)) == 3


def test_the_union_of_equal_chains_is_a_chain_and_budget_and_depth_cut_later_members():
    same, _ = union_proposal([DraftProposal([1, 2]), DraftProposal([1, 2, 3])], max_nodes=8, max_depth=4)
    assert (same.token_ids, same.parents) == ([1, 2, 3], None)  # one path: a chain
    # budget 4: the first chain whole, one node of the second (its root), the rest left out with its subtree
    cut, kept = union_proposal([DraftProposal([1, 2, 3]), DraftProposal([4, 5, 6])], max_nodes=4, max_depth=3)
    assert (cut.token_ids, cut.parents, kept) == ([1, 2, 3, 4], [-1, 0, 1, -1], [Kept(3, 3), Kept(1, 1)])
    # depth 2: nodes deeper than 2 are left out; a tree input keeps its own branching
    tree = DraftProposal([1, 2, 3, 8], parents=[-1, 0, 1, 0])
    deep, kept = union_proposal([tree, DraftProposal([1, 7, 9])], max_nodes=10, max_depth=2)
    assert (deep.token_ids, deep.parents, kept) == ([1, 2, 8, 7], [-1, 0, 0, 0], [Kept(3, 2), Kept(2, 2)])
    assert union_proposal([], 4, 4)[0].token_ids == []
    # a member's own duplicate siblings share one node, counted once
    dup, kept = union_proposal(
        [DraftProposal([5, 5, 6, 7], parents=[-1, -1, 0, 1])], max_nodes=8, max_depth=4
    )
    assert (dup.token_ids, dup.parents, kept) == ([5, 6, 7], [-1, 0, 0], [Kept(3, 2)])


def test_only_well_formed_proposals_join_a_union():
    assert well_formed(DraftProposal([1, 2], parents=[-1, 0]), vocab_size=8)
    assert not well_formed(DraftProposal([1, 9]), vocab_size=8)  # outside the vocabulary
    assert not well_formed(DraftProposal([1, True]))  # not integers
    assert not well_formed(DraftProposal([1, 2, 3], parents=[-2, 0, 1]))  # parent below -1
    assert not well_formed(DraftProposal([1, 2, 3], parents=[-1, 2, 0]))  # a later node as parent
    assert not well_formed(DraftProposal([1, 2], parents=[-1]))  # a parent per token


def test_a_union_tells_each_member_its_own_counts(toy):
    """``hybrid_union=True``: the members' chains go in as one tree (best-ranked first), each member is
    counted as drafting, and is told its own nodes and the drafts of its path that the committed tokens
    confirm."""
    config = SpeculativeConfig("hybrid", 3, hybrid_members=["ngram", toy], hybrid_union=True)
    assert config.num_draft_slots == 6
    hybrid = HybridDrafter(DrafterContext(None, config, None, torch.float32, torch.device("cpu"), None))  # type: ignore[arg-type]
    req = Request("u", [1, 2, 3, 1, 2], SamplingParams(temperature=0, max_tokens=20), 0)
    (proposal,) = hybrid.propose([DraftInput(req, 1, 3, 6)])
    # n-gram [3, 1, 2] (unscored: listed first, ranked first), the toy [3, 4, 5]: sharing the root 3
    assert (proposal.token_ids, proposal.parents) == ([3, 1, 2, 4, 5], [-1, 0, 1, 0, 3])
    req.token_ids.extend([3, 4, 9])  # the toy's path: two drafts accepted, then 9
    hybrid.on_verified(req, len(proposal.token_ids), 2)
    assert _Toy.calls == [("u", 3, 2)]  # its 3 nodes (the shared root counted), 2 accepted
    stats = req.drafter_metrics
    assert (stats["ngram"].num_chosen, stats["ngram"].num_accepted_tokens) == (1, 1)
    assert (stats[toy].num_chosen, stats[toy].num_draft_tokens, stats[toy].num_accepted_tokens) == (1, 3, 2)
    with pytest.raises(ConfigError, match="hybrid_union must be a bool"):
        SpeculativeConfig("hybrid", 3, hybrid_union=1)


def _union(members: list[str], k: int = 3) -> HybridDrafter:
    config = SpeculativeConfig("hybrid", k, hybrid_members=members, hybrid_union=True)
    return HybridDrafter(DrafterContext(None, config, None, torch.float32, torch.device("cpu"), None))  # type: ignore[arg-type]


def test_a_member_cut_by_the_budget_is_counted_by_what_went_in(toy):
    """With room for 4 nodes, n-gram's [3, 1, 2] goes in whole and the toy's [3, 4, 5] as the shared root
    and its 4 (its 5 is cut): the toy's drafts are its kept depth (2), its nodes 2."""
    hybrid = _union(["ngram", toy])
    req = Request("b", [1, 2, 3, 1, 2], SamplingParams(temperature=0, max_tokens=20), 0)
    (proposal,) = hybrid.propose([DraftInput(req, 1, 3, 4)])
    assert (proposal.token_ids, proposal.parents) == ([3, 1, 2, 4], [-1, 0, 1, 0])
    req.token_ids.extend([3, 4, 5])  # the toy's path to depth 2 (its 5 was cut): 3, 4 accepted, then 5
    hybrid.on_verified(req, 4, 2)
    assert _Toy.calls == [("b", 2, 2)]  # its two nodes in the tree (3 shared, 4), both accepted
    stats = req.drafter_metrics
    assert (stats[toy].num_draft_tokens, stats[toy].num_accepted_tokens) == (2, 2)
    assert (stats["ngram"].num_draft_tokens, stats["ngram"].num_accepted_tokens) == (3, 1)


def test_a_sampled_or_malformed_proposal_stays_out_of_the_union(toy, caplog):
    """A proposal with draft probabilities that ranks first goes alone (verified against its own
    distributions), and when the engine drops it nothing is credited later; a malformed best proposal
    is left out (logged once) and the union of the others goes."""
    hybrid = _union([toy, "ngram"])
    req = Request("s", [1, 2, 3, 1, 2], SamplingParams(temperature=1.0, max_tokens=20), 0)
    sampled = DraftProposal([3, 4, 5], draft_probs=torch.full((3, 8), 1 / 8))
    hybrid.members[0].propose = lambda batch: [sampled for _ in batch]
    (proposal,) = hybrid.propose([DraftInput(req, 1, 3, 6)])
    assert proposal is sampled and hybrid.states["s"].pending.merged == ()
    hybrid.on_verified(req, 0, 0)  # dropped: nothing verified
    req.token_ids.append(3)  # the step's one token happens to be the toy's first draft
    hybrid.members[0].propose = lambda batch: [DraftProposal([3, -4, 5]) for _ in batch]
    with caplog.at_level("WARNING", logger="specdec.drafters.hybrid"):
        # Both scored 1 in hindsight (n-gram's [3, 1, 2] too): the toy, listed first, ranks first but is
        # malformed: n-gram's proposal goes (a chain: the union of one), and the toy is not counted.
        (proposal,) = hybrid.propose([DraftInput(req, 1, 3, 6)])
        assert proposal.token_ids == [1, 2, 3] and proposal.parents is None
        assert hybrid.states["s"].pending.submitted() == {1: 3}
        hybrid.propose([DraftInput(req, 1, 3, 6)])  # again: not logged again
    assert sum("left out of the union" in r.message for r in caplog.records) == 1
    stats = req.drafter_metrics
    assert stats[toy].num_accepted_tokens == 0  # the dropped step credited nothing (hindsight: 1)
    assert (stats[toy].num_chosen, stats["ngram"].num_chosen) == (1, 2)
