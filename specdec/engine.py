"""The engine: requests in, one scheduler step and one forward per ``step()``, tokens out."""

from __future__ import annotations

import itertools
import logging
import numbers
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
from specdec.drafters.tree import TokenTree
from specdec.errors import ConfigError, InvalidRequestError, KVCacheExhaustedError
from specdec.kv_cache.manager import KVCacheManager, cdiv
from specdec.metrics import SpecStats
from specdec.model_runner import ModelRunner
from specdec.models.decoder import DecoderLM
from specdec.models.loader import load_model
from specdec.request import Request, RequestStatus
from specdec.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from specdec.structured import draft_bitmask, grammar_complete

if TYPE_CHECKING:
    from grammars.base import GrammarBackend

logger = logging.getLogger("specdec.engine")


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

    Raises:
        InvalidRequestError: the draft model's vocabulary differs from the target's.
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
        speculative_config: SpeculativeConfig | None = None,
        draft_model_dir: str | Path | None = None,
    ) -> None:
        self.model = model if model is not None else load_model(model_dir, dtype=dtype, device=device)
        cfg = self.model.cfg
        self.spec_config = speculative_config
        draft_model = None
        if speculative_config is not None and speculative_config.method == "draft_model":
            assert draft_model_dir is not None
            draft_dtype = resolve_dtype(speculative_config.draft_dtype or dtype)
            draft_model = load_model(draft_model_dir, dtype=draft_dtype, device=device)
            if draft_model.cfg.vocab_size != cfg.vocab_size:
                raise InvalidRequestError(
                    f"the draft model's vocabulary ({draft_model.cfg.vocab_size} tokens) differs from the "
                    f"target's ({cfg.vocab_size}); draft and target must share a tokenizer"
                )
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
            per_block = ModelRunner.kv_bytes_per_block(self.model, bs, dtype)
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
        self.runner = ModelRunner(self.model, num_blocks, bs)
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
        """Validate and queue one request (see :meth:`validate` for the errors raised)."""
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
                req.status = RequestStatus.FINISHED_ABORTED
                req.stats.finished_time = time.perf_counter()
                continue
            self.scheduler.add_request(req)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free everything it holds; unknown or finished ids are ignored."""
        if request_id in self.compiling:
            pending, fut = self.compiling.pop(request_id)
            fut.cancel()
            pending.status = RequestStatus.FINISHED_ABORTED
            return
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.compiling)

    # -------------------------------------------------------------------- step
    def step(self) -> list[Request]:
        """Schedule; draft (when speculating); run one target forward; sample or verify; append tokens.

        Returns:
            The requests that received tokens this step (finished ones included).
        """
        self._admit_compiled()
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests pending (KV pool too small?)")
            self._admit_compiled(wait=True)  # only compiling requests are left: wait for one
            return []
        self.num_steps += 1
        if self.drafter is not None:
            t0 = time.perf_counter()
            batch = [
                DraftInput(s.request, s.num_new_tokens, s.max_draft_depth, s.num_draft_slots)
                for s in out.scheduled
            ]
            for s, proposal in zip(out.scheduled, self.drafter.propose(batch)):
                self._take_proposal(s, proposal)
            if self.spec_stats is not None:
                self.spec_stats.draft_time_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        inputs = self.runner.prepare(out.scheduled)
        hidden = None
        if self.drafter_uses_hidden:
            logits, hidden = self.runner.execute_with_hidden(inputs)
        else:
            logits = self.runner.execute(inputs)
        updated = self._update(out, logits, hidden)
        if self.spec_stats is not None:
            self.spec_stats.verify_time_s += time.perf_counter() - t0
        return updated

    def _take_proposal(self, s: ScheduledRequest, proposal: DraftProposal) -> None:
        """Fit a proposal to the request's slots and depth; a tree that reduces to a chain becomes one,
        and constrained requests verify chains only (a tree's first path)."""
        tokens = list(proposal.token_ids)
        probs = proposal.draft_probs
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
        sampling = [s for s in out.scheduled if s.sample]
        results: list[VerifyResult] = []
        processed = logits
        if sampling:
            groups = [g for s in sampling for g in self._row_groups(s)]
            meta = build_sampling_metadata(groups, logits.shape[-1], logits.device)
            processed = process_logits(logits, meta)
            if not any(s.draft_token_ids for s in sampling):
                tokens = sample(
                    processed, meta.greedy, [s.request.generator for s in sampling], self.generator
                ).tolist()
                results = [VerifyResult([t], 0) for t in tokens]
            else:
                results = self._verify(sampling, processed, meta.greedy)
        logprobs = self._logprobs(sampling, results, processed)
        now = time.perf_counter()
        updated: list[Request] = []
        result_iter = iter(results)
        query_start = 0
        for s in out.scheduled:
            req = s.request
            num_drafts = len(s.draft_token_ids)
            first_position = req.num_computed_tokens
            rows_start, query_start = query_start, query_start + s.num_new_tokens + num_drafts
            req.num_computed_tokens += s.num_new_tokens + num_drafts
            if not s.sample:
                self.kv.cache_full_blocks(req)
                if hidden is not None:
                    self._observe(req, first_position, hidden[rows_start : rows_start + s.num_new_tokens])
                continue
            result = next(result_iter)
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
            updated.append(req)
            finished = False
            token_logprobs = logprobs.get(req.request_id)
            # Stop rules apply token by token inside the accepted run.
            for i, token in enumerate(result.token_ids):
                if token_logprobs is not None and req.logprobs is not None:
                    req.logprobs.append(token_logprobs[i])
                    req.cumulative_logprob += token_logprobs[i][token].logprob
                if self.append_token(req, token):
                    finished = True
                    break
            if not finished:
                self.kv.cache_full_blocks(req)
                if hidden is not None:
                    committed = list(range(rows_start, rows_start + s.num_new_tokens))
                    committed += [rows_start + s.num_new_tokens + n for n in _accepted_nodes(result)]
                    self._observe(req, first_position, hidden[committed])
                if self.drafter is not None:
                    self.drafter.on_verified(req, num_drafts, result.num_accepted)
        return updated

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
