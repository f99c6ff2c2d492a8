"""Draft-model drafter: a smaller model with the target's tokenizer proposes k tokens autoregressively
(Leviathan et al. 2023; Chen et al. 2023).

The draft model has its own KV cache tensors but shares the target's block tables and slot mapping:
a token's draft K/V lives in the same slot as its target K/V, so allocation, prefix caching, rollback
and preemption of the target apply to the draft cache too. Per request the drafter tracks how many
committed tokens have valid draft KV (its typed per-request state); each step that drafts for a request
first catches up on the committed tokens it has not seen (prompt chunks, the last verified tokens, the
decode steps a speculation policy gave no drafts), then drafts. Catch-up is lazy, prompts included: a
step without drafts for a request costs the draft model nothing for it, so a request a policy never lets
draft never runs the draft model (under the goodput policy at 16 requests, the quantized self-drafter's
eager prompt catch-up took 38 % of the wall time for a mean depth of 0.16). A backlog longer than
:data:`CATCH_UP_SEPARATE` tokens is caught up in forwards of its own, at most :data:`CATCH_UP_CHUNK`
tokens per request each, before the drafting forward; their seconds are ``catch_up_s`` (a policy learns
the cost of drafting without them). After verification the KV of accepted drafts stays valid; the rest is
simply overwritten later. The quantized self-drafter (the target's own layers) goes further and reads and
writes the target's KV tensors themselves (``share_target_kv``): nothing to catch up on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sampling.processors import RowGroup, build_sampling_metadata, process_logits
from sampling.sampler import argmax_rows, sample_from_probs
from specdec.config import SpeculativeConfig
from specdec.drafters.base import DrafterBase, DrafterContext, DraftInput, DraftProposal, RequestStates
from specdec.drafters.draft_vocab import DraftVocab, ReducedVocabHead
from specdec.drafters.registry import register_drafter
from specdec.errors import ConfigError, InvalidRequestError
from specdec.model_runner import ModelRunner, Segment, build_inputs
from specdec.models.config import ModelArchConfig
from specdec.models.decoder import DecoderLM
from specdec.models.loader import load_model
from specdec.quantization.apply import quantized_copy
from specdec.request import Request
from specdec.structured import grammar_complete

if TYPE_CHECKING:
    from grammars.base import Grammar


#: Backlogs longer than this many tokens are caught up in forwards of their own before drafting.
CATCH_UP_SEPARATE = 16
#: The most tokens of one request a catch-up forward computes (bounds its activations and attention).
CATCH_UP_CHUNK = 512


def drafts_on_target_kv(x: DraftInput) -> bool:
    """Whether a draft model on the target's KV (``share_target_kv``) drafts for ``x`` this step: not on the
    step that samples the request's first token. That step computes the prompt (or its last chunk), and
    the drafting forward would run over all of it only for the verification forward to overwrite its K/V
    with the target's in the same step (SmolLM2's int8 self-drafter: ~90 ms over a few hundred prompt
    tokens, three speculative steps' time); the next step drafts on the target's K/V.

    Decided from the request's token history alone (has it an output token yet?), not from the step's new
    tokens, which a prefix-cache hit or a preemption changes: drafting or not changes how many draws a
    seeded request takes from its generator, so a rule on the new tokens made the same seeded request
    draw other tokens after a prefix-cache hit. Either way the outputs follow the target's distribution.
    """
    return x.request.num_output_tokens > 0


@dataclass
class _DraftKV:
    num_computed: int = 0  # committed tokens whose draft K/V is in the draft cache


def draw_draft_tokens(
    logits: torch.Tensor,
    reqs: list[Request],
    drafts: list[list[int]],
    bitmasks: list[torch.Tensor | None],
    generator: torch.Generator,
) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft token per row of ``logits`` ``[R, V]`` (row r continues ``reqs[r]`` after its
    ``drafts[r]``), and the distribution it was drawn from ``[V]`` float32 (None for greedy requests,
    whose draft is the processed argmax).

    Each row is processed exactly as the target's verification row for the same position
    (:func:`sampling.processors.process_logits`), so ``draft_probs`` is the drafter's processed
    distribution; ``-inf`` logits (a reduced draft vocabulary) stay at probability zero. ``bitmasks``:
    per row a grammar's packed token bitmask ``[1, ceil(V / 32)]`` after the earlier drafts, or None.
    Requests with a seed draw from their own generator, the others from ``generator``.
    """
    groups = [
        RowGroup(r.sampling_params, r.token_ids, r.num_prompt_tokens, r.stop_ids, d, 1, m)
        for r, d, m in zip(reqs, drafts, bitmasks)
    ]
    meta = build_sampling_metadata(groups, logits.shape[-1], logits.device)
    processed = process_logits(logits, meta)
    tokens = argmax_rows(processed).tolist()
    probs: list[torch.Tensor | None] = [None] * len(reqs)
    random = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
    if random:
        rows = torch.tensor(random, device=logits.device)
        p = torch.softmax(processed[rows], dim=-1)
        drawn = sample_from_probs(p, [reqs[i].generator for i in random], generator).tolist()
        for j, i in enumerate(random):
            tokens[i], probs[i] = drawn[j], p[j]
    return tokens, probs


def check_draft_vocabulary(
    target: ModelArchConfig, config: SpeculativeConfig, model_dir: Path | None
) -> None:
    """Compare the vocabulary sizes in the configs of target and draft, before any weights load.

    Raises:
        InvalidRequestError: they differ.
    """
    assert model_dir is not None, "the registry resolves the draft model's directory"
    draft = ModelArchConfig.from_pretrained(model_dir).vocab_size
    if draft != target.vocab_size:
        raise InvalidRequestError(
            f"the draft model's vocabulary ({draft} tokens) differs from the target's ({target.vocab_size}); "
            "draft and target must share a tokenizer"
        )


@register_drafter("draft_model", model="model", check_target=check_draft_vocabulary)
class DraftModelDrafter(DrafterBase):
    """A smaller model with the target's tokenizer (Leviathan et al. 2023; Chen et al. 2023), on the
    target's block tables.

    Args:
        ctx: ``ctx.model_dir`` the draft model's directory (loaded in ``ctx.dtype``), ``ctx.generator``
            for unseeded sampled requests.
        model: an already built draft model (the quantized self-drafter, tests); None loads
            ``ctx.model_dir``.
        share_target_kv: read and write the target's own KV tensors instead of keeping its own (the
            quantized self-drafter: the same layers and shapes). Every committed token then has K/V
            already, the target's, so the drafter never catches up; it writes K/V only in the slots of the
            step's new tokens and drafts, which the verification forward overwrites with the target's.
            Taken only where the draft model's dtype is the target's (else its own KV, as without it).

    Its own KV (the draft model's K/V tensors) is allocated by :meth:`bind_kv`; shared, the runner on the
    target's caches is built by :meth:`bind_target_kv`.

    Raises:
        InvalidRequestError: the vocabularies differ.
    """

    def __init__(
        self, ctx: DrafterContext, model: DecoderLM | None = None, share_target_kv: bool = False
    ) -> None:
        if model is None:
            assert ctx.model_dir is not None, "the registry resolves the draft model's directory"
            model = load_model(ctx.model_dir, dtype=ctx.dtype, device=ctx.device)
        if model.cfg.vocab_size != ctx.vocab_size:
            raise InvalidRequestError(
                f"the draft model's vocabulary ({model.cfg.vocab_size} tokens) differs from the target's "
                f"({ctx.vocab_size}); draft and target must share a tokenizer"
            )
        self.model = model
        self.runner: ModelRunner | None = None
        self.vocab_size = ctx.vocab_size
        self.block_size = 0
        self.generator = ctx.generator
        self.compilation = ctx.compilation
        self.states: RequestStates[_DraftKV] = RequestStates(_DraftKV)
        #: Seconds and tokens of the latest :meth:`propose`'s catch-up forwards of their own (long backlogs).
        self.catch_up_s = 0.0
        self.catch_up_tokens = 0
        #: Whether the drafter reads and writes the target's KV tensors (see ``share_target_kv``).
        self.shares_target_kv = share_target_kv and ctx.dtype == ctx.target.dtype
        self._num_blocks = 0

    def kv_bytes_per_block(self, block_size: int) -> int:
        if self.shares_target_kv:
            return 0
        return ModelRunner.kv_bytes_per_block(self.model, block_size, self.model.dtype)

    def bind_kv(self, num_blocks: int, block_size: int) -> None:
        self.block_size, self._num_blocks = block_size, num_blocks
        if not self.shares_target_kv:
            self.runner = ModelRunner(self.model, num_blocks, block_size, compilation=self.compilation)

    def bind_target_kv(self, runner: ModelRunner) -> None:
        """Build the draft model's runner on the target runner's KV tensors (``share_target_kv``)."""
        if self.shares_target_kv:
            self.runner = ModelRunner(
                self.model, self._num_blocks, self.block_size, kv_cache_dtype=runner.kv_cache_dtype,
                compilation=self.compilation, kv_caches=runner.kv_caches,
            )  # fmt: skip

    def reset(self, request: Request) -> None:
        self.states.reset(request)

    def draft_backlog(self, request: Request, num_new_tokens: int) -> int:
        """Committed tokens (this step's new ones included) without draft K/V yet, the last one aside
        (it rides in the drafting forward): the catch-up a first draft for the request would pay."""
        done = self._num_computed(request, self.states.peek(request))
        return max(0, request.num_computed_tokens + num_new_tokens - 1 - done)

    def _num_computed(self, request: Request, state: _DraftKV | None) -> int:
        """Committed tokens whose draft K/V is in place: the state's count (0 without one); on the target's
        KV at least every committed token (the target wrote their K/V into the shared cache)."""
        done = state.num_computed if state is not None else 0
        return max(done, request.num_computed_tokens) if self.shares_target_kv else done

    def _state(self, request: Request) -> _DraftKV:
        state = self.states.get(request)
        state.num_computed = self._num_computed(request, state)
        return state

    def _draw(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        drafts: list[list[int]],
        bitmasks: list[torch.Tensor | None],
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft token per row, and the distribution it was drawn from (None when greedy).

        Each row is processed exactly as the target's verification row for the same position
        (:func:`sampling.processors.process_logits`, the prefix including the earlier drafts), so
        ``draft_probs`` is the drafter's processed distribution. ``bitmasks``: per row the grammar's
        packed token bitmask ``[1, ceil(V / 32)]`` after the earlier drafts, or None.
        """
        return draw_draft_tokens(logits, reqs, drafts, bitmasks, self.generator)

    @torch.inference_mode()
    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        proposals = [DraftProposal([]) for _ in batch]
        self.catch_up_s, self.catch_up_tokens = 0.0, 0
        # 1. Catch up on committed tokens of the drafting requests; the last row of each gives draft 1.
        spans: dict[int, tuple[int, int]] = {}
        for i, x in enumerate(batch):
            if x.max_drafts <= 0:
                continue  # no drafts this step: its catch-up (prompt chunks too) waits for a drafting step
            if self.shares_target_kv and not drafts_on_target_kv(x):
                continue  # the prompt: the target writes its K/V this step (drafts_on_target_kv)
            req, state = x.request, self._state(x.request)
            end = req.num_computed_tokens + x.num_new_tokens
            spans[i] = (min(state.num_computed, end - 1), end)
            state.num_computed = end
        if not spans:
            return proposals
        assert self.runner is not None, "bind_kv (own KV) or bind_target_kv (shared) builds the runner"
        runner = self.runner
        self._catch_up(batch, spans)
        drafting = list(spans)
        segments = [
            Segment(batch[i].request.block_ids, a, batch[i].request.token_ids[a:b], 1)
            for i, (a, b) in spans.items()
        ]
        logits = runner.execute(build_inputs(segments, self.block_size, runner.device))
        probs_rows: dict[int, list[torch.Tensor]] = {i: [] for i in drafting}
        # Constrained requests: the grammar is advanced through the drafts to mask each draft row,
        # then rolled back (only verification advances it for good).
        advanced = {i: 0 for i in drafting if batch[i].request.grammar is not None}
        try:
            while drafting:
                reqs = [batch[i].request for i in drafting]
                bitmasks = [
                    self._grammar_row(batch[i].request, proposals[i].token_ids, advanced, i) for i in drafting
                ]
                tokens, probs = self._draw(logits, reqs, [proposals[i].token_ids for i in drafting], bitmasks)
                for i, t, p in zip(drafting, tokens, probs):
                    proposals[i].token_ids.append(t)
                    if p is not None:
                        probs_rows[i].append(p)
                drafting = [i for i in drafting if len(proposals[i].token_ids) < batch[i].max_drafts]
                drafting = [
                    i
                    for i in drafting
                    if not self._grammar_ended(batch[i].request, proposals[i].token_ids, advanced, i)
                ]
                if not drafting:
                    break
                # 2. Feed each draft back: one token per request at the position after the last one.
                segments = []
                for i in drafting:
                    req, drafts = batch[i].request, proposals[i].token_ids
                    segments.append(Segment(req.block_ids, req.num_tokens + len(drafts) - 1, drafts[-1:], 1))
                logits = runner.execute(build_inputs(segments, self.block_size, runner.device))
        finally:
            for i, n in advanced.items():
                grammar = batch[i].request.grammar
                assert grammar is not None
                grammar.rollback(n)
        for i, rows in probs_rows.items():
            if rows:
                proposals[i].draft_probs = torch.stack(rows)
        return proposals

    def _catch_up(self, batch: list[DraftInput], spans: dict[int, tuple[int, int]]) -> None:
        """Forwards of their own over backlogs longer than :data:`CATCH_UP_SEPARATE` tokens (no logits;
        at most :data:`CATCH_UP_CHUNK` tokens per request each), leaving each request's last
        :data:`CATCH_UP_SEPARATE` or fewer tokens in ``spans`` for the drafting forward; timed into
        ``catch_up_s``."""
        t0 = time.perf_counter()
        runner = self.runner
        assert runner is not None
        while True:
            segments = []
            for i, (a, b) in spans.items():
                if b - a > CATCH_UP_SEPARATE:
                    n = min(CATCH_UP_CHUNK, b - a - CATCH_UP_SEPARATE)
                    req = batch[i].request
                    segments.append(Segment(req.block_ids, a, req.token_ids[a : a + n], 0))
                    spans[i] = (a + n, b)
                    self.catch_up_tokens += n
            if not segments:
                break
            runner.execute(build_inputs(segments, self.block_size, runner.device))
        self.catch_up_s = time.perf_counter() - t0

    def _grammar_row(
        self, req: Request, drafts: list[int], advanced: dict[int, int], i: int
    ) -> torch.Tensor | None:
        """The grammar's bitmask ``[1, ceil(V / 32)]`` after ``drafts`` (advancing it), or None."""
        grammar = req.grammar
        if grammar is None:
            return None
        from grammars.bitmask import allocate_token_bitmask

        self._advance(grammar, drafts, advanced, i)
        bitmask = allocate_token_bitmask(1, self.vocab_size)
        grammar.fill_bitmask(bitmask, 0)
        return bitmask

    @staticmethod
    def _advance(grammar: Grammar, drafts: list[int], advanced: dict[int, int], i: int) -> bool:
        while advanced[i] < len(drafts):
            if not grammar.accept_token(drafts[advanced[i]]):
                return False
            advanced[i] += 1
        return True

    def _grammar_ended(self, req: Request, drafts: list[int], advanced: dict[int, int], i: int) -> bool:
        """Stop drafting once the drafts complete (or break) the request's grammar."""
        grammar = req.grammar
        if grammar is None:
            return False
        if not self._advance(grammar, drafts, advanced, i):
            return True
        return grammar_complete(grammar, req.stop_ids, self.vocab_size)

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Accepted drafts that were fed to the draft model keep their KV (the last draft never was)."""
        state = self._state(request)
        state.num_computed += min(num_accepted, max(num_drafts - 1, 0))


# ------------------------------------------------------------------ the quantized self-drafter
def check_quantized_self(config: SpeculativeConfig) -> None:
    """``quantization`` is required and valid; no ``model`` (the drafter is the target's own weights).

    Raises:
        ConfigError: otherwise.
    """
    if config.model is not None:
        raise ConfigError(
            "speculative method 'quantized_self' drafts with the target's own weights "
            f"(got model={config.model!r})"
        )
    if config.quantization is None:
        raise ConfigError("speculative method 'quantized_self' needs quantization='int4' or 'int8'")
    config.quantization_config()  # validates the scheme and group size


def check_quantized_self_target(
    target: ModelArchConfig, config: SpeculativeConfig, model_dir: Path | None
) -> None:
    """The self-drafter's int4 group size must divide the target's layer input sizes.

    Raises:
        ConfigError: it does not.
    """
    quantization = config.quantization_config()
    assert quantization is not None
    quantization.check_model(target)


@register_drafter(
    "quantized_self",
    fields=("quantization", "draft_vocab"),
    check_config=check_quantized_self,
    check_target=check_quantized_self_target,
)
def quantized_self(ctx: DrafterContext) -> DraftModelDrafter:
    """The target's own weights, quantized to int8 or int4, as its draft model.

    No second checkpoint and no training: the draft model is
    :func:`~specdec.quantization.apply.quantized_copy` of the target (dense, or itself quantized: then its
    dequantized weights are re-quantized; not modified), sharing its tokenizer (the same vocabulary by
    construction), embedding table, norms and RoPE buffer, with its own linear layers quantized (see
    :mod:`specdec.quantization`). It runs as any draft model does, through :class:`DraftModelDrafter`:
    the target's KV tensors (below; its own, in ``ctx.dtype``, when that differs from the target's),
    greedy or sampled drafts, and exact verification by the full-precision target (Leviathan et al. 2023;
    Chen et al. 2023), so the output distribution is the target's whatever the quantization error.

    Why it can pay: a decode step is bound by the bytes it reads. In bfloat16 an int4 copy reads about a
    quarter of the target's linear-layer bytes (int8: about half), and, being the same network, it agrees
    with the target far more often than a smaller model does. With ``draft_vocab`` (target token ids, or
    an EAGLE-3 head whose draft vocabulary to take) its LM head computes those tokens' logits only
    (:class:`~specdec.drafters.draft_vocab.ReducedVocabHead`; SmolLM2: 8,192 of 49,152 rows), every
    other token at probability 0: drafts are verified as always, so outputs stay exact. It keeps no KV of
    its own: it reads the target's K/V of the context and writes its drafts' in the target's cache
    (``share_target_kv``), so it never catches up on a prompt or on steps it did not draft, and its
    drafts see the target's K/V.

    Raises:
        ConfigError: the int4 group size does not divide one of the target's layer input sizes.
    """
    quantization = ctx.config.quantization_config()
    assert quantization is not None
    model = quantized_copy(ctx.target, quantization, ctx.dtype)
    draft_vocab = ctx.config.draft_vocab
    if draft_vocab is not None:
        vocab = DraftVocab(draft_vocab, ctx.target, ctx.dtype, quantization if quantization.lm_head else None)
        model.lm_head = ReducedVocabHead(vocab, ctx.vocab_size)  # type: ignore[assignment]
    return DraftModelDrafter(ctx, model, share_target_kv=True)
