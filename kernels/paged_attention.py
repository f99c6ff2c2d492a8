"""Paged attention over a flattened variable-length batch, with grouped-query heads and tree masks.

One kernel serves prefill, chunked prefill, decode and the verification of draft chains and token
trees: request ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b + 1]`` (its ``q_len`` new
tokens) and ``seq_lens[b]`` tokens of KV in the paged cache (context + new, already written), found
through ``block_table[b]``. Every new token sees the whole context; among the new tokens it sees those
its request's mask allows (causal when the request has no mask). RoPE, and with it each token's
explicit position, is applied before this op; the mask rule is over slot order.

Layout of the kernel (the split of vLLM's unified attention kernel, written anew here):

- One program per (query block of one request, KV head[, KV split]). A query block holds ``BLOCK_Q``
  consecutive new tokens of one request times the ``G = num_heads / num_kv_heads`` query heads that
  share the KV head, ``BLOCK_M = BLOCK_Q * G`` (padded) rows, so each K/V tile is loaded once for the
  whole group. Programs find their request by binary search over ``query_start_loc``: query block ``i``
  of request ``b`` has program id ``query_start_loc[b] // BLOCK_Q + b + i``, so the grid needs no host
  copy of the query lengths.
- K/V tiles of ``TILE_N`` key positions are gathered through the block table (any tile size against
  block sizes 16 or 32), masked, and folded in with an online softmax (running max and sum, exp2,
  float32 accumulators whatever the input dtype).
- Causal requests stop at their last query's position; requests with a tree mask read all their keys.
- With ``num_splits > 1`` (long-context decode with few programs) each program covers a slice of the
  key tiles and writes an unnormalised partial; a second kernel merges the slices.

Sliding windows (``sliding_window`` > 0, Mistral / Gemma layers): a query at position p sees keys at
positions j with ``p - sliding_window < j`` on top of the causal or tree rule, and a query block starts
its key loop at the first tile inside its first query's window, so blocks wholly outside it are not
read. Positions are slot order for prefill, decode and verification chains; inside a token tree a new
token's position is ``context_len + depth`` (its depth: the new tokens its mask row sees, minus one),
as in the torch backends, and the packed mask carries the depths. Soft-capping (``softcap`` > 0,
Gemma 2) turns each scaled score s into ``softcap * tanh(s / softcap)`` before the mask.

Tree masks travel packed: :func:`pack_new_token_masks` concatenates each masked request's
``[q_len, q_len]`` bool mask row-major into one int8 buffer and gives each request its offset in it
(-1: causal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels._triton import cdiv, dot_in_fp32, lazy_jit, next_power_of_2, use_triton

if TYPE_CHECKING:  # at run time lazy_jit binds `tl` when it first jits a kernel of this module
    import triton.language as tl

_LOG2E = 1.4426950408889634


@dataclass
class PackedTreeMask:
    """Per-request new-token masks in one buffer.

    Attributes:
        bits: int8 ``[sum of q_len^2 over masked requests]``; request ``b``'s ``mask[i, j]`` is at
            ``offsets[b] + i * q_len + j``.
        offsets: int32 ``[B]``, -1 for a causal request.
        depths: int32 ``[sum of q_len over masked requests]``; request ``b``'s new token ``i`` has depth
            ``depths[depth_offsets[b] + i]`` in its tree (``mask[i].sum() - 1``; what a sliding window
            measures positions by).
        depth_offsets: int32 ``[B]``, -1 for a causal request.
    """

    bits: torch.Tensor
    offsets: torch.Tensor
    depths: torch.Tensor
    depth_offsets: torch.Tensor


def pack_new_token_masks(
    new_token_masks: list[torch.Tensor | None] | None, query_lens: list[int], device: torch.device
) -> PackedTreeMask | None:
    """Pack the metadata's per-request masks (None = causal); None when every request is causal.

    Raises:
        ValueError: a mask is not ``[q_len, q_len]``.
    """
    if new_token_masks is None or all(m is None for m in new_token_masks):
        return None
    parts: list[torch.Tensor] = []
    depths: list[torch.Tensor] = []
    offsets: list[int] = []
    depth_offsets: list[int] = []
    pos = depth_pos = 0
    for mask, q_len in zip(new_token_masks, query_lens):
        if mask is None:
            offsets.append(-1)
            depth_offsets.append(-1)
            continue
        if tuple(mask.shape) != (q_len, q_len):
            raise ValueError(f"new-token mask must be [{q_len}, {q_len}], got {tuple(mask.shape)}")
        parts.append(mask.reshape(-1).to(device=device, dtype=torch.int8))
        depths.append(mask.to(torch.int32).sum(dim=1) - 1)
        offsets.append(pos)
        depth_offsets.append(depth_pos)
        pos += q_len * q_len
        depth_pos += q_len
    return PackedTreeMask(
        bits=torch.cat(parts),
        offsets=torch.tensor(offsets, dtype=torch.int32, device=device),
        depths=torch.cat(depths).to(device=device, dtype=torch.int32),
        depth_offsets=torch.tensor(depth_offsets, dtype=torch.int32, device=device),
    )


# ----------------------------------------------------------------------------------------- reference
def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    new_token_masks: list[torch.Tensor | None] | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The definition, one request at a time in float32: gather K/V through the block table, mask
    (whole context + the allowed new tokens), softmax, weighted sum. Same semantics as
    :class:`specdec.attention.reference.ReferenceAttention` (which the backend tests also compare with).

    Args:
        query: ``[T, H, D]``.
        k_cache, v_cache: ``[num_blocks, block_size, KVH, D]``, the new tokens' K/V already written.
        query_start_loc: ``[B + 1]``; seq_lens: ``[B]``; block_table: ``[B, max_blocks]``.
        scale: softmax scale.
        new_token_masks: per request None (causal) or ``[q_len, q_len]`` bool.
        sliding_window: > 0: a query at position p sees only keys at positions j > p - sliding_window
            (slot order; ``context_len + depth`` inside a tree mask, see the module docstring).
        softcap: > 0: scaled scores s become ``softcap * tanh(s / softcap)``.

    Returns:
        ``[T, H, D]`` in ``query``'s dtype.
    """
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        ctx = seq_len - q_len
        blocks = block_table[b, : cdiv(seq_len, block_size)]
        k = k_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        allowed = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device)
        custom = None if new_token_masks is None else new_token_masks[b]
        if custom is None:
            allowed[:, ctx:] = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril_()
        else:
            allowed[:, ctx:] = custom.to(device=query.device, dtype=torch.bool)
        if sliding_window > 0:
            q_pos = torch.arange(ctx, seq_len, device=query.device)
            if custom is not None:  # inside a tree: context_len + depth
                q_pos = ctx + custom.to(device=query.device, dtype=torch.int64).sum(dim=1) - 1
            k_pos = torch.cat([torch.arange(ctx, device=query.device), q_pos])
            allowed &= q_pos[:, None] - k_pos[None, :] < sliding_window
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


# ----------------------------------------------------------------------------------------- kernels
@lazy_jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_table_ptr,
    mask_bits_ptr,
    mask_off_ptr,
    depth_ptr,
    depth_off_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in positions, 0: none
    softcap,  # soft-cap of the scores in log2 units (softcap * log2(e)), 0: none
    num_seqs,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_vd,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Request of this query block: the last b with query_start_loc[b] // BLOCK_Q + b <= pid.
    # (int32 tensors from the start: Triton turns an int argument equal to 1 into a constant, and a
    # loop-carried variable must keep one type)
    lo = tl.full([], 0, dtype=tl.int32)
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first_block <= pid:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    q_begin = tl.load(qsl_ptr + b).to(tl.int32)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_begin
    q_start = (pid - (q_begin // BLOCK_Q + b)) * BLOCK_Q
    if q_start < q_len:
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        ctx_len = seq_len - q_len

        rows = tl.arange(0, BLOCK_M)
        q_idx = q_start + rows // GROUP  # index among the request's new tokens
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
        token = q_begin + q_idx
        dims = tl.arange(0, HEAD_PAD)
        dim_ok = dims < HEAD_DIM
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:
            q = q.to(tl.float32)

        mask_off = -1
        depth_off = -1
        if HAS_MASK:
            mask_off = tl.load(mask_off_ptr + b)
            if HAS_WINDOW:
                depth_off = tl.load(depth_off_ptr + b)
        q_pos = ctx_len + q_idx  # position of each row's query (slot order; a tree's depths below)
        if HAS_MASK and HAS_WINDOW:
            depth = tl.load(
                depth_ptr + depth_off + q_idx, mask=tl.where(depth_off >= 0, row_ok, False), other=0
            )
            q_pos = tl.where(depth_off >= 0, ctx_len + depth, q_pos)
        # Keys this block can see: all of them with a tree mask, up to its last query when causal.
        kv_end = tl.minimum(seq_len, ctx_len + tl.minimum(q_start + BLOCK_Q, q_len))
        if mask_off >= 0:
            kv_end = seq_len
        num_tiles = tl.cdiv(kv_end, TILE_N)
        first_tile = 0
        if HAS_WINDOW:  # tiles wholly before the first query's window are not read
            first_pos = ctx_len + q_start
            if depth_off >= 0:  # a tree's queries sit at context_len + depth >= context_len
                first_pos = ctx_len
            first_tile = tl.maximum(first_pos - window + 1, 0) // TILE_N
        tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
        tile_lo = first_tile + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        cols = tl.arange(0, TILE_N)
        for tile in range(tile_lo, tile_hi):
            n = tile * TILE_N + cols
            n_ok = n < kv_end
            block = tl.load(block_table_ptr + b * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
            offset = n % BLOCK_SIZE
            kv_mask = dim_ok[:, None] & n_ok[None, :]
            k = tl.load(  # [HEAD_PAD, TILE_N]
                k_cache_ptr
                + block[None, :].to(tl.int64) * stride_kb
                + offset[None, :] * stride_ko
                + kv_head * stride_kh
                + dims[:, None] * stride_kd,
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(  # [TILE_N, HEAD_PAD]
                v_cache_ptr
                + block[:, None].to(tl.int64) * stride_vb
                + offset[:, None] * stride_vo
                + kv_head * stride_vh
                + dims[None, :] * stride_vd,
                mask=n_ok[:, None] & dim_ok[None, :],
                other=0.0,
            )
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N], log2 units
            if HAS_SOFTCAP:  # c * tanh(x / c) is the same map in log2 units, with c * log2(e) as the cap;
                # tanh(y) = 1 - 2 / (e^2y + 1), which saturates to +-1 without overflow trouble
                y = s / softcap
                s = (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * softcap

            j = n - ctx_len  # key index among the new tokens (< 0: context)
            new_ok = j[None, :] <= q_idx[:, None]  # causal
            if HAS_MASK:
                in_new = (j >= 0) & (j < q_len)
                tree = tl.load(
                    mask_bits_ptr + mask_off + q_idx[:, None] * q_len + j[None, :],
                    # (tl.where, not &, joins the scalar condition: the interpreter turns a scalar &
                    # block of booleans into int32, which tl.load rejects as a mask)
                    mask=tl.where(mask_off >= 0, row_ok[:, None] & in_new[None, :], False),
                    other=0,
                )
                new_ok = tl.where(mask_off >= 0, tree != 0, new_ok)
            allowed = row_ok[:, None] & n_ok[None, :] & ((j < 0)[None, :] | new_ok)
            if HAS_WINDOW:
                k_pos = n
                if HAS_MASK:  # new keys of a tree sit at context_len + their depth
                    key_depth = tl.load(
                        depth_ptr + depth_off + j,
                        mask=tl.where(depth_off >= 0, (j >= 0) & (j < q_len), False),
                        other=0,
                    )
                    k_pos = tl.where((depth_off >= 0) & (j >= 0), ctx_len + key_depth, n)
                allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window)
            s = tl.where(allowed, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
                o.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & dim_ok[None, :],
            )
        else:
            # Partials [NUM_SPLITS, T, NUM_HEADS, HEAD_PAD] and [NUM_SPLITS, T, NUM_HEADS, 2] (max, sum).
            base = (split * num_tokens + token).to(tl.int64) * NUM_HEADS + head
            tl.store(part_acc_ptr + base[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + base * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=row_ok)


@lazy_jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    num_tokens,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    base = (splits * num_tokens + token).to(tl.int64) * NUM_HEADS + head
    m = tl.load(part_ml_ptr + base * 2, mask=split_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + base * 2 + 1, mask=split_ok, other=0.0)  # noqa: E741
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    total = tl.sum(w * l, axis=0)
    dims = tl.arange(0, HEAD_PAD)
    acc = tl.load(part_acc_ptr + base[:, None] * HEAD_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    tree_mask: PackedTreeMask | None = None,
    *,
    sliding_window: int = 0,
    softcap: float = 0.0,
    max_query_len: int | None = None,
    num_splits: int = 1,
    block_m: int | None = None,
    tile_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``).

    Args: as :func:`paged_attention_ref`, with the masks packed (:func:`pack_new_token_masks`), and
        sliding_window, softcap: as :func:`paged_attention_ref` (0: off).
        max_query_len: the longest query in the batch when the caller knows it (picks ``BLOCK_M``,
            see :func:`choose_block_m`); None assumes prefill-sized queries.
        num_splits: KV splits per query block (> 1 for long-context decode with few programs).
        block_m, tile_n: override the query rows and key positions per program (tests).
        out: ``[T, H, D]`` output buffer (strided rows allowed), else a new one.

    Returns:
        ``out``.

    Raises:
        ValueError: shapes that do not fit.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if num_heads % num_kv_heads or cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    head_pad = max(16, next_power_of_2(head_dim))
    if block_m is None:
        block_m = choose_block_m(group, max_query_len)
    block_q = block_m // group
    if block_q < 1:
        raise ValueError(f"block_m {block_m} is smaller than the query group {group}")
    if tile_n is None:  # key positions per step: two 16-blocks or one 32-block (float32: 32, half the
        # registers and shared memory of 64-wide float32 tiles at head_dim 128)
        tile_n = 32 if query.dtype == torch.float32 else max(16, min(64, block_size * 2))
    grid_q = num_tokens // block_q + num_seqs
    dot_fp32 = dot_in_fp32(query.dtype) or dot_in_fp32(k_cache.dtype)
    # float32 inputs: exact float32 products (Triton's default for them is TF32); others: the default.
    precision = "ieee" if query.dtype == torch.float32 and k_cache.dtype == torch.float32 else None
    mask_bits = tree_mask.bits if tree_mask is not None else query.new_zeros(1, dtype=torch.int8)
    mask_off = tree_mask.offsets if tree_mask is not None else query.new_zeros(1, dtype=torch.int32)
    depths = tree_mask.depths if tree_mask is not None else mask_off
    depth_off = tree_mask.depth_offsets if tree_mask is not None else mask_off
    if num_splits > 1:
        part_acc = torch.empty(num_splits, num_tokens, num_heads, head_pad, device=query.device)
        part_ml = torch.empty(num_splits, num_tokens, num_heads, 2, device=query.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_attention_kernel[(grid_q, num_kv_heads, num_splits)](
        out,
        query,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_table,
        mask_bits,
        mask_off,
        depths,
        depth_off,
        part_acc,
        part_ml,
        scale * _LOG2E,
        sliding_window,
        softcap * _LOG2E,
        num_seqs,
        num_tokens,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_table.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        HAS_MASK=tree_mask is not None,
        HAS_WINDOW=sliding_window > 0,
        HAS_SOFTCAP=softcap > 0,
        NUM_SPLITS=num_splits,
        DOT_FP32=dot_fp32,
        DOT_PRECISION=precision,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            part_acc,
            part_ml,
            num_tokens,
            *out.stride(),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=max(2, next_power_of_2(num_splits)),
        )
    return out


def choose_block_m(group: int, max_query_len: int | None) -> int:
    """Query rows per program: enough for a whole short query's ``max_query_len × group`` rows (decode:
    16, verification of k drafts: 16-64), 64 for prefill; a power of two >= 16 (``tl.dot``'s minimum)."""
    rows = 64 if max_query_len is None else max_query_len * group
    return max(next_power_of_2(group), min(64, max(16, next_power_of_2(rows))))


def choose_num_splits(num_programs: int, max_query_len: int, max_seq_len: int, num_sms: int) -> int:
    """KV splits for a batch: more than one only for short queries over long contexts when the
    (query block × KV head) programs would leave most of the GPU's ``num_sms`` idle; a power of two (1,
    2, 4, 8 or 16), so that a CUDA graph captured for one count serves contexts of many lengths."""
    if max_query_len > 8 or max_seq_len < 512 or num_programs >= num_sms:
        return 1
    n = int(max(1, min(16, cdiv(num_sms, num_programs), max_seq_len // 256)))
    return 1 << (n.bit_length() - 1)


# ----------------------------------------------------------------------------------------- dispatch
def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float | None = None,
    new_token_masks: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Paged attention: the Triton kernel on CUDA, :func:`paged_attention_ref` elsewhere (or when
    ``SPECDEC_FORCE_REFERENCE=1``). ``scale`` defaults to ``head_dim ** -0.5``."""
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if not use_triton(query, k_cache, v_cache):
        return paged_attention_ref(
            query, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, new_token_masks
        )
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    packed = pack_new_token_masks(new_token_masks, query_lens, query.device)
    return paged_attention_triton(
        query,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_table,
        scale,
        packed,
        max_query_len=max(query_lens, default=0),
    )
