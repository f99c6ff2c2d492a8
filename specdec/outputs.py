"""What ``LLM.generate`` returns (named as in vLLM's offline API)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: index among the prompt's samples.
        token_ids: generated token ids (prompt excluded), ending at the first stop token.
        text: detokenized ``token_ids`` ("" when the tokenizer was skipped).
        finish_reason: "stop" (EOS or a stop token), "length" (``max_tokens`` or ``max_model_len``),
            "abort", or None while running.
        new_token_ids: tokens added since the last streamed chunk (streaming only).
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """The result for one prompt.

    Attributes:
        request_id: the engine's id for the request.
        prompt: the prompt string, if one was given.
        prompt_token_ids: the prompt's token ids.
        outputs: the generated sequences.
        finished: whether generation has ended.
        metrics: per-request figures: ``num_prompt_tokens``, ``num_generated_tokens``,
            ``num_cached_prompt_tokens`` (prefix-cache hits), ``num_preemptions``,
            ``time_to_first_token_s``, ``latency_s``, ``tokens_per_s``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, Any] = field(default_factory=dict)
