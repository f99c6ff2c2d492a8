"""A fake model runner for engine-layer tests: exact logits from a table over a simulated paged KV cache.

The fake "model": the logits after a context ``c_0 .. c_{L-1}`` are row ``context_row(c)`` of a fixed random
table ``[NUM_ROWS, VOCAB]`` (float32, seeded), where ``context_row`` hashes *every* token of the context in
order. So one wrong token anywhere in a row's context changes its logits (but for a row collision, chance
``1 / NUM_ROWS`` per row), and a greedy run has a known answer, :func:`greedy_reference`, a plain Python loop
over the same table.

The fake "KV cache": every forward writes each new token, with its position, into the slot that the
request's block table gives it (a token tree's node ``i`` takes the slot after the committed tokens in node
order, as :class:`specdec.model_runner.ModelRunner` does). A row's context is then read back the way
attention reads it: the committed positions ``0 .. start - 1`` from their slots through the block table
(prefix-cached blocks, compacted tree paths and rolled-back drafts included), then the new tokens the row
may attend to (causal, or its ancestors in the tree). The runner raises :class:`FakeRunnerError` when the
engine hands it something inconsistent: a committed position whose slot holds another position's token
(stale, never written, moved to the wrong place), positions that do not run ``0 .. L - 1`` along a row's
context, a slot written twice in one forward or a committed slot overwritten, a block table too short, drafts
on a step that does not sample. Greedy output therefore equals the reference only when the engine fed every
token, slot, position, draft and tree mask right.

:func:`make_engine` builds an :class:`~specdec.engine.LLMEngine` on it through ``LLMEngine.from_parts`` (no
model on disk); :func:`run` drives requests to the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sampling.params import SamplingParams
from specdec.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from specdec.drafters.base import Drafter
from specdec.drafters.registry import check_protocol
from specdec.engine import LLMEngine
from specdec.engine.build import EngineParts
from specdec.models.config import ModelArchConfig
from specdec.request import Request
from specdec.scheduler import ScheduledRequest

VOCAB = 32
EOS = 2
NUM_ROWS = 1024
HIDDEN = 8
TABLE_SEED = 1234
_MOD = (1 << 61) - 1

_gen = torch.Generator().manual_seed(TABLE_SEED)
#: The fake model: logits after a context are ``LOGITS_TABLE[context_row(context)]``.
LOGITS_TABLE = torch.randn(NUM_ROWS, VOCAB, generator=_gen)
#: The fake final-norm features of a token: ``FEATURE_TABLE[context_row(context up to and including it)]``.
FEATURE_TABLE = torch.randn(NUM_ROWS, HIDDEN, generator=_gen)
# Greedy is unambiguous: no row has a tie for its largest logit.
_top2 = LOGITS_TABLE.topk(2, dim=-1).values
assert bool((_top2[:, 0] > _top2[:, 1]).all())


class FakeRunnerError(AssertionError):
    """The engine handed the runner inconsistent inputs (see the module docstring)."""


def _fold(h: int, tokens: Sequence[int]) -> int:
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % _MOD
    return h


def context_row(context: Sequence[int]) -> int:
    """The table row of a context (a hash of every token, in order)."""
    return _fold(0, context) % NUM_ROWS


def logits_of(context: Sequence[int]) -> torch.Tensor:
    """The fake model's logits ``[VOCAB]`` after ``context``."""
    return LOGITS_TABLE[context_row(context)]


def features_of(context: Sequence[int]) -> torch.Tensor:
    """The fake features ``[HIDDEN]`` of the last token of ``context``."""
    return FEATURE_TABLE[context_row(context)]


def greedy_next(context: Sequence[int], banned: Sequence[int] = ()) -> int:
    """Argmax of the logits after ``context``, ``banned`` tokens excluded."""
    row = logits_of(context).clone()
    if banned:
        row[list(banned)] = float("-inf")
    return int(row.argmax())


def greedy_reference(
    prompt: Sequence[int],
    max_tokens: int,
    *,
    stop_ids: Sequence[int] = (),
    min_tokens: int = 0,
    max_model_len: int | None = None,
) -> list[int]:
    """Greedy continuation of ``prompt`` by a plain loop over the table, under the engine's stop rules: a
    token of ``stop_ids`` ends it (and is kept), but stop tokens are banned until ``min_tokens`` were
    generated; ``max_tokens`` and ``max_model_len`` (prompt + output) bound its length."""
    ctx = list(prompt)
    out: list[int] = []
    while True:
        t = greedy_next(ctx, stop_ids if len(out) < min_tokens else ())
        ctx.append(t)
        out.append(t)
        if t in stop_ids or len(out) >= max_tokens:
            return out
        if max_model_len is not None and len(ctx) >= max_model_len:
            return out


@dataclass
class FakeSegment:
    """One request's share of a fake forward.

    Attributes:
        request_id: the request's id.
        block_ids: a copy of its block table at ``prepare``.
        start: its ``num_computed_tokens`` at ``prepare``.
        token_ids: its new tokens: committed ones, then drafts (chain or tree nodes).
        positions: the position of each new token.
        visible: per new token, the new tokens it attends to (itself included), in order.
        num_logits: logits rows wanted: the last ``num_logits`` new tokens.
    """

    request_id: str
    block_ids: list[int]
    start: int
    token_ids: list[int]
    positions: list[int]
    visible: list[list[int]]
    num_logits: int


@dataclass
class FakeInputs:
    segments: list[FakeSegment]


class FakeRunner:
    """Usable as ``EngineParts.runner``: ``prepare``, ``execute``, ``execute_with_hidden``, ``copy_slots``,
    ``kv_caches`` (empty: the simulated cache is :attr:`slot_tokens` / :attr:`slot_positions`), ``device``,
    ``dtype``.

    Counters for tests: :attr:`num_forwards`, :attr:`num_forwards_with_hidden`, :attr:`num_copied_slots`,
    and :attr:`segments_log`, one ``(request_id, start, num_new_tokens, num_drafts, sample, is_tree)`` per
    request per forward.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.kv_caches: tuple = ()
        self.slot_tokens = [-1] * (num_blocks * block_size)
        self.slot_positions = [-1] * (num_blocks * block_size)
        self.num_forwards = 0
        self.num_forwards_with_hidden = 0
        self.num_copied_slots = 0
        self.segments_log: list[tuple[str, int, int, int, bool, bool]] = []

    # ---------------------------------------------------------------- inputs
    def prepare(self, scheduled: list[ScheduledRequest]) -> FakeInputs:
        segments = []
        for s in scheduled:
            req = s.request
            rid = req.request_id
            start, n = req.num_computed_tokens, s.num_new_tokens
            committed = req.token_ids[start : start + n]
            if n < 1 or len(committed) != n:
                raise FakeRunnerError(f"request {rid}: {n} new tokens from {start} of {req.num_tokens}")
            drafts = [int(t) for t in s.draft_token_ids]
            if drafts and not s.sample:
                raise FakeRunnerError(f"request {rid}: drafts on a step that does not sample")
            if s.sample and start + n != req.num_tokens:
                raise FakeRunnerError(f"request {rid}: samples but its new tokens stop before the end")
            tree = s.draft_tree
            visible = [list(range(j + 1)) for j in range(n)]
            if tree is None:
                positions = list(range(start, start + n + len(drafts)))
                visible += [list(range(n + i + 1)) for i in range(len(drafts))]
            else:
                if list(tree.token_ids) != drafts:
                    raise FakeRunnerError(f"request {rid}: draft_tree tokens differ from draft_token_ids")
                root = start + n - 1
                positions = list(range(start, start + n)) + [root + d for d in tree.depths()]
                visible += [list(range(n)) + [n + a for a in tree.path(i)] for i in range(tree.num_nodes)]
            num_logits = 1 + len(drafts) if s.sample else 0
            segments.append(
                FakeSegment(
                    rid, list(req.block_ids), start, committed + drafts, positions, visible, num_logits
                )
            )
            self.segments_log.append((rid, start, n, len(drafts), s.sample, tree is not None))
        return FakeInputs(segments)

    def _slot(self, seg: FakeSegment, index: int) -> int:
        """The slot of the token at sequence index ``index`` (a position, or a tree node's slot index)."""
        bs = self.block_size
        b = index // bs
        if b >= len(seg.block_ids):
            raise FakeRunnerError(
                f"request {seg.request_id}: index {index} is past its table of {len(seg.block_ids)} blocks"
            )
        block = seg.block_ids[b]
        if not 0 <= block < self.num_blocks:
            raise FakeRunnerError(f"request {seg.request_id}: block id {block} outside the pool")
        return block * bs + index % bs

    # --------------------------------------------------------------- forward
    def _forward(self, inputs: FakeInputs, want_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.num_forwards += 1
        written: set[int] = set()
        for seg in inputs.segments:  # write every new token's "K/V" first, as a forward does
            for j, (t, p) in enumerate(zip(seg.token_ids, seg.positions)):
                slot = self._slot(seg, seg.start + j)
                if slot in written:
                    raise FakeRunnerError(
                        f"request {seg.request_id}: slot {slot} written twice in one forward"
                    )
                written.add(slot)
                self.slot_tokens[slot] = t
                self.slot_positions[slot] = p
        logit_rows: list[int] = []
        feature_rows: list[int] = []
        for seg in inputs.segments:
            prefix: list[int] = []
            for q in range(seg.start):  # the committed context, read back through the block table
                slot = self._slot(seg, q)
                if slot in written:
                    raise FakeRunnerError(f"request {seg.request_id}: committed position {q} overwritten")
                if self.slot_positions[slot] != q:
                    raise FakeRunnerError(
                        f"request {seg.request_id}: slot {slot} of position {q} holds position "
                        f"{self.slot_positions[slot]} (stale or misplaced K/V)"
                    )
                prefix.append(self.slot_tokens[slot])
            h = _fold(0, prefix)
            first_logit = len(seg.token_ids) - seg.num_logits
            for j, vis in enumerate(seg.visible):
                if j < first_logit and not want_hidden:
                    continue
                if [seg.positions[a] for a in vis] != list(range(seg.start, seg.start + len(vis))):
                    raise FakeRunnerError(
                        f"request {seg.request_id}: token {j} sees positions "
                        f"{[seg.positions[a] for a in vis]} after {seg.start} committed ones"
                    )
                row = _fold(h, [seg.token_ids[a] for a in vis]) % NUM_ROWS
                feature_rows.append(row)
                if j >= first_logit:
                    logit_rows.append(row)
        logits = LOGITS_TABLE[torch.tensor(logit_rows, dtype=torch.int64)]  # a fresh (writable) tensor
        hidden = FEATURE_TABLE[torch.tensor(feature_rows, dtype=torch.int64)] if want_hidden else None
        return logits, hidden

    def execute(self, inputs: FakeInputs) -> torch.Tensor:
        """Logits ``[R, VOCAB]`` float32 of the rows wanted, in order."""
        logits, _ = self._forward(inputs, want_hidden=False)
        return logits

    def execute_with_hidden(self, inputs: FakeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[R, VOCAB]`` and features ``[T, HIDDEN]`` of every new token (``features_of`` its
        context up to and including it)."""
        self.num_forwards_with_hidden += 1
        logits, hidden = self._forward(inputs, want_hidden=True)
        assert hidden is not None
        return logits, hidden

    def copy_slots(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Slot ``dst_slots[i]`` gets slot ``src_slots[i]``'s token and position (all read first)."""
        if len(src_slots) != len(dst_slots):
            raise ValueError(f"{len(src_slots)} source slots but {len(dst_slots)} destinations")
        if len(set(dst_slots)) != len(dst_slots):
            raise ValueError("destination slots must be distinct")
        size = len(self.slot_tokens)
        if any(not 0 <= x < size for x in [*src_slots, *dst_slots]):
            raise FakeRunnerError(f"slot outside the pool in copy_slots({src_slots}, {dst_slots})")
        values = [(self.slot_tokens[s], self.slot_positions[s]) for s in src_slots]
        for d, (t, p) in zip(dst_slots, values):
            self.slot_tokens[d] = t
            self.slot_positions[d] = p
        self.num_copied_slots += len(src_slots)


def fake_model_config(
    max_position_embeddings: int = 1024, eos_token_ids: tuple[int, ...] = (EOS,)
) -> ModelArchConfig:
    """The architecture the engine sees: only the vocabulary, the EOS ids and the length matter."""
    return ModelArchConfig(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=HIDDEN,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        max_position_embeddings=max_position_embeddings,
        inv_freq=tuple(1.0 / 10000 ** (i / HIDDEN) for i in range(0, HIDDEN, 2)),
        rope_attention_scaling=1.0,
        bos_token_id=None,
        eos_token_ids=tuple(eos_token_ids),
    )


def make_engine(
    drafter: Drafter | None = None,
    spec: SpeculativeConfig | dict | None = None,
    *,
    num_kv_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = True,
    max_model_len: int = 128,
    max_num_seqs: int = 64,
    eos_token_ids: tuple[int, ...] = (EOS,),
    runner: FakeRunner | None = None,
) -> LLMEngine:
    """An engine on a :class:`FakeRunner` (``runner``, or a new one) through ``LLMEngine.from_parts``.

    ``spec`` sets k and the draft slots (a ``SpeculativeConfig`` or a dict of its fields); with a
    ``drafter`` and no ``spec``: ``{"method": "ngram", "num_speculative_tokens": 3}`` (the method only
    names a registered entry: ``drafter`` is what proposes).
    """
    spec_config = SpeculativeConfig.from_any(spec)
    if drafter is not None:
        check_protocol(drafter, type(drafter).__name__)
        if spec_config is None:
            spec_config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    if runner is None:
        runner = FakeRunner(num_kv_blocks, block_size)
    parts = EngineParts(
        model=None,
        model_cfg=fake_model_config(max(max_model_len, 1024), eos_token_ids),
        drafter=drafter,
        max_model_len=max_model_len,
        num_kv_blocks=num_kv_blocks,
        runner=runner,  # type: ignore[arg-type]
        generator=torch.Generator().manual_seed(0),
    )
    return LLMEngine.from_parts(
        parts,
        CacheConfig(
            block_size=block_size, num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching
        ),
        SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_model_len),
        spec_config,
    )


def run_requests(
    engine: LLMEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    request_ids: Sequence[str] | None = None,
    max_steps: int = 10_000,
) -> list[Request]:
    """Add one request per prompt (ids ``"0", "1", ...`` unless given) and step until none is left;
    returns the requests (finished)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = [str(i) for i in range(len(prompts))] if request_ids is None else list(request_ids)
    reqs = [engine.add_request(rid, list(p), sp) for rid, p, sp in zip(ids, prompts, params)]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"no end after {max_steps} steps: {reqs}")
    return reqs


def run(
    engine: LLMEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    request_ids: Sequence[str] | None = None,
) -> list[list[int]]:
    """:func:`run_requests`, returning each request's output tokens."""
    return [r.output_token_ids for r in run_requests(engine, prompts, params, request_ids)]


def assert_all_freed(engine: LLMEngine) -> None:
    """Every KV block is back in the pool and the pool's bookkeeping is consistent."""
    assert engine.kv.num_free_blocks == engine.num_kv_blocks
    engine.kv.pool.check_invariants()
    assert not engine.scheduler.has_unfinished_requests()
