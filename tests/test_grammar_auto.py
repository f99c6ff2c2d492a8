"""Grammar backends by name (grammars/registry.py) and ``"auto"``'s choice per spec
(grammars/auto_backend.py), on the tiny byte-level tokenizer: which member it picks and why, the
errors for unknown names and for specs no member takes, and strict mode."""

from __future__ import annotations

import warnings

import pytest

from grammars import GrammarCompileError, GrammarSpec, UnsupportedSchemaError
from grammars.base import CompiledGrammar, Grammar, GrammarBackend
from grammars.registry import GRAMMAR_BACKENDS, check_grammar_backend, make_grammar_backend
from specdec.errors import ConfigError
from tests.test_grammar_helpers import tiny_byte_level_tokenizer

BOUNDS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"]}
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


@pytest.fixture(scope="module")
def tok():
    return tiny_byte_level_tokenizer()


@pytest.fixture(scope="module")
def auto(tok):
    with make_grammar_backend("auto", tok, len(tok) + 3) as backend:
        yield backend


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(
        ConfigError,
        match=r"grammar_backend must be one of \['auto', 'llguidance', 'outlines', 'xgrammar'\]",
    ):
        check_grammar_backend("xgrammer")
    assert set(GRAMMAR_BACKENDS) == {"auto", "llguidance", "outlines", "xgrammar"}


@pytest.mark.parametrize("package", ["llguidance", "xgrammar"])
def test_missing_package_is_named(monkeypatch, tok, package):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == package else real(name))
    with pytest.raises(ConfigError, match=rf"needs the '{package}' package.*pip install {package}"):
        check_grammar_backend(package)
    # "auto" leaves the missing member out
    with make_grammar_backend("auto", tok, len(tok)) as auto:
        assert package not in auto.members and "outlines" in auto.members


def test_llm_rejects_an_unknown_backend_before_loading(tmp_path):
    from specdec import LLM

    with pytest.raises(ConfigError, match="grammar_backend must be one of"):
        LLM(tmp_path / "no-model-here", grammar_backend="lark")


@pytest.mark.parametrize("name", ["auto", "llguidance", "outlines", "xgrammar"])
def test_every_backend_meets_the_protocols(tok, name):
    with make_grammar_backend(name, tok, len(tok)) as backend:
        assert isinstance(backend, GrammarBackend) and backend.name == name
        compiled = backend.compile(GrammarSpec.regex("(ab)+"))
        assert isinstance(compiled, CompiledGrammar) and isinstance(compiled.matcher(), Grammar)


def test_auto_picks_the_member_that_enforces_more(auto):
    # outlines-core ignores minimum, llguidance and xgrammar enforce it: llguidance (first of the
    # tie), nothing ignored, no warning
    spec = GrammarSpec.json_schema(BOUNDS)
    # llguidance enforces everything: nobody after it is asked (compile time), unless complete
    assert auto.candidates(spec) == [("llguidance", [])]
    assert auto.candidates(spec, complete=True) == [
        ("llguidance", []),
        ("xgrammar", []),
        ("outlines", ["minimum at #/properties/n (numeric bounds are not enforced)"]),
    ]
    assert auto.candidates(spec) == auto.candidates(spec, complete=True)  # the complete list is kept
    compiled = auto.compile(spec)
    assert compiled.backend == "llguidance" and compiled.ignored_keywords == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert auto.check_schema(BOUNDS, strict=True) == []


def test_auto_prefers_the_first_member_on_a_tie_and_reports_what_it_ignores(auto):
    # all ignore uniqueItems: one finding each, so the first member (llguidance) wins
    spec = GrammarSpec.json_schema(UNIQUE)
    candidates = auto.candidates(spec)
    assert [name for name, _ in candidates] == ["llguidance", "xgrammar", "outlines"]
    assert all(len(found) == 1 and "uniqueItems" in found[0] for _, found in candidates)
    with pytest.warns(UserWarning, match=r"llguidance \(the best grammar backend for this schema\) does not"):
        auto.check_schema(UNIQUE, strict=False)
    with pytest.raises(UnsupportedSchemaError, match="uniqueItems"):
        auto.check_schema(UNIQUE, strict=True)


def test_auto_falls_back_when_the_preferred_member_refuses(tok):
    """A member refusing the schema is not a candidate: outlines-core compiles this ``allOf`` of two
    object schemas wrongly (refused always), so the other member takes it."""

    def only_outlines_then_llguidance(name):
        return make_grammar_backend(name, tok, len(tok))

    from grammars.auto_backend import AutoBackend

    schema = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ]
    }
    with AutoBackend(only_outlines_then_llguidance, ("outlines", "llguidance")) as backend:
        spec = GrammarSpec.json_schema(schema)
        assert [name for name, _ in backend.candidates(spec)] == ["llguidance"]
        assert backend.compile(spec).backend == "llguidance"


def test_a_spec_no_member_compiles_gives_every_reason(auto):
    # look-ahead: neither outlines-core's nor llguidance's regex engine has it
    with pytest.raises(GrammarCompileError) as info:
        auto.compile(GrammarSpec.regex("(?=a)ab"))
    message = str(info.value)
    assert message.startswith("no grammar backend compiles this spec")
    assert "llguidance: GrammarCompileError" in message and "look-around" in message
    assert "xgrammar: GrammarCompileError" in message
    assert "outlines: GrammarCompileError" in message


def test_strict_auto_keeps_only_members_that_enforce_everything(tok):
    with make_grammar_backend("auto", tok, len(tok), strict_schema=True) as strict:
        assert strict.compile(GrammarSpec.json_schema(BOUNDS)).backend == "llguidance"
        with pytest.raises(UnsupportedSchemaError, match="no grammar backend compiles this spec"):
            strict.compile(GrammarSpec.json_schema(UNIQUE))


@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_strict_refuses_what_the_backend_does_not_implement(tok, name):
    with (
        make_grammar_backend(name, tok, len(tok), strict_schema=True) as strict,
        pytest.raises(UnsupportedSchemaError, match=r"uniqueItems"),
    ):
        strict.compile(GrammarSpec.json_schema(UNIQUE))
    with make_grammar_backend(name, tok, len(tok)) as lenient:
        compiled = lenient.compile(GrammarSpec.json_schema(UNIQUE))
        assert any("uniqueItems" in k for k in compiled.ignored_keywords)


@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_recursive_schema_with_a_required_property_is_enforced(tok, name):
    """The issue's bug: outlines-core cut a recursive ``$ref`` with a required property and emitted
    ``{ "name": ..., }``. llguidance and xgrammar keep the recursion a grammar rule: no such cut
    exists, and every complete walk is valid JSON (checked by walking the shortest instances of depth
    1-5)."""
    import json

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["name", "children"],
        "additionalProperties": False,
    }
    with make_grammar_backend(name, tok, len(tok)) as backend:
        compiled = backend.compile(GrammarSpec.json_schema(schema))
        assert compiled.ignored_keywords == ()
        value: dict = {"name": "a", "children": []}
        for _ in range(5):
            text = json.dumps(value, separators=(",", ":"))
            ids = tok.encode(text, add_special_tokens=False)
            g = compiled.matcher()
            assert g.validate_tokens(ids) == len(ids) and all(g.accept_token(t) for t in ids) and g.is_final()
            g = compiled.matcher()
            cut = tok.encode(text.replace(',"children":[]', ""), add_special_tokens=False)
            fed = g.validate_tokens(cut)
            assert fed < len(cut) or not all(g.accept_token(t) for t in cut) or not g.is_final()
            value = {"name": "b", "children": [value]}


@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("extra", [-3, 0, 5])
def test_rows_fit_the_model_vocabulary(tok, extra, name):
    """Model vocabularies narrower than the tokenizer (llguidance: rows cut and AND-ed with ours),
    equal, and padded (rows written in place; xgrammar sets the padding bits, which are cleared): in
    each, the mask allows exactly the tokens ``accept_token`` takes, and no bit at or past
    ``vocab_size``."""
    import torch

    from grammars import allocate_token_bitmask, unpack_bitmask

    vocab_size = len(tok) + extra
    with make_grammar_backend(name, tok, vocab_size) as backend:
        g = backend.compile(GrammarSpec.regex("[a-z ]+")).matcher()
        bitmask = allocate_token_bitmask(3, vocab_size)
        g.fill_bitmask(bitmask, 1)
        allowed = unpack_bitmask(bitmask, vocab_size)[1]
        accepted = torch.zeros(vocab_size, dtype=torch.bool)
        for t in range(vocab_size):
            if g.accept_token(t):
                accepted[t] = True
                g.rollback(1)
        assert torch.equal(allowed, accepted) and int(allowed.sum()) > 0
        width = bitmask.shape[1]
        tail = [32 * (width - 1) + j for j in range(32) if 32 * (width - 1) + j >= vocab_size]
        words = bitmask[1, -1].item() & 0xFFFFFFFF
        assert all(not (words >> (t - 32 * (width - 1))) & 1 for t in tail)
        assert (bitmask[0] == -1).all() and (bitmask[2] == -1).all()  # other rows untouched


def test_auto_asks_the_later_members_when_the_first_choice_fails_to_compile(tok):
    """The first member enforces everything (so the others are not asked for findings) but its
    compilation fails: the others are ranked then, and the next one compiles."""
    from grammars.auto_backend import AutoBackend

    class Failing:
        name = "broken"

        def __init__(self, real):
            self.real = real
            self.fingerprint = real.fingerprint

        def schema_findings(self, spec):
            return []

        def compile(self, spec):
            raise GrammarCompileError("broken on purpose")

        def close(self):
            self.real.close()

    def members(name):
        real = make_grammar_backend("llguidance" if name == "first" else name, tok, len(tok))
        return Failing(real) if name == "first" else real

    with AutoBackend(members, ("first", "llguidance")) as backend:
        spec = GrammarSpec.json_schema(BOUNDS)
        assert [name for name, _ in backend.candidates(spec)] == ["first"]
        assert backend.compile(spec).backend == "llguidance"
        assert [name for name, _ in backend.candidates(spec)] == ["first", "llguidance"]
