"""Self-synthesised training prompts (Magpie, ``experiments/train/synth.py``): the pre-query template,
which requests are kept, the cache, and how they join the training prompts."""

from __future__ import annotations

import json

import pytest

from experiments.config import TrainDataConfig
from experiments.instruct import FRESH_CHAT
from experiments.train import synth
from experiments.train.prompts import split_heldout, training_prompts
from experiments.train.synth import (
    SynthSettings,
    keep_request,
    normalise,
    pre_query_ids,
    select_requests,
    synthesize_prompts,
)

MODEL = "smollm2-135m-instruct"


def test_pre_query_template_is_the_chat_template_up_to_the_user_message():
    from experiments.run import load_tokenizer

    tokenizer = load_tokenizer(MODEL)
    ids = pre_query_ids(tokenizer)
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\n"
    )
    # the template's own tokens for a whole user turn start with these ids
    whole = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=True)
    assert list(whole[: len(ids)]) == ids


def test_keep_request_drops_cut_short_long_and_garbled_requests():
    s = SynthSettings(min_chars=16, max_chars=80)
    good = "Can you suggest a recipe for a quick weeknight dinner?"
    assert keep_request(good, True, s)
    assert not keep_request(good, False, s)  # cut at the token limit
    assert not keep_request("Hi there you", True, s)  # 12 characters
    assert not keep_request("Please " * 20, True, s)  # 140 characters
    assert not keep_request("Resolventякý наzeudkoinik ema negi-demonetar", True, s)  # 10 % non-ASCII
    assert not keep_request("1234567890 !!!!!!", True, s)  # two words
    assert keep_request("  " + good + "\n", True, s)  # surrounding whitespace is stripped first


def test_select_requests_keeps_the_first_of_each_repeat_and_nothing_from_the_excluded_texts():
    s = SynthSettings()
    fresh = FRESH_CHAT[0]
    words = fresh.split()
    borrowed = "Quick question: " + " ".join(words[:6]) + " please?"  # one six-word run of an excluded text
    samples = [
        ("How do I keep basil alive on a windowsill?", True),
        ("how do I keep  basil alive on a WINDOWSILL?", True),  # a repeat: case and spacing folded
        (borrowed, True),
        ("What should I pack for a week of hiking in the rain?", False),  # not ended by the model
        ("What should I pack for a week of hiking in the rain?", True),  # kept: the cut copy was dropped
    ]
    kept = select_requests(samples, s, exclude=[fresh])
    assert kept == [
        "How do I keep basil alive on a windowsill?",
        "What should I pack for a week of hiking in the rain?",
    ]
    assert normalise(" A  b\nC ") == "a b c"


def test_synthesize_prompts_caches_every_kept_request_and_serves_prefixes(tmp_path, monkeypatch):
    calls = []

    def fake_sample(model, count, settings, dtype, device):
        calls.append(count)
        return [f"Request number {i} about something useful" for i in range(count + 3)]

    monkeypatch.setattr(synth, "_sample", fake_sample)
    first = synthesize_prompts(MODEL, 5, cache_dir=tmp_path)
    assert [p.id for p in first] == [f"synth/{i}" for i in range(5)]
    assert {p.category for p in first} == {"synth"}
    assert first[2].messages == [{"role": "user", "content": "Request number 2 about something useful"}]
    (cache,) = tmp_path.glob("synth-*.json")
    assert len(json.loads(cache.read_text())["requests"]) == 8  # all kept, not only the 5 asked for
    again = synthesize_prompts(MODEL, 8, cache_dir=tmp_path)  # served from the cache
    assert calls == [5] and [p.text for p in again[:5]] == [p.text for p in first]
    synthesize_prompts(MODEL, 9, cache_dir=tmp_path)  # more than cached: sampled again
    assert calls == [5, 9]
    other = synthesize_prompts(MODEL, 2, SynthSettings(top_p=1.0), cache_dir=tmp_path)  # other key
    assert calls == [5, 9, 2] and len(other) == 2 and len(list(tmp_path.glob("synth-*.json"))) == 2
    assert synthesize_prompts(MODEL, 0, cache_dir=tmp_path) == []
    with pytest.raises(ValueError, match="count must be >= 0"):
        synthesize_prompts(MODEL, -1, cache_dir=tmp_path)


def test_synthesised_prompts_join_the_training_prompts_last_and_split_by_id(tmp_path, monkeypatch):
    monkeypatch.setattr(
        synth,
        "_sample",
        lambda model, count, settings, dtype, device: [f"Tell me fact {i} about owls" for i in range(count)],
    )
    base = TrainDataConfig(builtin_limit=5, chat_limit=5, cache_dir=str(tmp_path))
    with_synth = TrainDataConfig(builtin_limit=5, chat_limit=5, cache_dir=str(tmp_path), synth_prompts=40)
    plain = training_prompts(base)
    prompts = training_prompts(with_synth, MODEL)
    assert [p.id for p in prompts[: len(plain)]] == [p.id for p in plain]
    assert [p.id for p in prompts[len(plain) :]] == [f"synth/{i}" for i in range(40)]
    flags = split_heldout(prompts, 0.1)
    assert flags[: len(plain)] == split_heldout(plain, 0.1)  # the other prompts keep their side
    assert 0 < sum(flags[len(plain) :]) < 40
    with pytest.raises(ValueError, match="needs the model"):
        training_prompts(with_synth)


def test_synthesize_prompts_with_the_model_is_deterministic_and_keeps_only_good_requests(tmp_path):
    # float32: the sampled text does not depend on the CPU's bfloat16 kernels. A handful of requests.
    s = SynthSettings(max_tokens=48, samples_per_request=6)
    a = synthesize_prompts(MODEL, 6, s, dtype="float32", cache_dir=tmp_path / "a")
    b = synthesize_prompts(MODEL, 6, s, dtype="float32", cache_dir=tmp_path / "b")
    assert [p.text for p in a] == [p.text for p in b]
    assert len({normalise(p.text) for p in a}) == 6
    assert all(keep_request(p.text, True, s) for p in a)
