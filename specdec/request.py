"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sampling.logprobs import Logprob
from sampling.params import SamplingParams
from specdec.metrics import SpecStats

if TYPE_CHECKING:
    from grammars.base import Grammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    #: Ended by the engine because of a fault of this request alone (``Request.error`` says which).
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestStats:
    """Timings (seconds, ``time.perf_counter``) and counters of one request."""

    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0


class Request:
    """One sequence being generated.

    ``token_ids`` is prompt + output so far; the KV of its first ``num_computed_tokens`` tokens is in the
    cache, in the blocks of ``block_ids`` (the request's block table). ``block_hashes`` are the chained
    hashes of its full blocks, computed once; ``num_cached_blocks`` of them are registered in the prefix
    cache. Under a sliding window the first ``num_released_blocks`` table entries may be
    :data:`~specdec.kv_cache.manager.RELEASED` (blocks no later query can read, given back to the pool).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_index: int,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        #: Scheduling priority: order of entry into the scheduler (smaller is older; see specdec.scheduler).
        self.arrival_index = arrival_index
        self.stop_ids = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else frozenset(eos_token_ids)
        )
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.num_released_blocks = 0
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)
        self.stats = RequestStats()
        self.num_streamed_tokens = 0
        #: Acceptance counters when speculative decoding is on.
        self.spec_stats: SpecStats | None = None
        #: A drafter's own per-request counters (the hybrid's per member, suffix decoding's), or None.
        self.drafter_metrics: dict | None = None
        #: Per generated token, its log-probabilities (``sampling_params.logprobs`` set), and their sum.
        self.logprobs: list[dict[int, Logprob]] | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        #: The stop string that ended the request, and where it starts in the decoded output text.
        self.stop_reason: str | int | None = None
        self.stop_text_offset: int | None = None
        #: Length of the output text already searched for stop strings.
        self.checked_text_len = 0
        #: The request's grammar matcher (constrained decoding), fed exactly the committed output tokens.
        self.grammar: Grammar | None = None
        #: Why the engine ended the request (status ``FINISHED_ERROR``): its grammar failed to compile, its
        #: logits were not finite, its drafter or grammar raised. None otherwise.
        self.error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
