"""Shared plumbing of the kernels: lazy ``triton.jit``, the interpreter switch, and the dispatch rule.

Every op in :mod:`kernels` dispatches the same way: the Triton kernel for CUDA tensors, the pure-torch
reference for everything else, and the reference everywhere when ``SPECDEC_FORCE_REFERENCE=1``.

Interpreter mode: Triton decides between compiling and interpreting (``TRITON_INTERPRET=1``, numpy on
the CPU) when ``triton.jit`` runs, and ``triton.language``'s own helpers (``tl.cdiv``, ``tl.max``, ...)
are jitted when ``triton`` is first imported; so the variable must be set before the process first
imports ``triton``. ``tests/kernels/conftest.py`` sets it at collection time. Importing a
:mod:`kernels` module does not import triton: the kernels are decorated with :class:`lazy_jit`, which
imports triton and calls ``triton.jit`` at the first launch. So the CPU path (the references) never
imports triton, and the modules import where triton is not installed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

FORCE_REFERENCE_ENV = "SPECDEC_FORCE_REFERENCE"


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works here (it is an optional, Linux x86-64 dependency)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def force_reference() -> bool:
    """``SPECDEC_FORCE_REFERENCE`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(FORCE_REFERENCE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def interpreting() -> bool:
    """``TRITON_INTERPRET`` is set to a true value: kernels run in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def use_triton(*tensors: torch.Tensor) -> bool:
    """The dispatch rule: Triton when every tensor is on CUDA, Triton imports and the reference is not
    forced; the reference otherwise (CPU tensors, even in interpreter mode: the interpreter is for tests
    of the kernels, which call the ``*_triton`` launchers directly)."""
    return all(t.is_cuda for t in tensors) and not force_reference() and triton_available()


def interpreter_active() -> bool:
    """Whether ``triton`` was imported in interpreter mode (its ``tl`` helpers are interpreted)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.cdiv, InterpretedFunction)


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether a kernel must up-cast ``tl.dot`` operands of ``dtype`` to float32: only in the interpreter,
    whose ``tl.dot`` multiplies the raw bit patterns of bfloat16 operands (triton-lang/triton#11584)."""
    return interpreting() and dtype != torch.float32


class lazy_jit:
    """``triton.jit`` applied at the first launch (``kernel[grid](...)`` as usual).

    Kernel modules import ``triton.language as tl`` for type checkers only; at the first launch this
    binds ``tl`` in the kernel's module globals (where Triton resolves the names a kernel uses), then
    jits. Our kernels call no other jitted function of ours (it would need the same treatment).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._jitted: Any = None
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    @property
    def jitted(self) -> Any:
        if self._jitted is None:
            import triton
            import triton.language

            self.fn.__globals__.setdefault("tl", triton.language)
            self._jitted = triton.jit(self.fn)
        return self._jitted

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted[grid]


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
