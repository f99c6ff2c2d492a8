"""Triton attention backend: :mod:`kernels.reshape_and_cache` + :mod:`kernels.paged_attention`.

The engine's CUDA path (``ModelRunner`` picks it for a model on CUDA). On a CPU it runs only in Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the tests compare it with
:class:`~specdec.attention.reference.ReferenceAttention`. Kernels are imported at the first forward, so
importing this module fixes nothing about the interpreter mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.attention.base import AttentionMetadata


@dataclass
class _Plan:
    """What every layer of one forward shares: the packed tree masks and the launch shape."""

    tree_mask: object | None  # kernels.paged_attention.PackedTreeMask
    max_query_len: int
    num_splits: int


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class TritonAttention:
    """Triton :class:`~specdec.attention.base.AttentionBackend`: writes K/V with one kernel, attends with
        one (plus a merge kernel when a long-context decode batch is split along the keys). Sliding windows
    (positions from the tree's depths under tree masks) and soft-capping go to the kernel."""

    @staticmethod
    def _plan(metadata: AttentionMetadata, num_heads: int, num_kv_heads: int, device: torch.device) -> _Plan:
        """The forward's launch plan, computed once per metadata (cached in ``metadata.backend_cache``)."""
        from kernels.paged_attention import choose_block_m, choose_num_splits, pack_new_token_masks

        plan = metadata.backend_cache.get("triton")
        if plan is None:
            max_q = max(metadata.query_lens, default=0)
            block_q = choose_block_m(num_heads // num_kv_heads, max_q) // (num_heads // num_kv_heads)
            programs = sum(-(-q // block_q) for q in metadata.query_lens) * num_kv_heads
            plan = metadata.backend_cache["triton"] = _Plan(
                tree_mask=pack_new_token_masks(metadata.new_token_masks, metadata.query_lens, device),
                max_query_len=max_q,
                num_splits=choose_num_splits(
                    programs, max_q, max(metadata.seq_lens_host, default=0), _num_sms(device)
                ),
            )
        return plan

    def cuda_graph_key(
        self, metadata: AttentionMetadata, num_heads: int, num_kv_heads: int
    ) -> tuple[int, int]:
        """The launch choices a forward over ``metadata`` takes from host values: ``(max_query_len,
        num_splits)``. A CUDA graph captured for one key replays correctly for any metadata of the same
        key and shapes (:mod:`specdec.compilation.cuda_graphs`): the kernels read lengths, slots and
        block tables from device memory."""
        device = metadata.seq_lens.device
        plan = self._plan(metadata, num_heads, num_kv_heads, device)
        return plan.max_query_len, plan.num_splits

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """As :class:`~specdec.attention.base.AttentionBackend`."""
        from kernels.paged_attention import paged_attention_triton
        from kernels.reshape_and_cache import reshape_and_cache_triton

        reshape_and_cache_triton(key, value, k_cache, v_cache, metadata.slot_mapping)
        plan = self._plan(metadata, query.shape[1], k_cache.shape[2], query.device)
        return paged_attention_triton(
            query,
            k_cache,
            v_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            scale,
            plan.tree_mask,  # type: ignore[arg-type]
            sliding_window=sliding_window or 0,
            softcap=softcap or 0.0,
            max_query_len=plan.max_query_len,
            num_splits=plan.num_splits,
        )
