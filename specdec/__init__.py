"""specdec: speculative and constrained decoding on a paged-KV engine, exact and measured.

Public names are imported lazily, so ``import specdec.errors`` (used by ``sampling``) stays light and
free of import cycles.
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
