"""``QuantizedLinear``: a weight-only quantized ``nn.Linear`` (int8 per output channel, int4 per group).

Two ways to compute ``x @ dequantize(W).T + b``:

- **reference**: dequantize the whole weight into the activation dtype, then a dense matmul
  (``F.linear``). Works on any device, for any shape; it is the ground truth of the tests.
- **packed**: torch's weight-only CPU kernels, which read the int8/int4 codes directly:
  ``torch.ops.aten._weight_int8pack_mm`` (int8 codes ``[N, K]``, scales ``[N]``) and
  ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (codes packed by
  ``_convert_weight_to_int4pack_for_cpu``, which needs N divisible by 16; scales and zeros
  ``[K / G, N, 2]``: zeros 0 for symmetric groups, the groups' offsets with ``zero_point``).

int8 products of at most 64 rows on a CPU (``kernel="auto"``) take this project's kernel first,
:mod:`kernels.cpu_gemv_int8` (int16-quantized input rows against the int8 codes with AVX512_VNNI; at one
row 18-24 GB/s of codes against torch's 9-12, i.e. about half the time of the bfloat16 GEMV; figures in
``docs/kernels.md``), where it builds; the rest of this docstring is about torch's kernels, which serve
where it does not (and ``kernel="packed"``).

Which path runs, and why (``kernel="auto"``, without the project's int8 kernel). Measured with one thread
on this project's 2-core CPU (shared with other jobs while measured, so indicative only; the ratios were
stable across reruns),
milliseconds per call, weights cycled through enough copies to defeat the caches (``python -m
experiments.bench_quant kernels=true`` reruns it):

==========================  =====  =========  ========  =========  ========
shape, dtype, rows          dense  int8 pack  int8 ref  int4 pack  int4 ref
==========================  =====  =========  ========  =========  ========
LM head [49152, 576], bf16
  1 row                     6.1    3.7        144       1.5        164
  16 rows                   9.9    21         131       11         173
  128 rows                  45     178        154       85         198
LM head, float32
  1 row                     9.6    23         112       48         142
  8 rows                    19     189        122       386        145
gate/up [3072, 576], bf16
  1 row                     0.45   0.28       1.9       0.11       3.3
  32 rows                   0.93   1.8        3.3       1.4        4.6
gate/up, float32, 1 row     0.75   2.0        1.5       4.0        4.0
==========================  =====  =========  ========  =========  ========

(A rerun through :class:`QuantizedLinear` itself gave the same picture: bfloat16 LM head at 32 rows 29 /
68 / 192 / 22 / 230 ms.)

The packed kernels are matrix-vector products: their cost grows with every row, while the reference pays
one dequantization and then a blocked GEMM. Hence:

- int8 (one storage for both paths): the packed kernel for calls of at most
  :data:`INT8_PACKED_MAX_ROWS` rows (16 in bfloat16/float16: decode and verification batches; 1 in
  float32, where the kernel is not vectorised), the reference above that (prefill chunks).
- int4 in bfloat16/float16 on a CPU, N divisible by 16: the packed layout and kernel at every size (4x
  faster than dense bfloat16 at one row, never far behind the reference up to 128 rows).
- int4 otherwise (float32, whose packed kernel is 5-30x slower than the reference beyond one row; other
  devices; N not divisible by 16): two codes per byte (:func:`~specdec.quantization.schemes.pack_int4`)
  and the reference path.

So quantization pays for speed only in bfloat16 here (int8 1.6x, int4 4x faster than the dense bfloat16
LM head at one row); in float32 a quantized layer saves memory but is slower than a float32 one. On CUDA
every call takes the reference path (correct, not fast). ``kernel="packed"`` / ``"reference"`` force one
path (the packed one wherever the kernels support the shape).

Scales are kept in the activation dtype (the packed kernels take them so), which in bfloat16 adds a
relative error of at most 2^-9 per weight, the same as storing the weight itself in bfloat16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_gemv_int8
from specdec.quantization.schemes import QuantizedWeight, pack_int4, quantize, unpack_int4

#: int8, ``kernel="auto"``: the packed kernel runs for calls of at most this many rows (measured above).
INT8_PACKED_MAX_ROWS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 1}
#: int4, ``kernel="auto"``: activation dtypes that get the packed layout on a CPU.
INT4_PACKED_DTYPES = (torch.bfloat16, torch.float16)
#: ``_convert_weight_to_int4pack_for_cpu`` needs the output size divisible by this.
INT4_PACKED_N_MULTIPLE = 16


def int4_packed_supported(out_features: int, in_features: int, device: torch.device) -> bool:
    """Whether torch's CPU int4 kernel takes a weight of this shape on ``device``."""
    return (
        device.type == "cpu"
        and out_features % INT4_PACKED_N_MULTIPLE == 0
        and in_features % 2 == 0
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


def int8_packed_supported(device: torch.device) -> bool:
    """Whether torch's int8 weight-only kernel runs on ``device``."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def uses_int4_packed_layout(
    out_features: int, in_features: int, dtype: torch.dtype, device: torch.device, kernel: str
) -> bool:
    """Whether an int4 layer stores torch's packed layout (else two codes per byte, reference path)."""
    if kernel == "reference" or not int4_packed_supported(out_features, in_features, device):
        return False
    return kernel == "packed" or dtype in INT4_PACKED_DTYPES


def quantized_nbytes(
    scheme: str,
    out_features: int,
    in_features: int,
    group_size: int | None,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kernel: str = "auto",
    zero_point: bool = False,
) -> int:
    """Bytes a :class:`QuantizedLinear` of this shape stores for its weight (codes, scales, zeros; no bias).

    int8: ``N K`` code bytes + ``N`` scales. int4: ``N K / 2`` code bytes + ``N K / G`` scales (+ as many
    zeros with ``zero_point``), or ``2 N K / G`` (scale and zero) in torch's packed layout. Scales and
    zeros are in ``dtype``.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    n, k = out_features, in_features
    if scheme == "int8":
        return n * k + n * elem
    assert group_size is not None
    groups = n * (k // group_size)
    packed = uses_int4_packed_layout(n, k, dtype, torch.device(device), kernel)
    return n * k // 2 + groups * elem * (2 if packed or zero_point else 1)


class QuantizedLinear(nn.Module):
    """``y = x @ dequantize(W).T + b`` with W held as int8 or int4 codes and scales.

    It has no ``weight`` attribute (code that needs the dense matrix calls :meth:`dequantized_weight`);
    :attr:`dtype` is the activation dtype.

    Args:
        qw: the quantized weight (from :func:`~specdec.quantization.schemes.quantize`).
        bias: ``[N]`` or None; kept in ``dtype``.
        dtype: activation dtype (scales are stored in it).
        device: where the layer runs.
        kernel: ``"auto"``, ``"packed"`` or ``"reference"`` (see the module docstring).

    Buffers:
        ``qweight``: int8 ``[N, K]`` (int8); uint8 ``[N, K / 2]`` (int4, either layout).
        ``scales``: ``[N]`` (int8); ``[N, K / G]`` (int4, two codes per byte); ``[K / G, N, 2]`` scale and
        zero (int4, torch's packed layout).
        ``zeros``: ``[N, K / G]`` (int4 with a zero point, two codes per byte); None otherwise.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    def __init__(
        self,
        qw: QuantizedWeight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.out_features, self.in_features = qw.shape
        self.scheme, self.group_size, self.kernel = qw.scheme, qw.group_size, kernel
        n, k = qw.shape
        self.int8_packed = qw.scheme == "int8" and kernel != "reference" and int8_packed_supported(device)
        #: int8 products of at most :data:`kernels.cpu_gemv_int8.MAX_ROWS` rows through this project's
        #: kernel (``kernel="auto"``, a CPU, the kernel built here); torch's packed kernel otherwise.
        self.int8_kernel = (
            qw.scheme == "int8" and kernel == "auto" and device.type == "cpu" and cpu_gemv_int8.available()
        )
        self.int4_packed = qw.scheme == "int4" and uses_int4_packed_layout(n, k, dtype, device, kernel)
        #: The int8 codes in the tile kernel's order (:func:`kernels.cpu_gemv_int8.pack_tiles`), given by
        #: :func:`specdec.models.cpu_linear.use_packed_weights` to an eager engine's layers; None: none.
        #: Read through :meth:`tile_codes`, which drops it once ``qweight`` is replaced.
        self.packed: torch.Tensor | None = None
        self._packed_from: torch.Tensor | None = None  # the qweight it was packed from
        if qw.scheme == "int8":
            qweight, scales = qw.codes, qw.scales.reshape(n)
        elif self.int4_packed:
            qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.codes.to(torch.int32) + 8, 2)
            # The kernel dequantizes (stored - 8) * scale + zero, stored = code + 8.
            zeros = qw.zeros if qw.zeros is not None else torch.zeros_like(qw.scales)
            scales = torch.stack([qw.scales.T, zeros.T], dim=-1)
        else:
            qweight, scales = pack_int4(qw.codes), qw.scales
        self.register_buffer("qweight", qweight.to(device))
        self.register_buffer("scales", scales.to(device=device, dtype=dtype).contiguous())
        zeros_buf = None
        if qw.zeros is not None and not self.int4_packed:  # the packed layout holds them with the scales
            zeros_buf = qw.zeros.to(device=device, dtype=dtype).contiguous()
        self.register_buffer("zeros", zeros_buf)
        self.zero_point = qw.zeros is not None
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device=device, dtype=dtype))

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        scheme: str,
        group_size: int | None,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kernel: str = "auto",
        zero_point: bool = False,
    ) -> QuantizedLinear:
        """Quantize ``weight`` ``[N, K]`` (any float dtype; quantized from float32) into a layer.

        Raises:
            ValueError: see :func:`~specdec.quantization.schemes.quantize`.
        """
        return cls(quantize(weight, scheme, group_size, zero_point), bias, dtype, device, kernel)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the codes, scales and zeros (the bias excluded)."""
        zeros = 0 if self.zeros is None else self.zeros.nbytes
        return self.qweight.nbytes + self.scales.nbytes + zeros

    def codes(self) -> torch.Tensor:
        """The integer codes ``[N, K]`` int8."""
        if self.scheme == "int8":
            return self.qweight
        if not self.int4_packed:
            return unpack_int4(self.qweight)
        # torch's packed layout depends on the CPU's vector width; read it back through the kernel itself:
        # one-hot rows with scale 1 and zero 8 give every code + 8 exactly (integers 0..15 in bfloat16).
        k, n = self.in_features, self.out_features
        device = self.qweight.device
        scale_zero = torch.ones(k // self.group_size, n, 2, dtype=torch.bfloat16, device=device)
        scale_zero[..., 1] = 8.0
        codes = torch.empty(n, k, dtype=torch.int8, device=device)
        eye = torch.eye(k, dtype=torch.bfloat16, device=device)
        for start in range(0, k, 256):  # [rows, N] at a time: the identity's rows pick columns of W
            rows = eye[start : start + 256]
            raw = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, self.group_size, scale_zero)
            codes[:, start : start + rows.shape[0]] = (raw.T.float() - 8).to(torch.int8)
        return codes

    def group_scales(self) -> torch.Tensor:
        """Scales ``[N, K / G]`` (int8: ``[N, 1]``) in the activation dtype."""
        if self.scheme == "int8":
            return self.scales[:, None]
        if self.int4_packed:
            return self.scales[..., 0].T
        return self.scales

    def group_zeros(self) -> torch.Tensor | None:
        """Zero points ``[N, K / G]`` in the activation dtype, or None (symmetric)."""
        if not self.zero_point:
            return None
        return self.scales[..., 1].T if self.int4_packed else self.zeros

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``codes * scales (+ zeros)`` ``[N, K]``, computed in float32, returned in ``dtype``."""
        n, k = self.out_features, self.in_features
        if self.scheme == "int8" and dtype == self.scales.dtype:
            # The same bits in half the passes (a prefill chunk's reference path dequantizes every call): a
            # code (8 bits) times a scale (at most 24) is exact in float32, so either way it rounds once.
            return self.qweight.to(dtype) * self.scales[:, None]
        g = k if self.scheme == "int8" else self.group_size
        w = self.codes().reshape(n, k // g, g).float() * self.group_scales().float()[..., None]
        zeros = self.group_zeros()
        if zeros is not None:
            w = w + zeros.float()[..., None]
        return w.reshape(n, k).to(dtype)

    def set_tile_codes(self, packed: torch.Tensor) -> None:
        """Keep ``packed`` (:func:`kernels.cpu_gemv_int8.pack_tiles` of the current ``qweight``)."""
        self.packed, self._packed_from = packed, self.qweight

    def tile_codes(self) -> torch.Tensor | None:
        """The tile-order copy of the codes, or None (none given, or ``qweight`` replaced since)."""
        if self.packed is None or self._packed_from is not self.qweight:
            return None
        return self.packed

    def _use_packed(self, rows: int, dtype: torch.dtype) -> bool:
        if self.scheme == "int4":
            return self.int4_packed
        if not self.int8_packed:
            return False
        return self.kernel == "packed" or rows <= INT8_PACKED_MAX_ROWS.get(dtype, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` in the activation dtype -> ``[..., N]``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if (
            self.int8_kernel
            and rows <= cpu_gemv_int8.MAX_ROWS
            and x2.dtype in (torch.float32, torch.bfloat16)
            and x2.device.type == "cpu"
        ):
            packed = None if torch.compiler.is_compiling() else self.tile_codes()
            out = torch.ops.specdec_cpu.gemv_int8(x2, self.qweight, self.scales, self.bias, packed)
        elif self._use_packed(rows, x2.dtype):
            if self.scheme == "int8":
                out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scales)
            else:
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x2.contiguous(), self.qweight, self.group_size, self.scales
                )
            if self.bias is not None:
                out = out + self.bias
        else:
            out = F.linear(x2, self.dequantized_weight(x2.dtype), self.bias)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        g = "per channel" if self.scheme == "int8" else f"group_size={self.group_size}"
        g += ", zero_point" if self.zero_point else ""
        path = "packed" if (self.int8_packed or self.int4_packed) else "reference"
        path += ", cpu_gemv_int8" if self.int8_kernel else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme} {g}, "
            f"bias={self.bias is not None}, layout={path}, kernel={self.kernel}"
        )


def bits_per_weight(layer: QuantizedLinear) -> float:
    """Stored bits per weight element, scales included."""
    return 8 * layer.nbytes / (layer.out_features * layer.in_features)
