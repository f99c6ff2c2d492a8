"""The engine: requests in, one scheduler step and one forward per ``step()``, tokens out."""

from __future__ import annotations

import itertools
import logging
import numbers
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sampling.logprobs import Logprob, token_logprobs
from sampling.params import SamplingParams
from sampling.processors import RowGroup, build_sampling_metadata, process_logits
from sampling.rejection_sampler import RejectionSampler, VerifyResult
from sampling.sampler import sample
from sampling.tree_rejection_sampler import TreeVerifyResult, verify_tree
from specdec.config import CacheConfig, SchedulerConfig, SpeculativeConfig, resolve_dtype
from specdec.drafters.base import Drafter, DraftInput, DraftProposal
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.heads import EagleHead, MedusaHeads, load_heads
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.quantized_self import quantized_self_draft_model
from specdec.drafters.tree import TokenTree
from specdec.errors import ConfigError, InvalidRequestError, KVCacheExhaustedError
from specdec.kv_cache.manager import KVCacheManager, cdiv
from specdec.metrics import SpecStats
from specdec.model_runner import ModelRunner
from specdec.models.config import ModelArchConfig
from specdec.models.decoder import DecoderLM
from specdec.models.loader import load_model
from specdec.models.packed_linear import PackedLinear, pack_linears
from specdec.quantization.config import QuantizationConfig
from specdec.request import Request, RequestStatus
from specdec.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from specdec.structured import draft_bitmask, grammar_complete

if TYPE_CHECKING:
    from grammars.base import GrammarBackend

logger = logging.getLogger("specdec.engine")

#: Test seam, see :attr:`LLMEngine.fault_injector`.
FaultInjector = Callable[[list[ScheduledRequest], torch.Tensor], None]


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


def _check_draft_vocabulary(target: ModelArchConfig, draft_model_dir: str | Path) -> None:
    """Compare the vocabulary sizes in the configs of target and draft, before loading the draft.

    Raises:
        InvalidRequestError: they differ.
    """
    draft = ModelArchConfig.from_pretrained(draft_model_dir).vocab_size
    if draft != target.vocab_size:
        raise InvalidRequestError(
            f"the draft model's vocabulary ({draft} tokens) differs from the target's ({target.vocab_size}); "
            "draft and target must share a tokenizer"
        )


def _zero_blocks(caches: object, block_ids: list[int], num_blocks: int) -> None:
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


def _accepted_nodes(result: VerifyResult) -> list[int]:
    """The accepted drafts as node indices (a chain's are 0 .. num_accepted - 1)."""
    if isinstance(result, TreeVerifyResult):
        return result.accepted_nodes
    return list(range(result.num_accepted))


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and the requests.

    Args:
        model_dir: an HF-format model directory.
        dtype: torch dtype of weights, activations and KV.
        device: where the model runs.
        cache_config, scheduler_config: see :mod:`specdec.config`.
        seed: seed of the generator used by unseeded sampled requests.
        speculative_config: the drafter and k, or None for plain decoding.
        draft_model_dir: the resolved draft model directory (``method="draft_model"``).
        quantization: weight-only quantization of the target (see :mod:`specdec.quantization`); None: none.
            ``cache_config.kv_cache_dtype`` sets the target's KV cache dtype.

    Raises:
        InvalidRequestError: the draft model's vocabulary differs from the target's (checked from the
            configs, before any weights are loaded).

    Faults: a fault that concerns one request ends that request alone (``finish_reason`` "error", the
    message in ``Request.error``), frees its blocks and leaves every other request's tokens unchanged:
    its grammar fails to compile; its logits rows, after the sampling transforms, are not finite (NaN,
    +inf, or every token at -inf; one max-reduction over the step's rows detects it); its drafter raises
    when proposing for it alone (drafts are then retried one request at a time); its draft
    distributions are not finite (its drafts are dropped for that step, the request goes on); building
    its rows' sampling metadata, committing its tokens, its grammar or its stop strings raise. Errors
    that cannot be pinned on one request (the target forward itself) propagate from :meth:`step`.

    Test seam: :attr:`fault_injector`, when set, is called after every target forward with the step's
    scheduled requests and the logits ``[R, vocab_size]`` (float32, writable in place under
    ``torch.inference_mode``; rows per request from :func:`logits_rows`), e.g. to write NaN into one
    request's rows. It costs one attribute test per
    step when unset.
    """

    #: See "Test seam" above; None in normal use.
    fault_injector: FaultInjector | None = None

    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype,
        device: torch.device,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        seed: int = 0,
        model: DecoderLM | None = None,
        speculative_config: SpeculativeConfig | None = None,
        draft_model_dir: str | Path | None = None,
        quantization: QuantizationConfig | None = None,
    ) -> None:
        # Checks that need only the configs run before any weights load.
        target_arch = model.cfg if model is not None else ModelArchConfig.from_pretrained(model_dir)
        if speculative_config is not None and speculative_config.method == "draft_model":
            assert draft_model_dir is not None
            _check_draft_vocabulary(target_arch, draft_model_dir)
        self_quantization = speculative_config.quantization_config() if speculative_config else None
        if self_quantization is not None:  # the self-drafter's group size must fit the target
            self_quantization.check_model(target_arch)
        self.model = (
            model
            if model is not None
            else load_model(model_dir, dtype=dtype, device=device, quantization=quantization)
        )
        cfg = self.model.cfg
        self.spec_config = speculative_config
        draft_model = None
        if self_quantization is not None:
            assert speculative_config is not None
            draft_dtype = resolve_dtype(speculative_config.draft_dtype or dtype)
            draft_model = quantized_self_draft_model(self.model, self_quantization, draft_dtype)
        if speculative_config is not None and speculative_config.method == "draft_model":
            assert draft_model_dir is not None
            draft_dtype = resolve_dtype(speculative_config.draft_dtype or dtype)
            draft_model = load_model(draft_model_dir, dtype=draft_dtype, device=device)
        heads = None
        if speculative_config is not None and speculative_config.method in ("medusa", "eagle"):
            if draft_model_dir is None:
                raise ConfigError(
                    f"speculative method {speculative_config.method!r} needs its heads' directory"
                )
            heads_dtype = resolve_dtype(speculative_config.draft_dtype or dtype)
            heads, _ = load_heads(str(draft_model_dir), cfg, speculative_config.method, heads_dtype, device)
        self.model_cfg = cfg
        self.max_model_len = min(
            scheduler_config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        bs = cache_config.block_size
        num_blocks = cache_config.num_kv_blocks
        if num_blocks is None:
            per_block = ModelRunner.kv_bytes_per_block(self.model, bs, dtype, cache_config.kv_cache_dtype)
            if draft_model is not None:
                per_block += ModelRunner.kv_bytes_per_block(
                    draft_model, bs, next(draft_model.parameters()).dtype
                )
            if isinstance(heads, EagleHead):
                per_block += EagleDrafter.kv_bytes_per_block(heads, bs, next(heads.parameters()).dtype)
            wanted = scheduler_config.max_num_seqs * cdiv(self.max_model_len, bs)
            num_blocks = max(1, min(wanted, cache_config.kv_cache_memory_bytes // per_block))
        self.num_kv_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, bs, cache_config.enable_prefix_caching)
        self.num_speculative_tokens = speculative_config.num_speculative_tokens if speculative_config else 0
        #: KV slots a drafting request reserves per step (k for chains, the tree size for trees).
        self.num_draft_slots = speculative_config.num_draft_slots if speculative_config else 0
        self.scheduler = Scheduler(
            scheduler_config, self.kv, self.max_model_len, self.num_speculative_tokens, self.num_draft_slots
        )
        self.runner = ModelRunner(self.model, num_blocks, bs, kv_cache_dtype=cache_config.kv_cache_dtype)
        self.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        self.drafter: Drafter | None = None
        if speculative_config is not None:
            if draft_model is not None:
                self.drafter = DraftModelDrafter(draft_model, cfg.vocab_size, num_blocks, bs, self.generator)
            elif isinstance(heads, MedusaHeads):
                self.drafter = MedusaDrafter(self.model, heads, speculative_config)
            elif isinstance(heads, EagleHead):
                self.drafter = EagleDrafter(self.model, heads, speculative_config, num_blocks, bs)
            else:
                self.drafter = NgramDrafter(speculative_config)
        #: The drafter reads the target's features (Medusa, EAGLE): every forward returns them.
        self.drafter_uses_hidden = bool(getattr(self.drafter, "uses_hidden_states", False))
        # bfloat16 on the CPU: weights pre-packed for oneDNN (faster decode, identical outputs). Last, so
        # that drafters built from the target's weights (quantized_self) read them in their dense form.
        packed: dict[int, PackedLinear] = {}  # modules the draft model shares with the target pack once
        pack_linears(self.model, packed)
        if draft_model is not None:
            pack_linears(draft_model, packed)
        self.rejection_sampler = RejectionSampler()
        self.spec_stats: SpecStats | None = None
        self.reset_spec_stats()
        self._arrivals = itertools.count()
        self.num_steps = 0
        #: Token ids -> text, for stop strings (set by ``LLM`` from its tokenizer).
        self.detokenize: Callable[[list[int]], str] | None = None
        #: Compiles grammar specs (set by ``LLM`` from its tokenizer); None: constrained decoding is off.
        self.grammar_backend: GrammarBackend | None = None
        #: Constrained requests whose grammar is still compiling (admitted by ``step`` when ready).
        self.compiling: dict[str, tuple[Request, Future]] = {}
        # ``step`` holds the lock: an abort from another thread waits for the step to end, one from inside
        # the step (a drafter, the fault injector) is applied when it ends.
        self._step_lock = threading.RLock()
        self._in_step = False
        self._deferred_aborts: list[str] = []
        #: Requests ended by a fault (``finish_reason`` "error") since the engine was built.
        self.num_failed_requests = 0

    def reset_spec_stats(self) -> None:
        """Zero the aggregate acceptance counters (None when speculation is off)."""
        k = self.num_speculative_tokens
        self.spec_stats = SpecStats(k) if k else None

    # ---------------------------------------------------------------- requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check one request before any work.

        Raises:
            InvalidRequestError: empty prompt, prompt of ``max_model_len`` tokens or more, token ids
                outside ``[0, vocab_size)``, params that are not a ``SamplingParams``, stop token ids
                outside the vocabulary, or stop strings without a tokenizer.
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
        bad_stops = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stops:
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab}); got {bad_stops[:5]}")
        if params.stop_strings and self.detokenize is None:
            raise InvalidRequestError("stop strings need a tokenizer (skip_tokenizer_init=True was given)")
        if params.grammar_spec is not None:
            if self.grammar_backend is None:
                raise InvalidRequestError(
                    "json_schema / regex / choice need a tokenizer (skip_tokenizer_init=True was given)"
                )
            schema = params.schema
            if schema is not None:
                from grammars.schema import check_schema

                check_schema(schema, strict=params.strict)  # UnsupportedSchemaError when strict
        total = min(n + params.max_tokens, self.max_model_len)
        # The last generated token ends the request before its KV is ever written; a verification
        # step may also reserve slots for num_speculative_tokens drafts past the committed tokens.
        need = cdiv(total - 1 + self.num_draft_slots, self.kv.block_size)
        if need > self.num_kv_blocks:
            raise KVCacheExhaustedError(
                f"this request can need {need} KV blocks ({total - 1} tokens) but the pool has only "
                f"{self.num_kv_blocks}; raise num_kv_blocks or lower max_tokens"
            )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Validate and queue one request (see :meth:`validate` for the errors raised). From another
        thread it waits for a running step to end."""
        with self._step_lock:
            return self._add_request(request_id, prompt_token_ids, params)

    def _add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        self.validate(prompt_token_ids, params)
        if params.n != 1:
            raise InvalidRequestError("the engine takes one sequence per request; LLM.generate expands n > 1")
        if request_id in self.scheduler.requests or request_id in self.compiling:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = Request(
            request_id,
            [int(t) for t in prompt_token_ids],
            params,
            next(self._arrivals),
            self.model_cfg.eos_token_ids,
        )
        if self.num_speculative_tokens:
            req.spec_stats = SpecStats(self.num_speculative_tokens)
        spec = params.grammar_spec
        if spec is not None and self.grammar_backend is not None:
            # Compiled off the engine thread; the request joins the scheduler once its grammar is ready.
            self.compiling[request_id] = (req, self.grammar_backend.compile_async(spec))
            self._admit_compiled()
        else:
            self.scheduler.add_request(req)
        return req

    def _admit_compiled(self, wait: bool = False) -> None:
        """Hand requests whose grammar finished compiling to the scheduler (``wait``: block for one).

        A grammar that fails to compile aborts its request only, with ``request.error`` set.
        """
        if not self.compiling:
            return
        if wait:
            futures.wait([f for _, f in self.compiling.values()], return_when=futures.FIRST_COMPLETED)
        for rid, (req, fut) in list(self.compiling.items()):
            if not fut.done():
                continue
            del self.compiling[rid]
            try:
                req.grammar = fut.result().matcher()
            except Exception as e:  # a compile error or limit: this request ends, the others go on
                logger.warning("request %s: grammar compilation failed: %s", rid, e)
                req.error = f"{type(e).__name__}: {e}"
                req.status = RequestStatus.FINISHED_ERROR
                req.stats.finished_time = time.perf_counter()
                self.num_failed_requests += 1
                continue
            # Priority is the order of entry into the scheduler (see specdec.scheduler).
            req.arrival_index = next(self._arrivals)
            self.scheduler.add_request(req)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free everything it holds; unknown or finished ids are ignored.

        Safe at any time: between steps it takes effect at once; from inside a step (a drafter, the
        fault injector) it takes effect when the step ends (the request may still receive that step's
        tokens); from another thread it waits for the running step to end.
        """
        with self._step_lock:
            if self._in_step:
                self._deferred_aborts.append(request_id)
                return
            if request_id in self.compiling:
                pending, fut = self.compiling.pop(request_id)
                fut.cancel()
                pending.status = RequestStatus.FINISHED_ABORTED
                pending.stats.finished_time = time.perf_counter()
                return
            req = self.scheduler.requests.get(request_id)
            if req is not None:
                req.stats.finished_time = time.perf_counter()
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def _fail(self, req: Request, message: str, scrub_kv: bool = False) -> None:
        """End ``req`` alone because of a fault: ``finish_reason`` "error", ``req.error`` = ``message``,
        every block freed. ``scrub_kv``: first zero the K/V of the blocks only it holds, so that NaN or
        infinity written by its forward cannot reach a later request through stale (masked) slots."""
        if req.status.finished:
            return
        logger.warning("request %s ended by a fault: %s", req.request_id, message)
        req.error = message
        if scrub_kv:
            pool = self.kv.pool
            private = [b for b in req.block_ids[req.num_cached_blocks :] if pool.blocks[b].ref_count == 1]
            if private:
                _zero_blocks(self.runner.kv_caches, private, self.num_kv_blocks)
        req.stats.finished_time = time.perf_counter()
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        self.num_failed_requests += 1

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.compiling)

    # -------------------------------------------------------------------- step
    def step(self) -> list[Request]:
        """Schedule; draft (when speculating); run one target forward; sample or verify; append tokens.

        A fault of one request ends that request alone (see the class docstring); aborts asked for during
        the step are applied when it ends.

        Returns:
            The requests that received tokens or ended this step (finished ones included).
        """
        with self._step_lock:
            self._in_step = True
            try:
                return self._step()
            finally:
                self._in_step = False
                aborts, self._deferred_aborts = self._deferred_aborts, []
                for rid in aborts:
                    self.abort_request(rid)

    def _step(self) -> list[Request]:
        self._admit_compiled()
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests pending (KV pool too small?)")
            self._admit_compiled(wait=True)  # only compiling requests are left: wait for one
            return []
        self.num_steps += 1
        failed: list[Request] = []
        if self.drafter is not None:
            t0 = time.perf_counter()
            self._draft(out.scheduled)
            failed = [s.request for s in out.scheduled if s.request.status.finished]
            if failed:  # ended while drafting: not in the forward (their blocks are free already)
                out.scheduled = [s for s in out.scheduled if not s.request.status.finished]
            if self.spec_stats is not None:
                self.spec_stats.draft_time_s += time.perf_counter() - t0
            if not out.scheduled:
                return failed
        t0 = time.perf_counter()
        inputs = self.runner.prepare(out.scheduled)
        hidden = None
        if self.drafter_uses_hidden:
            logits, hidden = self.runner.execute_with_hidden(inputs)
        else:
            logits = self.runner.execute(inputs)
        if self.fault_injector is not None:
            with torch.inference_mode():
                self.fault_injector(out.scheduled, logits)
        updated = self._update(out, logits, hidden)
        if self.spec_stats is not None:
            self.spec_stats.verify_time_s += time.perf_counter() - t0
        return failed + updated

    def _draft(self, scheduled: list[ScheduledRequest]) -> None:
        """Ask the drafter for every scheduled request's drafts. If the batched call raises, each request
        is asked alone, and a request whose drafter raises alone is ended (drafts are optional: the
        others verify what they got, or nothing). Requests whose proposal cannot be fitted end too."""
        assert self.drafter is not None
        batch = [
            DraftInput(s.request, s.num_new_tokens, s.max_draft_depth, s.num_draft_slots) for s in scheduled
        ]
        proposals: list[DraftProposal | None]
        try:
            proposals = list(self.drafter.propose(batch))
        except Exception as batch_error:
            logger.warning(
                "drafter failed on a batch of %d (%s); drafting one by one", len(batch), batch_error
            )
            proposals = []
            for s, x in zip(scheduled, batch):
                try:
                    proposals.append(self.drafter.propose([x])[0])
                except Exception as e:
                    self._fail(s.request, f"drafter failed: {type(e).__name__}: {e}")
                    proposals.append(None)
        for s, proposal in zip(scheduled, proposals):
            if proposal is None:
                continue
            try:
                self._take_proposal(s, proposal)
            except Exception as e:
                self._fail(s.request, f"drafts cannot be verified: {type(e).__name__}: {e}")

    def _take_proposal(self, s: ScheduledRequest, proposal: DraftProposal) -> None:
        """Fit a proposal to the request's slots and depth; a tree that reduces to a chain becomes one,
        and constrained requests verify chains only (a tree's first path)."""
        tokens = list(proposal.token_ids)
        probs = proposal.draft_probs
        if probs is not None and tokens and not bool(torch.isfinite(probs[: len(tokens)]).all()):
            # The drafter's distributions are broken: verify no drafts this step (exact either way).
            logger.warning("request %s: non-finite draft probabilities; drafts dropped", s.request.request_id)
            tokens, probs = [], None
        if proposal.parents is not None:
            if probs is not None:
                raise ValueError("token-tree proposals must be deterministic (draft_probs None)")
            tree = TokenTree(tuple(tokens), tuple(proposal.parents))
            tree = tree.truncated(s.num_draft_slots, s.max_draft_depth)
            if s.request.grammar is not None:
                tree = tree.first_path()
            tokens = list(tree.token_ids)
            s.draft_tree = None if tree.is_chain else tree
        else:
            tokens = tokens[: s.max_draft_depth]
        grammar = s.request.grammar
        if grammar is not None and tokens:  # drafts end at the first forbidden one
            tokens = tokens[: grammar.validate_tokens(tokens)]
        s.draft_token_ids = tokens
        s.draft_probs = None if probs is None else probs[: len(tokens)]

    def _row_groups(self, s: ScheduledRequest) -> list[RowGroup]:
        """The verification rows of a request: one group for a chain; for a tree, one row per node, each
        with its own path as the draft prefix (penalties see the path, not the other branches)."""
        req, tree = s.request, s.draft_tree
        if tree is None:
            return [self._row_group(req, s.draft_token_ids, 1 + len(s.draft_token_ids))]
        groups = [self._row_group(req, [], 1)]
        groups.extend(self._row_group(req, tree.path_tokens(i), 1) for i in range(tree.num_nodes))
        return groups

    def _row_group(self, req: Request, draft_token_ids: list[int], num_rows: int) -> RowGroup:
        bitmask = None
        if req.grammar is not None:
            bitmask = draft_bitmask(req.grammar, draft_token_ids, num_rows, self.model_cfg.vocab_size)
        return RowGroup(
            req.sampling_params,
            req.token_ids,
            req.num_prompt_tokens,
            req.stop_ids,
            draft_token_ids,
            num_rows,
            bitmask,
        )

    def _update(
        self, out: SchedulerOutput, logits: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> list[Request]:
        """Turn the logits rows into tokens: a plain sample, or verification of the drafts.

        Every row is first processed (penalties, masks, temperature, top-k/p, min-p) with its own
        prefix; the processed rows are what sampling, verification and ``logprobs`` use. A token tree's
        accepted path is then compacted: its K/V moves to the slots right after the committed tokens
        and every other node's slot is released. ``hidden`` (``[T, hidden_size]``, when the drafter reads
        features) gives the drafter the features of the committed tokens computed this step.
        """
        sampling, processed, greedy = self._process(out.scheduled, logits)
        results: list[VerifyResult] = []
        if sampling:
            if not any(s.draft_token_ids for s in sampling):
                tokens = sample(processed, greedy, [s.request.generator for s in sampling], self.generator)
                results = [VerifyResult([t], 0) for t in tokens.tolist()]
            else:
                results = self._verify(sampling, processed, greedy)
        logprobs = self._logprobs(sampling, results, processed)
        result_of = {id(s): r for s, r in zip(sampling, results)}
        now = time.perf_counter()
        updated: list[Request] = []
        query_start = 0
        for s in out.scheduled:
            req = s.request
            rows_start = query_start
            query_start += s.num_new_tokens + len(s.draft_token_ids)
            if req.status.finished:  # ended by a fault this step (its blocks are free already)
                updated.append(req)
                continue
            try:
                if self._commit(s, result_of.get(id(s)), rows_start, hidden, logprobs, now):
                    updated.append(req)
            except Exception as e:
                logger.exception("request %s: committing its tokens failed", req.request_id)
                self._fail(req, f"{type(e).__name__}: {e}")
                if req not in updated:
                    updated.append(req)
        return updated

    def _process(
        self, scheduled: list[ScheduledRequest], logits: torch.Tensor
    ) -> tuple[list[ScheduledRequest], torch.Tensor, list[bool]]:
        """Process the sampling requests' logits rows (:func:`sampling.processors.process_logits`) and end
        the requests whose rows cannot be sampled from.

        One max-reduction over the processed rows finds rows that are not finite: NaN anywhere (NaN
        propagates through ``amax``), +inf, or every token at -inf (nothing left to sample). Their requests
        end with an error and are left out; so are requests whose rows' metadata cannot be built (found by
        building it request by request, only after the batched build raised).

        Returns:
            ``(sampling, processed, greedy)``: the sampling requests left, their processed rows ``[R',
            vocab_size]`` (1 + drafts rows each, in order) and each row's greedy flag.
        """
        everyone = [s for s in scheduled if s.sample]
        if not everyone:
            return [], logits, []
        rows = logits_rows(scheduled)

        def process(batch: list[ScheduledRequest]) -> tuple[torch.Tensor, list[bool]]:
            groups = [g for s in batch for g in self._row_groups(s)]
            meta = build_sampling_metadata(groups, logits.shape[-1], logits.device)
            x = logits
            if len(batch) != len(everyone):
                index = [r for s in batch for r in rows[s.request.request_id]]
                x = logits[torch.tensor(index, device=logits.device)]
            return process_logits(x, meta), list(meta.greedy)

        sampling = everyone
        try:
            processed, greedy = process(sampling)
        except Exception:
            survivors = []
            for s in sampling:
                try:
                    process([s])
                    survivors.append(s)
                except Exception as e:
                    self._fail(s.request, f"cannot process its logits: {type(e).__name__}: {e}")
            if len(survivors) == len(sampling):
                raise  # not the fault of one request
            sampling = survivors
            if not sampling:
                return [], logits[:0], []
            processed, greedy = process(sampling)
        row_max = processed.amax(dim=-1)
        finite = torch.isfinite(row_max)
        if bool(finite.all()):
            return sampling, processed, greedy
        finite_rows = finite.tolist()
        keep: list[int] = []
        kept: list[ScheduledRequest] = []
        start = 0
        for s in sampling:
            n = 1 + len(s.draft_token_ids)
            if all(finite_rows[start : start + n]):
                keep.extend(range(start, start + n))
                kept.append(s)
            else:
                bad = [start + i for i in range(n) if not finite_rows[start + i]]
                self._fail(
                    s.request,
                    f"non-finite logits: {len(bad)} of its {n} rows have NaN, +inf or no token left after "
                    "the sampling transforms (a numeric overflow in the model, or from extreme sampling "
                    "parameters)",
                    scrub_kv=True,
                )
            start += n
        index = torch.tensor(keep, dtype=torch.int64, device=processed.device)
        return kept, processed[index], [greedy[i] for i in keep]

    def _commit(
        self,
        s: ScheduledRequest,
        result: VerifyResult | None,
        rows_start: int,
        hidden: torch.Tensor | None,
        logprobs: dict[str, list[dict[int, Logprob]]],
        now: float,
    ) -> bool:
        """Advance one request past this step's forward: roll back rejected drafts, append the emitted
        tokens under the stop rules, register full blocks, feed the drafter. Returns whether it emitted."""
        req = s.request
        num_drafts = len(s.draft_token_ids)
        first_position = req.num_computed_tokens
        req.num_computed_tokens += s.num_new_tokens + num_drafts
        if not s.sample:
            self.kv.cache_full_blocks(req)
            if hidden is not None:
                self._observe(req, first_position, hidden[rows_start : rows_start + s.num_new_tokens])
            return False
        assert result is not None
        if s.draft_tree is not None:
            self._compact(req, first_position + s.num_new_tokens, _accepted_nodes(result))
        # Rejected drafts' KV is rolled back; unused draft slots are released.
        self.kv.rollback(req, num_drafts - result.num_accepted)
        if req.spec_stats is not None:
            req.spec_stats.observe(num_drafts, result.num_accepted)
        if self.spec_stats is not None:
            self.spec_stats.observe(num_drafts, result.num_accepted)
        if req.stats.first_token_time is None:
            req.stats.first_token_time = now
        token_logprobs = logprobs.get(req.request_id)
        # Stop rules apply token by token inside the accepted run.
        for i, token in enumerate(result.token_ids):
            if token_logprobs is not None and req.logprobs is not None:
                req.logprobs.append(token_logprobs[i])
                req.cumulative_logprob += token_logprobs[i][token].logprob
            if self.append_token(req, token):
                return True
        self.kv.cache_full_blocks(req)
        if hidden is not None:
            committed = list(range(rows_start, rows_start + s.num_new_tokens))
            committed += [rows_start + s.num_new_tokens + n for n in _accepted_nodes(result)]
            self._observe(req, first_position, hidden[committed])
        if self.drafter is not None:
            self.drafter.on_verified(req, num_drafts, result.num_accepted)
        return True

    def _observe(self, req: Request, start_position: int, hidden: torch.Tensor) -> None:
        self.drafter.observe(req, start_position, hidden)  # type: ignore[union-attr]

    def _verify(
        self, sampling: list[ScheduledRequest], processed: torch.Tensor, greedy_rows: list[bool]
    ) -> list[VerifyResult]:
        """Chains go through the rejection sampler together; each token tree through tree verification."""
        # Greedy rows keep their processed logits (only their argmax is read).
        greedy_mask = torch.tensor(greedy_rows, device=processed.device)[:, None]
        target_probs = torch.where(greedy_mask, processed, torch.softmax(processed, dim=-1))
        results: list[VerifyResult | None] = [None] * len(sampling)
        chain_rows: list[int] = []
        chains: list[int] = []
        start = 0
        for j, s in enumerate(sampling):
            n_rows = 1 + len(s.draft_token_ids)
            req = s.request
            if s.draft_tree is None:
                chains.append(j)
                chain_rows.extend(range(start, start + n_rows))
            else:
                gen = req.generator if req.generator is not None else self.generator
                results[j] = verify_tree(
                    target_probs[start : start + n_rows], s.draft_tree, req.sampling_params.greedy, gen
                )
            start += n_rows
        if chains:
            rows = target_probs if len(chain_rows) == start else target_probs[torch.tensor(chain_rows)]
            chain_results = self.rejection_sampler.verify(
                rows,
                [sampling[j].draft_token_ids for j in chains],
                [sampling[j].draft_probs for j in chains],
                [sampling[j].request.sampling_params.greedy for j in chains],
                [sampling[j].request.generator for j in chains],
                self.generator,
            )
            for j, res in zip(chains, chain_results):
                results[j] = res
        return [r for r in results if r is not None]

    def _compact(self, req: Request, first_draft_position: int, accepted_nodes: list[int]) -> None:
        """Move the accepted tree path's K/V onto consecutive slots after the committed tokens."""
        src, dst = [], []
        for depth, node in enumerate(accepted_nodes):
            if node != depth:
                src.append(self.kv.slot(req, first_draft_position + node))
                dst.append(self.kv.slot(req, first_draft_position + depth))
        self.runner.copy_slots(src, dst)

    def _logprobs(
        self, sampling: list[ScheduledRequest], results: list[VerifyResult], processed: torch.Tensor
    ) -> dict[str, list[dict[int, Logprob]]]:
        """Log-probabilities of every emitted token of the requests that asked for them: the token
        emitted after j accepted drafts is scored under the verification row it was emitted from (row j of
        a chain; the root or the j-th accepted node of a tree): whatever the drafter, the emitted token
        follows the target's processed distribution there."""
        rows: list[int] = []
        tokens: list[int] = []
        num_top: list[int] = []
        owners: list[tuple[str, int]] = []
        start = 0
        for s, res in zip(sampling, results):
            n = s.request.sampling_params.logprobs
            if n is not None:
                emitted_rows = [0] + [1 + node for node in _accepted_nodes(res)]
                rows.extend(start + r for r in emitted_rows[: len(res.token_ids)])
                tokens.extend(res.token_ids)
                num_top.extend([n] * len(res.token_ids))
                owners.append((s.request.request_id, len(res.token_ids)))
            start += 1 + len(s.draft_token_ids)
        if not rows:
            return {}
        flat = token_logprobs(processed[torch.tensor(rows, device=processed.device)], tokens, num_top)
        out: dict[str, list[dict[int, Logprob]]] = {}
        i = 0
        for rid, n in owners:
            out[rid] = flat[i : i + n]
            i += n
        return out

    def _stop_string(self, req: Request) -> bool:
        """Whether the newest token completed one of the request's stop strings (records which)."""
        stops = req.sampling_params.stop_strings
        if not stops or self.detokenize is None or req.num_output_tokens < req.sampling_params.min_tokens:
            return False
        text = self.detokenize(req.output_token_ids)
        # Only occurrences that end in the newest token's text are new; search just before it.
        prev_len = req.checked_text_len
        req.checked_text_len = len(text)
        best: tuple[int, str] | None = None
        for stop in stops:
            idx = text.find(stop, max(0, prev_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        req.stop_text_offset, req.stop_reason = best
        return True

    def append_token(self, req: Request, token: int) -> bool:
        """Append one token and apply the stop rules; returns True when the request finished.

        Raises:
            RuntimeError: the request's grammar rejects the token (a bug: every row is masked).
        """
        req.token_ids.append(token)
        params = req.sampling_params
        status = None
        if req.grammar is not None and not req.grammar.accept_token(token):
            raise RuntimeError(f"request {req.request_id}: the grammar rejected emitted token {token}")
        if token in req.stop_ids:
            status = RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
        elif self._stop_string(req) or (
            req.grammar is not None
            and grammar_complete(req.grammar, self.model_cfg.eos_token_ids, self.model_cfg.vocab_size)
        ):
            status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            req.stats.finished_time = time.perf_counter()
            self.scheduler.finish(req, status)
            return True
        return False
