"""Verification: processing the logits rows, then sampling or verifying the drafts, and logprobs.

Every row is processed (penalties, masks, temperature, top-k/p, min-p) with its own prefix, the
committed tokens plus the drafts before it (for a tree node, its own path), and the processed rows are
what sampling, verification and ``logprobs`` use, so draft and target rows see the same transforms.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kernels.cpu_max_rows import max_rows
from sampling.logprobs import Logprob, token_logprobs
from sampling.processors import RowGroup, build_sampling_metadata, process_logits
from sampling.rejection_sampler import VerifyResult
from sampling.sampler import sample
from sampling.tree_rejection_sampler import TreeVerifyResult
from sampling.verifier import Verifier, VerifyInput
from specdec.engine.faults import run_isolated
from specdec.engine.grammar_masks import request_bitmask
from specdec.request import Request
from specdec.scheduler import ScheduledRequest

logger = logging.getLogger("specdec.engine")


def logits_rows(scheduled: list[ScheduledRequest]) -> dict[str, range]:
    """Rows of each sampling request in the step's logits ``[R, vocab_size]``: its last committed token,
    then its drafts (a chain's, or a token tree's nodes in order), in the order of ``scheduled``; requests
    that only prefill have none."""
    rows: dict[str, range] = {}
    start = 0
    for s in scheduled:
        if s.sample:
            n = 1 + len(s.draft_token_ids)
            rows[s.request.request_id] = range(start, start + n)
            start += n
    return rows


def accepted_nodes(result: VerifyResult) -> list[int]:
    """The accepted drafts as node indices (a chain's are 0 .. num_accepted - 1)."""
    if isinstance(result, TreeVerifyResult):
        return result.accepted_nodes
    return list(range(result.num_accepted))


def row_group(
    req: Request,
    draft_token_ids: list[int],
    num_rows: int,
    vocab_size: int,
    bitmask: torch.Tensor | None = None,
) -> RowGroup:
    """The processing of ``num_rows`` rows of ``req`` whose prefix is its tokens plus ``draft_token_ids``,
    masked by ``bitmask`` (``[num_rows, ceil(vocab_size / 32)]``; None: no grammar)."""
    return RowGroup(
        req.sampling_params,
        req.token_ids,
        req.num_prompt_tokens,
        req.stop_ids,
        draft_token_ids,
        num_rows,
        bitmask,
    )


def row_groups(s: ScheduledRequest, vocab_size: int, bitmask: torch.Tensor | None = None) -> list[RowGroup]:
    """The verification rows of a request: one group for a chain; for a tree, one row per node, each
    with its own path as the draft prefix (penalties see the path, not the other branches) and, under a
    grammar, masked by the grammar state after that path. ``bitmask``: the rows' masks when already
    computed beside the forward (else :func:`~specdec.engine.grammar_masks.request_bitmask` here)."""
    req, tree = s.request, s.draft_tree
    if bitmask is None and req.grammar is not None:
        bitmask = request_bitmask(s, vocab_size)
    if tree is None:
        return [row_group(req, s.draft_token_ids, 1 + len(s.draft_token_ids), vocab_size, bitmask)]
    masks = bitmask
    paths: list[list[int]] = [[]] + [tree.path_tokens(i) for i in range(tree.num_nodes)]
    return [
        row_group(req, path, 1, vocab_size, None if masks is None else masks[r : r + 1])
        for r, path in enumerate(paths)
    ]


@dataclass
class ProcessedRows:
    """The step's sampling requests and their processed rows.

    Attributes:
        sampling: the requests that emit tokens this step (prefill-only and failed ones left out).
        processed: ``[sum_i (1 + m_i), vocab_size]`` float32, each request's rows in order.
        greedy: per row, whether its request is greedy.
        argmax: ``[sum_i (1 + m_i)]`` int64, each processed row's first maximal index (the indices of
            the max-reduction that checks the rows are finite, so greedy sampling reads no row again), or
            None (a step with drafts or without greedy rows).
    """

    sampling: list[ScheduledRequest]
    processed: torch.Tensor
    greedy: list[bool]
    argmax: torch.Tensor | None = None


def process_rows(
    scheduled: list[ScheduledRequest],
    logits: torch.Tensor,
    vocab_size: int,
    fail: Callable[[ScheduledRequest, str, bool], None],
    bitmasks: Mapping[str, torch.Tensor] | None = None,
) -> ProcessedRows:
    """Process the sampling requests' logits rows (:func:`sampling.processors.process_logits`) and end,
    through ``fail``, the requests whose rows cannot be sampled from. ``bitmasks``: per request id, its
    rows' grammar masks computed beside the forward (:mod:`specdec.engine.grammar_masks`); the others'
    are computed here.

    One max-reduction over the processed rows finds rows that are not finite: NaN anywhere (NaN
    propagates through it), +inf, or every token at -inf (nothing left to sample). In a step of greedy
    rows and no drafts it is the maximum with its index (:func:`kernels.cpu_max_rows.max_rows`, torch's
    ``max`` where the kernel does not apply), the rows' argmax (``ProcessedRows.argmax``), which greedy
    sampling then takes; else ``amax`` (at a vocabulary of 49,152 on this project's CPU: 7 us a row
    against 45 us for torch's ``max`` with indices and ~7-15 us for the kernel's). Requests whose
    rows' metadata cannot be built are found request by request (:func:`run_isolated`).
    """
    everyone = [s for s in scheduled if s.sample]
    if not everyone:
        return ProcessedRows([], logits[:0], [])
    rows = logits_rows(scheduled)

    def process(batch: list[ScheduledRequest]) -> tuple[torch.Tensor, list[bool]]:
        masks = bitmasks or {}
        groups = [g for s in batch for g in row_groups(s, vocab_size, masks.get(s.request.request_id))]
        meta = build_sampling_metadata(groups, logits.shape[-1], logits.device)
        x = logits
        if len(batch) != len(everyone):
            x = logits[
                torch.tensor([r for s in batch for r in rows[s.request.request_id]], device=logits.device)
            ]
        return process_logits(x, meta), list(meta.greedy)

    try:  # the common case: one batched call, no per-request copies
        sampling = everyone
        processed, greedy = process(everyone)
    except Exception as batch_error:
        logger.warning("processing failed on a batch of %d (%s); one by one", len(everyone), batch_error)
        done = run_isolated(
            everyone,
            lambda one: [process(one)],
            lambda s, e: fail(s, f"cannot process its logits: {type(e).__name__}: {e}", False),
            "processing",
            batched=False,
        )
        if not done:
            return ProcessedRows([], logits[:0], [])
        sampling = [s for s, _ in done]
        processed = torch.cat([p for _, (p, _) in done])
        greedy = [g for _, (_, gs) in done for g in gs]
    if any(greedy) and not any(s.draft_token_ids for s in sampling):  # greedy sampling reads the argmax
        values, argmax = max_rows(processed)
        finite = torch.isfinite(values)
    else:  # ``amax`` is several times faster than ``max`` with indices on the CPU
        finite, argmax = torch.isfinite(processed.amax(dim=-1)), None
    batch = ProcessedRows(sampling, processed, greedy, argmax)
    if bool(finite.all()):
        return batch
    return _drop_non_finite(batch, finite, logits, fail)


def _drop_non_finite(
    batch: ProcessedRows,
    finite: torch.Tensor,
    logits: torch.Tensor,
    fail: Callable[[ScheduledRequest, str, bool], None],
) -> ProcessedRows:
    """End (scrubbing their KV) the requests with a row that is not finite (``finite`` ``[rows]`` bool
    False); keep the others' rows."""
    finite_rows = finite.tolist()
    kept: list[ScheduledRequest] = []
    keep: list[int] = []
    start = 0
    for s in batch.sampling:
        n = 1 + len(s.draft_token_ids)
        bad = [i for i in range(n) if not finite_rows[start + i]]
        if bad:
            fail(
                s,
                f"non-finite logits: {len(bad)} of its {n} rows have NaN, +inf or no token left after the "
                "sampling transforms (a numeric overflow in the model, or from extreme sampling parameters)",
                True,
            )
        else:
            kept.append(s)
            keep.extend(range(start, start + n))
        start += n
    if not kept:
        return ProcessedRows([], logits[:0], [])
    index = torch.tensor(keep, dtype=torch.int64, device=batch.processed.device)
    argmax = None if batch.argmax is None else batch.argmax[index]
    return ProcessedRows(kept, batch.processed[index], [batch.greedy[i] for i in keep], argmax)


def sample_or_verify(
    batch: ProcessedRows, verifier: Verifier, generator: torch.Generator
) -> list[VerifyResult]:
    """One token per request when nobody drafted (plain sampling); else the drafts through ``verifier``.
    Greedy rows keep their processed logits (only their argmax is read)."""
    sampling, processed = batch.sampling, batch.processed
    if not sampling:
        return []
    if not any(s.draft_token_ids for s in sampling):
        generators = [s.request.generator for s in sampling]
        tokens = sample(processed, batch.greedy, generators, generator, argmax=batch.argmax)
        return [VerifyResult([t], 0) for t in tokens.tolist()]
    if all(batch.greedy):  # only the argmax of each row is read: no softmax
        target_probs = processed
    else:
        greedy_mask = torch.tensor(batch.greedy, device=processed.device)[:, None]
        target_probs = torch.softmax(processed, dim=-1)
        if any(batch.greedy):
            target_probs = torch.where(greedy_mask, processed, target_probs)
    inputs = [
        VerifyInput(
            s.draft_token_ids,
            s.draft_probs,
            s.draft_tree,
            s.request.sampling_params.greedy,
            s.request.generator,
        )
        for s in sampling
    ]
    return verifier.verify_batch(target_probs, inputs, generator)


def emitted_logprobs(
    batch: ProcessedRows, results: list[VerifyResult]
) -> dict[str, list[dict[int, Logprob]]]:
    """Log-probabilities of every emitted token of the requests that asked for them: the token emitted
    after j accepted drafts is scored under the verification row it was emitted from (row j of a chain;
    the root or the j-th accepted node of a tree): whatever the drafter, the emitted token follows the
    target's processed distribution there."""
    rows: list[int] = []
    tokens: list[int] = []
    num_top: list[int] = []
    owners: list[tuple[str, int]] = []
    start = 0
    for s, res in zip(batch.sampling, results):
        n = s.request.sampling_params.logprobs
        if n is not None:
            emitted_rows = [0] + [1 + node for node in accepted_nodes(res)]
            rows.extend(start + r for r in emitted_rows[: len(res.token_ids)])
            tokens.extend(res.token_ids)
            num_top.extend([n] * len(res.token_ids))
            owners.append((s.request.request_id, len(res.token_ids)))
        start += 1 + len(s.draft_token_ids)
    if not rows:
        return {}
    processed = batch.processed
    flat = token_logprobs(processed[torch.tensor(rows, device=processed.device)], tokens, num_top)
    out: dict[str, list[dict[int, Logprob]]] = {}
    i = 0
    for rid, n in owners:
        out[rid] = flat[i : i + n]
        i += n
    return out
