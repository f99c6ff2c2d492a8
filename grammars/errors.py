"""Every exception the project raises on purpose: :class:`SpecdecError` and its subclasses.

The hierarchy lives here, in the lowest package that raises any of it (``sampling`` raises
:class:`InvalidRequestError`, ``grammars`` the grammar errors), so that no package imports one above it.
:mod:`specdec.errors` re-exports the same classes (``specdec.errors.ConfigError is
grammars.errors.ConfigError``); users and the engine import them from there.

Every error a user can cause is a subclass of :class:`SpecdecError`; errors about bad arguments also
subclass :class:`ValueError` so that ``except ValueError`` keeps working for callers who expect it.

Bad input raises before any work starts. A fault that appears while a request runs and concerns that
request alone (its grammar fails to compile, its logits rows turn NaN or infinite, its drafter or its
grammar raises) does not raise: the request ends with ``finish_reason == "error"`` and a message in
``CompletionOutput.error``, its KV blocks are freed, and the other requests go on unchanged (see
:meth:`specdec.engine.LLMEngine.step`).

The grammar errors subclass :class:`SpecdecError` and :class:`ValueError` (a grammar that cannot be
used is a bad request argument)::

    GrammarError
    ├── GrammarSpecError            the spec itself is malformed (unknown kind, value not JSON, ...)
    └── GrammarCompileError         a well-formed spec that cannot be turned into a grammar
        ├── UnsupportedSchemaError  schema keywords outlines-core ignores (strict mode) or miscompiles
        ├── GrammarCompileTimeoutError  compilation ran past the backend's ``compile_timeout_s``
        └── GrammarTooLargeError    the token index has more states than the backend's ``max_index_states``

This module imports nothing but the standard library.
"""

from __future__ import annotations

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


class SpecdecError(Exception):
    """Base class of every exception specdec raises on purpose."""


class InvalidRequestError(SpecdecError, ValueError):
    """A prompt or its parameters are invalid (empty prompt, too long, token id out of vocabulary...).

    Raised before any work starts; requests already in the engine are not affected.
    """


class UnknownModelError(SpecdecError, ValueError):
    """A model name is neither a zoo name nor a directory holding an HF-format model."""


class ModelFetchError(SpecdecError):
    """A zoo model's package could not be downloaded (no network, package missing, pip failed)."""


class ChecksumError(SpecdecError):
    """A downloaded weight file does not have the expected sha256; nothing was written to the cache."""


class CorruptModelError(SpecdecError):
    """A model directory's weight or config files are missing, truncated or unreadable."""


class KVCacheExhaustedError(SpecdecError):
    """A single request needs more KV blocks than the whole pool holds, so preemption cannot help."""


class ConfigError(SpecdecError, ValueError):
    """An engine, cache, scheduler or speculative configuration value is invalid (raised before loading)."""


class CacheDirectoryError(SpecdecError):
    """The cache folder (``$SPECDEC_CACHE_DIR``, default ``~/.cache/specdec``) cannot be created or written,
    so a zoo model cannot be converted into it. Raised before anything is downloaded; models already
    converted there are still served from a read-only cache."""


# ------------------------------------------------------------------------------------------- grammars
class GrammarError(SpecdecError, ValueError):
    """Base class of the grammar errors."""


class GrammarSpecError(GrammarError):
    """A :class:`~grammars.base.GrammarSpec` is malformed: unknown kind, a schema that is not JSON, a
    choice list that is empty or holds non-strings, a whitespace pattern on a non-JSON spec."""


class GrammarCompileError(GrammarError):
    """A well-formed spec cannot be compiled: outlines-core rejects the schema or regex, the regex
    cannot be matched with the tokenizer's vocabulary, or the compile process failed."""


class UnsupportedSchemaError(GrammarCompileError):
    """A JSON schema uses keywords the grammar backend ignores (raised in strict mode only; the message
    and :attr:`keywords` name each one, with its JSON-pointer location where the backend gives one) or
    constructs outlines-core compiles into a wrong grammar (raised always, see :mod:`grammars.schema`)."""

    def __init__(self, message: str, keywords: list[str]):
        super().__init__(message)
        self.keywords = keywords


class GrammarCompileTimeoutError(GrammarCompileError):
    """Compiling took longer than the backend's ``compile_timeout_s`` (the compile process is killed)."""


class GrammarTooLargeError(GrammarCompileError):
    """The compiled token index has more automaton states than the backend's ``max_index_states``."""
