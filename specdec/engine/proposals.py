"""Proposals: asking the drafter for drafts and fitting them to each request's slots, depth and grammar.

A drafter is a plug-in, so its proposals are checked like any other input (:func:`check_proposal`): a
proposal that cannot be verified exactly (token ids outside the vocabulary, ``draft_probs`` of the wrong
shape, not finite or not summing to 1, a malformed tree) is dropped for that request and step, with a
warning naming the request and the fault; other requests are untouched. Drafts beyond the reserved
slots or depth are cut. A drafter that raises for one request alone ends that request.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from sampling.token_tree import TokenTree
from specdec.drafters.base import Drafter, DraftInput, DraftProposal
from specdec.engine.admission import is_index
from specdec.engine.faults import run_isolated
from specdec.scheduler import ScheduledRequest
from specdec.structured import grammar_tree_keep

logger = logging.getLogger("specdec.engine")

#: Largest deviation of a ``draft_probs`` row's sum from 1 that is taken as rounding.
PROB_SUM_TOLERANCE = 1e-3


class InvalidProposalError(ValueError):
    """A drafter's proposal cannot be verified exactly (it is dropped, the request goes on)."""


def propose_drafts(
    drafter: Drafter,
    scheduled: list[ScheduledRequest],
    vocab_size: int,
    fail: Callable[[ScheduledRequest, str], None],
) -> None:
    """Fill each scheduled request's ``draft_token_ids`` / ``draft_probs`` / ``draft_tree`` from one
    batched ``drafter.propose`` call (one by one if it raises: a request whose drafter raises alone
    ends through ``fail``)."""
    inputs = [
        DraftInput(
            s.request,
            s.num_new_tokens,
            s.max_draft_depth - s.num_forced_slots,
            s.num_draft_slots - s.num_forced_slots,
            s.num_forced_slots,
        )
        for s in scheduled
    ]
    by_request = {id(x.request): s for x, s in zip(inputs, scheduled)}
    proposed = run_isolated(
        inputs,
        lambda batch: list(drafter.propose(batch)),
        lambda x, e: fail(by_request[id(x.request)], f"drafter failed: {type(e).__name__}: {e}"),
        "drafter",
    )
    checked: list[tuple[ScheduledRequest, DraftProposal]] = []
    for x, proposal in proposed:
        s = by_request[id(x.request)]
        try:
            checked.append((s, check_proposal(proposal, vocab_size, check_values=False)))
        except InvalidProposalError as e:
            logger.warning("request %s: drafts dropped this step: %s", s.request.request_id, e)
    # The values of every draft_probs in one batched pass (one host sync for the step).
    for (s, proposal), error in zip(checked, draft_probs_errors([p for _, p in checked])):
        if error is not None:
            logger.warning("request %s: drafts dropped this step: %s", s.request.request_id, error)
            continue
        try:
            fit_proposal(s, proposal)
        except Exception as e:
            fail(s, f"drafts cannot be verified: {type(e).__name__}: {e}")


def check_proposal(proposal: object, vocab_size: int, check_values: bool = True) -> DraftProposal:
    """Check a proposal is verifiable; returns it. ``check_values=False`` leaves the values of
    ``draft_probs`` to :func:`draft_probs_errors` (batched over a step's proposals).

    Raises:
        InvalidProposalError: not a ``DraftProposal``; token ids that are not integers in ``[0,
            vocab_size)``; ``draft_probs`` not ``[len(token_ids), vocab_size]``, not finite, negative or
            with rows not summing to 1; ``parents`` that do not form a token tree; a tree with
            ``draft_probs``; a draft token of probability 0 under its own ``draft_probs`` row (the
            acceptance test divides by it).
    """
    if not isinstance(proposal, DraftProposal):
        raise InvalidProposalError(f"the drafter returned {type(proposal).__name__}, not a DraftProposal")
    try:
        tokens = list(proposal.token_ids)
    except TypeError:
        raise InvalidProposalError(f"token_ids must be a list of ints, got {proposal.token_ids!r}") from None
    bad = [t for t in tokens if not is_index(t) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidProposalError(f"draft token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    probs = proposal.draft_probs
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != (len(tokens), vocab_size):
            shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
            raise InvalidProposalError(f"draft_probs has shape {shape}, expected {(len(tokens), vocab_size)}")
        if tokens and check_values:
            (error,) = draft_probs_errors([proposal])
            if error is not None:
                raise InvalidProposalError(error)
    if proposal.parents is not None:
        if probs is not None:
            raise InvalidProposalError("token-tree proposals must be deterministic (draft_probs None)")
        parents = proposal.parents
        if not isinstance(parents, (list, tuple)) or not all(is_index(q) for q in parents):
            raise InvalidProposalError(f"parents must be a list of ints, got {parents!r}")
        try:
            TokenTree(tuple(tokens), tuple(int(q) for q in parents))
        except (ValueError, TypeError) as e:
            raise InvalidProposalError(f"not a token tree: {e}") from None
    return proposal


def draft_probs_errors(proposals: list[DraftProposal]) -> list[str | None]:
    """Per proposal, why its ``draft_probs`` cannot be verified, or None: rows must be finite,
    non-negative and sum to 1, and give each draft token a positive probability (the acceptance test
    divides by it). Shapes are already checked (:func:`check_proposal`); one host sync for them all."""
    errors: list[str | None] = [None] * len(proposals)
    which = [i for i, p in enumerate(proposals) if p.draft_probs is not None and p.token_ids]
    if not which:
        return errors
    probs = torch.cat([proposals[i].draft_probs.detach().float() for i in which])  # type: ignore[union-attr]
    tokens = torch.tensor([int(t) for i in which for t in proposals[i].token_ids], device=probs.device)
    drawn = probs[torch.arange(probs.shape[0], device=probs.device), tokens]
    stats = torch.stack([probs.amin(dim=-1), (probs.sum(dim=-1) - 1).abs(), drawn], dim=1).tolist()
    row = 0
    for i in which:
        for lowest, deviation, q in stats[row : row + len(proposals[i].token_ids)]:
            if not (math.isfinite(lowest) and lowest >= 0 and math.isfinite(deviation)):  # NaN fails
                errors[i] = "draft_probs are not finite and non-negative"
            elif deviation > PROB_SUM_TOLERANCE:
                errors[i] = f"draft_probs rows must sum to 1 (off by {deviation:.3g})"
            elif q <= 0:
                errors[i] = "a draft token has probability 0 under its own draft_probs row"
            if errors[i] is not None:
                break
        row += len(proposals[i].token_ids)
    return errors


def fit_proposal(s: ScheduledRequest, proposal: DraftProposal) -> None:
    """Fit a checked proposal to the request's slots and depth; a tree that reduces to a chain becomes
    one. Under a grammar a chain is cut at the first draft the grammar forbids, and a tree loses every
    node whose path it forbids (with its subtree) before the slots are counted."""
    tokens = [int(t) for t in proposal.token_ids]
    probs = proposal.draft_probs
    grammar = s.request.grammar
    if proposal.parents is not None:
        tree = TokenTree(tuple(tokens), tuple(int(q) for q in proposal.parents))
        if grammar is not None:
            tree = tree.pruned(grammar_tree_keep(grammar, tree))
        tree = tree.truncated(s.num_draft_slots, s.max_draft_depth)
        tokens = list(tree.token_ids)
        s.draft_tree = None if tree.is_chain else tree
    else:
        tokens = tokens[: s.max_draft_depth]
        if grammar is not None and tokens:
            tokens = tokens[: grammar.validate_tokens(tokens)]
    s.draft_token_ids = tokens
    s.draft_probs = None if probs is None else probs.detach()[: len(tokens)]
