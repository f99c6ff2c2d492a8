"""The engine: requests in, one scheduler step and one forward per ``step()``, tokens out."""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from pathlib import Path

import torch

from sampling.params import SamplingParams
from sampling.sampler import sample
from specdec.config import CacheConfig, SchedulerConfig
from specdec.errors import InvalidRequestError, KVCacheExhaustedError
from specdec.kv_cache.manager import KVCacheManager, cdiv
from specdec.model_runner import ModelRunner
from specdec.models.decoder import DecoderLM
from specdec.models.loader import load_model
from specdec.request import Request, RequestStatus
from specdec.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger("specdec.engine")


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and the requests.

    Args:
        model_dir: an HF-format model directory.
        dtype: torch dtype of weights, activations and KV.
        device: where the model runs.
        cache_config, scheduler_config: see :mod:`specdec.config`.
        seed: seed of the generator used by unseeded sampled requests.
    """

    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype,
        device: torch.device,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        seed: int = 0,
        model: DecoderLM | None = None,
    ) -> None:
        self.model = model if model is not None else load_model(model_dir, dtype=dtype, device=device)
        cfg = self.model.cfg
        self.model_cfg = cfg
        self.max_model_len = min(
            scheduler_config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        bs = cache_config.block_size
        num_blocks = cache_config.num_kv_blocks
        if num_blocks is None:
            per_block = ModelRunner.kv_bytes_per_block(self.model, bs, dtype)
            wanted = scheduler_config.max_num_seqs * cdiv(self.max_model_len, bs)
            num_blocks = max(1, min(wanted, cache_config.kv_cache_memory_bytes // per_block))
        self.num_kv_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, bs, cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.kv, self.max_model_len)
        self.runner = ModelRunner(self.model, num_blocks, bs)
        self.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        self._arrivals = itertools.count()
        self.num_steps = 0

    # ---------------------------------------------------------------- requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check one request before any work.

        Raises:
            InvalidRequestError: empty prompt, prompt of ``max_model_len`` tokens or more, token ids
                outside ``[0, vocab_size)``, or params that are not a ``SamplingParams``.
            KVCacheExhaustedError: the request alone needs more KV blocks than the pool has.
        """
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        params.validate()  # fields may have been changed since construction
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but max_model_len is {self.max_model_len}: "
                "it must leave room for at least one generated token"
            )
        vocab = self.model_cfg.vocab_size
        bad = [
            t
            for t in prompt_token_ids
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab
        ]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        total = min(n + params.max_tokens, self.max_model_len)
        # The last generated token ends the request before its KV is ever written.
        need = cdiv(total - 1, self.kv.block_size)
        if need > self.num_kv_blocks:
            raise KVCacheExhaustedError(
                f"this request can need {need} KV blocks ({total - 1} tokens) but the pool has only "
                f"{self.num_kv_blocks}; raise num_kv_blocks or lower max_tokens"
            )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Validate and queue one request (see :meth:`validate` for the errors raised)."""
        self.validate(prompt_token_ids, params)
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = Request(
            request_id,
            [int(t) for t in prompt_token_ids],
            params,
            next(self._arrivals),
            self.model_cfg.eos_token_ids,
        )
        self.scheduler.add_request(req)
        return req

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free everything it holds; unknown or finished ids are ignored."""
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -------------------------------------------------------------------- step
    def step(self) -> list[Request]:
        """Schedule, run one forward, sample and append tokens.

        Returns:
            The requests that received tokens this step (finished ones included).
        """
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests pending (KV pool too small?)")
            return []
        self.num_steps += 1
        inputs = self.runner.prepare(out.scheduled)
        logits = self.runner.execute(inputs)
        return self._update(out, logits)

    def _update(self, out: SchedulerOutput, logits: torch.Tensor) -> list[Request]:
        sampling = [s for s in out.scheduled if s.sample]
        tokens: list[int] = []
        if sampling:
            params = [s.request.sampling_params for s in sampling]
            tokens = sample(
                logits,
                [p.temperature for p in params],
                [p.greedy for p in params],
                [s.request.generator for s in sampling],
                self.generator,
            ).tolist()
        now = time.perf_counter()
        updated: list[Request] = []
        token_iter = iter(tokens)
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(req)
            if not s.sample:
                continue
            if req.stats.first_token_time is None:
                req.stats.first_token_time = now
            self.append_token(req, next(token_iter))
            updated.append(req)
        return updated

    def append_token(self, req: Request, token: int) -> bool:
        """Append one token and apply the stop rules; returns True when the request finished."""
        req.token_ids.append(token)
        params = req.sampling_params
        status = None
        if token in req.stop_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            req.stats.finished_time = time.perf_counter()
            self.scheduler.finish(req, status)
            return True
        return False
