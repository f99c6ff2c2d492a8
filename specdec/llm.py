"""``LLM``: the offline Python API (mirrors vLLM's ``LLM`` where it fits)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grammars.registry import check_grammar_backend, make_grammar_backend
from grammars.schema import quiet_schema_warnings
from sampling.beam_search import BeamSearchParams
from sampling.params import SamplingParams, suggest_keywords
from specdec.beam_search import BeamSearchOutput
from specdec.beam_search import beam_search as run_beam_search
from specdec.compilation.cuda_graphs import check_cuda_graphs
from specdec.config import (
    CacheConfig,
    CompilationConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_device,
    resolve_dtype,
)
from specdec.engine import LLMEngine
from specdec.engine.huge_pages import HugePageStats, check_huge_pages, collapse_engine, wanted
from specdec.engine.threads import ThreadPolicy, check_threads
from specdec.errors import ConfigError, InvalidRequestError
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.quantization.config import QuantizationConfig
from specdec.request import Request

if TYPE_CHECKING:
    from grammars.base import GrammarBackend

Prompt = str | dict[str, Any]

#: ``LLM`` keyword arguments people bring from vLLM, transformers or habit, and what to write instead.
LLM_ALIASES: dict[str, str] = {
    "max_model_length": "use max_model_len=...",
    "max_seq_len": "use max_model_len=...",
    "max_length": "use max_model_len=... (the longest prompt + output)",
    "torch_dtype": 'use dtype=... ("float32" or "bfloat16")',
    "model_path": "use model=... (a zoo name or an HF-format directory)",
    "model_name": "use model=... (a zoo name or an HF-format directory)",
    "model_id": "use model=... (a zoo name or an HF-format directory)",
    "trust_remote_code": "specdec never runs a model's own code: it loads safetensors weights into its "
    "own decoders (Llama and Qwen2 families)",
    "tensor_parallel_size": "specdec runs one model on one device",
    "gpu_memory_utilization": "use kv_cache_memory_bytes=... (the KV pool's budget in bytes) or "
    "num_kv_blocks=...",
    "speculative_model": 'use speculative_config={"method": "draft_model", "model": ..., '
    '"num_speculative_tokens": ...}',
    "num_speculative_tokens": 'use speculative_config={"method": ..., "num_speculative_tokens": ...}',
    "speculative_method": 'use speculative_config={"method": ...}',
}


class LLM:
    """A model on the paged-KV engine, ready to generate.

    Args:
        model: a zoo name (see ``specdec.zoo.ZOO``) or a local HF-format directory.
        dtype: "float32" or "bfloat16" (weights, activations and KV cache).
        device: None picks CUDA when available, else the CPU.
        block_size: tokens per KV block.
        num_kv_blocks: KV blocks in the pool; None sizes it from ``max_num_seqs`` and ``max_model_len``
            within ``kv_cache_memory_bytes``.
        enable_prefix_caching: reuse the KV of equal prompt prefixes.
        max_model_len: longest prompt + output; None: the model's maximum.
        max_num_batched_tokens: token budget per forward (longer prompts are prefilled in chunks).
        max_num_seqs: most requests running at once.
        skip_tokenizer_init: do not load the tokenizer; prompts must be token ids and ``text`` is "".
        seed: seed for unseeded sampled requests.
        speculative_config: a :class:`~specdec.config.SpeculativeConfig` or a dict of its fields, e.g.
            ``{"method": "ngram", "num_speculative_tokens": 4}`` or ``{"method": "draft_model",
            "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}`` or ``{"method": "eagle",
            "tree": "dynamic"}`` (the target's built-in heads) or ``{"method": "quantized_self",
            "quantization": "int4"}`` (the target's own weights quantized); None: no speculation.
        kv_cache_memory_bytes: memory budget of the KV pool when ``num_kv_blocks`` is None.
        quantization: weight-only quantization of the linear layers at load time: None, ``"int8"`` (one
            scale per output channel), ``"int4"`` (one scale per group of 64 input columns), or a dict /
            :class:`~specdec.quantization.config.QuantizationConfig` (``group_size`` 32/64/128,
            ``zero_point``, ``lm_head``, ``kernel``). Speed pays in bfloat16 on the CPU; see
            :mod:`specdec.quantization.linear`.
        kv_cache_dtype: ``"auto"`` (the model's dtype) or ``"int8"`` (one scale per token and KV head;
            attention by the reference backend).
        compile: ``torch.compile`` the target's (and a draft model's) forward, everything but attention,
            one graph per token bucket: False (eager, the reference), True, or a dict /
            :class:`~specdec.config.CompilationConfig` (``buckets``, ``backend``). Each bucket compiles on
            its first use; ``llm.engine.runner.compile_stats`` reports them. See :mod:`specdec.compilation`.
        cuda_graphs: on CUDA, replay decode and chain-verification steps (the target's and a draft
            model's) from CUDA graphs captured per padded batch shape on first use; prefill chunks and
            token trees run eagerly. Same as ``compile={"enabled": ..., "cuda_graphs": True}``;
            ``llm.engine.runner.cuda_graph_stats`` reports them. See
            :mod:`specdec.compilation.cuda_graphs`.
        cpu_threads: intra-op threads on the CPU: ``"auto"`` (as many as there are cores that other
            processes leave free, re-sampled twice a second: a busy machine does not collapse the step),
            a fixed count, or None (torch's setting untouched). See :mod:`specdec.engine.threads`.
        grammar_backend: what compiles ``json_schema`` / ``regex`` / ``choice`` constraints: ``"auto"``
            (per spec, the backend that enforces the most of it: llguidance unless xgrammar or
            outlines-core enforces more), ``"llguidance"``, ``"xgrammar"`` or ``"outlines"``. See
            :mod:`grammars.registry`.
        huge_pages: on the CPU, move the weights (the target's, their packed copies, a drafter's) onto
            2 MiB pages once at start-up (``madvise``; here plain decoding ~2 % and int8 self-drafting ~10 %
            faster, for 2-4 s of start-up on SmolLM2): ``"auto"`` (on unless ``SPECDEC_HUGE_PAGES=0``),
            True or False; ``llm.huge_pages`` reports it. See :mod:`specdec.engine.huge_pages`.

    Raises:
        UnknownModelError, ModelFetchError, ChecksumError, CorruptModelError: the model cannot be had.
        ValueError: invalid configuration values.
        ConfigError: an unknown ``grammar_backend`` (the known ones named) or one whose package is
            missing; ``cuda_graphs`` without a CUDA device or with an attention backend other than Triton.
        TypeError: an unknown keyword argument, with what to write instead (``max_model_length`` ->
            ``max_model_len``...: :data:`LLM_ALIASES`, else the closest names).
    """

    @suggest_keywords("LLM", LLM_ALIASES)
    def __init__(
        self,
        model: str | Path,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        skip_tokenizer_init: bool = False,
        seed: int = 0,
        speculative_config: Any = None,
        kv_cache_memory_bytes: int = 2 * 1024**3,
        quantization: Any = None,
        kv_cache_dtype: str = "auto",
        compile: bool | dict | CompilationConfig = False,
        cuda_graphs: bool = False,
        cpu_threads: int | str | None = "auto",
        grammar_backend: str = "auto",
        huge_pages: bool | str = "auto",
        _shared_target: Any = None,
    ) -> None:
        #: The arguments this LLM was built with (what :meth:`with_speculation` builds another from; shallow
        #: copies, so a dict the caller changes later does not change them).
        self.init_args: dict[str, Any] = {
            k: copy.copy(v) for k, v in locals().items() if k not in ("self", "_shared_target")
        }
        from specdec.drafters.heads import default_heads_name, resolve_heads_dir
        from specdec.drafters.registry import model_method
        from specdec.zoo import resolve_model

        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed must be an integer, got {seed!r}")
        spec = SpeculativeConfig.from_any(speculative_config)
        torch_dtype = resolve_dtype(dtype)
        quantization_config = QuantizationConfig.from_any(quantization)
        compilation = CompilationConfig.from_any(compile)
        if not isinstance(cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs must be a bool, got {cuda_graphs!r}")
        if cuda_graphs:
            base = compilation or CompilationConfig(enabled=False)
            compilation = dataclasses.replace(base, cuda_graphs=True)
        if compilation is not None and compilation.cuda_graphs:
            check_cuda_graphs(resolve_device(device), kv_cache_dtype)
        check_threads(cpu_threads)
        check_huge_pages(huge_pages)
        self.grammar_backend_name = check_grammar_backend(grammar_backend)
        cache_config = CacheConfig(
            block_size,
            num_kv_blocks,
            enable_prefix_caching,
            kv_cache_memory_bytes,
            kv_cache_dtype,
            kv_huge_pages=wanted(huge_pages, resolve_device(device)),
        )
        scheduler_config = SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_model_len)
        self.model_dir = resolve_model(model)
        # Resolve (fetch) the draft model or heads before any loading, so a bad name fails first.
        draft_dir = None
        kind, method = model_method(spec) if spec is not None else ("none", "")
        if spec is not None and kind == "heads":  # a learned member's heads too (the hybrid)
            draft_dir = resolve_heads_dir(spec.model or default_heads_name(model, method))
        elif spec is not None and kind == "model" and spec.model:
            draft_dir = resolve_model(spec.model)
        self.tokenizer = None
        if not skip_tokenizer_init:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), trust_remote_code=False)
        self.engine = LLMEngine(
            self.model_dir,
            torch_dtype,
            resolve_device(device),
            cache_config,
            scheduler_config,
            seed,
            speculative_config=spec,
            draft_model_dir=draft_dir,
            quantization=quantization_config,
            compilation=compilation,
            model=_shared_target,
        )
        if self.engine.runner.device.type == "cpu" and cpu_threads is not None:
            self.engine.threads = ThreadPolicy(cpu_threads)
        #: What moving the weights (not the KV cache) onto huge pages did (None: not asked for); over a
        #: shared target (:meth:`with_speculation`) the target's windows are counted again.
        self.huge_pages: HugePageStats | None = None
        if wanted(huge_pages, self.engine.runner.device):
            self.huge_pages = collapse_engine(self.engine)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = set(self.engine.model_cfg.eos_token_ids) | {self.tokenizer.eos_token_id}
            object.__setattr__(self.engine.model_cfg, "eos_token_ids", tuple(sorted(eos)))
        if self.tokenizer is not None:
            tokenizer = self.tokenizer
            self.engine.detokenize = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))
        self._ids = itertools.count()

    #: ``LLM`` arguments that make the target's weights in memory: :meth:`with_speculation` keeps them.
    TARGET_ARGS = ("model", "dtype", "device", "quantization", "compile", "cuda_graphs")

    @property
    def target_shareable(self) -> bool:
        """Whether :meth:`with_speculation` can share this target: an eager one (not compiled, no CUDA
        graphs)."""
        runner = self.engine.runner
        return runner.forward is self.engine.model and runner.cuda_graphs is None

    def with_speculation(self, speculative_config: Any, **overrides: Any) -> LLM:
        """Another ``LLM`` over this one's target: the same weights in memory, its own drafter.

        The two engines share the target's weights, their packed copies and the huge pages they sit on, so
        a comparison of speculative against plain decoding (the benchmarks' interleaved rows) reads the
        same bytes in both, and holds one target in memory instead of two. Each engine keeps its own KV
        pool, scheduler, prefix cache, threads and drafter, and its own feature layers (EAGLE-3's: put
        back on the shared model before each of its forwards). The new engine is built with this one's
        arguments (:attr:`init_args`) but ``speculative_config`` (None: plain decoding) and
        ``overrides``, which may change any ``LLM`` argument except :data:`TARGET_ARGS`. Its
        :attr:`huge_pages` counts the shared target's windows again (already collapsed). Use the engines
        one at a time (``generate`` returns before the other starts; streams may interleave).

        Example::

            plain = LLM("smollm2-135m-instruct", dtype="bfloat16")
            ngram = plain.with_speculation({"method": "ngram", "num_speculative_tokens": 4})
            assert ngram.engine.model is plain.engine.model

        Raises:
            ConfigError: an override of one of :data:`TARGET_ARGS` to another value (named; the same
                value is accepted), or a compiled target or one replayed from CUDA graphs (their graphs
                are traced with one engine's feature layers: build a second ``LLM`` instead); and
                whatever ``LLM`` raises for the new arguments.
        """
        fixed = sorted(k for k in set(overrides) & set(self.TARGET_ARGS) if overrides[k] != self.init_args[k])
        if fixed:
            raise ConfigError(
                f"with_speculation shares this LLM's target: {', '.join(fixed)} cannot change "
                "(build another LLM for a different target)"
            )
        if not self.target_shareable:
            raise ConfigError(
                "with_speculation shares an eager target only: this one is compiled or replayed from CUDA "
                "graphs (build another LLM instead)"
            )
        args = {**self.init_args, **overrides, "speculative_config": speculative_config}
        return LLM(**args, _shared_target=self.engine.model)

    # ------------------------------------------------------------------ inputs
    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt and ("role" in prompt or "content" in prompt):
                raise InvalidRequestError(
                    "this prompt is a chat message ({'role': ..., 'content': ...}): use "
                    "llm.chat(messages, sampling_params), which applies the model's chat template; "
                    "generate takes strings or {'prompt_token_ids': [...]}"
                )
            if "prompt_token_ids" not in prompt:
                raise InvalidRequestError("a dict prompt needs the key 'prompt_token_ids'")
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Iterable):
                raise InvalidRequestError(
                    f"'prompt_token_ids' must be a list of ints, got {type(ids).__name__}"
                )
            return None, list(ids)
        if isinstance(prompt, (bytes, bytearray)):
            raise InvalidRequestError(
                "a prompt is a str or {'prompt_token_ids': [...]}, got bytes: decode it first "
                "(e.g. data.decode('utf-8', errors='replace'))"
            )
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
            raise InvalidRequestError(
                "this prompt is a conversation (a list of {'role': ..., 'content': ...} messages): use "
                "llm.chat(conversations, sampling_params), which applies the model's chat template"
            )
        if not isinstance(prompt, str):
            raise InvalidRequestError(
                f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt)}"
            )
        check_utf8(prompt, "the prompt")
        if self.tokenizer is None:
            raise InvalidRequestError("skip_tokenizer_init=True: give prompts as {'prompt_token_ids': [...]}")
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)

    def _add_all(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[tuple[str | None, list[Request]]]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise InvalidRequestError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (str, bytes, dict)) or not isinstance(sampling_params, Iterable):
            raise InvalidRequestError(
                "sampling_params must be a SamplingParams or a list of them, "
                f"got {type(sampling_params).__name__}"
            )
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(
                    f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one or one per prompt"
                )
        # Validate everything first so that a bad prompt adds nothing.
        tokenized = [self._tokenize(p) for p in prompts]
        if any(isinstance(sp, SamplingParams) and sp.grammar_spec is not None for sp in params):
            self._grammar_backend()
        for (_, ids), sp in zip(tokenized, params):
            self.engine.validate(ids, sp)
        # Compile every grammar now (cached by spec), so that a schema that cannot compile raises here.
        backend = self.engine.grammar_backend
        for spec in dict.fromkeys(sp.grammar_spec for sp in params if sp.grammar_spec is not None):
            assert backend is not None
            backend.compile(spec)
        added = []
        # Validated above, warnings included: add_request's own validation must not warn a second time.
        with quiet_schema_warnings():
            for (text, ids), sp in zip(tokenized, params):
                rid = str(next(self._ids))
                if sp.n == 1:
                    added.append((text, [self.engine.add_request(rid, ids, sp)]))
                    continue
                samples = [
                    self.engine.add_request(f"{rid}-{i}", ids, sample_params(sp, i)) for i in range(sp.n)
                ]
                added.append((text, samples))
        return added

    def _grammar_backend(self) -> GrammarBackend:
        """The ``grammar_backend`` for this tokenizer, made on first use (builds the vocabulary)."""
        if self.engine.grammar_backend is None and self.tokenizer is not None:
            self.engine.grammar_backend = make_grammar_backend(
                self.grammar_backend_name,
                self.tokenizer,
                self.engine.model_cfg.vocab_size,
                self.engine.model_cfg.eos_token_ids,
            )
        if self.engine.grammar_backend is None:
            raise InvalidRequestError(
                "json_schema / regex / choice need a tokenizer (skip_tokenizer_init=True)"
            )
        return self.engine.grammar_backend

    # ----------------------------------------------------------------- outputs
    def _completion(self, index: int, req: Request, delta: bool) -> CompletionOutput:
        ids = req.output_token_ids
        text = ""
        if self.tokenizer is not None:
            text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
            if req.stop_text_offset is not None:
                text = text[: req.stop_text_offset]  # the stop string is not part of the text
        new = ids[req.num_streamed_tokens :] if delta else []
        if delta:
            req.num_streamed_tokens = len(ids)
        schema = req.sampling_params.schema
        schema_valid = None
        if schema is not None and req.status.finished and self.tokenizer is not None:
            from grammars.schema import validate_instance

            schema_valid = validate_instance(text, schema)
        return CompletionOutput(
            index,
            list(ids),
            text,
            req.finish_reason,
            new,
            logprobs=None if req.logprobs is None else list(req.logprobs),
            cumulative_logprob=None if req.logprobs is None else req.cumulative_logprob,
            stop_reason=req.stop_reason,
            schema_valid=schema_valid,
            error=req.error,
        )

    def _output(self, prompt: str | None, reqs: list[Request], delta: bool = False) -> RequestOutput:
        """The prompt's output. With ``n`` > 1 each sample is an engine request of its own (ids
        ``"<id>-0"``, ``"<id>-1"``, ...) and ``metrics`` are those of the first sample, ``outputs[0]``."""
        req = reqs[0]
        ids = req.output_token_ids
        s = req.stats
        end = s.finished_time
        metrics: dict[str, Any] = {
            "num_prompt_tokens": req.num_prompt_tokens,
            "num_generated_tokens": len(ids),
            "num_cached_prompt_tokens": s.num_cached_prompt_tokens,
            "num_preemptions": s.num_preemptions,
            "time_to_first_token_s": None
            if s.first_token_time is None
            else s.first_token_time - s.arrival_time,
            "latency_s": None if end is None else end - s.arrival_time,
            "tokens_per_s": None if end is None else len(ids) / max(end - s.arrival_time, 1e-9),
        }
        if req.spec_stats is not None:
            metrics.update(req.spec_stats.as_dict())
            for key in ("draft_time_s", "verify_time_s"):  # measured per step, not per request
                metrics.pop(key)
        if req.drafter_metrics is not None:  # the hybrid's counts per member, suffix decoding's own
            metrics["drafter"] = {
                k: dict(vars(v)) if hasattr(v, "__dict__") else v for k, v in req.drafter_metrics.items()
            }
        return RequestOutput(
            request_id=req.request_id.split("-")[0],
            prompt=prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[self._completion(i, r, delta) for i, r in enumerate(reqs)],
            finished=all(r.status.finished for r in reqs),
            metrics=metrics,
        )

    # --------------------------------------------------------------------- API
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt with continuous batching; outputs come in prompt order.

        Args:
            prompts: a string, ``{"prompt_token_ids": [...]}``, or a list of them.
            sampling_params: one for all prompts, or one per prompt (default: ``SamplingParams()``).

        Raises:
            InvalidRequestError: a bad prompt or parameter (nothing is generated).
            KVCacheExhaustedError: one request cannot fit the KV pool even alone.
        """
        added = self._add_all(prompts, sampling_params)
        try:
            while self.engine.has_unfinished_requests():
                self.engine.step()
        except BaseException:  # interrupted (KeyboardInterrupt...) or an engine error: free our requests
            for _, reqs in added:
                for r in reqs:
                    self.engine.abort_request(r.request_id)
            raise
        return [self._output(text, reqs) for text, reqs in added]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Like :meth:`generate`, but yields after every engine step, once per prompt that got new
        tokens or finished; ``outputs[i].new_token_ids`` holds the tokens added since its previous chunk.

        Tokens are tracked per request, so nothing is lost if other calls step the engine while the
        consumer holds the iterator: the next chunk carries everything new since the last one, and every
        prompt's last chunk has ``finished=True`` (``finish_reason`` "abort" when it was aborted).
        """
        added = self._add_all(prompts, sampling_params)
        pending = {reqs[0].request_id: (text, reqs) for text, reqs in added}
        try:
            while pending:
                stepping = self.engine.has_unfinished_requests()
                if stepping:
                    self.engine.step()
                progressed = False
                for gid, (text, reqs) in list(pending.items()):
                    finished = all(r.status.finished for r in reqs)
                    fresh = any(r.num_output_tokens > r.num_streamed_tokens for r in reqs)
                    if finished:
                        del pending[gid]
                    if fresh or finished:
                        progressed = True
                        yield self._output(text, reqs, delta=True)
                if not stepping and not progressed:  # cannot happen: unfinished requests are stepped
                    raise RuntimeError(f"stream stalled with {len(pending)} unfinished prompts")
        finally:
            # A consumer that stops iterating abandons its requests: free them.
            for _, reqs in pending.values():
                for r in reqs:
                    self.engine.abort_request(r.request_id)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations: each is rendered with the tokenizer's chat template
        (``tokenizer.apply_chat_template``, the Jinja template shipped in the model's
        ``tokenizer_config.json``), tokenized, and generated from like a ``{"prompt_token_ids": [...]}``
        prompt.

        Instruction-tuned models, and draft heads trained on their chat data (``medusa``, ``eagle``),
        expect this format: the same request given to :meth:`generate` as raw text is another prompt, and
        the heads draft worse for it (SmolLM2 bfloat16, "Write a haiku about the sea.", 64 tokens: the
        built-in EAGLE chain of 4 reaches τ 2.24 through ``chat``, 1.72 raw).

        Args:
            messages: one conversation, a list of ``{"role": str, "content": str}`` dicts in order
                (roles as the template knows them: ``"system"``, ``"user"``, ``"assistant"``), or a list
                of such conversations (one output each, batched together). Extra keys are passed to the
                template.
            sampling_params: one for all conversations, or one per conversation (default:
                ``SamplingParams()``), as in :meth:`generate`.
            add_generation_prompt: end the rendered prompt with the template's assistant header (e.g.
                ``<|im_start|>assistant\\n``) so the model writes the assistant's reply; False renders the
                messages only (to continue the last message, or to score a finished conversation).

        Returns:
            One :class:`~specdec.outputs.RequestOutput` per conversation, in order. Its ``prompt`` is
            None and ``prompt_token_ids`` holds the rendered template's tokens (decode them to see the
            text the model was given); ``outputs[i].text`` is the reply alone.

        Raises:
            InvalidRequestError: no tokenizer (``skip_tokenizer_init=True``) or one without a chat
                template; ``messages`` not a list, an empty conversation, a message that is not a dict
                with string ``role`` and ``content``, content that is not valid Unicode; and everything
                :meth:`generate` raises (bad parameters, a prompt of ``max_model_len`` tokens or more...).
            jinja2.TemplateError: the template itself refuses the conversation (some require
                alternating user/assistant roles). Nothing is generated when anything raises.
        """
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("chat() needs a tokenizer with a chat template")
        if not isinstance(messages, list):
            raise InvalidRequestError(
                f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages)}"
            )
        conversations: list[Any] = [messages] if messages and isinstance(messages[0], dict) else messages
        for conv in conversations:
            if isinstance(conv, list) and not conv:
                raise InvalidRequestError("a conversation is empty: give at least one message")
            if not isinstance(conv, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in conv
            ):
                raise InvalidRequestError(
                    "each conversation must be a list of {'role': str, 'content': str} messages"
                )
            for m in conv:
                check_utf8(m["content"], "a message's content")
        prompts: list[Prompt] = [
            {"prompt_token_ids": chat_token_ids(self.tokenizer, conv, add_generation_prompt)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt, batched together, equal to transformers' ``generate(num_beams=W,
        do_sample=False)``; see :mod:`specdec.beam_search` and ``sampling.beam_search.BeamSearchParams``.

        Args:
            prompts: a string, ``{"prompt_token_ids": [...]}``, or a list of them.
            params: beam width, ``max_tokens``, length penalty, early stopping, sequences returned.

        Returns:
            One :class:`~specdec.beam_search.BeamSearchOutput` per prompt, in order, its ``sequences``
            best score first.

        Raises:
            InvalidRequestError: a bad prompt or parameter, or the engine has unfinished requests (nothing
                runs).
            KVCacheExhaustedError: one prompt's beams cannot fit the KV pool even alone (nothing runs).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise InvalidRequestError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
            )
        tokenized = [self._tokenize(p) for p in prompts]
        outputs = run_beam_search(self.engine, [ids for _, ids in tokenized], params)
        for (text, _), out in zip(tokenized, outputs):
            out.prompt = text
            if self.tokenizer is not None:
                for seq in out.sequences:
                    seq.text = str(self.tokenizer.decode(seq.token_ids, skip_special_tokens=True))
        return outputs


def check_utf8(text: str, what: str) -> None:
    """Raise unless ``text`` can be encoded as UTF-8 (a Python str can hold lone surrogates, e.g. from
    ``bytes.decode(errors="surrogateescape")``, which no tokenizer accepts).

    Raises:
        InvalidRequestError: naming the first offending character and its position.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{what} is not valid Unicode text: {text[e.start]!r} at position {e.start} ({e.reason}); "
            "decode bytes with errors='replace' instead of 'surrogateescape'"
        ) from None


def chat_token_ids(
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of one conversation under the tokenizer's chat template (transformers 4 or 5)."""
    ids: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sample ``index`` of a request with ``n`` > 1: ``n = 1``, and for a seeded
    request a seed derived from ``(seed, index)`` (sample 0 keeps the seed itself)."""
    seed = params.seed
    if seed is not None and index > 0:
        digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little") >> 1
    return dataclasses.replace(params, n=1, seed=seed)
