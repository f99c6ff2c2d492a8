"""Microbenchmarks of the CPU kernels: GB/s of weights streamed against torch's own kernels.

    python -m kernels.bench_cpu            # every table
    python -m kernels.bench_cpu gemv int8  # some of them

``gemv``: :func:`kernels.cpu_gemv._bench` (float32 / bfloat16 GEMV against ``F.linear``); ``int8``:
:func:`kernels.cpu_gemv_int8._bench` (weight-only int8 against torch's ``_weight_int8pack_mm`` and the
bfloat16 kernel); ``attention``: :func:`kernels.cpu_attention._bench` (one layer's short-query
attention by context and query count). A separate entry point: run as ``python -m kernels.cpu_gemv`` a
kernel module would define its operators' schemas twice (as ``__main__`` and as the module the extension
imports), and the extension would not load.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from kernels import cpu_attention, cpu_gemv, cpu_gemv_int8

BENCHES: dict[str, Callable[[], None]] = {
    "gemv": cpu_gemv._bench,
    "int8": cpu_gemv_int8._bench,
    "attention": cpu_attention._bench,
}


def main(names: Sequence[str] = ()) -> None:
    """Run the named tables (all when none)."""
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise SystemExit(f"unknown table {unknown[0]!r}; choose from {sorted(BENCHES)}")
    for name in names or list(BENCHES):
        BENCHES[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
