"""apply_token_bitmask kernel against :func:`kernels.token_bitmask.apply_token_bitmask_torch`: exact.

Vocabularies that are multiples of neither 32 nor the kernel's block, rows with every token masked but
one (the first, the last, and one whose word has the sign bit), all-allowed and random rows, padding
bits set past the vocabulary, float32/bfloat16/float16 logits and a strided (row-sliced) logits view.
"""

from __future__ import annotations

import pytest
import torch

from grammars.bitmask import apply_token_bitmask, pack_bitmask
from kernels.token_bitmask import (
    BLOCK_V,
    apply_token_bitmask_inplace,
    apply_token_bitmask_inplace_triton,
    apply_token_bitmask_torch,
    bitmask_width,
)


def _allowed(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    allowed = torch.rand(rows, vocab, generator=g) < 0.5
    allowed[0] = False
    allowed[0, vocab - 1] = True  # only the last token
    allowed[1] = False
    allowed[1, 0] = True  # only the first
    allowed[2] = False
    allowed[2, min(vocab - 1, 31 + 32 * (vocab // 64))] = True  # only one bit 31 (the sign bit)
    allowed[3] = True
    return allowed


@pytest.mark.parametrize("vocab", [37, BLOCK_V + 13, 2 * BLOCK_V + 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference(device, vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    rows = 6
    allowed = _allowed(rows, vocab, g)
    bitmask = pack_bitmask(allowed)
    bitmask[:, -1] |= torch.tensor(-1 << (vocab % 32), dtype=torch.int32) if vocab % 32 else 0  # padding bits
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    ref = apply_token_bitmask_torch(logits, bitmask)
    got = logits.to(device)
    apply_token_bitmask_inplace_triton(got, bitmask.to(device))
    assert torch.equal(got.cpu(), ref)
    assert torch.equal(torch.isfinite(got.cpu()), allowed)


def test_strided_rows_and_wide_bitmask(device):
    g = torch.Generator().manual_seed(1)
    vocab = 100
    big = torch.randn(8, vocab + 28, generator=g).to(device)
    logits = big[::2, :vocab]  # row stride vocab + 28, every other row
    allowed = _allowed(4, vocab, g)
    bitmask = torch.cat(
        [pack_bitmask(allowed), torch.full((4, 2), -1, dtype=torch.int32)], dim=1
    )  # extra words
    ref = apply_token_bitmask_torch(logits.cpu(), bitmask)
    apply_token_bitmask_inplace_triton(logits, bitmask.to(device))
    assert torch.equal(logits.cpu(), ref)
    assert bitmask_width(vocab) < bitmask.shape[1]


def test_dispatchers_off_cuda_are_the_reference():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 70, generator=g)
    bitmask = pack_bitmask(torch.rand(3, 70, generator=g) < 0.3)
    ref = apply_token_bitmask_torch(logits, bitmask)
    assert torch.equal(apply_token_bitmask(logits, bitmask), ref)
    inplace = logits.clone()
    apply_token_bitmask_inplace(inplace, bitmask)
    assert torch.equal(inplace, ref)
