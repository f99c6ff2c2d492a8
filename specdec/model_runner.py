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

    def prepare(self, scheduled: list[ScheduledRequest], all_logits: bool = False) -> ModelInputs:
        """Flatten the scheduled requests' new tokens; logits rows are the last row of each sampling
        request (or every row when ``all_logits``)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        for s in scheduled:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            input_ids.extend(req.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = req.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            if all_logits:
                logits_rows.extend(range(len(input_ids) - n, len(input_ids)))
            elif s.sample:
                logits_rows.append(len(input_ids) - 1)
        max_blocks = max(len(s.request.block_ids) for s in scheduled)
        block_table = torch.zeros(len(scheduled), max_blocks, dtype=torch.int64)
        for i, s in enumerate(scheduled):
            block_table[i, : len(s.request.block_ids)] = torch.tensor(s.request.block_ids)
        dev = self.device
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=block_table.to(dev),
            query_lens=query_lens,
            seq_lens_host=seq_lens,
        )
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            metadata=metadata,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
        )

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
