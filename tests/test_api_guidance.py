"""What a new user meets first (issue 24): misnamed arguments, chat messages given to ``generate``, an
invalid regex, the unsupported-keyword warning, and selecting a request for fault injection.

Each test would have caught the rough edge it is named after: a bare ``TypeError`` for
``max_new_tokens``, "a dict prompt needs the key 'prompt_token_ids'" for a chat message, outlines-core's
"Failed to build DFA error building NFA" for ``([a-z``, the schema warning twice for one request, and a
README recipe that injects nothing on an ``LLM`` that has been used before.
"""

from __future__ import annotations

import math
import warnings

import pytest

from grammars.errors import GrammarCompileError
from sampling.params import SamplingParams
from specdec import LLM
from specdec.engine import logits_rows
from specdec.errors import InvalidRequestError

MAX_MODEL_LEN = 64


@pytest.fixture
def text_llm(tiny_text_model_dirs) -> LLM:
    """A tiny model with a (byte-level) tokenizer: string prompts and grammars."""
    return LLM(tiny_text_model_dirs["target"], max_model_len=MAX_MODEL_LEN)


def assert_idle(llm: LLM, steps_before: int) -> None:
    engine = llm.engine
    assert engine.num_steps == steps_before and not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.num_kv_blocks


# ------------------------------------------------------------------------------ misnamed arguments
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 8}, r"'max_new_tokens': use max_tokens="),
        ({"max_length": 8}, r"'max_length': use max_tokens="),
        ({"do_sample": False}, r"'do_sample': .*do_sample=False is temperature=0"),
        ({"temp": 0.7}, r"'temp': use temperature="),
        ({"num_beams": 4}, r"'num_beams': beam search is its own call: llm\.beam_search\(.*beam_width"),
        ({"num_return_sequences": 2}, r"'num_return_sequences': use n="),
        ({"temprature": 0.7}, r"'temprature'; did you mean 'temperature'\?"),
        ({"stop_token_id": [3]}, r"'stop_token_id'; did you mean 'stop_token_ids'\?"),
        ({"frobnicate": 1}, r"'frobnicate'; its keyword arguments are .*max_tokens"),
    ],
)
def test_sampling_params_misnamed_argument_says_what_to_write(kwargs, match):
    with pytest.raises(TypeError, match=r"^SamplingParams\(\) got an unexpected keyword argument " + match):
        SamplingParams(**kwargs)


def test_sampling_params_keeps_its_signature_and_values():
    import dataclasses
    import inspect

    assert list(inspect.signature(SamplingParams).parameters)[:2] == ["temperature", "top_k"]
    p = SamplingParams(0.5, max_tokens=3)
    assert (p.temperature, p.max_tokens) == (0.5, 3)
    assert dataclasses.replace(p, n=2).n == 2
    with pytest.raises(InvalidRequestError, match="max_tokens"):  # bad values still raise as before
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_model_length": 64}, r"'max_model_length': use max_model_len="),
        ({"torch_dtype": "bfloat16"}, r"'torch_dtype': use dtype="),
        ({"trust_remote_code": True}, r"'trust_remote_code': specdec never runs a model's own code"),
        ({"num_speculative_tokens": 4}, r"'num_speculative_tokens': use speculative_config="),
        ({"max_num_seq": 4}, r"'max_num_seq'; did you mean 'max_num_seqs'\?"),
    ],
)
def test_llm_misnamed_argument_says_what_to_write(tmp_path, kwargs, match):
    # Raised before the model is even looked up: the directory does not exist.
    with pytest.raises(TypeError, match=r"^LLM\(\) got an unexpected keyword argument " + match):
        LLM(tmp_path / "no-model", **kwargs)


@pytest.mark.parametrize(
    "prompts",
    [
        {"role": "user", "content": "hi"},
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    ],
    ids=["one-message", "messages-as-prompts"],
)
def test_chat_messages_given_to_generate_point_to_chat(text_llm, prompts):
    steps = text_llm.engine.num_steps
    with pytest.raises(InvalidRequestError, match=r"chat message .*use llm\.chat\(messages"):
        text_llm.generate(prompts, SamplingParams(max_tokens=4))
    assert_idle(text_llm, steps)


def test_conversations_given_to_generate_point_to_chat(text_llm):
    steps = text_llm.engine.num_steps
    with pytest.raises(InvalidRequestError, match=r"a conversation .*use llm\.chat\(conversations"):
        text_llm.generate([[{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=4))
    with pytest.raises(
        InvalidRequestError, match="needs the key 'prompt_token_ids'"
    ):  # other dicts: as before
        text_llm.generate({"ids": [1, 2]}, SamplingParams(max_tokens=4))
    assert_idle(text_llm, steps)


# -------------------------------------------------------------------------------------- invalid regex
@pytest.mark.parametrize(
    ("regex", "match"),
    [
        (
            "([a-z",
            r"the regex '\(\[a-z' is not a valid regular expression: unterminated character set at "
            r"position 1 \('\[a-z'\)",
        ),
        ("(a", r"missing \), unterminated subpattern at position 0"),
        ("a{3,2}", r"min repeat greater than max repeat at position 2"),
        ("a(?=b)", r"valid Python but not in the regex syntax outlines-core compiles .*look-around"),
    ],
)
def test_invalid_regex_names_position_and_cause(text_llm, regex, match):
    steps = text_llm.engine.num_steps
    with pytest.raises(GrammarCompileError, match=match) as info:
        text_llm.generate("a", SamplingParams(max_tokens=4, regex=regex))
    if regex != "a(?=b)":
        assert "NFA" not in str(info.value)  # not the grammar engine's internal message
    assert_idle(text_llm, steps)


def test_invalid_regex_through_the_engine_api_names_position(text_llm):
    text_llm._grammar_backend()
    req = text_llm.engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=4, regex="([a-z"))
    while text_llm.engine.has_unfinished_requests():
        text_llm.engine.step()
    assert req.finish_reason == "error"
    assert req.error is not None and "unterminated character set at position 1" in req.error


def test_rust_only_regex_syntax_is_not_judged_by_python_re(text_llm):
    """``(?<name>...)`` and ``\\p{L}`` are invalid for Python's ``re`` (3.11) but valid for outlines-core:
    they must still work."""
    import re

    for regex in (r"(?<word>[a-z]+)", r"\p{L}+"):
        with pytest.raises(re.error):
            re.compile(regex)
    (out,) = text_llm.generate("a", SamplingParams(temperature=0, max_tokens=4, regex=r"(?<word>[a-z]+)"))
    assert out.outputs[0].error is None and out.outputs[0].text.isalpha()
    (out,) = text_llm.generate("a", SamplingParams(temperature=0, max_tokens=4, regex=r"\p{L}+"))
    assert out.outputs[0].error is None and out.outputs[0].token_ids


# ---------------------------------------------------------------------- unsupported-keyword warning
# uniqueItems: neither llguidance nor outlines-core enforces it, so every backend warns
SCHEMA = {
    "type": "object",
    "properties": {"ages": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
}


def schema_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "does not enforce" in str(w.message)]


def test_unsupported_schema_keyword_warns_once_per_request(text_llm):
    # The issue's call, through llm.chat: give the tiny tokenizer a chat template.
    text_llm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    params = SamplingParams(max_tokens=12, json_schema=SCHEMA)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        text_llm.chat([{"role": "user", "content": "age?"}], params)
    found = schema_warnings(record)
    assert len(found) == 1, found
    assert "uniqueItems" in found[0] and "llguidance" in found[0]

    # n samples are one request: one warning; two prompts are two requests: one each.
    for prompts, sp, want in (
        ("age?", SamplingParams(max_tokens=12, json_schema=SCHEMA, n=3, seed=1), 1),
        (["age?", "how old?"], params, 2),
    ):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            text_llm.generate(prompts, sp)
        assert len(schema_warnings(record)) == want, (prompts, schema_warnings(record))


def test_engine_api_still_warns_for_its_own_requests(text_llm):
    text_llm._grammar_backend()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        text_llm.engine.add_request("direct", [5, 6, 7], SamplingParams(max_tokens=4, json_schema=SCHEMA))
    assert len(schema_warnings(record)) == 1
    text_llm.engine.abort_request("direct")


# ------------------------------------------------------------------- fault injection across calls
def nan_for(llm: LLM, prompt: str):
    """The README's recipe: select the request by its prompt, not by a request id."""
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)

    def inject(scheduled, logits):
        rows = logits_rows(scheduled)
        for s in scheduled:
            if s.request.prompt_token_ids == ids and s.request.request_id in rows:
                logits[list(rows[s.request.request_id])] = math.nan

    return inject


def nan_for_id(request_id: str):
    """The README's former recipe: select by request id "1"."""

    def inject(scheduled, logits):
        rows = logits_rows(scheduled).get(request_id)
        if rows is not None:
            logits[list(rows)] = math.nan

    return inject


def test_fault_injection_by_prompt_hits_every_call(text_llm):
    prompts = ["Name a river.", "Name a mountain.", "Name a sea."]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text_llm.engine.fault_injector = nan_for(text_llm, prompts[1])
    for call in range(2):  # the second call on the same LLM is hit as well
        outs = text_llm.generate(prompts, params)
        assert [o.request_id for o in outs] == [str(3 * call + i) for i in range(3)]
        assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"], call
        assert outs[1].outputs[0].error is not None and "non-finite logits" in outs[1].outputs[0].error

    # Negative control: selecting request "1" misses once the LLM has been used.
    text_llm.engine.fault_injector = nan_for_id("1")
    outs = text_llm.generate(prompts, params)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
