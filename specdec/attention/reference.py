"""Reference paged attention in pure torch: gather K/V through the block table, masked SDPA.

This is the CPU path and the ground truth that the Triton kernels are tested against. Requests with a
short query (decode, draft verification: ``query_len <= BATCHED_QUERY_MAX``) are padded into one batched
SDPA call; prefill chunks run one SDPA call each, without padding waste.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.attention.base import AttentionMetadata

#: Requests with at most this many new tokens share one padded, batched SDPA call.
BATCHED_QUERY_MAX = 32


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[T]``; -1 is skipped."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


def _new_token_mask(query_len: int, custom: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if custom is None:
        return torch.ones(query_len, query_len, dtype=torch.bool, device=device).tril_()
    if custom.shape != (query_len, query_len):
        raise ValueError(f"new-token mask must be [{query_len}, {query_len}], got {tuple(custom.shape)}")
    return custom.to(device=device, dtype=torch.bool)


class ReferenceAttention:
    """Pure-torch :class:`~specdec.attention.base.AttentionBackend`."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        gqa = num_heads != num_kv_heads
        block_size = k_cache.shape[1]
        masks = metadata.new_token_masks
        short: list[int] = []
        start = 0
        starts = []
        for b, q_len in enumerate(metadata.query_lens):
            starts.append(start)
            start += q_len
            if q_len <= BATCHED_QUERY_MAX:
                short.append(b)
                continue
            # One prefill chunk: keys are the request's first seq_len slots.
            seq_len = metadata.seq_lens_host[b]
            context_len = seq_len - q_len
            custom = None if masks is None else masks[b]
            q = query[starts[b] : starts[b] + q_len].transpose(0, 1)  # [H, q, D]
            if context_len == 0:
                k = key[starts[b] : starts[b] + q_len]
                v = value[starts[b] : starts[b] + q_len]
            else:
                num_blocks = -(-seq_len // block_size)
                blocks = metadata.block_table[b, :num_blocks]
                k = k_cache[blocks].flatten(0, 1)[:seq_len]
                v = v_cache[blocks].flatten(0, 1)[:seq_len]
            k, v = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
            if context_len == 0 and custom is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
                mask[:, context_len:] = _new_token_mask(q_len, custom, q.device)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[starts[b] : starts[b] + q_len] = o.transpose(0, 1)
        if short:
            self._batched(query, k_cache, v_cache, metadata, scale, short, starts, out, gqa)
        return out

    @staticmethod
    def _batched(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        reqs: list[int],
        starts: list[int],
        out: torch.Tensor,
        gqa: bool,
    ) -> None:
        device = query.device
        block_size = k_cache.shape[1]
        q_lens = [metadata.query_lens[b] for b in reqs]
        seq_lens = [metadata.seq_lens_host[b] for b in reqs]
        max_q, max_seq = max(q_lens), max(seq_lens)
        num_blocks = -(-max_seq // block_size)
        idx = torch.tensor(reqs, device=device)
        blocks = metadata.block_table[idx, :num_blocks]  # [m, nb]
        k = k_cache[blocks].flatten(1, 2)[:, :max_seq]  # [m, L, KVH, D]
        v = v_cache[blocks].flatten(1, 2)[:, :max_seq]
        m = len(reqs)
        if m == 1 and max_q == 1:
            # Single-token decode of one request: no mask, no padding.
            q = query[starts[reqs[0]] : starts[reqs[0]] + 1].unsqueeze(0).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), scale=scale, enable_gqa=gqa
            )
            out[starts[reqs[0]]] = o[0, :, 0]
            return
        rows = torch.cat([torch.arange(starts[b], starts[b] + ql) for b, ql in zip(reqs, q_lens)]).to(device)
        req_of_row = torch.cat([torch.full((ql,), i) for i, ql in enumerate(q_lens)]).to(device)
        pos_in_req = torch.cat([torch.arange(ql) for ql in q_lens]).to(device)
        q = query.new_zeros(m, max_q, query.shape[1], query.shape[2])
        q[req_of_row, pos_in_req] = query[rows]
        # mask[i, r, j]: query r of request i may see key j.
        mask = torch.zeros(m, max_q, max_seq, dtype=torch.bool, device=device)
        masks = metadata.new_token_masks
        for i, (b, ql, sl) in enumerate(zip(reqs, q_lens, seq_lens)):
            ctx = sl - ql
            mask[i, :ql, :ctx] = True
            mask[i, :ql, ctx:sl] = _new_token_mask(ql, None if masks is None else masks[b], device)
            mask[i, ql:, 0] = True  # padding rows: attend to something, result discarded
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2).to(q.dtype),
            v.transpose(1, 2).to(q.dtype),
            attn_mask=mask.unsqueeze(1),
            scale=scale,
            enable_gqa=gqa,
        )  # [m, H, max_q, D]
        out[rows] = o.transpose(1, 2)[req_of_row, pos_in_req]
