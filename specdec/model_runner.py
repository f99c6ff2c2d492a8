"""Turns a scheduler step into one flattened forward of the model over the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.attention.base import AttentionBackend, AttentionMetadata
from specdec.attention.reference import ReferenceAttention
from specdec.errors import ConfigError
from specdec.models.decoder import DecoderLM
from specdec.quantization.kv_cache import allocate_kv_caches, kv_bytes_per_token
from specdec.scheduler import ScheduledRequest

if TYPE_CHECKING:
    from specdec.compilation.compiled_model import CompiledDecoder, CompileStats
    from specdec.compilation.cuda_graphs import CudaGraphRunner, CudaGraphStats
    from specdec.config import CompilationConfig


@dataclass
class ModelInputs:
    """A flattened batch. T = new tokens, B = requests, R = rows whose logits are wanted.

    Attributes:
        input_ids: ``[T]`` int64.
        positions: ``[T]`` int64, position of each token in its sequence.
        metadata: attention metadata (query_start_loc ``[B + 1]``, seq_lens ``[B]``, slot_mapping
            ``[T]``, block_table ``[B, max_blocks]``).
        logits_indices: ``[R]`` int64 rows of the batch whose logits are computed.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor


@dataclass
class Segment:
    """One request's new tokens in a flattened batch.

    Attributes:
        block_ids: the request's block table; leading entries may be
            :data:`~specdec.kv_cache.manager.RELEASED` (blocks behind a sliding window, never read).
        start: position of the first new token.
        token_ids: the new tokens; their K/V is written at the slots of positions ``start,
            start + 1, ...`` of the block table.
        num_logits: logits wanted for the last ``num_logits`` new tokens.
        positions: the tokens' positions when they are not ``start, start + 1, ...`` (a token tree's
            nodes share positions by depth); None for consecutive positions.
        mask: ``[len(token_ids), len(token_ids)]`` bool attention mask among the new tokens (a tree
            attention mask); None for causal.
        num_drafts: how many of the new tokens (the last ones) are drafts to verify
            (:attr:`~kernels.attention_metadata.AttentionMetadata.draft_lens`).
    """

    block_ids: list[int]
    start: int
    token_ids: list[int]
    num_logits: int
    positions: list[int] | None = None
    mask: torch.Tensor | None = None
    num_drafts: int = 0


#: Batches of at most this many new tokens are built from Python lists (:func:`_list_inputs`).
LIST_INPUTS_MAX_TOKENS = 256


def build_inputs(segments: list[Segment], block_size: int, device: torch.device) -> ModelInputs:
    """Flattened model inputs for ``segments``; slots come from each segment's block table.

    A batch of at most :data:`LIST_INPUTS_MAX_TOKENS` new tokens (decode rows, verification chains and
    trees, small prefill chunks) takes :func:`_list_inputs`: every field from Python lists, the
    one-dimensional ones in one ``torch.tensor`` split into views, the block table in another (a chain of 5
    tokens: 0.05 instead of 0.25 ms here). Larger ones take
    :func:`_batch_inputs`, vectorised over the batch (one ``torch.tensor`` per field, slots and rows by
    tensor arithmetic), so thousands of tokens per step stay cheap. The two give equal fields (tested).

    Raises:
        RuntimeError: a new token's slot in a block released behind the sliding window.
    """
    if sum(len(seg.token_ids) for seg in segments) <= LIST_INPUTS_MAX_TOKENS:
        return _list_inputs(segments, block_size, device)
    return _batch_inputs(segments, block_size, device)


def _batch_inputs(segments: list[Segment], bs: int, device: torch.device) -> ModelInputs:
    """:func:`build_inputs` of any segments."""
    num_segs = len(segments)
    query_lens = [len(seg.token_ids) for seg in segments]
    starts = [seg.start for seg in segments]
    seq_lens = [st + n for st, n in zip(starts, query_lens)]
    max_blocks = max(len(seg.block_ids) for seg in segments)
    block_table = torch.tensor(
        [seg.block_ids + [0] * (max_blocks - len(seg.block_ids)) for seg in segments], dtype=torch.int64
    )
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    qsl = torch.zeros(num_segs + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=qsl[1:])
    seg_of_token = torch.repeat_interleave(torch.arange(num_segs), q_lens)  # [T]
    offsets = torch.arange(int(qsl[-1])) - qsl[seg_of_token]
    consecutive = torch.tensor(starts, dtype=torch.int64)[seg_of_token] + offsets  # [T] cache positions
    slots = block_table[seg_of_token, consecutive // bs] * bs + consecutive % bs
    if any(seg.block_ids and seg.block_ids[0] < 0 for seg in segments):
        # Entries released behind a sliding window (``kv_cache.manager.RELEASED``, a prefix of the table):
        # no new token may be written there, and the attention, which never reads them unmasked, sees
        # block 0 instead.
        if bool((slots < 0).any()):
            raise RuntimeError("a new token's slot lies in a block released behind the sliding window")
        block_table.clamp_(min=0)
    positions = consecutive
    if any(seg.positions is not None for seg in segments):  # token trees: nodes share positions by depth
        positions = consecutive.clone()
        for seg, start in zip(segments, qsl.tolist()):
            if seg.positions is not None:
                positions[start : start + len(seg.positions)] = torch.tensor(seg.positions, dtype=torch.int64)
    num_logits = torch.tensor([seg.num_logits for seg in segments], dtype=torch.int64)
    seg_of_row = torch.repeat_interleave(torch.arange(num_segs), num_logits)  # [R]
    row_starts = torch.cumsum(num_logits, 0) - num_logits
    logits_rows = (
        qsl[1:][seg_of_row]
        - num_logits[seg_of_row]
        + (torch.arange(len(seg_of_row)) - row_starts[seg_of_row])
    )
    metadata = AttentionMetadata(
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        slot_mapping=slots.to(device),
        block_table=block_table.to(device),
        query_lens=query_lens,
        seq_lens_host=seq_lens,
        new_token_masks=None if all(s.mask is None for s in segments) else [s.mask for s in segments],
        draft_lens=_draft_lens(segments),
    )
    return ModelInputs(
        input_ids=torch.tensor(
            [t for seg in segments for t in seg.token_ids], dtype=torch.int64, device=device
        ),
        positions=positions.to(device),
        metadata=metadata,
        logits_indices=logits_rows.to(device),
    )


def _draft_lens(segments: list[Segment]) -> list[int] | None:
    return [seg.num_drafts for seg in segments] if any(seg.num_drafts for seg in segments) else None


def _list_inputs(segments: list[Segment], bs: int, device: torch.device) -> ModelInputs:
    """:func:`build_inputs` of a small batch, every field from Python lists: the one-dimensional fields
    in one ``torch.tensor`` (views of it; a draft head's decode row: 31 -> 20 us here), the block table in
    another."""
    query_lens = [len(seg.token_ids) for seg in segments]
    seq_lens = [seg.start + n for seg, n in zip(segments, query_lens)]
    max_blocks = max(len(seg.block_ids) for seg in segments)
    qsl, slots, positions, rows, ids = [0], [], [], [], []
    for seg, n in zip(segments, query_lens):
        table = seg.block_ids
        for p in range(seg.start, seg.start + n):
            block = table[p // bs]
            if block < 0:  # released behind a sliding window (``kv_cache.manager.RELEASED``)
                raise RuntimeError("a new token's slot lies in a block released behind the sliding window")
            slots.append(block * bs + p % bs)
        given = list(seg.positions) if seg.positions is not None else []  # a tree's positions by depth
        positions.extend(given + list(range(seg.start + len(given), seg.start + n)))
        rows.extend(range(qsl[-1] + n - seg.num_logits, qsl[-1] + n))
        qsl.append(qsl[-1] + n)
        ids.extend(seg.token_ids)
    # Released entries (a prefix of the table) read as block 0: the attention never reads them unmasked.
    table_rows = [
        (seg.block_ids if not seg.block_ids or seg.block_ids[0] >= 0 else [max(b, 0) for b in seg.block_ids])
        + [0] * (max_blocks - len(seg.block_ids))
        for seg in segments
    ]
    t, b, r = len(ids), len(segments), len(rows)
    flat = torch.tensor(ids + positions + slots + rows + qsl + seq_lens, dtype=torch.int64, device=device)
    input_ids, positions_t, slot_mapping, logits_rows, qsl_t, seq_lens_t = flat.split((t, t, t, r, b + 1, b))
    metadata = AttentionMetadata(
        query_start_loc=qsl_t,
        seq_lens=seq_lens_t,
        slot_mapping=slot_mapping,
        block_table=torch.tensor(table_rows, dtype=torch.int64, device=device),
        query_lens=query_lens,
        seq_lens_host=seq_lens,
        new_token_masks=None if all(s.mask is None for s in segments) else [s.mask for s in segments],
        draft_lens=_draft_lens(segments),
    )
    return ModelInputs(
        input_ids=input_ids, positions=positions_t, metadata=metadata, logits_indices=logits_rows
    )


def select_attention_backend(
    device: torch.device, choice: AttentionBackend | str | None = None, kv_cache_dtype: str = "auto"
) -> AttentionBackend:
    """The attention backend for a model on ``device``.

    Args:
        device: where the model runs.
        choice: a backend instance (used as is), ``"triton"``, ``"cpu"``, ``"reference"``, or None /
            ``"auto"``: Triton (:class:`~specdec.attention.triton_backend.TritonAttention`) on CUDA when
            triton imports, the CPU kernel backend (:class:`~specdec.attention.cpu_backend.CpuAttention`)
            on the CPU when its kernel builds, the pure-torch reference otherwise (and everywhere with
            ``SPECDEC_FORCE_REFERENCE=1``).
        kv_cache_dtype: ``"int8"`` is read and written by the reference only: ``"auto"`` then picks it
            (also on CUDA).

    Raises:
        ValueError: an unknown backend name.
        ConfigError: ``"triton"`` or ``"cpu"`` asked for with an int8 KV cache.
    """
    if choice is not None and not isinstance(choice, str):
        return choice
    name = choice or "auto"
    if kv_cache_dtype == "int8":
        if name in ("triton", "cpu"):
            raise ConfigError(
                "kv_cache_dtype='int8' is implemented by the reference attention backend only; "
                f"use attention='reference' (or 'auto') or kv_cache_dtype='auto' with {name!r}"
            )
        name = "reference" if name == "auto" else name
    if name == "auto":
        from kernels._triton import force_reference, triton_available

        if device.type == "cuda":
            name = "triton" if triton_available() and not force_reference() else "reference"
        else:
            from kernels import cpu_attention

            name = "cpu" if device.type == "cpu" and cpu_attention.available() else "reference"
    if name == "triton":
        from specdec.attention.triton_backend import TritonAttention

        return TritonAttention()
    if name == "cpu":
        from specdec.attention.cpu_backend import CpuAttention

        return CpuAttention()
    if name == "reference":
        return ReferenceAttention()
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'triton', 'cpu' or 'reference'")


class ModelRunner:
    """Holds the model and its KV cache tensors; runs flattened batches.

    Args:
        model: the decoder.
        num_blocks: KV blocks in the pool.
        block_size: tokens per block.
        attention: attention backend, an instance or a name (see :func:`select_attention_backend`;
            default: Triton kernels on CUDA, the pure-torch reference elsewhere).
        kv_cache_dtype: ``"auto"`` (the model's dtype) or ``"int8"`` (see
            :mod:`specdec.quantization.kv_cache`).
        compilation: compile the forward piecewise, one graph per token bucket (see
            :mod:`specdec.compilation`), and / or replay steps from CUDA graphs
            (``compilation.cuda_graphs``, :mod:`specdec.compilation.cuda_graphs`); None runs the eager
            model.
        kv_caches: per layer ``(k_cache, v_cache)`` to read and write instead of allocating them: another
            runner's, of the same shapes (the quantized self-drafter on the target's caches); None
            allocates zero-filled ones.
        kv_zeros: allocates the zero-filled caches on the CPU (``zeros(shape, dtype)``, e.g.
            :func:`specdec.engine.huge_pages.zeros_on_huge_pages`); None: ``torch.zeros``.

    The model's :attr:`~specdec.models.decoder.DecoderLM.feature_layers` (EAGLE-3's fused layers) are the
    runner's: taken when it is built and put back on the model before each forward where another engine
    over the same model (``LLM.with_speculation``) changed them.

    Raises:
        ConfigError: ``cuda_graphs`` on a model not on CUDA, or with an attention backend that cannot run
            in graphs (the reference).
    """

    def __init__(
        self,
        model: DecoderLM,
        num_blocks: int,
        block_size: int,
        attention: AttentionBackend | str | None = None,
        kv_cache_dtype: str = "auto",
        compilation: CompilationConfig | None = None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        kv_zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        #: What this runner's forwards return as features (the model's setting when it was built).
        self.feature_layers: tuple[int, ...] = tuple(getattr(model, "feature_layers", ()))
        self.block_size = block_size
        cfg = model.cfg
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.attention = select_attention_backend(self.device, attention, kv_cache_dtype)
        if kv_caches is None:
            kv_caches = allocate_kv_caches(
                cfg, num_blocks, block_size, self.dtype, self.device, kv_cache_dtype, kv_zeros
            )
        else:
            want = allocate_kv_caches(cfg, 1, block_size, self.dtype, "meta", kv_cache_dtype)[0][0]
            if len(kv_caches) != cfg.num_layers or any(
                c.shape[1:] != want.shape[1:] or c.shape[0] != num_blocks or c.dtype != want.dtype
                for layer in kv_caches
                for c in layer
            ):
                raise ValueError(
                    f"kv_caches: {len(kv_caches)} layers' caches of shape {tuple(kv_caches[0][0].shape)}, "
                    f"{kv_caches[0][0].dtype}; the model needs {cfg.num_layers} of "
                    f"{(num_blocks, *want.shape[1:])}, {want.dtype}"
                )
        self.kv_caches = kv_caches
        #: The forward run by :meth:`execute`: the model, or its compiled form.
        self.forward: DecoderLM | CompiledDecoder = model
        if compilation is not None and compilation.enabled:
            from specdec.compilation.compiled_model import CompiledDecoder

            self.forward = CompiledDecoder(model, compilation.buckets or (), compilation.backend)
        #: Replays decode and chain-verification steps from CUDA graphs (None: off).
        self.cuda_graphs: CudaGraphRunner | None = None
        if compilation is not None and compilation.cuda_graphs:
            self.cuda_graphs = self._graph_runner(compilation, num_blocks)

    def _graph_runner(self, compilation: CompilationConfig, num_blocks: int) -> CudaGraphRunner:
        """Raises ConfigError (from :class:`CudaGraphRunner`): no CUDA, or a backend other than Triton."""
        from specdec.compilation.cuda_graphs import CudaGraphRunner

        cfg = self.model.cfg
        return CudaGraphRunner(
            self.forward, self.kv_caches, self.attention, cfg.num_heads, cfg.num_kv_heads, num_blocks,
            compilation.cuda_graph_batch_sizes or (), compilation.cuda_graph_max_query_len,
        )  # fmt: skip

    @property
    def cuda_graph_stats(self) -> CudaGraphStats | None:
        """Graphs captured and forwards replayed / run eagerly; None when CUDA graphs are off."""
        return None if self.cuda_graphs is None else self.cuda_graphs.stats

    @property
    def compile_stats(self) -> CompileStats | None:
        """Compilations and compiled/eager calls so far; None when the forward is not compiled."""
        return getattr(self.forward, "stats", None)

    @staticmethod
    def kv_bytes_per_block(
        model: DecoderLM, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> int:
        return block_size * kv_bytes_per_token(model.cfg, dtype, kv_cache_dtype)

    def prepare(self, scheduled: list[ScheduledRequest]) -> ModelInputs:
        """Flatten the scheduled requests: each contributes its committed new tokens followed by its
        draft tokens. Logits rows: for a request that samples, its last committed token and every draft
        (``1 + len(drafts)`` rows, the verification rows); none for a prefill chunk that does not.

        A token tree's nodes take the slots after the committed tokens in node order, positions by
        depth, and the tree attention mask."""
        segments = []
        for s in scheduled:
            req = s.request
            start = req.num_computed_tokens
            n = s.num_new_tokens
            tokens = req.token_ids[start : start + n] + list(s.draft_token_ids)
            num_logits = 1 + len(s.draft_token_ids) if s.sample else 0
            seg = Segment(req.block_ids, start, tokens, num_logits, num_drafts=len(s.draft_token_ids))
            tree = s.draft_tree
            if tree is not None:
                root = start + n - 1
                seg.positions = list(range(start, start + n)) + [root + d for d in tree.position_offsets()]
                seg.mask = tree.attention_mask(num_prefix=n).to(self.device)
            segments.append(seg)
        return build_inputs(segments, self.block_size, self.device)

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs) -> torch.Tensor:
        """Run the forward; returns ``[R, vocab_size]`` float32 logits at ``inputs.logits_indices``."""
        self._own_feature_layers()
        if self.cuda_graphs is not None:
            out = self.cuda_graphs.run(
                inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices, False
            )
            if out is not None:
                return out[0]
        logits, _ = self.forward(
            inputs.input_ids,
            inputs.positions,
            self.kv_caches,
            inputs.metadata,
            self.attention,
            inputs.logits_indices,
        )
        return logits

    @torch.inference_mode()
    def execute_with_hidden(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the forward; returns the logits ``[R, vocab_size]`` float32 at ``inputs.logits_indices``
        and the final-norm hidden states of every row ``[T, hidden_size]`` (for learned drafters)."""
        self._own_feature_layers()
        if self.cuda_graphs is not None:
            out = self.cuda_graphs.run(
                inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices, True
            )
            if out is not None:
                return out
        return self.forward(
            inputs.input_ids,
            inputs.positions,
            self.kv_caches,
            inputs.metadata,
            self.attention,
            inputs.logits_indices,
            all_hidden=True,
        )

    def _own_feature_layers(self) -> None:
        """Put this runner's feature layers back on a model shared with another engine that set its own."""
        if getattr(self.model, "feature_layers", ()) != self.feature_layers:
            self.model.set_feature_layers(self.feature_layers)

    @torch.inference_mode()
    def copy_slots(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copy single tokens' K/V in every layer: slot ``dst_slots[i]`` gets slot ``src_slots[i]``'s
        (compaction of a token tree's accepted path onto consecutive positions). All sources are read
        before any destination is written, so a destination may be another pair's source.

        Raises:
            ValueError: the lists differ in length, or a destination is repeated.
        """
        if len(src_slots) != len(dst_slots):
            raise ValueError(f"{len(src_slots)} source slots but {len(dst_slots)} destinations")
        if len(set(dst_slots)) != len(dst_slots):
            raise ValueError("destination slots must be distinct")
        if not src_slots:
            return
        src = torch.tensor(src_slots, dtype=torch.int64, device=self.device)
        dst = torch.tensor(dst_slots, dtype=torch.int64, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, cache.shape[2], cache.shape[3])
                flat.index_copy_(0, dst, flat.index_select(0, src))

    @torch.inference_mode()
    def copy_blocks(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Copy the K/V of whole blocks, in every layer: block ``dst_block_ids[i]`` becomes a copy of block
        ``src_block_ids[i]`` (the copy-on-write of a forked sequence's partly filled last block).

        Raises:
            ValueError: the lists differ in length, or a destination is also a source or repeated.
        """
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError(f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destinations")
        if len(set(dst_block_ids)) != len(dst_block_ids) or set(dst_block_ids) & set(src_block_ids):
            raise ValueError("destination blocks must be distinct and not among the sources")
        if not src_block_ids:
            return
        src = torch.tensor(src_block_ids, dtype=torch.int64, device=self.device)
        dst = torch.tensor(dst_block_ids, dtype=torch.int64, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
