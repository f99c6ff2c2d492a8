"""The drafter registry through the public API: a drafter defined here, registered by name, run by ``LLM``.

A tiny random Llama on disk (``tests/conftest.py``'s ``make_tiny_hf_model``), float32. The test drafter
``repeat_last`` proposes its request's last token k times (the registry's docstring example); greedy output
must equal plain decoding token for token, and the acceptance counters must equal what a replay of the plain
output says ``repeat_last`` gets accepted. Every name registered here is unregistered when its test ends
(the ``registry`` fixture), so other tests never see it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sampling.params import SamplingParams
from specdec import LLM
from specdec.config import SpeculativeConfig
from specdec.drafters import (
    DrafterBase,
    DrafterContext,
    DraftInput,
    DraftProposal,
    drafter_names,
    get_drafter,
    register_drafter,
    unregister_drafter,
)
from specdec.errors import ConfigError

VOCAB = 96
K = 3
BUILTINS = ("ngram", "draft_model", "quantized_self", "medusa", "eagle")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    from tests.conftest import make_tiny_hf_model

    root = tmp_path_factory.mktemp("drafter_registry")
    make_tiny_hf_model("llama", 4, 2, False, vocab_size=VOCAB, seed=5).save_pretrained(root)
    return root


@pytest.fixture
def registry() -> Iterator[list[str]]:
    """Names appended to the yielded list are unregistered at teardown."""
    names: list[str] = []
    yield names
    for name in names:
        unregister_drafter(name)
    assert not set(names) & set(drafter_names())


@pytest.fixture
def repeat_last(registry) -> type:
    """``repeat_last``, registered for one test."""

    @register_drafter("repeat_last")
    class RepeatLast(DrafterBase):
        """Proposes the request's last token k times (``limit``: at most that many)."""

        def __init__(self, ctx: DrafterContext, limit: int | None = None, tag: str = "") -> None:
            self.k = ctx.config.num_speculative_tokens
            self.vocab_size = ctx.vocab_size
            self.limit = limit
            self.tag = tag
            self.calls = 0

        def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
            self.calls += 1
            out = []
            for x in batch:
                n = min(self.k, x.max_drafts, self.limit if self.limit is not None else self.k)
                out.append(DraftProposal([x.request.token_ids[-1]] * n))
            return out

    registry.append("repeat_last")
    return RepeatLast


# Repetitive prompts (runs of one token), so that repeating the last token is sometimes right.
PROMPTS = [[5, 5, 5, 5], [7, 8, 9, 9, 9], [11] * 9, [20, 21, 22, 23, 24, 25, 26, 3], [40, 41, 40, 41, 41, 41]]
MAX_TOKENS = [24, 17, 30, 12, 21]


def generate(llm: LLM, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def make_llm(target_dir: Path, spec=None) -> LLM:
    return LLM(target_dir, dtype="float32", skip_tokenizer_init=True, block_size=4, speculative_config=spec)


def replay_repeat_last(prompt: list[int], output: list[int], k: int) -> tuple[int, int, int]:
    """``(draft steps, draft tokens, accepted tokens)`` that ``repeat_last`` must get on ``output`` (the
    plain greedy output, ignore_eos): at each step ``d = min(k, tokens left - 1)`` copies of the last
    committed token, accepted while they equal the next output tokens."""
    tokens = prompt + output
    m = len(output)
    steps = drafted = accepted = 0
    j = 0
    while j < m:
        d = min(k, m - j - 1)
        a = 0
        while a < d and output[j + a] == tokens[len(prompt) + j - 1]:
            a += 1
        if d:
            steps, drafted, accepted = steps + 1, drafted + d, accepted + a
        j += a + 1
    return steps, drafted, accepted


@pytest.fixture(scope="module")
def plain_output(target_dir) -> list[list[int]]:
    return generate(make_llm(target_dir))


# ------------------------------------------------------------------------------------ running a drafter
def test_registered_drafter_runs_through_llm(target_dir, repeat_last, plain_output):
    assert "repeat_last" in drafter_names()
    llm = make_llm(target_dir, {"method": "repeat_last", "num_speculative_tokens": K})
    assert isinstance(llm.engine.drafter, repeat_last)
    assert llm.engine.drafter.vocab_size == VOCAB
    got = generate(llm)
    assert got == plain_output
    expected = [replay_repeat_last(p, o, K) for p, o in zip(PROMPTS, plain_output)]
    s = llm.engine.spec_stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == tuple(map(sum, zip(*expected)))
    assert s.num_drafts > 0 and s.num_accepted_tokens > 0  # drafts were verified, some accepted
    assert llm.engine.drafter.calls > 0


def test_drafter_kwargs_reach_the_constructor(target_dir, repeat_last, plain_output):
    spec = {"method": "repeat_last", "num_speculative_tokens": K, "drafter_kwargs": {"limit": 1, "tag": "hi"}}
    llm = make_llm(target_dir, spec)
    assert (llm.engine.drafter.limit, llm.engine.drafter.tag) == (1, "hi")
    assert generate(llm) == plain_output
    s = llm.engine.spec_stats
    expected = [replay_repeat_last(p, o, 1) for p, o in zip(PROMPTS, plain_output)]  # one draft per step
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == tuple(map(sum, zip(*expected)))
    assert s.num_draft_tokens == s.num_drafts


def test_unexpected_drafter_kwargs_raise_the_constructors_error(target_dir, repeat_last):
    spec = {"method": "repeat_last", "num_speculative_tokens": K, "drafter_kwargs": {"nope": 1}}
    with pytest.raises(TypeError, match="nope"):
        make_llm(target_dir, spec)


# ---------------------------------------------------------------------------------------- config errors
def test_unknown_method_names_the_registered_ones(target_dir, repeat_last):
    with pytest.raises(ConfigError) as e:
        make_llm(target_dir, {"method": "repeat_lats", "num_speculative_tokens": K})
    for name in (*BUILTINS, "repeat_last"):
        assert repr(name) in str(e.value)
    assert "'repeat_lats'" in str(e.value)


@pytest.mark.parametrize("method", [None, 3, "", "Ngram"])
def test_method_must_be_a_registered_name(method):
    with pytest.raises(ConfigError, match="speculative method must be one of"):
        SpeculativeConfig(method=method)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_a_tree_the_drafter_does_not_declare_is_a_config_error(target_dir, repeat_last, tree):
    with pytest.raises(ConfigError, match=r"repeat_last drafts chains"):
        SpeculativeConfig(method="repeat_last", tree=tree)
    with pytest.raises(ConfigError, match=rf"tree='{tree}'"):
        make_llm(target_dir, {"method": "repeat_last", "num_speculative_tokens": K, "tree": tree})


def test_declared_trees_and_fields_are_accepted(registry):
    """Positive control of the above: what an entry declares passes validation."""

    @register_drafter("treeish", trees=(None, "dynamic"), fields=("max_tree_nodes", "prompt_lookup_max"))
    class Treeish(DrafterBase):
        def propose(self, batch):
            return [DraftProposal([]) for _ in batch]

    registry.append("treeish")
    cfg = SpeculativeConfig(method="treeish", tree="dynamic", max_tree_nodes=9, prompt_lookup_max=6)
    assert cfg.num_draft_slots == 9
    only = r"tree_topk=7 applies to method 'eagle' or 'eagle3' or 'hybrid' only"
    with pytest.raises(ConfigError, match=only):
        SpeculativeConfig(method="treeish", tree="dynamic", tree_topk=7)


def test_undeclared_fields_and_models_are_config_errors(repeat_last):
    with pytest.raises(ConfigError, match=r"prompt_lookup_max=2 applies to method 'ngram' or 'hybrid' only"):
        SpeculativeConfig(method="repeat_last", prompt_lookup_max=2)
    # a value equal to the default but of another type was set on purpose (1 is not the default True)
    with pytest.raises(ConfigError, match=r"hybrid_skip_outranked=1 applies to method 'hybrid' only"):
        SpeculativeConfig(method="repeat_last", hybrid_skip_outranked=1)
    assert SpeculativeConfig(method="repeat_last", hybrid_skip_outranked=True).hybrid_skip_outranked is True
    with pytest.raises(ConfigError, match=r"'repeat_last' takes no model"):
        SpeculativeConfig(method="repeat_last", model="some-draft")
    with pytest.raises(ConfigError, match=r"num_speculative_tokens must be an integer in \[1, 16\]"):
        SpeculativeConfig(method="repeat_last", num_speculative_tokens=0)


def test_entry_model_kind_and_check_config(registry):
    calls = []

    def check(cfg: SpeculativeConfig) -> None:
        calls.append(cfg.num_speculative_tokens)
        if cfg.num_speculative_tokens > 2:
            raise ConfigError("needs k <= 2")

    @register_drafter("needs_model", model="model", check_config=check)
    class NeedsModel(DrafterBase):
        def propose(self, batch):
            return [DraftProposal([]) for _ in batch]

    registry.append("needs_model")
    with pytest.raises(ConfigError, match="needs model="):
        SpeculativeConfig(method="needs_model", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="needs k <= 2"):
        SpeculativeConfig(method="needs_model", num_speculative_tokens=3, model="x")
    assert SpeculativeConfig(method="needs_model", num_speculative_tokens=1, model="x").model == "x"
    assert calls == [2, 3, 1]


@pytest.mark.parametrize("name", ["", "has space", "a/b", 5, None])
def test_bad_names_are_refused(name):
    with pytest.raises(ConfigError, match="drafter name"):
        register_drafter(name)


def test_bad_entry_kinds_are_refused():
    with pytest.raises(ConfigError, match="model must be"):
        register_drafter("x_bad_model", model="weights")
    with pytest.raises(ConfigError, match="trees must be among"):
        register_drafter("x_bad_tree", trees=(None, "bushy"))
    assert "x_bad_model" not in drafter_names() and "x_bad_tree" not in drafter_names()


# ---------------------------------------------------------------------------------- Protocol violations
class NoPropose:
    """Every Drafter hook but ``propose``."""

    uses_hidden_states = False

    def __init__(self, ctx: DrafterContext) -> None:
        pass

    def on_verified(self, request, num_drafts, num_accepted):
        pass

    def observe(self, request, start_position, hidden_states):
        pass

    def reset(self, request):
        pass

    def kv_bytes_per_block(self, block_size):
        return 0

    def bind_kv(self, num_blocks, block_size):
        pass


class HiddenNotABool(DrafterBase):
    uses_hidden_states = "yes"

    def __init__(self, ctx: DrafterContext) -> None:
        pass

    def propose(self, batch):
        return [DraftProposal([]) for _ in batch]


BROKEN: dict[str, tuple[Callable, list[str], list[str]]] = {
    # name: (factory, what the message must name, what it must not)
    "no_propose": (NoPropose, ["'propose'", "NoPropose"], ["on_verified", "uses_hidden_states"]),
    "hidden_not_bool": (HiddenNotABool, ["uses_hidden_states (a bool)", "HiddenNotABool"], ["'propose'"]),
    "returns_object": (
        lambda ctx: object(),
        ["'propose'", "'on_verified'", "'observe'", "'reset'", "'kv_bytes_per_block'", "'bind_kv'", "a bool"],
        [],
    ),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_protocol_violations_fail_at_llm_construction(target_dir, registry, name):
    factory, named, not_named = BROKEN[name]
    register_drafter(name)(factory)
    registry.append(name)
    with pytest.raises(ConfigError) as e:
        make_llm(target_dir, {"method": name, "num_speculative_tokens": K})
    msg = str(e.value)
    assert "does not follow the Drafter protocol" in msg and repr(name) in msg
    for part in named:
        assert part in msg
    for part in not_named:
        assert part not in msg


def test_drafterbase_subclass_without_propose_fails_at_construction(target_dir, registry):
    @register_drafter("forgot_propose")
    class ForgotPropose(DrafterBase):
        def __init__(self, ctx: DrafterContext) -> None:
            pass

    registry.append("forgot_propose")
    with pytest.raises(ConfigError, match="'propose'"):
        make_llm(target_dir, {"method": "forgot_propose", "num_speculative_tokens": K})


# -------------------------------------------------------------------------------------------- the list
def test_drafter_names_lists_the_five_builtins():
    names = drafter_names()
    assert names[:5] == BUILTINS
    assert "repeat_last" not in names
    for name in BUILTINS:
        assert get_drafter(name).name == name
    assert get_drafter("medusa").model == get_drafter("eagle").model == "heads"
    assert get_drafter("draft_model").model == "model"
    assert get_drafter("ngram").model == get_drafter("quantized_self").model == "none"
    assert "static" in get_drafter("medusa").trees and "dynamic" in get_drafter("eagle").trees


def test_unregister_ignores_unknown_names():
    before = drafter_names()
    unregister_drafter("never_registered")
    assert drafter_names() == before


_FRESH_PROCESS_REGISTRATION = """
from specdec.drafters import DrafterBase, drafter_names, get_drafter, register_drafter

@register_drafter("ngram")  # a user's own n-gram drafter, registered before any look-up
class MyNgram(DrafterBase):
    def propose(self, batch):
        return []

@register_drafter("mine")
class Mine(DrafterBase):
    def propose(self, batch):
        return []

assert get_drafter("ngram").factory is MyNgram, get_drafter("ngram").factory
names = drafter_names()
builtins = {"ngram", "draft_model", "quantized_self", "medusa", "eagle"}
assert names[-1] == "mine" and set(names[:5]) == builtins, names
"""


def test_registration_before_any_lookup_is_kept():
    """In a fresh process (the built-ins not yet loaded), a user's entry must replace a built-in of the
    same name and be listed after the built-ins, as ``register_drafter`` and ``drafter_names`` say."""
    r = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS_REGISTRATION],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
