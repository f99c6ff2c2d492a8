"""The xgrammar backend (grammars/xgrammar_backend.py) on the tiny in-process tokenizers: its vocabulary
is ours, the schema keywords it does not enforce are the ones it reports (each claim checked by walking
an instance that violates the keyword), JSON whitespace, choices, regex refusals, limits, and the row
written through a non-contiguous bitmask. The Grammar contract itself is checked with the other
backends in test_grammar_rollback.py, test_grammar_vocabulary.py and test_grammar_auto.py."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from grammars import (
    GrammarCompileError,
    GrammarCompileTimeoutError,
    GrammarSpec,
    GrammarTooLargeError,
    allocate_token_bitmask,
    tokenizer_vocabulary,
    validate_instance,
)
from grammars.xgrammar_backend import XGrammarBackend, xgrammar_tokenizer_info
from grammars.xgrammar_ebnf import xgrammar_regex
from tests.test_grammar_helpers import feed, tiny_byte_level_tokenizer, tiny_sentencepiece_tokenizer

PAD = 7


@pytest.fixture(scope="module")
def tok():
    return tiny_byte_level_tokenizer()


@pytest.fixture(scope="module")
def backend(tok):
    with XGrammarBackend(tok, len(tok) + PAD) as b:
        yield b


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def accepts(backend, tok, spec: GrammarSpec, text: str) -> bool:
    g = backend.compile(spec).matcher()
    ids = tok.encode(text, add_special_tokens=False)
    return feed(g, ids) == len(ids) and g.is_final()


@pytest.mark.parametrize("make", [tiny_byte_level_tokenizer, tiny_sentencepiece_tokenizer])
@pytest.mark.parametrize("extra", [-3, 0, PAD])
def test_vocabulary_is_ours(make, extra):
    """xgrammar decodes every token to our bytes; its special ids are exactly our non-EOS ids without
    bytes plus the padded tail; its stop tokens are our EOS ids."""
    tok = make()
    v = tokenizer_vocabulary(tok)
    vocab_size = v.size + extra
    info = xgrammar_tokenizer_info(v, vocab_size)
    assert info.vocab_size == vocab_size and info.stop_token_ids == list(v.eos_token_ids)
    decoded = info.decoded_vocab
    assert all(decoded[i] == (v.token_bytes[i] or b"") for i in range(min(vocab_size, v.size)))
    expected = {i for i in range(vocab_size) if i >= v.size or v.token_bytes[i] is None}
    assert set(info.special_token_ids) == expected - set(v.eos_token_ids)


# (schema, instance violating the keyword that xgrammar accepts anyway, the keyword it reports)
OBJ_A = {"type": "object", "properties": {"a": {}}}
IGNORED = [
    ({"type": "number", "multipleOf": 0.5}, 1.2, "multipleOf"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, 7, "multipleOf"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "aaa", "maxLength"),
    ({"type": "string", "format": "email", "pattern": "^b"}, "a@b.co", "pattern"),
    ({"type": "array", "uniqueItems": True}, [1, 1], "uniqueItems"),
    ({"type": "array", "contains": {"const": 5}}, [1, 2], "contains"),
    ({"type": "object", "required": ["b"]}, {"a": 1}, "required"),
    ({**OBJ_A, "dependentRequired": {"a": ["b"]}}, {"a": 1}, "dependentRequired"),
    ({**OBJ_A, "unevaluatedProperties": False}, {"a": 1, "z": 2}, "unevaluatedProperties"),
    ({"type": "object", "properties": {"xa": {"type": "string"}},
      "patternProperties": {"^x": {"type": "integer"}}}, {"xa": "s"}, "patternProperties"),
    ({"type": "integer", "not": {"const": 3}}, 3, "not"),
    ({"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}}, 11, "if"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1, "oneOf"),
    ({"allOf": [{"type": "integer", "minimum": 1}, {"type": "integer", "maximum": 3}]}, 5, "allOf"),
    ({"type": "string", "enum": ["a", 1]}, 1, "type"),
    ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i", "minimum": 3}, 1, "minimum"),
    ({"$defs": {"i": {"$anchor": "int", "type": "integer"}}, "$ref": "#int"}, "s", "$ref"),
    ({**OBJ_A, "anyOf": [{"required": ["a"]}]}, {}, "required"),
    ({"minimum": 3}, 1, "minimum"),
]  # fmt: skip

# (schema, instance violating it: rejected, and nothing reported)
ENFORCED = [
    ({"type": "integer", "minimum": 3, "exclusiveMaximum": 9}, 9),
    ({"type": "number", "maximum": 1.5}, 1.6),
    ({"type": "integer", "multipleOf": 3}, 7),
    ({"type": "string", "minLength": 2, "maxLength": 3}, "abcd"),
    ({"type": "string", "pattern": "^[a-z]+$"}, "aB"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1]),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, [1, 2]),
    ({"type": "object", "minProperties": 2}, {"a": 1}),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False}, {"a": 1, "b": 2}),
    ({"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}}, {"z": 1}),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, True),
    ({"anyOf": [{"type": "integer"}, {"enum": ["a"]}]}, "b"),
    ({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}, "v": {"type": "integer"}},
      "required": ["v"]}}, "$ref": "#/$defs/n"}, {"c": {"c": {"c": {}, "v": 1}, "v": 1}, "v": 1}),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "instance", "keyword"), IGNORED, ids=[k for *_, k in IGNORED])
def test_reported_keywords_are_not_enforced(backend, tok, schema, instance, keyword):
    text = compact(instance)
    assert not validate_instance(text, schema)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = backend.check_schema(schema, strict=False)
    assert any(f.startswith(keyword + " at ") for f in found), found
    compiled = backend.compile(GrammarSpec.json_schema(schema))
    assert list(compiled.ignored_keywords) == found
    assert accepts(backend, tok, GrammarSpec.json_schema(schema), text)


@pytest.mark.parametrize(("schema", "instance"), ENFORCED)
def test_enforced_keywords_are_not_reported(backend, tok, schema, instance):
    assert not validate_instance(compact(instance), schema)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.check_schema(schema, strict=True) == []
    assert not accepts(backend, tok, GrammarSpec.json_schema(schema), compact(instance))


def test_refused_schemas(backend):
    for schema in (
        {"type": "integer", "minimum": 1.5},  # a fractional bound on an integer
        {"type": "string", "pattern": "^(?=a)ab$"},  # xgrammar would ignore the look-ahead
        {"$ref": "#/$defs/missing"},
    ):
        with pytest.raises(GrammarCompileError):
            backend.check_schema(schema, strict=False)
        with pytest.raises(GrammarCompileError):
            backend.compile(GrammarSpec.json_schema(schema))


def test_json_whitespace_is_the_spec_pattern(backend, tok):
    spec = GrammarSpec.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    assert accepts(backend, tok, spec, '{"a":1}') and accepts(backend, tok, spec, '{ "a": 1 }')
    assert not accepts(backend, tok, spec, '{"a":  1}') and not accepts(backend, tok, spec, '{"a":\n1}')
    custom = GrammarSpec.json_schema(spec.value, whitespace_pattern="[ \\n]{0,2}")
    assert accepts(backend, tok, custom, '{"a":\n 1}') and not accepts(backend, tok, custom, '{"a":\n\n 1}')
    assert accepts(backend, tok, GrammarSpec.json_schema({"type": "string"}), '"a b"')


def test_choice_and_regex(backend, tok):
    spec = GrammarSpec.choice(["a.b", "(x)", '"q"', "[é]", "a|b", "\\", ""])
    for text in ("a.b", "(x)", '"q"', "[é]", "a|b", "\\", ""):
        assert accepts(backend, tok, spec, text), text
    for text in ("axb", "x", "é", "a"):
        assert not accepts(backend, tok, spec, text), text
    dot = GrammarSpec.regex("^a.b$")
    assert accepts(backend, tok, dot, "a-b") and not accepts(backend, tok, dot, "a\nb")
    assert accepts(backend, tok, GrammarSpec.regex("a|ab"), "ab")
    for pattern, why in [
        ("(?=a)ab", "look-around"),
        ("(a)\\1", "escape \\\\1"),
        ("a\\z", "escape \\\\z"),
        ("(?i)ab", "group flag"),
        ("a$b", "anchor"),
        ("[[:alpha:]]", "POSIX"),
    ]:
        with pytest.raises(GrammarCompileError, match=why):
            backend.compile(GrammarSpec.regex(pattern))
    assert xgrammar_regex("a.[.]\\.", full_match_spec=True) == "a[^\\n][.]\\."
    assert xgrammar_regex("^a.b", full_match_spec=False) == "^a.b"


def test_limits(tok):
    with (
        XGrammarBackend(tok, len(tok), compile_timeout_s=1e-9) as b,
        pytest.raises(GrammarCompileTimeoutError),
    ):
        b.compile(GrammarSpec.regex("ab"))
    with XGrammarBackend(tok, len(tok), max_grammar_bytes=1) as b, pytest.raises(GrammarTooLargeError):
        b.compile(GrammarSpec.regex("ab"))
    with pytest.raises(ValueError):
        XGrammarBackend(tok, 0)


def test_rows_through_a_non_contiguous_bitmask_and_forced_tokens(backend, tok):
    spec = GrammarSpec.json_schema(
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    )
    g = backend.compile(spec).matcher()
    head = tok.encode('{"', add_special_tokens=False)
    assert feed(g, head) == len(head)
    expected = allocate_token_bitmask(1, backend.vocab_size)
    g.fill_bitmask(expected, 0)
    wide = torch.full((3, 2 * expected.shape[1]), -1, dtype=torch.int32)
    view = wide[:, ::2]
    assert not view.is_contiguous()
    g.fill_bitmask(view, 1)
    assert torch.equal(view[1], expected[0]) and (wide[0] == -1).all() and (wide[2] == -1).all()
    forced = g.forced_tokens()
    assert b"".join(backend.vocabulary.token_bytes[t] for t in forced) == b'name"'
    assert g.num_accepted_tokens == len(head)  # unchanged
