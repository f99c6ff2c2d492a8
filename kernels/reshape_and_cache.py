"""reshape_and_cache: write the new tokens' K/V into the paged cache at their slots.

Token ``t``'s key and value ``[num_kv_heads, head_dim]`` go to slot ``slot_mapping[t]`` (block id ×
block size + offset in block) of ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads,
head_dim]``; a slot of -1 is skipped. The reference is :func:`write_kv` (pure torch, the engine's CPU
path; it also writes int8 caches, quantized, see :mod:`kernels.kv_int8`), defined here beside the Triton
kernel and re-exported by :mod:`specdec.attention.reference`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels._triton import lazy_jit, next_power_of_2, use_triton
from kernels.kv_int8 import is_int8_cache, quantize_kv

if TYPE_CHECKING:  # at run time lazy_jit binds `tl` when it first jits a kernel of this module
    import triton.language as tl


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[T]``; -1 is skipped.
    An int8 cache stores them quantized (codes and scale per token and head)."""
    num_kv_heads = key.shape[1]
    flat_k = k_cache.view(-1, num_kv_heads, k_cache.shape[-1])
    flat_v = v_cache.view(-1, num_kv_heads, v_cache.shape[-1])
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    if is_int8_cache(k_cache):
        key, value = quantize_kv(key), quantize_kv(value)
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The reference: :func:`write_kv`."""
    write_kv(key, value, k_cache, v_cache, slot_mapping)


@lazy_jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_co,
    stride_ch,
    stride_cd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        head = i // HEAD_DIM
        dim = i % HEAD_DIM
        ok = i < NUM_KV_HEADS * HEAD_DIM
        dst = block * stride_cb + offset * stride_co + head * stride_ch + dim * stride_cd
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim * stride_kd, mask=ok)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim * stride_vd, mask=ok)
        tl.store(k_cache_ptr + dst, k, mask=ok)
        tl.store(v_cache_ptr + dst, v, mask=ok)


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch the Triton kernel: one program per token (and per 1024 elements of its heads).

    ``key``/``value`` ``[T, KVH, D]`` may be strided views (the model passes slices of its fused QKV
    projection); the caches must have the same strides as each other.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("key/value and k_cache/v_cache must have matching shapes (and cache strides)")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"key {tuple(key.shape)}, cache {tuple(k_cache.shape)}, slot_mapping {tuple(slot_mapping.shape)}"
        )
    if num_tokens == 0:
        return
    if key.dtype != k_cache.dtype:
        # Converted here by torch (round to nearest even), not in the kernel: the interpreter truncates
        # float32 -> bfloat16. The engine's caches have the model's dtype, so this never runs there.
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    width = num_kv_heads * head_dim
    block = min(1024, next_power_of_2(width))
    _reshape_and_cache_kernel[(num_tokens, -(-width // block))](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK=block,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write K/V at ``slot_mapping`` (-1 skipped): Triton on CUDA, the reference elsewhere."""
    if use_triton(key, k_cache):
        reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping)
