"""Each row's maximum and its first index — ``torch.max(x, dim=-1)`` — as a C++ kernel beside its torch
reference.

A sampling step reads every logits row once more after the LM head: greedy rows need their argmax, and
every row a finiteness check (NaN anywhere, +inf, or nothing left above -inf ends the request). torch's
reduction with indices runs at ~45 us per row of 49,152 float32 logits on this project's CPU, several
times its value-only ``amax``: SmolLM2-135M bfloat16 at 32 greedy requests spent 1.5 ms of a 39 ms step
there, the logits just written by the LM head and out of the caches. ``csrc/cpu_max_rows.cpp`` keeps a
running maximum and its index per SIMD lane in one pass (``specdec_cpu::max_rows``).

Semantics are ``torch.max``'s (the reference): the largest value and the first index holding it; a row
with a NaN gives NaN and the index of its first NaN; ±inf compare as numbers (a row of -inf gives -inf at
index 0). Outputs equal the reference's exactly (values are elements of the row, indices integers).

Used for float32 ``[rows, n]`` CPU tensors with contiguous rows, outside autograd, where the extension
builds (:mod:`kernels.cpu_ext`; the first call builds it, as the other CPU kernels' first calls do) with
AVX-512; ``SPECDEC_CPU_MAX_ROWS=0`` or ``SPECDEC_FORCE_REFERENCE=1`` keeps the reference. Callers:
the engine's processing of each step's rows and :func:`sampling.sampler.argmax_rows` (greedy rows of the
rejection samplers, the drafters' greedy drafts, the exponential race of random draws).
"""

from __future__ import annotations

import functools

import torch

from kernels import cpu_gemv  # noqa: F401  (defines the specdec_cpu namespace: DEF before FRAGMENT)
from kernels.cpu_ext import enabled, load_extension

__all__ = ["available", "max_rows", "max_rows_reference"]

DISABLE_ENV = "SPECDEC_CPU_MAX_ROWS"

_LIB = torch.library.Library("specdec_cpu", "FRAGMENT")
_LIB.define("max_rows(Tensor x) -> (Tensor, Tensor)")


@torch.library.register_fake("specdec_cpu::max_rows", lib=_LIB)
def _max_rows_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0]), x.new_empty(x.shape[0], dtype=torch.int64)


def available() -> bool:
    """Whether the kernel can be used here: not disabled, built (on the first call) and vectorised
    (AVX-512: the scalar build is no faster than torch's reduction, so the reference runs there)."""
    return enabled(DISABLE_ENV) and _vectorized()


@functools.cache
def _vectorized() -> bool:
    ext = load_extension()
    return ext is not None and bool(ext.max_rows_vectorized())


def max_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` ``[rows]`` float32 / int64 of ``x`` ``[rows, n]``: ``torch.max(x, dim=-1)``."""
    top = x.max(dim=-1)
    return top.values, top.indices


def max_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`max_rows_reference` through the kernel where it applies (``x`` float32 ``[rows, n]`` on the
    CPU with contiguous rows, ``n >= 1``, no autograd, not traced by ``torch.compile``); the reference
    elsewhere."""
    if (
        x.dim() == 2
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and 0 < x.shape[1] < 2**31
        and x.stride(1) == 1
        and not (torch.is_grad_enabled() and x.requires_grad)
        and not torch.compiler.is_compiling()
        and available()
    ):
        values, indices = torch.ops.specdec_cpu.max_rows(x)
        return values, indices
    return max_rows_reference(x)
