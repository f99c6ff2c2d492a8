"""The draft heads' RoPE lookup table equals :func:`rope_cos_sin` bit for bit (it is the table of that
function's values), through growth and a swapped ``inv_freq``."""

from __future__ import annotations

import pytest
import torch

from specdec.models.decoder import RopeTable, rope_cos_sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_equals_rope_cos_sin_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    table = RopeTable()
    for high in (5, 300, 5000):  # each larger bound grows the table
        positions = torch.randint(0, high, (7,), generator=g)
        cos, sin = table(positions, inv_freq, 0.75, dtype)
        ref_cos, ref_sin = rope_cos_sin(positions, inv_freq, 0.75, dtype)
        assert cos.shape == ref_cos.shape == (7, 1, 64) and cos.dtype == dtype
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert table._cos.shape[0] > int(positions.max())
    # Negative control: another inv_freq (a new tensor) rebuilds the table instead of reusing it.
    other = inv_freq * 0.5
    positions = torch.tensor([0, 1, 4999])
    cos, _ = table(positions, other, 0.75, dtype)
    assert torch.equal(cos, rope_cos_sin(positions, other, 0.75, dtype)[0])
    assert not torch.equal(cos, rope_cos_sin(positions, inv_freq, 0.75, dtype)[0])


def test_empty_positions_take_the_function():
    inv_freq = torch.ones(4)
    cos, sin = RopeTable()(torch.zeros(0, dtype=torch.int64), inv_freq, 1.0, torch.float32)
    assert cos.shape == (0, 1, 8) and sin.shape == (0, 1, 8)


def test_a_deep_copy_rebuilds_its_table_for_its_own_inv_freq():
    """A deep copy's table is keyed by the copy's own ``inv_freq`` object: a new ``inv_freq`` on the copy
    (as ``.to(dtype)`` or a reload would set) gets its own values, not the original's."""
    import copy

    inv_freq = torch.tensor([1.0, 0.1])
    table = RopeTable()
    table(torch.tensor([3]), inv_freq, 1.0, torch.float32)
    clone = copy.deepcopy(table)
    other = torch.tensor([0.5, 0.05])
    cos, _ = clone(torch.tensor([3]), other, 1.0, torch.float32)
    assert torch.equal(cos, rope_cos_sin(torch.tensor([3]), other, 1.0, torch.float32)[0])
