"""The sampler stack stays exact under speculation: with top-k, top-p, min-p, all three combined,
penalties and ``min_tokens``, speculative decoding samples exactly the target's processed distribution.

Set-up as in :mod:`tests.test_spec_distribution`: a tiny random Llama with a vocabulary of 8 is the
target (another one the draft model); for one prompt the exact joint distribution of the first three
generated tokens (512 outcomes) is enumerated in float64 with transformers' own logits processors
(``RepetitionPenaltyLogitsProcessor``, ``MinNewTokensLengthLogitsProcessor``, ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``) in ``generate``'s order, plus the OpenAI
presence/frequency penalties by their definition, each position with its own prefix. The fixture checks
that no truncation decision is within float32 rounding of its threshold (float32 and float64 keep the
same tokens), so the float32 engine and the float64 reference agree on every support.

Every ``generate`` call mixes all six sampled configurations (and seeded with unseeded requests) with
greedy requests, plain and with a repetition penalty, which must reproduce their exact argmax chains: the
"batch mixing all of them with greedy rows". Each configuration gets 25,000 samples per drafter (the
negative control below is rejected with 20,000), each tested with the chi-square test of
:mod:`tests.stats` at ``alpha = 1e-3`` (12 tests in this file). With ``k = 2`` the second and third
tokens come from verification of one or two drafts, so the penalties and ``min_tokens`` of draft 2 must
see draft 1 (that is what the ``penalties`` and ``min_tokens`` rows check).

Negative control: the engine building its verification rows without the earlier drafts in the prefix
(stale penalties and ``min_tokens`` along the draft) must fail the same test.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sampling.params import SamplingParams
from sampling.processors import RowGroup
from specdec import LLM
from tests.conftest import first_three_logits, save_target_and_draft
from tests.stats import ALPHA, assert_differs, counts_of, goodness_of_fit

V = 8
EOS = 2  # the tiny models' eos_token_id
PROMPT = [3, 4, 5, 6, 7, 3, 4, 5]
K = 2
TARGET_SEED, DRAFT_SEED = 1, 2
#: Samples of each configuration per drafter: 25,000 each, to bound CI time (the draft model's 50,000
#: took 4 of the suite's 32 minutes, in 100 calls of 3,000 requests); the stale-prefix control fails
#: at 20,000 with p < 1e-6.
SAMPLES_PER_CONFIG = {"draft_model": 25_000, "ngram": 25_000}
PER_CALL = 500  # requests of each configuration per generate call

#: name -> SamplingParams fields (max_tokens 3 or 4 is added per request).
CONFIGS: dict[str, dict[str, Any]] = {
    "top_k": dict(temperature=0.8, top_k=3, ignore_eos=True),
    "top_p": dict(temperature=1.2, top_p=0.7, ignore_eos=True),
    "min_p": dict(temperature=1.0, min_p=0.2, ignore_eos=True),
    "combined": dict(temperature=0.9, top_k=5, top_p=0.85, min_p=0.05, ignore_eos=True),
    "penalties": dict(
        temperature=1.0, repetition_penalty=1.6, presence_penalty=0.4, frequency_penalty=0.5, ignore_eos=True
    ),
    "min_tokens": dict(temperature=1.0, min_tokens=2, repetition_penalty=1.3),  # EOS banned for t1, t2
}
GREEDY: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0, ignore_eos=True),
    "greedy_penalty": dict(temperature=0.0, repetition_penalty=5.0, frequency_penalty=0.5, ignore_eos=True),
}

SCALE = int(os.environ.get("SPECDEC_TEST_SCALE_DOWN", "1"))  # > 1 only to try the file quickly

pytestmark = pytest.mark.usefixtures("fast_cpu_settings")


def processed_probs(logits: torch.Tensor, prefix: list[int], fields: dict[str, Any]) -> torch.Tensor:
    """The processed distribution ``[V]`` after ``prefix`` (prompt + generated), per transformers' order."""
    p = SamplingParams(**fields, max_tokens=4)
    ids = torch.tensor([prefix])
    x = logits.clone()[None]
    procs = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    x = procs(ids, x)
    counts = torch.bincount(torch.tensor(prefix[len(PROMPT) :], dtype=torch.long), minlength=V).to(x.dtype)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(x.dtype)
    procs = LogitsProcessorList()
    if p.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(len(PROMPT), p.min_tokens, [EOS]))
    if p.greedy:
        return procs(ids, x)[0]  # greedy: only the argmax is used
    procs.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        procs.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        procs.append(MinPLogitsWarper(p.min_p))
    return torch.softmax(procs(ids, x)[0], dim=-1)


def exact_tables(model, dtype: torch.dtype) -> dict[str, np.ndarray]:
    """Per configuration the joint ``[V, V, V]`` of the first three tokens; greedy chains as ``[3]``."""
    l1, l2, l3 = first_three_logits(model, PROMPT, V, dtype)
    out: dict[str, np.ndarray] = {}
    for name, fields in CONFIGS.items():
        p1 = processed_probs(l1, PROMPT, fields)
        joint = torch.zeros(V, V, V, dtype=torch.float64)
        for a in range(V):
            p2 = processed_probs(l2[a], PROMPT + [a], fields)
            for b in range(V):
                p3 = processed_probs(l3[a, b], PROMPT + [a, b], fields)
                joint[a, b] = p1[a] * p2[b] * p3
        out[name] = joint.numpy()
    for name, fields in GREEDY.items():
        a = int(processed_probs(l1, PROMPT, fields).argmax())
        b = int(processed_probs(l2[a], PROMPT + [a], fields).argmax())
        c = int(processed_probs(l3[a, b], PROMPT + [a, b], fields).argmax())
        out[name] = np.array([a, b, c])
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_proc_dist")
    target = save_target_and_draft(root, V, TARGET_SEED, DRAFT_SEED)
    exact = exact_tables(target, torch.float64)
    rough = exact_tables(target, torch.float32)
    for name in CONFIGS:  # same support in float32 and float64: no decision is a rounding accident
        assert np.array_equal(exact[name] > 0, rough[name] > 0), name
    for name in GREEDY:
        assert np.array_equal(exact[name], rough[name]), name
    return {"target": root / "target", "draft": root / "draft", "exact": exact}


def test_each_configuration_really_truncates_or_penalises(setup):
    exact = setup["exact"]
    support = {name: int((exact[name] > 0).sum()) for name in CONFIGS}
    assert all(n < V**3 for name, n in support.items() if name not in ("penalties", "min_tokens")), support
    assert exact["min_tokens"][EOS].sum() == 0 and exact["min_tokens"][:, EOS].sum() == 0
    assert exact["min_tokens"][:, :, EOS].sum() > 0.01  # EOS allowed at t3
    assert not np.array_equal(exact["greedy"], exact["greedy_penalty"])
    for name in CONFIGS:
        assert abs(exact[name].sum() - 1) < 1e-9


def make_llm(setup, method: str) -> LLM:
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": K}
    if method == "draft_model":
        spec["model"] = str(setup["draft"])
    n = PER_CALL * len(CONFIGS) + 2 * len(GREEDY)
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


def sample_counts(
    llm: LLM, num_calls: int, seed_base: int, greedy_chains: dict[str, list[int]]
) -> dict[str, np.ndarray]:
    """``num_calls`` mixed batches; per configuration the counts ``[V, V, V]`` of the first 3 tokens."""
    configs = CONFIGS
    samples: dict[str, list[list[int]]] = {name: [] for name in configs}
    for call in range(num_calls):
        params, names = [], []
        for i in range(PER_CALL):
            for c, (name, fields) in enumerate(configs.items()):
                seed = seed_base + (call * PER_CALL + i) * len(configs) + c if i % 2 else None
                params.append(SamplingParams(**fields, seed=seed, max_tokens=3 + (i // 2) % 2))
                names.append(name)
            if i % (PER_CALL // 2) == 0:  # greedy rows spread through the batch
                for name, fields in GREEDY.items():
                    params.append(SamplingParams(**fields, max_tokens=3))
                    names.append(name)
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params)
        for out, name in zip(outs, names):
            toks = out.outputs[0].token_ids
            if name in GREEDY:
                assert toks == greedy_chains[name], name
                continue
            assert len(toks) >= 3, (name, toks)
            samples[name].append(toks[:3])
    return {name: counts_of(s, (V, V, V)) for name, s in samples.items()}


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_sampler_stack_is_exact_under_speculation_in_one_mixed_batch(setup, method):
    llm = make_llm(setup, method)
    greedy_chains = {name: setup["exact"][name].tolist() for name in GREEDY}
    num_samples = SAMPLES_PER_CONFIG[method] // SCALE
    num_calls = num_samples // PER_CALL
    counts = sample_counts(llm, num_calls, seed_base=10**7, greedy_chains=greedy_chains)
    failed = {}
    for name, c in counts.items():
        assert int(c.sum()) == num_calls * PER_CALL
        res = goodness_of_fit(setup["exact"][name], c)
        print(f"[gof] {method} {name}: {res.describe()}")
        if res.pvalue < ALPHA:
            failed[name] = res.describe()
    assert not failed, f"{method}: not the processed target distribution: {failed}"
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_position[1] > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def stale_row_group(req, draft_token_ids, num_rows, vocab_size, bitmask=None):
    """A broken engine: verification rows ignore the drafts before them (stale penalties)."""
    return RowGroup(req.sampling_params, req.token_ids, req.num_prompt_tokens, req.stop_ids, [], num_rows)


def test_negative_control_stale_prefix_along_the_draft_fails(setup, monkeypatch):
    llm = make_llm(setup, "draft_model")
    monkeypatch.setattr("specdec.engine.verification.row_group", stale_row_group)
    configs = {"penalties": CONFIGS["penalties"]}
    counts = sample_counts_no_greedy(llm, configs)
    res = assert_differs(setup["exact"]["penalties"], counts["penalties"], label="stale prefix")
    assert res.pvalue < ALPHA * 1e-3


def sample_counts_no_greedy(llm: LLM, configs) -> dict[str, np.ndarray]:
    """20,000 samples of each configuration, no greedy rows (their chains would be wrong too)."""
    samples: dict[str, list[list[int]]] = {name: [] for name in configs}
    for call in range(10):
        params = [
            SamplingParams(**fields, max_tokens=4, seed=call * 10**5 + i)
            for i in range(2000)
            for fields in configs.values()
        ]
        names = [name for _ in range(2000) for name in configs]
        for out, name in zip(llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params), names):
            samples[name].append(out.outputs[0].token_ids[:3])
    return {name: counts_of(s, (V, V, V)) for name, s in samples.items()}
