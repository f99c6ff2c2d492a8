"""Transparent huge pages for the engine's weights and KV cache on the CPU.

A decode step streams every weight once. On 4 KiB pages each page of a stream costs a TLB miss and a page
walk; the kernels' prefetches hide part of it, not all. Linux backs a range with 2 MiB pages when asked:
``madvise(MADV_HUGEPAGE)`` marks it, ``madvise(MADV_COLLAPSE)`` (Linux 6.1) collapses its pages now, in
place: the addresses stay, so the C++ decode stacks' references to the weights stay valid. Where
transparent huge pages are in ``madvise`` mode (this project's host), nothing gets them unless asked:
``AnonHugePages`` was 0 kB in an engine process.

Measured on this project's 2-core host (docs/engine.md#huge-pages-for-the-weights): ``torch.sum`` over
320 MB of float32 22 → 30-32 GB/s. Two engines in one process, held-out prompts, bfloat16, batch 1, passes
interleaved, one on 4 KiB pages and one with its weights and their packed copies collapsed (0.55 GB in
1.8-3.8 s at start-up): plain decoding SmolLM2-135M 77.3 → 79.1 and 73.7 → 75.1 tok/s (+2 %), int8
self-drafting 78.6 → 86.3 tok/s (+10 %: its draft steps stream int8 codes, whose kernel gained most).
The KV caches are left out (see :func:`collapse_engine`).

:func:`collapse_engine` runs once per :class:`~specdec.llm.LLM` built on the CPU with
``huge_pages="auto"`` (the default; ``SPECDEC_HUGE_PAGES=0`` in the environment turns ``"auto"`` off, as
the test suite does to keep its many engines quick to build) or ``True``. It never fails an engine: where
the kernel or the platform refuses (not Linux, THP ``never``, a kernel before 6.1), the memory stays on
the pages it has and :class:`HugePageStats` says so. Outputs do not change (the same bytes at the same
addresses; tested).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from specdec.errors import ConfigError

__all__ = ["HugePageStats", "check_huge_pages", "collapse_engine", "collapse_tensors", "wanted"]

logger = logging.getLogger("specdec.huge_pages")

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB base pages) transparent huge page
MIN_STORAGE = 256 << 10  # smaller storages are not worth a window of their own
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
ENV = "SPECDEC_HUGE_PAGES"
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclass
class HugePageStats:
    """What :func:`collapse_tensors` did.

    Attributes:
        collapsed_bytes: bytes now on huge pages (whole 2 MiB ranges inside the tensors' storages).
        refused_bytes: bytes whose collapse the kernel refused (they stay on the pages they had).
        storages: distinct storages of at least 2 MiB visited.
        seconds: wall time spent.
        reason: why nothing was tried ("" when it was).
    """

    collapsed_bytes: int = 0
    refused_bytes: int = 0
    storages: int = 0
    seconds: float = 0.0
    reason: str = ""


def check_huge_pages(value: object) -> bool | str:
    """``"auto"``, True or False; anything else is a :class:`ConfigError` naming the field."""
    if value == "auto" or isinstance(value, bool):
        return value  # type: ignore[return-value]
    raise ConfigError(f"huge_pages must be 'auto', True or False, got {value!r}")


def wanted(value: bool | str, device: torch.device) -> bool:
    """Whether an engine on ``device`` collapses its memory: ``True``/``False`` as given (CPU only);
    ``"auto"``: on the CPU unless ``SPECDEC_HUGE_PAGES=0``."""
    if device.type != "cpu":
        return False
    if value == "auto":
        return os.environ.get(ENV, "1") != "0"
    return bool(value)


def _unavailable() -> str:
    """Why huge pages cannot be asked for here ("" when they can)."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    try:
        with open(_THP_ENABLED) as f:
            if "[never]" in f.read():
                return "transparent huge pages are off ([never])"
    except OSError:
        return "no transparent huge pages (" + _THP_ENABLED + " missing)"
    return ""


def _madvise() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def collapse_tensors(tensors: Iterable[torch.Tensor]) -> HugePageStats:
    """Put the CPU tensors' storages on huge pages, now and in place.

    Every 2 MiB-aligned window that a distinct storage of at least :data:`MIN_STORAGE` bytes touches is
    marked ``MADV_HUGEPAGE`` (later faults there get huge pages) and collapsed with ``MADV_COLLAPSE``,
    once however many tensors view it. Most of a model's weights are 0.3-2 MiB tensors that the allocator
    packs into its heap, so whole windows hold several of them (SmolLM2-135M: 552 MB of windows for its
    270 MB of weights and their packed copies, against 191 MB when only windows inside one storage were
    taken); a window that crosses into an unmapped or file-backed range is refused by the kernel and
    stays as it was. Raises nothing: refusals are counted in ``refused_bytes``.
    """
    stats = HugePageStats()
    stats.reason = _unavailable()
    if stats.reason:
        return stats
    madvise = _madvise()
    start_time = time.perf_counter()
    seen: set[int] = set()
    windows: set[int] = set()  # 2 MiB-aligned addresses
    for t in tensors:
        if t.device.type != "cpu" or t.is_sparse:
            continue
        storage = t.untyped_storage()
        addr, size = storage.data_ptr(), storage.nbytes()
        if size < MIN_STORAGE or addr in seen:
            continue
        seen.add(addr)
        stats.storages += 1
        windows.update(range(addr // HUGE_PAGE * HUGE_PAGE, addr + size, HUGE_PAGE))
    for start in sorted(windows):
        if madvise(start, HUGE_PAGE, MADV_HUGEPAGE) != 0 or madvise(start, HUGE_PAGE, MADV_COLLAPSE) != 0:
            stats.refused_bytes += HUGE_PAGE
        else:
            stats.collapsed_bytes += HUGE_PAGE
    stats.seconds = time.perf_counter() - start_time
    return stats


def _tensors_in(obj: Any, seen: set[int], depth: int) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj``: a tensor; a module's parameters, buffers and tensor-valued
    attributes (packed weight copies), recursively through its children; lists, tuples, dicts and plain
    objects' attributes down to ``depth`` levels (a drafter's KV cache, its draft vocabulary's codes)."""
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        for module in obj.modules():
            seen.add(id(module))
            for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
                if value is not None and not isinstance(value, torch.nn.Module):
                    yield from _tensors_in(value, seen, 2)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value, seen, depth - 1)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value, seen, depth - 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for value in vars(obj).values():
            yield from _tensors_in(value, seen, depth - 1)


def collapse_engine(engine: Any) -> HugePageStats:
    """:func:`collapse_tensors` on the weights of the engine's target (and their packed copies) and of
    its drafter (a draft model or heads, a draft vocabulary's rows); logged once at INFO. Not the KV
    caches: a step reads a small part of the pool (11.5 MB of SmolLM2's at 500 tokens against 270 MB of
    weights), and collapsing its 1.9 GB took 5-10 s of start-up here."""
    seen: set[int] = set()
    kv = (engine.runner.kv_caches, getattr(engine.drafter, "kv_cache", None))
    for tensor in _tensors_in(kv, set(), 3):
        seen.add(id(tensor))  # KV caches are skipped
    roots = (engine.runner.model, engine.drafter)
    stats = collapse_tensors(t for root in roots for t in _tensors_in(root, seen, 4))
    if stats.reason:
        logger.info("huge pages: not asked for (%s)", stats.reason)
    else:
        logger.info(
            "huge pages: %.0f MB of %d storages collapsed in %.2f s%s",
            stats.collapsed_bytes / 1e6,
            stats.storages,
            stats.seconds,
            f", {stats.refused_bytes / 1e6:.0f} MB refused" if stats.refused_bytes else "",
        )
    return stats
