"""``LLM.with_speculation``: engines over one target in memory decode as engines with targets of their own.

- A plain engine and an EAGLE-3 engine over one target, used in turn (and a second plain engine built
  after the EAGLE-3 one, which sets the shared model's feature layers back to none): every output equals
  that of an engine with its own copy of the target, token for token, and the EAGLE-3 engine's accepted
  counts per draft position equal its twin's. Negative control: with the runners' feature layers not put
  back before their forwards, the same sequence of calls no longer matches its twin.
- The two share the weights (the same tensors), not the KV pools; the new engine takes this one's
  arguments but the speculative config and the overrides; a new target (dtype, quantization, ...) or a
  compiled one is a ``ConfigError`` naming it, before anything is built.
- Quantized self-drafting (built from the shared target's dense weights after the first engine packed
  them) equals plain greedy decoding.
"""

from __future__ import annotations

import pytest

from sampling.params import SamplingParams
from specdec import LLM
from specdec.errors import ConfigError
from specdec.model_runner import ModelRunner
from specdec.models.config import ModelArchConfig
from tests.test_eagle3 import _random_head, _save_head

VOCAB = 64
EAGLE3 = {"method": "eagle3", "num_speculative_tokens": 3}

pytestmark = pytest.mark.usefixtures("fast_cpu_settings")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.conftest import make_tiny_hf_model

    root = tmp_path_factory.mktemp("shared_target")
    make_tiny_hf_model("llama", 4, 2, False, vocab_size=VOCAB, seed=7).save_pretrained(root / "target")
    arch = ModelArchConfig.from_pretrained(root / "target")
    _save_head(
        _random_head(arch, list(range(VOCAB)), layers=(0, 1, 2), seed=3), root / "target", root / "head"
    )
    return root


def _prompts() -> list[dict]:
    return [
        {"prompt_token_ids": [(7 * i + 3 * j) % (VOCAB - 3) + 3 for j in range(5 + 6 * i)]} for i in range(3)
    ]


PARAMS = [SamplingParams(temperature=0, max_tokens=17 + 5 * i, ignore_eos=True) for i in range(3)]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS)]


@pytest.fixture
def drafts(monkeypatch) -> dict[int, list[list[int]]]:
    """Every EAGLE-3 drafter's proposals in order, by ``id`` of the drafter."""
    from specdec.drafters.eagle3 import Eagle3Drafter

    seen: dict[int, list[list[int]]] = {}
    propose = Eagle3Drafter.propose

    def recording(self, inputs):
        out = propose(self, inputs)
        seen.setdefault(id(self), []).extend(list(p.token_ids) for p in out)
        return out

    monkeypatch.setattr(Eagle3Drafter, "propose", recording)
    return seen


def _in_turn(setup, drafts) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Plain, EAGLE-3, a second plain engine built after it, then EAGLE-3 and the first plain again, all
    over one target: every call's outputs, and the EAGLE-3 engine's drafts."""
    plain = LLM(setup / "target", skip_tokenizer_init=True, block_size=4)
    eagle = plain.with_speculation(EAGLE3 | {"model": str(setup / "head")})
    outs = [_tokens(plain), _tokens(eagle)]
    second_plain = eagle.with_speculation(None)
    assert second_plain.engine.model is plain.engine.model is eagle.engine.model
    outs += [_tokens(second_plain), _tokens(eagle), _tokens(plain)]
    return outs, drafts[id(eagle.engine.drafter)]


def test_engines_over_one_target_decode_as_engines_with_their_own(setup, drafts):
    own_plain = LLM(setup / "target", skip_tokenizer_init=True, block_size=4)
    own_eagle = LLM(
        setup / "target",
        skip_tokenizer_init=True,
        block_size=4,
        speculative_config=EAGLE3 | {"model": str(setup / "head")},
    )
    plain_ref = _tokens(own_plain)
    eagle_ref = [_tokens(own_eagle), _tokens(own_eagle)]
    drafts_ref = drafts[id(own_eagle.engine.drafter)]
    assert eagle_ref[0] == plain_ref and own_eagle.engine.spec_stats.num_accepted_tokens > 0

    outs, shared_drafts = _in_turn(setup, drafts)
    assert outs == [plain_ref, eagle_ref[0], plain_ref, eagle_ref[1], plain_ref]
    assert shared_drafts == drafts_ref  # every draft, token for token


def test_negative_control_runners_that_leave_the_feature_layers_differ(setup, drafts, monkeypatch):
    monkeypatch.setattr(ModelRunner, "_own_feature_layers", lambda self: None)
    own_eagle = LLM(
        setup / "target",
        skip_tokenizer_init=True,
        block_size=4,
        speculative_config=EAGLE3 | {"model": str(setup / "head")},
    )
    _tokens(own_eagle)
    _tokens(own_eagle)
    outs, shared_drafts = _in_turn(setup, drafts)
    assert outs[1] == outs[3] == outs[0]  # outputs stay exact: only the drafts go wrong
    assert shared_drafts != drafts[id(own_eagle.engine.drafter)]


def test_the_weights_are_shared_and_the_rest_is_the_new_engines(setup):
    plain = LLM(setup / "target", skip_tokenizer_init=True, block_size=4, max_num_seqs=8, seed=3)
    ngram = plain.with_speculation({"method": "ngram", "num_speculative_tokens": 2}, max_num_seqs=2)
    a = dict(plain.engine.model.named_parameters())
    b = dict(ngram.engine.model.named_parameters())
    assert a.keys() == b.keys() and all(a[k].data_ptr() == b[k].data_ptr() for k in a)
    assert ngram.engine.runner.kv_caches[0][0].data_ptr() != plain.engine.runner.kv_caches[0][0].data_ptr()
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert ngram.init_args == {**plain.init_args, "max_num_seqs": 2, "speculative_config": spec}
    assert ngram.init_args["seed"] == 3 and ngram.engine.scheduler.config.max_num_seqs == 2
    assert plain.engine.spec_config is None and ngram.engine.spec_config.num_speculative_tokens == 2
    assert _tokens(ngram) == _tokens(plain)


@pytest.mark.parametrize(
    "override", [{"dtype": "bfloat16"}, {"quantization": "int8"}, {"model": "x"}, {"compile": True}]
)
def test_a_new_target_is_a_config_error_naming_it(setup, override):
    plain = LLM(setup / "target", skip_tokenizer_init=True, block_size=4)
    name = next(iter(override))
    with pytest.raises(ConfigError, match=f"{name} cannot change"):
        plain.with_speculation({"method": "ngram"}, **override)


def test_a_target_argument_given_its_own_value_and_a_changed_dict_are_harmless(setup):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    ngram = LLM(setup / "target", skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    spec["num_speculative_tokens"] = 3  # the caller's dict, changed after construction
    again = ngram.with_speculation(ngram.init_args["speculative_config"], dtype="float32")
    assert again.engine.spec_config.num_speculative_tokens == 2 and again.engine.model is ngram.engine.model


def test_a_compiled_target_is_not_shared(setup):
    compiled = LLM(setup / "target", skip_tokenizer_init=True, block_size=4, compile=True)
    with pytest.raises(ConfigError, match="eager target only"):
        compiled.with_speculation({"method": "ngram"})


def test_quantized_self_drafting_over_a_shared_packed_target_is_greedy_equal(setup):
    plain = LLM(setup / "target", skip_tokenizer_init=True, block_size=4, dtype="bfloat16")
    assert any(getattr(m, "packed", None) is not None for m in plain.engine.model.modules())  # packed already
    ref = _tokens(plain)
    spec = {"method": "quantized_self", "quantization": "int8", "num_speculative_tokens": 3}
    draft = plain.with_speculation(spec)
    assert draft.engine.model is plain.engine.model
    assert _tokens(draft) == ref
    assert draft.engine.spec_stats.num_drafts > 0
    assert _tokens(plain) == ref
