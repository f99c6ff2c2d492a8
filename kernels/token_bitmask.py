"""apply_token_bitmask: a packed int32 token bitmask applied to logits in place (masked -> -inf).

The format (:mod:`grammars.bitmask` packs and fills it): an int32 tensor ``[rows, ceil(vocab_size /
32)]`` whose bit ``j`` (value ``1 << j``, bit 31 being the sign bit) of word ``w`` allows token ``32 * w +
j``; padding bits past the vocabulary are ignored. The pure-torch reference,
:func:`apply_token_bitmask_torch` (out of place; it is the ground truth), lives here beside the Triton
kernel, with the helpers it needs (:func:`bitmask_width`, :func:`unpack_bitmask`);
:mod:`grammars.bitmask` re-exports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels._triton import cdiv, lazy_jit, use_triton

if TYPE_CHECKING:  # at run time lazy_jit binds `tl` when it first jits a kernel of this module
    import triton.language as tl

BITS_PER_WORD = 32


# ----------------------------------------------------------------------------------------- reference
def bitmask_width(vocab_size: int) -> int:
    """Words per row: ``ceil(vocab_size / 32)``.

    Raises:
        ValueError: ``vocab_size`` < 1.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def _bit_positions(device: torch.device) -> torch.Tensor:
    return torch.arange(BITS_PER_WORD, dtype=torch.int32, device=device)


def check_bitmask(bitmask: torch.Tensor, vocab_size: int) -> None:
    """Raises ValueError unless ``bitmask`` is int32 ``[rows, W]`` with ``32 * W >= vocab_size``."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be int32 [rows, words], got {bitmask.dtype} {list(bitmask.shape)}")
    if bitmask.shape[1] * BITS_PER_WORD < vocab_size:
        raise ValueError(
            f"bitmask has {bitmask.shape[1]} words per row, too few for vocab_size {vocab_size} "
            f"(needs {bitmask_width(vocab_size)})"
        )


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack to one bool per token.

    Args:
        bitmask: int32 ``[rows, W]`` with ``32 * W >= vocab_size``.
        vocab_size: tokens to unpack; padding bits beyond it are dropped.

    Returns:
        bool ``[rows, vocab_size]`` on ``bitmask``'s device, True = allowed.

    Raises:
        ValueError: wrong dtype or rank, or too few words for ``vocab_size``.
    """
    check_bitmask(bitmask, vocab_size)
    bits = (bitmask.unsqueeze(-1) >> _bit_positions(bitmask.device)) & 1  # arithmetic shift; bit 0 is exact
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Reference masking in pure torch: disallowed tokens get ``-inf``; ``logits`` is not modified.

    Args:
        logits: float ``[rows, V]`` (any floating dtype, any device).
        bitmask: int32 ``[rows, W]`` with ``32 * W >= V``, on ``logits``' device.

    Returns:
        a new ``[rows, V]`` tensor of ``logits``' dtype.

    Raises:
        ValueError: row counts differ, ``logits`` is not 2-D floating point, or ``bitmask`` is not int32
            with enough words.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be floating [rows, vocab], got {logits.dtype} {list(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask {list(bitmask.shape)} does not match logits {list(logits.shape)} rows")
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_inplace_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The reference, in place: ``logits`` takes the values of :func:`apply_token_bitmask_torch`."""
    logits.copy_(apply_token_bitmask_torch(logits, bitmask))


# -------------------------------------------------------------------------------------------- triton
#: Logits per program.
BLOCK_V = 1024


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
