"""Continuous batching with a token budget, chunked prefill, prefix caching and preemption.

Policy (first come, first served by arrival):

1. Running requests, oldest first, each get the tokens they still need (one decode token, or the rest of
   a prompt as a chunk) while the step's token budget lasts.
2. When the KV pool cannot hold a running request's new tokens, the *newest* running request is
   preempted: its blocks are freed and it goes back to the front of the waiting queue, to be recomputed
   later (its prompt and the tokens it already generated become one prefill). The oldest request is
   never preempted for a newer one, so it always progresses and every request finishes: a request
   waits at most until every older request has finished.
3. If nothing was preempted, waiting requests join in arrival order while budget, ``max_num_seqs`` and
   free blocks allow, reusing prefix-cached blocks.

There are no prefill and decode phases: every request simply has ``num_computed_tokens`` of its
``num_tokens`` in the cache, and a step moves that forward (as in vLLM v1).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass

from specdec.config import SchedulerConfig
from specdec.kv_cache.manager import KVCacheManager
from specdec.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens starting at ``num_computed_tokens``.

    ``sample`` is True when these tokens reach the end of the known sequence, so the last row's logits
    give the next token.
    """

    request: Request
    num_new_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival_index
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens))
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: everything after it already was too
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                hits = self.kv.get_computed_blocks(req)
                num_hit_tokens = len(hits) * self.kv.block_size
                n = min(req.num_tokens - num_hit_tokens, budget)
                if not self.kv.allocate_slots(req, n, new_computed_blocks=hits):
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                if req.stats.first_scheduled_time is None:
                    req.stats.first_scheduled_time = time.perf_counter()
                keys = [r.arrival_index for r in self.running]
                self.running.insert(bisect.bisect(keys, req.arrival_index), req)
                scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens))
                budget -= n
        return SchedulerOutput(scheduled, preempted)

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
