"""Packed token bitmasks: the format grammars write and the logits masking reads.

A bitmask for ``rows`` logits rows over a vocabulary of ``vocab_size`` tokens is an int32 tensor
``[rows, ceil(vocab_size / 32)]``: bit ``j`` (value ``1 << j``, bit 31 being the sign bit) of word ``w``
says whether token ``32 * w + j`` is allowed (1) or not (0). This is the layout of xgrammar's and vLLM's
token bitmasks, 32× smaller than a bool mask, so a CPU-filled mask is cheap to ship to an accelerator.
Bits at positions ``>= vocab_size`` in the last word are padding and are ignored by every reader.

:func:`apply_token_bitmask_torch` is the pure-torch reference; the Triton kernel must match it exactly,
and :func:`apply_token_bitmask` uses it on CUDA. Both, and the format's basic helpers
(:data:`BITS_PER_WORD`, :func:`bitmask_width`, :func:`unpack_bitmask`), are defined in
:mod:`kernels.token_bitmask` (the layer below, see ``docs/layers.md``) and re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from kernels._triton import use_triton
from kernels.token_bitmask import (
    BITS_PER_WORD,
    apply_token_bitmask_inplace_triton,
    apply_token_bitmask_torch,
    bitmask_width,
    check_bitmask,
    unpack_bitmask,
)

__all__ = [
    "BITS_PER_WORD",
    "allocate_token_bitmask",
    "apply_token_bitmask",
    "apply_token_bitmask_torch",
    "bitmask_width",
    "check_bitmask",
    "is_token_allowed",
    "pack_bitmask",
    "set_token_bits",
    "token_ids_to_bitmask_row",
    "unpack_bitmask",
]


def allocate_token_bitmask(
    num_rows: int, vocab_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """A bitmask with every token allowed (every bit set, i.e. every word ``-1``).

    Returns:
        int32 ``[num_rows, ceil(vocab_size / 32)]``.

    Raises:
        ValueError: ``num_rows`` < 0 or ``vocab_size`` < 1.
    """
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32, device=device)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask (inverse of :func:`unpack_bitmask`; padding bits are 0).

    Args:
        allowed: bool ``[rows, vocab_size]``, True = allowed.

    Returns:
        int32 ``[rows, ceil(vocab_size / 32)]``.

    Raises:
        ValueError: ``allowed`` is not a 2-D bool tensor.
    """
    if allowed.dtype != torch.bool or allowed.dim() != 2:
        raise ValueError(f"allowed must be bool [rows, vocab], got {allowed.dtype} {list(allowed.shape)}")
    rows, vocab = allowed.shape
    width = bitmask_width(vocab)
    padded = torch.zeros(rows, width * BITS_PER_WORD, dtype=torch.int64, device=allowed.device)
    padded[:, :vocab] = allowed.long()
    weights = torch.ones(BITS_PER_WORD, dtype=torch.int64, device=allowed.device) << torch.arange(
        BITS_PER_WORD, device=allowed.device
    )
    words = (padded.view(rows, width, BITS_PER_WORD) * weights).sum(-1)  # in [0, 2**32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def token_ids_to_bitmask_row(token_ids: Iterable[int] | np.ndarray, vocab_size: int) -> torch.Tensor:
    """One packed row allowing exactly ``token_ids`` (ids outside ``[0, vocab_size)`` are ignored).

    Uses numpy's ``packbits`` (little bit order, words read little-endian), about 20 µs for a
    49k-token vocabulary.

    Returns:
        int32 ``[ceil(vocab_size / 32)]`` (CPU).
    """
    width = bitmask_width(vocab_size)
    ids = np.fromiter(token_ids, dtype=np.int64) if not isinstance(token_ids, np.ndarray) else token_ids
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    bits = np.zeros(width * BITS_PER_WORD, dtype=np.bool_)
    bits[ids] = True
    words = np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)
    return torch.from_numpy(words)


def set_token_bits(bitmask: torch.Tensor, row: int, token_ids: Iterable[int], allowed: bool) -> None:
    """Allow (``allowed=True``) or forbid the given tokens in ``bitmask[row]``, in place; other bits stay.

    Args:
        bitmask: int32 ``[rows, W]``.
        row: the row to change.
        token_ids: ids in ``[0, 32 * W)``.

    Raises:
        IndexError: an id outside ``[0, 32 * W)``.
    """
    width = bitmask.shape[1]
    for t in token_ids:
        t = int(t)
        if not 0 <= t < width * BITS_PER_WORD:
            raise IndexError(f"token id {t} outside the bitmask's {width * BITS_PER_WORD} bits")
        word, bit = divmod(t, BITS_PER_WORD)
        value = int(bitmask[row, word]) & 0xFFFFFFFF
        value = value | (1 << bit) if allowed else value & ~(1 << bit)
        bitmask[row, word] = value - 2**32 if value >= 2**31 else value


def is_token_allowed(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    """Whether bit ``token_id`` of ``bitmask[row]`` is set."""
    word, bit = divmod(int(token_id), BITS_PER_WORD)
    return bool((int(bitmask[row, word]) >> bit) & 1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens get ``-inf``; ``logits`` is not modified. On CUDA the Triton kernel of
    :mod:`kernels.token_bitmask` masks a copy (unless ``SPECDEC_FORCE_REFERENCE=1``); elsewhere
    :func:`apply_token_bitmask_torch` runs. Arguments, result and errors: as the reference's.
    """
    if (
        logits.is_cuda
        and logits.dim() == 2
        and logits.is_floating_point()
        and bitmask.dim() == 2
        and bitmask.shape[0] == logits.shape[0]
        and use_triton(logits, bitmask)
    ):
        check_bitmask(bitmask, logits.shape[1])
        out = logits.clone(memory_format=torch.contiguous_format)
        apply_token_bitmask_inplace_triton(out, bitmask.contiguous())
        return out
    return apply_token_bitmask_torch(logits, bitmask)
