"""The xgrammar grammar backend: spec -> xgrammar EBNF -> a pushdown automaton with precomputed token masks.

Method (XGrammar, Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models"; the ``xgrammar`` package, 0.2.x): a JSON schema, regex or choice list becomes a
context-free grammar (EBNF); compilation splits the vocabulary, per automaton position, into tokens
decided by the position alone (masks precomputed and cached) and the few "context-dependent" ones
checked at run time against the parser's stack (an Earley parser), so a mask costs tens of µs and a
compilation milliseconds to a second. Recursive ``$ref`` s are grammar rules: enforced at any depth.

Our contract (:class:`grammars.base.Grammar`) on top of ``xgrammar.GrammarMatcher``:

- every backend sees the same bytes for every token (:mod:`grammars.vocabulary`): xgrammar gets *our*
  token bytes as a ``RAW`` vocabulary (:func:`xgrammar_tokenizer_info`), special tokens and ids without
  bytes as empty tokens, which xgrammar never allows. (``TokenizerInfo.from_huggingface`` decodes the
  ordinary tokens of the tokenizers we test exactly as we do, but it treats added special tokens such
  as ``<|im_start|>`` or ``<|pad|>`` as ordinary text a grammar may emit, so it is not used.) The
  vocabulary is sized to the model's: its bitmask rows are ours word for word (same packed int32
  layout), except that xgrammar sets the padding bits past ``vocab_size`` in the last word, which are
  cleared here;
- EOS is ours: xgrammar is told our EOS ids as its stop tokens (so its masks allow them exactly when
  the text is a complete match), but an EOS is never fed to it: after an accepted EOS only EOS is
  allowed (:meth:`XGrammarGrammar.is_terminated` is "the last accepted token is an EOS");
- token ids outside the model vocabulary, special tokens and padded ids are refused before they reach
  xgrammar (which would log a warning for each).

JSON whitespace: the same language as the other backends, ``GrammarSpec.whitespace_pattern`` (default
``[ ]?``) between JSON tokens with ``,`` and ``:`` as separators. xgrammar only offers "any whitespace"
(``[ \\n\\r\\t]``, optionally bounded in count) or fixed separators, so the schema is converted with at
most one whitespace character per slot and every slot rule (``("" | ([ \\n\\r\\t]))``) of the EBNF is
replaced by the spec's pattern (itself converted by xgrammar's regex converter) before compiling.

Schema keywords xgrammar does not enforce are found by :mod:`grammars.xgrammar_schema` (verified by
compiling a schema with the keyword and walking an instance that violates it, see
``tests/test_grammar_xgrammar.py``): listed in ``XGRAMMAR_IGNORED``, reported by
:meth:`XGrammarBackend.check_schema` and recorded in the compiled grammar's ``ignored_keywords``;
``strict_schema=True`` refuses such schemas (:class:`UnsupportedSchemaError`). Objects are open unless
``additionalProperties`` closes them (xgrammar's ``strict_mode=False``, what the schema says).

Narrower than the schema (documented, not reported): properties in schema order (declared properties
before any others); ``pattern`` and ``patternProperties`` patterns match the whole string or key;
numbers with bounds cannot use exponents; integers cannot be written ``1.0`` (nor ``enum``/``const``
floats such as ``1.0``); the formats ``email``, ``date``, ``time``, ``date-time``, ``duration``,
``ipv4``, ``ipv6``, ``hostname``, ``uuid``, ``uri``, ``uri-reference``, ``uri-template``,
``json-pointer`` and ``relative-json-pointer`` are enforced by regexes covering subsets of their RFCs.

Regexes (``regex`` specs and schema patterns) use xgrammar's regex converter: look-around,
backreferences, word boundaries, ``\\p{...}``, inline flags such as ``(?i)``, POSIX classes
(``[[:alpha:]]``), escapes it would read as literal characters (``\\z``, ``\\A``, ``\\Q``, ``\\0``...)
and, in ``regex`` specs, ``^``/``$`` anywhere but at the ends are refused (:class:`GrammarCompileError`)
rather than compiled into a different language. In ``regex`` specs ``.`` is rewritten to ``[^\\n]``
(xgrammar's ``.`` matches a newline, Rust's does not); ``\\d`` and ``\\w`` are ASCII-only (narrower
than Rust's Unicode classes). Choices compile as an EBNF alternation of string literals.

Limits: xgrammar's compilation cannot be interrupted, so ``compile_timeout_s`` is checked when it returns
(:class:`GrammarCompileTimeoutError`), and a compiled grammar larger than ``max_grammar_bytes``
(``CompiledGrammar.memory_size_bytes``) raises :class:`GrammarTooLargeError`. xgrammar logs its own
warnings (an ignored ``multipleOf``, ``oneOf`` taken as ``anyOf``, ...) to stderr from C++; there is
no switch to silence them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from grammars.base import GrammarSpec
from grammars.bitmask import bitmask_width, token_ids_to_bitmask_row
from grammars.errors import (
    GrammarCompileError,
    GrammarCompileTimeoutError,
    GrammarTooLargeError,
    UnsupportedSchemaError,
)
from grammars.external_matcher import ExternalMatcherGrammar
from grammars.outlines_backend import strip_anchors
from grammars.pool import CompiledBase, PooledBackend
from grammars.schema import warn_ignored_keywords
from grammars.vocabulary import TokenVocabulary, tokenizer_vocabulary
from grammars.xgrammar_ebnf import (
    _NOT_COMPILED,
    ebnf_literal,
    restrict_whitespace,
    xgrammar_message,
    xgrammar_regex,
)
from grammars.xgrammar_schema import xgrammar_schema_findings


# --------------------------------------------------------------------------------- compiled, matcher
class XGrammarCompiledGrammar(CompiledBase):
    """A compiled spec (implements :class:`grammars.base.CompiledGrammar`); shared, thread-safe.

    Attributes:
        spec: the spec.
        vocab_size: model vocabulary size (bitmask rows are ``ceil(vocab_size / 32)`` words).
        grammar: the EBNF xgrammar compiled (for a regex spec, the regex it was given).
        memory_size_bytes: the compiled grammar's size (xgrammar's figure).
        compile_time_s: wall time of the compilation (conversion, EBNF, masks).
        ignored_keywords: what xgrammar does not enforce of the schema
            (:data:`grammars.xgrammar_schema.XGRAMMAR_IGNORED`).
        backend: ``"xgrammar"``.
    """

    backend = "xgrammar"

    def __init__(
        self,
        spec: GrammarSpec,
        compiled: xgr.CompiledGrammar,
        vocabulary: TokenVocabulary,
        vocab_size: int,
        grammar: str,
        compile_time_s: float,
        ignored_keywords: Sequence[str] = (),
    ):
        super().__init__(spec, vocabulary, vocab_size, compile_time_s, ignored_keywords)
        self._compiled = compiled
        self.grammar = grammar
        self.memory_size_bytes = int(compiled.memory_size_bytes)
        self.eos_set = frozenset(self.eos_token_ids)
        ordinary = np.zeros(vocab_size, dtype=bool)
        n = min(vocab_size, len(vocabulary.ordinary_mask))
        ordinary[:n] = vocabulary.ordinary_mask[:n]
        #: ordinary ids (bool ``[vocab_size]``): the only non-EOS tokens a row may allow
        self.ordinary = ordinary
        self.eos_row = token_ids_to_bitmask_row(np.array(self.eos_token_ids, dtype=np.int64), vocab_size)
        self.width = bitmask_width(vocab_size)
        rest = vocab_size % 32
        #: the bits of the last word inside the vocabulary (None: the last word is full)
        self.tail_mask: np.int32 | None = None if rest == 0 else np.int32((1 << rest) - 1)

    def matcher(self) -> XGrammarGrammar:
        """A fresh matcher in the initial state."""
        return XGrammarGrammar(self, xgr.GrammarMatcher(self._compiled))


class XGrammarGrammar(ExternalMatcherGrammar):
    """One request's matcher (implements :class:`grammars.base.Grammar`; see there for the contract).
    Rollback is unbounded: xgrammar keeps the parser's whole history."""

    def __init__(self, compiled: XGrammarCompiledGrammar, matcher: xgr.GrammarMatcher):
        super().__init__(compiled, matcher)
        self._scratch: torch.Tensor | None = None

    def _accepting(self) -> bool:
        return bool(self._matcher.is_completed())

    def _consume(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens into ``bitmask[row]`` (int32 ``[rows, W]``, ``W`` =
        ``ceil(vocab_size / 32)``).

        Raises:
            ValueError: ``bitmask`` is not int32 with ``W`` words per row.
            IndexError: ``row`` is outside the bitmask.
        """
        if self._check_row(bitmask, row):
            return
        c = self.compiled
        if bitmask.device.type == "cpu" and bitmask.is_contiguous():
            # straight into the row (xgrammar reads the tensor through DLPack, ignoring strides: only a
            # contiguous CPU tensor is written in place)
            self._matcher.fill_next_token_bitmask(bitmask, row)
            if c.tail_mask is not None:
                words = bitmask.numpy()
                words[row, -1] &= c.tail_mask
            return
        if self._scratch is None:
            self._scratch = torch.zeros(1, c.width, dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(self._scratch, 0)
        if c.tail_mask is not None:
            self._scratch.numpy()[0, -1] &= c.tail_mask
        bitmask[row].copy_(self._scratch[0])

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here (xgrammar's jump-forward tokens: the forced text split
        greedily into the longest vocabulary tokens, the last one left out when a longer token could
        extend it), possibly none; the state is not changed."""
        if self._num_eos:
            return []
        return [int(t) for t in self._matcher.find_jump_forward_tokens()]


def xgrammar_tokenizer_info(vocabulary: TokenVocabulary, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of ``vocabulary`` over a model vocabulary of ``vocab_size`` ids: our token bytes
    as a ``RAW`` vocabulary (ids without bytes, and the padded tail, empty: special to xgrammar, never
    allowed), our EOS ids inside the model vocabulary as its stop tokens."""
    encoded = [b or b"" for b in vocabulary.token_bytes[:vocab_size]]
    encoded += [b""] * (vocab_size - len(encoded))
    stop = [e for e in vocabulary.eos_token_ids if e < vocab_size]
    return xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)


class XGrammarBackend(PooledBackend[XGrammarCompiledGrammar]):
    """Compiles :class:`GrammarSpec` s with xgrammar for one tokenizer (implements
    :class:`grammars.base.GrammarBackend`).

    Args:
        tokenizer: a Hugging Face tokenizer (:func:`grammars.vocabulary.tokenizer_vocabulary`).
        vocab_size: the model's vocabulary size (its logits width), >= 1.
        eos_token_ids: ids that end generation (default ``[tokenizer.eos_token_id]``); each is allowed
            in final states only.
        compile_timeout_s: wall-clock limit of one compilation, checked when it returns (xgrammar's
            compilation cannot be interrupted).
        strict_schema: refuse JSON schemas with keywords xgrammar does not enforce
            (:class:`UnsupportedSchemaError`) instead of recording them in ``ignored_keywords``.
        max_grammar_bytes: largest accepted compiled grammar (``memory_size_bytes``); more raises
            :class:`GrammarTooLargeError`.
        compile_threads: threads xgrammar uses inside one compilation.
        max_workers, cache_size: compile threads and compiled grammars kept (LRU).

    Raises:
        ValueError: ``vocab_size`` < 1, a limit <= 0, or no EOS id.
    """

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Collection[int] | None = None,
        *,
        compile_timeout_s: float = 20.0,
        strict_schema: bool = False,
        max_grammar_bytes: int = 1 << 30,
        compile_threads: int = 2,
        max_workers: int = 2,
        cache_size: int = 256,
    ):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if compile_timeout_s <= 0 or max_grammar_bytes <= 0 or compile_threads <= 0:
            raise ValueError("compile_timeout_s, max_grammar_bytes and compile_threads must be > 0")
        super().__init__(max_workers, cache_size)
        self.vocabulary = tokenizer_vocabulary(tokenizer, eos_token_ids)
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.strict_schema = strict_schema
        self.max_grammar_bytes = max_grammar_bytes
        self.tokenizer_info = xgrammar_tokenizer_info(self.vocabulary, vocab_size)
        # our own cache (PooledBackend) keeps compilations: xgrammar's would grow without bound
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=compile_threads, cache_enabled=False
        )

    @property
    def fingerprint(self) -> str:
        """The tokenizer fingerprint (:class:`~grammars.vocabulary.TokenVocabulary`)."""
        return self.vocabulary.fingerprint

    def grammar(self, spec: GrammarSpec) -> str:
        """The EBNF xgrammar compiles for a ``json_schema`` or ``choice`` spec.

        Raises:
            GrammarCompileError: xgrammar cannot convert the schema.
        """
        if spec.kind == "choice":
            return "root ::= " + " | ".join(ebnf_literal(c) for c in json.loads(spec.value)) + "\n"
        if spec.kind != "json_schema":
            raise ValueError(f"a {spec.kind} spec is compiled as a regex, not an EBNF")
        try:
            converted = xgr.Grammar.from_json_schema(
                spec.value, any_whitespace=True, max_whitespace_cnt=1, strict_mode=False
            )
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarCompileError(
                f"{_NOT_COMPILED}xgrammar cannot convert this JSON schema: {xgrammar_message(e)}"
            ) from None
        return restrict_whitespace(str(converted), spec.whitespace_pattern)

    def schema_findings(self, spec: GrammarSpec) -> list[str]:
        """What xgrammar would not enforce of a ``json_schema`` spec; no warning issued.

        Raises:
            GrammarCompileError: xgrammar cannot take the schema (invalid, unconvertible, or with a
                pattern it would compile into another language).
        """
        found = xgrammar_schema_findings(json.loads(spec.value))
        self.grammar(spec)  # the conversion alone (about a millisecond) tells a refusal
        return found

    def check_schema(self, schema: dict[str, Any] | bool, strict: bool) -> list[str]:
        """The parts of ``schema`` xgrammar does not enforce: warned about, or raised when ``strict``.

        Raises:
            GrammarCompileError: xgrammar cannot take the schema.
            UnsupportedSchemaError: ``strict`` and something is not enforced.
        """
        found = xgrammar_schema_findings(schema)
        if isinstance(schema, dict):
            self.grammar(GrammarSpec.json_schema(schema))
        return warn_ignored_keywords(found, "xgrammar", strict)

    def _compile(self, spec: GrammarSpec) -> XGrammarCompiledGrammar:
        t0 = time.perf_counter()
        ignored: list[str] = []
        try:
            if spec.kind == "regex":
                grammar = xgrammar_regex(strip_anchors(spec.value), full_match_spec=True)
                compiled = self._compiler.compile_regex(grammar)
            else:
                if spec.kind == "json_schema":
                    ignored = xgrammar_schema_findings(json.loads(spec.value))
                    if ignored and self.strict_schema:
                        raise UnsupportedSchemaError(
                            f"xgrammar does not enforce this schema (strict): {'; '.join(ignored)}", ignored
                        )
                grammar = self.grammar(spec)
                compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            if isinstance(e, GrammarCompileError):
                raise
            raise GrammarCompileError(f"{_NOT_COMPILED}{xgrammar_message(e)}") from None
        elapsed = time.perf_counter() - t0
        if elapsed > self.compile_timeout_s:
            raise GrammarCompileTimeoutError(
                f"compiling the grammar took {elapsed:.1f} s, "
                f"longer than compile_timeout_s={self.compile_timeout_s} s"
            )
        if compiled.memory_size_bytes > self.max_grammar_bytes:
            raise GrammarTooLargeError(
                f"the compiled grammar takes {compiled.memory_size_bytes} bytes, more than "
                f"max_grammar_bytes={self.max_grammar_bytes}"
            )
        return XGrammarCompiledGrammar(
            spec, compiled, self.vocabulary, self.vocab_size, grammar, elapsed, ignored
        )
