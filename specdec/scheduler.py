"""Continuous batching with a token budget, chunked prefill, prefix caching and preemption.

Policy (first come, first served, by ``Request.arrival_index``: the order in which requests entered the
scheduler, i.e. their arrival, or for a constrained request the moment its grammar finished compiling):

1. Running requests, oldest first, each get the tokens they still need (one decode token, or the rest of
   a prompt as a chunk) while the step's token budget lasts; a request whose tokens reach the end of its
   committed sequence also gets slots for its drafts when speculating, always as many as the request
   alone allows (see :meth:`Scheduler._plan`): a request whose drafts do not fit what is left of the
   budget waits for the next step rather than verifying fewer.
2. When the KV pool cannot hold a running request's new tokens, the *newest* running request is
   preempted: its blocks are freed and it goes back to the front of the waiting queue, to be recomputed
   later (its prompt and the tokens it already generated become one prefill). The oldest request is
   never preempted for a newer one, so it always progresses and every request finishes: a request
   waits at most until every older request has finished.
3. If nothing was preempted, waiting requests join in arrival order while budget, ``max_num_seqs`` and
   free blocks allow, reusing prefix-cached blocks.

Invariant and bound (tested under load in ``tests/test_load.py``): every running request is older than
every waiting one, so at every step the oldest unfinished request is scheduled, computes at least one
token and is not preempted (a request alone always fits the pool: ``LLMEngine.validate``). Once oldest,
a request with prompt P, at most M generated tokens and budget B per step finishes within
``ceil((P + M - 1) / B) + M`` steps; a request therefore finishes within the sum of that figure over the
requests that entered no later than it and were unfinished when it entered.

There are no prefill and decode phases: every request simply has ``num_computed_tokens`` of its
``num_tokens`` in the cache, and a step moves that forward (as in vLLM v1).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from sampling.token_tree import TokenTree
from specdec.config import SchedulerConfig
from specdec.kv_cache.manager import KVCacheManager
from specdec.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request.
        num_new_tokens: committed tokens computed this step, from ``request.num_computed_tokens``.
        sample: these tokens reach the end of the committed sequence, so the step emits tokens.
        num_draft_slots: most draft tokens this request may verify this step (slots are reserved).
        max_draft_depth: most drafts on one path (a chain's length, a tree's depth): a step emits at
            most ``max_draft_depth + 1`` tokens.
        draft_token_ids: the drafts proposed for it this step (at most ``num_draft_slots``): a chain, or
            a token tree's nodes in order.
        draft_probs: ``[len(draft_token_ids), vocab_size]`` distributions the drafts were drawn from, or
            None for a deterministic drafter.
        draft_tree: the drafts' tree when they are not a chain (``draft_tree.token_ids ==
            draft_token_ids``), else None.
        num_forced_slots: the part of ``num_draft_slots`` and ``max_draft_depth`` beyond the drafter's
            own, for grammar-aware drafting (``SpeculativeConfig.max_forced_drafts``; constrained
            requests only): the drafter itself is asked for ``max_draft_depth - num_forced_slots``.
    """

    request: Request
    num_new_tokens: int
    sample: bool
    num_draft_slots: int = 0
    max_draft_depth: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    draft_tree: TokenTree | None = None
    num_forced_slots: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        num_speculative_tokens: int = 0,
        num_draft_slots: int | None = None,
        num_forced_draft_slots: int = 0,
    ) -> None:
        self.config = config
        self.num_speculative_tokens = num_speculative_tokens
        #: Slots reserved per drafting request (a tree's size; k for chains; k per member for a hybrid
        #: union: ``SpeculativeConfig.num_draft_slots``).
        self.num_draft_slots = num_speculative_tokens if num_draft_slots is None else num_draft_slots
        #: Extra draft positions and slots of a constrained request, for grammar-aware drafting.
        self.num_forced_draft_slots = num_forced_draft_slots
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival_index
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        #: Preemptions per request id (kept after the request finishes, for tests and reports).
        self.num_preemptions_by_request: dict[str, int] = {}

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _plan(self, req: Request, num_computed: int, budget: int) -> tuple[int, int, int, int] | None:
        """``(num_new_tokens, draft_slots, draft_depth, forced_slots)`` for a request whose first
        ``num_computed`` tokens are in the cache (computed, or prefix-cache hits), within ``budget``
        tokens; None when it must sit this step out.

        A step whose new tokens reach the end of the committed sequence (a decode step, or the last
        chunk of a prefill or of a recompute after preemption) also verifies drafts. Their number depends
        on the request alone: the drafter's slots (k, or a tree's size) and depth k, limited by
        ``max_tokens``, ``max_model_len`` and the step budget ``max_num_batched_tokens`` (a
        configuration, not what other requests use). When the budget left this step cannot hold them,
        the drafts are not cut: a last prefill chunk is shortened by one token (the rest comes next
        step, with its drafts) and a decode step waits for the next step. So the drafts a request
        verifies, and the random numbers a seeded request draws, do not depend on the other requests,
        on aborts or on preemption. The oldest request always has the whole budget, so it always runs.
        A constrained request's slots and depth include ``num_forced_draft_slots`` more, for
        grammar-aware drafting (``forced_slots``: how many of them it got).
        """
        todo = req.num_tokens - num_computed
        n = min(todo, budget)
        if not self.num_speculative_tokens or n != todo:
            return n, 0, 0, 0
        forced = self.num_forced_draft_slots if req.grammar is not None else 0
        remaining = req.sampling_params.max_tokens - req.num_output_tokens
        room = self.max_model_len - req.num_tokens
        step_cap = self.config.max_num_batched_tokens - 1
        depth = max(0, min(self.num_speculative_tokens + forced, remaining - 1, room - 1, step_cap))
        if depth == 0:
            return n, 0, 0, 0
        slots = min(self.num_draft_slots + forced, step_cap)
        if n + slots <= budget:
            depth = min(depth, slots)
            return n, slots, depth, max(0, depth - self.num_speculative_tokens)
        if n > 1:
            return n - 1, 0, 0, 0
        return None

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.stats.num_preemptions += 1
        self.num_preemptions += 1
        rid = request.request_id
        self.num_preemptions_by_request[rid] = self.num_preemptions_by_request.get(rid, 0) + 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            plan = self._plan(req, req.num_computed_tokens, budget)
            if plan is None:  # a decode step whose drafts do not fit what is left: next step
                i += 1
                continue
            n, k, depth, forced = plan
            while not self.kv.allocate_slots(req, n + k):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                sample = req.num_computed_tokens + n == req.num_tokens
                scheduled.append(ScheduledRequest(req, n, sample, k, depth, num_forced_slots=forced))
                budget -= n + k
                i += 1
                continue
            break  # the request itself was preempted: everything after it already was too
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                hits = self.kv.get_computed_blocks(req)
                num_hit_tokens = len(hits) * self.kv.block_size
                plan = self._plan(req, num_hit_tokens, budget)
                if plan is None:
                    break
                n, k, depth, forced = plan
                if not self.kv.allocate_slots(req, n, k, new_computed_blocks=hits):
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                if req.stats.first_scheduled_time is None:
                    req.stats.first_scheduled_time = time.perf_counter()
                if not self.running or self.running[-1].arrival_index < req.arrival_index:
                    self.running.append(req)  # the common case: newest arrival
                else:
                    keys = [r.arrival_index for r in self.running]
                    self.running.insert(bisect.bisect(keys, req.arrival_index), req)
                sample = req.num_computed_tokens + n == req.num_tokens
                scheduled.append(ScheduledRequest(req, n, sample, k, depth, num_forced_slots=forced))
                budget -= n + k
        return SchedulerOutput(scheduled, preempted)

    def reclaim_draft_slots(self, scheduled: list[ScheduledRequest]) -> int:
        """Return to the step the draft slots of requests that will draft nothing after all (the
        speculation policy lowered their ``max_draft_depth`` to 0): their slots are released and the
        tokens they held lengthen the step's unfinished prompt chunks, oldest request first, each at most
        to its prompt's end (a chunk that reaches it samples this step, without drafts). A chunk whose
        KV blocks cannot be allocated keeps its length. Call it after the policy, before drafting.

        Without it a policy that switches speculation off under load still pays for the slots in prefill
        steps: at 32 HumanEval requests (512 tokens a step) their prompts took one step more than plain
        decoding's, 1.4 % of the run. Chunk lengths change no output (a prompt's K/V are the same however
        it is chunked), and a static policy never lowers a depth to 0 below the scheduler's cap, so its
        steps are unchanged.

        Returns:
            The tokens added to prompt chunks.
        """
        freed = 0
        for s in scheduled:
            if s.max_draft_depth == 0 and s.num_draft_slots > 0:
                freed += s.num_draft_slots
                s.num_draft_slots = s.num_forced_slots = 0
        added = 0
        for s in scheduled:
            if freed <= 0:
                break
            req = s.request
            if s.sample or s.num_new_tokens == 0:
                continue
            extra = min(freed, req.num_tokens - req.num_computed_tokens - s.num_new_tokens)
            if extra > 0 and self.kv.allocate_slots(req, s.num_new_tokens + extra):
                s.num_new_tokens += extra
                s.sample = req.num_computed_tokens + s.num_new_tokens == req.num_tokens
                freed -= extra
                added += extra
        return added

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and free everything it holds."""
        if request.status.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        del self.requests[request.request_id]
