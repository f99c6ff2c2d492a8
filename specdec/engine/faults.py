"""Fault isolation: one request's fault ends that request alone.

:func:`run_isolated` is the one place where a batched stage (drafting, processing the logits rows,
committing tokens) falls back to running its requests one at a time to find the culprit.
:func:`zero_blocks` scrubs a failed request's private KV so NaN or infinity cannot reach a later request
through stale (masked) slots.

Faults: a fault that concerns one request ends that request alone (``finish_reason`` "error", the
message in ``Request.error``), frees its blocks and leaves every other request's tokens unchanged:
its grammar fails to compile; its logits rows, after the sampling transforms, are not finite (NaN,
+inf, or every token at -inf; one max-reduction over the step's rows detects it); its drafter raises
when proposing for it alone (drafts are then retried one request at a time); its drafts cannot be
verified (out-of-vocabulary ids, bad ``draft_probs``: they are dropped for that step, the request
goes on); building its rows' sampling metadata, committing its tokens, its grammar or its stop
strings raise. Errors that cannot be pinned on one request (the target forward itself) propagate
from :meth:`step`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from specdec.kv_cache.block_pool import BlockPool
    from specdec.request import Request

logger = logging.getLogger("specdec.engine")

T = TypeVar("T")
R = TypeVar("R")


def run_isolated(
    items: Sequence[T],
    run: Callable[[list[T]], list[R]],
    fail: Callable[[T, Exception], None],
    what: str,
    batched: bool = True,
) -> list[tuple[T, R]]:
    """Run ``run`` over ``items`` (one result per item, in order) so that a failing item fails alone.

    ``batched``: first one call on the whole batch; if it raises, each item is run alone, ``fail(item,
    error)`` ends those that raise alone and the others keep their own results (a batch that fails while
    every item succeeds alone is logged, and the step goes on). Not ``batched`` (stages with side
    effects, such as committing tokens): each item alone from the start, never run twice.

    Returns:
        ``(item, result)`` for each item that did not fail, in order.
    """
    if batched and items:
        try:
            results = run(list(items))
            if len(results) != len(items):
                raise ValueError(f"{what}: {len(results)} results for {len(items)} requests")
            return list(zip(items, results))
        except Exception as batch_error:
            logger.warning(
                "%s failed on a batch of %d (%s); retrying one by one", what, len(items), batch_error
            )
    out: list[tuple[T, R]] = []
    for item in items:
        try:
            (result,) = run([item])
        except Exception as e:
            fail(item, e)
            continue
        out.append((item, result))
    return out


def scrub_private_blocks(req: Request, pool: BlockPool, caches: object, num_blocks: int) -> None:
    """Zero the K/V of the blocks only ``req`` holds (its uncached blocks with reference count 1), so that
    NaN or infinity its forward wrote cannot reach a later request through stale (masked) slots."""
    first = max(req.num_cached_blocks, req.num_released_blocks)  # released entries are held no more
    private = [b for b in req.block_ids[first:] if pool.blocks[b].ref_count == 1]
    if private:
        zero_blocks(caches, private, num_blocks)


def zero_blocks(caches: object, block_ids: list[int], num_blocks: int) -> None:
    """Zero blocks ``block_ids`` of every per-block cache tensor (dim 0 = ``num_blocks``) in ``caches``
    (a runner's per-layer tuples, whatever tensors they hold)."""
    idx = None
    stack: list[object] = [caches]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.dim() > 0 and item.shape[0] == num_blocks:
                if idx is None or idx.device != item.device:
                    idx = torch.tensor(block_ids, dtype=torch.int64, device=item.device)
                item.index_fill_(0, idx, 0)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
