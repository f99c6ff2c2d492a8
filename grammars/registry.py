"""Grammar backends by name: ``LLM(..., grammar_backend=NAME)``, the CLI's ``--grammar-backend`` and the
Hydra ``grammar_backend`` group.

=============== ===================================================================================
``auto``        per spec, the backend that enforces the most of it (:mod:`grammars.auto_backend`)
``llguidance``  llguidance's Earley parser (:mod:`grammars.llguidance_backend`)
``xgrammar``    xgrammar's pushdown automaton with precomputed masks (:mod:`grammars.xgrammar_backend`)
``outlines``    outlines-core's token index (:mod:`grammars.outlines_backend`)
=============== ===================================================================================
"""

from __future__ import annotations

import importlib.util
from collections.abc import Collection
from typing import Any

from grammars.base import GrammarBackend
from grammars.errors import ConfigError

#: backend name -> the Python package it needs
GRAMMAR_BACKENDS: dict[str, str | None] = {
    "auto": None,
    "llguidance": "llguidance",
    "outlines": "outlines_core",
    "xgrammar": "xgrammar",
}


def check_grammar_backend(name: str) -> str:
    """``name`` if it names a backend whose package is installed.

    Raises:
        ConfigError: an unknown name (the known ones listed), or the backend's package is missing.
    """
    if not isinstance(name, str) or name not in GRAMMAR_BACKENDS:
        raise ConfigError(f"grammar_backend must be one of {sorted(GRAMMAR_BACKENDS)}, got {name!r}")
    package = GRAMMAR_BACKENDS[name]
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"grammar_backend={name!r} needs the {package!r} package, which is not installed "
            f"(pip install {package.replace('_', '-')})"
        )
    return name


def make_grammar_backend(
    name: str,
    tokenizer: Any,
    vocab_size: int,
    eos_token_ids: Collection[int] | None = None,
    *,
    strict_schema: bool = False,
    compile_timeout_s: float = 20.0,
) -> GrammarBackend:
    """The backend ``name`` for ``tokenizer`` and a model vocabulary of ``vocab_size`` ids.

    Raises:
        ConfigError: see :func:`check_grammar_backend`.
        ValueError: the backend's own argument checks.
    """
    check_grammar_backend(name)
    if name == "auto":
        from grammars.auto_backend import AUTO_MEMBERS, AutoBackend

        members = tuple(m for m in AUTO_MEMBERS if importlib.util.find_spec(GRAMMAR_BACKENDS[m] or m))

        def member(m: str) -> GrammarBackend:
            return make_grammar_backend(
                m, tokenizer, vocab_size, eos_token_ids, compile_timeout_s=compile_timeout_s
            )

        return AutoBackend(member, members, strict_schema=strict_schema)
    if name == "llguidance":
        from grammars.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(
            tokenizer,
            vocab_size,
            eos_token_ids,
            strict_schema=strict_schema,
            compile_timeout_s=compile_timeout_s,
        )
    if name == "xgrammar":
        from grammars.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(
            tokenizer,
            vocab_size,
            eos_token_ids,
            strict_schema=strict_schema,
            compile_timeout_s=compile_timeout_s,
        )
    from grammars.outlines_backend import OutlinesBackend

    return OutlinesBackend(
        tokenizer, vocab_size, eos_token_ids, strict_schema=strict_schema, compile_timeout_s=compile_timeout_s
    )
