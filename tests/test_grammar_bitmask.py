"""Packed token bitmasks (grammars/bitmask.py): layout, round trips, padding bits, reference masking."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grammars.bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask,
    bitmask_width,
    is_token_allowed,
    pack_bitmask,
    set_token_bits,
    token_ids_to_bitmask_row,
    unpack_bitmask,
)


def test_width_and_allocation():
    assert [bitmask_width(v) for v in (1, 31, 32, 33, 64, 49152, 49153)] == [1, 1, 1, 2, 2, 1536, 1537]
    m = allocate_token_bitmask(3, 70)
    assert m.dtype == torch.int32 and m.shape == (3, 3)
    assert (m == -1).all()
    assert unpack_bitmask(m, 70).all() and unpack_bitmask(m, 70).shape == (3, 70)
    with pytest.raises(ValueError):
        bitmask_width(0)
    with pytest.raises(ValueError):
        allocate_token_bitmask(-1, 10)


def test_bit_layout_is_token_32w_plus_j():
    """Bit j of word w is token 32 * w + j, including the sign bit (j = 31)."""
    for token in (0, 1, 5, 31, 32, 63, 64, 95):
        row = token_ids_to_bitmask_row([token], 96)
        word, bit = divmod(token, 32)
        expected = [0, 0, 0]
        expected[word] = (1 << bit) - (1 << 32 if bit == 31 else 0)
        assert row.tolist() == expected, token
        bm = row[None].clone()
        assert unpack_bitmask(bm, 96)[0].nonzero().flatten().tolist() == [token]
        assert is_token_allowed(bm, 0, token)
        assert not is_token_allowed(bm, 0, (token + 1) % 96)


def test_pack_unpack_and_ids_agree():
    gen = torch.Generator().manual_seed(0)
    allowed = torch.rand(4, 100, generator=gen) < 0.3
    packed = pack_bitmask(allowed)
    assert packed.shape == (4, 4) and packed.dtype == torch.int32
    assert torch.equal(unpack_bitmask(packed, 100), allowed)
    for r in range(4):
        ids = allowed[r].nonzero().flatten().numpy()
        assert torch.equal(token_ids_to_bitmask_row(ids, 100), packed[r])
    # padding bits past vocab_size are zero after packing
    assert ((packed[:, -1] >> 4) == 0).all()  # tokens 96..99 use bits 0..3 of the last word


def test_tail_bits_past_vocab_are_ignored():
    """All-ones padding (as allocated) and garbage padding never leak into unpack or apply."""
    vocab = 40  # 2 words, 24 padding bits in the second
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, 3] = True
    allowed[1, 39] = True
    bm = pack_bitmask(allowed)
    bm[:, 1] |= torch.tensor(-256, dtype=torch.int32)  # set every bit from token 40 (bit 8 of word 1) up
    assert torch.equal(unpack_bitmask(bm, vocab), allowed)
    logits = torch.zeros(2, vocab)
    out = apply_token_bitmask(logits, bm)
    assert torch.isfinite(out).sum(1).tolist() == [1, 1]
    assert out[0, 3] == 0 and out[1, 39] == 0


def test_apply_masks_with_minus_inf_and_keeps_input():
    logits = torch.arange(6, dtype=torch.float32).reshape(2, 3) - 1.5
    bm = pack_bitmask(torch.tensor([[True, False, True], [False, False, True]]))
    out = apply_token_bitmask(logits, bm)
    ninf = float("-inf")
    assert out.tolist() == [[-1.5, ninf, 0.5], [ninf, ninf, 3.5]]
    assert logits.tolist() == [[-1.5, -0.5, 0.5], [1.5, 2.5, 3.5]]  # not modified
    assert apply_token_bitmask(logits.to(torch.bfloat16), bm).dtype == torch.bfloat16


def test_apply_rejects_bad_shapes():
    logits = torch.zeros(2, 70)
    with pytest.raises(ValueError, match="too few"):
        apply_token_bitmask(logits, allocate_token_bitmask(2, 64))
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask(logits, allocate_token_bitmask(3, 70))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, allocate_token_bitmask(2, 70).long())
    with pytest.raises(ValueError, match="floating"):
        apply_token_bitmask(torch.zeros(2, 70, dtype=torch.int64), allocate_token_bitmask(2, 70))


def test_set_token_bits():
    bm = torch.zeros(2, 2, dtype=torch.int32)
    set_token_bits(bm, 1, [0, 31, 33], allowed=True)
    assert unpack_bitmask(bm, 64)[1].nonzero().flatten().tolist() == [0, 31, 33]
    assert (bm[0] == 0).all()
    set_token_bits(bm, 1, [31], allowed=False)
    assert unpack_bitmask(bm, 64)[1].nonzero().flatten().tolist() == [0, 33]
    with pytest.raises(IndexError):
        set_token_bits(bm, 0, [64], allowed=True)


def test_ids_outside_vocab_are_dropped():
    row = token_ids_to_bitmask_row(np.array([-1, 0, 9, 10, 1000]), 10)
    assert unpack_bitmask(row[None], 10)[0].nonzero().flatten().tolist() == [0, 9]


@settings(max_examples=200, deadline=None)
@given(
    vocab=st.integers(1, 200),
    rows=st.integers(1, 4),
    data=st.data(),
)
def test_property_pack_unpack_apply_round_trip(vocab, rows, data):
    """pack∘unpack is the identity on every bool mask; apply keeps exactly the allowed logits."""
    flat = data.draw(st.lists(st.booleans(), min_size=rows * vocab, max_size=rows * vocab))
    allowed = torch.tensor(flat, dtype=torch.bool).reshape(rows, vocab)
    packed = pack_bitmask(allowed)
    assert packed.shape == (rows, bitmask_width(vocab))
    assert torch.equal(unpack_bitmask(packed, vocab), allowed)
    assert torch.equal(pack_bitmask(unpack_bitmask(packed, vocab)), packed)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    out = apply_token_bitmask(logits, packed)
    assert torch.equal(torch.isfinite(out), allowed)
    assert torch.equal(out[allowed], logits[allowed])
