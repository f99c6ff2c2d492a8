"""The weight-only int8 kernel (:mod:`kernels.cpu_gemv_int8`) against its reference (dequantize, then
``F.linear``), within its stated bound: the input's int16 rounding (:func:`error_bound`) plus the output
rounding of the two results, on the row-major codes and on their tile-order copy (the tile kernel, where
the kernels have AVX512_VNNI). Then its users: :class:`QuantizedLinear` sends few-row int8 products to it,
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


def _packed(codes: torch.Tensor, layout: str) -> torch.Tensor | None:
    """None (row-major) or the codes' tile-order copy; skips where the tile kernel is not built."""
    if layout == "rowmajor":
        return None
    if not cpu_gemv_int8.tiles():
        pytest.skip("the int8 tile kernel needs AVX512_VNNI")
    return cpu_gemv_int8.pack_tiles(codes)


LAYOUTS = ["rowmajor", "tiles"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_within_its_bound_of_the_reference(shape, dtype, layout):
    x, codes, scales, bias = _case(*shape, dtype)
    packed = _packed(codes, layout)
    _assert_within_bound(gemv_int8(x, codes, scales, bias, packed), x, codes, scales, bias)
    _assert_within_bound(gemv_int8(x, codes, scales, None, packed), x, codes, scales, None)


@pytest.mark.parametrize("shape", [(1, 1), (64, 32), (100, 70), (960, 576), (19, 4097)])
def test_tile_packing_equals_its_reference(shape):
    codes = torch.randint(-127, 128, shape, generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    got = _packed(codes, "tiles")
    want = cpu_gemv_int8.pack_tiles_reference(codes)
    assert got.dtype == torch.int8 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_tile_kernel_rows_are_batch_invariant(dtype):
    """A row's outputs are the same bits whichever rows share its passes (1, 5, 6, 7, 13 and 40 rows:
    passes of up to 6), K past one 512-column block; and they agree with the row-major kernel within
    float32 rounding (the two add their integer partial sums in different groupings)."""
    x, codes, scales, bias = _case(40, 150, 1100, dtype, seed=5)
    packed = _packed(codes, "tiles")
    alone = torch.cat([gemv_int8(x[i : i + 1], codes, scales, bias, packed) for i in range(40)])
    for rows in (5, 6, 7, 13, 40):
        assert torch.equal(gemv_int8(x[:rows], codes, scales, bias, packed), alone[:rows])
    rowmajor = gemv_int8(x, codes, scales, bias)
    if dtype == torch.float32:
        torch.testing.assert_close(alone, rowmajor, rtol=1e-5, atol=1e-4)
    else:  # one bfloat16 step at most
        assert bool(((alone.float() - rowmajor.float()).abs() <= 2.0**-7 * rowmajor.float().abs()).all())
    with pytest.raises(RuntimeError, match="pack_int8_tiles"):
        gemv_int8(x, codes, scales, bias, _packed(codes[:, :500], "tiles"))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_packed_quantized_linear_takes_the_tile_kernel(dtype):
    """use_packed_weights gives an int8 layer on the kernel its tile-order codes, and its products are the
    tile kernel's (within the bound of the reference); SPECDEC_CPU_INT8_TILES=0 keeps it row-major."""
    from specdec.models.cpu_linear import use_packed_weights
    from specdec.quantization.linear import QuantizedLinear

    g = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(130, 600, generator=g), torch.randn(130, generator=g)
    layer = QuantizedLinear.from_weight(weight, bias, "int8", None, dtype)
    packed = _packed(layer.qweight, "tiles")
    assert layer.packed is None and use_packed_weights(layer) == 1 and torch.equal(layer.packed, packed)
    x = torch.randn(3, 600, generator=g).to(dtype)
    got = layer(x)
    assert torch.equal(got, gemv_int8(x, layer.qweight, layer.scales, layer.bias, packed))
    _assert_within_bound(got, x, layer.qweight, layer.scales, layer.bias)
    # the products read the tile copy: a copy of other codes (negated) gives their product, not the layer's
    other = cpu_gemv_int8.pack_tiles(-layer.qweight)
    layer.set_tile_codes(other)
    negated = layer(x)
    assert torch.equal(negated, gemv_int8(x, -layer.qweight, layer.scales, layer.bias, other))
    assert not torch.allclose(negated, got)
    layer.set_tile_codes(packed)
    layer.qweight = -layer.qweight  # codes replaced: their old tile copy is no longer used
    assert layer.tile_codes() is None
    assert torch.equal(layer(x), gemv_int8(x, layer.qweight, layer.scales, layer.bias))
    again = QuantizedLinear.from_weight(weight, bias, "int8", None, dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_gemv_int8.TILES_DISABLE_ENV, "0")
        assert not cpu_gemv_int8.tiles() and use_packed_weights(again) == 0 and again.packed is None
