"""Exceptions raised by specdec: the classes of :mod:`grammars.errors`, re-exported.

The hierarchy is defined in :mod:`grammars.errors`, the lowest package that raises any of it (see
``docs/layers.md``); the names here are the same class objects, so ``except specdec.errors.ConfigError``
and ``isinstance(e, SpecdecError)`` hold whichever module a caller imported them from.

Every error a user can cause is a subclass of :class:`SpecdecError`; errors about bad arguments also
subclass :class:`ValueError` so that ``except ValueError`` keeps working for callers who expect it.

Bad input raises before any work starts. A fault that appears while a request runs and concerns that
request alone (its grammar fails to compile, its logits rows turn NaN or infinite, its drafter or its
grammar raises) does not raise: the request ends with ``finish_reason == "error"`` and a message in
``CompletionOutput.error``, its KV blocks are freed, and the other requests go on unchanged (see
:meth:`specdec.engine.LLMEngine.step`).
"""

from __future__ import annotations

from grammars.errors import (
    CacheDirectoryError,
    ChecksumError,
    ConfigError,
    CorruptModelError,
    GrammarCompileError,
    GrammarCompileTimeoutError,
    GrammarError,
    GrammarSpecError,
    GrammarTooLargeError,
    InvalidRequestError,
    KVCacheExhaustedError,
    ModelFetchError,
    SpecdecError,
    UnknownModelError,
    UnsupportedSchemaError,
)

__all__ = [
    "CacheDirectoryError",
    "ChecksumError",
    "ConfigError",
    "CorruptModelError",
    "GrammarCompileError",
    "GrammarCompileTimeoutError",
    "GrammarError",
    "GrammarSpecError",
    "GrammarTooLargeError",
    "InvalidRequestError",
    "KVCacheExhaustedError",
    "ModelFetchError",
    "SpecdecError",
    "UnknownModelError",
    "UnsupportedSchemaError",
]
