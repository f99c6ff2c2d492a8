"""Suffix decoding (Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications"): drafts from suffix tries over the request's own text and, when enabled, over earlier
requests' prompts and outputs.

Each request keeps a :class:`~specdec.drafters.suffix_tree.SuffixTrie` of its prompt and committed
output, extended by ``O(depth)`` work per committed token (never rebuilt). Indexing is lazy: a request's
trie catches up on its committed tokens when the request next drafts, so a request a speculation policy
never lets draft is never indexed (at 32 concurrent HumanEval requests eager indexing took 3 % of the
wall time while nothing drafted); the tokens a draft would index first are its ``draft_backlog``, and
their seconds ``catch_up_s``, which the goodput policy charges (:mod:`specdec.policies.goodput`). A step
matches each suffix of
the context (1 .. ``suffix_max_match`` tokens) in that trie and, with ``suffix_share_across_requests``,
in the global :class:`~specdec.drafters.suffix_tree.SuffixCache` (finished requests' prompts and
outputs, at most ``suffix_cache_max_nodes`` nodes, least recently used evicted). Below each match it
drafts a chain (the most frequent continuation) or, with ``tree="dynamic"``, a token tree of the most
frequent continuations (best-first by path probability, like EAGLE-2's reranking), and keeps the draft
of highest expected accepted length. The speculation budget of a match of ``p`` tokens is
``ceil(suffix_spec_factor × p)`` drafts (SuffixDecoding's adaptive ``MAX_SPEC = α p``), capped by the
step's depth (``max_drafts``) and a tree's slots (``max_tree_nodes``); continuations of path probability
below ``suffix_min_token_prob`` are not drafted. A chain is then cut where its drafts stop paying
(``suffix_accept_threshold``, :mod:`specdec.drafters.draft_length`): the acceptance earlier drafts after
matches of the same length had, against what a verification row costs on this machine.

A request's own trie is the C++ index of :mod:`kernels.suffix_index` where the CPU kernels are built
(~0.8-1.2 µs a token to grow a 200-token prompt, ~2.8 at 32k tokens; ~125 bytes a node), else its Python
reference (:class:`~specdec.drafters.suffix_tree.RequestIndex`: the same drafts; ~4.5 and ~7 µs a token,
~270 bytes a node in CPython 3.11, measured with tracemalloc); the global cache is the Python trie.

Memory: a trie holds up to ``suffix_max_match + k`` nodes per token of text that never repeats, so a
32k-token request of code-like text takes ~650k nodes, ~70 MiB in C++ (~170 MiB in Python), while it
runs (defaults: depth 20); lower ``suffix_max_match`` for very long contexts. The global cache's
default budget, 2**20 nodes, is ~270 MiB.

Drafts are deterministic (``draft_probs`` None): the rejection sampler verifies chains and the tree
verifier verifies trees exactly, so the output distribution is the target's whatever was drafted.

Sharing across requests is off by default. Outputs stay exact either way, but with a shared cache a
request drafts from another request's text, and its speed (time per token) then reveals whether its
output continues text another request wrote: a timing side channel between tenants. Enable it
(``suffix_share_across_requests=True``) when the requests share a trust domain (one user's agent loop,
an offline batch); it is where suffix decoding pays most (repeated tool output, earlier answers).
"""

from __future__ import annotations

import math
import time
from typing import Any

from kernels import suffix_index
from specdec.config import SpeculativeConfig
from specdec.drafters.base import DrafterBase, DrafterContext, DraftInput, DraftProposal, RequestStates
from specdec.drafters.draft_length import AcceptanceCounts, AcceptanceDraftLength, check_threshold
from specdec.drafters.draft_stats import DraftCounts
from specdec.drafters.registry import register_drafter
from specdec.drafters.suffix_tree import (
    Draft,
    RequestIndex,
    SuffixCache,
    SuffixTrie,
    draft_budget,
    draft_from,
)
from specdec.errors import ConfigError
from specdec.request import Request, RequestStatus

#: The ``SpeculativeConfig`` fields suffix decoding reads (the hybrid drafter reads them too).
SUFFIX_FIELDS = (
    "suffix_max_match",
    "suffix_min_token_prob",
    "suffix_spec_factor",
    "suffix_accept_threshold",
    "suffix_cache_max_nodes",
    "suffix_share_across_requests",
)


def check_suffix_config(config: SpeculativeConfig) -> None:
    """Validate the suffix fields once, at config construction.

    Raises:
        ConfigError: naming the field: ``suffix_max_match`` not an integer in [1, 64],
            ``suffix_min_token_prob`` not a number in [0, 1], ``suffix_spec_factor`` not a number > 0,
            ``suffix_accept_threshold`` neither "auto" nor a number in [0, 1] (or a number with a
            token tree), ``suffix_cache_max_nodes``
            not an integer >= 0, ``suffix_share_across_requests`` not a bool.
    """
    m = config.suffix_max_match
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= 64:
        raise ConfigError(f"suffix_max_match must be an integer in [1, 64], got {m!r}")
    p = config.suffix_min_token_prob
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
        raise ConfigError(f"suffix_min_token_prob must be a number in [0, 1], got {p!r}")
    f = config.suffix_spec_factor
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not (f > 0 and math.isfinite(f)):
        raise ConfigError(f"suffix_spec_factor must be a finite number > 0, got {f!r}")
    message = check_threshold(config.suffix_accept_threshold, "suffix_accept_threshold")
    if message is not None:
        raise ConfigError(message)
    if config.tree is not None and config.suffix_accept_threshold != "auto":
        raise ConfigError(
            "suffix_accept_threshold cuts chains; token trees keep SuffixDecoding's budget alone "
            f"(tree={config.tree!r}): leave it at 'auto'"
        )
    n = config.suffix_cache_max_nodes
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"suffix_cache_max_nodes must be an integer >= 0, got {n!r}")
    if not isinstance(config.suffix_share_across_requests, bool):
        raise ConfigError(
            f"suffix_share_across_requests must be a bool, got {config.suffix_share_across_requests!r}"
        )


@register_drafter(
    "suffix",
    trees=(None, "dynamic"),
    fields=("max_tree_nodes", *SUFFIX_FIELDS),
    check_config=check_suffix_config,
)
class SuffixDrafter(DrafterBase):
    """Suffix decoding (Oliaro et al. 2024): frequency-ranked continuations of the context's longest
    suffix matches, from the request's own text and (opt-in) earlier requests'.

    Args:
        ctx: its ``config`` gives ``tree`` (None: chains, "dynamic": token trees), ``max_tree_nodes``
            (a tree's most nodes) and the ``suffix_*`` fields (see
            :class:`~specdec.config.SpeculativeConfig`).

    Attributes:
        cache: the global :class:`~specdec.drafters.suffix_tree.SuffixCache`, or None when requests do
            not share (``suffix_share_across_requests`` False, the default).
        num_local_drafts, num_global_drafts: proposals taken from a request's own trie / the global one.
        length_rule: the chain cut (:class:`~specdec.drafters.draft_length.AcceptanceDraftLength`: its
            threshold and the shared counts by match length and draft position; a seeded request keeps
            counts of its own), or None for trees.
        counts: each request's figures in ``request.drafter_metrics["suffix"]``
            (``RequestOutput.metrics["drafter"]``, the keys the hybrid reports per member:
            :class:`~specdec.drafters.draft_stats.MemberStats`) when it drafts alone (``method="suffix"``;
            as a hybrid member, the hybrid counts), else None.
    """

    def __init__(self, ctx: DrafterContext) -> None:
        config = ctx.config
        self.tree = config.tree is not None
        self.max_tree_nodes = config.max_tree_nodes
        self.max_match = config.suffix_max_match
        self.min_prob = float(config.suffix_min_token_prob)
        self.spec_factor = float(config.suffix_spec_factor)
        #: Cuts chains where a draft's chance of acceptance falls below the break-even (trees keep α p).
        self.length_rule = (
            None
            if self.tree
            else AcceptanceDraftLength(config.suffix_accept_threshold, config.num_speculative_tokens)
        )
        self._proposed: dict[str, int] = {}  # request id -> its latest chain's match length
        self._own_counts: dict[str, AcceptanceCounts] = {}  # a seeded request's own (see draft_length)
        # Deep enough to draft k tokens below the longest match.
        self.depth = self.max_match + config.num_speculative_tokens
        self.cache = (
            SuffixCache(self.depth, config.suffix_cache_max_nodes)
            if config.suffix_share_across_requests
            else None
        )
        #: Each request's own text (:class:`~specdec.drafters.suffix_tree.RequestIndex`, or its C++
        #: twin from :mod:`kernels.suffix_index` where that is built).
        self.states: RequestStates[Any] = RequestStates(self._new_state)
        self._native = suffix_index.available()  # loads the CPU kernels now, not in a request's first draft
        self.num_local_drafts = 0
        self.num_global_drafts = 0
        self.counts = DraftCounts("suffix") if config.method == "suffix" else None
        #: Seconds and tokens of the latest :meth:`propose`'s catch-up (tokens indexed before a draft,
        #: each request's last one aside; see :meth:`draft_backlog`).
        self.catch_up_s = 0.0
        self.catch_up_tokens = 0

    def _new_state(self) -> Any:
        native = suffix_index.request_index(self.depth) if self._native else None
        return native if native is not None else RequestIndex(self.depth)

    def _catch_up(self, request: Request) -> Any:
        """Index the request's tokens not indexed yet: ``O(depth)`` per token."""
        state = self.states.get(request)
        tokens, done = request.token_ids, state.num_indexed
        if len(tokens) > done:
            state.extend(tokens[done:], done)
        return state

    def draft_backlog(self, request: Request, num_new_tokens: int) -> int:
        """Committed tokens (this step's new ones included) not indexed yet, the last one aside (a
        request that drafts every step indexes one token a step): what its next draft indexes first."""
        state = self.states.peek(request)
        done = 0 if state is None else state.num_indexed
        return max(0, request.num_computed_tokens + num_new_tokens - 1 - done)

    def budget(self, match_length: int, cap: int) -> int:
        """Drafts allowed after a match of ``match_length`` tokens (:func:`draft_budget`)."""
        return draft_budget(self.spec_factor, match_length, cap)

    def draft(self, request: Request, max_drafts: int, max_tree_nodes: int) -> Draft | None:
        """The best draft for ``request`` (highest expected accepted length over every match length and
        both tries; ties go to the longer match, then the request's own text), or None."""
        if max_drafts <= 0:
            return None
        state = self._catch_up(request)
        cap = max(1, min(self.max_tree_nodes, max_tree_nodes)) if self.tree else max_drafts
        best: Draft | None = None

        def consider(trie: SuffixTrie, length: int, node: int, source: int) -> None:
            nonlocal best
            budget = self.budget(length, cap)
            d = draft_from(trie, node, max_drafts, budget, self.min_prob, self.tree, length)
            d.source = source
            if d.token_ids and (best is None or d.score >= best.score):
                best = d

        if self.cache is not None:
            shared = self.cache.trie
            for length, node in shared.matches(request.token_ids, self.max_match):
                consider(shared, length, node, shared.seq[node])
        own = state.best_draft(self.max_match, max_drafts, cap, self.spec_factor, self.min_prob, self.tree)
        if own is not None and (best is None or own[2] >= best.score):  # ties: the request's own text
            best = Draft(*own)
        if best is not None and self.length_rule is not None:
            keep = self.length_rule.length(best.match_length, len(best.token_ids), self._counts(request))
            best.token_ids = best.token_ids[:keep]
        if best is not None:
            if best.source >= 0 and self.cache is not None:
                self.cache.touch(best.source)
                self.num_global_drafts += 1
            else:
                self.num_local_drafts += 1
        return best

    def _counts(self, request: Request) -> AcceptanceCounts | None:
        """The chain cut's counts for ``request``: its own when it has a seed (its tokens then do not
        depend on other requests), else None (the drafter's shared counts)."""
        if self.length_rule is None or request.sampling_params.seed is None:
            return None
        own = self._own_counts.get(request.request_id)
        if own is None:
            own = self._own_counts[request.request_id] = self.length_rule.new_counts()
        return own

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        """One proposal per input (empty where ``max_drafts`` is 0: nothing is indexed then). A drafting
        request's trie first catches up on its backlog, timed into ``catch_up_s`` / ``catch_up_tokens``."""
        out = []
        self.catch_up_s, self.catch_up_tokens = 0.0, 0
        for x in batch:
            if x.max_drafts > 0:
                self._timed_catch_up(x.request)
            d = self.draft(x.request, x.max_drafts, x.max_tree_nodes)
            out.append(
                DraftProposal([])
                if d is None
                else DraftProposal(d.token_ids, parents=d.parents, match_length=d.match_length)
            )
            if d is not None:
                self._proposed[x.request.request_id] = d.match_length
            if self.counts is not None:
                self.counts.proposed(x, out[-1])
        return out

    def _timed_catch_up(self, request: Request) -> None:
        """Index ``request``'s pending tokens; a backlog (more than the one a step commits) is timed."""
        state = self.states.peek(request)
        pending = len(request.token_ids) - (0 if state is None else state.num_indexed)
        t0 = time.perf_counter()
        self._catch_up(request)
        if pending > 1:
            self.catch_up_s += (time.perf_counter() - t0) * (pending - 1) / pending
            self.catch_up_tokens += pending - 1

    def reset(self, request: Request) -> None:
        """Forget the request's trie; a request that finished (not by a fault, not preempted) joins the
        global cache when requests share."""
        self.states.reset(request)
        self._proposed.pop(request.request_id, None)
        if request.status.finished:  # preempted: a seeded request keeps what its chains taught it
            self._own_counts.pop(request.request_id, None)
        if self.counts is not None and request.status.finished:
            self.counts.finished(request)
        if (
            self.cache is not None
            and request.status.finished
            and request.status is not RequestStatus.FINISHED_ERROR
        ):
            self.cache.add(request.token_ids)

    @property
    def wants_step_costs(self) -> bool:
        """True when the chain cut's break-even comes from the target's profiled step costs
        (``suffix_accept_threshold="auto"``): the engine then calls :meth:`set_step_costs` once."""
        return self.length_rule is not None and self.length_rule.wants_step_costs

    def set_step_costs(self, step_s: dict[int, float]) -> None:
        """The target's seconds per forward by batched-token count (:mod:`specdec.engine.cost_profile`)."""
        if self.length_rule is not None:
            self.length_rule.set_step_costs(step_s)

    def observe_step_time(self, num_tokens: int, seconds: float) -> None:
        """A decode step of one request: ``num_tokens`` rows in ``seconds`` (the engine calls it after
        each such step); the chain cut's observed row cost
        (:meth:`~specdec.drafters.draft_length.AcceptanceDraftLength.observe_step_time`)."""
        if self.length_rule is not None:
            self.length_rule.observe_step_time(num_tokens, seconds)

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Nothing to roll back (the tries only ever hold committed tokens); the chain cut's counts (by
        the verified chain's match length) and the request's counts."""
        match_length = self._proposed.pop(request.request_id, None)
        if self.length_rule is not None and match_length is not None:
            (self._counts(request) or self.length_rule.shared).observe(match_length, num_drafts, num_accepted)
        if self.counts is not None:
            self.counts.verified(request, num_drafts, num_accepted)
