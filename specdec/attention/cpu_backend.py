"""The CPU attention backend: prefill chunks through the reference's SDPA calls, short queries (decode,
verification chains and token trees) and the K/V writes through the C++ kernels of
:mod:`kernels.cpu_attention`.

Sliding windows and soft-capped scores (Mistral, Gemma) are applied by the kernel too (same rules as the
reference: positions from tree depths, keys before the window not read).

Chosen by ``attention="auto"`` on the CPU when the kernel builds and the KV cache is in the model's dtype
(an int8 cache keeps the reference); ``attention="cpu"`` asks for it by name. Output equals the
reference's within float32 rounding (``tests/kernels/test_cpu_attention.py``).
"""

from __future__ import annotations

import torch

from kernels import cpu_attention
from kernels.attention_metadata import AttentionMetadata
from kernels.cpu_attention import PromptChunk, ShortQueries
from specdec.attention.reference import ReferenceAttention, _Plan, _plan, short_mask

__all__ = ["CpuAttention"]


_NO_MASKS = torch.empty(0, dtype=torch.uint8)


def _short_batch(metadata: AttentionMetadata, plan: _Plan) -> ShortQueries:
    m = len(plan.short)
    if metadata.new_token_masks is None:  # causal everywhere: no mask to pack (decode rows, chains)
        flat = [v for column in zip(*plan.short) for v in column] + [-1] * m
        b, start, q_len, seq_len, offsets = torch.tensor(flat, dtype=torch.int64).split(m)
        block_table = metadata.block_table
        if block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
        return ShortQueries(block_table, b, start, q_len, seq_len, offsets, _NO_MASKS)
    columns = torch.tensor(plan.short, dtype=torch.int64).T.contiguous()  # [4, m]: b, start, q_len, seq_len
    offsets, flat, at = [], [], 0
    for b, start, q_len, _ in plan.short:
        mask = short_mask(metadata, b, start, q_len)
        if mask is None:
            offsets.append(-1)
            continue
        if tuple(mask.shape) != (q_len, q_len):
            raise ValueError(f"new-token mask must be [{q_len}, {q_len}], got {tuple(mask.shape)}")
        offsets.append(at)
        flat.append(mask.reshape(-1).to(torch.uint8))
        at += q_len * q_len
    packed = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
    block_table = metadata.block_table
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    return ShortQueries(
        block_table, columns[0], columns[1], columns[2], columns[3], torch.tensor(offsets), packed
    )


def _no_short(metadata: AttentionMetadata) -> ShortQueries:
    """A short-query batch of no requests (a forward of prompt chunks only)."""
    none = torch.empty(0, dtype=torch.int64)
    return ShortQueries(metadata.block_table, none, none, none, none, none, _NO_MASKS)


class CpuAttention(ReferenceAttention):
    """:class:`~specdec.attention.base.AttentionBackend` for the CPU: the reference with short queries
    attended by the C++ kernel (see the module docstring)."""

    plan_key = "cpu"
    batch_short = False

    def short_queries(self, metadata: AttentionMetadata, k_cache: torch.Tensor) -> ShortQueries | None:
        """The forward's requests as the short-query kernel reads them when every one is short (decode
        rows, verification chains, token trees: no prefill chunk) and ``k_cache`` (any layer's ``[num_blocks,
        block_size, KVH, D]``) is in a dtype the kernel reads; None otherwise. Computed once per forward
        (:attr:`AttentionMetadata.backend_cache`)."""
        queries = self.stack_queries(metadata, k_cache)
        if queries is None or queries[1] or not queries[0].reqs.numel():
            return None
        return queries[0]

    def stack_queries(
        self, metadata: AttentionMetadata, k_cache: torch.Tensor
    ) -> tuple[ShortQueries, list[PromptChunk]] | None:
        """The forward's requests as the C++ layer stack attends them: the short ones as
        :meth:`short_queries` (possibly none) and the prompt chunks (:class:`PromptChunk`, from the same
        plan as :meth:`ReferenceAttention._prefills` uses: its masks and cache blocks); None where
        ``k_cache``'s dtype is not one the kernel reads. The layers must have no sliding window (the plan's
        masks are the global ones). Computed once per forward (:attr:`AttentionMetadata.backend_cache`);
        :class:`kernels.cpu_decode_stack.DecodeStack` reads it."""
        if k_cache.dtype not in (torch.float32, torch.bfloat16):
            return None
        plan = metadata.backend_cache.get(self.plan_key)
        if plan is None:
            plan = metadata.backend_cache[self.plan_key] = _plan(
                metadata, k_cache.shape[1], k_cache.device, batch_short=self.batch_short
            )
        batch = metadata.backend_cache.get("cpu_short")
        if batch is None:
            batch = metadata.backend_cache["cpu_short"] = (
                _short_batch(metadata, plan) if plan.short else _no_short(metadata)
            )
        chunks = [
            PromptChunk(p.start, p.query_len, p.seq_len - p.key_start, p.blocks, p.mask)
            for p in plan.prefills
        ]
        return batch, chunks

    @staticmethod
    def _write(
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        if key.stride(-1) != 1 or value.stride(-1) != 1:
            key, value = key.contiguous(), value.contiguous()
        cpu_attention.write_kv(key, value, k_cache, v_cache, slots)

    def _short(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: _Plan,
        scale: float,
        out: torch.Tensor,
        softcap: float | None = None,
    ) -> None:
        batch = metadata.backend_cache.get("cpu_short")
        if batch is None:
            batch = metadata.backend_cache["cpu_short"] = _short_batch(metadata, plan)
        cpu_attention.paged_attention_short(
            query.contiguous(), k_cache, v_cache, batch.block_table, batch.reqs, batch.q_start, batch.q_len,
            batch.seq_len, batch.mask_offset, batch.masks, out, scale, plan.window or 0, softcap or 0.0,
        )  # fmt: skip
