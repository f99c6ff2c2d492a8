"""The engine: requests in, one scheduler step and one forward per :meth:`LLMEngine.step`, tokens out.

One step reads top to bottom in :meth:`LLMEngine._step`: admit → schedule → propose → forward →
process and verify → commit. Each stage lives in its own module of this package (``admission``,
``proposals``, ``verification``, ``commit``; building in ``build``, fault isolation in ``faults``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sampling.params import SamplingParams
from sampling.verifier import SpeculativeVerifier, Verifier
from specdec.config import CacheConfig, CompilationConfig, SchedulerConfig, SpeculativeConfig
from specdec.drafters.base import Drafter
from specdec.engine import faults
from specdec.engine.admission import GrammarAdmission, validate_request
from specdec.engine.build import EngineParts, build_engine_parts, build_scheduler
from specdec.engine.commit import commit_all
from specdec.engine.cost_profile import draft_model_costs, step_costs
from specdec.engine.grammar_masks import MaskPrefetch
from specdec.engine.policy_step import apply_policy, observe_policy
from specdec.engine.proposals import propose_drafts
from specdec.engine.threads import ThreadPolicy
from specdec.engine.verification import emitted_logprobs, process_rows, sample_or_verify
from specdec.errors import InvalidRequestError
from specdec.metrics import SpecStats
from specdec.models.decoder import DecoderLM
from specdec.policies.base import SpeculationPolicy
from specdec.quantization.config import QuantizationConfig
from specdec.request import Request, RequestStatus
from specdec.scheduler import ScheduledRequest

if TYPE_CHECKING:
    from grammars.base import GrammarBackend

logger = logging.getLogger("specdec.engine")

#: Test seam, see :attr:`LLMEngine.fault_injector`.
FaultInjector = Callable[[list[ScheduledRequest], torch.Tensor], None]


class LLMEngine:
    """Owns the model, the KV cache, the scheduler, the drafter, the verifier and the requests.

    Args:
        model_dir: an HF-format model directory.
        dtype: torch dtype of weights, activations and KV.
        device: where the model runs.
        cache_config, scheduler_config: see :mod:`specdec.config`.
        seed: seed of the generator used by unseeded sampled requests.
        model: an already built target (tests); None loads ``model_dir``.
        speculative_config: the drafter and k, or None for plain decoding.
        draft_model_dir: the resolved draft model or heads directory (the drafter's registry entry says
            which it takes).
        quantization: weight-only quantization of the target (see :mod:`specdec.quantization`); None: none.
            ``cache_config.kv_cache_dtype`` sets the target's KV cache dtype.
        compilation: ``torch.compile`` of the target's and a draft model's forward (see
            :mod:`specdec.compilation`); None: eager.

    Raises:
        InvalidRequestError: the draft model's vocabulary differs from the target's (checked from the
            configs, before any weights are loaded), and the other checks of the drafter's entry.

    Faults: a fault of one request ends that request alone (:mod:`specdec.engine.faults` lists them);
    one that cannot be pinned on a request (the target forward) propagates from :meth:`step`.

    Test seam: :attr:`fault_injector`, when set, is called after every target forward with the step's
    scheduled requests and the writable float32 logits ``[R, vocab_size]`` (rows per request from
    :func:`~specdec.engine.verification.logits_rows`), e.g. to write NaN into one request's rows.
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
        compilation: CompilationConfig | None = None,
    ) -> None:
        parts = build_engine_parts(model_dir, dtype, device, cache_config, scheduler_config, seed, model,
                                   speculative_config, draft_model_dir, quantization,
                                   compilation)  # fmt: skip
        self._init_from_parts(parts, cache_config, scheduler_config, speculative_config)

    @classmethod
    def from_parts(
        cls,
        parts: EngineParts,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        speculative_config: SpeculativeConfig | None = None,
    ) -> LLMEngine:
        """An engine over parts built elsewhere: a fake model runner and a drafter passed in (the engine
        tests), or parts shared with another engine. ``speculative_config`` sets k and the draft slots
        (``parts.drafter`` is used as it is)."""
        engine = cls.__new__(cls)
        engine._init_from_parts(parts, cache_config, scheduler_config, speculative_config)
        return engine

    def _init_from_parts(
        self,
        parts: EngineParts,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        spec: SpeculativeConfig | None,
    ) -> None:
        self.model = parts.model
        self.model_cfg = parts.model_cfg
        self.spec_config = spec
        self.max_model_len = parts.max_model_len
        self.num_kv_blocks = parts.num_kv_blocks
        self.runner = parts.runner
        self.generator = parts.generator
        #: The drafter (None: plain decoding); assignable, e.g. to a test's own drafter.
        self.drafter: Drafter | None = parts.drafter
        #: Verifies drafts (chains and trees); assignable, e.g. to a negative control.
        self.verifier: Verifier = SpeculativeVerifier()
        self.num_speculative_tokens = spec.num_speculative_tokens if spec else 0
        #: KV slots a drafting request reserves per step (k for chains, the tree size for trees, k per
        #: member for a hybrid union of chains: ``SpeculativeConfig.num_draft_slots``).
        self.num_draft_slots = spec.num_draft_slots if spec else 0
        #: Draft slots a constrained request reserves beyond ``num_draft_slots`` (grammar-aware drafting).
        self.num_forced_draft_slots = spec.num_forced_draft_slots if spec else 0
        #: Chooses each request's draft depth per step (None: plain decoding); assignable, as the drafter.
        self.policy: SpeculationPolicy | None = spec.build_policy() if spec else None
        self._policy_disabled: set[str] = set()  # requests whose policy failed: no drafts for them
        self._policy_prepared: SpeculationPolicy | None = None  # the policy that got the step costs
        self._policy_learns = True  # False once the policy's observe_step raised
        self._drafter_times_steps = True  # False once the drafter's observe_step_time raised
        self._drafter_prepared = False  # the drafter got the step costs it wants (or wants none)
        self._step_costs: dict[int, float] | None = None  # the target's profiled step costs
        # A draft model's profile: seconds per draft position by drafting rows, catch-up seconds per token.
        self._draft_costs: tuple[dict[int, float], float] | None = None
        self.kv, self.scheduler = build_scheduler(parts, cache_config, scheduler_config, spec)
        self.spec_stats: SpecStats | None = None
        self.reset_spec_stats()
        self._arrivals = itertools.count()
        self.num_steps = 0
        #: Token ids -> text, for stop strings (set by ``LLM`` from its tokenizer).
        self.detokenize: Callable[[list[int]], str] | None = None
        #: Compiles grammar specs (set by ``LLM`` from its tokenizer); None: constrained decoding is off.
        self.grammar_backend: GrammarBackend | None = None
        self.admission = GrammarAdmission()
        # ``step`` holds the lock: an abort from another thread waits for the step to end, one from inside
        # the step (a drafter, the fault injector) is applied when it ends.
        self._step_lock = threading.RLock()
        self._in_step = False
        self._deferred_aborts: list[str] = []
        self._num_faults = 0
        #: Chooses the intra-op thread count each step (set by ``LLM`` on the CPU); None: torch's setting.
        self.threads: ThreadPolicy | None = None
        #: Computes constrained requests' token bitmasks beside the forward; None: after it, inline.
        self.mask_prefetch: MaskPrefetch | None = MaskPrefetch()

    def reset_spec_stats(self) -> None:
        """Zero the aggregate acceptance counters (None when speculation is off)."""
        k = self.num_speculative_tokens
        self.spec_stats = SpecStats(k) if k else None

    @property
    def compiling(self) -> dict:
        """Constrained requests whose grammar is still compiling (admitted by ``step`` when ready)."""
        return self.admission.compiling

    @property
    def num_failed_requests(self) -> int:
        """Requests ended by a fault (``finish_reason`` "error") since the engine was built."""
        return self._num_faults + self.admission.num_failed

    # ---------------------------------------------------------------- requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check one request before any work (see :func:`~specdec.engine.admission.validate_request`)."""
        validate_request(
            prompt_token_ids,
            params,
            vocab_size=self.model_cfg.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.kv.block_size,
            num_kv_blocks=self.num_kv_blocks,
            num_draft_slots=self.num_draft_slots
            + (self.num_forced_draft_slots if getattr(params, "grammar_spec", None) is not None else 0),
            has_tokenizer=self.detokenize is not None,
            grammar_backend=self.grammar_backend,
        )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Validate and queue one request (see :meth:`validate` for the errors raised). From another
        thread it waits for a running step to end."""
        with self._step_lock:
            self.validate(prompt_token_ids, params)
            if params.n != 1:
                raise InvalidRequestError(
                    "the engine takes one sequence per request; LLM.generate expands n > 1"
                )
            if request_id in self.scheduler.requests or request_id in self.compiling:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            req = Request(
                request_id, [int(t) for t in prompt_token_ids], params, 0, self.model_cfg.eos_token_ids
            )
            if self.num_speculative_tokens:
                req.spec_stats = SpecStats(self.num_speculative_tokens)
            if params.grammar_spec is not None and self.grammar_backend is not None:
                # Compiled off the engine thread; the request joins the scheduler once its grammar is ready.
                self.admission.submit(req, self.grammar_backend)
                self.admit_compiled()
            else:
                self._admit(req)
            return req

    def _admit(self, req: Request) -> None:
        # Priority is the order of entry into the scheduler (see specdec.scheduler).
        req.arrival_index = next(self._arrivals)
        self.scheduler.add_request(req)

    def admit_compiled(self, wait: bool = False) -> None:
        """Hand requests whose grammar finished compiling to the scheduler (``wait``: block for one)."""
        self.admission.admit_ready(self._admit, wait)

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
            if self.admission.abort(request_id):
                return
            req = self.scheduler.requests.get(request_id)
            if req is not None:
                req.stats.finished_time = time.perf_counter()
                self.finish(req, RequestStatus.FINISHED_ABORTED)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop, length, abort or fault): the scheduler frees its blocks, the drafter
        forgets it."""
        self.scheduler.finish(req, status)
        self._policy_disabled.discard(req.request_id)
        if self.drafter is not None:
            self.drafter.reset(req)

    def fail(self, req: Request, message: str, scrub_kv: bool = False) -> None:
        """End ``req`` alone because of a fault: ``finish_reason`` "error", ``req.error`` = ``message``,
        every block freed. ``scrub_kv``: first zero the K/V of the blocks only it holds, so that NaN or
        infinity written by its forward cannot reach a later request through stale (masked) slots."""
        if req.status.finished:
            return
        logger.warning("request %s ended by a fault: %s", req.request_id, message)
        req.error = message
        if scrub_kv:
            faults.scrub_private_blocks(req, self.kv.pool, self.runner.kv_caches, self.num_kv_blocks)
        req.stats.finished_time = time.perf_counter()
        self.finish(req, RequestStatus.FINISHED_ERROR)
        self._num_faults += 1

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
            if self.threads is not None:
                self.threads.step()
            try:
                return self._step()
            finally:
                self._in_step = False
                aborts, self._deferred_aborts = self._deferred_aborts, []
                for rid in aborts:
                    self.abort_request(rid)

    def prepare_policy(self) -> None:
        """Hand the drafter and the policy the target's step costs if they want them
        (``wants_step_costs``), and a draft model's forward by drafting rows and its catch-up cost per
        token to a policy with ``set_draft_costs``: profiled once per engine, or loaded from the cache
        (:mod:`specdec.engine.cost_profile`). ``step`` calls it before a new policy's (or the drafter's)
        first decision; call it yourself to keep the profile out of a timed run.
        Run it between steps (the profile borrows free KV blocks)."""
        self._prepare_drafter()
        policy = self.policy
        if policy is None or policy is self._policy_prepared:
            return
        self._policy_prepared, self._policy_learns = policy, True
        if getattr(policy, "wants_step_costs", False):
            self._give_step_costs(policy, "speculation policy")
            set_draft_costs = getattr(policy, "set_draft_costs", None)
            if set_draft_costs is not None:
                if self._draft_costs is None:
                    self._draft_costs = draft_model_costs(self)
                try:
                    per_position, catch_up = self._draft_costs
                    set_draft_costs(dict(per_position), catch_up_s_per_token=catch_up)
                except Exception as e:
                    logger.warning(
                        "the speculation policy's set_draft_costs raised %s: %s", type(e).__name__, e
                    )

    def _prepare_drafter(self) -> None:
        """Hand the drafter the target's step costs once if it wants them (``wants_step_costs``: suffix
        decoding's chain cut, :mod:`specdec.drafters.draft_length`)."""
        drafter = self.drafter
        if drafter is None or self._drafter_prepared or not getattr(drafter, "wants_step_costs", False):
            return
        self._drafter_prepared = True
        self._give_step_costs(drafter, "drafter")

    def _give_step_costs(self, receiver: Any, what: str) -> None:
        """Profile the target's step costs once per engine (or load them from the cache) and hand a copy
        to ``receiver.set_step_costs``; a plug-in that raises goes on without them (logged)."""
        if self._step_costs is None:
            self._step_costs = step_costs(self)
        try:
            receiver.set_step_costs(dict(self._step_costs))
        except Exception as e:  # a plug-in's fault: it goes on without the profile
            logger.warning("the %s's set_step_costs raised %s: %s", what, type(e).__name__, e)

    def _step(self) -> list[Request]:
        self.admit_compiled()
        if self.drafter is not None:
            self.prepare_policy()  # before scheduling: the profile borrows free KV blocks
        out = self.scheduler.schedule()
        for req in out.preempted:  # their KV is gone: drafters rebuild state from the committed tokens
            if self.drafter is not None:
                self.drafter.reset(req)
        if not out.scheduled:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests pending (KV pool too small?)")
            self.admit_compiled(wait=True)  # only compiling requests are left: wait for one
            return []
        self.num_steps += 1
        scheduled, failed, draft_s = out.scheduled, [], 0.0
        if self.drafter is not None:
            t0 = time.perf_counter()
            if self.policy is not None:
                backlog = getattr(self.drafter, "draft_backlog", None)
                apply_policy(self.policy, scheduled, self._policy_disabled, backlog)
                self.scheduler.reclaim_draft_slots(scheduled)
            # A drafter writing the target's own KV (the quantized self-drafter) may leave non-finite K/V
            # in the request's blocks when it fails: scrubbed, as after a target fault.
            scrub = bool(getattr(self.drafter, "shares_target_kv", False))
            propose_drafts(
                self.drafter,
                scheduled,
                self.model_cfg.vocab_size,
                lambda s, m: self.fail(s.request, m, scrub_kv=scrub),
            )
            failed = [s.request for s in scheduled if s.request.status.finished]  # ended while drafting
            scheduled = [s for s in scheduled if not s.request.status.finished]
            draft_s = time.perf_counter() - t0
            if self.spec_stats is not None:
                self.spec_stats.draft_time_s += draft_s
            if not scheduled:
                return failed
        t0 = time.perf_counter()
        vocab_size = self.model_cfg.vocab_size
        masks = self.mask_prefetch.submit(scheduled, vocab_size) if self.mask_prefetch is not None else None
        try:
            logits, hidden = self._forward(scheduled)
        finally:  # the worker is done with the grammars before anything else touches them
            bitmasks = self.mask_prefetch.collect(masks) if self.mask_prefetch is not None else None
        batch = process_rows(
            scheduled, logits, vocab_size, lambda s, m, scrub: self.fail(s.request, m, scrub), bitmasks
        )
        results = sample_or_verify(batch, self.verifier, self.generator)
        logprobs = emitted_logprobs(batch, results)
        updated = commit_all(self, scheduled, batch.sampling, results, hidden, logprobs)
        target_s = time.perf_counter() - t0
        if self.spec_stats is not None:
            self.spec_stats.verify_time_s += target_s
        if self._drafter_times_steps and len(scheduled) == 1:
            self._drafter_step_time(scheduled[0], target_s)
        if self.policy is not None and self._policy_learns:
            # Catch-up forwards over long backlogs (a draft model resuming) are a one-off, not a cost
            # per draft position: the policy learns drafting seconds without them, and their cost per
            # token apart.
            catch_up_s = float(getattr(self.drafter, "catch_up_s", 0.0))
            catch_up_tokens = int(getattr(self.drafter, "catch_up_tokens", 0))
            self._policy_learns = observe_policy(
                self.policy,
                scheduled,
                batch.sampling,
                results,
                max(0.0, draft_s - catch_up_s),
                target_s,
                (catch_up_s, catch_up_tokens),
            )
        return failed + updated

    def _drafter_step_time(self, s: ScheduledRequest, target_s: float) -> None:
        """Hand a drafter with ``observe_step_time`` a lone request's decode step (rows, seconds); a
        drafter that raises is not asked again (logged)."""
        observe = getattr(self.drafter, "observe_step_time", None)
        if observe is None or s.num_new_tokens != 1 or not s.sample:
            return
        if s.request.status is RequestStatus.FINISHED_ERROR:  # failed in the step: not a step's cost
            return
        try:
            observe(1 + len(s.draft_token_ids), target_s)
        except Exception as e:  # a plug-in's fault: the step and the request are unaffected
            self._drafter_times_steps = False
            logger.warning("the drafter's observe_step_time raised %s: %s", type(e).__name__, e)

    def _forward(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target forward: logits ``[R, vocab_size]`` of the sampling rows and, when the drafter reads
        features, the final-norm hidden states ``[T, hidden_size]`` of every row."""
        inputs = self.runner.prepare(scheduled)
        hidden = None
        if self.drafter is not None and self.drafter.uses_hidden_states:
            logits, hidden = self.runner.execute_with_hidden(inputs)
        else:
            logits = self.runner.execute(inputs)
        if self.fault_injector is not None:
            with torch.inference_mode():
                self.fault_injector(scheduled, logits)
        return logits, hidden
