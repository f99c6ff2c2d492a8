"""Self-synthesised training prompts (Magpie, ``experiments/train/synth.py``): the pre-query template,
which requests are kept, the sampling rounds and their cache, and how they join the training prompts."""

from __future__ import annotations

import json

import pytest

from experiments.config import TrainDataConfig
from experiments.instruct import FRESH_CHAT
from experiments.train import synth
from experiments.train.prompts import is_heldout, split_heldout, training_prompts
from experiments.train.synth import (
    SynthSettings,
    keep_request,
    normalise,
    sample_rounds,
    select_requests,
    six_word_sequences,
    synthesize_prompts,
    template_parts,
)

MODEL = "smollm2-135m-instruct"


def fake_generator(texts_per_seed):
    """A stand-in for the engine: seed s gives ``texts_per_seed(s)`` (text, ended) samples; records the
    seeds asked for."""
    asked = []

    def make(model, settings, dtype, device):
        def generate(seeds):
            asked.extend(seeds)
            return [sample for s in seeds for sample in texts_per_seed(s)]

        return generate

    return make, asked


@pytest.mark.real_model
def test_template_parts_are_the_chat_template_around_a_user_message():
    from experiments.run import load_tokenizer

    tokenizer = load_tokenizer(MODEL)
    prefix, end_of_turn = template_parts(tokenizer)
    assert tokenizer.decode(prefix) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\n"
    )
    assert tokenizer.convert_ids_to_tokens(end_of_turn) == "<|im_end|>"
    whole = tokenizer(
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    )
    assert whole["input_ids"][: len(prefix)] == prefix


class _MergingTokenizer:
    """A template whose prefix ends in a space, and a tokenizer that merges it with the next word."""

    all_special_ids = (0,)

    def apply_chat_template(self, messages, tokenize, add_generation_prompt=False):
        text = "[INST] " + messages[0]["content"] + "</s>"
        return [1, 5, 0] if tokenize else text

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [1, 4]}  # "[INST]", " "; rendered with a message, " Hello" is one token


def test_template_parts_refuse_a_prefix_that_merges_with_the_message():
    with pytest.raises(ValueError, match="depend on the message"):
        template_parts(_MergingTokenizer())


def test_keep_request_drops_cut_short_long_and_garbled_requests():
    s = SynthSettings(min_chars=16, max_chars=80)
    good = "Can you suggest a recipe for a quick weeknight dinner?"
    assert keep_request(good, True, s)
    assert not keep_request(good, False, s)  # cut at the token limit
    assert not keep_request("Hi there you", True, s)  # 12 characters
    assert not keep_request("Please " * 20, True, s)  # 140 characters
    assert not keep_request("Resolventякý наzeudkoinik ema negi-demonetar", True, s)  # 10 % non-ASCII
    assert not keep_request("1234567890 !!!!!! ??????", True, s)  # one word
    assert not keep_request("Supercalifragilistic expialidocious!", True, s)  # two words
    assert keep_request("Supercalifragilistic expialidocious now!", True, s)  # three
    assert keep_request("Is café au lait stronger than coffee? " + "x" * 22, True, s)  # 1 of 60 non-ASCII
    assert not keep_request("Is café au lait stronger than coffee?" + "é" * 2, True, s)  # 3 of 40
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
    # a curly apostrophe is the same word as a straight one
    assert six_word_sequences("I\u2019ve got two eggs and milk") == six_word_sequences(
        "I've got two eggs and milk"
    )


@pytest.mark.real_model  # the cache key reads the model's files and tokenizer
def test_rounds_continue_from_the_cache_so_a_longer_list_starts_with_a_shorter_one(tmp_path, monkeypatch):
    settings = SynthSettings(samples_per_request=2, round_requests=3)
    # seed s: one good request, and one the model did not end (dropped)
    make, asked = fake_generator(
        lambda s: [(f"Tell me a fact about owls number {s}", True), (f"Cut {s}", False)]
    )
    monkeypatch.setattr(synth, "_generator", make)
    first = synthesize_prompts(MODEL, 4, settings, cache_dir=tmp_path)
    assert asked == [0, 1, 2, 3, 4, 5]  # two rounds of three engine requests
    assert [p.id for p in first] == [f"synth/{i}" for i in range(4)]
    assert {p.category for p in first} == {"synth"}
    assert first[2].messages == [{"role": "user", "content": "Tell me a fact about owls number 2"}]
    (cache,) = tmp_path.glob("synth-*.json")
    assert json.loads(cache.read_text())["next_seed"] == 6 and not list(tmp_path.glob("*.tmp*"))
    assert [p.text for p in synthesize_prompts(MODEL, 6, settings, cache_dir=tmp_path)] == [
        f"Tell me a fact about owls number {s}" for s in range(6)
    ]
    assert len(asked) == 6  # served from the cache: no sampling
    longer = synthesize_prompts(MODEL, 8, settings, cache_dir=tmp_path)
    assert asked == list(range(9))  # one more round, from seed 6 on
    assert [p.text for p in longer[:4]] == [p.text for p in first]
    # another dtype or other settings: another cache file
    synthesize_prompts(MODEL, 1, settings, dtype="float32", cache_dir=tmp_path)
    synthesize_prompts(
        MODEL, 1, SynthSettings(samples_per_request=2, round_requests=3, top_p=1.0), cache_dir=tmp_path
    )
    assert len(list(tmp_path.glob("synth-*.json"))) == 3
    assert synthesize_prompts(MODEL, 0, cache_dir=tmp_path) == []
    with pytest.raises(ValueError, match="count must be >= 0"):
        synthesize_prompts(MODEL, -1, cache_dir=tmp_path)
    for bad in (2.5, "3", True):  # before any sampling
        with pytest.raises(TypeError, match="count must be an int"):
            synthesize_prompts(MODEL, bad, cache_dir=tmp_path)
    assert len(asked) == 15  # one round for each of the two other cache files, none for the bad counts


def test_rounds_drop_fresh_chat_wording_and_stop_when_the_model_never_ends_a_request():
    settings = SynthSettings(samples_per_request=1, round_requests=2)
    fresh_words = " ".join(FRESH_CHAT[3].split()[:6])
    samples = []
    texts = {0: f"Please help: {fresh_words}", 1: "Which houseplants survive in a dark hallway?"}
    seed = sample_rounds(
        lambda seeds: [(texts.get(s, f"Question {s} about tea kettles"), True) for s in seeds],
        2,
        settings,
        samples,
        0,
    )
    assert seed == 4 and synth._select(samples, settings) == [
        "Which houseplants survive in a dark hallway?",
        "Question 2 about tea kettles",
        "Question 3 about tea kettles",
    ]
    never = []
    with pytest.raises(ValueError, match="only 0 of 3 requests kept from 62 samples"):
        sample_rounds(
            lambda seeds: [("Unfinished request text", False) for _ in seeds], 3, settings, never, 0
        )


@pytest.mark.real_model
def test_synthesised_prompts_join_the_training_prompts_last_and_split_by_id(tmp_path, monkeypatch):
    make, _ = fake_generator(lambda s: [(f"Tell me fact {s} about owls", True)])
    monkeypatch.setattr(synth, "_generator", make)
    base = TrainDataConfig(builtin_limit=5, chat_limit=5, cache_dir=str(tmp_path))
    with_synth = TrainDataConfig(builtin_limit=5, chat_limit=5, cache_dir=str(tmp_path), synth_prompts=40)
    plain = training_prompts(base)
    prompts = training_prompts(with_synth, MODEL)
    assert [p.id for p in prompts[: len(plain)]] == [p.id for p in plain]
    assert [p.id for p in prompts[len(plain) :]] == [f"synth/{i}" for i in range(40)]
    flags = split_heldout(prompts, 0.1)
    assert flags == [is_heldout(p.id, 0.1) for p in prompts]  # by each id's hash, no fallback
    assert 0 < sum(flags[len(plain) :]) < 40  # self-written prompts are held out like any other
    with pytest.raises(ValueError, match="needs the model"):
        training_prompts(with_synth)


@pytest.mark.real_model
@pytest.mark.slow
def test_synthesize_prompts_with_the_model_is_deterministic_and_keeps_only_good_requests(tmp_path):
    # float32: the sampled text does not depend on the CPU's bfloat16 kernels. A handful of requests.
    s = SynthSettings(max_tokens=48, samples_per_request=6, round_requests=1)
    a = synthesize_prompts(MODEL, 3, s, dtype="float32", cache_dir=tmp_path / "a")
    b = synthesize_prompts(MODEL, 6, s, dtype="float32", cache_dir=tmp_path / "b")
    assert [p.text for p in b[:3]] == [p.text for p in a]  # the same samples, whatever the count
    assert len({normalise(p.text) for p in b}) == 6
    assert all(keep_request(p.text, True, s) for p in b)
    assert not any("<|im_" in p.text or p.text.lower().startswith("assistant") for p in b)
    (cache,) = (tmp_path / "b").glob("synth-*.json")
    samples = json.loads(cache.read_text())["samples"]
    assert len(samples) % 6 == 0  # whole rounds, the dropped samples recorded too
