"""Turns a scheduler step into one flattened forward of the model over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.attention.base import AttentionBackend, AttentionMetadata
from specdec.attention.reference import ReferenceAttention
from specdec.errors import ConfigError
from specdec.models.decoder import DecoderLM
from specdec.quantization.kv_cache import allocate_kv_caches, kv_bytes_per_token
from specdec.scheduler import ScheduledRequest


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
        block_ids: the request's block table.
        start: position of the first new token.
        token_ids: the new tokens; their K/V is written at the slots of positions ``start,
            start + 1, ...`` of the block table.
        num_logits: logits wanted for the last ``num_logits`` new tokens.
        positions: the tokens' positions when they are not ``start, start + 1, ...`` (a token tree's
            nodes share positions by depth); None for consecutive positions.
        mask: ``[len(token_ids), len(token_ids)]`` bool attention mask among the new tokens (a tree
            attention mask); None for causal.
    """

    block_ids: list[int]
    start: int
    token_ids: list[int]
    num_logits: int
    positions: list[int] | None = None
    mask: torch.Tensor | None = None


def build_inputs(segments: list[Segment], block_size: int, device: torch.device) -> ModelInputs:
    """Flattened model inputs for ``segments``; slots come from each segment's block table."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    logits_rows: list[int] = []
    for seg in segments:
        n, start, table = len(seg.token_ids), seg.start, seg.block_ids
        input_ids.extend(seg.token_ids)
        positions.extend(range(start, start + n) if seg.positions is None else seg.positions)
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        query_lens.append(n)
        seq_lens.append(start + n)
        logits_rows.extend(range(len(input_ids) - seg.num_logits, len(input_ids)))
    max_blocks = max(len(seg.block_ids) for seg in segments)
    block_table = torch.zeros(len(segments), max_blocks, dtype=torch.int64)
    for i, seg in enumerate(segments):
        block_table[i, : len(seg.block_ids)] = torch.tensor(seg.block_ids, dtype=torch.int64)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_table=block_table.to(device),
        query_lens=query_lens,
        seq_lens_host=seq_lens,
        new_token_masks=None if all(s.mask is None for s in segments) else [s.mask for s in segments],
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        metadata=metadata,
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
    )


def select_attention_backend(
    device: torch.device, choice: AttentionBackend | str | None = None, kv_cache_dtype: str = "auto"
) -> AttentionBackend:
    """The attention backend for a model on ``device``.

    Args:
        device: where the model runs.
        choice: a backend instance (used as is), ``"triton"``, ``"reference"``, or None / ``"auto"``:
            Triton (:class:`~specdec.attention.triton_backend.TritonAttention`) on CUDA when triton
            imports and ``SPECDEC_FORCE_REFERENCE`` is not set, the pure-torch reference otherwise.
        kv_cache_dtype: ``"int8"`` is read and written by the reference only: ``"auto"`` then picks it
            (also on CUDA).

    Raises:
        ValueError: an unknown backend name.
        ConfigError: ``"triton"`` asked for with an int8 KV cache.
    """
    if choice is not None and not isinstance(choice, str):
        return choice
    name = choice or "auto"
    if kv_cache_dtype == "int8":
        if name == "triton":
            raise ConfigError(
                "kv_cache_dtype='int8' is implemented by the reference attention backend only; "
                "use attention='reference' (or 'auto') or kv_cache_dtype='auto' with Triton"
            )
        name = "reference" if name == "auto" else name
    if name == "auto":
        from kernels._triton import force_reference, triton_available

        use = device.type == "cuda" and triton_available() and not force_reference()
        name = "triton" if use else "reference"
    if name == "triton":
        from specdec.attention.triton_backend import TritonAttention

        return TritonAttention()
    if name == "reference":
        return ReferenceAttention()
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'triton' or 'reference'")


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
    """

    def __init__(
        self,
        model: DecoderLM,
        num_blocks: int,
        block_size: int,
        attention: AttentionBackend | str | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model
        self.block_size = block_size
        cfg = model.cfg
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.attention = select_attention_backend(self.device, attention, kv_cache_dtype)
        self.kv_caches = allocate_kv_caches(
            cfg, num_blocks, block_size, self.dtype, self.device, kv_cache_dtype
        )

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
            seg = Segment(req.block_ids, start, tokens, num_logits)
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
        logits, _ = self.model(
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
        return self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_caches,
            inputs.metadata,
            self.attention,
            inputs.logits_indices,
            all_hidden=True,
        )

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
