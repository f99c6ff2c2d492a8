"""JSON-schema / regex / choice constrained decoding on the real SmolLM2 tokenizer and model: valid JSON
that ``jsonschema`` accepts, identical greedy output with and without speculation, and the request
ending rules (grammar complete -> "stop", ``max_tokens`` first -> "length" and ``schema_valid`` False)."""

from __future__ import annotations

import json
import warnings

import jsonschema
import pytest

from grammars import GrammarCompileError
from sampling.params import SamplingParams
from specdec import LLM
from specdec.errors import InvalidRequestError

pytestmark = pytest.mark.real_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "city": {"enum": ["New York", "São Paulo", "東京", "Zürich 🏔"]},
        "age": {"type": "integer"},
    },
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}
# Strings with multi-byte characters: é (2 bytes), 中 (3 bytes), an emoji (4 bytes).
GREETING = {
    "type": "object",
    "properties": {
        "greeting": {"enum": ["café", "中文", "👋 hi"]},
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["greeting", "note"],
    "additionalProperties": False,
}
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "label": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1},
            },
            # "children" optional: outlines-core 0.2.14 expands a recursive $ref three levels deep and,
            # where a *required* property is cut there, leaves a dangling comma (invalid JSON).
            "required": ["label"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
CODE = {
    "type": "object",
    "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "ok": {"type": "boolean"}},
    "required": ["sku", "ok"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "greeting": GREETING, "tree": TREE, "code": CODE}


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir, seed=0)


@pytest.fixture(scope="module", params=["outlines", "llguidance", "xgrammar"])
def backend_llm(request, smollm2_dir):
    """One LLM per grammar backend (the module's ``llm`` uses the default, ``"auto"``)."""
    return LLM(smollm2_dir, seed=0, grammar_backend=request.param)


def ask(llm: LLM, what: str) -> dict:
    from specdec.llm import chat_token_ids

    msgs = [{"role": "user", "content": f"Give one example of {what} as JSON."}]
    return {"prompt_token_ids": chat_token_ids(llm.tokenizer, msgs)}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_outputs_parse_and_validate(backend_llm, name):
    llm, schema = backend_llm, SCHEMAS[name]
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=128, json_schema=schema)
        for t, s in [(0, None), (0.8, 1)]
    ]
    if name == "tree" and llm.grammar_backend_name == "outlines":
        # outlines-core would unroll the recursion three levels deep (and can leave a dangling comma):
        # refused before any work (issue 20)
        with pytest.raises(GrammarCompileError, match="recursive"):
            llm.generate([ask(llm, name)] * 2, params)
        assert not llm.engine.has_unfinished_requests()
        return
    outs = llm.generate([ask(llm, name)] * 2, params)
    for out in outs:
        c = out.outputs[0]
        if c.finish_reason == "length":
            # llguidance and xgrammar enforce the recursion itself, so greedy decoding may nest nodes
            # until max_tokens: the text is then an unfinished instance, every token of it accepted by a
            # fresh matcher
            assert name == "tree" and llm.grammar_backend_name in ("llguidance", "xgrammar"), c.text
            grammar = llm.engine.grammar_backend.compile(params[0].grammar_spec).matcher()
            assert grammar.validate_tokens(c.token_ids) == len(c.token_ids)
            assert c.schema_valid is False
            continue
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        jsonschema.validate(value, schema)
        assert c.schema_valid is True
    if name == "person":
        cities = {json.loads(o.outputs[0].text)["city"] for o in outs}
        assert cities <= set(PERSON["properties"]["city"]["enum"])


def test_space_prefixed_tokens_are_usable(llm):
    """ "New York" needs the byte-level token for " York" (or a lone space token): the vocabulary maps
    'Ġ' back to the space byte."""
    schema = {"type": "object", "properties": {"city": {"const": "New York"}}, "required": ["city"]}
    (out,) = llm.generate(
        ask(llm, "a city"), SamplingParams(temperature=0, max_tokens=32, json_schema=schema)
    )
    c = out.outputs[0]
    assert json.loads(c.text) == {"city": "New York"} and c.schema_valid
    pieces = llm.tokenizer.convert_ids_to_tokens(c.token_ids)
    assert any(p.startswith("Ġ") and p != "Ġ" for p in pieces), pieces


def test_greedy_output_is_the_same_with_and_without_speculation_and_free_rows_are_unaffected(
    backend_llm, smollm2_dir
):
    llm, backend = backend_llm, backend_llm.grammar_backend_name
    prompts, params = [], []
    for name, schema in SCHEMAS.items():
        if name == "tree" and backend == "outlines":  # refused (recursive)
            continue
        prompts.append(ask(llm, name))
        params.append(SamplingParams(temperature=0, max_tokens=64, json_schema=schema))
    free = len(prompts)
    prompts.append(ask(llm, "a colour"))
    params.append(SamplingParams(temperature=0, max_tokens=48))  # a free row in the same batch
    prompts.append(ask(llm, "a number"))
    params.append(SamplingParams(temperature=0, max_tokens=16, regex=r"[0-9]{2,4}(\.[0-9])?"))
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    free_alone = llm.generate(prompts[free], params[free])[0].outputs[0].token_ids
    assert plain[free] == free_alone
    specs: list[dict] = [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}]
    if backend in ("outlines", "xgrammar"):  # the grammar's forced tokens alone (issue 20)
        specs.append({"method": "grammar", "num_speculative_tokens": 6})
    if backend == "llguidance":
        # the default ("auto") backend's: n-gram chains extended by the forced tokens, the draft model
        # and EAGLE-2 trees (the other backends: fewer drafters, suite time)
        specs[0]["grammar_forced_drafts"] = True
        # SmolLM2 in bfloat16 drafting for itself in float32: mostly, not always, the same argmax.
        specs.append(
            {
                "method": "draft_model",
                "model": str(smollm2_dir),
                "draft_dtype": "bfloat16",
                "num_speculative_tokens": 3,
            }
        )
        # EAGLE-2 trees: every node masked along its own path, forbidden nodes pruned (issue 20)
        specs.append(
            {
                "method": "eagle",
                "num_speculative_tokens": 4,
                "tree": "dynamic",
                "tree_topk": 3,
                "max_tree_nodes": 10,
            }
        )
    for spec in specs:
        spec_llm = LLM(smollm2_dir, speculative_config=spec, grammar_backend=backend)
        got = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
        assert got == plain, spec["method"]
        stats = spec_llm.engine.spec_stats
        assert stats.num_accepted_tokens > 0, spec["method"]
        if spec.get("tree"):  # trees were verified, not cut to their first path
            assert stats.num_draft_nodes > stats.num_draft_tokens
        if spec.get("grammar_forced_drafts") or spec["method"] == "grammar":
            assert spec_llm.engine.drafter.num_forced_drafts > 0
        if spec.get("grammar_forced_drafts"):  # and verified, accepted, beyond k (max_forced_drafts: k)
            k = spec["num_speculative_tokens"]
            assert len(stats.accepted_per_position) > k and stats.accepted_per_position[k] > 0
        assert spec_llm.engine.kv.num_free_blocks == spec_llm.engine.num_kv_blocks


def test_a_complete_grammar_ends_the_request_with_stop_and_max_tokens_gives_length(llm):
    (yes_no,) = llm.generate(
        ask(llm, "yes or no"), SamplingParams(temperature=0, max_tokens=8, choice=["yes", "no"])
    )
    c = yes_no.outputs[0]
    assert c.text in ("yes", "no") and c.finish_reason == "stop"
    assert llm.tokenizer.eos_token_id not in c.token_ids  # ended by the grammar, before any EOS
    (cut,) = llm.generate(
        ask(llm, "a person"), SamplingParams(temperature=0, max_tokens=5, json_schema=PERSON)
    )
    c = cut.outputs[0]
    assert c.finish_reason == "length" and c.schema_valid is False and len(c.token_ids) == 5


def test_ignored_keywords_warn_or_raise_in_strict_mode_and_the_output_is_validated(llm):
    # uniqueItems: no backend enforces it, so "auto" warns
    schema = {
        "type": "object",
        "properties": {
            "n": {
                "type": "array",
                "items": {"enum": [1, 2]},
                "minItems": 3,
                "maxItems": 3,
                "uniqueItems": True,
            }
        },
        "required": ["n"],
    }
    with pytest.raises(ValueError, match="uniqueItems"):
        llm.generate(ask(llm, "a list"), SamplingParams(max_tokens=16, json_schema=schema, strict=True))
    assert not llm.engine.has_unfinished_requests()
    with pytest.warns(UserWarning, match="uniqueItems"):
        (out,) = llm.generate(
            ask(llm, "a list"), SamplingParams(temperature=0, max_tokens=48, json_schema=schema)
        )
    c = out.outputs[0]
    n = json.loads(c.text)["n"]
    assert len(n) >= 3 and set(n) <= {1, 2}  # what the grammar enforces
    assert c.schema_valid is False  # three items from two values repeat one: jsonschema judges


def test_keywords_only_outlines_ignores_are_enforced_by_auto(llm):
    """The bounds outlines-core ignores (``minimum``/``maximum``) make "auto" pick llguidance, which
    enforces them: no warning, strict accepted, and every output in range."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1000, "maximum": 1005}},
        "required": ["n"],
        "additionalProperties": False,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = llm.generate(
            [ask(llm, "a number")] * 4,
            [
                SamplingParams(temperature=1.0, seed=s, max_tokens=24, json_schema=schema, strict=True)
                for s in range(4)
            ],
        )
    for out in outs:
        assert 1000 <= json.loads(out.outputs[0].text)["n"] <= 1005 and out.outputs[0].schema_valid


def test_bad_specs_raise_before_any_work(llm):
    steps = llm.engine.num_steps
    for kwargs, match in [
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"json_schema": {"type": "object"}, "regex": "a+"}, "at most one"),
        ({"choice": []}, "choice"),
        ({"regex": ""}, "regex"),
    ]:
        with pytest.raises(InvalidRequestError, match=match):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError):
        llm.generate(ask(llm, "x"), SamplingParams(max_tokens=4, regex="(unclosed"))
    assert llm.engine.num_steps == steps and not llm.engine.has_unfinished_requests()


def test_constrained_decoding_needs_a_tokenizer(smollm2_dir):
    llm = LLM(smollm2_dir, skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, regex="a+"))
