"""Paged attention of short queries on the CPU (decode, verification chains, token trees): a C++ kernel
beside its reference.

The kernel (``csrc/cpu_attention.cpp``) attends the new queries of ``m`` requests (at most
``BATCHED_QUERY_MAX`` each) to their keys, read through the block table from the paged caches, with a causal
or tree attention mask among the new tokens; one task per (request, KV head) — or per chunk of its rows where
that evens out the threads — so K and V are read once per KV head for all its query heads and queries, the
keys transposed in registers 32 at a time and the values widened as they are summed. Its reference is the
pure-torch backend (:class:`specdec.attention.reference.ReferenceAttention`: masked batched matmuls, or SDPA),
which the tests compare it with.

Why: the reference's gathers, masks and small matmuls cost about 0.4 ms per layer at batch 1 on this
project's 2-core CPU, a third of a compiled SmolLM2-135M step; the kernel reads the same bytes in a few
microseconds per layer.

Built with the other CPU kernels by :mod:`kernels.cpu_ext`; ``SPECDEC_CPU_ATTENTION=0`` or
``SPECDEC_FORCE_REFERENCE=1`` turns it off. It is a plain call, not a custom op: the compiled forward
already keeps all of attention out of its graph (``specdec::paged_attention``), and a custom op's
dispatch would cost more than the kernel at batch 1.

Accuracy: float32 scores and softmax as the reference; float32 outputs agree within 1e-5, bfloat16
within one bfloat16 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_ext import enabled, require_extension

__all__ = ["ShortQueries", "available", "paged_attention_short", "write_kv"]

DISABLE_ENV = "SPECDEC_CPU_ATTENTION"


def available() -> bool:
    """Whether the kernel can be used here: not disabled and built (on the first call)."""
    return enabled(DISABLE_ENV)


@dataclass(frozen=True)
class ShortQueries:
    """The forward's ``m`` requests as the short-query attention kernel reads them
    (:func:`kernels.cpu_attention.paged_attention_short`): all int64 ``[m]`` but ``block_table`` ``[B,
    max_blocks]`` int64 and ``masks`` (flattened tree attention masks, uint8)."""

    block_table: torch.Tensor
    reqs: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    seq_len: torch.Tensor
    mask_offset: torch.Tensor
    masks: torch.Tensor


@dataclass(frozen=True)
class PromptChunk:
    """One request's prompt chunk among a forward's rows, as the C++ layer stack attends it (SDPA's fused
    kernel, as ``ReferenceAttention._prefills``): rows ``start:start + query_len`` over ``num_keys`` keys,
    read from the cache blocks ``blocks`` ``[num_blocks]`` int64 (None: no earlier keys, the chunk's own
    new keys), under ``mask`` ``[query_len, num_keys]`` bool (None: causal)."""

    start: int
    query_len: int
    num_keys: int
    blocks: torch.Tensor | None
    mask: torch.Tensor | None


def paged_attention_short(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    reqs: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    seq_len: torch.Tensor,
    mask_offset: torch.Tensor,
    masks: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Attend the new queries of ``m`` requests, writing their rows of ``out``.

    Args:
        query: ``[T, num_heads, head_dim]`` float32 or bfloat16, heads and dims contiguous (any token
            stride: the query heads of a fused ``[T, H + 2 KVH, D]`` projection are read in place).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, query's dtype, contiguous;
            the new tokens' K/V already written.
        block_table: ``[B, max_blocks]`` int64.
        reqs: ``[m]`` int64, each request's row of ``block_table``.
        q_start: ``[m]`` int64, first row of ``query`` / ``out`` of each request.
        q_len: ``[m]`` int64, new tokens of each request.
        seq_len: ``[m]`` int64, keys of each request (context + new).
        mask_offset: ``[m]`` int64, offset in ``masks`` of the request's ``[q_len, q_len]`` tree
            attention mask (row-major), or -1 for causal.
        masks: ``[*]`` uint8, the tree masks, flattened and concatenated.
        out: ``[T, num_heads, head_dim]``, query's dtype, contiguous; only the requests' rows are written.
        scale: softmax scale.
        window: sliding window in positions, 0 for none: a query at position p sees keys at positions
            > p - window (chains: ``context + r``; trees: ``context + depth``, as the reference).
        softcap: scores s become ``softcap * tanh(s / softcap)``, 0 for none.

    Raises:
        RuntimeError: shapes or dtypes it does not take, or the kernel is not built.
    """
    require_extension().paged_attention_short(
        query, k_cache, v_cache, block_table, reqs, q_start, q_len, seq_len, mask_offset, masks, out, scale,
        window, softcap,
    )  # fmt: skip


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[T, num_kv_heads, head_dim]`` (unit stride along ``head_dim``) at
    ``slot_mapping`` ``[T]`` (int64; negative: skipped) of the caches, all of one dtype: the kernel of
    :func:`kernels.reshape_and_cache.write_kv` (its reference) for float32 / bfloat16 CPU caches.

    Raises:
        RuntimeError: shapes, strides or dtypes it does not take, a slot past the cache, or the kernel is
            not built.
    """
    require_extension().write_kv(key, value, k_cache, v_cache, slot_mapping)


def _bench(contexts: tuple[int, ...] = (128, 512, 2048), q_lens: tuple[int, ...] = (1, 5, 16)) -> None:
    """Microseconds per call of one SmolLM2-135M layer's attention (9 query heads, 3 KV heads, head_dim
    64, bfloat16, blocks of 16, one request): a decode row, a chain of 5 and a 16-node tree (a binary
    tree's mask) at several contexts, and the GB/s of K/V read (``python -m kernels.bench_cpu attention``)."""
    import time

    H, KVH, D, bs = 9, 3, 64, 16
    print(f"threads {torch.get_num_threads()}, kernel built: {available()}")
    for ctx in contexts:
        line = []
        for q in q_lens:
            L = ctx + q
            nblocks = -(-L // bs)
            k_cache = torch.randn(nblocks, bs, KVH, D, dtype=torch.bfloat16)
            v_cache = torch.randn_like(k_cache)
            query = torch.randn(q, H, D, dtype=torch.bfloat16)
            out = torch.empty_like(query)
            table = torch.randperm(nblocks).view(1, -1)
            one = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
            masks, offset = torch.empty(0, dtype=torch.uint8), -1
            if q == 16:
                tree = torch.eye(q, dtype=torch.bool)
                for i in range(1, q):
                    tree[i] |= tree[(i - 1) // 2]
                masks, offset = tree.to(torch.uint8).flatten(), 0
            args = (query, k_cache, v_cache, table, one(0), one(0), one(q), one(L), one(offset), masks, out)
            for _ in range(10):
                paged_attention_short(*args, D**-0.5)
            reps = 400
            t0 = time.perf_counter()
            for _ in range(reps):
                paged_attention_short(*args, D**-0.5)
            dt = (time.perf_counter() - t0) / reps
            line.append(f"q {q:2d}: {dt * 1e6:6.1f} µs {2 * L * KVH * D * 2 / dt / 1e9:5.1f} GB/s")
        print(f"context {ctx:5d}  " + " | ".join(line))
