"""Reference paged attention in pure torch: gather K/V through the block table, masked SDPA.

This is the CPU path and the ground truth that the Triton kernels are tested against. Requests with a
short query (decode, draft verification: ``query_len <= BATCHED_QUERY_MAX``) are padded into one batched
SDPA call; prefill chunks run one SDPA call each, without padding waste. Drafts verified right after a
long prefill chunk (``AttentionMetadata.draft_lens``: a draft model proposes with the prompt's last
chunk) join the short queries, apart from the chunk, so their rows are computed as in a decode step.
Index tensors and masks depend only on the batch, so they are built once per forward and reused by every
layer.

An int8 KV cache (``kv_cache_dtype="int8"``, layout in :mod:`specdec.quantization.kv_cache`) is
quantized on write at the slot mapping and dequantized on read. Every query then reads its keys and
values back from the cache, its own chunk's included, so the result does not depend on how a prompt was
split into chunks (with a cache in the model dtype the fresh K/V of a first chunk equal the cached ones).

The K/V write, :func:`write_kv`, is the reference of :mod:`kernels.reshape_and_cache` and is defined
there (re-exported here).

Sliding windows and soft-capping (per layer, the ``sliding_window`` and ``softcap`` keywords of
:meth:`ReferenceAttention.forward`): a query at position p sees key position j only when
``p - sliding_window < j`` (transformers' ``sliding_window_overlay``), on top of the causal or tree
mask; positions are slot order for chains and ``context_len + depth`` inside a token tree (depth: the
node's ancestors in its mask row). Prefill chunks and a lone decode row read only the blocks that hold a
key inside the window; padded short batches mask the others. Soft-capping turns each scaled score s into
``softcap * tanh(s / softcap)`` before the mask (Gemma 2), so those layers attend through explicit
matmuls instead of SDPA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata
from kernels.kv_int8 import dequantize_kv, is_int8_cache
from kernels.reshape_and_cache import write_kv

__all__ = ["BATCHED_QUERY_MAX", "ReferenceAttention", "explicit_attention", "new_token_positions", "write_kv"]

#: Requests with at most this many new tokens share one padded, batched SDPA call.
BATCHED_QUERY_MAX = 32


def _read(cached: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows ``[..., head_dim]`` in ``dtype`` (dequantized from an int8 cache)."""
    return dequantize_kv(cached, dtype) if is_int8_cache(cached) else cached.to(dtype)


@functools.lru_cache(maxsize=64)
def _causal_mask(query_len: int, device: torch.device) -> torch.Tensor:
    return torch.ones(query_len, query_len, dtype=torch.bool, device=device).tril_()


def _new_token_mask(query_len: int, custom: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if custom is None:
        return _causal_mask(query_len, device)
    if custom.shape != (query_len, query_len):
        raise ValueError(f"new-token mask must be [{query_len}, {query_len}], got {tuple(custom.shape)}")
    return custom.to(device=device, dtype=torch.bool)


def new_token_positions(query_len: int, context_len: int, custom: torch.Tensor | None) -> torch.Tensor:
    """``[query_len]`` int64 positions of a request's new tokens: ``context_len + i`` (causal), or
    ``context_len + depth`` under a tree mask (depth = the node's visible new tokens - 1)."""
    if custom is None:
        return torch.arange(context_len, context_len + query_len)
    return context_len + custom.to(device="cpu", dtype=torch.int64).sum(dim=1) - 1


def window_allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``[..., q, k]`` bool: key position ``k_pos`` lies inside the sliding window of query position
    ``q_pos`` (``q_pos - window < k_pos``); causality is the caller's mask."""
    return (q_pos[..., :, None] - k_pos[..., None, :]) < window


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention written out (for soft-capped scores, which SDPA cannot apply): ``q`` ``[H, q, D]``,
    ``k``/``v`` ``[KVH, L, D]``, ``mask`` ``[q, L]`` bool (None: causal, q == L) -> ``[H, q, D]``.
    Scores and softmax in float32, as transformers' eager Gemma 2 attention."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = _causal_mask(q.shape[1], q.device)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


@dataclass
class _Prefill:
    """One long-query request: rows ``start:start+query_len``; ``mask`` None means plain causal."""

    start: int
    query_len: int
    seq_len: int
    blocks: torch.Tensor | None  # [num_blocks] or None when there is no context (keys are the new tokens)
    mask: torch.Tensor | None  # [query_len, seq_len - key_start] bool
    key_start: int = 0  # first key read (a block boundary; > 0 when a sliding window skips blocks)


@dataclass
class _Batched:
    """Short-query requests padded into one SDPA call of ``m`` rows of ``max_q`` queries."""

    rows: torch.Tensor  # [n] flattened rows of these requests
    req_of_row: torch.Tensor  # [n] index into the m padded requests
    pos_in_req: torch.Tensor  # [n] query index inside the request
    blocks: torch.Tensor  # [m, num_blocks]
    max_q: int
    max_seq: int
    mask: torch.Tensor | None  # [m, 1, max_q, max_seq] bool, None for a single unpadded decode row
    key_start: int = 0  # single decode row under a sliding window: first key inside it


@dataclass
class _Plan:
    prefills: list[_Prefill]
    batched: _Batched | None
    #: The short-query requests, ``(b, start, query_len, seq_len)`` each (what ``batched`` pads).
    short: list[tuple[int, int, int, int]]
    #: The layer's sliding window the plan was made for (None: global attention).
    window: int | None = None


def _split_drafts(metadata: AttentionMetadata, b: int, q_len: int, custom: torch.Tensor | None) -> int:
    """How many trailing rows of request ``b`` to attend as short queries apart from the chunk before
    them: its drafts (``metadata.draft_lens``) when its new tokens, chunk and drafts, are more than
    :data:`BATCHED_QUERY_MAX`, the drafts are at most that many, and they see every earlier new token (a
    tree's nodes do); else 0. The chunk left behind may itself be short."""
    drafts = metadata.draft_lens[b] if metadata.draft_lens is not None else 0
    if not (0 < drafts <= BATCHED_QUERY_MAX < q_len):
        return 0
    if custom is not None and not bool(custom[q_len - drafts :, : q_len - drafts].all()):
        return 0
    return drafts


def short_mask(metadata: AttentionMetadata, b: int, start: int, q_len: int) -> torch.Tensor | None:
    """The ``[q_len, q_len]`` tree attention mask of the short query of request ``b`` at flattened rows
    ``start:start + q_len`` (all its new tokens; or, split by :func:`_split_drafts`, its chunk or its
    drafts), or None (causal)."""
    masks = metadata.new_token_masks
    custom = None if masks is None else masks[b]
    if custom is None or q_len == metadata.query_lens[b]:  # unsplit: the caller checks the shape
        return custom
    if start == sum(metadata.query_lens[:b]):  # the chunk before the drafts
        return custom[:q_len, :q_len]
    return custom[-q_len:, -q_len:]


def _plan(
    metadata: AttentionMetadata,
    block_size: int,
    device: torch.device,
    from_cache: bool = False,
    batch_short: bool = True,
    window: int | None = None,
) -> _Plan:
    """``from_cache``: prefill chunks read their own K/V back from the cache too (an int8 cache).
    ``batch_short``: build the padded batch of the short-query requests (False: a kernel attends them).
    ``window``: the layer's sliding window in positions (None: global attention)."""
    masks = metadata.new_token_masks
    prefills: list[_Prefill] = []
    short: list[tuple[int, int, int, int]] = []  # (b, start, q_len, seq_len)
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens_host)):
        custom = None if masks is None else masks[b]
        drafts = _split_drafts(metadata, b, q_len, custom)
        if drafts:  # a prefill chunk, then its drafts as short queries (a decode step's bits)
            short.append((b, start + q_len - drafts, drafts, seq_len))
            q_len, seq_len = q_len - drafts, seq_len - drafts
            custom = None if custom is None else custom[:q_len, :q_len]
        if q_len <= BATCHED_QUERY_MAX:
            short.append((b, start, q_len, seq_len))
        else:
            context_len = seq_len - q_len
            windowed = window is not None and seq_len > window
            key_start = 0
            if windowed:  # skip the blocks wholly before the first query's window
                q_pos = new_token_positions(q_len, context_len, custom)
                key_start = max(0, int(q_pos.min()) - window + 1) // block_size * block_size
            blocks = None
            if context_len > 0 or from_cache:
                blocks = metadata.block_table[b, key_start // block_size : -(-seq_len // block_size)]
            mask = None
            if context_len > 0 or custom is not None or windowed:
                mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
                mask[:, context_len:] = _new_token_mask(q_len, custom, device)
                if windowed:
                    k_pos = torch.cat([torch.arange(context_len), q_pos])
                    mask &= window_allowed(q_pos, k_pos, window).to(device)  # type: ignore[arg-type]
                    mask = mask[:, key_start:]
            prefills.append(_Prefill(start, q_len, seq_len, blocks, mask, key_start))
        start += q_len + drafts
    if not short or not batch_short:
        return _Plan(prefills, None, short, window)
    m = len(short)
    short_t = torch.tensor(short, dtype=torch.int64)  # [m, 4]: (b, start, q_len, seq_len)
    q_lens, seq_lens = short_t[:, 2], short_t[:, 3]
    max_q, max_seq = int(q_lens.max()), int(seq_lens.max())
    blocks = metadata.block_table[short_t[:, 0].to(device), : -(-max_seq // block_size)]
    req_of_row = torch.repeat_interleave(torch.arange(m), q_lens)  # [n]
    row_starts = torch.cumsum(q_lens, 0) - q_lens  # [m] first flattened row of each request, among these
    pos_in_req = torch.arange(len(req_of_row)) - row_starts[req_of_row]
    rows = short_t[req_of_row, 1] + pos_in_req
    batch_mask: torch.Tensor | None = None
    key_start = 0
    if m == 1 and max_q == 1:
        if window is not None:  # one decode row: read only the keys inside its window
            key_start = max(0, max_seq - window)
    else:
        # mask[i, 0, r, j]: query r of request i may see key j. Causal: key j is visible to query r when
        # j < context_len + r + 1; padding rows (r >= q_len) see key 0 only (their output is discarded).
        r = torch.arange(max_q)[None, :, None]
        j = torch.arange(max_seq)[None, None, :]
        ctx = (seq_lens - q_lens)[:, None, None]
        valid_row = r < q_lens[:, None, None]
        mask = (j <= ctx + r) & valid_row
        q_pos = (ctx + r)[:, :, 0]  # [m, max_q]
        k_pos = j[0].expand(m, max_seq).clone()  # [m, max_seq]
        if masks is not None:
            for i, (b, st, ql, sl) in enumerate(short):
                tree = short_mask(metadata, b, st, ql)
                if tree is not None:  # a tree attention mask among the new tokens
                    c = sl - ql
                    mask[i, :ql, c:sl] = _new_token_mask(ql, tree, "cpu")  # type: ignore[arg-type]
                    q_pos[i, :ql] = k_pos[i, c:sl] = new_token_positions(ql, c, tree)
        if window is not None:
            mask &= window_allowed(q_pos, k_pos, window)
        mask |= ~valid_row & (j == 0)
        batch_mask = mask.unsqueeze(1).to(device)
    rows, req_of_row, pos_in_req = rows.to(device), req_of_row.to(device), pos_in_req.to(device)
    batched = _Batched(rows, req_of_row, pos_in_req, blocks, max_q, max_seq, batch_mask, key_start)
    return _Plan(prefills, batched, short, window)


class ReferenceAttention:
    """Pure-torch :class:`~specdec.attention.base.AttentionBackend`."""

    #: Key of this backend's plan in ``AttentionMetadata.backend_cache``.
    plan_key = "reference"
    #: Whether :func:`_plan` pads the short-query requests into one batch (subclasses attending them with
    #: a kernel set False).
    batch_short = True

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
        """As :meth:`~specdec.attention.base.AttentionBackend.forward`; ``sliding_window`` (positions, the
        query's included) and ``softcap`` (tanh soft-capping of the scaled scores) are the layer's, None
        when off (see the module docstring)."""
        self._write(key, value, k_cache, v_cache, metadata.slot_mapping)
        key_ = self.plan_key if sliding_window is None else (self.plan_key, sliding_window)
        plan = metadata.backend_cache.get(key_)
        if plan is None:
            plan = metadata.backend_cache[key_] = _plan(
                metadata,
                k_cache.shape[1],
                query.device,
                from_cache=is_int8_cache(k_cache),
                batch_short=self.batch_short,
                window=sliding_window,
            )
        out = query.new_empty(query.shape)  # contiguous, whatever the query's strides
        self._prefills(query, key, value, k_cache, v_cache, plan, scale, out, softcap)
        if plan.short:
            self._short(query, k_cache, v_cache, metadata, plan, scale, out, softcap)
        return out

    @staticmethod
    def _write(
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Store the new K/V at their slots (:func:`write_kv`)."""
        write_kv(key, value, k_cache, v_cache, slots)

    @staticmethod
    def _prefills(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: _Plan,
        scale: float,
        out: torch.Tensor,
        softcap: float | None = None,
    ) -> None:
        """Long-query requests (prefill chunks), one SDPA call each, into ``out``'s rows."""
        gqa = query.shape[1] != key.shape[1]
        for p in plan.prefills:
            rows = slice(p.start, p.start + p.query_len)
            q = query[rows].transpose(0, 1)  # [H, q, D]
            if p.blocks is None:
                k, v = key[rows], value[rows]
            else:
                n = p.seq_len - p.key_start
                k = _read(k_cache[p.blocks].flatten(0, 1)[:n], q.dtype)
                v = _read(v_cache[p.blocks].flatten(0, 1)[:n], q.dtype)
            k, v = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
            if softcap is not None:
                o = explicit_attention(q, k, v, p.mask, scale, softcap)
            else:
                # Batched 4-D operands ([1, H, q, D], the mask [1, 1, q, k]): on the CPU, 3-D ones take
                # SDPA's unfused math path (bmm, softmax, masking), 4-D ones its fused flash kernel. A
                # 100-token chunk after 200 tokens, SmolLM2's heads, bfloat16, 2-core AMX: 1.79 -> 0.23 ms
                # a layer; a whole 100-token chunk's forward 66 -> 48 ms.
                mask = None if p.mask is None else p.mask[None, None]
                o = F.scaled_dot_product_attention(
                    q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale,
                    enable_gqa=gqa,
                )[0]  # fmt: skip
            out[rows] = o.transpose(0, 1)

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
        """Short-query requests (decode, verification), into ``out``'s rows."""
        bt = plan.batched
        assert bt is not None
        gqa = query.shape[1] != k_cache.shape[2]
        if bt.mask is None:
            # One request decoding one token: no mask and no padding, so SDPA's fused kernel applies.
            bs = k_cache.shape[1]
            first = bt.key_start // bs * bs  # a window skips whole blocks, then the keys before it
            blocks = bt.blocks[0, first // bs :]
            keys = slice(bt.key_start - first, bt.max_seq - first)
            q = query[bt.rows].transpose(0, 1).unsqueeze(0)  # [1, H, 1, D]
            k = _read(k_cache[blocks].flatten(0, 1)[keys], q.dtype).transpose(0, 1).unsqueeze(0)
            v = _read(v_cache[blocks].flatten(0, 1)[keys], q.dtype).transpose(0, 1).unsqueeze(0)
            k, v = k.to(q.dtype), v.to(q.dtype)
            if softcap is not None:
                every_key = torch.ones(1, k.shape[2], dtype=torch.bool, device=q.device)
                out[bt.rows] = explicit_attention(q[0], k[0], v[0], every_key, scale, softcap).transpose(0, 1)
                return
            o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
            out[bt.rows] = o[0].transpose(0, 1)
        else:
            out[bt.rows] = self._batched(query, k_cache, v_cache, bt, scale, softcap)

    @staticmethod
    def _batched(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        bt: _Batched,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Short queries of ``m`` requests at once: grouped-query attention as two batched matmuls.

        Written out rather than through SDPA, whose masked CPU kernels were 10-30x slower here in
        bfloat16 for decode-shaped inputs. Scores and softmax are float32.
        """
        m = bt.blocks.shape[0]
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        # [m, KVH, L, D], made contiguous: strided operands slowed the matmuls by 2-3x here.
        k = _read(k_cache[bt.blocks].flatten(1, 2)[:, : bt.max_seq], query.dtype).transpose(1, 2).contiguous()
        v = _read(v_cache[bt.blocks].flatten(1, 2)[:, : bt.max_seq], query.dtype).transpose(1, 2).contiguous()
        q = query.new_zeros(m, bt.max_q, num_heads, head_dim)
        q[bt.req_of_row, bt.pos_in_req] = query[bt.rows]
        # [m, H, max_q, D] -> [m, KVH, G * max_q, D]: query head h reads KV head h // G.
        q = q.transpose(1, 2).reshape(m, num_kv_heads, group * bt.max_q, head_dim)
        scores = torch.matmul(q, k.to(q.dtype).transpose(-1, -2)).float() * scale  # [m, KVH, G*max_q, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if bt.mask is not None:
            scores = scores.view(m, num_kv_heads, group, bt.max_q, bt.max_seq).masked_fill(
                ~bt.mask.unsqueeze(1), float("-inf")
            )
        probs = scores.softmax(dim=-1).to(q.dtype).view(m, num_kv_heads, group * bt.max_q, bt.max_seq)
        o = torch.matmul(probs, v.to(q.dtype))  # [m, KVH, G*max_q, D]
        o = o.view(m, num_heads, bt.max_q, head_dim).transpose(1, 2)  # [m, max_q, H, D]
        return o[bt.req_of_row, bt.pos_in_req]
