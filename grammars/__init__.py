"""Constrained decoding: grammar Protocol, backends (llguidance, xgrammar, outlines-core, "auto"), bitmasks.

A request's output can be constrained to a JSON schema, a regular expression or a list of choices
(:class:`GrammarSpec`). A :class:`GrammarBackend` (:class:`LLGuidanceBackend`, llguidance's Earley
parser; :class:`XGrammarBackend`, xgrammar's pushdown automaton with precomputed masks, Dong et al. 2024;
:class:`OutlinesBackend`, outlines-core's token index, Willard & Louf 2023; :class:`AutoBackend`, per
spec the one that enforces the most; by name with :func:`make_grammar_backend`) compiles a spec
once into a shared :class:`CompiledGrammar`; each
request drives its own :class:`Grammar` matcher, which writes the allowed tokens of its state into a
packed int32 bitmask row (:mod:`grammars.bitmask`) and accepts, validates and rolls back tokens so that
speculative drafts can be masked position by position::

    backend = OutlinesBackend(tokenizer, vocab_size=model_vocab_size)
    compiled = backend.compile(GrammarSpec.json_schema({"type": "object", ...}))   # or compile_async
    grammar = compiled.matcher()
    bitmask = allocate_token_bitmask(1, model_vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    logits = apply_token_bitmask(logits, bitmask)        # disallowed -> -inf
    grammar.accept_token(next_token)

Modules, one concept each: :mod:`~grammars.base` (spec and Protocols), :mod:`~grammars.bitmask`
(packing and the reference masking), :mod:`~grammars.vocabulary` (tokenizer -> token bytes,
fingerprint), :mod:`~grammars.registry` (backends by name), :mod:`~grammars.auto_backend`,
:mod:`~grammars.llguidance_backend`, :mod:`~grammars.xgrammar_backend`,
:mod:`~grammars.outlines_backend` (the backends), :mod:`~grammars.pool` (compilation off the engine
thread), :mod:`~grammars.cache` (compile cache),
:mod:`~grammars.schema` (what outlines-core ignores in a JSON schema; instance validation),
:mod:`~grammars.errors`.

Public names are imported lazily (PEP 562): ``import grammars.errors`` (used by ``sampling`` and
:mod:`specdec.errors`) runs only the standard library, and the backend (outlines-core, numpy, torch)
loads at the first use of a name that needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grammars.auto_backend import AutoBackend
    from grammars.base import CompiledGrammar, Grammar, GrammarBackend, GrammarSpec
    from grammars.bitmask import (
        allocate_token_bitmask,
        apply_token_bitmask,
        bitmask_width,
        is_token_allowed,
        pack_bitmask,
        set_token_bits,
        token_ids_to_bitmask_row,
        unpack_bitmask,
    )
    from grammars.cache import CompileCache
    from grammars.errors import (
        GrammarCompileError,
        GrammarCompileTimeoutError,
        GrammarError,
        GrammarSpecError,
        GrammarTooLargeError,
        UnsupportedSchemaError,
    )
    from grammars.llguidance_backend import LLGuidanceBackend
    from grammars.outlines_backend import (
        DEFAULT_WHITESPACE_PATTERN,
        OutlinesBackend,
        OutlinesCompiledGrammar,
        OutlinesGrammar,
        spec_to_regex,
    )
    from grammars.registry import GRAMMAR_BACKENDS, make_grammar_backend
    from grammars.schema import (
        IGNORED_KEYWORDS,
        SchemaFinding,
        check_schema,
        find_ignored_keywords,
        normalize_schema,
        schema_findings,
        validate_instance,
    )
    from grammars.vocabulary import (
        TokenVocabulary,
        build_outlines_vocabulary,
        bytes_to_unicode,
        tokenizer_fingerprint,
        tokenizer_vocabulary,
    )
    from grammars.xgrammar_backend import XGrammarBackend

_LAZY = {
    "AutoBackend": "grammars.auto_backend",
    "LLGuidanceBackend": "grammars.llguidance_backend",
    "XGrammarBackend": "grammars.xgrammar_backend",
    "GRAMMAR_BACKENDS": "grammars.registry",
    "make_grammar_backend": "grammars.registry",
    "CompiledGrammar": "grammars.base",
    "Grammar": "grammars.base",
    "GrammarBackend": "grammars.base",
    "GrammarSpec": "grammars.base",
    "allocate_token_bitmask": "grammars.bitmask",
    "apply_token_bitmask": "grammars.bitmask",
    "bitmask_width": "grammars.bitmask",
    "is_token_allowed": "grammars.bitmask",
    "pack_bitmask": "grammars.bitmask",
    "set_token_bits": "grammars.bitmask",
    "token_ids_to_bitmask_row": "grammars.bitmask",
    "unpack_bitmask": "grammars.bitmask",
    "CompileCache": "grammars.cache",
    "GrammarCompileError": "grammars.errors",
    "GrammarCompileTimeoutError": "grammars.errors",
    "GrammarError": "grammars.errors",
    "GrammarSpecError": "grammars.errors",
    "GrammarTooLargeError": "grammars.errors",
    "UnsupportedSchemaError": "grammars.errors",
    "DEFAULT_WHITESPACE_PATTERN": "grammars.outlines_backend",
    "OutlinesBackend": "grammars.outlines_backend",
    "OutlinesCompiledGrammar": "grammars.outlines_backend",
    "OutlinesGrammar": "grammars.outlines_backend",
    "spec_to_regex": "grammars.outlines_backend",
    "IGNORED_KEYWORDS": "grammars.schema",
    "SchemaFinding": "grammars.schema",
    "check_schema": "grammars.schema",
    "find_ignored_keywords": "grammars.schema",
    "normalize_schema": "grammars.schema",
    "schema_findings": "grammars.schema",
    "validate_instance": "grammars.schema",
    "TokenVocabulary": "grammars.vocabulary",
    "build_outlines_vocabulary": "grammars.vocabulary",
    "bytes_to_unicode": "grammars.vocabulary",
    "tokenizer_fingerprint": "grammars.vocabulary",
    "tokenizer_vocabulary": "grammars.vocabulary",
}

__all__ = [
    "DEFAULT_WHITESPACE_PATTERN",
    "GRAMMAR_BACKENDS",
    "IGNORED_KEYWORDS",
    "AutoBackend",
    "CompileCache",
    "CompiledGrammar",
    "Grammar",
    "GrammarBackend",
    "GrammarCompileError",
    "GrammarCompileTimeoutError",
    "GrammarError",
    "GrammarSpec",
    "GrammarSpecError",
    "GrammarTooLargeError",
    "LLGuidanceBackend",
    "OutlinesBackend",
    "OutlinesCompiledGrammar",
    "OutlinesGrammar",
    "SchemaFinding",
    "TokenVocabulary",
    "UnsupportedSchemaError",
    "XGrammarBackend",
    "allocate_token_bitmask",
    "apply_token_bitmask",
    "bitmask_width",
    "build_outlines_vocabulary",
    "bytes_to_unicode",
    "check_schema",
    "find_ignored_keywords",
    "is_token_allowed",
    "make_grammar_backend",
    "normalize_schema",
    "pack_bitmask",
    "schema_findings",
    "set_token_bits",
    "spec_to_regex",
    "token_ids_to_bitmask_row",
    "tokenizer_fingerprint",
    "tokenizer_vocabulary",
    "unpack_bitmask",
    "validate_instance",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'grammars' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
