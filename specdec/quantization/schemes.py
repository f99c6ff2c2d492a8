"""Weight-only quantization schemes: symmetric round-to-nearest int8 and int4 with per-group scales.

A weight ``W`` ``[N, K]`` (N output channels, K input features) is split along K into groups of
``group_size`` columns; each (row, group) gets one scale ``s = max |W[n, group]| / q_max`` and the codes
``q = clamp(round(W / s), q_min, q_max)``. Dequantization is ``q * s``. Round to nearest makes the error
of every element at most half a step: ``|W - q * s| <= s / 2`` (the clamp never bites because
``|W| / s <= q_max``).

- ``int8``: one scale per output channel (a group is the whole row, ``group_size = K``), codes in
  ``[-127, 127]`` (symmetric: -128 is never used, as in LLM.int8's absmax quantization, Dettmers et al.
  2022).
- ``int4``: group-wise scales along K (``group_size`` 32, 64 or 128; GPTQ/AWQ-style groups, Frantar et
  al. 2023, Lin et al. 2024), codes in ``[-8, 7]``; with ``s = absmax / 7`` only ``[-7, 7]`` occur.
- ``int4`` with ``zero_point=True`` (asymmetric, llama.cpp's Q4_1, AWQ's zero points): per group
  ``s = (max - min) / 15`` and an offset ``z = min + 8 s``; codes ``clamp(round((W - z) / s), -8, 7)``,
  dequantized ``q * s + z``; the same ``s / 2`` bound, over 16 levels spanning exactly the group's range.
  This matters for the zoo's checkpoints: they are converted from GGUF files whose layers were quantized
  in blocks of 32 (SmolLM2: Q4_1, so its weights already lie on a 16-level asymmetric grid per 32
  columns); an asymmetric group-32 requantization lands on that grid again, a symmetric one adds its full
  rounding error on top (``tests/test_quantized_quality.py`` has the perplexities).

Why per-channel and group scales (outliers). With one scale for the whole tensor, ``s = max |W| / q_max``
is set by the single largest weight: an outlier 20x larger than the typical weight makes the step 20x
coarser for every other element, and at int4 most weights then round to 0. A scale per row (or per
group of 32-128 columns) confines an outlier's damage to its own row (group): the other rows keep a
step sized to their own range. ``tests/test_quantization.py`` measures this on SmolLM2's real weights
(:func:`quantize_per_tensor` is the per-tensor baseline used there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Weight-only schemes: name -> (q_min, q_max) of the codes.
SCHEMES: dict[str, tuple[int, int]] = {"int8": (-127, 127), "int4": (-8, 7)}
#: Group sizes (input columns per int4 scale) accepted, and the default.
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64


@dataclass
class QuantizedWeight:
    """Codes and scales of one weight matrix ``[N, K]``.

    Attributes:
        codes: ``[N, K]`` int8, the integer codes (int4 codes also held one per int8 here; see
            :func:`pack_int4` for the 2-per-byte storage).
        scales: ``[N, K // group_size]`` float32 (int8: ``[N, 1]``).
        scheme: ``"int8"`` or ``"int4"``.
        group_size: input columns per scale (int8: K).
        zeros: ``[N, K // group_size]`` float32 offsets (int4 with ``zero_point``), or None (symmetric).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    scheme: str
    group_size: int
    zeros: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(
            f"a weight to quantize must be 2-D [out_features, in_features], got {weight.dim()}-D"
        )
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("the weight has NaN or infinite values; cannot quantize it")


def quantize(
    weight: torch.Tensor, scheme: str, group_size: int | None = None, zero_point: bool = False
) -> QuantizedWeight:
    """Quantize ``weight`` ``[N, K]``, rounding to nearest: symmetric, or with a zero point per group.

    Args:
        weight: any float dtype; computed in float32.
        scheme: ``"int8"`` (one scale per output channel) or ``"int4"`` (one scale per group).
        group_size: int4 only: columns per group, one of :data:`GROUP_SIZES` dividing K (None: 64).
        zero_point: int4 only: asymmetric groups (see the module docstring).

    Raises:
        ValueError: unknown scheme, group size not in :data:`GROUP_SIZES` or not dividing K, a group size
            or zero point given for int8, a weight that is not 2-D or not finite.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"quantization scheme must be one of {list(SCHEMES)}, got {scheme!r}")
    _check_weight(weight)
    n, k = weight.shape
    if scheme == "int8":
        if group_size is not None or zero_point:
            raise ValueError(
                "int8 is symmetric with one scale per output channel (group_size, zero_point: int4)"
            )
        group_size = k
    else:
        group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        if k % group_size:
            raise ValueError(f"int4 group_size {group_size} does not divide in_features {k}")
    q_min, q_max = SCHEMES[scheme]
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    zeros = None
    if zero_point:
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = (high - low) / (q_max - q_min)  # [N, groups]: 16 levels from min to max
        zeros = low - q_min * scales
        w = w - zeros[..., None]
    else:
        scales = w.abs().amax(dim=-1) / q_max  # [N, groups]
    # A constant group has scale 0: its codes are 0 (divide by the smallest normal float instead of 0).
    codes = torch.round(w / scales.clamp_min(torch.finfo(torch.float32).tiny)[..., None])
    codes = codes.clamp_(q_min, q_max).to(torch.int8).reshape(n, k)
    return QuantizedWeight(codes, scales, scheme, group_size, zeros)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """``codes * scales (+ zeros)`` ``[N, K]`` float32."""
    n, k = qw.shape
    groups = qw.codes.reshape(n, k // qw.group_size, qw.group_size).float() * qw.scales.float()[..., None]
    if qw.zeros is not None:
        groups = groups + qw.zeros.float()[..., None]
    return groups.reshape(n, k)


def error_bound(qw: QuantizedWeight) -> torch.Tensor:
    """The round-to-nearest bound ``scale / 2`` of every element, ``[N, K]`` float32."""
    n, k = qw.shape
    return (qw.scales.float() / 2).repeat_interleave(qw.group_size, dim=1).reshape(n, k)


def quantize_per_tensor(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, float]:
    """The per-tensor baseline: one scale ``max |W| / q_max`` for the whole matrix.

    Returns:
        ``(dequantized [N, K] float32, scale)``.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"quantization scheme must be one of {list(SCHEMES)}, got {scheme!r}")
    _check_weight(weight)
    q_min, q_max = SCHEMES[scheme]
    w = weight.detach().float()
    scale = float(w.abs().max()) / q_max
    if scale == 0.0:
        return torch.zeros_like(w), 0.0
    return torch.round(w / scale).clamp_(q_min, q_max) * scale, scale


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two int4 codes per byte: ``[N, K]`` int8 in ``[-8, 7]`` -> ``[N, K / 2]`` uint8, the code of even
    column ``2j`` (offset by 8) in the low nibble, odd column ``2j + 1`` in the high nibble.

    Raises:
        ValueError: K is odd.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {codes.shape[-1]}")
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[N, K / 2]`` uint8 -> ``[N, K]`` int8 codes in ``[-8, 7]``."""
    low = (packed & 15).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
