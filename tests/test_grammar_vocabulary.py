"""Token bytes from tokenizers (grammars/vocabulary.py) and grammars over the real SmolLM2 tokenizer:
instances tokenised by the real tokenizer are accepted token by token, masks agree with acceptance,
special tokens and the padded vocabulary tail are masked, EOS is allowed exactly in final states."""

from __future__ import annotations

import json

import pytest
import torch

from grammars import (
    GrammarCompileError,
    GrammarSpec,
    OutlinesBackend,
    allocate_token_bitmask,
    check_schema,
    is_token_allowed,
    tokenizer_fingerprint,
    tokenizer_vocabulary,
    unpack_bitmask,
    validate_instance,
)
from grammars.vocabulary import bytes_to_unicode
from tests.test_grammar_helpers import (
    allowed_ids,
    feed,
    tiny_byte_level_tokenizer,
    tiny_sentencepiece_tokenizer,
)

PAD = 64  # model vocabulary = tokenizer vocabulary + PAD padded ids


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# ---------------------------------------------------------------------------------------- no model
def test_bytes_to_unicode_is_gpt2s_map():
    m = bytes_to_unicode()
    assert len(m) == 256 and len(set(m.values())) == 256
    assert (m[0x20], m[0x0A], m[0x21], m[0xC3], m[0x00], m[0xAD]) == ("Ġ", "Ċ", "!", "Ã", "Ā", "Ń")


def test_tiny_byte_level_vocabulary():
    tok = tiny_byte_level_tokenizer()
    v = tokenizer_vocabulary(tok)
    assert v.decoding == "byte_level" and v.size == len(tok) and v.eos_token_ids == (0,)
    assert v.token_bytes[0] is None and v.token_bytes[1] is None  # special
    assert v.special_ids == frozenset({0, 1})
    assert [v.token_bytes[2 + b] for b in (0x00, 0x20, 0x0A, 0xC3)] == [b"\x00", b" ", b"\n", b"\xc3"]
    merged = {tok.convert_ids_to_tokens(i): v.token_bytes[i] for i in range(258, len(tok))}
    assert merged == {"Ġw": b" w", "ab": b"ab", "12": b"12", "Ã©": "é".encode(), "Ġwo": b" wo",
                      "Ġa": b" a", "Ġab": b" ab"}  # fmt: skip
    token_map = v.outlines_token_map()
    assert token_map[b" wo"] == [tok.convert_tokens_to_ids("Ġwo")] and b"" not in token_map


def test_tiny_sentencepiece_vocabulary():
    tok = tiny_sentencepiece_tokenizer()
    v = tokenizer_vocabulary(tok)
    assert v.decoding == "sentencepiece" and v.eos_token_ids == (2,)
    assert v.token_bytes[:3] == (None, None, None)
    assert (
        v.token_bytes[3] == b"\x00" and v.token_bytes[3 + 0xE4] == b"\xe4" and v.token_bytes[258] == b"\xff"
    )
    assert v.token_bytes[259:] == (b" ", b"a", b"b", b" a", "é".encode(), b" hello")


@pytest.mark.parametrize("name", ["outlines", "llguidance", "xgrammar"])
def test_sentencepiece_grammar_accepts_byte_fallback_and_spaces(name):
    """'a é中' through '▁a'-style tokens and <0xNN> byte tokens for 中."""
    from grammars.registry import make_grammar_backend

    tok = tiny_sentencepiece_tokenizer()
    if name == "outlines":
        backend = OutlinesBackend(tok, len(tok), compile_in_subprocess=False)
    else:
        backend = make_grammar_backend(name, tok, len(tok))
    with backend:
        g = backend.compile(GrammarSpec.regex("(a|b)( [a-zé中]+)+")).matcher()
    ids = [260, 262, *[3 + b for b in b" "], 263, *[3 + b for b in "中".encode()]]  # a, ▁a, ' ', é, 中
    assert feed(g, ids) == len(ids) and g.is_final()
    assert not any(g.accept_token(t) for t in (0, 1))  # <unk>, <s>: special
    assert g.accept_token(2) and g.is_terminated()


def test_fingerprint_depends_on_vocab_and_eos():
    tok = tiny_byte_level_tokenizer()
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(tok)
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(tok, eos_token_ids=[0, 1])
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(tiny_sentencepiece_tokenizer())


def test_vocabulary_requires_an_eos():
    class NoEos:
        eos_token_id = None

    with pytest.raises(ValueError, match="eos"):
        tokenizer_vocabulary(NoEos())


# ------------------------------------------------------------------------------------- real SmolLM2
@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from specdec.zoo import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="module", params=["outlines", "llguidance", "xgrammar"])
def smol_backend(request, smol_tokenizer):
    """Each backend over the real tokenizer, the model vocabulary padded by ``PAD`` ids."""
    from grammars.registry import make_grammar_backend

    with make_grammar_backend(request.param, smol_tokenizer, len(smol_tokenizer) + PAD) as backend:
        yield backend


def accept_text(backend, tokenizer, spec: GrammarSpec, text: str):
    """A fresh matcher fed ``text`` as the real tokenizer splits it (masks checked at every step)."""
    g = backend.compile(spec).matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    n = feed(g, ids)
    return g, ids, n


@pytest.mark.real_model
def test_smollm2_vocabulary_bytes_match_the_tokenizers_decoder(smol_tokenizer):
    """Every ordinary token's bytes, decoded as UTF-8, equal the tokenizer's own decoding of the token
    (tokens that are parts of a multi-byte character decode to U+FFFD on both sides)."""
    v = tokenizer_vocabulary(smol_tokenizer)
    assert v.decoding == "byte_level" and v.size == 49152 == len(smol_tokenizer)
    assert v.eos_token_ids == (smol_tokenizer.eos_token_id,) == (2,)
    assert v.special_ids == frozenset(range(17))  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>...
    assert all(v.token_bytes[i] is None for i in range(17))
    ids = [i for i in range(v.size) if v.token_bytes[i] is not None]
    assert len(ids) == 49152 - 17
    decoded = smol_tokenizer.backend_tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    mismatches = [i for i, d in zip(ids, decoded) if v.token_bytes[i].decode("utf-8", errors="replace") != d]
    assert mismatches == []
    tok = smol_tokenizer.convert_tokens_to_ids
    assert v.token_bytes[tok("Ġ")] == b" " and v.token_bytes[tok("Ċ")] == b"\n"
    assert v.token_bytes[tok("ä¸Ń")] == "中".encode()
    assert v.token_bytes[tok("ĠðŁĺ")] == b" \xf0\x9f\x98"  # first 3 bytes of an emoji, after a space


@pytest.mark.real_model
def test_space_prefixed_tokens(smol_backend, smol_tokenizer):
    """A pattern that needs spaces is generated through SmolLM2's 'Ġword' tokens."""
    spec = GrammarSpec.json_schema(
        {
            "type": "object",
            "properties": {"title": {"type": "string", "pattern": "^[A-Za-z]+( [A-Za-z]+)+$"}},
            "required": ["title"],
        }
    )
    text = compact({"title": "Hello brave new world"})
    g, ids, n = accept_text(smol_backend, smol_tokenizer, spec, text)
    tokens = smol_tokenizer.convert_ids_to_tokens(ids)
    assert "Ġbrave" in tokens and "Ġworld" in tokens
    assert n == len(ids) and g.is_final()
    # the same state after "Hello" allows " brave" as one token, and forbids a newline
    g2 = smol_backend.compile(spec).matcher()
    head = smol_tokenizer.encode('{"title":"Hello', add_special_tokens=False)
    assert feed(g2, head) == len(head)
    allowed = set(allowed_ids(g2).tolist())
    assert smol_tokenizer.convert_tokens_to_ids("Ġbrave") in allowed
    assert smol_tokenizer.convert_tokens_to_ids("Ċ") not in allowed


@pytest.mark.real_model
def test_multibyte_characters_inside_strings(smol_backend, smol_tokenizer):
    """é, 中 and an emoji (split across tokens mid-character by SmolLM2) inside JSON strings."""
    spec = GrammarSpec.json_schema(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "notes": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "notes"],
        }
    )
    value = {"name": "Zoë café", "notes": ["中文 text", "party 😀🎉", "é"]}
    text = compact(value)
    g, ids, n = accept_text(smol_backend, smol_tokenizer, spec, text)
    assert n == len(ids) and g.is_final()
    pieces = [smol_tokenizer.convert_ids_to_tokens(i) for i in ids]
    assert "ĠðŁĺ" in pieces  # an emoji split mid-character: the grammar accepted partial UTF-8
    # before the last token no prefix is final
    g.rollback(1)
    assert not g.is_final()


@pytest.mark.real_model
def test_recursive_ref(smol_backend, smol_tokenizer):
    schema = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["value"],
            }
        },
        "$ref": "#/$defs/node",
    }
    instance = {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}, {"value": -4}]}
    assert validate_instance(compact(instance), schema)
    spec = GrammarSpec.json_schema(schema)
    if smol_backend.name == "outlines":  # it would unroll three levels deep: refused (issue 20)
        with pytest.raises(GrammarCompileError, match=r"\$ref at #/\$defs/node/properties/children/items"):
            smol_backend.compile(spec)
        with pytest.raises(GrammarCompileError, match="recursive"):
            check_schema(schema, strict=False)
        return
    compiled = smol_backend.compile(spec)  # llguidance, xgrammar: a grammar rule, enforced at any depth
    assert compiled.ignored_keywords == ()
    deep: dict = {"value": 0}
    for depth in range(1, 8):
        deep = {"value": depth, "children": [deep]}
    g, ids, n = accept_text(smol_backend, smol_tokenizer, spec, compact(deep))
    assert n == len(ids) and g.is_final()
    g, ids, n = accept_text(smol_backend, smol_tokenizer, spec, compact(instance))
    assert n == len(ids) and g.is_final()
    bad = compact({"value": 1, "children": [{"children": []}]})  # inner node misses "value"
    g, ids, n = accept_text(smol_backend, smol_tokenizer, spec, bad)
    assert n < len(ids)


@pytest.mark.real_model
def test_enum_with_non_ascii_values(smol_backend, smol_tokenizer):
    spec = GrammarSpec.json_schema({"enum": ["café", "東京", "🙂 ok", 3]})
    for value in ["café", "東京", "🙂 ok", 3]:
        g, ids, n = accept_text(smol_backend, smol_tokenizer, spec, compact(value))
        assert n == len(ids) and g.is_final(), value
    for value in ["cafe", "東", "🙂", 4]:
        g, ids, n = accept_text(smol_backend, smol_tokenizer, spec, compact(value))
        assert n < len(ids) or not g.is_final(), value


@pytest.mark.real_model
def test_pattern(smol_backend, smol_tokenizer):
    spec = GrammarSpec.json_schema({"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"})
    g, ids, n = accept_text(smol_backend, smol_tokenizer, spec, '"AB-123"')
    assert n == len(ids) and g.is_final()
    g, ids, n = accept_text(smol_backend, smol_tokenizer, spec, '"AB-12')
    assert n == len(ids) and not g.is_final()  # a prefix: accepted so far, not complete
    assert not g.accept_token(smol_tokenizer.convert_tokens_to_ids('"'))  # closing it now is wrong
    g, ids, n = accept_text(smol_backend, smol_tokenizer, spec, '"ab-123"')
    assert n == 1  # the opening quote only


@pytest.mark.real_model
def test_special_tokens_masked_and_eos_only_in_final_states(smol_backend, smol_tokenizer):
    """Walking a valid instance: at every step the special tokens (ids 0-16) are masked except EOS, and
    EOS is allowed exactly when the matcher is final (only at the end for an object)."""
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"},
                                    "s": {"type": "string"}}, "required": ["n"]})  # fmt: skip
    g = smol_backend.compile(spec).matcher()
    ids = smol_tokenizer.encode(compact({"n": 42, "s": "x y"}), add_special_tokens=False)
    eos = smol_tokenizer.eos_token_id
    bm = allocate_token_bitmask(1, smol_backend.vocab_size)
    finals = []
    for t in [*ids, None]:
        g.fill_bitmask(bm, 0)
        allowed = unpack_bitmask(bm, smol_backend.vocab_size)[0]
        assert not allowed[[i for i in range(17) if i != eos]].any()
        assert bool(allowed[eos]) == g.is_final()
        finals.append(g.is_final())
        if t is None:
            break
        before = g.num_accepted_tokens
        if not g.is_final():
            assert not g.accept_token(eos) and g.num_accepted_tokens == before and not g.is_terminated()
        assert g.accept_token(t)
    assert finals == [False] * len(ids) + [True]
    assert g.accept_token(eos) and g.is_terminated() and g.is_final()
    g.fill_bitmask(bm, 0)
    assert unpack_bitmask(bm, smol_backend.vocab_size)[0].nonzero().flatten().tolist() == [eos]
    assert not g.accept_token(ids[0])
    g.rollback(1)
    assert not g.is_terminated() and g.is_final()


@pytest.mark.real_model
def test_padded_vocabulary_rows_masked(smol_backend, smol_tokenizer):
    """The model vocabulary is 64 ids larger than the tokenizer's: those ids are never allowed, even by
    the most permissive grammar, and padding bits stay zero."""
    spec = GrammarSpec.json_schema({"type": "string"})
    g = smol_backend.compile(spec).matcher()
    assert g.accept_token(smol_tokenizer.convert_tokens_to_ids('"'))
    bm = allocate_token_bitmask(2, smol_backend.vocab_size)
    g.fill_bitmask(bm, 1)
    allowed = unpack_bitmask(bm, smol_backend.vocab_size)
    assert allowed[0].all()  # row 0 untouched
    assert allowed[1, :49152].sum() > 40000  # inside a string almost every token is fine
    assert not allowed[1, 49152:].any()
    for t in (49152, 49152 + PAD - 1, -1, smol_backend.vocab_size):
        assert not g.accept_token(t)
    if smol_backend.name == "outlines":
        assert not g.accept_token(smol_backend.sentinel_token_id)
        assert smol_backend.sentinel_token_id >= smol_backend.vocab_size


@pytest.mark.real_model
def test_mask_agrees_with_accept_on_every_token(smol_backend, smol_tokenizer):
    """In three states, accept_token succeeds exactly for the tokens the mask allows (all 49216 ids)."""
    spec = GrammarSpec.json_schema(
        {"type": "object", "properties": {"k": {"type": "number"}}, "required": ["k"]}
    )
    for prefix in ["", '{"k":', '{"k":1']:
        g = smol_backend.compile(spec).matcher()
        head = smol_tokenizer.encode(prefix, add_special_tokens=False)
        assert feed(g, head) == len(head)
        bm = allocate_token_bitmask(1, smol_backend.vocab_size)
        g.fill_bitmask(bm, 0)
        mask = unpack_bitmask(bm, smol_backend.vocab_size)[0]
        accepted = torch.zeros_like(mask)
        for t in range(smol_backend.vocab_size):
            if g.accept_token(t):
                accepted[t] = True
                g.rollback(1)
        assert torch.equal(mask, accepted), prefix
        assert 0 < int(mask.sum()) < 49152
        assert is_token_allowed(bm, 0, smol_tokenizer.convert_tokens_to_ids("{")) == (prefix == "")
