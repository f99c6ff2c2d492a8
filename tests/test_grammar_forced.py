"""The tokens a grammar forces (:func:`specdec.structured.forced_tokens`, issue 20), per backend, on the
tiny byte-level tokenizer: a single allowed token, the longest of a prefix chain (``a`` / ``ab``), the
spacing the request's own text used after the same byte, a stop at a real choice and where EOS is
allowed; the matcher is left where it was. Their exactness in decoding is proven by
``tests/test_structured_distribution.py`` (forced drafts)."""

from __future__ import annotations

import pytest

from grammars import GrammarSpec, OutlinesBackend, allocate_token_bitmask
from grammars.registry import make_grammar_backend
from specdec.structured import forced_tokens
from tests.test_grammar_helpers import tiny_byte_level_tokenizer

PAD = 5
EOS = 0


@pytest.fixture(scope="module", params=["outlines", "llguidance", "xgrammar"])
def backend(request):
    tok = tiny_byte_level_tokenizer()
    if request.param == "outlines":
        b = OutlinesBackend(tok, len(tok) + PAD, compile_in_subprocess=False)
    else:
        pytest.importorskip(request.param)
        b = make_grammar_backend(request.param, tok, len(tok) + PAD)
    yield b
    b.close()


def ids(*pieces: str) -> list[int]:
    return tiny_byte_level_tokenizer().convert_tokens_to_ids(list(pieces))


def snapshot(g) -> tuple[list[int], int]:
    bm = allocate_token_bitmask(1, g.compiled.vocab_size)
    g.fill_bitmask(bm, 0)
    return bm[0].tolist(), g.num_accepted_tokens


def forced(backend, regex: str, fed: list[int], max_tokens: int = 8) -> list[int]:
    g = backend.compile(GrammarSpec.regex(regex)).matcher()
    for t in fed:
        assert g.accept_token(t)
    before = snapshot(g)
    out = forced_tokens(g, max_tokens, g.compiled.vocab_size, [EOS], fed)
    assert snapshot(g) == before
    return out


def test_single_tokens_and_prefix_chains(backend):
    x, a, ab, c, y, z = ids("x", "a", "ab", "c", "y", "z")
    assert forced(backend, "xabc", []) == [x, ab, c]  # "a" and "ab" allowed after x: the longest
    assert forced(backend, "xabc", [], max_tokens=2) == [x, ab]
    assert forced(backend, "xabc", [x, a]) == ids("b", "c")
    assert forced(backend, "x(ab|12)yz", []) == [x]  # a, ab, 1, 12: a real choice
    assert forced(backend, "x(ab|12)yz", [x, ab]) == [y, z]  # then EOS is allowed: the walk stops
    assert forced(backend, "x(ab|12)yz", [x, ab, y, z]) == []


def test_optional_space_follows_the_requests_own_spacing(backend):
    regex = "ab,( ?ab,)*( ?ab;)"
    spaced = ids("ab", ",", "Ġab", ",")
    tight = ids("ab", ",", "ab", ",")
    assert forced(backend, regex, spaced[:2]) == []  # no earlier "," to learn from
    assert forced(backend, regex, spaced) == ids("Ġab")  # then "," or ";": a real choice
    assert forced(backend, regex, tight) == ids("ab")


def test_config_and_registry():
    from specdec.config import SpeculativeConfig
    from specdec.drafters.registry import drafter_names
    from specdec.errors import ConfigError

    assert "grammar" in drafter_names()
    assert SpeculativeConfig(method="ngram", grammar_forced_drafts=True).grammar_forced_drafts
    with pytest.raises(ConfigError, match="grammar_forced_drafts must be a bool, got 'yes'"):
        SpeculativeConfig(method="ngram", grammar_forced_drafts="yes")
    with pytest.raises(ConfigError, match="takes no model"):
        SpeculativeConfig(method="grammar", model="smollm2-135m-instruct")
    # positions beyond k for grammar-aware drafting: k by default, only with grammar_forced_drafts
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).num_forced_draft_slots == 0
    assert (
        SpeculativeConfig(
            method="ngram", num_speculative_tokens=3, grammar_forced_drafts=True
        ).num_forced_draft_slots
        == 3
    )
    spec = SpeculativeConfig(method="ngram", grammar_forced_drafts=True, max_forced_drafts=0)
    assert spec.num_forced_draft_slots == 0
    with pytest.raises(ConfigError, match="max_forced_drafts needs grammar_forced_drafts=True"):
        SpeculativeConfig(method="ngram", max_forced_drafts=4)
    with pytest.raises(ConfigError, match="max_forced_drafts must be an integer >= 0, got -1"):
        SpeculativeConfig(method="ngram", grammar_forced_drafts=True, max_forced_drafts=-1)


def test_scheduler_reserves_forced_positions_for_constrained_requests_only():
    """k = 2 and 3 forced positions: a constrained request may draft 5 (the drafter asked for 2), an
    unconstrained one 2; near ``max_tokens`` the forced part shrinks first."""
    from sampling.params import SamplingParams
    from specdec.config import SchedulerConfig
    from specdec.kv_cache.manager import KVCacheManager
    from specdec.request import Request
    from specdec.scheduler import Scheduler

    kv = KVCacheManager(64, 4, False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, 64, 2, 2, 3)
    free = Request("free", [1, 2, 3], SamplingParams(max_tokens=20), 0, (EOS,))
    constrained = Request("json", [1, 2, 3], SamplingParams(max_tokens=20), 0, (EOS,))
    constrained.grammar = object()  # the scheduler only asks whether there is one
    short = Request("short", [1, 2, 3], SamplingParams(max_tokens=4), 0, (EOS,))
    short.grammar = object()
    # a decode step (the last token is new): (num_new_tokens, draft slots, draft depth, forced slots)
    plans = {r.request_id: sched._plan(r, 2, 64) for r in (free, constrained, short)}
    assert plans["free"] == (1, 2, 2, 0)
    assert plans["json"] == (1, 5, 5, 3)
    assert plans["short"] == (1, 5, 3, 1)  # max_tokens 4: at most 3 drafts, 2 of them the drafter's
