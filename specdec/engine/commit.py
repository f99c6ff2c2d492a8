"""Commit: advancing each request past the step's forward.

Per request: roll back the rejected drafts' KV (a token tree's accepted path is first compacted onto
consecutive slots), append the emitted tokens under the stop rules (stop tokens, stop strings, a
completed grammar, ``max_tokens``, ``max_model_len``), register full blocks for prefix caching, update
the acceptance counters and feed the drafter.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from sampling.logprobs import Logprob
from sampling.rejection_sampler import VerifyResult
from specdec.engine.faults import run_isolated
from specdec.engine.verification import accepted_nodes
from specdec.request import Request, RequestStatus
from specdec.scheduler import ScheduledRequest
from specdec.structured import grammar_complete

if TYPE_CHECKING:
    from specdec.engine.engine import LLMEngine

logger = logging.getLogger("specdec.engine")


def commit(
    engine: LLMEngine,
    s: ScheduledRequest,
    result: VerifyResult | None,
    hidden: torch.Tensor | None,
    rows_start: int,
    logprobs: list[dict[int, Logprob]] | None,
    now: float,
) -> bool:
    """Advance one request past this step's forward; returns whether it emitted tokens.

    ``hidden`` (``[T, hidden_size]``, when the drafter reads features) hands the drafter the features of
    the committed tokens computed this step; ``rows_start`` is the request's first row in it.
    """
    req = s.request
    num_drafts = len(s.draft_token_ids)
    first_position = req.num_computed_tokens
    req.num_computed_tokens += s.num_new_tokens + num_drafts
    drafter = engine.drafter
    if not s.sample:
        engine.kv.cache_full_blocks(req)
        if hidden is not None and drafter is not None:
            drafter.observe(req, first_position, hidden[rows_start : rows_start + s.num_new_tokens])
        return False
    assert result is not None
    if s.draft_tree is not None:
        compact(engine, req, first_position + s.num_new_tokens, accepted_nodes(result))
    engine.kv.rollback(req, num_drafts - result.num_accepted)  # rejected drafts; unused draft slots
    # A tree's draft length is its depth (what a step can accept); its nodes are counted on their own.
    draft_length = num_drafts if s.draft_tree is None else s.draft_tree.max_depth
    for stats in (req.spec_stats, engine.spec_stats):
        if stats is not None:
            stats.observe(draft_length, result.num_accepted, num_drafts)
    if req.stats.first_token_time is None:
        req.stats.first_token_time = now
    for i, token in enumerate(result.token_ids):  # stop rules apply token by token
        if logprobs is not None and req.logprobs is not None:
            req.logprobs.append(logprobs[i])
            req.cumulative_logprob += logprobs[i][token].logprob
        if append_token(engine, req, token):
            return True
    engine.kv.cache_full_blocks(req)
    if hidden is not None and drafter is not None:
        end = rows_start + s.num_new_tokens
        if s.draft_tree is None:  # a chain's accepted drafts follow its new tokens: one view, no copy
            drafter.observe(req, first_position, hidden[rows_start : end + result.num_accepted])
        else:
            committed = list(range(rows_start, end)) + [end + n for n in accepted_nodes(result)]
            drafter.observe(req, first_position, hidden[committed])
    if drafter is not None:
        drafter.on_verified(req, num_drafts, result.num_accepted)
    return True


def commit_all(
    engine: LLMEngine,
    scheduled: list[ScheduledRequest],
    sampling: list[ScheduledRequest],
    results: list[VerifyResult],
    hidden: torch.Tensor | None,
    logprobs: dict[str, list[dict[int, Logprob]]],
) -> list[Request]:
    """Commit every scheduled request, each alone: a request whose commit raises ends alone. Returns the
    requests that received tokens or ended."""
    result_of = {id(s): r for s, r in zip(sampling, results)}
    rows_start: dict[int, int] = {}
    start = 0
    for s in scheduled:
        rows_start[id(s)] = start
        start += s.num_new_tokens + len(s.draft_token_ids)
    now = time.perf_counter()
    updated: list[Request] = []

    def run(batch: list[ScheduledRequest]) -> list[bool]:
        s = batch[0]
        if s.request.status.finished:  # ended by a fault this step (its blocks are free already)
            return [True]
        rid = s.request.request_id
        return [commit(engine, s, result_of.get(id(s)), hidden, rows_start[id(s)], logprobs.get(rid), now)]

    def fail(s: ScheduledRequest, e: Exception) -> None:
        logger.exception("request %s: committing its tokens failed", s.request.request_id, exc_info=e)
        engine.fail(s.request, f"{type(e).__name__}: {e}")
        updated.append(s.request)

    for s, emitted in run_isolated(scheduled, run, fail, "commit", batched=False):
        if emitted:
            updated.append(s.request)
    return updated


def compact(engine: LLMEngine, req: Request, first_draft_position: int, nodes: list[int]) -> None:
    """Move the accepted tree path's K/V onto consecutive slots after the committed tokens."""
    src, dst = [], []
    for depth, node in enumerate(nodes):
        if node != depth:
            src.append(engine.kv.slot(req, first_draft_position + node))
            dst.append(engine.kv.slot(req, first_draft_position + depth))
    engine.runner.copy_slots(src, dst)


def append_token(engine: LLMEngine, req: Request, token: int) -> bool:
    """Append one token and apply the stop rules; returns True when the request finished.

    Raises:
        RuntimeError: the request's grammar rejects the token (a bug: every row is masked).
    """
    req.token_ids.append(token)
    params = req.sampling_params
    status = None
    if req.grammar is not None and not req.grammar.accept_token(token):
        raise RuntimeError(f"request {req.request_id}: the grammar rejected emitted token {token}")
    cfg = engine.model_cfg
    if token in req.stop_ids:
        status = RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            req.stop_reason = token
    elif stop_string(engine, req) or (
        req.grammar is not None and grammar_complete(req.grammar, cfg.eos_token_ids, cfg.vocab_size)
    ):
        status = RequestStatus.FINISHED_STOPPED
    elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= engine.max_model_len:
        status = RequestStatus.FINISHED_LENGTH
    if status is not None:
        req.stats.finished_time = time.perf_counter()
        engine.kv.cache_full_blocks(req)  # this step's full blocks too (a prompt that ends at its prefill)
        engine.finish(req, status)
        return True
    return False


def stop_string(engine: LLMEngine, req: Request) -> bool:
    """Whether the newest token completed one of the request's stop strings (records which)."""
    stops = req.sampling_params.stop_strings
    if not stops or engine.detokenize is None or req.num_output_tokens < req.sampling_params.min_tokens:
        return False
    text = engine.detokenize(req.output_token_ids)
    # Only occurrences that end in the newest token's text are new; search just before it.
    prev_len = req.checked_text_len
    req.checked_text_len = len(text)
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, prev_len - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return False
    req.stop_text_offset, req.stop_reason = best
    return True
