"""Logits processors: pure functions on a flattened batch of logits rows, with per-row parameters.

Every function takes ``logits`` ``[num_rows, vocab_size]`` float32 and per-row parameter tensors
``[num_rows]``, and returns a new tensor (removed tokens set to ``-inf``); there is no per-request
Python loop. :func:`process_logits` applies them in transformers' ``generate`` order:

1. repetition penalty (transformers' ``RepetitionPenaltyLogitsProcessor``; Keskar et al. 2019): for every
   token in the row's prompt or output, a positive logit is divided by the penalty, a negative one
   multiplied by it, so the token always becomes less likely when the penalty is > 1;
2. presence and frequency penalties (the OpenAI API's definition): ``logit -= frequency_penalty *
   count + presence_penalty * (count > 0)``, counting occurrences in the output only;
3. the token bitmask: tokens a row must not produce (the stop tokens while ``min_tokens`` is unmet, as
   transformers' ``MinNewTokensLengthLogitsProcessor`` does for EOS; the grammar mask) get ``-inf``;
4. temperature: ``logits / temperature`` (greedy rows use 1.0: their argmax is unchanged);
5. top-k (``TopKLogitsWarper``): keep every logit >= the k-th largest, so ties at the k-th value stay;
6. top-p (``TopPLogitsWarper``; Holtzman et al. 2020): sort ascending, drop the tokens whose cumulative
   probability is <= ``1 - top_p``, never the most probable one: what is left is the smallest set of
   most probable tokens whose mass reaches ``top_p``;
7. min-p (``MinPLogitsWarper``; Nguyen et al. 2024): drop tokens whose probability, after temperature,
   is below ``min_p`` times the largest probability.

The *processed distribution* of a row is ``softmax`` of the result. It is what sampling draws from,
what speculative decoding verifies with (as ``target_probs``, and as ``draft_probs`` for a draft model,
both built by these same functions, each draft position with its own prefix), and what ``logprobs``
reports. Greedy requests take its argmax; their processed distribution is the one at temperature 1.

Each row's prefix may extend the request's committed tokens with earlier draft tokens: the
penalties and ``min_tokens`` of draft position j see the drafts before j (:class:`RowGroup`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from sampling.params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class RowGroup:
    """Consecutive logits rows of one request: row j continues the request's committed tokens with
    the draft tokens before it.

    Attributes:
        params: the request's sampling parameters.
        token_ids: the committed prompt + output tokens.
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        stop_token_ids: the tokens that end the request (masked while ``min_tokens`` is unmet).
        draft_token_ids: draft tokens after ``token_ids``; row j's prefix holds the first
            ``len(draft_token_ids) - num_rows + 1 + j`` of them (so a verification group of m drafts
            has ``m + 1`` rows, row j seeing ``drafts[:j]``; a drafter row after s drafts sees all s).
        num_rows: logits rows of the group.
        bitmask: optional packed token bitmask ``[num_rows, ceil(vocab_size / 32)]`` int32 (bit j of
            word w allows token ``32 * w + j``; see :mod:`grammars.bitmask`), from the request's grammar.
    """

    params: SamplingParams
    token_ids: Sequence[int]
    num_prompt_tokens: int
    stop_token_ids: Collection[int] = ()
    draft_token_ids: Sequence[int] = ()
    num_rows: int = 1
    bitmask: torch.Tensor | None = None

    def num_drafts_before(self, row: int) -> int:
        return len(self.draft_token_ids) - self.num_rows + 1 + row


@dataclass
class SamplingMetadata:
    """Per-row parameters of a flattened batch of R logits rows. A field is None when no row uses it.

    Attributes:
        greedy: ``[R]`` Python bools, take the argmax.
        temperature: ``[R]`` float32 (1.0 on greedy rows).
        top_k: ``[R]`` int64, 0 = off.
        top_p_threshold: ``[R]`` float32, ``1 - top_p`` computed in float64 as transformers does.
        min_p: ``[R]`` float32.
        repetition_penalty: ``[R]`` float32.
        penalty_mask: ``[R, V]`` bool, tokens in the row's prompt or output.
        presence_penalty, frequency_penalty: ``[R]`` float32.
        output_counts: ``[R, V]`` float32, occurrences in the row's output (drafts before it included).
        banned_rows, banned_token_ids: ``[n]`` int64 pairs forced to ``-inf`` (min_tokens).
        bitmask: packed ``[R, ceil(V / 32)]`` int32 token bitmask (all bits set on free rows), or None.
    """

    greedy: list[bool]
    temperature: torch.Tensor
    top_k: torch.Tensor | None = None
    top_p_threshold: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    penalty_mask: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None
    banned_token_ids: torch.Tensor | None = None
    bitmask: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.greedy)


def build_sampling_metadata(
    groups: Sequence[RowGroup], vocab_size: int, device: torch.device | str = "cpu"
) -> SamplingMetadata:
    """Flatten the groups' parameters into per-row tensors (rows in group order)."""
    rows: list[SamplingParams] = []
    for g in groups:
        rows.extend([g.params] * g.num_rows)
    num_rows = len(rows)
    greedy = [p.greedy for p in rows]

    def vec(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = SamplingMetadata(greedy, vec([1.0 if p.greedy else float(p.temperature) for p in rows]))
    if any(p.top_k > 0 for p in rows):
        meta.top_k = vec([max(p.top_k, 0) for p in rows], torch.int64)
    if any(p.top_p < 1 for p in rows):
        meta.top_p_threshold = vec([1 - float(p.top_p) for p in rows])
    if any(p.min_p > 0 for p in rows):
        meta.min_p = vec([float(p.min_p) for p in rows])
    use_rep = any(p.repetition_penalty != 1.0 for p in rows)
    use_openai = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in rows)
    mask_rows: list[int] = []
    mask_toks: list[int] = []
    count_rows: list[int] = []
    count_toks: list[int] = []
    ban_rows: list[int] = []
    ban_toks: list[int] = []
    bitmasks: list[tuple[int, torch.Tensor]] = []
    r0 = 0
    for g in groups:
        p = g.params
        num_output = len(g.token_ids) - g.num_prompt_tokens
        for j in range(g.num_rows):
            r = r0 + j
            extra = list(g.draft_token_ids[: g.num_drafts_before(j)])
            if use_rep and p.repetition_penalty != 1.0:
                toks = list(g.token_ids) + extra
                mask_rows.extend([r] * len(toks))
                mask_toks.extend(toks)
            if use_openai and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
                toks = list(g.token_ids[g.num_prompt_tokens :]) + extra
                count_rows.extend([r] * len(toks))
                count_toks.extend(toks)
            if num_output + len(extra) < p.min_tokens and g.stop_token_ids:
                stops = sorted(t for t in g.stop_token_ids if t < vocab_size)
                ban_rows.extend([r] * len(stops))
                ban_toks.extend(stops)
        if g.bitmask is not None:
            bitmasks.append((r0, g.bitmask))
        r0 += g.num_rows
    if use_rep:
        meta.repetition_penalty = vec([float(p.repetition_penalty) for p in rows])
        mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        if mask_rows:
            mask[vec(mask_rows, torch.int64), vec(mask_toks, torch.int64)] = True
        meta.penalty_mask = mask
    if use_openai:
        meta.presence_penalty = vec([float(p.presence_penalty) for p in rows])
        meta.frequency_penalty = vec([float(p.frequency_penalty) for p in rows])
        counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
        if count_rows:
            idx = (vec(count_rows, torch.int64), vec(count_toks, torch.int64))
            counts.index_put_(idx, torch.ones(len(count_rows), device=device), accumulate=True)
        meta.output_counts = counts
    if ban_rows:
        meta.banned_rows = vec(ban_rows, torch.int64)
        meta.banned_token_ids = vec(ban_toks, torch.int64)
    if bitmasks:
        from grammars.bitmask import allocate_token_bitmask

        full = allocate_token_bitmask(num_rows, vocab_size).to(device)
        for start, m in bitmasks:
            full[start : start + m.shape[0]] = m.to(device)
        meta.bitmask = full
    return meta


# ------------------------------------------------------------------------------------------ processors
def apply_repetition_penalty(
    logits: torch.Tensor, penalty: torch.Tensor, penalty_mask: torch.Tensor
) -> torch.Tensor:
    """transformers' repetition penalty. ``penalty`` ``[R]`` (> 0), ``penalty_mask`` ``[R, V]`` bool
    (tokens seen in the prompt or output). Returns ``[R, V]``."""
    pen = penalty[:, None]
    penalized = torch.where(logits < 0, logits * pen, logits / pen)
    return torch.where(penalty_mask, penalized, logits)


def apply_presence_frequency_penalties(
    logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor, output_counts: torch.Tensor
) -> torch.Tensor:
    """OpenAI's penalties: ``logits - frequency * count - presence * (count > 0)``; ``output_counts``
    ``[R, V]`` occurrences in the output. Returns ``[R, V]``."""
    return logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0)


def apply_token_ban(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Set ``logits[rows[i], token_ids[i]] = -inf`` (``min_tokens``: stop tokens not yet allowed)."""
    out = logits.clone()
    out[rows, token_ids] = _NEG_INF
    return out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Packed token bitmask ``[R, ceil(V / 32)]`` int32: tokens whose bit is 0 become ``-inf``
    (:func:`grammars.bitmask.apply_token_bitmask`, the pure-torch reference)."""
    from grammars.bitmask import apply_token_bitmask

    return apply_token_bitmask(logits, bitmask)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits / temperature[:, None]`` (temperature ``[R]`` > 0)."""
    return logits / temperature[:, None]


def _on_rows(logits: torch.Tensor, active: torch.Tensor, fn) -> torch.Tensor:
    """Apply ``fn(sub_logits, row_index)`` to the rows where ``active`` is True only."""
    if bool(active.all()):
        return fn(logits, None)
    rows = active.nonzero().squeeze(1)
    if rows.numel() == 0:
        return logits
    out = logits.clone()
    out[rows] = fn(logits[rows], rows)
    return out


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the logits >= each row's k-th largest (ties kept); ``top_k`` ``[R]`` int64, <= 0 = off,
    >= V keeps everything."""
    vocab = logits.shape[-1]

    def fn(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        k = (top_k if rows is None else top_k[rows]).clamp(max=vocab)
        kth = x.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        return x.masked_fill(x < kth, _NEG_INF)

    return _on_rows(logits, top_k > 0, fn)


def apply_top_p(logits: torch.Tensor, top_p_threshold: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering with ``top_p_threshold = 1 - top_p`` ``[R]`` float32; rows with threshold <= 0
    (``top_p = 1``) are left alone."""

    def fn(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        thr = top_p_threshold if rows is None else top_p_threshold[rows]
        sorted_logits, order = torch.sort(x, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= thr[:, None]
        remove_sorted[:, -1] = False  # the most probable token always stays
        remove = remove_sorted.scatter(1, order, remove_sorted)
        return x.masked_fill(remove, _NEG_INF)

    return _on_rows(logits, top_p_threshold > 0, fn)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with probability < ``min_p`` × the row's largest probability; ``min_p`` ``[R]``."""

    def fn(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        mp = min_p if rows is None else min_p[rows]
        probs = x.softmax(dim=-1)
        remove = probs < mp[:, None] * probs.amax(dim=-1, keepdim=True)
        return x.masked_fill(remove, _NEG_INF)

    return _on_rows(logits, min_p > 0, fn)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """All processors in order (module docstring). ``logits`` ``[R, V]`` float32, not modified.

    Returns:
        ``[R, V]`` float32 processed logits: ``softmax`` of a row is its processed distribution.

    Raises:
        ValueError: ``meta`` has a different number of rows.
    """
    if logits.shape[0] != meta.num_rows:
        raise ValueError(f"logits have {logits.shape[0]} rows, the sampling metadata {meta.num_rows}")
    x = logits.float()
    if meta.repetition_penalty is not None and meta.penalty_mask is not None:
        x = apply_repetition_penalty(x, meta.repetition_penalty, meta.penalty_mask)
    counts, presence, frequency = meta.output_counts, meta.presence_penalty, meta.frequency_penalty
    if counts is not None and presence is not None and frequency is not None:
        x = apply_presence_frequency_penalties(x, presence, frequency, counts)
    if meta.banned_rows is not None and meta.banned_token_ids is not None:
        x = apply_token_ban(x, meta.banned_rows, meta.banned_token_ids)
    if meta.bitmask is not None:
        x = apply_bitmask(x, meta.bitmask)
    if not all(meta.greedy):
        x = apply_temperature(x, meta.temperature)
    if meta.top_k is not None:
        x = apply_top_k(x, meta.top_k)
    if meta.top_p_threshold is not None:
        x = apply_top_p(x, meta.top_p_threshold)
    if meta.min_p is not None:
        x = apply_min_p(x, meta.min_p)
    return x
