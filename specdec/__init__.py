"""specdec: speculative and constrained decoding on a paged-KV engine, exact and measured.

Public names are imported lazily (PEP 562), at their first use: ``import specdec.errors``,
``specdec.zoo`` or ``specdec.cli`` then loads neither torch nor the engine (importing them eagerly here
would cost every such import about 2 s and a thousand modules). The lazy import no longer dodges a
cycle: the packages are layered, ``kernels`` < ``grammars`` < ``sampling`` < ``specdec`` <
``experiments``, and none imports one above it (``docs/layers.md``, ``tests/test_layers.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

_LAZY = {
    "LLM": "specdec.llm",
    "CompletionOutput": "specdec.outputs",
    "RequestOutput": "specdec.outputs",
    "SamplingParams": "sampling.params",
}

if TYPE_CHECKING:
    from sampling.params import SamplingParams
    from specdec.llm import LLM
    from specdec.outputs import CompletionOutput, RequestOutput


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
