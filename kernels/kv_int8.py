"""The int8 KV cache layout in torch: quantize on write, dequantize on read.

An int8 cache tensor is ``[num_blocks, block_size, num_kv_heads, head_dim + 4]`` int8: each token-head
row holds its ``head_dim`` codes followed by the 4 bytes of its float32 scale (see
:mod:`specdec.quantization.kv_cache`, which allocates and sizes the caches and re-exports these
functions). Quantization is symmetric round to nearest per (token, head): ``scale = max |x| / 127``,
``code = round(x / scale)``.

Defined here because the reference K/V write (:func:`kernels.reshape_and_cache.write_kv`) quantizes an
int8 cache, and ``kernels`` imports no package above it (see ``docs/layers.md``).
"""

from __future__ import annotations

import torch

__all__ = ["QMAX", "SCALE_BYTES", "dequantize_kv", "is_int8_cache", "quantize_kv"]

#: Bytes of the per-(token, head) scale of the int8 layout (float32).
SCALE_BYTES = 4
#: Largest code magnitude.
QMAX = 127


def is_int8_cache(cache: torch.Tensor) -> bool:
    """Whether a cache tensor uses the int8 layout."""
    return cache.dtype == torch.int8


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` (any float dtype) -> ``[..., head_dim + 4]`` int8 rows: codes, then the
    float32 scale's bytes."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / QMAX  # [..., 1]
    codes = torch.round(xf / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-QMAX, QMAX)
    return torch.cat([codes.to(torch.int8), scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv`: ``[..., head_dim + 4]`` int8 -> ``[..., head_dim]`` in ``dtype``."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(dtype)
