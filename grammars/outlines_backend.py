"""The outlines-core grammar backend: spec -> regex -> token-level index -> per-request matchers.

Method (Willard & Louf 2023, "Efficient Guided Generation for Large Language Models"; the
``outlines-core`` Rust library, 0.2.x): a spec becomes a regular expression (``json_schema`` through
``outlines_core.json_schema.build_regex_from_schema``, ``choice`` as an alternation of escaped
literals, ``regex`` as given); the regex becomes a byte-level DFA, and outlines-core's ``Index`` walks
every vocabulary token's bytes (see :mod:`grammars.vocabulary`) from every reachable DFA state, keeping
``state -> {token id: next state}``. Decoding is then a table lookup per token.

Two outlines-core 0.2.14 quirks are worked around by compiling ``\\x00(?:R)$`` instead of ``R``:

- its ``Index`` drops a token from a state where the text so far is a complete match when the token
  leads to a non-final state (regex-automata reports matches one byte late and the index mistakes that
  for a finished match): for ``(ab)+`` the token ``a`` is missing after ``ab``, for a top-level JSON
  number the token ``.`` after ``12``. With the end anchor ``$`` a match is only reported at the end
  of input, so no token is mistaken;
- leftmost-first semantics stop at the first complete match of an alternation (``a|ab`` never
  allows ``ab``); the end anchor removes that too;
- ``(?:R)$`` has no "universal start state" when ``R`` matches the empty string, so the index is
  built behind a one-byte sentinel token (``\\x00``, given an id no model token has) and the matcher's
  initial state is the state after it.

Masks: the allowed tokens of a state are packed once into an int32 bitmask row (:mod:`grammars.bitmask`)
cached on the compiled grammar, so :meth:`OutlinesGrammar.fill_bitmask` is a row copy after the first
visit of a state. EOS ids are handled here, not by outlines-core: allowed exactly in final states.

Compilation runs in a small thread pool (:meth:`OutlinesBackend.compile_async` returns a
``concurrent.futures.Future``); the index itself is built in a child Python process (``_index_worker.py``,
outlines-core only), so a compile past ``compile_timeout_s`` is killed rather than left burning a core,
and the index size is checked there against ``max_index_states`` before it is shipped back (bincode,
~1 ms to load).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from grammars.base import GrammarSpec
from grammars.bitmask import bitmask_width, token_ids_to_bitmask_row
from grammars.errors import (
    GrammarCompileError,
    GrammarCompileTimeoutError,
    GrammarTooLargeError,
)
from grammars.pool import CompiledBase, PooledBackend
from grammars.schema import check_schema, normalize_schema, schema_findings
from grammars.vocabulary import TokenVocabulary, build_outlines_vocabulary, tokenizer_vocabulary

#: whitespace allowed between JSON tokens when a spec gives none: at most one space
DEFAULT_WHITESPACE_PATTERN = r"[ ]?"
_SENTINEL_BYTES = b"\x00"
_WORKER = Path(__file__).with_name("_index_worker.py")
_TERMINATED = -1
_INDEX_ERROR = "outlines-core cannot build the token index: "
# regex_syntax::is_meta_character
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def escape_regex_literal(text: str) -> str:
    """``text`` as a Rust-regex literal (backslash before each meta character, as ``regex::escape``)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def strip_anchors(pattern: str) -> str:
    """Drop one leading ``^`` and one trailing unescaped ``$``: patterns are matched in full anyway."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1]
    return pattern


def spec_to_regex(spec: GrammarSpec, strict_schema: bool = False) -> tuple[str, list[str]]:
    """The regex outlines-core will match in full for ``spec``, and the ignored schema keywords.

    Raises:
        GrammarCompileError: outlines-core cannot translate the schema; an invalid JSON schema.
        UnsupportedSchemaError: see :func:`grammars.schema.check_schema` (no warning is issued here: the
            ignored keywords are returned, and recorded on the compiled grammar).
    """
    if spec.kind == "json_schema":
        schema = json.loads(spec.value)
        ignored = schema_findings(schema, strict_schema)
        whitespace = spec.whitespace_pattern or DEFAULT_WHITESPACE_PATTERN
        try:
            regex = build_regex_from_schema(json.dumps(normalize_schema(schema)), whitespace)
        except (ValueError, RuntimeError) as e:
            raise GrammarCompileError(f"outlines-core cannot compile this JSON schema: {e}") from None
        return regex, ignored
    if spec.kind == "choice":
        return "|".join(escape_regex_literal(c) for c in json.loads(spec.value)), []
    return strip_anchors(spec.value), []


def explain_regex_error(pattern: str, message: str) -> str:
    """A readable reason why outlines-core (Rust ``regex-automata``) failed on the user's ``pattern``.

    outlines-core reports a syntax error as "Failed to build DFA error building NFA", without where or
    why. Python's :mod:`re` names the position and the cause, so a pattern both engines reject is
    explained by ``re``. (``re`` is not the judge: Rust's syntax accepts ``\\p{L}``, ``\\z`` or
    ``(?<name>...)``, which ``re`` rejects, so it is consulted only once outlines-core has failed.) A
    pattern that ``re`` accepts but outlines-core cannot parse uses a feature Rust's syntax lacks.
    """
    try:
        re.compile(pattern)
    except re.error as e:
        where = "" if e.pos is None else f" at position {e.pos}"
        excerpt = "" if e.pos is None else f" ({pattern[e.pos : e.pos + 24]!r})"
        return (
            f"{_INDEX_ERROR}the regex {pattern!r} is not a valid regular expression: {e.msg}{where}{excerpt}"
        )
    if "error building NFA" in message:
        return (
            f"{_INDEX_ERROR}the regex {pattern!r} is valid Python but not "
            "in the regex syntax outlines-core compiles "
            "(Rust's regex crate): it has no look-around ((?=...), (?!...), (?<=...), (?<!...)), "
            "backreferences (\\1), atomic groups ((?>...)), conditionals "
            f"((?(1)...)) or {{,n}} without a lower bound ({message.removeprefix(_INDEX_ERROR)})"
        )
    return message


class OutlinesCompiledGrammar(CompiledBase):
    """A compiled spec (implements :class:`grammars.base.CompiledGrammar`); shared, thread-safe.

    Attributes:
        spec: the spec.
        vocab_size: model vocabulary size (bitmask rows are ``ceil(vocab_size / 32)`` words).
        regex: the regex outlines-core matched (before the sentinel and anchor wrapping).
        num_states: states of the token index.
        compile_time_s: wall time of the whole compilation (regex, index, transfer).
        ignored_keywords: schema keywords outlines-core does not enforce (see :mod:`grammars.schema`).
    """

    backend = "outlines"

    def __init__(
        self,
        spec: GrammarSpec,
        index: outlines_core.Index,
        initial_state: int,
        vocabulary: TokenVocabulary,
        vocab_size: int,
        regex: str,
        num_states: int,
        compile_time_s: float,
        ignored_keywords: Sequence[str] = (),
    ):
        super().__init__(spec, vocabulary, vocab_size, compile_time_s, ignored_keywords)
        self.regex = regex
        self.num_states = num_states
        self._index = index
        self.initial_state = initial_state
        self._eos_set = frozenset(self.eos_token_ids)
        # ids a grammar may allow for their bytes: ordinary tokens inside the model vocabulary
        self._ordinary = vocabulary.ordinary_mask[:vocab_size]
        self._eos_array = np.array(self.eos_token_ids, dtype=np.int64)
        self._rows: dict[int, torch.Tensor] = {_TERMINATED: self._pack(self._eos_array)}
        self._final: dict[int, bool] = {_TERMINATED: True}

    @property
    def bitmask_width(self) -> int:
        return bitmask_width(self._vocab_size)

    def _pack(self, ids: np.ndarray) -> torch.Tensor:
        return token_ids_to_bitmask_row(ids, self._vocab_size)

    def matcher(self) -> OutlinesGrammar:
        """A fresh matcher in the initial state."""
        return OutlinesGrammar(self)

    def is_final_state(self, state: int) -> bool:
        """Whether ``state`` is a complete match (``_TERMINATED`` counts as final)."""
        final = self._final.get(state)
        if final is None:
            final = self._final[state] = bool(self._index.is_final_state(state))
        return final

    def next_state(self, state: int, token_id: int) -> int | None:
        """The state after ``token_id``, or None if it is not allowed (EOS included: see the matcher)."""
        if not 0 <= token_id < len(self._ordinary) or not self._ordinary[token_id]:
            return None
        nxt = self._index.get_next_state(state, token_id)
        return None if nxt is None else int(nxt)

    def allowed_row(self, state: int) -> torch.Tensor:
        """The packed allowed-token row of ``state``: int32 ``[ceil(vocab_size / 32)]`` (cached; do not
        modify it)."""
        row = self._rows.get(state)
        if row is None:
            ids = np.asarray(self._index.get_allowed_tokens(state) or [], dtype=np.int64)
            ids = ids[ids < len(self._ordinary)]
            ids = ids[self._ordinary[ids]]
            if self.is_final_state(state):
                ids = np.concatenate([ids, self._eos_array])
            row = self._rows[state] = self._pack(ids)
        return row

    @property
    def num_cached_rows(self) -> int:
        return len(self._rows)


class OutlinesGrammar:
    """One request's matcher over an :class:`OutlinesCompiledGrammar` (implements
    :class:`grammars.base.Grammar`; see there for the contract). The state history is a stack, so
    rollback is unbounded and O(n)."""

    def __init__(self, compiled: OutlinesCompiledGrammar):
        self.compiled = compiled
        self._states: list[int] = [compiled.initial_state]

    def _step(self, state: int, token_id: int) -> int | None:
        compiled = self.compiled
        if token_id in compiled._eos_set:
            return _TERMINATED if compiled.is_final_state(state) else None
        if state == _TERMINATED:
            return None
        return compiled.next_state(state, token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Copy the current state's cached row into ``bitmask[row]`` (int32 ``[rows, W]``, ``W`` =
        ``ceil(vocab_size / 32)``).

        Raises:
            ValueError: ``bitmask`` is not int32 with ``W`` words per row.
        """
        if (
            bitmask.dtype != torch.int32
            or bitmask.dim() != 2
            or bitmask.shape[1] != self.compiled.bitmask_width
        ):
            raise ValueError(
                f"bitmask must be int32 [rows, {self.compiled.bitmask_width}], "
                f"got {bitmask.dtype} {list(bitmask.shape)}"
            )
        bitmask[row].copy_(self.compiled.allowed_row(self._states[-1]))

    def accept_token(self, token_id: int) -> bool:
        nxt = self._step(self._states[-1], int(token_id))
        if nxt is None:
            return False
        self._states.append(nxt)
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        state = self._states[-1]
        for n, t in enumerate(token_ids):
            nxt = self._step(state, int(t))
            if nxt is None:
                return n
            state = nxt
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted_tokens} accepted")
        if num_tokens:
            del self._states[-num_tokens:]

    def reset(self) -> None:
        """Back to the initial state (everything rolled back)."""
        del self._states[1:]

    def is_terminated(self) -> bool:
        return self._states[-1] == _TERMINATED

    def is_final(self) -> bool:
        return self.compiled.is_final_state(self._states[-1])

    @property
    def num_accepted_tokens(self) -> int:
        return len(self._states) - 1


class OutlinesBackend(PooledBackend[OutlinesCompiledGrammar]):
    """Compiles :class:`GrammarSpec` s with outlines-core for one tokenizer (implements
    :class:`grammars.base.GrammarBackend`).

    Args:
        tokenizer: a Hugging Face tokenizer (:func:`grammars.vocabulary.tokenizer_vocabulary`).
        vocab_size: the model's vocabulary size (its logits width), >= 1; ids the tokenizer lacks are
            always masked.
        eos_token_ids: ids that end generation (default ``[tokenizer.eos_token_id]``); each is allowed in
            final states only.
        compile_timeout_s: wall-clock limit of one compilation (queueing not counted); past it the
            index-building process is killed and :class:`GrammarCompileTimeoutError` raised.
        max_index_states: largest accepted token index (states); more raises :class:`GrammarTooLargeError`.
        strict_schema: raise :class:`UnsupportedSchemaError` for schema keywords outlines-core ignores;
            otherwise they are listed in the compiled grammar's ``ignored_keywords`` (no warning: call
            :func:`grammars.schema.check_schema` per request for one).
        max_workers: compile threads (each runs at most one index-building process).
        cache_size: compiled grammars kept (LRU, keyed by (spec, tokenizer fingerprint)).
        compile_in_subprocess: build indexes in a child process (killable at the time limit). When
            False they are built in the compile thread: the time limit is then checked only after the
            build (the thread cannot be stopped), which suits tests and environments without
            ``sys.executable``.
        compile_memory_limit_bytes: address-space limit of the index-building process (``RLIMIT_AS``),
            None = none; a build that exceeds it fails with :class:`GrammarCompileError`.

    Raises:
        ValueError: ``vocab_size`` < 1, a limit <= 0, or no EOS id.
    """

    name = "outlines"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Collection[int] | None = None,
        *,
        compile_timeout_s: float = 20.0,
        max_index_states: int = 100_000,
        strict_schema: bool = False,
        max_workers: int = 2,
        cache_size: int = 256,
        compile_in_subprocess: bool = True,
        compile_memory_limit_bytes: int | None = None,
    ):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if compile_timeout_s <= 0 or max_index_states <= 0 or max_workers <= 0:
            raise ValueError("compile_timeout_s, max_index_states and max_workers must be > 0")
        super().__init__(max_workers, cache_size)
        self.vocabulary = tokenizer_vocabulary(tokenizer, eos_token_ids)
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.max_index_states = max_index_states
        self.strict_schema = strict_schema
        self.compile_in_subprocess = compile_in_subprocess
        self.compile_memory_limit_bytes = compile_memory_limit_bytes
        self.sentinel_token_id = max(self.vocabulary.size, vocab_size)
        self._lock = threading.Lock()
        self._token_map_payload: bytes | None = None
        self._outlines_vocabulary: outlines_core.Vocabulary | None = None

    @property
    def fingerprint(self) -> str:
        """The tokenizer fingerprint (:class:`~grammars.vocabulary.TokenVocabulary`)."""
        return self.vocabulary.fingerprint

    def check_schema(self, schema: dict[str, Any] | bool, strict: bool) -> list[str]:
        """The keywords of ``schema`` outlines-core ignores, warned about or, when ``strict``, raised
        (:func:`grammars.schema.check_schema`)."""
        return check_schema(schema, strict)

    # ------------------------------------------------------------------------------------ compilation
    def _compile(self, spec: GrammarSpec) -> OutlinesCompiledGrammar:
        t0 = time.perf_counter()
        regex, ignored = spec_to_regex(spec, self.strict_schema)
        wrapped = "\\x00(?:" + regex + ")$"
        try:
            if self.compile_in_subprocess:
                index, num_states = self._build_in_subprocess(wrapped, t0)
            else:
                index, num_states = self._build_in_thread(wrapped, t0)
        except (GrammarCompileTimeoutError, GrammarTooLargeError):
            raise
        except GrammarCompileError as e:
            if spec.kind != "regex":
                raise
            raise GrammarCompileError(explain_regex_error(spec.value, str(e))) from None
        initial = index.get_next_state(index.get_initial_state(), self.sentinel_token_id)
        if initial is None:  # cannot happen: the sentinel byte always starts the wrapped regex
            raise GrammarCompileError(f"the index of {spec.kind} has no start state")
        return OutlinesCompiledGrammar(
            spec,
            index,
            int(initial),
            self.vocabulary,
            self.vocab_size,
            regex,
            num_states,
            time.perf_counter() - t0,
            ignored,
        )

    def _vocabulary_payload(self) -> bytes:
        with self._lock:
            if self._token_map_payload is None:
                token_map = self.vocabulary.outlines_token_map()
                token_map.setdefault(_SENTINEL_BYTES, []).append(self.sentinel_token_id)
                pairs = [[token.hex(), [int(i) for i in ids]] for token, ids in token_map.items()]
                self._token_map_payload = json.dumps(pairs, separators=(",", ":")).encode()
            return self._token_map_payload

    def _build_in_subprocess(self, regex: str, t0: float) -> tuple[outlines_core.Index, int]:
        header = {
            "regex": regex,
            "eos_token_id": self.vocabulary.eos_token_ids[0],
            "max_states": self.max_index_states,
            "memory_limit_bytes": self.compile_memory_limit_bytes,
        }
        job = json.dumps(header).encode() + b"\n" + self._vocabulary_payload()
        remaining = self.compile_timeout_s - (time.perf_counter() - t0)
        try:
            if remaining <= 0:
                raise subprocess.TimeoutExpired(str(_WORKER), self.compile_timeout_s)
            proc = subprocess.run(
                [sys.executable, str(_WORKER)],
                input=job,
                capture_output=True,
                timeout=remaining,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise GrammarCompileTimeoutError(
                f"compiling the grammar took longer than compile_timeout_s={self.compile_timeout_s} s"
            ) from None
        if proc.returncode != 0 or not proc.stdout:
            tail = proc.stderr.decode(errors="replace")[-500:]
            raise GrammarCompileError(f"the index-building process failed (exit {proc.returncode}): {tail}")
        line, _, binary = proc.stdout.partition(b"\n")
        try:
            result = json.loads(line)
        except ValueError:
            raise GrammarCompileError(
                f"the index-building process answered garbage: {line[:200]!r}"
            ) from None
        if result.get("status") == "ok":
            if len(binary) != result["size"]:
                raise GrammarCompileError(
                    f"the index-building process sent {len(binary)} of {result['size']} bytes of the index"
                )
            return outlines_core.Index.from_binary(binary), int(result["num_states"])
        kind, message = result.get("kind"), result.get("message")
        if kind == "too_large":
            raise GrammarTooLargeError(
                f"the grammar's token index has {message}, more than max_index_states={self.max_index_states}"
            )
        raise GrammarCompileError(f"{_INDEX_ERROR}{message}")

    def _build_in_thread(self, regex: str, t0: float) -> tuple[outlines_core.Index, int]:
        with self._lock:
            if self._outlines_vocabulary is None:
                self._outlines_vocabulary = build_outlines_vocabulary(
                    self.vocabulary, {_SENTINEL_BYTES: self.sentinel_token_id}
                )
            vocabulary = self._outlines_vocabulary
        try:
            index = outlines_core.Index(regex, vocabulary)
        except (ValueError, RuntimeError) as e:
            raise GrammarCompileError(f"{_INDEX_ERROR}{e}") from None
        if time.perf_counter() - t0 > self.compile_timeout_s:
            raise GrammarCompileTimeoutError(
                f"compiling the grammar took longer than compile_timeout_s={self.compile_timeout_s} s"
            )
        num_states = len(index.get_transitions())
        if num_states > self.max_index_states:
            raise GrammarTooLargeError(
                f"the grammar's token index has {num_states} states, more than "
                f"max_index_states={self.max_index_states}"
            )
        return index, num_states
