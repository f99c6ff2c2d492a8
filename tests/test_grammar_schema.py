"""What outlines-core ignores in a JSON schema (grammars/schema.py), verified on the compiled grammar:
for every keyword we report as ignored, an instance violating it is rejected by ``jsonschema`` and yet
accepted by the grammar token by token up to a final state. Also strict mode, the always-rejected
``allOf`` concatenation, schemas outlines-core cannot compile, and no false alarms."""

from __future__ import annotations

import json
import warnings

import jsonschema
import pytest

from grammars import (
    IGNORED_KEYWORDS,
    GrammarCompileError,
    GrammarSpec,
    OutlinesBackend,
    UnsupportedSchemaError,
    check_schema,
    find_ignored_keywords,
    validate_instance,
)
from tests.test_grammar_helpers import feed, tiny_byte_level_tokenizer

INT = {"type": "integer"}
DRAFT7 = "http://json-schema.org/draft-07/schema#"

# (flagged keyword, schema, an instance that violates the keyword)
IGNORED_CASES = [
    ("minimum", {"type": "integer", "minimum": 5}, 3),
    ("maximum", {"type": "number", "maximum": 1}, 2.5),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 5}, 5),
    ("exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 5}, 5),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 7),
    ("maxProperties", {"type": "object", "additionalProperties": INT, "maxProperties": 1}, {"a": 1, "b": 2}),
    ("maxProperties", {"type": "object", "properties": {"a": INT, "b": INT}, "maxProperties": 1},
     {"a": 1, "b": 2}),
    ("minProperties", {"type": "object", "properties": {"a": INT}, "minProperties": 1}, {}),
    ("minProperties", {"type": "object", "additionalProperties": INT, "minProperties": 2}, {"a": 1}),
    ("uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, [1, 1]),
    ("contains", {"type": "array", "items": INT, "contains": {"const": 3}}, [1]),
    ("minContains", {"type": "array", "items": INT, "contains": {"const": 3}, "minContains": 2}, [3]),
    ("maxContains", {"type": "array", "items": INT, "contains": {"const": 3}, "maxContains": 1}, [3, 3]),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": INT}}, {"x1": "s"}),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 2}}, {"abc": 1}),
    ("dependentRequired", {"type": "object", "properties": {"a": INT, "b": INT},
                           "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    ("dependentSchemas", {"type": "object", "properties": {"a": INT, "b": INT},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    ("dependencies", {"$schema": DRAFT7, "type": "object", "properties": {"a": INT, "b": INT},
                      "dependencies": {"a": ["b"]}}, {"a": 1}),
    ("not", {"type": "integer", "not": {"const": 3}}, 3),
    ("if", {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2},
            "else": {"multipleOf": 3}}, 7),
    ("then", {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, 7),
    ("else", {"type": "integer", "if": {"minimum": 5}, "else": {"multipleOf": 3}}, 2),
    ("unevaluatedItems", {"type": "array", "unevaluatedItems": False}, [1]),
    ("unevaluatedProperties", {"type": "object", "unevaluatedProperties": False}, {"a": 1}),
    ("$dynamicRef", {"$defs": {"s": {"$dynamicAnchor": "s", "type": "string"}}, "type": "integer",
                     "$dynamicRef": "#s"}, 1),
    ("required", {"type": "object", "properties": {"a": INT}, "required": ["b"]}, {}),
    ("required", {"type": "object", "required": ["a"]}, {}),
    ("oneOf", {"oneOf": [INT, {"type": "number"}]}, 1),
    ("minItems", {"prefixItems": [INT], "minItems": 2}, [1]),
    ("maxItems", {"prefixItems": [INT, INT], "maxItems": 1}, [1, 2]),
    ("uniqueItems", {"prefixItems": [INT, INT], "uniqueItems": True}, [1, 1]),
    # constraints beside the keyword outlines-core dispatches on
    ("type", {"type": "string", "enum": ["a", 1]}, 1),
    ("pattern", {"type": "string", "maxLength": 5, "pattern": "^a+$"}, "bbb"),
    ("maxLength", {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, "abc"),
    ("enum", {"anyOf": [INT, {"type": "string"}], "enum": [1, "a"]}, 2),
    ("enum", {"enum": [{"a": 1}], "properties": {"a": INT}}, {"a": 2}),
]  # fmt: skip


@pytest.fixture(scope="module")
def backend():
    tok = tiny_byte_level_tokenizer()
    with OutlinesBackend(tok, len(tok), compile_in_subprocess=False) as b:
        yield b


def grammar_accepts(backend, schema, instance) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = backend.compile(GrammarSpec.json_schema(schema)).matcher()
    text = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
    ids = tiny_byte_level_tokenizer().encode(text, add_special_tokens=False)
    return feed(g, ids) == len(ids) and g.is_final()


@pytest.mark.parametrize(("keyword", "schema", "instance"), IGNORED_CASES)
def test_ignored_keyword_is_flagged_and_really_ignored(backend, keyword, schema, instance):
    ignored, miscompiled = find_ignored_keywords(schema)
    assert keyword in [f.keyword for f in ignored]
    assert not miscompiled
    assert not validate_instance(json.dumps(instance), schema)  # jsonschema rejects it...
    assert grammar_accepts(backend, schema, instance)  # ...the grammar does not


def test_recursive_refs_are_refused_not_truncated(backend):
    """Issue 20: outlines-core unrolls a recursive ``$ref`` three levels deep and can leave a dangling
    comma (``{"v": 0, }``), so such a schema is a miscompiled finding: refused, never compiled."""
    from grammars import GrammarCompileError

    schema = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"v": INT, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                "required": ["v", "next"],
            }
        },
        "$ref": "#/$defs/node",
    }
    _, miscompiled = find_ignored_keywords(schema)
    assert [f.keyword for f in miscompiled] == ["$ref"] and "dangling comma" in str(miscompiled[0])
    with pytest.raises(GrammarCompileError, match="recursive"):
        backend.compile(GrammarSpec.json_schema(schema))


def test_validate_instance_of_a_schema_it_cannot_evaluate_is_none():
    """A remote ``$ref`` (nothing is fetched): ``schema_valid`` is None, not a crash after the work."""
    assert validate_instance("{}", {"$ref": "http://example.com/x.json"}) is None
    assert validate_instance("{", {"$ref": "http://example.com/x.json"}) is False  # does not parse


def test_every_listed_keyword_has_a_verified_case():
    verified = {k for k, _, _ in IGNORED_CASES}
    assert set(IGNORED_KEYWORDS) - verified <= {"$recursiveRef"}  # draft 2019-09 only, same code path


def test_format_next_to_pattern_is_dropped(backend):
    """``format`` is only an annotation for ``validate_instance``; with a format checker the date is
    invalid, and the grammar (pattern only) still takes it."""
    schema = {"type": "string", "pattern": "^[0-9-]+$", "format": "date"}
    assert "format" in [f.keyword for f in find_ignored_keywords(schema)[0]]
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    assert not checker.is_valid("1-2")
    assert grammar_accepts(backend, schema, "1-2")


def test_all_of_concatenation_is_always_rejected(backend):
    schema = {
        "allOf": [{"type": "object", "properties": {"a": INT}}, {"type": "object", "properties": {"b": INT}}]
    }
    # the evidence: outlines-core's own regex for it accepts two objects back to back
    from outlines_core.json_schema import build_regex_from_schema

    regex = build_regex_from_schema(json.dumps(schema), None)
    raw = backend.compile(GrammarSpec.regex(regex)).matcher()
    text = tiny_byte_level_tokenizer().encode('{"a":1}{"b":2}', add_special_tokens=False)
    assert feed(raw, text) == len(text) and raw.is_final()
    with pytest.raises(UnsupportedSchemaError, match="allOf at #") as err:
        backend.compile(GrammarSpec.json_schema(schema))
    assert err.value.keywords and err.value.keywords[0].startswith("allOf at #")
    with pytest.raises(UnsupportedSchemaError):
        check_schema(schema, strict=False)
    assert check_schema({"allOf": [INT]}, strict=False) == []  # a single subschema is fine


@pytest.mark.parametrize(
    ("schema", "instance", "keyword"),
    [
        ({"type": "array", "items": INT, "properties": {}}, {}, "properties at #"),
        ({"type": "object", "prefixItems": [INT]}, [1], "prefixItems at #"),
    ],
)
def test_dispatch_on_a_keyword_of_an_excluded_type_is_always_rejected(backend, schema, instance, keyword):
    """outlines-core compiles ``properties`` (``prefixItems``) even when ``type`` rules objects (arrays)
    out: its grammar then emits only values of the wrong type."""
    from outlines_core.json_schema import build_regex_from_schema

    raw = backend.compile(GrammarSpec.regex(build_regex_from_schema(json.dumps(schema), None))).matcher()
    ids = tiny_byte_level_tokenizer().encode(json.dumps(instance), add_special_tokens=False)
    assert feed(raw, ids) == len(ids) and raw.is_final()
    assert not validate_instance(json.dumps(instance), schema)
    with pytest.raises(UnsupportedSchemaError, match=keyword):
        backend.compile(GrammarSpec.json_schema(schema))


def test_strict_mode_raises_non_strict_records_check_schema_warns():
    tok = tiny_byte_level_tokenizer()
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}, "required": ["age"]}
    with OutlinesBackend(tok, len(tok), strict_schema=True, compile_in_subprocess=False) as strict:
        with pytest.raises(UnsupportedSchemaError, match=r"minimum at #/properties/age") as err:
            strict.compile(GrammarSpec.json_schema(schema))
        assert err.value.keywords == ["minimum at #/properties/age (numeric bounds are not enforced)"]
        assert isinstance(err.value, ValueError) and isinstance(err.value, GrammarCompileError)
        # a schema it enforces fully compiles in strict mode too
        ok = strict.compile(GrammarSpec.json_schema({"type": "object", "properties": {"age": INT}}))
        assert ok.ignored_keywords == ()
    with OutlinesBackend(tok, len(tok), compile_in_subprocess=False) as lenient:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the backend records, it does not warn
            compiled = lenient.compile(GrammarSpec.json_schema(schema))
        assert compiled.ignored_keywords == ("minimum at #/properties/age (numeric bounds are not enforced)",)
    with pytest.warns(UserWarning, match="1 schema keyword"):
        assert check_schema(schema, strict=False) == [compiled.ignored_keywords[0]]


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "strng"}, "not a valid JSON schema"),
        ({"type": "string", "format": "ipv4"}, "Format ipv4 is not supported"),
        ({"$ref": "https://example.com/other.json"}, "outlines-core cannot compile"),
        (
            {"type": "object", "properties": {"a": {"minLength": 3}}},
            "Unsupported JSON Schema structure",
        ),
        (
            {"type": "object", "properties": {"d": {"type": "string", "pattern": "^[0-9]+"}}},
            "cannot build the token index",
        ),
    ],
)
def test_schemas_outlines_cannot_compile_raise_clearly(backend, schema, message):
    with pytest.raises(GrammarCompileError, match=message):
        backend.compile(GrammarSpec.json_schema(schema))


def test_no_false_alarms():
    """Keywords outlines-core does enforce, annotations, data that looks like keywords, unreferenced
    definitions and draft-7 ``$ref`` siblings (ignored by the spec itself) are not reported."""
    schema = {
        "$schema": DRAFT7,
        "title": "t",
        "definitions": {"unused": {"type": "integer", "minimum": 3}, "s": {"type": "string", "maxLength": 4}},
        "type": "object",
        "properties": {
            "minimum": {"type": "string", "enum": ["a", "b"], "description": "a property named minimum"},
            "tags": {"type": "array", "items": {"$ref": "#/definitions/s"}, "minItems": 1, "maxItems": 3},
            "kind": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
            "choice": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
            "ref": {"$ref": "#/definitions/s", "maxLength": 2},
            "when": {"type": "string", "format": "date-time", "examples": ["x"]},
            "any": {},
            "c": {"const": 5, "type": "integer"},
            "map": {"type": "object", "additionalProperties": INT, "minProperties": 1},
        },
        "required": ["minimum", "tags"],
        "additionalProperties": False,
    }
    assert find_ignored_keywords(schema) == ([], [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_schema(schema, strict=True) == []


def test_validate_instance():
    schema = {"type": "object", "properties": {"a": INT}, "required": ["a"]}
    assert validate_instance('{"a": 1}', schema)
    assert not validate_instance('{"a": "1"}', schema)
    assert not validate_instance('{"a": 1', schema)  # parse error
    assert not validate_instance('{"a": NaN}', {"type": "object"})  # not JSON
    assert not validate_instance("", schema)


def test_any_value_subschemas_compile_correctly(backend):
    """outlines-core expands a nested ``{}`` into an unparenthesised alternation that splits the whole
    regex (its raw grammar takes the unclosed ``{"foo":true`` as complete) and refuses annotation-only
    schemas; normalize_schema spells both as an anyOf over the JSON types."""
    from outlines_core.json_schema import build_regex_from_schema

    from grammars import normalize_schema

    schema = {
        "type": "object",
        "properties": {"foo": {}, "note": {"description": "anything"}, "bar": {"type": "string"}},
        "required": ["foo", "bar"],
    }
    without_note = {**schema, "properties": {"foo": {}, "bar": {"type": "string"}}}
    raw = backend.compile(
        GrammarSpec.regex(build_regex_from_schema(json.dumps(without_note), None))
    ).matcher()
    with pytest.raises(ValueError, match="Unsupported JSON Schema structure"):
        build_regex_from_schema(json.dumps(schema), None)
    unclosed = tiny_byte_level_tokenizer().encode('{"foo":true', add_special_tokens=False)
    assert feed(raw, unclosed) == len(unclosed) and raw.is_final()  # the upstream bug
    normalized = normalize_schema(schema)
    any_types = ("boolean", "null", "number", "string", "array", "object")
    assert normalized["properties"]["foo"] == {"anyOf": [{"type": t} for t in any_types]}
    assert normalized["properties"]["note"]["description"] == "anything"
    assert normalized["properties"]["bar"] == {"type": "string"} and normalized["required"] == ["foo", "bar"]
    g = backend.compile(GrammarSpec.json_schema(schema)).matcher()
    assert feed(g, unclosed) == len(unclosed) and not g.is_final()
    for value in ({"foo": True, "bar": "x"}, {"foo": [1, {"a": None}], "note": 2.5, "bar": ""}):
        assert validate_instance(json.dumps(value), schema)
        assert grammar_accepts(backend, schema, value), value
    assert grammar_accepts(backend, {}, [1, "a", {"b": None}])  # top level too
    assert grammar_accepts(backend, {"title": "anything"}, "x")
