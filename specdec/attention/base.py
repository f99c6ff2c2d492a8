"""Attention metadata for a flattened variable-length batch, and the attention backend Protocol.

One forward mixes prefill chunks, decode tokens and (later) draft verification segments: the new tokens
of every scheduled request are concatenated into one ``[num_tokens]`` axis. Request ``b`` owns rows
``query_start_loc[b]:query_start_loc[b + 1]``; after this forward its sequence holds ``seq_lens[b]``
tokens of KV, the last ``query_len = seq_lens[b] - context_len`` of which are the new ones.

The K/V of token ``t`` is written into the paged cache at ``slot_mapping[t]`` (block id × block size +
offset in block); slot mapping is the only interface between the model and the cache.

:class:`AttentionMetadata` is defined in :mod:`kernels.attention_metadata` (the kernels read it, and
``kernels`` imports no package above it, see ``docs/layers.md``) and re-exported here.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.attention_metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata"]


class AttentionBackend(Protocol):
    """Paged attention over a flattened batch. Implementations: ``ReferenceAttention`` (pure torch, the
    ground truth and CPU path); Triton kernels register here for CUDA."""

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
        """Write the new K/V into the cache, then attend.

        Args:
            query: ``[T, num_heads, head_dim]``, RoPE applied.
            key, value: ``[T, num_kv_heads, head_dim]``, RoPE applied to ``key``.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, updated in place.
            metadata: the flattened batch.
            scale: softmax scale, usually ``head_dim ** -0.5`` (Gemma: ``query_pre_attn_scalar ** -0.5``).
            sliding_window: the layer's window in positions: a query at position p sees key positions
                j with ``p - sliding_window < j <= p`` (HF ``sliding_window``, Mistral / Gemma); None: all.
            softcap: scaled scores s become ``softcap * tanh(s / softcap)`` before the mask (HF
                ``attn_logit_softcapping``, Gemma 2); None: off. Decoder layers pass these two keywords
                only when set, so a backend without them still serves the families that need neither.

        Returns:
            ``[T, num_heads, head_dim]`` attention output.
        """
        ...
