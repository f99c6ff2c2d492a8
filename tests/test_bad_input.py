"""Bad input through the ``LLM`` API: specific errors, raised before any work, harming nothing else.

Every rejected call must leave the engine as it was (no step run, no request pending, every KV block
free), and a good request in the same ``LLM`` afterwards must give exactly what it gives in a fresh one.
"""

from __future__ import annotations

import math
import shutil

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
    ("top_k", -2, r"top_k must be an integer >= -1 \(0 or -1: off\), got -2"),
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
    ("n", 0, r"n must be an integer >= 1, got 0"),
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
