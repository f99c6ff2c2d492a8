"""Matcher state under speculation: any sequence of accept / validate / rollback leaves the matcher
exactly where a fresh matcher fed the still-accepted tokens would be (same mask, same finality)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grammars import GrammarSpec, OutlinesBackend, allocate_token_bitmask
from grammars.llguidance_backend import LLGuidanceBackend
from grammars.xgrammar_backend import XGrammarBackend
from tests.test_grammar_helpers import allowed_ids, tiny_byte_level_tokenizer

PAD = 5
REGEX = "(ab|12)+( wo)*|é+"


@pytest.fixture(scope="module", params=["outlines", "llguidance", "xgrammar"])
def compiled(request):
    tok = tiny_byte_level_tokenizer()
    if request.param == "outlines":
        backend = OutlinesBackend(tok, len(tok) + PAD, compile_in_subprocess=False)
    elif request.param == "llguidance":
        backend = LLGuidanceBackend(tok, len(tok) + PAD)
    else:
        backend = XGrammarBackend(tok, len(tok) + PAD)
    yield backend.compile(GrammarSpec.regex(REGEX))
    backend.close()


def snapshot(grammar) -> tuple[list[int], bool, bool, int]:
    bm = allocate_token_bitmask(1, grammar.compiled.vocab_size)
    grammar.fill_bitmask(bm, 0)
    return bm[0].tolist(), grammar.is_final(), grammar.is_terminated(), grammar.num_accepted_tokens


def test_rollback_errors(compiled):
    g = compiled.matcher()
    with pytest.raises(ValueError, match="1 tokens: 0 accepted"):
        g.rollback(1)
    with pytest.raises(ValueError):
        g.rollback(-1)
    tok = tiny_byte_level_tokenizer()
    ab = tok.convert_tokens_to_ids("ab")
    assert g.accept_token(ab) and g.accept_token(ab)
    before = snapshot(g)
    with pytest.raises(ValueError):
        g.rollback(3)
    assert snapshot(g) == before
    g.rollback(0)
    assert snapshot(g) == before
    g.rollback(2)
    assert snapshot(g) == snapshot(compiled.matcher())


def test_validate_does_not_move(compiled):
    tok = tiny_byte_level_tokenizer()
    ab, one, two, wo = (tok.convert_tokens_to_ids(t) for t in ("ab", "1", "2", "Ġwo"))
    g = compiled.matcher()
    fresh = snapshot(g)
    assert g.validate_tokens([ab, one, two, wo, wo, 0]) == 6  # EOS (id 0) after a complete match
    assert g.validate_tokens([ab, one, one]) == 2
    assert g.validate_tokens([wo]) == 0
    assert g.validate_tokens([]) == 0
    assert g.validate_tokens([ab, 0, 0, ab]) == 3  # EOS stays acceptable once terminated, nothing else
    assert snapshot(g) == fresh


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_property_random_accept_validate_rollback(compiled, data):
    """Random operations; after each, the matcher equals a fresh matcher fed the accepted tokens."""
    vocab = compiled.vocab_size
    g = compiled.matcher()
    accepted: list[int] = []
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        op = data.draw(st.sampled_from(["accept", "accept", "validate", "rollback"]), label="op")
        if op == "accept":
            allowed = allowed_ids(g).tolist()
            if allowed and data.draw(st.booleans(), label="pick allowed"):
                t = data.draw(st.sampled_from(allowed), label="token")
            else:
                t = data.draw(st.integers(-2, vocab + 1), label="any token")
            ok = g.accept_token(t)
            assert ok == (t in allowed)
            if ok:
                accepted.append(t)
        elif op == "validate":
            tokens = data.draw(st.lists(st.integers(0, vocab - 1), max_size=6), label="tokens")
            before = snapshot(g)
            n = g.validate_tokens(tokens)
            assert snapshot(g) == before
            probe = compiled.matcher()
            for t in accepted:
                assert probe.accept_token(t)
            expected = 0
            while expected < len(tokens) and probe.accept_token(tokens[expected]):
                expected += 1
            assert n == expected
        else:
            n = data.draw(st.integers(0, len(accepted) + 1), label="rollback")
            if n > len(accepted):
                with pytest.raises(ValueError):
                    g.rollback(n)
            else:
                g.rollback(n)
                del accepted[len(accepted) - n :]
        fresh = compiled.matcher()
        for t in accepted:
            assert fresh.accept_token(t)
        assert snapshot(g) == snapshot(fresh)


def test_speculative_walk_then_rollback(compiled):
    """The verifier's pattern: walk k drafts filling one row before each, roll them back, then accept
    the committed prefix; the rows equal those of fresh matchers at each prefix."""
    tok = tiny_byte_level_tokenizer()
    drafts = [tok.convert_tokens_to_ids(t) for t in ("ab", "1", "2", "Ġwo", "Ġwo")]
    g = compiled.matcher()
    bm = allocate_token_bitmask(len(drafts) + 1, compiled.vocab_size)
    n = 0
    for i, t in enumerate(drafts):
        g.fill_bitmask(bm, i)
        if not g.accept_token(t):
            break
        n += 1
    g.fill_bitmask(bm, n)
    assert n == len(drafts)
    g.rollback(n)
    assert g.num_accepted_tokens == 0
    for i in range(n + 1):
        ref = compiled.matcher()
        for t in drafts[:i]:
            assert ref.accept_token(t)
        row = allocate_token_bitmask(1, compiled.vocab_size)
        ref.fill_bitmask(row, 0)
        assert torch.equal(bm[i], row[0]), i
    # commit 3 of them
    for t in drafts[:3]:
        assert g.accept_token(t)
    assert g.num_accepted_tokens == 3 and g.is_final()
