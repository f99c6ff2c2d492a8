"""transformers' logits processors for a ``SamplingParams``: the reference the sampler tests compare to."""

from __future__ import annotations

from collections.abc import Sequence

from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sampling.params import SamplingParams


def hf_processors(
    p: SamplingParams, num_prompt_tokens: int, eos_token_ids: Sequence[int] = (2,)
) -> LogitsProcessorList:
    """transformers ``generate``'s processors and warpers, in its order, for the parameters specdec
    shares with it (greedy rows: no warpers). OpenAI's presence/frequency penalties have no transformers
    counterpart."""
    procs = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(num_prompt_tokens, p.min_tokens, list(eos_token_ids)))
    if not p.greedy:
        procs.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k > 0:
            procs.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1:
            procs.append(TopPLogitsWarper(p.top_p))
        if p.min_p > 0:
            procs.append(MinPLogitsWarper(p.min_p))
    return procs
