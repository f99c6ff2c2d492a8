"""Transparent huge pages for the engine's weights and KV pool on the CPU.

A decode step streams every weight once. On 4 KiB pages each page of a stream costs a TLB miss and a page
walk; the kernels' prefetches hide part of it, not all. Linux backs a range with huge pages (2 MiB on
x86-64; the size is read from ``hpage_pmd_size``) when asked: ``madvise(MADV_HUGEPAGE)`` marks it,
``madvise(MADV_COLLAPSE)`` (Linux 6.1) collapses its pages now, in place: the addresses stay, so the C++
decode stacks' references to the weights stay valid, and no byte changes. Where transparent huge pages
are in ``madvise`` mode (this project's host), nothing gets them unless asked: ``AnonHugePages`` was 0 kB
in an engine process.

Measured on this project's 2-core host (docs/engine.md#huge-pages-for-the-weights): ``torch.sum`` over
320 MB of float32 21.8-22.7 → 28.5-32.1 GB/s. Two engines in one process, held-out prompts, bfloat16,
batch 1, passes interleaved, one on 4 KiB pages and one with its weights and their packed copies
collapsed: plain decoding SmolLM2-135M 77.3 → 79.1 and 73.7 → 75.1 tok/s (+2 %), int8 self-drafting
78.6 → 86.3 tok/s (+10 %: its draft steps stream int8 codes). Start-up: 0.55 GB of windows in 1.7-4.4 s
(SmolLM2 bfloat16), 6.6 GB in 9.2 s (Qwen2.5-Coder 1.5B): it grows with the model, a few seconds a GB.

:func:`collapse_engine` runs once per :class:`~specdec.llm.LLM` built on the CPU with
``huge_pages="auto"`` (the default; ``SPECDEC_HUGE_PAGES=0``, ``false``, ``off`` or ``no`` in the
environment turns ``"auto"`` off, as the test suite does to keep its many engines quick to build) or
``True``. It never fails an engine: where the platform refuses (not Linux, THP ``never``, no ``madvise``
in the C library, a kernel before 6.1) the memory stays on the pages it has and
:attr:`HugePageStats.reason` says why; a window the kernel refuses (``EAGAIN``/``ENOMEM``: memory it
cannot compact) is counted in ``refused_bytes``.

The KV pool is not collapsed: the engine maps it fresh, advises it and then writes it once, at start-up
(:func:`zeros_on_huge_pages`, ``CacheConfig.kv_huge_pages``, set by the same ``huge_pages`` argument).

Side effects, beyond the weights' pages: a window reaches past a weight's storage into whatever shares
its 2 MiB (other heap allocations; their contents do not change), that neighbouring memory becomes
resident (at most a window per weight) and stays marked for huge pages, and collapsing holds the
process's mmap lock (other engines in the process pause while one starts).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os
import sys
import time
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from specdec.errors import ConfigError

__all__ = [
    "HugePageStats",
    "check_huge_pages",
    "collapse_engine",
    "collapse_tensors",
    "wanted",
    "zeros_on_huge_pages",
]

logger = logging.getLogger("specdec.huge_pages")

MIN_STORAGE = 256 << 10  # smaller storages are not worth a window of their own
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
EINVAL = 22
ENV = "SPECDEC_HUGE_PAGES"
_OFF = ("0", "false", "off", "no")
_THP = "/sys/kernel/mm/transparent_hugepage/"
#: Attribute names of KV caches: the walk of :func:`collapse_engine` does not enter them.
KV_NAMES = frozenset({"kv_cache", "kv_caches", "k_cache", "v_cache"})


def _huge_page_size() -> int:
    """The PMD-sized transparent huge page in bytes (2 MiB where the kernel does not say)."""
    try:
        with open(_THP + "hpage_pmd_size") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = _huge_page_size()


@dataclass
class HugePageStats:
    """What :func:`collapse_tensors` did.

    Attributes:
        collapsed_bytes: bytes of the windows now on huge pages (whole huge pages, so more than the
            tensors' own bytes where a window holds other memory too).
        refused_bytes: bytes of the windows whose collapse the kernel refused (they keep their pages).
        storages: distinct storages of at least :data:`MIN_STORAGE` bytes visited.
        seconds: wall time of the ``madvise`` calls (not of finding the tensors).
        reason: why nothing (or not everything) was tried; "" when every window was.
    """

    collapsed_bytes: int = 0
    refused_bytes: int = 0
    storages: int = 0
    seconds: float = 0.0
    reason: str = ""


def check_huge_pages(value: object) -> bool | str:
    """``"auto"``, True or False; anything else is a :class:`ConfigError` naming the field."""
    if (isinstance(value, str) and value == "auto") or isinstance(value, bool):
        return value  # type: ignore[return-value]
    raise ConfigError(f"huge_pages must be 'auto', True or False, got {value!r}")


def wanted(value: bool | str, device: torch.device) -> bool:
    """Whether an engine on ``device`` collapses its weights: ``True``/``False`` as given (CPU only: a
    GPU's memory is not the host's pages); ``"auto"``: on the CPU unless :data:`ENV` is ``0``,
    ``false``, ``off`` or ``no``."""
    if device.type != "cpu":
        return False
    if value == "auto":
        return os.environ.get(ENV, "1").strip().lower() not in _OFF
    return bool(value)


def _unavailable() -> str:
    """Why huge pages cannot be asked for here ("" when they can)."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    try:
        with open(_THP + "enabled") as f:
            if "[never]" in f.read():
                return "transparent huge pages are off ([never])"
    except OSError:
        return "no transparent huge pages (" + _THP + "enabled missing)"
    return ""


def _madvise() -> Any:
    """The C library's ``madvise`` (the process's own C library: glibc or musl), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _storage_span(t: torch.Tensor) -> tuple[int, int] | None:
    """``(address, bytes)`` of a dense CPU tensor's storage; None for any other (an opaque oneDNN or
    sparse tensor, a subclass without a plain storage)."""
    plain = type(t) in (torch.Tensor, torch.nn.Parameter)
    if t.device.type != "cpu" or t.layout != torch.strided or not plain:
        return None
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def _errno() -> int:
    """The ``errno`` of the last ``madvise`` call (a seam for the tests)."""
    return ctypes.get_errno()


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, populate: bool = True) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, in memory faulted onto huge pages: a fresh private
    anonymous mapping, marked ``MADV_HUGEPAGE``, the tensor starting at its first 2 MiB boundary, and
    with ``populate`` written with zeros once now, so that every page is faulted in here, as
    ``torch.zeros`` faults its memory, and not by the first step that writes it. Under :data:`HUGE_PAGE`
    bytes, or where the platform cannot ask (see :func:`collapse_tensors`), or the mapping fails, it is
    plain ``torch.zeros``; where the kernel finds no free huge page a write faults in 4 KiB pages (never
    an error). ``populate=False`` leaves the mapping to be faulted in as it is first written (only the
    part a run writes becomes resident).

    Why ``populate`` (the engine's pool): faulting a huge page in means zeroing 2 MiB, and on a virtual
    machine whose memory the host backs lazily (this project's hosts), the first touch of guest memory
    costs far more: ``madvise(MADV_POPULATE_WRITE)`` over a fresh 2 GiB mapping took 5.8 s, over a
    recycled one 0.3 s. Left to the steps, a pool of 30 layers' K and V caches faults 60 huge pages
    whenever the blocks handed out cross into a new 2 MiB of each cache: SmolLM2-135M bfloat16, 32
    requests decoding 64 tokens each, two steps of each 64-step pass took 360-400 ms against 31-34 ms
    (about a fifth of the pass's time), until the whole pool had been touched (docs/engine.md, huge
    pages).

    For the KV pool (:func:`specdec.quantization.kv_cache.allocate_kv_caches`): a decode step gathers
    each request's blocks from every layer's cache, pages scattered over a pool of gigabytes; on 4 KiB
    pages nearly every one costs a TLB miss (SmolLM2-135M bfloat16, 2-core AMX host, block tables shuffled
    as a long-running pool hands them out: 32 requests at 200 tokens 31.4 → 29.7 ms a step, 8 at 1000
    tokens 32.3 → 30.2 ms; one request at 200 tokens unchanged, 12.0 ms)."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if (
        nbytes < HUGE_PAGE
        or _unavailable()
        or not hasattr(mmap, "MADV_HUGEPAGE")
        or not hasattr(mmap, "MAP_ANONYMOUS")
    ):
        return torch.zeros(shape, dtype=dtype)
    # Private and anonymous (Python's default anonymous mapping is shared memory, which anonymous huge
    # pages do not back): the kernel's zero pages until written.
    try:
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no address space for it: torch's allocator, and its error if it fails too
        return torch.zeros(shape, dtype=dtype)
    with contextlib.suppress(OSError):  # refused: 4 KiB pages
        buf.madvise(mmap.MADV_HUGEPAGE)
    start = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE
    # It reads as zeros already (a fresh anonymous mapping); populating writes the same zeros. The tensor
    # keeps the mapping alive (frombuffer holds the buffer); unmapped with the last view.
    out = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)
    if populate:
        out.zero_()  # faults every page in now (the same zeros)
    return out


def collapse_tensors(tensors: Iterable[torch.Tensor]) -> HugePageStats:
    """Put the CPU tensors' storages on huge pages, now and in place.

    Every :data:`HUGE_PAGE`-aligned window that a distinct storage of at least :data:`MIN_STORAGE` bytes
    touches is marked ``MADV_HUGEPAGE`` (later faults there get huge pages) and collapsed with
    ``MADV_COLLAPSE``, once however many tensors view it. Most of a model's weights are 0.3-2 MiB tensors
    that the allocator packs into its heap, so whole windows hold several of them (SmolLM2-135M: 552 MB of
    windows for its weights and their packed copies, 270 MB each, against 191 MB when only windows inside
    one storage were taken). A window the kernel does not collapse (part of it unmapped, memory it cannot
    compact now, a mapping that cannot take huge pages) keeps its pages, though the part ``MADV_HUGEPAGE``
    marked may be collapsed later by the kernel's background thread. Raises nothing: refusals are counted
    in ``refused_bytes``.
    """
    stats = HugePageStats()
    stats.reason = _unavailable()
    madvise = None if stats.reason else _madvise()
    if madvise is None:
        stats.reason = stats.reason or "no madvise in the C library"
        return stats
    start_time = time.perf_counter()
    seen: set[int] = set()
    windows: set[int] = set()  # huge-page-aligned addresses
    for t in tensors:
        span = _storage_span(t)
        if span is None:
            continue
        addr, size = span
        if size < MIN_STORAGE or addr in seen:
            continue
        seen.add(addr)
        stats.storages += 1
        windows.update(range(addr // HUGE_PAGE * HUGE_PAGE, addr + size, HUGE_PAGE))
    invalid = 0  # windows refused with EINVAL: no MADV_COLLAPSE, or a mapping that cannot take THP
    for start in sorted(windows):
        if madvise(start, HUGE_PAGE, MADV_HUGEPAGE) == 0 and madvise(start, HUGE_PAGE, MADV_COLLAPSE) == 0:
            stats.collapsed_bytes += HUGE_PAGE
            continue
        invalid += _errno() == EINVAL
        stats.refused_bytes += HUGE_PAGE
    if windows and invalid == len(windows):  # every one: the kernel's, not the windows'
        stats.reason = "the kernel does not collapse on request (MADV_COLLAPSE needs Linux 6.1)"
    stats.seconds = time.perf_counter() - start_time
    return stats


def _tensors_in(obj: Any, seen: set[int], depth: int) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj``: a tensor; a module's parameters, buffers and tensor-valued
    attributes (packed weight copies), recursively through its children; lists, tuples, dicts and plain
    objects' attributes down to ``depth`` levels (a drafter's heads or draft model, its draft
    vocabulary's rows). Attributes named in :data:`KV_NAMES` are not entered, nor Python modules,
    functions or classes."""
    if id(obj) in seen or depth < 0 or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        for module in obj.modules():
            seen.add(id(module))
            yield from (t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None)
            for name, value in vars(module).items():
                if name not in KV_NAMES and not name.startswith("_"):
                    yield from _tensors_in(value, seen, 2)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value, seen, depth - 1)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value, seen, depth - 1)
    elif hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            if name not in KV_NAMES:
                yield from _tensors_in(value, seen, depth - 1)


def collapse_engine(engine: Any) -> HugePageStats:
    """:func:`collapse_tensors` on the weights of the engine's target (and their packed copies) and of
    its drafter (a draft model or heads, a draft vocabulary's rows); logged once at INFO. Not the KV
    caches (attributes named in :data:`KV_NAMES`, a draft model's runner's pool included): collapsing a
    1.9-2.1 GB pool after it is zeroed took 5-10 s of start-up here; the engine allocates its pool on
    huge pages instead (:func:`zeros_on_huge_pages`, ``CacheConfig.kv_huge_pages``). Never raises: an
    unexpected error is logged and reported as the stats' ``reason``."""
    try:
        seen: set[int] = set()
        roots = (engine.runner.model, engine.drafter)
        stats = collapse_tensors(t for root in roots for t in _tensors_in(root, seen, 4))
    except Exception as exc:
        logger.warning("huge pages: not applied (%s: %s)", type(exc).__name__, exc)
        return HugePageStats(reason=f"{type(exc).__name__}: {exc}")
    if stats.reason and not stats.storages:
        logger.info("huge pages: not asked for (%s)", stats.reason)
    else:
        logger.info(
            "huge pages: %.0f MB of %d storages collapsed in %.2f s%s%s",
            stats.collapsed_bytes / 1e6,
            stats.storages,
            stats.seconds,
            f", {stats.refused_bytes / 1e6:.0f} MB refused" if stats.refused_bytes else "",
            f" ({stats.reason})" if stats.reason else "",
        )
    return stats
