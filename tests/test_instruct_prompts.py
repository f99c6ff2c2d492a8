"""The instruction prompt sets (experiments/instruct.py): deterministic, stratified training prompts from
many templates, and hand-written fresh chat requests that share no wording with any training set."""

from __future__ import annotations

import re
from collections import Counter

from experiments.datasets import Prompt, load_chat
from experiments.instruct import (
    DOCUMENTS,
    FRESH_CHAT,
    INSTRUCT_CATEGORIES,
    INSTRUCT_TEMPLATES,
    PASSAGES,
    load_fresh_chat,
    load_instruct,
)

CATEGORIES = {
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
    "translation",
    "summarization",
    "qa",
    "conversation",
}


def _ngrams(text: str, n: int = 6) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower().replace("’", "'"))
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _check_shape(prompts: list[Prompt]) -> None:
    for p in prompts:
        assert isinstance(p, Prompt) and p.token_ids is None
        assert isinstance(p.messages, list) and len(p.messages) == 1
        assert set(p.messages[0]) == {"role", "content"} and p.messages[0]["role"] == "user"
        assert isinstance(p.text, str) and p.text.strip() == p.text and p.text


def test_instruct_is_deterministic_and_seed_moves_fillers_not_ids():
    a, b = load_instruct(), load_instruct()
    assert a == b
    other = load_instruct(seed=1)
    assert [p.id for p in other] == [p.id for p in a]
    assert [p.category for p in other] == [p.category for p in a]
    changed = sum(p.text != q.text for p, q in zip(a, other))
    assert 0 < changed < len(a)  # names and numbers move, passages and code stay


def test_instruct_size_ids_templates_and_categories():
    prompts = load_instruct()
    assert len(prompts) >= 600
    ids = [p.id for p in prompts]
    assert len(set(ids)) == len(ids)
    assert len({p.text for p in prompts}) == len(prompts)
    assert len(INSTRUCT_TEMPLATES) >= 60
    assert set(INSTRUCT_CATEGORIES) == CATEGORIES
    per_category = Counter(t.category for t in INSTRUCT_TEMPLATES)
    assert min(per_category.values()) >= 4
    assert {p.category for p in prompts} == CATEGORIES
    for p in prompts:
        prefix, category, index, slug = p.id.split("/")
        assert prefix == "instruct" and category == p.category and slug
        assert INSTRUCT_TEMPLATES[int(index)].category == category
    # every template is used
    assert {int(p.id.split("/")[2]) for p in prompts} == set(range(len(INSTRUCT_TEMPLATES)))


def test_instruct_prompts_are_well_formed():
    prompts = load_instruct()
    _check_shape(prompts)
    for p in prompts:
        assert len(p.text) <= 600, p.id
        assert not re.search(r"\{[a-z_0-9]+\}", p.text), p.id  # no unfilled template field
    for row in PASSAGES:
        assert 3 <= row["passage"].count(". ") + 1 <= 5, row["key"]
    assert len(PASSAGES) == 30 and len({r["key"] for r in PASSAGES}) == 30
    assert len({r["key"] for r in DOCUMENTS}) == len(DOCUMENTS)


def test_instruct_limit_is_a_stratified_prefix():
    full = load_instruct()
    first = load_instruct(limit=24)
    assert first == full[:24]
    assert len({p.category for p in first}) >= 10
    # the prefix also spreads over the templates of a category
    assert len({p.id.split("/")[2] for p in load_instruct(limit=48)}) >= 24


def test_fresh_chat_is_unique_and_shares_no_wording_with_training_sets():
    assert len(FRESH_CHAT) == 32 and len(set(FRESH_CHAT)) == 32
    fresh = load_fresh_chat()
    _check_shape(fresh)
    assert [p.text for p in fresh] == list(FRESH_CHAT)
    assert {p.category for p in fresh} == {"fresh"}
    assert len({p.id for p in fresh}) == 32 and all(
        p.id.startswith(f"fresh/{i}/") for i, p in enumerate(fresh)
    )
    assert load_fresh_chat(limit=5) == fresh[:5]
    training: set[tuple[str, ...]] = set()
    for p in load_instruct() + load_chat():
        training |= _ngrams(p.text)
    for text in FRESH_CHAT:
        shared = _ngrams(text) & training
        assert not shared, (text, sorted(shared))
    pairs = [
        (i, j) for i in range(32) for j in range(i + 1, 32) if _ngrams(FRESH_CHAT[i]) & _ngrams(FRESH_CHAT[j])
    ]
    assert not pairs
