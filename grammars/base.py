"""What the engine sees of constrained decoding: a spec, a backend that compiles it, a matcher per request.

Life cycle (vLLM's structured-output design, with outlines-core as the backend):

1. A request carries a :class:`GrammarSpec` (``GrammarSpec.json_schema(...)``, ``.regex(...)`` or
   ``.choice(...)``); specs are frozen and hashable, so they key the compile cache.
2. ``backend.compile(spec)`` (or ``backend.compile_async(spec)``, a ``concurrent.futures.Future`` the
   engine polls) returns a :class:`CompiledGrammar`: immutable, shared by every request with that spec.
3. ``compiled.matcher()`` returns a fresh :class:`Grammar` for one request: a state machine over token
   ids. Each step the engine asks it for the allowed tokens (:meth:`Grammar.fill_bitmask`, a packed
   int32 row, see :mod:`grammars.bitmask`), applies the mask to the logits, and feeds it the committed
   tokens (:meth:`Grammar.accept_token`).

Under speculation, the verifier needs a mask for every draft position: walk the drafts with
``accept_token`` filling one row before each, then :meth:`Grammar.rollback` them; after verification
accept the committed tokens. :meth:`Grammar.validate_tokens` tells how many drafts the grammar would
take at all (a drafter can truncate its proposal there). Invariant: a matcher after any sequence of
accepts and rollbacks is in the state of a fresh matcher fed the tokens still accepted.

EOS: the grammar allows an EOS id exactly in final states (a complete match); accepting it terminates
the matcher. After termination EOS stays allowed (and acceptable), nothing else, so every mask row has at
least one allowed token and no row of logits becomes all ``-inf``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import torch

from grammars.errors import GrammarSpecError

GrammarKind = Literal["json_schema", "regex", "choice"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "regex", "choice")


def _compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _compact_json_or_raise(value: Any, what: str) -> str:
    try:
        return _compact_json(value)
    except (TypeError, ValueError) as e:  # not JSON-serialisable, or NaN / infinity
        raise GrammarSpecError(f"{what} cannot be serialised as JSON: {e}") from None


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. Frozen and hashable; equal specs share one compiled grammar.

    Prefer the constructors :meth:`json_schema`, :meth:`regex` and :meth:`choice`; the plain constructor
    canonicalises ``value`` the same way.

    Attributes:
        kind: ``"json_schema"``, ``"regex"`` or ``"choice"``.
        value: canonical string. ``json_schema``: the schema as compact JSON (``separators=(",", ":")``,
            non-ASCII kept) **in the schema's own key order**: outlines-core emits an object's properties
            in the order of its ``properties`` keyword, so two schemas differing only in key order are
            different grammars and must not share a cache entry (sorting keys would silently reorder
            the generated JSON). ``regex``: the pattern, matched in full (implicitly anchored at both
            ends) with Rust ``regex`` syntax (outlines-core uses ``regex-automata``). ``choice``: a JSON
            list of the allowed strings, in the given order, duplicates removed.
        whitespace_pattern: ``json_schema`` only: regex for the whitespace allowed between JSON tokens;
            None = the backend's default ``[ ]?`` (at most one space, so generation cannot run away in
            whitespace). Unbounded patterns such as ``[ \\n]*`` are allowed but let a model emit
            whitespace forever.

    Raises:
        GrammarSpecError: unknown kind; ``value`` not a JSON object/boolean schema for ``json_schema``;
            an empty pattern for ``regex``; not a non-empty JSON list of strings for ``choice``;
            ``whitespace_pattern`` given for a kind other than ``json_schema``.
    """

    kind: GrammarKind
    value: str
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarSpecError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise GrammarSpecError(f"GrammarSpec.value must be a str, got {type(self.value).__name__}")
        if self.whitespace_pattern is not None:
            if self.kind != "json_schema":
                raise GrammarSpecError("whitespace_pattern applies to json_schema specs only")
            if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
                raise GrammarSpecError("whitespace_pattern must be a non-empty regex string or None")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as e:
                raise GrammarSpecError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise GrammarSpecError(
                    f"json_schema must be a JSON object, got {type(schema).__name__}: {self.value[:80]}"
                )
            canonical = _compact_json_or_raise(schema, "json_schema")
        elif self.kind == "regex":
            if not self.value:
                raise GrammarSpecError("regex must be a non-empty pattern")
            canonical = self.value
        else:
            try:
                choices = json.loads(self.value)
            except json.JSONDecodeError as e:
                raise GrammarSpecError(f"choice value is not a JSON list: {e}") from None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarSpecError(f"choice must be a non-empty list of strings, got {self.value[:80]}")
            canonical = _compact_json(list(dict.fromkeys(choices)))
        object.__setattr__(self, "value", canonical)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, whitespace_pattern: str | None = None) -> GrammarSpec:
        """A spec for JSON matching ``schema`` (a dict, or its JSON text)."""
        value = schema if isinstance(schema, str) else _compact_json_or_raise(schema, "json_schema")
        return cls("json_schema", value, whitespace_pattern)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        """A spec for text fully matching ``pattern`` (Rust regex syntax)."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        """A spec for text equal to one of ``choices``."""
        if isinstance(choices, str):
            raise GrammarSpecError("choice takes a sequence of strings, not one string")
        return cls("choice", _compact_json_or_raise(list(choices), "choice"))


@runtime_checkable
class Grammar(Protocol):
    """A matcher for one request: the state of one walk through a compiled grammar.

    Token ids are model vocabulary ids, ``0 <= id < vocab_size`` (the model's, possibly padded beyond the
    tokenizer's). Not thread-safe: one request's matcher is driven by one thread.
    """

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed now into ``bitmask[row]``.

        Args:
            bitmask: packed int32 ``[rows, ceil(vocab_size / 32)]``; bit j of word w is token
                ``32 * w + j`` (see :mod:`grammars.bitmask`). Only row ``row`` is written, every word of it.
            row: the row to fill.

        Allowed: the tokenizer's ordinary tokens that keep a match possible; an EOS id exactly when the
        text so far is a complete match (:meth:`is_final`). Never allowed: special tokens other than EOS,
        ids the tokenizer does not have (the padded tail of a model vocabulary), bits past ``vocab_size``.
        """
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``. Returns False, leaving the state unchanged, if it is not allowed now
        (exactly the tokens :meth:`fill_bitmask` allows are accepted). Accepting EOS in a final state
        terminates the matcher."""
        ...

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` would be accepted one after another; the state is
        not changed."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (EOS included).

        Raises:
            ValueError: ``num_tokens`` is negative or more than :attr:`num_accepted_tokens`.
        """
        ...

    def is_terminated(self) -> bool:
        """True once EOS has been accepted (and not rolled back)."""
        ...

    def is_final(self) -> bool:
        """True when the accepted text is a complete match, i.e. EOS is allowed now."""
        ...

    @property
    def num_accepted_tokens(self) -> int:
        """Tokens accepted and not rolled back, EOS included."""
        ...


@runtime_checkable
class CompiledGrammar(Protocol):
    """A compiled spec: immutable and shared by every request with this spec (thread-safe)."""

    @property
    def spec(self) -> GrammarSpec:
        """The spec this grammar was compiled from."""
        ...

    @property
    def vocab_size(self) -> int:
        """The model vocabulary size the bitmask rows cover."""
        ...

    def matcher(self) -> Grammar:
        """A fresh matcher in the initial state, for one request."""
        ...


CompiledT = TypeVar("CompiledT", bound=CompiledGrammar)


@runtime_checkable
class GrammarBackend(Protocol[CompiledT]):
    """Compiles specs for one tokenizer and model vocabulary size.

    Generic in the compiled-grammar class it returns (``GrammarBackend[OutlinesCompiledGrammar]``); a
    bare ``GrammarBackend`` annotation accepts any backend.
    """

    def compile_async(self, spec: GrammarSpec) -> Future[CompiledT]:
        """Start compiling ``spec`` off the calling thread (or return the cached or pending future).

        Never blocks on the compilation; the engine polls ``future.done()``. ``future.result()`` is the
        :class:`CompiledGrammar` or raises :class:`~grammars.errors.GrammarCompileError` (or a subclass).
        """
        ...

    def compile(self, spec: GrammarSpec) -> CompiledT:
        """Compile (or fetch from the cache) and return the grammar; blocks until done.

        Raises:
            GrammarCompileError: the spec cannot be compiled (or a subclass: unsupported schema,
                timeout, too large).
        """
        ...

    def check_schema(self, schema: dict[str, Any] | bool, strict: bool) -> list[str]:
        """What this backend would not enforce of the JSON schema ``schema`` (one string per finding),
        warned about (``UserWarning``), or raised when ``strict``.

        Raises:
            UnsupportedSchemaError: ``strict`` and a finding.
            GrammarCompileError: the backend cannot take the schema at all.
        """
        ...
