"""The CPU kernel of each row's maximum and first index (``kernels/csrc/cpu_max_rows.cpp``) against its
torch reference (``torch.max(x, dim=-1)``, :func:`kernels.cpu_max_rows.max_rows_reference`).

- Equal indices and values (NaN where the reference has NaN) for widths below, at and around the 16-lane
  loop, SmolLM2's vocabulary and one past it; 1 row (inline) to 32 (across threads).
- Ties (small integers: many equal maxima, in several lanes) keep the first index; a negative control,
  the last maximal index, differs on the same inputs, so the comparison can fail.
- A NaN anywhere gives NaN at its first index; +inf wins; a row of -inf gives -inf at index 0.
- Signed zeros keep the first one's sign; rows further apart than their length; strided rows, bfloat16
  and autograd leaves fall back to the reference (the engine's greedy tests run on the kernel).
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_max_rows

pytestmark = pytest.mark.skipif(not cpu_max_rows.available(), reason="the CPU kernels do not build here")

WIDTHS = [1, 5, 15, 16, 17, 31, 33, 4096, 49152, 49157]


def _equal(x: torch.Tensor) -> None:
    values, indices = torch.ops.specdec_cpu.max_rows(x)  # the kernel itself, not the dispatching wrapper
    want_values, want_indices = cpu_max_rows.max_rows_reference(x)
    assert indices.dtype == torch.int64 and values.dtype == torch.float32
    assert torch.equal(indices, want_indices)
    nan = want_values.isnan()
    assert torch.equal(values.isnan(), nan) and torch.equal(values[~nan], want_values[~nan])
    assert torch.equal(values.signbit(), want_values.signbit())  # -0.0 and +0.0: the first one's sign


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_random_rows_equal_the_reference(rows, width):
    g = torch.Generator().manual_seed(rows * 100003 + width)
    _equal(torch.randn(rows, width, generator=g))
    _equal(torch.randn(rows, width, generator=g) * 1e30)


@pytest.mark.parametrize("width", WIDTHS)
def test_ties_keep_the_first_index_and_a_last_index_control_differs(width):
    g = torch.Generator().manual_seed(width)
    x = torch.randint(-2, 3, (8, width), generator=g).float()  # maxima repeated across the lanes
    _equal(x)
    if width >= 16:
        last = width - 1 - x.flip(-1).max(dim=-1).indices  # the negative control: last maximal index
        assert not torch.equal(torch.ops.specdec_cpu.max_rows(x)[1], last)


@pytest.mark.parametrize("width", WIDTHS)
def test_nan_inf_and_empty_rows(width):
    x = torch.randn(5, width)
    x[0, width // 2] = float("nan")  # NaN mid-row
    x[1, width - 1] = float("nan")  # NaN in the tail, a larger value earlier
    x[1, 0] = 1e9
    x[2, width // 3] = float("inf")
    x[3] = float("-inf")  # nothing left to sample
    x[4, 0], x[4, -1] = float("nan"), float("nan")  # two NaNs: the first
    _equal(x)
    values, indices = torch.ops.specdec_cpu.max_rows(x)
    assert values[0].isnan() and indices[0] == width // 2
    assert values[3] == float("-inf") and indices[3] == 0


def test_signed_zeros_and_padded_rows():
    x = torch.zeros(4, 40)
    x[0, 3], x[1, 20], x[2, 39] = -0.0, -0.0, -0.0  # ties of -0.0 and +0.0: the first index wins
    x[3] = -0.0
    x[3, 17] = 0.0
    _equal(x)
    wide = torch.randn(6, 49160)
    _equal(wide[:, :49152])  # rows further apart than their length (stride(0) > n)
    _equal(wide[1:4, 8:])


def test_the_wrapper_falls_back_where_the_kernel_does_not_apply(monkeypatch):
    fallbacks = []
    reference = cpu_max_rows.max_rows_reference

    def counted(t):
        fallbacks.append(tuple(t.shape))
        return reference(t)

    monkeypatch.setattr(cpu_max_rows, "max_rows_reference", counted)
    x = torch.randn(4, 2 * 49152)
    strided = x[:, ::2]
    assert torch.equal(cpu_max_rows.max_rows(strided)[1], strided.max(dim=-1).indices)
    b = x.bfloat16()
    assert torch.equal(cpu_max_rows.max_rows(b)[1], b.max(dim=-1).indices)
    leaf = torch.randn(3, 100, requires_grad=True)
    assert torch.equal(cpu_max_rows.max_rows(leaf)[1], leaf.max(dim=-1).indices)
    assert fallbacks == [(4, 49152), (4, 2 * 49152), (3, 100)]  # strided, bfloat16, autograd leaf
    assert torch.equal(cpu_max_rows.max_rows(x)[1], x.max(dim=-1).indices)
    assert len(fallbacks) == 3  # contiguous float32 rows: the kernel


def test_sampling_argmax_rows_goes_through_the_kernel(monkeypatch):
    from sampling import sampler

    calls = []
    real = cpu_max_rows.max_rows

    def spy(x):
        calls.append(tuple(x.shape))
        return real(x)

    monkeypatch.setattr(sampler, "max_rows", spy)

    def no_reference(x):
        raise AssertionError("the kernel applies: the reference must not run")

    monkeypatch.setattr(cpu_max_rows, "max_rows_reference", no_reference)
    x = torch.randn(6, 49152)
    assert torch.equal(sampler.argmax_rows(x), x.argmax(dim=-1)) and calls == [(6, 49152)]
    y = torch.randn(2, 3, 50)  # not [rows, vocab]: torch's max
    assert torch.equal(sampler.argmax_rows(y), y.argmax(dim=-1)) and len(calls) == 1
