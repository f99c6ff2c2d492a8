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

from dataclasses import dataclass

import torch

from kernels import cpu_attention
from kernels.attention_metadata import AttentionMetadata
from specdec.attention.reference import ReferenceAttention, _Plan

__all__ = ["CpuAttention"]


@dataclass
class _ShortBatch:
    """The kernel's view of the short-query requests (``m`` of them), built once per forward."""

    reqs: torch.Tensor  # [m] int64, row of the block table
    q_start: torch.Tensor  # [m] int64, first flattened row
    q_len: torch.Tensor  # [m] int64
    seq_len: torch.Tensor  # [m] int64
    mask_offset: torch.Tensor  # [m] int64, -1 for causal
    masks: torch.Tensor  # [*] uint8, tree attention masks flattened
    block_table: torch.Tensor  # [B, max_blocks] int64, rows contiguous


def _short_batch(metadata: AttentionMetadata, plan: _Plan) -> _ShortBatch:
    columns = torch.tensor(plan.short, dtype=torch.int64).T.contiguous()  # [4, m]: b, start, q_len, seq_len
    offsets, flat, at = [], [], 0
    masks = metadata.new_token_masks
    for b, _, q_len, _ in plan.short:
        mask = None if masks is None else masks[b]
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
    return _ShortBatch(
        columns[0], columns[1], columns[2], columns[3], torch.tensor(offsets), packed, block_table
    )


class CpuAttention(ReferenceAttention):
    """:class:`~specdec.attention.base.AttentionBackend` for the CPU: the reference with short queries
    attended by the C++ kernel (see the module docstring)."""

    plan_key = "cpu"
    batch_short = False

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
