"""Skinny matrix products on the CPU (decode and verification rows): a C++ kernel beside its reference.

``y [M, N] = x [M, K] @ w [N, K]^T + bias`` for a few rows ``M``. Decode reads every weight once per
step, so what a CPU step costs is how fast these products stream the weights. On this project's 2-core
AMD EPYC (AVX2, no AVX-512), two threads, SmolLM2-135M shapes, ``F.linear`` streams 9-12 GB/s in float32
at one row and 2-4 GB/s in bfloat16 at five rows (a k = 4 verification), against 26 GB/s for
``torch.sum``; the kernel of ``csrc/cpu_gemv.cpp`` streams 12-23 GB/s (float32, one row), 15-20 (float32,
five rows), 15-18 (bfloat16, one row) and 9-14 (bfloat16, five rows). ``python -m kernels.bench_cpu gemv``
prints these figures for this machine.

Dispatch (:func:`gemv`): the kernel for float32 / bfloat16 CPU tensors of at most :func:`max_rows` rows
(:data:`MAX_ROWS`; in bfloat16 on a CPU without oneDNN's bfloat16 path any number, since ``F.linear``
then ran 3.5-4.5x slower than the kernel at 16-64 rows here, a prefill chunk's 42 rows taking 0.6 s)
when it builds here; :func:`gemv_reference` (``F.linear``) otherwise, and everywhere with
``SPECDEC_FORCE_REFERENCE=1`` or ``SPECDEC_CPU_GEMV=0``. The kernel is built with the other CPU kernels
by :mod:`kernels.cpu_ext` (once per machine; a build that fails leaves the reference in place).

The kernel is a dispatcher operator, ``specdec_cpu::gemv`` (defined in C++, ``csrc/bindings.cpp``, with
its fake implementation registered here), so ``torch.compile`` keeps it as one opaque call and a call
costs a few microseconds of dispatch (a Python custom op cost ~25 µs, ~3 ms of a 22 ms SmolLM2 step at
121 calls).

bfloat16 weights with bfloat16 inputs on a CPU with AVX-512 BF16 (``avx512_bf16``: AMD Zen 4, Intel
Cooper Lake and later) take ``csrc/cpu_gemv_bf16dp.h`` instead: ``vdpbf16ps`` multiplies the bfloat16
pairs directly (no widening), which matters when several rows share each weight. On a 2-core AMD EPYC with
AVX512_BF16, SmolLM2 shapes: five rows 18-25 GB/s against 12-17 for the AVX2 path, sixteen rows 9-11
against 4.5-6, one row unchanged (25-30, bound by memory). :func:`bf16_dot` reports it and switches it
off and on (A/B measurements; the tests check both paths against the reference).

float32 weights with float32 inputs on a CPU with AVX-512 take ``csrc/cpu_gemv_f32x16.h``: 16-lane FMAs,
each weight row streamed once for up to 16 input rows (the AVX2 path takes 8 per pass).

Packed weights (:func:`pack_weight`, :func:`linear_packed`, :func:`packed_rows`): an eager engine keeps a
second copy of every bfloat16 weight, in the AMX kernel's tile order where the CPU has AMX-BF16
(``csrc/cpu_gemv_amx.h``: every product, 1-16 rows at the memory's speed, each row's sums independent of
the others), else in the pair-major tile order of the AVX-512 BF16 kernel where the CPU has AVX512_BF16
(``csrc/cpu_gemv_bf16tiles.h``: every product, no horizontal sums, each row's sums independent of the
others; on a 2-core AMD EPYC five rows cost 1.0-1.2x one row on the MLP and LM-head matrices, against
1.3-1.7x on the row-major kernel or oneDNN), else (or with ``SPECDEC_CPU_TILES=0``) in oneDNN's layout for
its GEMM (wider products only).

Accuracy: float32 accumulation in a different order than ``F.linear``: float32 outputs agree within
1e-5 relative; bfloat16 outputs within one bfloat16 rounding of the float32 result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_ext import enabled, require_extension

#: Rows up to which the kernel is used (the AVX2 path reads the weights once per 8 rows; wider inputs are
#: GEMMs).
MAX_ROWS = 16
DISABLE_ENV = "SPECDEC_CPU_GEMV"


#: Whether oneDNN lacks a bfloat16 path on this CPU (then ``F.linear`` in bfloat16 is a slow loop).
_NO_ONEDNN_BF16 = not torch.ops.mkldnn._is_mkldnn_bf16_supported()


#: Rows up to which bfloat16 products use the AVX-512 BF16 kernel: a 16-node tree and its root (17 rows) run
#: there in two passes of 9 and 8 rows, ~21 ms of SmolLM2's linears against ~36 ms in ``F.linear``.
BF16_DOT_ROWS = 32

_bf16_dot_in_use: bool | None = None  # bf16_dot(), cached: max_rows() runs on every call

#: ``SPECDEC_CPU_ONEDNN=0``: no packed copies of bfloat16 weights (every few-row product on the kernel,
#: prefill chunks through ``F.linear`` on the dense weight), and no second copy of the weights in memory.
ONEDNN_ENV = "SPECDEC_CPU_ONEDNN"


def packing_supported(weight: torch.Tensor) -> bool:
    """Whether a linear layer with ``weight`` ``[N, K]`` takes a packed copy (:func:`pack_weight`):
    bfloat16 on the CPU, oneDNN with a bfloat16 path, the kernels built (their rule, :func:`packed_rows`,
    picks the path per call) and not switched off (``SPECDEC_CPU_ONEDNN=0``)."""
    import os

    return (
        os.environ.get(ONEDNN_ENV, "1") != "0"
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not _NO_ONEDNN_BF16
        and torch.backends.mkldnn.is_available()
        and available()
    )


def amx() -> bool:
    """Whether packed bfloat16 weights use the AMX kernel (``csrc/cpu_gemv_amx.h``): the kernels built for
    a CPU with AMX-BF16, Linux granted this process the tiles, and not switched off
    (``SPECDEC_CPU_AMX=0``, or ``require_extension().set_amx(False)``)."""
    return available() and bool(require_extension().has_amx())


def tiles() -> bool:
    """Whether packed bfloat16 weights take the tile order (:func:`pack_tiles_reference`): multiplied by the
    AMX kernel where :func:`amx`, else by the AVX-512 BF16 kernel on that order
    (``csrc/cpu_gemv_bf16tiles.h``) where the kernels were built with AVX512_BF16; not switched off
    (``SPECDEC_CPU_TILES=0``, or ``require_extension().set_tiles(False)``: oneDNN's layout and GEMM where
    there is no AMX)."""
    return available() and bool(require_extension().has_tiles())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A second copy of ``weight`` ``[N, K]`` (bfloat16) for :func:`linear_packed`: in the tile order of
    the AMX and AVX-512 BF16 kernels (:func:`pack_tiles_reference`) where :func:`tiles`, else in oneDNN's
    blocked layout (``mkldnn::_reorder_linear_weight``, what inductor's weight freezing does)."""
    if tiles():
        return require_extension().pack_tiles(weight.detach())
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def pack_tiles_reference(weight: torch.Tensor, pair_major: bool = False) -> torch.Tensor:
    """The packed kernels' tile order in torch (the reference their C++ packing is tested against):
    ``weight`` ``[N, K]`` zero-padded to ``[64 G, 32 KB]``, as ``[G, KB, 4, 16, 32]`` where element ``[g,
    kb, j, r, 2 c + e]`` is ``weight[64 g + 16 j + c, 32 kb + 2 r + e]``: each ``[16, 32]`` tile holds 16
    pairs of inputs (rows) for 16 outputs (interleaved pairs), the B operand of TDPBF16PS (Intel AMX).
    ``pair_major`` (the AVX-512 BF16 kernel's order, where there is no AMX): ``[G, KB, 16, 4, 32]``, element
    ``[g, kb, r, j, 2 c + e]``, one input pair's weights for the group's 64 outputs together, each 64-byte
    row the weight operand of one VDPBF16PS for 16 outputs."""
    n, k = weight.shape
    g, kb = -(-n // 64), -(-k // 32)
    w = F.pad(weight, (0, kb * 32 - k, 0, g * 64 - n))
    # [g, j, c, kb, r, e] -> [g, kb, j, r, c, e] (pair-major: [g, kb, r, j, c, e])
    order = (0, 3, 4, 1, 2, 5) if pair_major else (0, 3, 1, 4, 2, 5)
    shape = (g, kb, 16, 4, 32) if pair_major else (g, kb, 4, 16, 32)
    return w.view(g, 4, 16, kb, 16, 2).permute(*order).reshape(shape).contiguous()


def onednn_rows(rows: int, out_features: int, in_features: int) -> bool:
    """Whether a bfloat16 product of ``rows`` rows with an ``[out_features, in_features]`` weight runs
    faster through oneDNN's packed GEMM than through the kernel: 12 rows and more, or 5 and more for wide
    matrices (``out_features >= 2048`` or ``in_features >= 1024``); measured on a 2-core AMD EPYC with
    AVX512_BF16, SmolLM2 shapes, at 16 rows 88-119 G multiply-adds/s against the kernel's 52-71.

    Raises:
        RuntimeError: the kernels are not built here.
    """
    return bool(require_extension().onednn_rows(rows, out_features, in_features))


def packed_rows(rows: int, out_features: int, in_features: int) -> bool:
    """Whether a bfloat16 product of ``rows`` rows takes a layer's packed weight (:func:`linear_packed`)
    rather than the kernel: with the tile order (:func:`tiles`) every product, one row included (AMX: the
    tiles stream the weights as fast at 2-16 rows as the kernel at one: on a 2-core Intel Xeon with AMX,
    3072 x 576 at 130-146 µs for 1-16 rows, where the kernel took 140 at one row and 221 at five; AVX-512
    BF16 without AMX: on a 2-core AMD EPYC 81-88 µs at five rows against 121-129, level at one row; and a
    row's sums do not depend on the other rows, so verification rows get the bits decode rows get: greedy
    speculative decoding equals greedy plain decoding bit for bit in bfloat16), else :func:`onednn_rows`.
    The C++ rule (``csrc/cpu_gemv.cpp``), shared with
    :mod:`kernels.cpu_decode_stack`.

    Raises:
        RuntimeError: the kernels are not built here.
    """
    return bool(require_extension().packed_rows(rows, out_features, in_features))


def linear_packed(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` ``[M, K]`` @ ``weight^T`` (+ ``bias``) -> ``[M, N]`` on ``packed = pack_weight(weight)``
    (``torch.ops.specdec_cpu.linear_packed``): the AMX kernel for a tile-packed weight, oneDNN's GEMM for a
    oneDNN-packed one; ``weight`` only gives the shape. bfloat16; equals :func:`gemv_reference` within one
    bfloat16 rounding.

    Raises:
        RuntimeError: shapes that do not match, or the kernels are not built here.
    """
    require_extension()
    return torch.ops.specdec_cpu.linear_packed(x, weight, packed, bias)


def linear_packed_logits(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`linear_packed` ``(x, weight, packed, bias).float()`` bit for bit, ``[M, N]`` float32: an LM
    head's logits (``torch.ops.specdec_cpu.linear_packed_logits``). ``x`` ``[M, K]`` bfloat16 ->
    ``[M, N]`` float32. On AMX the kernel widens its bfloat16 results as it stores them, so there is no
    bfloat16 logits tensor and no conversion pass over it (that pass took 0.37 ms a step at 24 rows of
    SmolLM2's 49,152-token head and 0.97 ms at 53, timed in the engine); the AVX-512 BF16 tile kernel and
    oneDNN's GEMM convert after.

    Raises:
        RuntimeError: shapes that do not match, ``x`` not bfloat16 on a tile-packed weight, tiles not
            granted, or the kernels are not built here.
    """
    require_extension()
    return torch.ops.specdec_cpu.linear_packed_logits(x, weight, packed, bias)


def max_rows(dtype: torch.dtype) -> int:
    """Rows up to which :func:`gemv` uses the kernel: :data:`MAX_ROWS`; for bfloat16
    :data:`BF16_DOT_ROWS` with the AVX-512 BF16 kernel, unbounded where oneDNN has no bfloat16 path on
    this CPU."""
    if dtype != torch.bfloat16:
        return MAX_ROWS
    if _NO_ONEDNN_BF16:
        return 2**31
    global _bf16_dot_in_use
    if _bf16_dot_in_use is None:
        _bf16_dot_in_use = available() and bf16_dot()
    return BF16_DOT_ROWS if _bf16_dot_in_use else MAX_ROWS


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x`` ``[M, K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` ->
    ``[M, N]``."""
    return F.linear(x, weight, bias)


def available() -> bool:
    """Whether :func:`gemv` can use the kernel here: not disabled (``SPECDEC_CPU_GEMV=0``,
    ``SPECDEC_FORCE_REFERENCE=1``) and built (on the first call)."""
    return enabled(DISABLE_ENV)


def bf16_dot(enabled: bool | None = None) -> bool:
    """Whether bfloat16 x bfloat16 products use the AVX-512 BF16 kernel (built for this CPU and not
    switched off); ``enabled`` switches it first (False: the AVX2 path). False where the extension is not
    built."""
    from kernels.cpu_ext import load_extension

    global _bf16_dot_in_use
    ext = load_extension()
    if ext is None:
        return False
    if enabled is None:
        return bool(ext.has_bf16_dot())
    _bf16_dot_in_use = None  # max_rows() asks again
    return bool(ext.set_bf16_dot(enabled))


def cpu_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel (``torch.ops.specdec_cpu.gemv``): ``x`` ``[M, K]`` float32/bfloat16, ``weight`` ``[N, K]``
    contiguous float32/bfloat16, ``bias`` ``[N]`` or None -> ``[M, N]`` in ``x``'s dtype.

    Raises:
        RuntimeError: shapes or dtypes it does not take, or the kernel is not built.
    """
    require_extension()
    return torch.ops.specdec_cpu.gemv(x, weight, bias)


#: The operator's schema, defined here so that traces see it before the extension is built; the extension
#: registers its CPU kernel when it loads.
_LIB = torch.library.Library("specdec_cpu", "DEF")
_LIB.define("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.define("linear_packed(Tensor x, Tensor weight, Tensor packed, Tensor? bias) -> Tensor")
_LIB.define("linear_packed_logits(Tensor x, Tensor weight, Tensor packed, Tensor? bias) -> Tensor")


@torch.library.register_fake("specdec_cpu::gemv", lib=_LIB)
def _cpu_gemv_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("specdec_cpu::linear_packed", lib=_LIB)
def _linear_packed_fake(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("specdec_cpu::linear_packed_logits", lib=_LIB)
def _linear_packed_logits_fake(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, use_kernel: bool | None = None
) -> torch.Tensor:
    """``x`` ``[..., K]`` @ ``weight^T`` (+ ``bias``) -> ``[..., N]``: the kernel where it applies (see the
    module docstring), :func:`gemv_reference` otherwise. ``use_kernel``: :func:`available`, decided once
    by the caller (a module traced by ``torch.compile`` must not build or probe inside the trace)."""
    if use_kernel is None:
        use_kernel = available()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if (
        use_kernel
        and x2.shape[0] <= max_rows(x.dtype)
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
    ):
        return torch.ops.specdec_cpu.gemv(x2, weight, bias).reshape(*lead, weight.shape[0])
    return gemv_reference(x, weight, bias)


def _bench(rows: tuple[int, ...] = (1, 5, 16)) -> None:
    """GB/s of weights streamed by ``F.linear``, by the kernel and (bfloat16) by :func:`linear_packed` on
    :func:`pack_weight`'s copy (the tile kernels, or oneDNN), SmolLM2-135M's shapes (``python -m
    kernels.bench_cpu gemv``); weights cycled through 256 MB of copies to defeat the caches."""
    import time

    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
              "lm_head": (49152, 576)}  # fmt: skip
    print(f"threads {torch.get_num_threads()}, kernel built: {available()}")
    packs = available() and packing_supported(torch.empty(8, 8, dtype=torch.bfloat16))
    if packs:
        print(f"packed bfloat16 weights: {'tile order' if tiles() else 'oneDNN'}")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for m in rows:
                for name, (n, k) in shapes.items():
                    ws = [torch.randn(n, k).to(dtype) for _ in range(max(1, int(256e6 // (n * k * 4))))]
                    x = torch.randn(m, k).to(dtype)
                    calls = [lambda w, x=x: gemv_reference(x, w), lambda w, x=x: gemv(x, w)]
                    if packs and dtype == torch.bfloat16:
                        packed = {id(w): pack_weight(w) for w in ws}
                        calls.append(lambda w, x=x, p=packed: linear_packed(x, w, p[id(w)]))
                    speeds = []
                    for f in calls:
                        for w in ws[:2]:
                            f(w)
                        t = time.perf_counter()
                        for w in ws:
                            f(w)
                        seconds = time.perf_counter() - t
                        speeds.append(n * k * ws[0].element_size() * len(ws) / seconds / 1e9)
                    line = (f"{str(dtype)[6:]:9s} rows {m:2d} {name:8s} F.linear {speeds[0]:5.1f} GB/s  "
                            f"kernel {speeds[1]:5.1f} GB/s")  # fmt: skip
                    if len(speeds) > 2:
                        line += f"  packed {speeds[2]:5.1f} GB/s"
                    print(line)
