"""apply_token_bitmask: a packed int32 token bitmask applied to logits in place (masked -> -inf).

The format is :mod:`grammars.bitmask`'s: bit ``j`` of word ``w`` of a row allows token ``32 * w + j``;
padding bits past the vocabulary are ignored. The reference is
:func:`grammars.bitmask.apply_token_bitmask_torch` (out of place; it is the ground truth).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grammars.bitmask import apply_token_bitmask_torch
from kernels._triton import cdiv, lazy_jit, use_triton

if TYPE_CHECKING:  # at run time lazy_jit binds `tl` when it first jits a kernel of this module
    import triton.language as tl

#: Logits per program.
BLOCK_V = 1024


def apply_token_bitmask_inplace_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The reference, in place: ``logits`` takes the values of
    :func:`grammars.bitmask.apply_token_bitmask_torch`."""
    logits.copy_(apply_token_bitmask_torch(logits, bitmask))


@lazy_jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    vocab_size,
    stride_lr,
    stride_br,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = v < vocab_size
    words = tl.load(bitmask_ptr + row * stride_br + v // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (v % 32)) & 1) != 0  # arithmetic shift: bit 0 of the result is exact
    # Only masked entries are written (no arithmetic on the logits, whatever their dtype).
    neg_inf = tl.full([BLOCK], float("-inf"), dtype=tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row.to(tl.int64) * stride_lr + v, neg_inf, mask=in_vocab & ~allowed)


def apply_token_bitmask_inplace_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Launch the Triton kernel on ``logits`` ``[rows, V]`` (unit stride along V) and int32 ``bitmask``
    ``[rows, >= ceil(V / 32)]``; one program per row and ``BLOCK_V`` tokens."""
    rows, vocab = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.shape[0] != rows or bitmask.shape[1] * 32 < vocab:
        raise ValueError(
            f"bitmask {bitmask.dtype} {list(bitmask.shape)} does not fit logits {list(logits.shape)}"
        )
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    if rows == 0:
        return
    _apply_token_bitmask_kernel[(rows, cdiv(vocab, BLOCK_V))](
        logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK_V
    )


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask ``logits`` in place: Triton on CUDA, the reference elsewhere."""
    if use_triton(logits, bitmask) and logits.stride(1) == 1 and bitmask.stride(1) == 1:
        apply_token_bitmask_inplace_triton(logits, bitmask)
    else:
        apply_token_bitmask_inplace_ref(logits, bitmask)
