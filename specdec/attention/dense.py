"""Attention without a KV cache, for training learned drafters on whole sequences.

Every request of the flattened batch is a complete sequence (``seq_lens == query_lens``); its new tokens
attend causally to each other (or through its ``new_token_masks`` entry). Nothing is written to a cache,
so the op is differentiable; the engine never uses this backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.attention.base import AttentionMetadata
from specdec.attention.reference import explicit_attention, new_token_positions, window_allowed


class DenseAttention:
    """:class:`~specdec.attention.base.AttentionBackend` for cache-free, differentiable forwards.

    Raises:
        ValueError: a request has context in the cache (``seq_lens != query_lens``).
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """``query`` ``[T, H, D]``, ``key``/``value`` ``[T, KVH, D]`` -> ``[T, H, D]``; caches are ignored;
        ``sliding_window``/``softcap`` as :class:`~specdec.attention.base.AttentionBackend`."""
        if metadata.query_lens != metadata.seq_lens_host:
            raise ValueError("DenseAttention takes whole sequences only (no cached context)")
        gqa = query.shape[1] != key.shape[1]
        outs = []
        start = 0
        masks = metadata.new_token_masks
        for b, n in enumerate(metadata.query_lens):
            q = query[start : start + n].transpose(0, 1)
            k = key[start : start + n].transpose(0, 1)
            v = value[start : start + n].transpose(0, 1)
            custom = None if masks is None else masks[b]
            mask = None if custom is None else custom.to(device=q.device, dtype=torch.bool)
            if sliding_window is not None and n > sliding_window:
                pos = new_token_positions(n, 0, custom)
                inside = window_allowed(pos, pos, sliding_window).to(q.device)
                mask = inside & (torch.ones_like(inside).tril_() if mask is None else mask)
            if softcap is not None:
                o = explicit_attention(q, k, v, mask, scale, softcap)
            elif mask is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
            outs.append(o.transpose(0, 1))
            start += n
        return torch.cat(outs)


def dense_metadata(seq_lens: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata of whole sequences of ``seq_lens`` tokens for :class:`DenseAttention` (no cache)."""
    qsl = [0]
    for n in seq_lens:
        qsl.append(qsl[-1] + n)
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=device),
        seq_lens=lens,
        slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=device),
        block_table=torch.zeros(len(seq_lens), 1, dtype=torch.int64, device=device),
        query_lens=list(seq_lens),
        seq_lens_host=list(seq_lens),
    )
