"""Typed engine configuration, validated with ``ValueError`` at construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CacheConfig:
    """Paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        num_kv_blocks: blocks in the pool; None sizes the pool to hold ``max_num_seqs`` full-length
            sequences, capped at ``kv_cache_memory_bytes``.
        enable_prefix_caching: share full blocks of equal prefixes between requests.
        kv_cache_memory_bytes: memory budget for the pool when ``num_kv_blocks`` is None.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int = 2 * 1024**3

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")


@dataclass
class SchedulerConfig:
    """Continuous batching.

    Attributes:
        max_num_batched_tokens: token budget of one forward (prefill chunks + decode tokens + drafts).
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence (prompt + output); None: the model's maximum.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` or a torch dtype.

    Raises:
        ValueError: any other dtype.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None picks CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
