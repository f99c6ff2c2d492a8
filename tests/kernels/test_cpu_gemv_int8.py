"""The weight-only int8 kernel (:mod:`kernels.cpu_gemv_int8`) against its reference (dequantize, then
``F.linear``), within its stated bound: the input's int16 rounding (:func:`error_bound`) plus the output
rounding of the two results. Then its users: :class:`QuantizedLinear` sends few-row int8 products to it,
and the C++ layer stack takes int8 layers and equals their per-layer path bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_gemv_int8
from kernels.cpu_gemv_int8 import error_bound, gemv_int8, gemv_int8_reference

pytestmark = pytest.mark.skipif(not cpu_gemv_int8.available(), reason="the CPU kernels do not build here")

# (M, N, K): one row and the row groups (4 weight rows at once for 1-2 input rows, 2 for 3-4), passes of
# 16 rows (17: 9 + 8), K not a multiple of 32 or 64, K beyond one int32 chunk (4096), tiny shapes
SHAPES = [(1, 37, 70), (2, 100, 576), (3, 5, 64), (4, 64, 96), (5, 33, 1536), (16, 19, 128), (17, 40, 200),
          (40, 24, 300), (64, 17, 96), (1, 9, 9000), (7, 3, 4097), (2, 1, 1)]  # fmt: skip


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) / 100).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, codes, scales, b


def _assert_within_bound(got: torch.Tensor, x, codes, scales, bias) -> None:
    want = gemv_int8_reference(x, codes, scales, bias)
    assert got.shape == want.shape and got.dtype == x.dtype
    # the kernel's input rounding, then both results' output rounding (bfloat16: half a step each, 2^-8
    # of |y| between them; float32: accumulation order), and float32 products of the scales
    rounding = 2.0**-7 if x.dtype == torch.bfloat16 else 1e-5
    bound = error_bound(x, codes, scales) + rounding * want.float().abs() + 1e-5
    err = (got.float() - want.float()).abs()
    assert bool((err <= bound).all()), (
        f"max error {err.max():.3g}, bound there {bound.flatten()[err.argmax()]:.3g}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_within_its_bound_of_the_reference(shape, dtype):
    x, codes, scales, bias = _case(*shape, dtype)
    _assert_within_bound(gemv_int8(x, codes, scales, bias), x, codes, scales, bias)
    _assert_within_bound(gemv_int8(x, codes, scales, None), x, codes, scales, None)


def test_bound_is_tight_enough_to_catch_a_wrong_scale():
    """Negative control: a kernel result with one output row's scale off by 1 % falls outside the bound."""
    x, codes, scales, bias = _case(5, 64, 576, torch.float32)
    got = gemv_int8(x, codes, scales, bias)
    got[:, 7] = (got[:, 7] - bias[7]) * 1.01 + bias[7]
    with pytest.raises(AssertionError):
        _assert_within_bound(got, x, codes, scales, bias)


def test_edge_inputs():
    """No rows: an empty result. A zero input row: exactly the bias. A strided input row: as contiguous."""
    x, codes, scales, bias = _case(3, 20, 100, torch.bfloat16)
    assert gemv_int8(x[:0], codes, scales, bias).shape == (0, 20)
    x[1] = 0
    assert torch.equal(gemv_int8(x, codes, scales, bias)[1], bias)
    wide = torch.zeros(3, 200, dtype=torch.bfloat16)
    wide[:, ::2] = x
    assert torch.equal(gemv_int8(wide[:, ::2], codes, scales, bias), gemv_int8(x, codes, scales, bias))
    with pytest.raises(RuntimeError, match="int8"):
        gemv_int8(x, codes.float(), scales, bias)
    with pytest.raises(RuntimeError, match="one scale per output row"):
        gemv_int8(x, codes, scales[:5], bias)


def test_rows_are_independent():
    """Each input row's quantization scale is its own: a row's output does not depend on the others."""
    x, codes, scales, bias = _case(6, 48, 256, torch.bfloat16, seed=3)
    together = gemv_int8(x, codes, scales, bias)
    for i in range(6):
        assert torch.equal(gemv_int8(x[i : i + 1], codes, scales, bias), together[i : i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quantized_linear_takes_the_kernel_for_few_rows(dtype):
    from specdec.quantization.linear import QuantizedLinear

    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    layer = QuantizedLinear.from_weight(weight, bias, "int8", None, dtype)
    assert layer.int8_kernel and "cpu_gemv_int8" in repr(layer)
    for rows in (1, 5, cpu_gemv_int8.MAX_ROWS):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        assert torch.equal(layer(x), gemv_int8(x, layer.qweight, layer.scales, layer.bias))
    wide = torch.randn(cpu_gemv_int8.MAX_ROWS + 1, 64, generator=g).to(dtype)  # a GEMM: the reference
    assert torch.equal(
        layer(wide), torch.nn.functional.linear(wide, layer.dequantized_weight(dtype), layer.bias)
    )
    forced = QuantizedLinear.from_weight(weight, bias, "int8", None, dtype, kernel="reference")
    assert not forced.int8_kernel
