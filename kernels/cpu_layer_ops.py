"""A decoder layer's small operations on the CPU — RMSNorm, rotary embedding, SiLU(gate) · up — each a
C++ kernel beside its torch reference.

At batch 1 a CPU decode step of SmolLM2-135M spends about as long in the ~1,300 small torch calls between
its linears (a few microseconds of dispatch and allocation each) as in the linears themselves. The three
kernels of ``csrc/cpu_layer_ops.cpp`` replace 8, ~8 and 3 of those calls per use with one dispatcher call
each (``specdec_cpu::rms_norm``, ``specdec_cpu::rope``, ``specdec_cpu::silu_mul``; their schemas and
fakes are defined here, so ``torch.compile`` could keep them as opaque calls).

The references are the definitions the model uses (:class:`specdec.models.decoder.RMSNorm` and
``GemmaRMSNorm``, ``DecoderLayer.block``'s RoPE and MLP) and the kernels reproduce their roundings:
float32 arithmetic, results rounded to the input dtype where the reference rounds them, no fused
multiply-adds. Outputs equal the reference's except where a sum of squares or ``exp`` rounds its last
float32 bit differently (float32: within 1e-6 relative; bfloat16: at most one bfloat16 step, rarely).

Used by the model's layers on the CPU (float32 / bfloat16, no autograd, not inside a ``torch.compile``
trace) when the extension builds (:mod:`kernels.cpu_ext`); ``SPECDEC_CPU_LAYER_OPS=0`` or
``SPECDEC_FORCE_REFERENCE=1`` keeps the references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_gemv  # noqa: F401  (defines the specdec_cpu namespace: DEF before FRAGMENT)
from kernels.cpu_ext import enabled

__all__ = [
    "available",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_reference",
    "silu_mul",
    "silu_mul_reference",
]

DISABLE_ENV = "SPECDEC_CPU_LAYER_OPS"

_LIB = torch.library.Library("specdec_cpu", "FRAGMENT")
_LIB.define("rms_norm(Tensor x, Tensor weight, float eps, bool gemma) -> Tensor")
_LIB.define("rope(Tensor qk, Tensor cos, Tensor sin) -> Tensor")
_LIB.define("silu_mul(Tensor gate_up) -> Tensor")


@torch.library.register_fake("specdec_cpu::rms_norm", lib=_LIB)
def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.register_fake("specdec_cpu::rope", lib=_LIB)
def _rope_fake(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return qk.new_empty(qk.shape)


@torch.library.register_fake("specdec_cpu::silu_mul", lib=_LIB)
def _silu_mul_fake(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


def available() -> bool:
    """Whether the kernels can be used here: not disabled and built (on the first call)."""
    return enabled(DISABLE_ENV)


# ------------------------------------------------------------------------------------------ references
def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False
) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) in float32 as transformers computes it: ``x`` ``[..., H]``,
    ``weight`` ``[H]`` -> ``[..., H]`` in ``x``'s dtype. Llama: ``w * norm(x)``, normalised in float32
    and rounded to ``x``'s dtype before the product; Gemma (``gemma=True``): ``(1 + w) * norm(x)`` all in
    float32, rounded once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def rope_reference(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021, the rotate-half layout): ``qk`` ``[T, heads, D]``, ``cos`` /
    ``sin`` ``[T, 1, D]`` -> ``qk * cos + rotate_half(qk) * sin`` ``[T, heads, D]``."""
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    return qk * cos + rotated * sin


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's product (Shazeer 2020): ``gate_up`` ``[T, 2I]`` -> ``silu(gate) * up`` ``[T, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ------------------------------------------------------------------------------------------- kernels
def _fits(t: torch.Tensor) -> bool:
    cpu_float = t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16)
    return cpu_float and not torch.is_grad_enabled()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False, use_kernel: bool | None = None
) -> torch.Tensor:
    """:func:`rms_norm_reference` through the kernel where it applies (``x`` ``[..., H]`` with contiguous
    rows, ``weight`` of ``x``'s dtype, no autograd). ``use_kernel``: :func:`available`, decided once by
    the caller (a module traced by ``torch.compile`` must not build or probe inside the trace)."""
    if use_kernel is None:
        use_kernel = available()
    if use_kernel and _fits(x) and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.is_contiguous():
        lead = x.shape[:-1]
        return torch.ops.specdec_cpu.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, gemma).reshape(
            *lead, x.shape[-1]
        )
    return rms_norm_reference(x, weight, eps, gemma)


def rope(
    qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, use_kernel: bool | None = None
) -> torch.Tensor:
    """:func:`rope_reference` through the kernel where it applies (``qk`` ``[T, heads, D]`` with
    contiguous head rows; ``cos`` / ``sin`` contiguous, of ``qk``'s dtype)."""
    if use_kernel is None:
        use_kernel = available()
    if (
        use_kernel
        and _fits(qk)
        and qk.dim() == 3
        and qk.stride(-1) == 1
        and cos.dtype == sin.dtype == qk.dtype
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.numel() == sin.numel() == qk.shape[0] * qk.shape[-1]
    ):
        return torch.ops.specdec_cpu.rope(qk, cos, sin)
    return rope_reference(qk, cos, sin)


def silu_mul(gate_up: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """:func:`silu_mul_reference` through the kernel where it applies (``gate_up`` ``[T, 2I]`` with
    contiguous rows)."""
    if use_kernel is None:
        use_kernel = available()
    if use_kernel and _fits(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return torch.ops.specdec_cpu.silu_mul(gate_up)
    return silu_mul_reference(gate_up)
