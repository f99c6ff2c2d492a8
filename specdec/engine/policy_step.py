"""Applying the speculation policy to a step: each drafting request's depth cap, before drafting, and
what the step cost and yielded, after it.

A policy is a plug-in: its answers are checked. A batch call that raises is retried request by request;
a request whose call raises, or whose answer is not an integer >= 0, has speculation switched off for
the rest of its life (it still decodes to the end; logged once). Answers above the scheduler's cap are
cut to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from specdec.engine.admission import is_index
from specdec.policies.base import PolicyInput, SpeculationPolicy, StepObservation
from specdec.request import Request
from specdec.scheduler import ScheduledRequest

if TYPE_CHECKING:
    from sampling.rejection_sampler import VerifyResult

logger = logging.getLogger("specdec.engine")


def apply_policy(
    policy: SpeculationPolicy,
    scheduled: list[ScheduledRequest],
    disabled: set[str],
    backlog: Callable[[Request, int], int] | None = None,
) -> None:
    """Lower each scheduled request's drafter depth (``max_draft_depth - num_forced_slots``) to the
    policy's answer; the positions reserved for grammar-aware drafting stay (their drafts cost a slot
    and are forced by the grammar). ``disabled``: ids of requests whose policy failed (they draft
    nothing; ids are added here, removed when they end). ``backlog``: the drafter's
    ``draft_backlog(request, num_new_tokens)`` (for ``PolicyInput.draft_backlog``; None: 0)."""
    for s in scheduled:
        if s.request.request_id in disabled:
            s.max_draft_depth = s.num_forced_slots = 0
    drafting = [s for s in scheduled if s.max_draft_depth - s.num_forced_slots > 0]
    if not drafting:
        return
    num_tokens = sum(s.num_new_tokens for s in scheduled)
    inputs = [
        PolicyInput(
            s.request,
            s.max_draft_depth - s.num_forced_slots,
            len(scheduled),
            len(drafting),
            num_tokens,
            backlog(s.request, s.num_new_tokens) if backlog is not None else 0,
        )
        for s in drafting
    ]
    try:
        answers = list(policy.decide(inputs))
        if len(answers) != len(inputs):
            raise ValueError(f"decide() returned {len(answers)} answers for {len(inputs)} requests")
    except Exception:
        answers = [_decide_one(policy, x, disabled) for x in inputs]
    for s, x, depth in zip(drafting, inputs, answers):
        if not is_index(depth) or depth < 0:
            _disable(disabled, x, f"answered {depth!r}, not an integer >= 0")
            depth = s.num_forced_slots = 0
        s.max_draft_depth = min(x.max_drafts, int(depth)) + s.num_forced_slots


def _decide_one(policy: SpeculationPolicy, x: PolicyInput, disabled: set[str]) -> int:
    try:
        (depth,) = policy.decide([x])
        return depth
    except Exception as e:
        _disable(disabled, x, f"raised {type(e).__name__}: {e}")
        return 0


def _disable(disabled: set[str], x: PolicyInput, what: str) -> None:
    rid = x.request.request_id
    if rid not in disabled:
        disabled.add(rid)
        logger.warning(
            "request %s: the speculation policy %s; speculation is off for this request", rid, what
        )


def observe_policy(
    policy: SpeculationPolicy,
    scheduled: list[ScheduledRequest],
    sampling: list[ScheduledRequest],
    results: list[VerifyResult],
    draft_s: float,
    target_s: float,
    catch_up: tuple[float, int] = (0.0, 0),
) -> bool:
    """Hand a learning policy (one with ``observe_step``) the step's cost and acceptance (``draft_s``
    without the catch-up forwards, whose seconds and tokens are ``catch_up``). Returns False
    when ``observe_step`` raised (logged; the engine then skips the policy's learning from then on, and
    its decisions continue)."""
    observe = getattr(policy, "observe_step", None)
    if observe is None:
        return True
    per_request = []
    for s, r in zip(sampling, results):
        depth = len(s.draft_token_ids) if s.draft_tree is None else s.draft_tree.max_depth
        if depth:
            per_request.append((depth, r.num_accepted))
    step = StepObservation(
        num_tokens=sum(s.num_new_tokens + len(s.draft_token_ids) for s in scheduled),
        target_s=target_s,
        draft_s=draft_s,
        max_depth=max((d for d, _ in per_request), default=0),
        per_request=tuple(per_request),
        num_committed=sum(len(r.token_ids) for r in results),
        prefill=any(s.num_new_tokens > 1 or not s.sample for s in scheduled),
        catch_up_s=catch_up[0],
        catch_up_tokens=catch_up[1],
    )
    try:
        observe(step)
    except Exception as e:
        logger.warning(
            "the speculation policy's observe_step raised %s: %s; it learns no more", type(e).__name__, e
        )
        return False
    return True
