"""A hybrid drafter: per request and per step, the member proposal expected to have the most drafts accepted.

The measured winner changes with the task (prompt lookup on code, learned drafters on chat; suffix
decoding where text repeats across turns and requests), so ``method="hybrid"`` runs every member each
step (model-free members cost microseconds; a learned member, at most one: an EAGLE, EAGLE-3 or Medusa
head, loaded from ``model`` or the target's built-in head, costs its draft step) and submits one proposal
per request: that of the member with the highest :meth:`HybridDrafter.estimate` among those that
proposed something. After the step, every member's proposal is scored in hindsight against the tokens
the step committed: a chain scores its longest prefix equal to them, a tree its longest root path. A
request's score per member is an exponential moving average of those scores (decay :data:`DECAY`);
before any, members are tried in their configured order.

**Per-step confidence.** Each proposal carries its member's own confidence: a copier's matched suffix
length (``DraftProposal.match_length``), a learned drafter's top-1 probability at its first draft
position (``first_draft_prob``), put in a few buckets (:func:`confidence_bucket`). The hybrid keeps, per
member and bucket, the request's running score and an engine-wide mean of the final hindsight scores (a
calibration table over every request's steps), and estimates a proposal's accepted drafts from both
(:meth:`HybridDrafter.estimate`): a copier's long match can then win a step against a head whose steady
short acceptances keep its running score higher. On Spec-Bench (26 questions, greedy, SmolLM2) the
EAGLE-3 + suffix + n-gram hybrid's τ went from 1.82 to 1.86, and from 1.84 to 1.92 on 26 other questions
(docs/suffix_decoding.md). The table pools acceptance counts across requests (never their text): a
request's member choice, and so its speed, depends on the requests before it; its output distribution
never does. A request with a seed (``SamplingParams.seed``) chooses without the table (a sampled request
draws one random number per draft, so its tokens would depend on the requests before it), as suffix
decoding's chain cut gives a seeded request counts of its own.
A proposal that every token committed so far confirms stays open: as later steps commit more tokens its
hindsight score grows, and the growth is added to the running score with the weight that score's term
has by then (a step commits only the chosen member's accepted drafts and one more token, so without this
an unchosen member that would have had 4 drafts accepted where the chosen one had 0 was credited 1: the
member drafting held its place against a better copier).

Exactness: the member is chosen from committed tokens only, before the step's drafts are verified (the
confidences are the members' top-1 probabilities and match lengths, never a sampled draft's), so
whichever member drafts, the exact verifier keeps the target's distribution (as for the speculation
policies, :mod:`specdec.policies.base`). The speculation policy still sets each request's depth
(``max_drafts``) before the hybrid drafts.

**Union** (``hybrid_union=True``): instead of the best proposal alone, the hybrid submits the union of
its members' deterministic proposals as one token tree (:func:`union_proposal`: common prefixes shared,
the members' nodes added best-ranked first within the step's node budget), so that a step accepts the
longest of its members' accepted paths. Every root path of the union is one member's, so for a greedy
request with every proposal kept whole the step accepts exactly what its best member in hindsight would
have: the hybrid's τ is the oracle's. The cost is the extra rows verified (a chain config reserves
``k × len(members)`` slots). This is multi-draft speculation (SpecInfer, Miao et al. 2024, verifies a
tree merged from several drafters' candidates); the tree verifier keeps it exact, since the nodes depend
on committed tokens only.

Metrics (:meth:`HybridDrafter.report`): per member, the steps it drafted for (in a union, every member
whose nodes went in), its drafted and accepted tokens (in a union, its own path's accepted drafts),
and the tokens it would have had accepted had it drafted every step (in hindsight); and the oracle,
the best member per step in hindsight (computed when each request finishes, from its whole output:
exact for greedy requests). Each request's own counts are in ``request.drafter_metrics``
(``RequestOutput.metrics["drafter"]``).
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.config import DEFAULT_HYBRID_MEMBERS, SpeculativeConfig
from specdec.drafters.base import Drafter, DrafterBase, DrafterContext, DraftInput, DraftProposal
from specdec.drafters.draft_stats import MemberStats, accepted_length, draft_depth
from specdec.drafters.registry import check_protocol, get_drafter, register_drafter
from specdec.drafters.suffix import SUFFIX_FIELDS, check_suffix_config
from specdec.errors import ConfigError
from specdec.models.config import ModelArchConfig
from specdec.request import Request

if TYPE_CHECKING:
    from specdec.model_runner import ModelRunner

logger = logging.getLogger(__name__)

#: Members when ``hybrid_members`` is None.
DEFAULT_MEMBERS = DEFAULT_HYBRID_MEMBERS
#: Weight of the past in a member's running score (per step).
DECAY = 0.7


#: Registered with no ``model`` to load, yet drafting with a model of their own (the target's weights
#: quantized, on the target's own KV cache): not a hybrid member.
MODEL_DRAFTERS = ("quantized_self",)


def check_hybrid_config(config: SpeculativeConfig) -> None:
    """Validate ``hybrid_members`` and the members' own fields once, at config construction.

    Raises:
        ConfigError: ``hybrid_members`` not a non-empty list of distinct registered drafter names, a
            member that drafts with a model of its own (a draft model, the quantized target: not
            supported), more than one learned member (heads), "hybrid" itself, a member that does not
            draft the configured ``tree``; ``hybrid_skip_outranked`` or ``hybrid_union`` not a bool;
            ``quantization`` without a learned member (it quantizes that member's head, as for the
            member alone); the suffix fields' errors.
    """
    members = config.hybrid_members
    if members is not None:
        if isinstance(members, str) or not isinstance(members, (list, tuple)) or not members:
            raise ConfigError(f"hybrid_members must be a non-empty list of drafter names, got {members!r}")
        bad = [m for m in members if not isinstance(m, str)]
        if bad:
            raise ConfigError(
                f"hybrid_members must list drafter names (str), got {bad[0]!r} in {list(members)}"
            )
        if len(set(members)) != len(members):
            raise ConfigError(f"hybrid_members must be distinct, got {list(members)}")
        for name in members:
            if name == "hybrid":
                raise ConfigError("hybrid_members cannot contain 'hybrid'")
            try:
                entry = get_drafter(name)
            except ConfigError as e:
                raise ConfigError(f"hybrid_members: {e}") from None
            if entry.model == "model" or name in MODEL_DRAFTERS:
                raise ConfigError(
                    f"hybrid_members: {name!r} drafts with a model of its own; the hybrid takes model-free "
                    f"members (e.g. {list(DEFAULT_MEMBERS)}) and at most one learned head (eagle, eagle3, "
                    "medusa)"
                )
            if config.tree is not None and config.tree not in entry.trees and None not in entry.trees:
                raise ConfigError(f"hybrid_members: {name!r} drafts neither chains nor tree={config.tree!r}")
        learned = [m for m in members if get_drafter(m).model == "heads"]
        if len(learned) > 1:
            raise ConfigError(f"hybrid_members: at most one learned head (they share model=), got {learned}")
    if not isinstance(config.hybrid_skip_outranked, bool):
        raise ConfigError(f"hybrid_skip_outranked must be a bool, got {config.hybrid_skip_outranked!r}")
    if not isinstance(config.hybrid_union, bool):
        raise ConfigError(f"hybrid_union must be a bool, got {config.hybrid_union!r}")
    if config.quantization is not None and learned_member(config) is None:
        raise ConfigError(
            f"quantization={config.quantization!r} quantizes the hybrid's learned member (eagle, eagle3, "
            f"medusa), and the members {list(config.hybrid_members or DEFAULT_MEMBERS)} include none"
        )
    check_suffix_config(config)


def learned_member(config: SpeculativeConfig) -> str | None:
    """The hybrid's learned member (a head drafter: its ``model`` is the config's), or None."""
    for name in config.hybrid_members or DEFAULT_MEMBERS:
        if get_drafter(name).model == "heads":
            return name
    return None


def check_member_target(arch: ModelArchConfig, config: SpeculativeConfig, model_dir: Path | None) -> None:
    """The learned member's own check against the target (its head's sizes), before any weights load."""
    member = learned_member(config)
    check = get_drafter(member).check_target if member is not None else None
    if check is not None:
        check(arch, config, model_dir)


@dataclass
class _Step:
    position: int  # request length when drafted
    proposals: list[DraftProposal]
    chosen: int  # member index, -1: none
    counted: bool = False  # the submitted members' accepted drafts were counted (or none verified)
    #: With ``hybrid_union``: the members whose nodes went into the submitted tree (the chosen first)
    #: and what of each; empty: the chosen member's proposal went alone.
    merged: tuple[tuple[int, Kept], ...] = ()

    def submitted(self) -> dict[int, int | None]:
        """The members whose drafts the step verified -> the most of their drafts it could accept
        (their kept depth in a union; None: the whole proposal went)."""
        if self.merged:
            return {i: k.depth for i, k in self.merged}
        return {} if self.chosen < 0 else {self.chosen: None}


#: A proposal's confidence bucket (:func:`confidence_bucket`).
Bucket = tuple[str, int]
#: Largest ``match_length`` bucket (longer matches share it) and the ``first_draft_prob`` buckets' count.
MAX_MATCH_BUCKET = 4
PROB_BUCKETS = 5
#: Scored proposals of a (member, bucket) engine-wide before its calibrated mean is used, and that mean's
#: weight against the request's own running score for the bucket, in proposals.
MIN_CALIBRATION = 8
CALIBRATION_WEIGHT = 4.0
#: Most steps in a row the learned member may skip for a request (then it drafts once, and is scored).
MAX_SKIPS = 3


def confidence_bucket(proposal: DraftProposal) -> Bucket:
    """The per-step confidence class of a member's proposal: ``("match", min(match_length, 4))`` for a
    copier, ``("prob", b)`` with ``b = floor(5 × first_draft_prob)`` (at most 4) for a learned drafter,
    ``("none", 0)`` for a proposal that reports neither."""
    if proposal.match_length is not None:
        return ("match", min(int(proposal.match_length), MAX_MATCH_BUCKET))
    p = proposal.first_draft_prob
    if p is not None:
        # Not a finite number (a head's overflowed logits): the lowest bin, its drafts get verified anyway.
        return ("prob", min(int(p * PROB_BUCKETS), PROB_BUCKETS - 1) if math.isfinite(p) and p > 0 else 0)
    return ("none", 0)


def well_formed(proposal: DraftProposal, vocab_size: int | None = None) -> bool:
    """Whether a member's proposal can join a union: integer tokens (Python or numpy), non-negative
    (and below ``vocab_size`` when given),
    and for a tree one parent per token, each -1 or an earlier node (the engine's own check drops a
    malformed proposal that goes alone; in a union it would take the other members' drafts with it)."""
    tokens = proposal.token_ids
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in tokens):
        return False
    if not all(t >= 0 and (vocab_size is None or t < vocab_size) for t in tokens):
        return False
    parents = proposal.parents
    if parents is None:
        return True
    return len(parents) == len(tokens) and all(
        isinstance(q, numbers.Integral) and not isinstance(q, bool) and -1 <= q < i
        for i, q in enumerate(parents)
    )


@dataclass(frozen=True)
class Kept:
    """What of one proposal a union holds: its distinct nodes there (shared ones included) and the
    depth of its deepest kept node (its drafts on one path: what it can have accepted)."""

    nodes: int
    depth: int


def union_proposal(
    proposals: list[DraftProposal], max_nodes: int, max_depth: int
) -> tuple[DraftProposal, list[Kept]]:
    """One token tree holding ``proposals`` in order of preference.

    Each proposal's nodes join in its own topological order: a node whose token path is already in the
    tree shares that node; a new node is added while the tree has fewer than ``max_nodes`` nodes and its
    depth is at most ``max_depth``; a node left out takes its subtree with it. Every root path of the
    result is a root path (or its prefix) of one of the proposals, and a proposal kept whole keeps every
    one of its paths, so a step verifying the union accepts the longest accepted path of any kept
    proposal (multi-draft speculation; SpecInfer, Miao et al. 2024, merges several drafters' candidates
    into one token tree). Siblings are distinct tokens, as the tree verifier needs.

    Args:
        proposals: deterministic proposals (chains or trees, ``draft_probs`` None), each
            :func:`well_formed`.
        max_nodes: most nodes of the result (the step's draft slots).
        max_depth: most drafts on one path (the step's depth).

    Returns:
        (the tree: ``parents`` None when it is one chain; ``match_length`` and ``first_draft_prob`` of
        the first proposal, what the hybrid ranked it by; per proposal, :class:`Kept`).
    """
    tokens: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent node or -1, token) -> node
    kept: list[Kept] = []
    for proposal in proposals:
        own_parents = proposal.parents
        if own_parents is None:
            own_parents = list(range(-1, len(proposal.token_ids) - 1))
        mapped: list[int | None] = []
        for token, parent in zip(proposal.token_ids, own_parents):
            at = -1 if parent < 0 else mapped[parent]
            if at is None:  # its parent was left out
                mapped.append(None)
                continue
            key = (at, int(token))
            node = node_of.get(key)
            if node is None:
                d = 1 if at < 0 else depth[at] + 1
                if len(tokens) >= max_nodes or d > max_depth:
                    mapped.append(None)
                    continue
                node = node_of[key] = len(tokens)
                tokens.append(int(token))
                parents.append(at)
                depth.append(d)
            mapped.append(node)
        mine = {n for n in mapped if n is not None}
        kept.append(Kept(len(mine), max((depth[n] for n in mine), default=0)))
    first = proposals[0] if proposals else DraftProposal([])
    chain = all(p == i - 1 for i, p in enumerate(parents))
    tree = DraftProposal(
        tokens,
        parents=None if chain else parents,
        match_length=first.match_length,
        first_draft_prob=first.first_draft_prob,
    )
    return tree, kept


@dataclass
class _Open:
    """A member's scored proposal that every committed token so far confirms: its score may still grow."""

    step: _Step
    member: int
    bucket: Bucket
    got: int  # its hindsight score so far, in the member's running scores
    depth: int  # the proposal's drafts on its longest path (draft_depth): confirmed that far, it closes
    weight: float  # that term's weight in the member's running score now (DECAY per later update)
    bucket_weight: float  # the same in the member's running score for ``bucket``


@dataclass
class _HybridState:
    scores: list[float | None]
    #: Per member, a running score per confidence bucket (same decay, updated by that bucket's proposals).
    bucket_scores: list[dict[Bucket, float]] = field(default_factory=list)
    bucket_counts: list[dict[Bucket, int]] = field(default_factory=list)
    skipped: int = 0  # steps in a row the learned member was skipped (hybrid_skip_outranked)
    pending: _Step | None = None  # scored at the next proposal (or when the request ends)
    history: list[_Step] = field(default_factory=list)  # for the oracle, scored at the end
    open: list[_Open] = field(default_factory=list)  # each closes within k steps: at most members x k
    seeded: bool = False  # the request has a seed: its choices ignore the engine-wide table


@register_drafter(
    "hybrid",
    trees=(None, "dynamic"),
    fields=(
        "hybrid_members", "prompt_lookup_max", "prompt_lookup_min", "max_tree_nodes", "tree_topk",
        "draft_vocab", "quantization", "hybrid_skip_outranked", "hybrid_union", *SUFFIX_FIELDS,
    ),
    check_config=check_hybrid_config,
    check_target=check_member_target,
    model_of=learned_member,
)  # fmt: skip
class HybridDrafter(DrafterBase):
    """Per request and step, the member proposal with the most expected accepted drafts.

    Args:
        ctx: built into every member (``config.hybrid_members``, default suffix and n-gram).
        members: already built members (tests); None builds them from the registry.

    Attributes:
        names: the members' names, in order.
        stats: engine-wide :class:`MemberStats` per member name.
        oracle_steps, oracle_accepted: steps where any member drafted, and the tokens the best member of
            each would have had accepted (in hindsight, over finished requests).
    """

    def __init__(self, ctx: DrafterContext, members: dict[str, Drafter] | None = None) -> None:
        if members is None:
            names = list(ctx.config.hybrid_members or DEFAULT_MEMBERS)
            members = {n: get_drafter(n).factory(ctx) for n in names}
        for name, m in members.items():
            check_protocol(m, name)
        self.names = list(members)
        self.members = list(members.values())
        self.uses_hidden_states = any(m.uses_hidden_states for m in self.members)
        #: The target layers whose residual streams a member reads (an EAGLE-3 member), else ().
        layers = [getattr(m, "feature_layers", ()) for m in self.members]
        self.feature_layers = next((f for f in layers if f), ())
        for m in self.members:
            m.reports_confidence = True  # type: ignore[attr-defined]
        #: Index of the learned member (a head), or None.
        self._learned = next((i for i, m in enumerate(self.members) if m.uses_hidden_states), None)
        #: Skip the learned member's draft step for a request when a model-free member's proposal
        #: outranks any it could make (:meth:`_outranked`; ``hybrid_skip_outranked``).
        self.skip_outranked = ctx.config.hybrid_skip_outranked
        #: Submit the union of the members' proposals as one tree (``hybrid_union``).
        self.union = ctx.config.hybrid_union
        self._vocab_size = ctx.target.cfg.vocab_size if ctx.target is not None else None
        self._malformed_logged: set[int] = set()
        self.states: dict[str, _HybridState] = {}
        #: Engine-wide, per member and confidence bucket: [summed hindsight accepted drafts, proposals].
        self.calibration: list[dict[Bucket, list[int]]] = [{} for _ in self.members]
        self.stats = {n: MemberStats() for n in self.names}
        self.oracle_steps = 0
        self.oracle_accepted = 0

    @property
    def catch_up_s(self) -> float:  # type: ignore[override]
        """The members' catch-up seconds in the latest :meth:`propose`, summed (the learned member's head
        forwards and suffix decoding's indexing read the same backlog)."""
        return sum(float(getattr(m, "catch_up_s", 0.0)) for m in self.members)

    @property
    def catch_up_tokens(self) -> int:  # type: ignore[override]
        """The most tokens a member caught up on in the latest :meth:`propose` (their spans overlap)."""
        return max(int(getattr(m, "catch_up_tokens", 0)) for m in self.members)

    @property
    def wants_step_costs(self) -> bool:
        """True when a member wants the target's profiled step costs (suffix decoding's chain cut)."""
        return any(getattr(m, "wants_step_costs", False) for m in self.members)

    def set_step_costs(self, step_s: dict[int, float]) -> None:
        """Hand the target's step costs to the members that want them."""
        for m in self.members:
            if getattr(m, "wants_step_costs", False):
                m.set_step_costs(step_s)

    def observe_step_time(self, num_tokens: int, seconds: float) -> None:
        """A decode step of one request, handed to the members that learn from step times."""
        for m in self.members:
            observe = getattr(m, "observe_step_time", None)
            if observe is not None:
                observe(num_tokens, seconds)

    def draft_backlog(self, request: Request, num_new_tokens: int) -> int:
        """The longest member backlog for ``request`` (what its next draft reads first: the learned
        member's head, suffix decoding's trie), or 0."""
        return max(
            int(m.draft_backlog(request, num_new_tokens)) if hasattr(m, "draft_backlog") else 0
            for m in self.members
        )

    def _state(self, request: Request) -> _HybridState:
        state = self.states.get(request.request_id)
        if state is None:
            state = self.states[request.request_id] = _HybridState(
                [None] * len(self.members),
                [{} for _ in self.members],
                [{} for _ in self.members],
                seeded=request.sampling_params.seed is not None,
            )
            request.drafter_metrics = {n: MemberStats() for n in self.names}
        return state

    def _refresh_open(self, request: Request, state: _HybridState) -> None:
        """Grow the open proposals' scores by what the tokens committed since confirm; close those a
        token contradicts or that are confirmed to their depth."""
        still = []
        for o in state.open:
            committed = request.token_ids[o.step.position :]
            got = accepted_length(o.step.proposals[o.member], committed)
            if got > o.got:
                state.scores[o.member] = (state.scores[o.member] or 0.0) + o.weight * (got - o.got)
                by_bucket = state.bucket_scores[o.member]
                by_bucket[o.bucket] = by_bucket.get(o.bucket, 0.0) + o.bucket_weight * (got - o.got)
                o.got = got
            if got == len(committed) and got < o.depth:
                still.append(o)
            else:
                self._calibrate(o.member, o.bucket, got)
        state.open = still

    def _calibrate(self, member: int, bucket: Bucket, got: int) -> None:
        """Count a proposal's final hindsight score in the engine-wide table."""
        entry = self.calibration[member].setdefault(bucket, [0, 0])
        entry[0] += got
        entry[1] += 1

    def _score_pending(self, request: Request, state: _HybridState) -> None:
        self._refresh_open(request, state)
        step = state.pending
        if step is None:
            return
        state.pending = None
        committed = request.token_ids[step.position :]
        submitted = step.submitted()
        for i, proposal in enumerate(step.proposals):
            if not proposal.token_ids:
                continue
            got = accepted_length(proposal, committed)
            bucket = confidence_bucket(proposal)
            old = state.scores[i]
            state.scores[i] = got if old is None else DECAY * old + (1 - DECAY) * got
            by_bucket = state.bucket_scores[i]
            old_bucket = by_bucket.get(bucket)
            by_bucket[bucket] = got if old_bucket is None else DECAY * old_bucket + (1 - DECAY) * got
            state.bucket_counts[i][bucket] = state.bucket_counts[i].get(bucket, 0) + 1
            for o in state.open:
                if o.member == i:
                    o.weight *= DECAY
                    if o.bucket == bucket:
                        o.bucket_weight *= DECAY
            depth = draft_depth(proposal) if got == len(committed) else 0
            if got < depth:
                state.open.append(
                    _Open(
                        step, i, bucket, got, depth,
                        1.0 if old is None else 1 - DECAY, 1.0 if old_bucket is None else 1 - DECAY,
                    )
                )  # fmt: skip
            else:
                self._calibrate(i, bucket, got)
            if i in submitted and not step.counted:  # the request's last step: no on_verified
                cap, n = submitted[i], min(got, len(committed))
                self._count_accepted(request, i, n if cap is None else min(n, cap))

    def estimate(self, state: _HybridState, member: int, bucket: Bucket) -> float:
        """Expected accepted drafts of a proposal of ``member`` in confidence ``bucket`` this step, from
        tokens committed before it.

        With ``b`` the proposal's :func:`confidence_bucket`, ``c`` the engine-wide mean hindsight score of
        the member's proposals in ``b`` (once :data:`MIN_CALIBRATION` are counted), ``r`` the request's
        running score for ``b`` after its ``n`` proposals there, an exponential moving average worth
        ``m = (1 - DECAY^n) / (1 - DECAY)`` proposals (at most 3.3): ``(W c + m r) / (W + m)`` with ``W =``
        :data:`CALIBRATION_WEIGHT` (the engine-wide mean as a prior worth ``W`` proposals); ``r`` alone
        before ``c`` exists; without either, the member's running score; else 0. A seeded request's
        estimates leave ``c`` out: its choices, and so its tokens, then depend on its own history alone."""
        own = state.bucket_scores[member].get(bucket)
        entry = None if state.seeded else self.calibration[member].get(bucket)
        if entry is not None and entry[1] >= MIN_CALIBRATION:
            calibrated = entry[0] / entry[1]
            if own is None:
                return calibrated
            weight = (1 - DECAY ** state.bucket_counts[member][bucket]) / (1 - DECAY)
            return (CALIBRATION_WEIGHT * calibrated + weight * own) / (CALIBRATION_WEIGHT + weight)
        if own is not None:
            return own
        score = state.scores[member]
        return 0.0 if score is None else score

    def rank(self, state: _HybridState, proposals: list[DraftProposal]) -> list[int]:
        """The members with non-empty proposals, highest :meth:`estimate` first (ties: the earlier
        member first)."""
        scored = [
            (-self.estimate(state, i, confidence_bucket(p)), i)
            for i, p in enumerate(proposals)
            if p.token_ids
        ]
        return [i for _, i in sorted(scored)]

    def choose(self, state: _HybridState, proposals: list[DraftProposal]) -> int:
        """The member to submit: the highest :meth:`estimate` among non-empty proposals (ties go to the
        earlier member); -1 when none proposed anything."""
        ranked = self.rank(state, proposals)
        return ranked[0] if ranked else -1

    def _outranked(self, state: _HybridState, proposals: list[DraftProposal | None]) -> bool:
        """Whether the learned member may skip this step: a model-free member's proposal has a higher
        :meth:`estimate` than the head could reach in any bucket (a bucket without figures counts as the
        head's running score in the request; a head never scored in the request is never skipped), and
        the head has not been skipped :data:`MAX_SKIPS` steps in a row (then it drafts, so that its
        figures follow the text: a skipped head is not scored)."""
        learned = self._learned
        assert learned is not None
        if state.scores[learned] is None or state.skipped >= MAX_SKIPS:
            return False
        free = [
            self.estimate(state, i, confidence_bucket(p))
            for i, p in enumerate(proposals)
            if p is not None and p.token_ids
        ]
        if not free:
            return False
        buckets = [("prob", b) for b in range(PROB_BUCKETS)] + [("none", 0)]
        return max(free) > max(self.estimate(state, learned, b) for b in buckets)

    def _mergeable(self, member: int, proposal: DraftProposal) -> bool:
        """Whether ``proposal`` may join a union (:func:`well_formed`); a malformed one is left out (the
        other members' drafts still go) and logged once per member."""
        if well_formed(proposal, self._vocab_size):
            return True
        if member not in self._malformed_logged:
            self._malformed_logged.add(member)
            logger.warning(
                "hybrid: member %r proposed a malformed proposal (tokens outside the vocabulary, or "
                "parents not -1 or an earlier node); it is left out of the union",
                self.names[member],
            )
        return False

    def _propose_members(self, batch: list[DraftInput]) -> list[list[DraftProposal]]:
        """Every member's proposals ``[member][request]``: the model-free members first; the learned
        member then drafts only for the requests whose best model-free proposal does not outrank it
        (:attr:`skip_outranked`; the others get an empty proposal)."""
        learned = self._learned
        per_member: list[list[DraftProposal] | None] = [
            None if i == learned else m.propose(batch) for i, m in enumerate(self.members)
        ]
        if learned is not None:
            inputs = batch
            if self.skip_outranked:
                inputs = []
                for j, x in enumerate(batch):
                    state = self.states[x.request.request_id]
                    if x.max_drafts > 0 and self._outranked(state, [p and p[j] for p in per_member]):
                        state.skipped += 1
                        x = replace(x, max_drafts=0)
                    elif x.max_drafts > 0:
                        state.skipped = 0
                    inputs.append(x)
            per_member[learned] = self.members[learned].propose(inputs)
        return per_member  # type: ignore[return-value]

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        for x in batch:  # scores first: the choice (and the learned member's skip) read them
            self._score_pending(x.request, self._state(x.request))
        per_member = self._propose_members(batch)
        out = []
        for j, x in enumerate(batch):
            state = self.states[x.request.request_id]
            proposals = [per_member[i][j] for i in range(len(self.members))]
            if x.max_drafts <= 0:
                out.append(DraftProposal([]))
                continue
            ranked = self.rank(state, proposals)
            chosen = ranked[0] if ranked else -1
            step = _Step(len(x.request.token_ids), proposals, chosen)
            state.pending = step
            if chosen < 0:
                out.append(DraftProposal([]))
                continue
            state.history.append(step)
            submitted = proposals[chosen]
            if self.union and submitted.draft_probs is None:
                merged = [
                    i for i in ranked if proposals[i].draft_probs is None and self._mergeable(i, proposals[i])
                ]
                if merged:  # a malformed best proposal is left out: the union of the others goes
                    budget = x.max_tree_nodes if x.max_tree_nodes > 0 else x.max_drafts * len(merged)
                    submitted, kept = union_proposal([proposals[i] for i in merged], budget, x.max_drafts)
                    step.merged = tuple((i, k) for i, k in zip(merged, kept) if k.nodes > 0)
                    step.chosen = chosen = merged[0]
            for i, cap in step.submitted().items():
                name = self.names[i]
                depth = min(draft_depth(proposals[i]), x.max_drafts)
                for stats in (self.stats[name], x.request.drafter_metrics.get(name)):
                    if stats is not None:
                        stats.num_chosen += 1
                        stats.num_draft_tokens += depth if cap is None else min(depth, cap)
            out.append(submitted)
        return out

    def _count_accepted(self, request: Request, member: int, n: int) -> None:
        name = self.names[member]
        for stats in (self.stats[name], (request.drafter_metrics or {}).get(name)):
            if stats is not None:
                stats.num_accepted_tokens += n

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The member whose proposal was submitted this step is told the verified counts (its proposal
        was the step's whole proposal); in a union (``hybrid_union``) each member whose nodes went in is
        told its own: its nodes in the tree, and the drafts of its path that the committed tokens
        confirm (at most ``num_accepted``). Every other member ``(0, 0)``, as the engine tells a drafter
        whose proposal it did not verify."""
        state = self.states.get(request.request_id)
        step = None if state is None else state.pending
        told: dict[int, tuple[int, int]] = {}
        if step is not None and step.chosen >= 0 and num_drafts:
            if step.merged:
                committed = request.token_ids[step.position :]
                for i, kept in step.merged:
                    own = min(accepted_length(step.proposals[i], committed), num_accepted, kept.depth)
                    told[i] = (kept.nodes, own)
            else:
                told[step.chosen] = (num_drafts, num_accepted)
        if step is not None and not step.counted:
            step.counted = True  # verified now (or dropped: nothing to count later either)
            for i, (_, accepted) in told.items():
                self._count_accepted(request, i, accepted)
        for i, m in enumerate(self.members):
            m.on_verified(request, *told.get(i, (0, 0)))

    def observe(self, request, start_position, hidden_states) -> None:
        for m in self.members:
            if m.uses_hidden_states:
                m.observe(request, start_position, hidden_states)

    def reset(self, request: Request) -> None:
        """Preempted: the members forget the request (the hybrid keeps its scores). Finished: the oracle
        and hindsight counts are scored from the whole output, and the request is forgotten."""
        for m in self.members:
            m.reset(request)
        if not request.status.finished:
            return
        state = self.states.pop(request.request_id, None)
        if state is None:
            return
        self._score_pending(request, state)
        for o in state.open:
            self._calibrate(o.member, o.bucket, o.got)
        tokens = request.token_ids
        per_request = getattr(request, "drafter_metrics", None) or {}
        for step in state.history:
            committed = tokens[step.position :]
            got = [accepted_length(p, committed) if p.token_ids else 0 for p in step.proposals]
            self.oracle_steps += 1
            self.oracle_accepted += max(got)
            for name, g in zip(self.names, got):
                for stats in (self.stats[name], per_request.get(name)):
                    if stats is not None:
                        stats.hindsight_accepted += g

    def report(self) -> dict:
        """Engine-wide: per member its :class:`MemberStats` as a dict, and the oracle's steps, accepted
        tokens and τ (``1 + accepted / steps``; None before any finished request drafted)."""
        return {
            "members": {n: vars(s).copy() for n, s in self.stats.items()},
            "oracle_steps": self.oracle_steps,
            "oracle_accepted_tokens": self.oracle_accepted,
            "oracle_mean_acceptance_length": (
                1 + self.oracle_accepted / self.oracle_steps if self.oracle_steps else None
            ),
        }

    def kv_bytes_per_block(self, block_size: int) -> int:
        return sum(m.kv_bytes_per_block(block_size) for m in self.members)

    def bind_kv(self, num_blocks: int, block_size: int) -> None:
        for m in self.members:
            m.bind_kv(num_blocks, block_size)

    def bind_target_kv(self, runner: ModelRunner) -> None:
        for m in self.members:
            bind = getattr(m, "bind_target_kv", None)
            if bind is not None:
                bind(runner)
