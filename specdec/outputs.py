"""What ``LLM.generate`` returns (named as in vLLM's offline API)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sampling.logprobs import Logprob


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: index among the prompt's samples.
        token_ids: generated token ids (prompt excluded), ending at the first stop token.
        text: detokenized ``token_ids`` ("" when the tokenizer was skipped).
        finish_reason: "stop" (EOS, a stop token, a stop string or a completed grammar), "length"
            (``max_tokens`` or ``max_model_len``), "abort" (``LLMEngine.abort_request``, or the caller
            stopped iterating a stream), "error" (the engine ended this request alone because of a fault:
            see ``error``), or None while running.
        new_token_ids: tokens added since the last streamed chunk (streaming only).
        logprobs: with ``SamplingParams.logprobs`` set, per generated token a dict token id ->
            :class:`~sampling.logprobs.Logprob` (the chosen token and the top N); else None.
        cumulative_logprob: sum of the chosen tokens' log-probabilities (None without ``logprobs``).
        stop_reason: the stop string or stop token id that ended generation (None for EOS or length).
        schema_valid: with ``SamplingParams.json_schema``, whether the finished text parses and validates
            with ``jsonschema`` (False also when ``max_tokens`` cut it short); else None.
        error: with ``finish_reason == "error"``, what went wrong, e.g. ``"GrammarCompileError: ..."`` (its
            grammar failed to compile), ``"non-finite logits: ..."`` (NaN or infinity in its logits rows,
            e.g. from a numeric overflow), or the exception its drafter or grammar raised; the tokens
            generated before the fault are kept. None otherwise. Every other request of the batch is
            unaffected.
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    schema_valid: bool | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    """The result for one prompt.

    Attributes:
        request_id: the engine's id for the request. ``LLM`` numbers requests "0", "1", ... over its whole
            life (ids count up across calls, so the second call's first prompt is not "0"); with ``n`` > 1
            the samples are engine requests ``"<request_id>-0"``, ``"<request_id>-1"``, ...
        prompt: the prompt string, if one was given (None for token ids and for ``LLM.chat``).
        prompt_token_ids: the prompt's token ids.
        outputs: the generated sequences (``SamplingParams.n`` of them).
        finished: whether generation has ended.
        metrics: per-request figures: ``num_prompt_tokens``, ``num_generated_tokens``,
            ``num_cached_prompt_tokens`` (prefix-cache hits), ``num_preemptions``,
            ``time_to_first_token_s``, ``latency_s``, ``tokens_per_s``; with speculation also the
            request's acceptance counters and figures (:class:`specdec.metrics.SpecStats`: ``num_drafts``,
            ``num_draft_tokens``, ``num_draft_nodes``, ``num_accepted_tokens``, ``accepted_per_position``,
            ``drafted_per_position``, ``acceptance_rate``, ``acceptance_rate_per_position``,
            ``mean_acceptance_length``, ``num_steps``, ``tokens_per_step``). With ``n`` > 1 they are the
            first sample's (``outputs[0]``) alone, not a sum or mean over the samples;
            ``llm.engine.spec_stats`` aggregates every sample.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, Any] = field(default_factory=dict)
