"""KV cache tensors: in the model's dtype (``"auto"``) or int8 with one scale per token and KV head.

Layout per layer, for K and for V: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype
(``"auto"``), or for ``"int8"`` ``[num_blocks, block_size, num_kv_heads, head_dim + 4]`` int8: the
head's ``head_dim`` codes followed by the 4 bytes of its float32 scale, so one token-head is one row
(like llama.cpp's ``q8_0`` blocks, which carry their scale beside their codes). Keeping the scale inside the
same tensor leaves everything that moves K/V by slot or by block (copy on write, token-tree compaction,
zeroing) unchanged.

Quantization is symmetric round to nearest per (token, head): ``scale = max |x| / 127``, ``code =
round(x / scale)``, so every element is within ``scale / 2`` of the original (KIVI, Liu et al. 2024,
and KVQuant, Hooper et al. 2024, quantize keys per channel for lower error at 2-4 bits; at 8 bits
per-token scales lose little, see ``tests/test_quantized_quality.py``). The attention reference quantizes
on write (at the slot mapping) and dequantizes on read; see :mod:`specdec.attention.reference`. The
per-row functions (:func:`quantize_kv`, :func:`dequantize_kv`, :func:`is_int8_cache`) are defined in
:mod:`kernels.kv_int8`, beside the reference K/V write that uses them, and re-exported here.

Bytes per token: ``layers × 2 × kv_heads × head_dim × element size`` (auto), ``layers × 2 × kv_heads ×
(head_dim + 4)`` (int8): for SmolLM2 (30 layers, 3 KV heads of 64) 46,080 bytes in float32, 23,040 in
bfloat16 and 12,240 in int8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kernels.kv_int8 import SCALE_BYTES, dequantize_kv, is_int8_cache, quantize_kv
from specdec.errors import ConfigError

if TYPE_CHECKING:
    from specdec.models.config import ModelArchConfig

__all__ = [
    "KV_CACHE_DTYPES",
    "SCALE_BYTES",
    "allocate_kv_caches",
    "check_kv_cache_dtype",
    "dequantize_kv",
    "is_int8_cache",
    "kv_bytes_per_token",
    "kv_cache_shape",
    "kv_storage_dtype",
    "quantize_kv",
]

#: ``kv_cache_dtype`` values: the model's dtype, or int8 codes with a float32 scale per token and head.
KV_CACHE_DTYPES = ("auto", "int8")


def check_kv_cache_dtype(kv_cache_dtype: object) -> None:
    """Raises ConfigError unless ``kv_cache_dtype`` is one of :data:`KV_CACHE_DTYPES`."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str
) -> tuple[int, int, int, int]:
    """Shape of one layer's K (or V) cache tensor."""
    check_kv_cache_dtype(kv_cache_dtype)
    last = head_dim + SCALE_BYTES if kv_cache_dtype == "int8" else head_dim
    return (num_blocks, block_size, num_kv_heads, last)


def kv_storage_dtype(model_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The cache tensors' dtype."""
    check_kv_cache_dtype(kv_cache_dtype)
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def allocate_kv_caches(
    cfg: ModelArchConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_cache_dtype: str = "auto",
    zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(k_cache, v_cache)``, zero-filled (padded reads of unused slots are masked, and 0 ×
    finite stays finite; an int8 slot of zeros has scale 0 and dequantizes to 0). ``zeros(shape, dtype)``
    allocates each one on the CPU instead of ``torch.zeros`` (the engine's pool on huge pages:
    :func:`specdec.engine.huge_pages.zeros_on_huge_pages`); ignored on other devices.

    Raises:
        ConfigError: unknown ``kv_cache_dtype``, or int8 with a head size not divisible by 4 (the scale's
            bytes must stay 4-byte aligned).
    """
    if kv_cache_dtype == "int8" and cfg.head_dim % SCALE_BYTES:
        raise ConfigError(f"kv_cache_dtype='int8' needs head_dim divisible by 4, got {cfg.head_dim}")
    shape = kv_cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, kv_cache_dtype)
    storage = kv_storage_dtype(dtype, kv_cache_dtype)
    if zeros is None or torch.device(device).type != "cpu":
        return [
            (
                torch.zeros(shape, dtype=storage, device=device),
                torch.zeros(shape, dtype=storage, device=device),
            )
            for _ in range(cfg.num_layers)
        ]
    return [(zeros(shape, storage), zeros(shape, storage)) for _ in range(cfg.num_layers)]


def kv_bytes_per_token(cfg: ModelArchConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V for one token across all layers (see the module docstring)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "int8":
        per_head = cfg.head_dim + SCALE_BYTES
    else:
        per_head = cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * cfg.num_kv_heads * per_head
