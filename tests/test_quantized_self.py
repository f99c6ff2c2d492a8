"""Quantized self-drafting (``method="quantized_self"``) is exact: greedy output equals plain decoding of
the full-precision target token for token, and sampled output follows the target's distribution.

The distribution test is :mod:`tests.test_spec_distribution`'s, with its helpers: the same tiny target
(vocabulary 8), the exact joint distribution of the first three tokens (512 outcomes) enumerated in
float64, 100,000 sampled requests (temperatures 0.7 / 1.0 / 1.5 mixed in each batch, seeded and unseeded,
``max_tokens`` 3 and 4, k = 2) plus greedy requests that must reproduce the argmax chain, and a
chi-square test per temperature at ``alpha = 1e-3`` (6 more tests in the suite's count, see
:mod:`tests.stats`). The drafter is the target itself quantized to int4 (group 32, symmetric) or int8
(per channel, through the project's int8 kernel where it builds), close to but not equal to the target,
so drafts are accepted and rejected. Negative controls (accept every draft;
recover from the target instead of the residual) must fail the same test at T = 1.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from sampling.params import SamplingParams
from specdec import LLM
from specdec.models.cpu_linear import GemvLinear
from specdec.policies import PolicyContext, PolicyInput, register_policy
from specdec.quantization.apply import LAYER_LINEARS
from specdec.quantization.linear import QuantizedLinear
from specdec.quantization.schemes import dequantize, quantize
from tests.conftest import SMOL_QUESTIONS, SYSTEM, first_three_logits, make_tiny_hf_model
from tests.stats import ALPHA, assert_differs
from tests.test_rejection_sampler import AcceptEverything, RecoverFromTarget
from tests.test_spec_distribution import (
    BATCH,
    NUM_CALLS,
    NUM_CONTROL_CALLS,
    NUM_GREEDY,
    PROMPT,
    TARGET_SEED,
    TEMPERATURES,
    K,
    V,
    check_all,
    exact_joint,
    sample_counts,
)

VOCAB = 128
INT4 = {"method": "int4", "group_size": 32}  # the tiny models' sizes (64, 96) take groups of 32


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    d = tmp_path_factory.mktemp("qself") / "target"
    make_tiny_hf_model("llama", 4, 2, False, vocab_size=VOCAB, seed=0).save_pretrained(d)
    return d


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    out = []
    for i in range(n):
        motif = torch.randint(3, VOCAB, (3 + i % 3,), generator=g).tolist()
        out.append((motif * 6)[: 4 + 5 * i])
    return out


def _generate(model_dir, prompts, max_tokens, spec=None, **kwargs: Any) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, skip_tokenizer_init=True, block_size=4, speculative_config=spec, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("quantization", ["int8", INT4], ids=["int8", "int4"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equality_tiny(tiny_target, quantization, batch):
    prompts = _prompts(batch)
    max_tokens = [24 + 3 * i for i in range(batch)]
    plain, _ = _generate(tiny_target, prompts, max_tokens)
    spec = {"method": "quantized_self", "quantization": quantization, "num_speculative_tokens": 3}
    got, llm = _generate(tiny_target, prompts, max_tokens, spec)
    assert got == plain
    stats = llm.engine.spec_stats
    print(f"[quantized_self] {quantization} batch {batch}: {stats.as_dict()}")
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_greedy_equality_over_a_reduced_draft_vocabulary(tiny_target):
    """``draft_vocab``: the drafter's LM head computes the even token ids' logits only and drafts none
    of the odd ones (every draft even), and the output is still plain decoding's."""
    prompts = _prompts(3)
    max_tokens = [24, 27, 30]
    plain, _ = _generate(tiny_target, prompts, max_tokens)
    even = list(range(0, VOCAB, 2))
    spec = {
        "method": "quantized_self",
        "quantization": "int8",
        "num_speculative_tokens": 3,
        "draft_vocab": even,
    }
    llm = LLM(tiny_target, skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    drafted: list[int] = []
    propose = llm.engine.drafter.propose
    llm.engine.drafter.propose = lambda batch: [drafted.extend(p.token_ids) or p for p in propose(batch)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert drafted and all(t % 2 == 0 for t in drafted)
    assert llm.engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("case", ["int8 target", "bfloat16 drafter"])
def test_a_reduced_vocabulary_over_a_quantized_target_or_in_another_dtype(tiny_target, case):
    """``draft_vocab`` takes the rows of a quantized target's LM head (dequantized), and a drafter whose
    dtype differs from the target's casts its hidden states to the rows' dtype: output equals the
    target's plain greedy decoding either way."""
    prompts = _prompts(3)
    target = {"quantization": "int8"} if case == "int8 target" else {}
    plain, _ = _generate(tiny_target, prompts, [20, 20, 20], **target)
    spec = {
        "method": "quantized_self",
        "quantization": "int8",
        "num_speculative_tokens": 3,
        "draft_vocab": list(range(0, VOCAB, 2)),
    }
    if case == "bfloat16 drafter":
        spec["draft_dtype"] = "bfloat16"
    got, llm = _generate(tiny_target, prompts, [20, 20, 20], spec, **target)
    assert got == plain
    assert llm.engine.spec_stats.num_drafts > 0
    assert llm.engine.drafter.shares_target_kv == (case == "int8 target")


def test_greedy_equality_with_a_quantized_target_and_a_bfloat16_drafter(tiny_target):
    """The target itself int8 (the drafter re-quantizes its dequantized weights to int4, in bfloat16):
    output equals the int8 target's plain greedy decoding."""
    prompts = _prompts(3)
    plain, _ = _generate(tiny_target, prompts, [20, 20, 20], quantization="int8")
    spec = {
        "method": "quantized_self",
        "quantization": INT4,
        "num_speculative_tokens": 4,
        "draft_dtype": "bfloat16",
    }
    got, llm = _generate(tiny_target, prompts, [20, 20, 20], spec, quantization="int8")
    assert got == plain
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_the_drafter_is_the_targets_own_weights_quantized(tiny_target):
    llm = LLM(
        tiny_target,
        skip_tokenizer_init=True,
        speculative_config={"method": "quantized_self", "quantization": INT4, "num_speculative_tokens": 2},
    )
    target, draft = llm.engine.model, llm.engine.drafter.runner.model
    assert draft.embed_tokens is target.embed_tokens  # shared, not copied
    assert draft.norm is target.norm and draft.layers[0].input_layernorm is target.layers[0].input_layernorm
    assert draft.inv_freq is target.inv_freq
    for t_layer, d_layer in zip(target.layers, draft.layers):
        for name in LAYER_LINEARS:
            q = getattr(d_layer, name)
            # The target's layer stays dense (a plain linear, or the CPU GEMV kernel's, on the same weight).
            assert isinstance(q, QuantizedLinear) and isinstance(
                getattr(t_layer, name), (nn.Linear, GemvLinear)
            )
            expected = dequantize(quantize(getattr(t_layer, name).weight, "int4", 32))
            assert torch.equal(q.dequantized_weight(), expected)
    assert isinstance(draft.lm_head, QuantizedLinear)
    # No KV tensors of its own: the target's, read and written in place.
    assert draft is not target
    assert llm.engine.drafter.shares_target_kv and llm.engine.drafter.kv_bytes_per_block(16) == 0
    assert llm.engine.drafter.runner.kv_caches is llm.engine.runner.kv_caches


@register_policy("test_qself_late")
class _LatePolicy:
    """No drafts until a request has written 6 tokens, then all it may; records each draft_backlog."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.backlogs: list[tuple[int, int]] = []  # (output tokens, draft_backlog)

    def decide(self, batch: list[PolicyInput]) -> list[int]:
        self.backlogs += [(x.request.num_output_tokens, x.draft_backlog) for x in batch]
        return [x.max_drafts if x.request.num_output_tokens >= 6 else 0 for x in batch]


def test_on_the_targets_kv_the_drafter_never_catches_up(tiny_target, monkeypatch):
    """Sharing the target's K/V, the drafter has no backlog: its forwards read only each step's new
    tokens and drafts, also for requests whose prompt and first 6 tokens it never drafted on, and the
    output is plain decoding's, with most drafts accepted (the int8 copy agrees with its target). A
    bfloat16 drafter of a float32 target keeps its own K/V (different dtypes) and catches up."""
    prompts = _prompts(3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    common = dict(skip_tokenizer_init=True, block_size=4)
    base = LLM(tiny_target, **common).generate([{"prompt_token_ids": p} for p in prompts], params)
    spec = {"method": "quantized_self", "quantization": "int8", "num_speculative_tokens": 3}
    llm = LLM(tiny_target, speculative_config={**spec, "policy": "test_qself_late"}, **common)
    drafter = llm.engine.drafter
    tokens: list[int] = []  # tokens of each draft-model forward
    execute = drafter.runner.execute
    monkeypatch.setattr(
        drafter.runner, "execute", lambda inputs: tokens.append(inputs.input_ids.numel()) or execute(inputs)
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > stats.num_draft_tokens // 2
    assert tokens and max(tokens) <= len(prompts)  # one new token (then one draft) per request
    assert all(backlog == 0 for n, backlog in llm.engine.policy.backlogs if n > 0)
    own = LLM(tiny_target, speculative_config={**spec, "draft_dtype": "bfloat16"}, **common)
    assert not own.engine.drafter.shares_target_kv
    assert own.engine.drafter.runner.kv_caches is not own.engine.runner.kv_caches


def test_on_the_targets_kv_the_drafter_skips_the_prompt(tiny_target, monkeypatch):
    """On the target's K/V the drafter does not draft on the step that samples a request's first token
    (the target writes the prompt's K/V in that step; ``drafts_on_target_kv``): no draft-model forward
    reads more than one row per request, whatever the prompt's length, later steps draft, and the output is
    plain decoding's."""
    long_prompt = (_prompts(6)[-1] * 3)[:40]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(skip_tokenizer_init=True, block_size=4)
    spec = {"method": "quantized_self", "quantization": "int8", "num_speculative_tokens": 3}
    for prompt in (long_prompt, long_prompt[:6]):
        base = LLM(tiny_target, **common).generate([{"prompt_token_ids": prompt}], params)
        llm = LLM(tiny_target, speculative_config=spec, **common)
        runner = llm.engine.drafter.runner
        rows: list[int] = []  # rows of each draft-model forward
        execute = runner.execute
        monkeypatch.setattr(
            runner,
            "execute",
            lambda inputs, rows=rows, execute=execute: (
                rows.append(inputs.input_ids.numel()) or execute(inputs)
            ),
        )
        out = llm.generate([{"prompt_token_ids": prompt}], params)
        assert out[0].outputs[0].token_ids == base[0].outputs[0].token_ids
        assert max(rows) == 1
        assert llm.engine.spec_stats.num_drafts > 0


def _seeded_twice(tiny_target) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Seeded sampled requests run twice through one quantized self-drafting engine with prefix caching
    (the second run hits the cache: fewer new tokens in its first step), and once through an engine
    without prefix caching."""
    prompts = [{"prompt_token_ids": (_prompts(6)[i] * 4)[: 30 + i]} for i in range(3)]
    params = [SamplingParams(temperature=0.9, seed=40 + i, max_tokens=24, ignore_eos=True) for i in range(3)]
    spec = {"method": "quantized_self", "quantization": "int8", "num_speculative_tokens": 3}

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    cached = LLM(tiny_target, skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    first = run(cached)
    hits = cached.engine.kv.num_prefix_hits
    second = run(cached)
    assert cached.engine.kv.num_prefix_hits > hits  # the second run's prompts hit the cache
    uncached = LLM(
        tiny_target,
        skip_tokenizer_init=True,
        block_size=4,
        speculative_config=spec,
        enable_prefix_caching=False,
    )
    return first, second, run(uncached)


def test_seeded_requests_repeat_after_a_prefix_cache_hit(tiny_target):
    first, second, uncached = _seeded_twice(tiny_target)
    assert first == second == uncached


def test_negative_control_a_rule_on_the_steps_new_tokens_repeats_no_more(tiny_target, monkeypatch):
    """The rule before 2026-12-06 (draft when the step brings at most 16 new tokens): the prefix-cache hit
    of the second run lets its first step draft, and the seeded requests draw other tokens."""
    from specdec.drafters import draft_model

    monkeypatch.setattr(draft_model, "drafts_on_target_kv", lambda x: x.num_new_tokens <= 16)
    first, second, _ = _seeded_twice(tiny_target)
    assert first != second


def test_quantized_self_config_errors(tiny_target):
    from specdec.config import SpeculativeConfig
    from specdec.errors import ConfigError

    with pytest.raises(ConfigError, match="needs quantization"):
        SpeculativeConfig(method="quantized_self")
    with pytest.raises(ConfigError, match="own weights"):
        SpeculativeConfig(method="quantized_self", quantization="int4", model="x")
    with pytest.raises(ConfigError, match=r"applies to method 'quantized_self' or .* only"):
        SpeculativeConfig(method="ngram", quantization="int4")
    with pytest.raises(ConfigError, match="quantization method must be one of"):
        SpeculativeConfig(method="quantized_self", quantization="int3")
    with pytest.raises(ConfigError, match="group sizes that fit"):  # group 64 does not divide 96
        LLM(
            tiny_target,
            skip_tokenizer_init=True,
            speculative_config={"method": "quantized_self", "quantization": "int4"},
        )


# ---------------------------------------------------------------------------------- real SmolLM2
def test_greedy_equality_smollm2(smollm2_dir):
    """The float32 target with an int4 (group 32, zero point) drafter in bfloat16: output equals plain
    float32 greedy decoding on two chat prompts. Measured here (k = 4): 96 % of drafts accepted, τ 4.8
    (the group-32 zero-point grid is the checkpoint's own Q4_1 grid, see tests/test_quantized_quality.py)."""
    from transformers import AutoTokenizer

    from specdec.llm import chat_token_ids

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [
        chat_token_ids(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in SMOL_QUESTIONS[:2]
    ]
    sp = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(smollm2_dir, skip_tokenizer_init=True).generate(
        [{"prompt_token_ids": p} for p in prompts], sp
    )
    spec = {
        "method": "quantized_self",
        "quantization": {"method": "int4", "group_size": 32, "zero_point": True},
        "num_speculative_tokens": 4,
        "draft_dtype": "bfloat16",
    }
    llm = LLM(smollm2_dir, skip_tokenizer_init=True, speculative_config=spec)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.spec_stats
    print(f"[quantized_self smollm2] {stats.as_dict()}")
    assert stats.mean_acceptance_length > 1.5  # drafts are mostly accepted (a weak floor, not a figure)


# ---------------------------------------------------------------------------------- distribution


@pytest.fixture(scope="module")
def dist_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qself_dist")
    target = make_tiny_hf_model("llama", 4, 2, False, vocab_size=V, seed=TARGET_SEED)
    target.save_pretrained(root / "target", safe_serialization=True)
    logits = first_three_logits(target, PROMPT, V)
    exact = {t: exact_joint(logits, t) for t in TEMPERATURES}
    l1, l2, l3 = logits
    a = int(l1.argmax())
    b = int(l2[a].argmax())
    c = int(l3[a, b].argmax())
    return {"target": root / "target", "exact": exact, "greedy": [a, b, c]}


#: The drafters of the distribution tests: int4 (torch's kernels) and int8 (this project's int8 kernel,
#: kernels/csrc/cpu_gemv_int8.cpp, where it builds: its drafts come from int16-quantized activations);
#: "int4-v6" drafts from 6 of the 8 tokens only (``draft_vocab``: probability 0 for tokens 6 and 7).
DIST_QUANTIZATIONS = {"int4": INT4, "int8": "int8", "int4-v6": INT4}
DIST_DRAFT_VOCAB = {"int4-v6": [0, 1, 2, 3, 4, 5]}


def _dist_llm(setup, quantization: str) -> LLM:
    n = BATCH + NUM_GREEDY
    spec = {
        "method": "quantized_self",
        "quantization": DIST_QUANTIZATIONS[quantization],
        "num_speculative_tokens": K,
    }
    if quantization in DIST_DRAFT_VOCAB:
        spec["draft_vocab"] = DIST_DRAFT_VOCAB[quantization]
    return LLM(
        setup["target"],
        skip_tokenizer_init=True,
        speculative_config=spec,
        seed=4321,
        block_size=4,
        num_kv_blocks=4 * n + 16,
        max_model_len=32,
        max_num_seqs=n,
        max_num_batched_tokens=n * (len(PROMPT) + K + 1),
    )


@pytest.mark.usefixtures("fast_cpu_settings")
@pytest.mark.parametrize("quantization", list(DIST_QUANTIZATIONS))
def test_output_distribution_matches_target(dist_setup, quantization):
    llm = _dist_llm(dist_setup, quantization)
    if quantization == "int8":  # the draft model's linears take the int8 kernel where it builds
        from kernels import cpu_gemv_int8

        layer = llm.engine.drafter.runner.model.layers[0].qkv_proj
        assert layer.int8_kernel == cpu_gemv_int8.available()
    counts = sample_counts(llm, NUM_CALLS, seed_base=7 * 10**6, greedy_chain=dist_setup["greedy"])
    assert sum(int(c.sum()) for c in counts.values()) == NUM_CALLS * BATCH
    check_all(dist_setup, counts, f"quantized_self {quantization}")
    stats = llm.engine.spec_stats
    print(f"[spec] quantized_self: {stats.as_dict()}")
    assert stats.num_drafts > NUM_CALLS * BATCH // 4
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rejected drafts
    assert stats.num_draft_tokens > stats.num_drafts and stats.accepted_per_position[1] > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.usefixtures("fast_cpu_settings")
@pytest.mark.parametrize("control", [AcceptEverything, RecoverFromTarget])
def test_negative_controls_fail_the_same_test(dist_setup, control):
    """With the int4 drafter only: the int8 one is so close to the target that accepting every draft is
    nearly exact (observed p = 0.86 at 5,000 samples), so a control there shows nothing about the test.
    Recovering from the target errs only where a draft is rejected, rarer since the drafter reads the
    target's K/V (p = 1.5e-4 at 5,000 samples): it gets twice the samples."""
    llm = _dist_llm(dist_setup, "int4")
    llm.engine.verifier = control()
    calls = NUM_CONTROL_CALLS * (2 if control is RecoverFromTarget else 1)
    counts = sample_counts(llm, calls, seed_base=9 * 10**6, temperatures=(1.0,))
    res = assert_differs(dist_setup["exact"][1.0], counts[1.0], label=f"control {control.__name__}, T=1.0")
    assert res.pvalue < ALPHA * 1e-3


@pytest.mark.parametrize("shares", [True, False], ids=["shared KV", "own KV"])
def test_a_failing_drafter_on_the_targets_kv_scrubs_its_requests_blocks(tiny_target, shares):
    """A drafter that writes the target's KV may leave non-finite K/V there when it fails: the engine
    ends the request with its private blocks zeroed (``fail(..., scrub_kv=True)``, whose effect
    tests/test_faults.py proves); a drafter with its own KV leaves the target's cache as the target wrote
    it, so nothing is scrubbed."""
    spec = {"method": "quantized_self", "quantization": "int8", "num_speculative_tokens": 2}
    if not shares:
        spec["draft_dtype"] = "bfloat16"
    llm = LLM(tiny_target, skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    engine = llm.engine
    assert engine.drafter.shares_target_kv == shares
    scrubbed: list[bool] = []
    fail = engine.fail
    engine.fail = lambda req, message, scrub_kv=False: (
        scrubbed.append(scrub_kv) or fail(req, message, scrub_kv)
    )

    def broken(batch):
        raise RuntimeError("drafter broke")

    engine.drafter.propose = broken
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": _prompts(1)[0]}], params)[0].outputs[0]
    assert out.finish_reason == "error" and "drafter broke" in (out.error or "")
    assert scrubbed == [shares]
    assert engine.kv.num_free_blocks == engine.num_kv_blocks
