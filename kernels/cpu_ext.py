"""The CPU kernels' extension module: ``kernels/csrc/*.cpp`` built once per machine.

One module holds every CPU kernel (:mod:`kernels.cpu_gemv`, :mod:`kernels.cpu_attention`). It is built
with torch's C++ extension mechanism (``torch.utils.cpp_extension.load``: needs a C++ compiler and
``ninja``; about a minute on 2 cores, then cached under ``TORCH_EXTENSIONS_DIR``), compiled for this CPU
(``-march=native``, OpenMP). The build is keyed by the sources, the CPU's flags and torch's version, so a
home directory shared between machines is safe. A build that fails logs one warning and returns None:
every kernel then falls back to its torch reference.

``SPECDEC_FORCE_REFERENCE=1`` turns every kernel off (the references run); each kernel module has its own
switch too (``SPECDEC_CPU_GEMV=0``, ``SPECDEC_CPU_ATTENTION=0``), ``SPECDEC_CPU_BF16_DOT=0`` keeps
bfloat16 products on the AVX2 path where the CPU has AVX512_BF16, and ``SPECDEC_CPU_AMX=0`` keeps packed
bfloat16 weights on oneDNN where it has AMX.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("kernels.cpu_ext")

_CSRC = Path(__file__).parent / "csrc"

#: ``SPECDEC_CPU_BF16_DOT=0``: bfloat16 products take the AVX2 path even where the CPU has AVX512_BF16 (A/B
#: measurements; see kernels.cpu_gemv.bf16_dot).
BF16_DOT_ENV = "SPECDEC_CPU_BF16_DOT"

#: ``SPECDEC_CPU_AMX=0``: packed bfloat16 weights take oneDNN's layout and GEMM, and bfloat16 attention
#: scores the AVX-512 path, even where the CPU has AMX (A/B measurements; see kernels.cpu_gemv.amx and
#: csrc/cpu_attention_amx.h).
AMX_ENV = "SPECDEC_CPU_AMX"
#: ``SPECDEC_CPU_TILES=0``: where there is no AMX, packed bfloat16 weights take oneDNN's layout and GEMM
#: instead of the tile order and the AVX-512 BF16 kernel on it (A/B measurements; see
#: kernels.cpu_gemv.tiles and csrc/cpu_gemv_bf16tiles.h).
TILES_ENV = "SPECDEC_CPU_TILES"

#: A build lock older than this (seconds) was left by a killed build (a build takes 1-2 minutes here).
STALE_LOCK_S = 600.0


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def _sources() -> list[Path]:
    return sorted(_CSRC.glob("*.cpp"))


def clear_stale_lock(name: str) -> bool:
    """Remove the build lock of extension ``name`` when it is older than :data:`STALE_LOCK_S`: torch's
    builder waits forever on a lock left by a build that was killed (Ctrl-C during the first build).
    Returns whether a lock was removed."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("removing the stale build lock %s (left by a killed build)", lock)
            lock.unlink(missing_ok=True)
            return True
    except Exception:  # torch's private helper moved: nothing to clear
        pass
    return False


@functools.cache
def build_key() -> str:
    """The build's key (12 hex digits): the kernel sources, this CPU's flags and torch's version; the
    module's name carries it, so a changed source builds anew (and cost profiles keyed by it are
    profiled anew, :mod:`specdec.engine.cost_profile`)."""
    text = "".join(p.read_text() for p in sorted(_CSRC.iterdir()) if p.is_file())
    return hashlib.sha256((text + _cpu_flags() + torch.__version__).encode()).hexdigest()[:12]


@functools.cache
def load_extension() -> Any | None:
    """The built module (functions ``gemv``, ``paged_attention_short``, ``write_kv``, ``has_avx2``), or None
    where it cannot build (logged once). Cached: the hot paths ask for it at every call (each uncached
    ``torch.utils.cpp_extension.load`` re-imports the module, ~0.26 ms)."""
    try:
        from torch.utils.cpp_extension import load

        # The operators' schemas first: the module registers kernels for them when it loads.
        import kernels.cpu_gemv
        import kernels.cpu_gemv_int8
        import kernels.cpu_layer_ops
        import kernels.cpu_max_rows  # noqa: F401

        sources = _sources()
        key = build_key()
        logger.info("loading the CPU kernels (built once per machine, about a minute on 2 cores)")
        name = f"specdec_cpu_kernels_{key}"
        clear_stale_lock(name)
        module = load(
            name,
            sources=[str(p) for p in sources],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
        if os.environ.get(BF16_DOT_ENV) == "0":
            module.set_bf16_dot(False)
        if os.environ.get(AMX_ENV) == "0":
            module.set_amx(False)
        if os.environ.get(TILES_ENV) == "0":
            module.set_tiles(False)
        return module
    except Exception as e:  # no compiler, no ninja, an unsupported CPU: the references serve
        logger.warning(
            "the CPU kernels did not build (%s: %s); using the torch references", type(e).__name__, e
        )
        return None


def enabled(disable_env: str) -> bool:
    """Whether a kernel may run here: not turned off (``SPECDEC_FORCE_REFERENCE=1`` or its own
    ``disable_env=0``) and the module built (on the first call)."""
    from kernels._triton import force_reference

    if force_reference() or os.environ.get(disable_env, "1") == "0":
        return False
    return load_extension() is not None


def require_extension() -> Any:
    """The built module.

    Raises:
        RuntimeError: it is not built here (callers check :func:`enabled` first).
    """
    ext = load_extension()
    if ext is None:
        raise RuntimeError("the CPU kernels are not built here (see kernels.cpu_ext.enabled)")
    return ext
