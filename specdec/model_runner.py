"""Turns a scheduler step into one flattened forward of the model over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.attention.base import AttentionBackend, AttentionMetadata
from specdec.attention.reference import ReferenceAttention
from specdec.models.decoder import DecoderLM
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
        token_ids: the new tokens (their K/V is written at positions ``start...``).
        num_logits: logits wanted for the last ``num_logits`` new tokens.
    """

    block_ids: list[int]
    start: int
    token_ids: list[int]
    num_logits: int


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
        positions.extend(range(start, start + n))
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
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        metadata=metadata,
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
    )


class ModelRunner:
    """Holds the model and its KV cache tensors; runs flattened batches.

    Args:
        model: the decoder.
        num_blocks: KV blocks in the pool.
        block_size: tokens per block.
        attention: attention backend (default: the pure-torch reference).
    """

    def __init__(
        self,
        model: DecoderLM,
        num_blocks: int,
        block_size: int,
        attention: AttentionBackend | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.attention = attention or ReferenceAttention()
        cfg = model.cfg
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zero-filled: padded reads of unused slots are masked, and 0 * finite stays finite.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]

    @staticmethod
    def kv_bytes_per_block(model: DecoderLM, block_size: int, dtype: torch.dtype) -> int:
        cfg = model.cfg
        elem = torch.tensor([], dtype=dtype).element_size()
        return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def prepare(self, scheduled: list[ScheduledRequest]) -> ModelInputs:
        """Flatten the scheduled requests: each contributes its committed new tokens followed by its
        draft tokens. Logits rows: for a request that samples, its last committed token and every draft
        (``1 + len(drafts)`` rows, the verification rows); none for a prefill chunk that does not."""
        segments = []
        for s in scheduled:
            req = s.request
            start = req.num_computed_tokens
            tokens = req.token_ids[start : start + s.num_new_tokens] + list(s.draft_token_ids)
            num_logits = 1 + len(s.draft_token_ids) if s.sample else 0
            segments.append(Segment(req.block_ids, start, tokens, num_logits))
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
