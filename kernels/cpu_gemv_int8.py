"""Weight-only int8 skinny products on the CPU: a C++ kernel beside its reference.

``y [M, N] = x [M, K] @ (codes [N, K] * scales [N])^T + bias`` for a few rows ``M`` (an int8 model's
decode and draft steps): the layout of :class:`specdec.quantization.linear.QuantizedLinear` with
``method="int8"`` (symmetric codes, one scale per output channel). ``csrc/cpu_gemv_int8.cpp`` quantizes
each input row to int16 (one scale per row) and multiplies with AVX512_VNNI's ``vpdpwssd`` (exact integer
sums), streaming each weight row once for up to 16 input rows; without VNNI a float32 loop computes the
same products on the unquantized input. Figures (``python -m kernels.bench_cpu int8``) are in
``docs/kernels.md``.

Tile order: :func:`pack_tiles` gives a second copy of the codes in the pair-major tile order of the
bfloat16 tile kernel (:func:`pack_tiles_reference`); :func:`gemv_int8` with it runs
``csrc/cpu_gemv_int8tiles.h``, which reads one input pair's codes for 64 outputs at once and needs no
horizontal sums (SmolLM2's shapes, weights cold: 1.2-2.6x faster at 5-16 rows, level to 1.3x at one row;
an int8 SmolLM2 draft forward 9 % faster). Its sums are exact integers per 512 columns, added in float32,
so a row's outputs do not depend on the other rows; they differ from the row-major kernel's by float32
rounding. :func:`tiles` says whether it is used (``SPECDEC_CPU_INT8_TILES=0`` keeps the row-major kernel).

Accuracy: :func:`error_bound` states the kernel's bound against :func:`gemv_int8_reference` (the
input's int16 rounding, at most ``max|x| / 65534`` per element, about 2^-16 of the row's largest element:
finer than the bfloat16 input itself), plus float32 and output rounding.

The kernel is the dispatcher operator ``specdec_cpu::gemv_int8`` (schema and fake here, CPU kernel
registered by the extension when it loads), so a call costs a few microseconds of dispatch.
``SPECDEC_CPU_INT8=0`` (or ``SPECDEC_FORCE_REFERENCE=1``) keeps torch's own kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_gemv  # also defines the specdec_cpu namespace: DEF before FRAGMENT
from kernels.cpu_ext import enabled, load_extension, require_extension

__all__ = [
    "MAX_ROWS",
    "available",
    "error_bound",
    "gemv_int8",
    "gemv_int8_reference",
    "pack_tiles",
    "pack_tiles_reference",
    "tiles",
    "vnni",
]

DISABLE_ENV = "SPECDEC_CPU_INT8"
TILES_DISABLE_ENV = "SPECDEC_CPU_INT8_TILES"
#: Rows up to which :class:`~specdec.quantization.linear.QuantizedLinear` sends int8 products to the
#: kernel: passes of at most 16 rows, each streaming the weights once (a batch of 32 requests of the
#: quantized self-drafter: two passes; it took 241 ms a forward through F.linear on the weight dequantized
#: at every call, against 26 ms for 16 rows through the kernel). Wider inputs (prefill chunks) are GEMMs,
#: which dequantize once and multiply densely.
MAX_ROWS = 64

_LIB = torch.library.Library("specdec_cpu", "FRAGMENT")
_LIB.define("gemv_int8(Tensor x, Tensor codes, Tensor scales, Tensor? bias, Tensor? packed=None) -> Tensor")


@torch.library.register_fake("specdec_cpu::gemv_int8", lib=_LIB)
def _gemv_int8_fake(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0])


def available() -> bool:
    """Whether the kernel may run here: not disabled (``SPECDEC_CPU_INT8=0``, ``SPECDEC_FORCE_REFERENCE=1``)
    and the CPU kernels built (on the first call)."""
    return enabled(DISABLE_ENV)


def vnni() -> bool:
    """Whether the kernel multiplies with AVX512_VNNI here (False: its float32 loop, or not built)."""
    ext = load_extension()
    return bool(ext is not None and ext.has_int8_vnni())


def tiles() -> bool:
    """Whether int8 linears on the kernel take a tile-order copy of their codes (:func:`pack_tiles`): the
    kernel is available, built with AVX512_VNNI, and ``SPECDEC_CPU_INT8_TILES`` is not ``0``."""
    return available() and enabled(TILES_DISABLE_ENV) and bool(require_extension().has_int8_tiles())


def pack_tiles(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` ``[N, K]`` int8 in the tile kernel's pair-major order, ``[G, KB, 16, 4, 32]`` int8 (equal to
    :func:`pack_tiles_reference`), for :func:`gemv_int8`'s ``packed``.

    Raises:
        RuntimeError: not int8 ``[N, K]``, or the kernels were built without AVX512_VNNI (see :func:`tiles`).
    """
    return require_extension().pack_int8_tiles(codes.detach())


def pack_tiles_reference(codes: torch.Tensor) -> torch.Tensor:
    """The tile order in torch: :func:`kernels.cpu_gemv.pack_tiles_reference` with ``pair_major=True``
    (element ``[g, kb, r, j, 2 c + e]`` is ``codes[64 g + 16 j + c, 32 kb + 2 r + e]``, zeros past N, K)."""
    return cpu_gemv.pack_tiles_reference(codes, pair_major=True)


def gemv_int8_reference(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Dequantize, then ``F.linear``: ``x`` ``[M, K]``, ``codes`` ``[N, K]`` int8, ``scales`` ``[N]``,
    ``bias`` ``[N]`` or None -> ``[M, N]`` in ``x``'s dtype (computed in float32)."""
    w = codes.float() * scales.float()[:, None]
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


def error_bound(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[M, N]`` float32: the most the kernel's int16 input rounding can move each output, before the
    float32 and output roundings: ``max|x_m| / 65534 * |scales_n| * sum_k |codes_nk|``."""
    half_step = x.float().abs().amax(dim=1, keepdim=True) / 65534.0
    return half_step * (scales.float().abs() * codes.float().abs().sum(dim=1))[None, :]


def gemv_int8(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel (``torch.ops.specdec_cpu.gemv_int8``).

    Args:
        x: ``[M, K]`` float32 or bfloat16 on the CPU.
        codes: ``[N, K]`` int8, contiguous.
        scales: ``[N]``, any floating dtype (one per output row).
        bias: ``[N]`` or None.
        packed: :func:`pack_tiles` of ``codes`` (the tile kernel), or None (the row-major kernel).

    Returns:
        ``[M, N]`` in ``x``'s dtype.

    Raises:
        RuntimeError: shapes or dtypes it does not take, or the kernels are not built here.
    """
    require_extension()
    return torch.ops.specdec_cpu.gemv_int8(x, codes, scales, bias, packed)


def _bench(rows: tuple[int, ...] = (1, 5, 16)) -> None:
    """GB/s of codes streamed by the kernel (row-major codes, and tile-order ones where :func:`tiles`), by
    torch's ``_weight_int8pack_mm`` and, for the same shape in bfloat16, by the dense GEMV kernel
    (SmolLM2-135M's shapes; ``python -m kernels.bench_cpu int8``); weights cycled through ~256 MB of copies
    to defeat the caches."""
    import time

    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
              "lm_head": (49152, 576)}  # fmt: skip
    ops, int8mm = torch.ops.specdec_cpu, torch.ops.aten._weight_int8pack_mm
    print(f"threads {torch.get_num_threads()}, kernel built: {available()}, VNNI: {vnni()}")
    for name, (n, k) in shapes.items():
        copies = max(2, (256 << 20) // (n * k))
        codes = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(copies)]
        packs = [pack_tiles(c) for c in codes] if tiles() else None
        scales = torch.rand(n, dtype=torch.bfloat16) / 100
        dense = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            calls = {
                "ours": lambda i, x=x, c=codes, s=scales: ops.gemv_int8(x, c[i % len(c)], s, None),
                "tiles": lambda i, x=x, c=codes, s=scales, p=packs: ops.gemv_int8(
                    x,
                    c[i % len(c)],
                    s,
                    None,
                    p[i % len(p)],  # type: ignore[index]
                ),
                "torch": lambda i, x=x, c=codes, s=scales: int8mm(x, c[i % len(c)], s),
                "bf16": lambda i, x=x, d=dense: ops.gemv(x, d[i % len(d)], None),
            }
            if packs is None:
                del calls["tiles"]
            line = []
            for label, call in calls.items():
                for i in range(3):
                    call(i)
                reps = max(20, 2 * copies)
                t0 = time.perf_counter()
                for i in range(reps):
                    call(i)
                dt = (time.perf_counter() - t0) / reps
                nbytes = n * k * (2 if label == "bf16" else 1)
                line.append(f"{label} {dt * 1e6:7.0f} µs {nbytes / dt / 1e9:5.1f} GB/s")
            print(f"{name:8s} {m:2d} rows: " + " | ".join(line))
