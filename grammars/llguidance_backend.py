"""The llguidance grammar backend: spec -> llguidance grammar -> an Earley parser over token bytes.

Method (llguidance, Moskal et al. 2025, the engine behind Guidance and the JSONSchemaBench tables;
Geng et al. 2025, "JSONSchemaBench"): a JSON schema is translated into a context-free grammar whose
terminals are regular expressions (a lexer) and parsed by an Earley parser; the token mask of a state is
computed on the fly by walking the tokenizer's token trie through the lexer (about 10-50 µs per token
here), so there is no token index to build and compilation takes milliseconds. Recursive ``$ref`` s are
grammar rules, so recursive schemas are enforced, not unrolled or truncated.

Our contract (:class:`grammars.base.Grammar`) on top of llguidance's ``LLMatcher``:

- every backend sees the same bytes for every token (:mod:`grammars.vocabulary`: byte-level BPE,
  SentencePiece byte fallback, partial UTF-8 tokens): llguidance reads a fast tokenizer itself and its
  reading is checked against ours token by token, else gets ours (:func:`llguidance_tokenizer`), sized
  to the model's vocabulary. llguidance allows no special token but EOS (none of our grammars names
  one) and no id without bytes (a padded vocabulary tail), so its mask rows are ours as they are
  (tested token by token on SmolLM2); where its vocabulary is wider than the model's they are cut and
  AND-ed with our ordinary-token row;
- EOS is ours: never fed to llguidance, allowed exactly when its matcher is accepting, and after it only
  EOS (so :meth:`LLGuidanceGrammar.is_terminated` is "the last accepted token is an EOS");
- tokens are fed with ``try_consume_tokens``, which refuses a disallowed token and stays usable
  (``consume_token`` would put the matcher in a permanent error state); the EOS side is
  :class:`grammars.external_matcher.ExternalMatcherGrammar`'s;
- grammars are compiled with llguidance's ``no_forcing`` option. By default, where the grammar forces a
  byte string (``cd`` after ``a`` in ``[ab]cd``; a property name), llguidance's mask allows only its
  canonical tokenization (the token ``cd``, not ``c``) while ``consume_token`` still takes the others:
  the mask and the matcher then describe different languages, and the masked target differs from the
  other backends' (found by the forced-drafts distribution test). With ``no_forcing`` every tokenization
  of the allowed bytes is allowed, as in outlines-core and xgrammar (llguidance then computes no
  fast-forward tokens: the drafts of forced tokens come from its masks,
  :func:`specdec.structured.forced_tokens`).

Schema keywords: ``strict_schema=True`` compiles in llguidance's default mode, which refuses every
keyword it does not implement (:class:`UnsupportedSchemaError`); otherwise it compiles with
``lenient`` and ``coerce_one_of`` (``oneOf`` enforced as ``anyOf``), and llguidance's warnings are the
compiled grammar's ``ignored_keywords``. Whitespace between JSON tokens follows
``GrammarSpec.whitespace_pattern`` (default ``[ ]?``, as the outlines-core backend), with ``,`` and ``:``
as separators.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Collection, Sequence
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from grammars.base import GrammarSpec
from grammars.bitmask import bitmask_width, token_ids_to_bitmask_row
from grammars.errors import GrammarCompileError, GrammarCompileTimeoutError, UnsupportedSchemaError
from grammars.external_matcher import ExternalMatcherGrammar
from grammars.outlines_backend import DEFAULT_WHITESPACE_PATTERN, escape_regex_literal, strip_anchors
from grammars.pool import CompiledBase, PooledBackend
from grammars.schema import warn_ignored_keywords
from grammars.vocabulary import TokenVocabulary, tokenizer_vocabulary

_NOT_COMPILED = "llguidance cannot compile this grammar: "
logger = logging.getLogger("grammars.llguidance")


def _message(text: str) -> str:
    """llguidance's message on one line, without the grammar source it quotes (ours, not the user's:
    ``   2 | start: ...`` and its caret line) or its ``at line(column):`` prefix."""
    source = False
    kept: list[str] = []
    for line in text.strip().splitlines():
        if re.match(r"^\s*\d+ \| ", line):
            source = True
        elif not (source and re.match(r"^\s*\^+\s*$", line)):
            source = False
            kept.append(line.strip())
    return re.sub(r"^at \d+\(\d+\): ", "", " ".join(k for k in kept if k))


def _lark_regex(pattern: str) -> str:
    """A Lark regex terminal matching ``pattern`` (``/`` escaped)."""
    return "/" + pattern.replace("/", "\\/") + "/"


class LLGuidanceCompiledGrammar(CompiledBase):
    """A compiled spec (implements :class:`grammars.base.CompiledGrammar`); shared, thread-safe.

    Attributes:
        spec: the spec.
        vocab_size: model vocabulary size (bitmask rows are ``ceil(vocab_size / 32)`` words).
        grammar: the llguidance grammar (JSON text).
        compile_time_s: wall time of the compilation (translation, validation, first matcher).
        ignored_keywords: llguidance's warnings about what it does not enforce (lenient mode).
        backend: ``"llguidance"``.
    """

    backend = "llguidance"

    def __init__(
        self,
        spec: GrammarSpec,
        template: llguidance.LLMatcher,
        vocabulary: TokenVocabulary,
        vocab_size: int,
        llg_vocab_size: int,
        grammar: str,
        compile_time_s: float,
        ignored_keywords: Sequence[str] = (),
    ):
        super().__init__(spec, vocabulary, vocab_size, compile_time_s, ignored_keywords)
        self._template = template
        self.grammar = grammar
        self.eos_set = frozenset(self.eos_token_ids)
        ordinary = np.zeros(vocab_size, dtype=bool)
        n = min(vocab_size, len(vocabulary.ordinary_mask))
        ordinary[:n] = vocabulary.ordinary_mask[:n]
        #: ordinary ids (bool ``[vocab_size]``): the only non-EOS tokens a row may allow
        self.ordinary = ordinary
        eos = np.array(self.eos_token_ids, dtype=np.int64)
        self.permitted_row = token_ids_to_bitmask_row(
            np.concatenate([np.flatnonzero(ordinary), eos]), vocab_size
        )
        self.eos_row = token_ids_to_bitmask_row(eos, vocab_size)
        self.width = bitmask_width(vocab_size)
        self.llg_vocab_size = llg_vocab_size
        self.llg_width = bitmask_width(llg_vocab_size)

    def matcher(self) -> LLGuidanceGrammar:
        """A fresh matcher in the initial state (a copy of the compiled one, ~2 µs)."""
        return LLGuidanceGrammar(self, self._template.deep_copy())


class LLGuidanceGrammar(ExternalMatcherGrammar):
    """One request's matcher (implements :class:`grammars.base.Grammar`; see there for the contract).
    Rollback is unbounded: llguidance keeps the parser's whole history."""

    def __init__(self, compiled: LLGuidanceCompiledGrammar, matcher: llguidance.LLMatcher):
        super().__init__(compiled, matcher)
        self._scratch = torch.zeros(1, compiled.llg_width, dtype=torch.int32)

    def _accepting(self) -> bool:
        return bool(self._matcher.is_accepting())

    def _consume(self, token_id: int) -> bool:
        # try_consume_tokens refuses a disallowed token without entering llguidance's error state
        return self._matcher.try_consume_tokens([token_id]) == 1

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
        if c.llg_vocab_size == c.vocab_size and bitmask.device.type == "cpu" and bitmask.is_contiguous():
            # straight into the row: llguidance allows no special token but EOS (our grammars name none),
            # no id without bytes (the padded tail) and no bit past its vocabulary, which is the model's:
            # exactly our ordinary-or-EOS set
            self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + 4 * row * c.width, 4 * c.width)
            return
        scratch = self._scratch[0]
        self._matcher.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
        torch.bitwise_and(scratch[: c.width], c.permitted_row, out=bitmask[row])

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        c = self.compiled
        ids = [int(t) for t in token_ids]
        if self._num_eos:  # terminated: EOS only
            n = 0
            while n < len(ids) and ids[n] in c.eos_set:
                n += 1
            return n
        # the leading run llguidance can judge: ordinary tokens of the model vocabulary
        j = 0
        while j < len(ids) and 0 <= ids[j] < c.vocab_size and c.ordinary[ids[j]]:
            j += 1
        n = self._matcher.validate_tokens(ids[:j]) if j else 0
        if n < j or j == len(ids) or ids[j] not in c.eos_set:
            return n
        # an EOS after the run: allowed if the run ends in an accepting state; then EOS only
        self._matcher.consume_tokens(ids[:j])
        accepting = self._matcher.is_accepting()
        self._matcher.rollback(j)
        if not accepting:
            return n
        n += 1
        while n < len(ids) and ids[n] in c.eos_set:
            n += 1
        return n


class _TokenizerAdapter:
    """What ``llguidance.TokenizerWrapper`` reads: our token bytes (special tokens as llguidance
    expects them, ``0xFF`` + name; ids without bytes empty) and the tokenizer's ``encode``."""

    def __init__(self, tokenizer: Any, vocabulary: TokenVocabulary, n_vocab: int):
        self._tokenizer = tokenizer
        self.eos_token_id = vocabulary.eos_token_ids[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(i for i in vocabulary.special_ids if i < n_vocab)
        tokens = []
        for i in range(n_vocab):
            b = vocabulary.token_bytes[i] if i < vocabulary.size else None
            if b is None and i in vocabulary.special_ids:
                name = tokenizer.convert_ids_to_tokens(i)
                b = b"\xff" + (name if isinstance(name, str) else f"<special_{i}>").encode()
            tokens.append(b or b"")
        self.tokens = tokens

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def llguidance_tokenizer(tokenizer: Any, vocabulary: TokenVocabulary, n_vocab: int) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over ``n_vocab`` ids that sees the token bytes of ``vocabulary``.

    A fast Hugging Face tokenizer is read by llguidance's Rust side (``llguidance.hf.from_tokenizer``:
    masks never call back into Python); its bytes are checked against ours for every ordinary token.
    Where it cannot read the tokenizer, or reads any token differently, our bytes are handed over
    through ``llguidance.TokenizerWrapper`` instead (correct, but llguidance then calls
    ``tokenizer.encode`` from Python while computing some masks, which is slower). A token whose bytes
    start with 0xFF (a raw-byte token; no UTF-8 text contains that byte) is never allowed by llguidance,
    which marks special tokens with that byte.
    """
    eos = list(vocabulary.eos_token_ids)
    try:
        rust = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
    except (ValueError, TypeError, AttributeError) as e:
        logger.info("llguidance cannot read the tokenizer itself (%s): our token bytes are used", e)
    else:
        mismatched = [
            i
            for i, b in enumerate(vocabulary.token_bytes)
            # a token starting with byte 0xFF (never in UTF-8 text) is a special token to llguidance
            if b is not None and i < n_vocab and not b.startswith(b"\xff") and rust.decode_bytes([i]) != b
        ]
        if not mismatched:
            return rust
        logger.warning(
            "llguidance reads %d tokens of this tokenizer differently from specdec (first: id %d); "
            "specdec's token bytes are used",
            len(mismatched),
            mismatched[0],
        )
    adapter = _TokenizerAdapter(tokenizer, vocabulary, n_vocab)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(adapter), n_vocab=n_vocab, eos_token=eos)


class LLGuidanceBackend(PooledBackend[LLGuidanceCompiledGrammar]):
    """Compiles :class:`GrammarSpec` s with llguidance for one tokenizer (implements
    :class:`grammars.base.GrammarBackend`).

    Args:
        tokenizer: a Hugging Face tokenizer (:func:`grammars.vocabulary.tokenizer_vocabulary`).
        vocab_size: the model's vocabulary size (its logits width), >= 1.
        eos_token_ids: ids that end generation (default ``[tokenizer.eos_token_id]``); each is allowed
            in final states only.
        compile_timeout_s: wall-clock limit of one compilation, checked when it returns (llguidance
            compiles in milliseconds; its own fuel limits, ``limits``, bound the work).
        strict_schema: refuse JSON-schema keywords llguidance does not implement
            (:class:`UnsupportedSchemaError`) instead of recording them in ``ignored_keywords``.
        limits: an ``llguidance.LLParserLimits`` (grammar size, lexer fuel, Earley items per step);
            None = llguidance's defaults.
        max_workers, cache_size: compile threads and compiled grammars kept (LRU).

    Raises:
        ValueError: ``vocab_size`` < 1, ``compile_timeout_s`` <= 0, or no EOS id.
    """

    name = "llguidance"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Collection[int] | None = None,
        *,
        compile_timeout_s: float = 20.0,
        strict_schema: bool = False,
        limits: llguidance.LLParserLimits | None = None,
        max_workers: int = 2,
        cache_size: int = 256,
    ):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        super().__init__(max_workers, cache_size)
        self.vocabulary = tokenizer_vocabulary(tokenizer, eos_token_ids)
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.strict_schema = strict_schema
        self.limits = limits
        # llguidance needs every tokenizer id in its vocabulary; rows are cut to the model's width
        self.llg_vocab_size = max(vocab_size, self.vocabulary.size, len(tokenizer))
        self.tokenizer = llguidance_tokenizer(tokenizer, self.vocabulary, self.llg_vocab_size)

    @property
    def fingerprint(self) -> str:
        """The tokenizer fingerprint (:class:`~grammars.vocabulary.TokenVocabulary`)."""
        return self.vocabulary.fingerprint

    def grammar(self, spec: GrammarSpec, lenient: bool) -> str:
        """The llguidance grammar (JSON text) of ``spec``: a Lark grammar with ``no_forcing`` (see the
        module docstring), the schema inlined with ``%json`` and its options under ``x-guidance``."""
        if spec.kind == "json_schema":
            options: dict[str, Any] = {
                "whitespace_pattern": spec.whitespace_pattern or DEFAULT_WHITESPACE_PATTERN,
                "item_separator": ",",
                "key_separator": ":",
            }
            if lenient:
                options.update(lenient=True, coerce_one_of=True)
            schema = json.loads(spec.value)
            schema["x-guidance"] = options
            start = "%json " + json.dumps(schema, ensure_ascii=False)
        elif spec.kind == "choice":
            pattern = "|".join(escape_regex_literal(c) for c in json.loads(spec.value))
            start = _lark_regex(pattern)
        else:
            start = _lark_regex(strip_anchors(spec.value))
        lark = '%llguidance {"no_forcing": true}\nstart: ' + start
        return json.dumps({"grammars": [{"lark_grammar": lark}]}, ensure_ascii=False)

    def schema_findings(self, spec: GrammarSpec) -> list[str]:
        """What llguidance would not enforce of ``spec`` in lenient mode (its warnings); no warning issued.

        Raises:
            GrammarCompileError: llguidance cannot compile the spec even leniently.
        """
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            self.grammar(spec, lenient=True), self.tokenizer, limits=self.limits
        )
        if is_error:
            raise GrammarCompileError(_NOT_COMPILED + "; ".join(_message(m) for m in messages))
        return [_message(m) for m in messages]

    def check_schema(self, schema: dict[str, Any] | bool, strict: bool) -> list[str]:
        """The parts of ``schema`` llguidance does not enforce: warned about, or raised when ``strict``.

        Raises:
            GrammarCompileError: llguidance cannot compile the schema.
            UnsupportedSchemaError: ``strict`` and something is not enforced.
        """
        spec = GrammarSpec.json_schema(schema if isinstance(schema, dict) else json.dumps(schema))
        return warn_ignored_keywords(self.schema_findings(spec), "llguidance", strict)

    def _compile(self, spec: GrammarSpec) -> LLGuidanceCompiledGrammar:
        t0 = time.perf_counter()
        lenient = spec.kind == "json_schema" and not self.strict_schema
        try:
            grammar = self.grammar(spec, lenient)
        except ValueError as e:
            raise GrammarCompileError(f"{_NOT_COMPILED}{e}") from None
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if template.is_error():
            message = _message(template.get_error())
            if spec.kind == "json_schema" and not lenient:
                raise UnsupportedSchemaError(
                    f"llguidance does not enforce this schema (strict): {message}", [message]
                )
            raise GrammarCompileError(_NOT_COMPILED + message)
        messages = [_message(m) for m in template.get_grammar_warnings()]
        elapsed = time.perf_counter() - t0
        if elapsed > self.compile_timeout_s:
            raise GrammarCompileTimeoutError(
                f"compiling the grammar took {elapsed:.1f} s, "
                f"longer than compile_timeout_s={self.compile_timeout_s} s"
            )
        return LLGuidanceCompiledGrammar(
            spec,
            template,
            self.vocabulary,
            self.vocab_size,
            self.llg_vocab_size,
            grammar,
            elapsed,
            messages if lenient else (),
        )
