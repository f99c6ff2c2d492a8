"""Property tests of the public API (hypothesis): whatever goes in, what comes out is either a result or a
``SpecdecError`` with a message, never an IndexError, a RuntimeError, a NumPy or torch error, nor a hang.

Inputs: prompts (strings with any code point, lone surrogates included; token id lists with ids in and
out of the vocabulary, floats, bools, huge ints; malformed dicts and junk), ``SamplingParams`` built from
random subsets of its fields with values in and out of range, grammars (random JSON schemas, regexes and
choices), ``BeamSearchParams``, speculative configurations and engine arguments.

Properties checked on success: one output per prompt, every request finished, "error" outputs carry a
message; the engine is idle and every KV block free afterwards. Valid speculative and engine
configurations give the greedy output of plain decoding with a default engine (speculation is exact;
pool size, block size, budget and prefix caching change nothing).

Reproducible: a fixed hypothesis profile (``derandomize=True``, no example database), small example
counts, and a 30 s alarm per example (a hang fails the test instead of stalling CI).
"""

from __future__ import annotations

import json
import math
import signal
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sampling.beam_search import BeamSearchParams
from sampling.params import SamplingParams
from specdec import LLM
from specdec.errors import SpecdecError

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MAX_MODEL_LEN = 48
VOCAB = 265  # the tiny text models' vocabulary
HANG_S = 30


class Hang(BaseException):
    """Raised by the alarm: an example ran past ``HANG_S`` seconds."""


@contextmanager
def no_hang(seconds: int = HANG_S) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def call(fn, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``, or the SpecdecError it raised (anything else fails the test)."""
    with no_hang():
        try:
            return fn(*args, **kwargs)
        except SpecdecError as e:
            assert str(e).strip(), f"{type(e).__name__} without a message"
            return e


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.requests == {}
    assert engine.kv.num_free_blocks == engine.num_kv_blocks
    engine.kv.pool.check_invariants()


@pytest.fixture(scope="module", autouse=True)
def _one_thread(fast_cpu_settings):
    yield


@pytest.fixture(scope="module")
def text_llm(tiny_text_model_dirs) -> LLM:
    llm = LLM(tiny_text_model_dirs["target"], max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=64)
    llm._grammar_backend().compile_timeout_s = 10.0
    return llm


# ------------------------------------------------------------------------------------------ strategies
def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy, p_invalid: int = 2) -> st.SearchStrategy:
    """``valid`` most of the time, ``invalid`` about ``p_invalid`` times in 10."""
    return st.integers(0, 9).flatmap(lambda i: invalid if i < p_invalid else valid)


junk = st.sampled_from([None, 5, 2.5, b"bytes", [], {}, object(), "x", math.nan, -1, True])
good_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
token_ids = mostly(
    good_ids,
    st.lists(
        st.one_of(
            st.integers(-5, VOCAB + 5), st.sampled_from([10**20, -(10**20), 1.0, 7.5, True, "3", None])
        ),
        max_size=60,
    ),
)
text = mostly(
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=40),
    st.one_of(
        st.text(st.characters(codec="utf-8"), max_size=10).map(lambda s: s + "\udcff"),  # a lone surrogate
        st.sampled_from(["", " ", "\x00", "a" * 200, "ünïcödé ✓ 🙂"]),
    ),
)
prompt = mostly(
    st.one_of(text, token_ids.map(lambda ids: {"prompt_token_ids": ids})),
    st.one_of(
        st.builds(lambda k, v: {k: v}, st.sampled_from(["prompt_token_ids", "prompt", "tokens"]), junk), junk
    ),
)
prompts = st.one_of(prompt, st.lists(prompt, min_size=0, max_size=3))

FIELD_VALUES: dict[str, st.SearchStrategy] = {
    "temperature": mostly(st.floats(0, 3), st.sampled_from([-1.0, math.inf, math.nan, 1e-30, 1e30, "1"])),
    "top_k": mostly(st.integers(-1, 300), st.sampled_from([-3, 10**30, 2.0])),
    "top_p": mostly(st.floats(0.01, 1), st.sampled_from([0.0, 1.2, math.nan, -1.0])),
    "min_p": mostly(st.floats(0, 1), st.sampled_from([-0.5, 1.5, math.nan])),
    "repetition_penalty": mostly(st.floats(0.1, 3), st.sampled_from([1e-300, 1e300, -1.0, 0.0, math.inf])),
    "presence_penalty": mostly(st.floats(0, 2), st.floats(-1, 3)),
    "frequency_penalty": mostly(st.floats(0, 2), st.floats(-1, 3)),
    "seed": mostly(st.one_of(st.none(), st.integers(0, 2**63)), st.integers(-(2**64), 2**65)),
    "max_tokens": mostly(st.integers(1, 12), st.sampled_from([-2, 0, 10**12, 0.5, None])),
    "min_tokens": mostly(st.integers(0, 3), st.integers(-2, 14)),
    "stop_token_ids": mostly(
        st.lists(st.integers(0, VOCAB - 1), max_size=3),
        st.one_of(st.lists(st.integers(-3, VOCAB + 3), max_size=3), junk),
    ),
    "stop": mostly(
        st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=3), max_size=3)), st.one_of(text, junk)
    ),
    "ignore_eos": mostly(st.booleans(), junk),
    "logprobs": mostly(st.one_of(st.none(), st.integers(0, 5)), st.integers(-2, 25)),
    "n": mostly(st.integers(1, 3), st.sampled_from([0, -1, 10**9])),
    "regex": mostly(
        st.sampled_from(["[a-z]{1,8}", "(yes|no)", "a+b?", "[0-9]{2}"]),
        st.one_of(st.sampled_from(["(", "[", "x{2,1}", ""]), text),
    ),
    "choice": mostly(
        st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3),
        st.one_of(st.lists(text, max_size=3), junk),
    ),
    "strict": mostly(st.booleans(), junk),
}
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(-5, 5), st.text(max_size=5)),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
SCHEMA_KEYS = ["type", "properties", "items", "enum", "const", "required", "minLength", "maxLength", "anyOf"]
schema_leaf = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(
            ["string", "integer", "number", "boolean", "null", "array", "object", "foo", 5]
        ),
        "minLength": st.integers(-1, 4),
        "maxLength": st.integers(0, 6),
        "enum": st.lists(
            st.one_of(st.integers(0, 9), st.sampled_from(["a", "b", "yes"])), min_size=1, max_size=3
        ),
        "const": st.sampled_from(["k", 1, True]),
        "minimum": st.integers(0, 5),
        "pattern": st.sampled_from(["^[a-c]+$", "[", "x*"]),
    },
)
schemas = st.recursive(
    schema_leaf,
    lambda children: st.one_of(
        st.fixed_dictionaries(
            {
                "type": st.just("object"),
                "properties": st.dictionaries(st.sampled_from("abc"), children, max_size=2),
            },
            optional={"required": st.lists(st.sampled_from("abcd"), max_size=2)},
        ),
        st.fixed_dictionaries(
            {"type": st.just("array"), "items": children}, optional={"maxItems": st.integers(0, 3)}
        ),
        st.fixed_dictionaries({"anyOf": st.lists(children, min_size=1, max_size=2)}),
        st.dictionaries(st.sampled_from(SCHEMA_KEYS), json_values, max_size=3),
    ),
    max_leaves=4,
)


@st.composite
def sampling_params(draw) -> Any:
    """A SamplingParams built from random fields (may raise when built), or junk."""
    if draw(st.integers(0, 9)) == 0:
        return draw(junk)
    names = draw(st.sets(st.sampled_from(sorted(FIELD_VALUES)), max_size=4))
    if len({"regex", "choice"} & names) > 1 and draw(st.booleans()):
        names -= {"choice"}
    kwargs = {name: draw(FIELD_VALUES[name]) for name in names}
    if "max_tokens" not in kwargs:
        kwargs["max_tokens"] = draw(st.integers(1, 8))
    grammar = draw(st.sampled_from(["none", "none", "none", "none", "schema"]))
    if grammar == "schema":
        kwargs["json_schema"] = draw(
            st.one_of(schemas, schemas.map(str), st.sampled_from(["{bad", "[]", "{}"]))
        )
    return kwargs


def build_params(spec: Any) -> Any:
    return SamplingParams(**spec) if isinstance(spec, dict) else spec


def check_outputs(outs: Any, num_prompts: int | None) -> None:
    assert isinstance(outs, list)
    if num_prompts is not None:
        assert len(outs) == num_prompts
    for o in outs:
        assert o.finished
        for c in o.outputs:
            assert c.finish_reason in ("stop", "length", "error"), c
            assert (c.finish_reason == "error") == (c.error is not None)
            if c.error is not None:
                assert c.error.strip()


# ------------------------------------------------------------------------------------------- tests
def test_generate_fails_only_with_specdec_errors(text_llm):
    seen: Counter[str] = Counter()

    @FUZZ
    @given(prompts=prompts, params=st.one_of(sampling_params(), st.lists(sampling_params(), max_size=3)))
    def run(prompts, params):
        built = call(
            lambda: [build_params(p) for p in params] if isinstance(params, list) else build_params(params)
        )
        if isinstance(built, SpecdecError):
            seen["params rejected"] += 1
            return
        outs = call(text_llm.generate, prompts, built)
        if isinstance(outs, SpecdecError):
            seen["generate rejected"] += 1
        else:
            n = (
                1
                if isinstance(prompts, (str, dict))
                else (len(prompts) if isinstance(prompts, list) else None)
            )
            check_outputs(outs, n)
            seen["generated"] += 1
            seen["tokens"] += sum(len(c.token_ids) for o in outs for c in o.outputs)
            seen["failed requests"] += sum(c.finish_reason == "error" for o in outs for c in o.outputs)
            seen["constrained"] += sum(
                isinstance(p, SamplingParams) and p.grammar_spec is not None
                for p in (built if isinstance(built, list) else [built])
            )
        assert_idle(text_llm)

    run()
    # One constrained request for certain (the fuzzed draw's constrained requests vary from run to run:
    # 0 in one CI run, 11 in others), so the grammar path is always exercised.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    outs = text_llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=16, json_schema=schema))
    check_outputs(outs, 1)
    assert outs[0].outputs[0].finish_reason != "error", outs[0].outputs[0].error
    seen["constrained"] += 1
    assert_idle(text_llm)
    print("generate fuzzing:", dict(seen))
    assert seen["params rejected"] >= 5 and seen["generate rejected"] >= 5
    assert seen["generated"] >= 5 and seen["tokens"] >= 20 and seen["constrained"] >= 1


@FUZZ
@given(
    messages=st.one_of(
        st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system", 5]), "content": text}),
            max_size=3,
        ),
        junk,
        st.lists(junk, max_size=2),
    )
)
def test_chat_fails_only_with_specdec_errors(text_llm, messages):
    text_llm.tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    )
    outs = call(text_llm.chat, messages, SamplingParams(max_tokens=3))
    if not isinstance(outs, SpecdecError):
        check_outputs(outs, None)
    assert_idle(text_llm)


@FUZZ
@given(
    prompts=st.one_of(prompt, st.lists(prompt, max_size=2)),
    kwargs=st.fixed_dictionaries(
        {
            "beam_width": st.one_of(st.integers(-1, 4), st.sampled_from([10**6, 2.0, True])),
            "max_tokens": st.one_of(st.integers(-1, 6), st.just(10**9)),
        },
        optional={
            "length_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([math.nan, math.inf])),
            "early_stopping": st.sampled_from([True, False, "never", "always", 1]),
            "num_return_sequences": st.integers(-1, 5),
            "ignore_eos": st.one_of(st.booleans(), junk),
        },
    ),
)
def test_beam_search_fails_only_with_specdec_errors(text_llm, prompts, kwargs):
    params = call(BeamSearchParams, **kwargs)
    if isinstance(params, SpecdecError):
        return
    outs = call(text_llm.beam_search, prompts, params)
    if not isinstance(outs, SpecdecError):
        for o in outs:
            assert 1 <= len(o.sequences) <= params.num_return_sequences
    assert_idle(text_llm)


def test_json_schemas_fail_only_with_specdec_errors(text_llm):
    """Random schemas (valid, invalid, unsupported by outlines-core): rejected with a SpecdecError before
    any work, or compiled and decoded; a finished output of a compiled schema is JSON text."""
    seen: Counter[str] = Counter()

    @settings(FUZZ, max_examples=60)
    @given(schema=st.one_of(schemas, schemas.map(json.dumps)), strict=st.booleans())
    def run(schema, strict):
        params = call(SamplingParams, temperature=0.0, max_tokens=24, json_schema=schema, strict=strict)
        if isinstance(params, SpecdecError):
            seen["params rejected"] += 1
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # keywords outlines-core ignores
            outs = call(text_llm.generate, ["{", "x"], params)
        if isinstance(outs, SpecdecError):
            seen["rejected"] += 1
        else:
            check_outputs(outs, 2)
            seen["decoded"] += 1
            for o in outs:
                c = o.outputs[0]
                if c.finish_reason == "stop":
                    json.loads(c.text)  # the grammar only allows JSON text
                    seen["complete JSON"] += 1
        assert_idle(text_llm)

    run()
    print("schemas:", dict(seen))
    assert seen["rejected"] >= 3 and seen["decoded"] >= 5


PROBE = [40, 41, 42, 43, 40, 41, 42, 43, 40]
PROBE_PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(tiny_text_model_dirs) -> list[int]:
    llm = LLM(tiny_text_model_dirs["target"], skip_tokenizer_init=True)
    return llm.generate({"prompt_token_ids": PROBE}, PROBE_PARAMS)[0].outputs[0].token_ids


SPEC_FIELDS = {
    "num_speculative_tokens": mostly(st.integers(1, 5), st.sampled_from([-1, 0, 17, 2.0, True, "3"])),
    "prompt_lookup_max": st.integers(-1, 6),
    "prompt_lookup_min": st.integers(-1, 3),
    "draft_dtype": mostly(st.sampled_from([None, "float32"]), st.just("int4")),
    "tree": mostly(st.none(), st.sampled_from(["static", "dynamic", "bushy"])),
    "tree_topk": st.integers(-1, 5),
    "max_tree_nodes": st.integers(-1, 70),
    "bogus_key": st.just(1),
}
SPEC_CONFIGS = st.one_of(
    junk,
    st.fixed_dictionaries({"method": st.just("ngram")}, optional=SPEC_FIELDS),
    st.fixed_dictionaries(
        {
            "method": st.just("draft_model"),
            "model": mostly(
                st.just("draft"), st.sampled_from(["draft-other-vocab", "no-such-model", "../x", "", 7])
            ),
        },
        optional=SPEC_FIELDS,
    ),
    st.fixed_dictionaries(
        {"method": st.sampled_from(["medusa", "eagle", "bogus", None, 3])},
        optional={"model": st.sampled_from(["draft", "x/y", ""]), **SPEC_FIELDS},
    ),
)


def test_speculative_configs_fail_with_specdec_errors_or_decode_exactly(tiny_text_model_dirs, plain_greedy):
    dirs = tiny_text_model_dirs
    seen: Counter[str] = Counter()

    @settings(FUZZ, max_examples=100)
    @given(spec=SPEC_CONFIGS)
    def run(spec):
        if isinstance(spec, dict) and spec.get("model") in dirs:
            spec = dict(spec, model=str(dirs[spec["model"]]))
        llm = call(LLM, dirs["target"], skip_tokenizer_init=True, speculative_config=spec)
        if isinstance(llm, SpecdecError):
            seen["rejected"] += 1
            return
        (out,) = call(llm.generate, {"prompt_token_ids": PROBE}, PROBE_PARAMS)
        assert out.outputs[0].token_ids == plain_greedy  # speculation is exact
        assert_idle(llm)
        config = llm.engine.spec_config
        seen[config.method if config is not None else "plain"] += 1

    run()
    print("speculative configs:", dict(seen))
    assert seen["rejected"] >= 10 and seen["ngram"] >= 5 and seen["draft_model"] >= 5


def test_engine_arguments_fail_with_specdec_errors_or_change_nothing(tiny_text_model_dirs, plain_greedy):
    seen: Counter[str] = Counter()

    @settings(FUZZ, max_examples=60)
    @given(
        kwargs=st.fixed_dictionaries(
            {},
            optional={
                "block_size": mostly(st.integers(1, 20), st.sampled_from([0, -1, 2.0])),
                "num_kv_blocks": mostly(st.one_of(st.none(), st.integers(1, 40)), st.sampled_from([0, -1])),
                "max_model_len": mostly(
                    st.one_of(st.none(), st.integers(2, 600)), st.sampled_from([-1, 0, 1])
                ),
                "max_num_batched_tokens": mostly(st.integers(1, 64), st.just(0)),
                "max_num_seqs": mostly(st.integers(1, 4), st.just(0)),
                "enable_prefix_caching": mostly(st.booleans(), st.just("yes")),
                "dtype": mostly(st.just("float32"), st.sampled_from(["float64", "int8", "bfloat16"])),
                "seed": mostly(st.integers(-5, 5), st.just("x")),
                "device": mostly(st.sampled_from([None, "cpu"]), st.sampled_from(["tpu", "cuda:7"])),
                "kv_cache_memory_bytes": mostly(st.integers(2**14, 2**20), st.integers(-1, 100)),
            },
        )
    )
    def run(kwargs):
        llm = call(LLM, tiny_text_model_dirs["target"], skip_tokenizer_init=True, **kwargs)
        if isinstance(llm, SpecdecError):
            seen["rejected"] += 1
            return
        out = call(llm.generate, [{"prompt_token_ids": PROBE}] * 2, PROBE_PARAMS)
        if isinstance(out, SpecdecError):
            seen["generate rejected"] += 1
            return
        if kwargs.get("dtype", "float32") == "float32":
            for o in out:
                got = o.outputs[0].token_ids
                assert got == plain_greedy[: len(got)]
                assert len(got) == min(8, llm.engine.max_model_len - len(PROBE))
            seen["compared"] += 1
        assert_idle(llm)

    run()
    print("engine arguments:", dict(seen))
    assert seen["rejected"] >= 10 and seen["generate rejected"] >= 1 and seen["compared"] >= 10
