"""Beam search on the paged KV cache: many prompts' beams in one batched forward per step.

Every prompt is prefilled once (in chunks of at most ``max_num_batched_tokens`` tokens, prefix-cache hits
reused); each step then runs one forward with the last token of every running beam of every prompt, and
per prompt :class:`~sampling.beam_search.BeamSearchState` chooses the new beams, with transformers'
``generate(num_beams=...)`` semantics (see :mod:`sampling.beam_search`).

Beams are :class:`~specdec.request.Request` objects whose block tables share KV by reference count: a beam
continued by k new beams is kept by the first and forked for the others (``KVCacheManager.fork``: the full
blocks are shared, the partly filled last block is copy-on-write, copied by ``ModelRunner.copy_blocks``);
a beam with no continuation frees its blocks. Shared blocks are full, so they are never written again.

Capacity: before any work, prompts are split, in order, into groups whose beams fit the KV pool at full
length (:func:`blocks_needed`) and whose running beams fit one forward (``max_num_batched_tokens``; a
group holds at least one prompt); groups run one after the other. A prompt that cannot fit the pool even
alone raises :class:`~specdec.errors.KVCacheExhaustedError`. Nothing is registered in the prefix cache.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sampling.beam_search import BeamSearchParams, BeamSearchState
from sampling.params import SamplingParams
from specdec.errors import InvalidRequestError, KVCacheExhaustedError
from specdec.kv_cache.manager import cdiv
from specdec.model_runner import Segment, build_inputs
from specdec.request import Request

if TYPE_CHECKING:
    from specdec.engine import LLMEngine


@dataclass
class BeamSearchSequence:
    """One returned hypothesis.

    Attributes:
        token_ids: generated tokens (prompt excluded, no padding), EOS included when it ended the sequence.
        text: detokenized ``token_ids`` ("" without a tokenizer).
        cum_logprob: sum of the tokens' log-probabilities (float32 arithmetic).
        score: ``cum_logprob / len(token_ids) ** length_penalty``, transformers' ``sequences_scores``.
        finish_reason: "stop" (ended by EOS) or "length" (``max_tokens`` or ``max_model_len``).
    """

    token_ids: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    """The beam search result of one prompt.

    Attributes:
        prompt: the prompt string, if one was given.
        prompt_token_ids: the prompt's token ids.
        sequences: ``num_return_sequences`` hypotheses, best score first.
    """

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]


def blocks_needed(prompt_len: int, max_new_tokens: int, beam_width: int, block_size: int) -> int:
    """Most KV blocks one prompt's beam search holds at once.

    The prompt's full blocks are shared by every beam; each of at most ``beam_width`` beams holds the rest
    of its blocks privately, up to ``prompt_len + max_new_tokens - 1`` tokens of KV (the last generated
    token is never forwarded). With ``max_new_tokens == 1`` there is no fork: only the prompt's blocks.
    """
    total = prompt_len + max_new_tokens - 1
    shared = prompt_len // block_size
    beams = beam_width if max_new_tokens > 1 else 1
    return shared + beams * (cdiv(total, block_size) - shared)


def _validate(engine: LLMEngine, prompts: Sequence[Sequence[int]], params: BeamSearchParams) -> None:
    """The engine's request checks for beam search (see ``LLMEngine.validate``).

    Raises:
        InvalidRequestError: params not a valid ``BeamSearchParams``; the engine has unfinished requests;
            an empty prompt, one of ``max_model_len`` tokens or more, or token ids outside the vocabulary.
    """
    if not isinstance(params, BeamSearchParams):
        raise InvalidRequestError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    params.validate()
    if engine.has_unfinished_requests():
        raise InvalidRequestError(
            "beam search runs its own loop and needs an idle engine; finish or abort the engine's "
            "unfinished requests first"
        )
    vocab = engine.model_cfg.vocab_size
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        if n == 0:
            raise InvalidRequestError(f"prompt {i} is empty")
        if n >= engine.max_model_len:
            raise InvalidRequestError(
                f"prompt {i} has {n} tokens but max_model_len is {engine.max_model_len}: "
                "it must leave room for at least one generated token"
            )
        bad = [
            t
            for t in prompt
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab
        ]
        if bad:
            raise InvalidRequestError(
                f"prompt {i}: token ids must be integers in [0, {vocab}); got {bad[:5]}"
            )


def _groups(engine: LLMEngine, needs: list[int], width: int) -> list[list[int]]:
    """Split prompt indices, in order, into groups that fit the free KV blocks and one forward.

    Raises:
        KVCacheExhaustedError: one prompt alone needs more blocks than are free.
    """
    free = engine.kv.num_free_blocks
    budget = engine.scheduler.config.max_num_batched_tokens
    groups: list[list[int]] = []
    used = 0
    for i, need in enumerate(needs):
        if need > free:
            raise KVCacheExhaustedError(
                f"beam search of prompt {i} needs up to {need} KV blocks at once ({width} beams at full "
                f"length) but the pool has {free} free; raise num_kv_blocks or lower beam_width or max_tokens"
            )
        if groups and used + need <= free and (len(groups[-1]) + 1) * width <= budget:
            groups[-1].append(i)
            used += need
        else:
            groups.append([i])
            used = need
    return groups


def _prefill(engine: LLMEngine, reqs: list[Request]) -> torch.Tensor:
    """Compute the prompts' KV in forwards of at most ``max_num_batched_tokens`` tokens.

    Returns:
        ``[len(reqs), vocab_size]`` float32 logits of each prompt's last token.
    """
    kv, runner = engine.kv, engine.runner
    budget = engine.scheduler.config.max_num_batched_tokens
    rows: list[torch.Tensor | None] = [None] * len(reqs)
    for req in reqs:  # reuse prefix-cache hits (their KV is in the blocks already)
        if not kv.allocate_slots(req, 0, new_computed_blocks=kv.get_computed_blocks(req)):
            raise RuntimeError("KV pool exhausted during beam search prefill (capacity was reserved)")
    pending = list(range(len(reqs)))
    while pending:
        left = budget
        segments: list[Segment] = []
        chunk: list[tuple[int, int]] = []
        for i in pending:
            req = reqs[i]
            n = min(req.num_tokens - req.num_computed_tokens, left)
            if n == 0:
                break
            if not kv.allocate_slots(req, n):
                raise RuntimeError("KV pool exhausted during beam search prefill (capacity was reserved)")
            last = req.num_computed_tokens + n == req.num_tokens
            start = req.num_computed_tokens
            segments.append(Segment(req.block_ids, start, req.token_ids[start : start + n], int(last)))
            chunk.append((i, n))
            left -= n
        logits = runner.execute(build_inputs(segments, kv.block_size, runner.device))
        row = 0
        for i, n in chunk:
            reqs[i].num_computed_tokens += n
            if reqs[i].num_computed_tokens == reqs[i].num_tokens:
                rows[i] = logits[row]
                row += 1
        pending = [i for i in pending if reqs[i].num_computed_tokens < reqs[i].num_tokens]
    return torch.stack([r for r in rows if r is not None])


def _advance(
    engine: LLMEngine,
    parents: list[Request],
    selection: list[tuple[int, int]],
    created: list[Request] | None = None,
) -> list[Request]:
    """The new running beams, in ``selection`` order: a parent's first continuation reuses the parent, the
    others fork it (the copy-on-write copies run before returning); parents without one free their blocks.

    Args:
        parents: the running beams, whose K/V covers every token but the last.
        selection: ``(parent index, token id)`` of each new beam (from ``BeamSearchState.step``).
        created: each forked beam is appended here as soon as it holds blocks, so that a caller
            interrupted before this returns can still free it.
    """
    kv = engine.kv
    first: dict[int, int] = {}
    for j, (p, _) in enumerate(selection):
        first.setdefault(p, j)
    for p, parent in enumerate(parents):
        if p not in first:
            kv.free(parent)  # a dead beam: freed first, so that forks below find its blocks
    beams: list[Request | None] = [None] * len(selection)
    copies: list[tuple[int, int]] = []
    for j, (p, token) in enumerate(selection):
        if first[p] != j:
            parent = parents[p]
            child = Request(parent.request_id, parent.prompt_token_ids, parent.sampling_params, 0)
            if created is not None:
                created.append(child)
            copies.extend(kv.fork(parent, child))
            child.token_ids = parent.token_ids + [token]
            beams[j] = child
    for p, j in first.items():
        parents[p].token_ids.append(selection[j][1])
        beams[j] = parents[p]
    if copies:
        engine.runner.copy_blocks([s for s, _ in copies], [d for _, d in copies])
    return [b for b in beams if b is not None]


def _run_group(
    engine: LLMEngine, prompts: list[list[int]], states: list[BeamSearchState], params: BeamSearchParams
) -> None:
    """Beam search of a group of prompts whose KV fits the pool; every block is free again on return,
    also when it is interrupted (an exception, KeyboardInterrupt included, at any point)."""
    kv, runner = engine.kv, engine.runner
    beams: list[list[Request]] = []
    created: list[Request] = []  # every beam that may hold blocks
    try:
        for i, (prompt, state) in enumerate(zip(prompts, states)):
            sp = SamplingParams(
                temperature=0.0, max_tokens=state.max_new_tokens, ignore_eos=params.ignore_eos
            )
            beams.append([Request(f"beam-{i}", prompt, sp, 0)])
            created.append(beams[-1][0])
        log_probs = torch.log_softmax(_prefill(engine, [b[0] for b in beams]).float(), dim=-1)
        active = list(range(len(prompts)))
        while active:
            row = 0
            for i in active:
                n = len(beams[i])
                selection = states[i].step(log_probs[row : row + n])
                row += n
                if states[i].done:
                    for beam in beams[i]:
                        kv.free(beam)
                    beams[i] = []
                else:
                    beams[i] = _advance(engine, beams[i], selection, created)
                    if len(created) > 4 * sum(len(b) for b in beams):  # forget freed beams now and then
                        created = [r for r in created if r.block_ids]
            active = [i for i in active if not states[i].done]
            if not active:
                break
            segments = []
            for i in active:
                for beam in beams[i]:
                    if not kv.allocate_slots(beam, 1):
                        raise RuntimeError("KV pool exhausted during beam search (capacity was reserved)")
                    segments.append(Segment(beam.block_ids, beam.num_computed_tokens, beam.token_ids[-1:], 1))
            logits = runner.execute(build_inputs(segments, kv.block_size, runner.device))
            for i in active:
                for beam in beams[i]:
                    beam.num_computed_tokens += 1
            log_probs = torch.log_softmax(logits.float(), dim=-1)
    finally:  # also on errors and interrupts: every block back to the pool
        for beam in created:
            kv.free(beam)


def beam_search(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], params: BeamSearchParams
) -> list[BeamSearchOutput]:
    """Beam search for every prompt, prompts batched together, on the engine's model and KV cache.

    Args:
        engine: an engine with no unfinished requests (beam search does not use its scheduler queue).
        prompts: token ids of each prompt.
        params: the search parameters; ``max_tokens`` is capped at ``max_model_len - len(prompt)``.

    Returns:
        One :class:`BeamSearchOutput` per prompt, in order (``prompt`` None, sequences' ``text`` "").

    Raises:
        InvalidRequestError: bad params, a bad prompt, or an engine with unfinished requests (nothing runs).
        KVCacheExhaustedError: one prompt's beams cannot fit the KV pool even alone (nothing runs).
    """
    _validate(engine, prompts, params)
    token_lists = [[int(t) for t in p] for p in prompts]
    eos = engine.model_cfg.eos_token_ids
    states = [
        BeamSearchState(params, min(params.max_tokens, engine.max_model_len - len(p)), eos)
        for p in token_lists
    ]
    bs = engine.kv.block_size
    needs = [
        blocks_needed(len(p), s.max_new_tokens, params.beam_width, bs) for p, s in zip(token_lists, states)
    ]
    for group in _groups(engine, needs, params.beam_width):
        _run_group(engine, [token_lists[i] for i in group], [states[i] for i in group], params)
    outputs = []
    for prompt, state in zip(token_lists, states):
        sequences = [
            BeamSearchSequence(
                h.token_ids, "", h.cum_logprob, h.score, "stop" if h.finished_by_eos else "length"
            )
            for h in state.best()
        ]
        outputs.append(BeamSearchOutput(None, prompt, sequences))
    return outputs
