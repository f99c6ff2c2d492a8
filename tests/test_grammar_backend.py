"""The outlines-core backend (grammars/outlines_backend.py, grammars/base.py, grammars/cache.py): specs,
compile cache and futures, time and size limits, the outlines-core index quirks we work around, regex
and choice grammars, bounded JSON whitespace. On a tiny in-process byte-level tokenizer (no model)."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from grammars import (
    CompileCache,
    CompiledGrammar,
    Grammar,
    GrammarBackend,
    GrammarCompileError,
    GrammarCompileTimeoutError,
    GrammarSpec,
    GrammarSpecError,
    GrammarTooLargeError,
    OutlinesBackend,
)
from tests.test_grammar_helpers import allowed_ids, feed, tiny_byte_level_tokenizer

EXPONENTIAL = "(a|b)*a[ab]{20}"  # 2**21 DFA states: ~16 s to build here


@pytest.fixture(scope="module")
def tok():
    return tiny_byte_level_tokenizer()


@pytest.fixture(scope="module")
def backend(tok):
    with OutlinesBackend(tok, len(tok) + 3) as b:
        yield b


def byte_ids(tok, text: str) -> list[int]:
    """``text`` as single-byte tokens only (ids 2..257), whatever the merges would do."""
    return [tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(2 + b)) for b in text.encode()]


def accepts(backend, tok, spec: GrammarSpec, text: str, bytewise: bool = False) -> bool:
    g = backend.compile(spec).matcher()
    ids = byte_ids(tok, text) if bytewise else tok.encode(text, add_special_tokens=False)
    return feed(g, ids) == len(ids) and g.is_final()


# ---------------------------------------------------------------------------------------------- spec
def test_spec_canonical_forms():
    a = GrammarSpec.json_schema({"type": "object", "properties": {"é": {"type": "string"}}})
    b = GrammarSpec.json_schema('{ "type" : "object",\n "properties": {"é": {"type": "string"}} }')
    assert a == b and hash(a) == hash(b)
    assert a.value == '{"type":"object","properties":{"é":{"type":"string"}}}'
    # property order is part of the grammar (outlines-core emits properties in schema order)
    ab = GrammarSpec.json_schema({"properties": {"a": {}, "b": {}}})
    ba = GrammarSpec.json_schema({"properties": {"b": {}, "a": {}}})
    assert ab != ba
    assert GrammarSpec.choice(["x", "y", "x"]).value == '["x","y"]'
    assert GrammarSpec("choice", '["x", "y"]') == GrammarSpec.choice(["x", "y"])
    assert GrammarSpec.json_schema({}, whitespace_pattern="[ ]{0,2}") != GrammarSpec.json_schema({})
    assert {a: 1}[b] == 1


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: GrammarSpec("grammar", "x"), "kind"),  # type: ignore[arg-type]
        (lambda: GrammarSpec("json_schema", "{not json"), "not valid JSON"),
        (lambda: GrammarSpec("json_schema", "[1]"), "JSON object"),
        (lambda: GrammarSpec.json_schema({"const": float("nan")}), "cannot be serialised"),
        (lambda: GrammarSpec.regex(""), "non-empty"),
        (lambda: GrammarSpec.choice([]), "non-empty list"),
        (lambda: GrammarSpec.choice(["a", 1]), "strings"),  # type: ignore[list-item]
        (lambda: GrammarSpec.choice("ab"), "not one string"),
        (lambda: GrammarSpec("regex", "a", whitespace_pattern=" "), "json_schema specs only"),
        (lambda: GrammarSpec.json_schema({}, whitespace_pattern=""), "non-empty"),
    ],
)
def test_spec_errors(make, message):
    with pytest.raises(GrammarSpecError, match=message) as err:
        make()
    assert isinstance(err.value, ValueError)


def test_protocols(backend):
    compiled = backend.compile(GrammarSpec.regex("ab"))
    assert isinstance(backend, GrammarBackend)
    assert isinstance(compiled, CompiledGrammar)
    assert isinstance(compiled.matcher(), Grammar)
    assert compiled.vocab_size == backend.vocab_size and compiled.spec == GrammarSpec.regex("ab")


# ----------------------------------------------------------------------------------- cache, futures
def test_cache_and_futures(tok):
    with OutlinesBackend(tok, len(tok)) as b:
        spec = GrammarSpec.regex("(ab)+c")
        fut = b.compile_async(spec)
        assert isinstance(fut, Future)
        assert b.compile_async(spec) is fut  # a pending compile is shared
        compiled = fut.result(timeout=30)
        assert b.compile(spec) is compiled and b.compile(GrammarSpec("regex", "(ab)+c")) is compiled
        assert (spec, b.fingerprint) in b.cache
        assert b.cache.misses == 1 and b.cache.hits == 3
        m1, m2 = compiled.matcher(), compiled.matcher()
        assert m1.accept_token(tok.convert_tokens_to_ids("ab"))
        assert m2.num_accepted_tokens == 0  # matchers are independent
        failing = GrammarSpec.json_schema({"type": "string", "format": "ipv4"})
        f1 = b.compile_async(failing)
        with pytest.raises(GrammarCompileError):
            f1.result(timeout=30)
        assert b.compile_async(failing) is f1  # failures are cached too
        b.cache.clear()
        assert len(b.cache) == 0 and b.compile(spec) is not compiled


def test_compile_cache_lru():
    cache: CompileCache[int] = CompileCache(2)

    def done(v: int) -> Future[int]:
        f: Future[int] = Future()
        f.set_result(v)
        return f

    cache.get_or_submit("a", lambda: done(1))
    cache.get_or_submit("b", lambda: done(2))
    assert cache.get_or_submit("a", lambda: done(9)).result() == 1  # refreshes "a"
    cache.get_or_submit("c", lambda: done(3))
    assert "b" not in cache and "a" in cache and "c" in cache
    with pytest.raises(ValueError):
        CompileCache(0)


# ---------------------------------------------------------------------------------------- limits
def test_compile_timeout_kills_the_build(tok):
    with OutlinesBackend(tok, len(tok), compile_timeout_s=1.0) as b:
        t0 = time.perf_counter()
        with pytest.raises(GrammarCompileTimeoutError, match=r"compile_timeout_s=1\.0") as err:
            b.compile(GrammarSpec.regex(EXPONENTIAL))
        elapsed = time.perf_counter() - t0
        assert isinstance(err.value, GrammarCompileError) and isinstance(err.value, ValueError)
        assert elapsed < 5.0  # the 16 s build was killed, not waited for
        assert b.compile(GrammarSpec.regex("ab")).num_states > 0  # the backend still works


def test_index_size_limit(tok):
    spec = GrammarSpec.regex("[a-z]{0,50}")  # 52 states
    for in_subprocess in (True, False):
        small = OutlinesBackend(tok, len(tok), max_index_states=40, compile_in_subprocess=in_subprocess)
        with small as b, pytest.raises(GrammarTooLargeError, match=r"52 states, more than max_index_states"):
            b.compile(spec)
        with OutlinesBackend(tok, len(tok), max_index_states=52, compile_in_subprocess=in_subprocess) as b:
            assert b.compile(spec).num_states == 52


def test_compile_memory_limit(tok):
    with OutlinesBackend(tok, len(tok), compile_memory_limit_bytes=2**32) as b:
        assert b.compile(GrammarSpec.regex("[a-z]{0,50}")).num_states == 52
    tiny = OutlinesBackend(tok, len(tok), compile_memory_limit_bytes=2**20)
    with tiny as b, pytest.raises(GrammarCompileError, match="index-building process failed"):
        b.compile(GrammarSpec.regex("[a-z]{0,50}"))


def test_bad_backend_arguments(tok):
    with pytest.raises(ValueError):
        OutlinesBackend(tok, 0)
    with pytest.raises(ValueError):
        OutlinesBackend(tok, len(tok), compile_timeout_s=0)
    with pytest.raises(TypeError):
        OutlinesBackend(tok, len(tok)).compile_async({"type": "string"})  # type: ignore[arg-type]


# ---------------------------------------------------------------------- outlines-core quirks fixed
@pytest.mark.parametrize("in_subprocess", [True, False])
def test_token_from_a_final_state_into_a_non_final_one(tok, in_subprocess):
    """outlines-core 0.2.14's own Index for ``(ab)+`` lacks the token ``a`` after ``ab``; ours has it."""
    import outlines_core

    from grammars import build_outlines_vocabulary, tokenizer_vocabulary

    a, b = byte_ids(tok, "ab")
    raw = outlines_core.Index("(ab)+", build_outlines_vocabulary(tokenizer_vocabulary(tok)))
    s = raw.get_next_state(raw.get_next_state(raw.get_initial_state(), a), b)
    assert raw.is_final_state(s) and raw.get_next_state(s, a) is None  # the upstream quirk
    with OutlinesBackend(tok, len(tok), compile_in_subprocess=in_subprocess) as backend:
        spec = GrammarSpec.regex("(ab)+")
        assert accepts(backend, tok, spec, "ababab", bytewise=True)
        g = backend.compile(spec).matcher()
        assert feed(g, [a, b]) == 2 and g.is_final()
        assert a in allowed_ids(g).tolist() and 0 in allowed_ids(g).tolist()  # 'a' and EOS


def test_leftmost_first_alternation_and_top_level_numbers(backend, tok):
    assert accepts(backend, tok, GrammarSpec.regex("a|ab"), "ab", bytewise=True)
    assert accepts(backend, tok, GrammarSpec.regex("a|ab"), "a", bytewise=True)
    number = GrammarSpec.json_schema({"type": "number"})
    for text in ("12.5", "-0.25e+3", "7", "12"):
        assert accepts(backend, tok, number, text, bytewise=True), text
    assert not accepts(backend, tok, number, "1.", bytewise=True)
    assert not accepts(backend, tok, number, "01", bytewise=True)


def test_empty_match_and_anchors(backend, tok):
    g = backend.compile(GrammarSpec.regex("a*")).matcher()
    assert g.is_final() and 0 in allowed_ids(g).tolist()  # EOS right away is a complete match
    assert accepts(backend, tok, GrammarSpec.regex("a*"), "aaa", bytewise=True)
    assert accepts(backend, tok, GrammarSpec.regex("^ab$"), "ab")  # explicit anchors are harmless
    assert accepts(backend, tok, GrammarSpec.choice(["", "x"]), "")
    assert accepts(backend, tok, GrammarSpec.regex("a\\$"), "a$")  # an escaped $ stays


def test_regex_with_nul_bytes(backend, tok):
    """The start sentinel is a \\x00 byte with an id of its own: real \\x00 tokens still work."""
    assert accepts(backend, tok, GrammarSpec.regex("a\\x00b"), "a\x00b", bytewise=True)
    g = backend.compile(GrammarSpec.regex("\\x00+")).matcher()
    assert backend.sentinel_token_id not in allowed_ids(g).tolist()
    assert not g.accept_token(backend.sentinel_token_id)


# ---------------------------------------------------------------------------------- regex, choice
def test_choice_escapes_regex_syntax(backend, tok):
    spec = GrammarSpec.choice(["a.b", "(x)", "1+1", "[é]", "a|b", "~#&-"])
    for text in ("a.b", "(x)", "1+1", "[é]", "a|b", "~#&-"):
        assert accepts(backend, tok, spec, text), text
    for text in ("axb", "x", "11", "é", "a", "b"):
        assert not accepts(backend, tok, spec, text), text


def test_regex_errors(backend):
    with pytest.raises(GrammarCompileError, match="cannot build the token index"):
        backend.compile(GrammarSpec.regex("(unclosed"))
    with pytest.raises(GrammarCompileError, match="word boundar"):
        backend.compile(GrammarSpec.regex("\\bword"))


# ------------------------------------------------------------------------------------ whitespace
def test_default_json_whitespace_is_bounded(backend, tok):
    spec = GrammarSpec.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    assert accepts(backend, tok, spec, '{"a":1}')
    assert accepts(backend, tok, spec, '{ "a": 1 }')
    assert not accepts(backend, tok, spec, '{"a":  1}')  # two spaces
    assert not accepts(backend, tok, spec, '{"a":\n1}')  # newline
    custom = GrammarSpec.json_schema(spec.value, whitespace_pattern="[ \\n]{0,2}")
    assert accepts(backend, tok, custom, '{"a":\n 1}')
    assert not accepts(backend, tok, custom, '{"a":\n\n 1}')
