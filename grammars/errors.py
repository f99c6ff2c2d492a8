"""Exceptions of the grammars package.

Every class subclasses :class:`specdec.errors.SpecdecError` and :class:`ValueError` (a grammar that
cannot be used is a bad request argument), so ``except ValueError`` and ``except SpecdecError`` both
catch them. The hierarchy::

    GrammarError
    ├── GrammarSpecError            the spec itself is malformed (unknown kind, value not JSON, ...)
    └── GrammarCompileError         a well-formed spec that cannot be turned into a grammar
        ├── UnsupportedSchemaError  schema keywords outlines-core ignores (strict mode) or miscompiles
        ├── GrammarCompileTimeoutError  compilation ran past the backend's ``compile_timeout_s``
        └── GrammarTooLargeError    the token index has more states than the backend's ``max_index_states``
"""

from __future__ import annotations

from specdec.errors import SpecdecError


class GrammarError(SpecdecError, ValueError):
    """Base class of the grammar errors."""


class GrammarSpecError(GrammarError):
    """A :class:`~grammars.base.GrammarSpec` is malformed: unknown kind, a schema that is not JSON, a
    choice list that is empty or holds non-strings, a whitespace pattern on a non-JSON spec."""


class GrammarCompileError(GrammarError):
    """A well-formed spec cannot be compiled: outlines-core rejects the schema or regex, the regex
    cannot be matched with the tokenizer's vocabulary, or the compile process failed."""


class UnsupportedSchemaError(GrammarCompileError):
    """A JSON schema uses keywords outlines-core ignores (raised in strict mode only; the message and
    :attr:`keywords` name each one with its JSON-pointer location) or constructs it compiles into a
    wrong grammar (raised always, see :mod:`grammars.schema`)."""

    def __init__(self, message: str, keywords: list[str]):
        super().__init__(message)
        self.keywords = keywords


class GrammarCompileTimeoutError(GrammarCompileError):
    """Compiling took longer than the backend's ``compile_timeout_s`` (the compile process is killed)."""


class GrammarTooLargeError(GrammarCompileError):
    """The compiled token index has more automaton states than the backend's ``max_index_states``."""
