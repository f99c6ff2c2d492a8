"""Skinny matrix products on the CPU (decode and verification rows): a C++ kernel beside its reference.

``y [M, N] = x [M, K] @ w [N, K]^T + bias`` for a few rows ``M``. Decode reads every weight once per
step, so what a CPU step costs is how fast these products stream the weights. On this project's 2-core
AMD EPYC (AVX2, no AVX-512), two threads, SmolLM2-135M shapes, ``F.linear`` streams 9-12 GB/s in float32
at one row and 2-4 GB/s in bfloat16 at five rows (a k = 4 verification), against 26 GB/s for
``torch.sum``; the kernel of ``csrc/cpu_gemv.cpp`` streams 12-23 GB/s (float32, one row), 15-20 (float32,
five rows), 15-18 (bfloat16, one row) and 9-14 (bfloat16, five rows). ``python -m kernels.cpu_gemv``
prints these figures for this machine.

Dispatch (:func:`gemv`): the kernel for float32 / bfloat16 CPU tensors of at most :data:`MAX_ROWS` rows
when it builds here; :func:`gemv_reference` (``F.linear``) otherwise, and everywhere with
``SPECDEC_FORCE_REFERENCE=1`` or ``SPECDEC_CPU_GEMV=0``. The kernel is built once per machine with
torch's C++ extension mechanism (``torch.utils.cpp_extension.load_inline``: needs a C++ compiler and
``ninja``; about 45 s, cached under ``TORCH_EXTENSIONS_DIR``), compiled for this CPU (``-march=native``;
the cached build is keyed by the CPU's flags, so a home directory shared between machines is safe). A
build that fails logs one warning and leaves the reference in place.

The op is registered as ``specdec::cpu_gemv`` (with a fake implementation), so ``torch.compile`` keeps
it as one opaque call.

Accuracy: float32 accumulation in a different order than ``F.linear``: float32 outputs agree within
1e-5 relative; bfloat16 outputs within one bfloat16 rounding of the float32 result.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels._triton import force_reference

logger = logging.getLogger("kernels.cpu_gemv")

#: Rows up to which the kernel is used (it reads the weights once per 4 rows; wider inputs are GEMMs).
MAX_ROWS = 16
DISABLE_ENV = "SPECDEC_CPU_GEMV"
_SOURCE = Path(__file__).parent / "csrc" / "cpu_gemv.cpp"


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x`` ``[M, K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` ->
    ``[M, N]``."""
    return F.linear(x, weight, bias)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def load_extension() -> Any | None:
    """The built kernel module, or None where it cannot build (logged once)."""
    try:
        from torch.utils.cpp_extension import load_inline

        source = _SOURCE.read_text()
        key = hashlib.sha256((source + _cpu_flags() + torch.__version__).encode()).hexdigest()[:12]
        logger.info("loading the CPU GEMV kernel (built once per machine, about 45 s on 2 cores)")
        return load_inline(
            f"specdec_cpu_gemv_{key}",
            cpp_sources=[source],
            functions=["gemv", "has_avx2"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler, no ninja, an unsupported CPU: the reference serves
        logger.warning("the CPU GEMV kernel did not build (%s: %s); using F.linear", type(e).__name__, e)
        return None


def available() -> bool:
    """Whether :func:`gemv` can use the kernel here: not disabled (``SPECDEC_CPU_GEMV=0``,
    ``SPECDEC_FORCE_REFERENCE=1``) and built (on the first call)."""
    if force_reference() or os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    return load_extension() is not None


@torch.library.custom_op("specdec::cpu_gemv", mutates_args=())
def cpu_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel: ``x`` ``[M, K]`` float32/bfloat16, ``weight`` ``[N, K]`` contiguous float32/bfloat16,
    ``bias`` ``[N]`` or None -> ``[M, N]`` in ``x``'s dtype.

    Raises:
        RuntimeError: shapes or dtypes it does not take, or the kernel is not built.
    """
    ext = load_extension()
    if ext is None:
        raise RuntimeError("the CPU GEMV kernel is not built here (see kernels.cpu_gemv.available)")
    empty = x.new_empty(0, dtype=torch.float32)
    return ext.gemv(x, weight, empty if bias is None else bias)


@cpu_gemv.register_fake
def _cpu_gemv_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


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
        and x2.shape[0] <= MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
    ):
        return cpu_gemv(x2, weight, bias).reshape(*lead, weight.shape[0])
    return gemv_reference(x, weight, bias)


def _bench(rows: tuple[int, ...] = (1, 5, 16)) -> None:
    """GB/s of weights streamed by ``F.linear`` and by the kernel, SmolLM2-135M's shapes (``python -m
    kernels.cpu_gemv``); weights cycled through 256 MB of copies to defeat the caches."""
    import time

    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
              "lm_head": (49152, 576)}  # fmt: skip
    print(f"threads {torch.get_num_threads()}, kernel built: {available()}")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for m in rows:
                for name, (n, k) in shapes.items():
                    ws = [torch.randn(n, k).to(dtype) for _ in range(max(1, int(256e6 // (n * k * 4))))]
                    x = torch.randn(m, k).to(dtype)
                    speeds = []
                    for f in (gemv_reference, gemv):
                        for w in ws[:2]:
                            f(x, w)
                        t = time.perf_counter()
                        for w in ws:
                            f(x, w)
                        seconds = time.perf_counter() - t
                        speeds.append(n * k * ws[0].element_size() * len(ws) / seconds / 1e9)
                    print(f"{str(dtype)[6:]:9s} rows {m:2d} {name:8s} F.linear {speeds[0]:5.1f} GB/s  "
                          f"kernel {speeds[1]:5.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    _bench()
