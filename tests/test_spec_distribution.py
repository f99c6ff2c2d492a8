"""Speculative decoding through the real engine samples exactly the target model's distribution.

A tiny random Llama with a vocabulary of 8 is the target. For one fixed prompt the exact distribution of
the first three generated tokens (8^3 = 512 outcomes) is enumerated with transformers in float64:
``p(t1) p(t2 | t1) p(t3 | t1, t2)``, each ``softmax(logits / T)``. The engine then generates 100,000
sampled requests per drafter through ``LLM.generate`` (40 calls of 2,500 requests plus 10 greedy ones)
and each temperature's first three tokens are tested against their exact distribution with the
chi-square test of :mod:`tests.stats` at ``alpha = 1e-3``.

Each call mixes, request by request: temperatures 0.7 / 1.0 / 1.5 (counted separately), requests with
their own distinct seeds and unseeded ones (engine generator), ``max_tokens`` 3 and 4 (with k = 2: one
draft for t2 and a bonus t3, or a chain of two drafts for t2, t3; a rejection at t2 leaves one draft for
t3), and greedy requests, which must reproduce the exact argmax chain. The first token always comes from
the prefill step; t2 and t3 come from verification.

Negative controls installed as ``llm.engine.verifier`` (accept every draft; recovered token
from the target instead of the residual) must fail the same test on the draft-model drafter at T = 1.

Throughput (one CPU thread, 3 tokens per request, ~3 engine steps each): about 2,500 requests/s with the
n-gram drafter and 2,000/s with the draft model, so each drafter's 100,000 samples take ~40-50 s. The
engine's per-request Python work (scheduling, input building, attention masks, verification one request
at a time) dominates, not the model. Hence, for this file only: one intra-op thread (on a loaded 2-core
machine, threads made the reference attention's per-request ``torch.ones(q, q).tril_()`` ~100x slower),
the cyclic GC's long-lived objects frozen (full collections cost 15-40 %), and batches of 2,500 rather
than 5,000 (the scheduler's admission is quadratic in the number of running requests).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from tests.conftest import first_three_logits, save_target_and_draft
from tests.stats import ALPHA, GofResult, assert_differs, counts_of, goodness_of_fit
from tests.test_rejection_sampler import AcceptEverything, RecoverFromTarget

V = 8
PROMPT = [3, 4, 5, 6, 7, 3, 4, 5]  # repetitive, so n-gram lookup finds matches
TEMPERATURES = (0.7, 1.0, 1.5)
K = 2  # num_speculative_tokens
BATCH = 2500  # sampled requests per generate call (larger is slower: see the module docstring)
NUM_CALLS = 40  # 100,000 sampled requests per drafter
NUM_GREEDY = 10  # greedy requests per call, spread through the batch
NUM_CONTROL_CALLS = 2  # 5,000 requests at T = 1.0 per negative control
TARGET_SEED, DRAFT_SEED = 1, 2


pytestmark = pytest.mark.usefixtures("fast_cpu_settings")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Model directories, exact joint distributions per temperature, and the greedy chain."""
    root = tmp_path_factory.mktemp("spec_dist")
    target = save_target_and_draft(root, V, TARGET_SEED, DRAFT_SEED)
    target_logits = first_three_logits(target, PROMPT, V)
    exact = {t: exact_joint(target_logits, t) for t in TEMPERATURES}
    l1, l2, l3 = target_logits
    a = int(l1.argmax())
    b = int(l2[a].argmax())
    c = int(l3[a, b].argmax())
    return {"target": root / "target", "draft": root / "draft", "exact": exact, "greedy": [a, b, c]}


def exact_joint(logits: tuple[torch.Tensor, torch.Tensor, torch.Tensor], temperature: float) -> np.ndarray:
    p1, p2, p3 = (torch.softmax(x / temperature, dim=-1) for x in logits)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def test_exact_distributions_are_far_from_uniform_but_have_no_tiny_probabilities(setup):
    for t, joint in setup["exact"].items():
        assert abs(joint.sum() - 1) < 1e-9
        p1 = joint.sum((1, 2))
        cond3 = joint / joint.sum(2, keepdims=True)
        assert p1.max() > 0.25 and cond3.max() > 0.3, t  # far from uniform (1/8)
        assert cond3.min() > 1e-3, t


def make_llm(setup, method: str) -> LLM:
    spec = {"method": method, "num_speculative_tokens": K}
    if method == "draft_model":
        spec["model"] = str(setup["draft"])
    n = BATCH + NUM_GREEDY
    return LLM(
        setup["target"],
        skip_tokenizer_init=True,
        speculative_config=spec,
        seed=1234,
        block_size=4,  # the prompt's first block is prefix-cached from the second call on
        num_kv_blocks=4 * n + 16,
        max_model_len=32,
        max_num_seqs=n,
        max_num_batched_tokens=n * (len(PROMPT) + K + 1),  # the whole batch prefills in one step
    )


def sample_counts(
    llm: LLM, num_calls: int, seed_base: int, temperatures=TEMPERATURES, greedy_chain=None
) -> dict[float, np.ndarray]:
    """Run ``num_calls`` mixed batches; counts ``[V, V, V]`` of the first three tokens per temperature."""
    samples: dict[float, list[list[int]]] = {t: [] for t in temperatures}
    num_greedy = NUM_GREEDY if greedy_chain is not None else 0
    for call in range(num_calls):
        params, temps = [], []
        n = BATCH + num_greedy
        greedy_at = set(range(0, n, n // num_greedy)[:num_greedy]) if num_greedy else set()
        i = 0
        for j in range(n):
            if j in greedy_at:
                params.append(SamplingParams(temperature=0.0, max_tokens=3 + j % 2, ignore_eos=True))
                temps.append(None)
                continue
            t = temperatures[i % len(temperatures)]
            seeded = (i // len(temperatures)) % 2 == 1
            seed = seed_base + call * BATCH + i if seeded else None
            mt = 3 + (i // (2 * len(temperatures))) % 2
            params.append(SamplingParams(temperature=t, seed=seed, max_tokens=mt, ignore_eos=True))
            temps.append(t)
            i += 1
        assert i == BATCH
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params)
        for out, p, t in zip(outs, params, temps):
            toks = out.outputs[0].token_ids
            assert len(toks) == p.max_tokens and out.outputs[0].finish_reason == "length"
            if t is None:
                assert toks[:3] == greedy_chain
            else:
                samples[t].append(toks[:3])
    return {t: counts_of(s, (V, V, V)) for t, s in samples.items()}


def check_all(setup, counts: dict[float, np.ndarray], label: str) -> dict[float, GofResult]:
    results = {}
    for t, c in counts.items():
        results[t] = goodness_of_fit(setup["exact"][t], c)
        print(f"[gof] {label} T={t}: {results[t].describe()}")
    failed = {t: r.describe() for t, r in results.items() if r.pvalue < ALPHA}
    assert not failed, f"{label}: first three tokens do not match the exact distribution: {failed}"
    return results


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_output_distribution_matches_target(setup, method):
    llm = make_llm(setup, method)
    counts = sample_counts(llm, NUM_CALLS, seed_base=10**6, greedy_chain=setup["greedy"])
    assert sum(int(c.sum()) for c in counts.values()) == NUM_CALLS * BATCH
    check_all(setup, counts, method)
    stats = llm.engine.spec_stats
    print(f"[spec] {method}: {stats.as_dict()}")
    # Drafts were proposed, and verification both accepted and rejected some (at both positions).
    assert stats.num_drafts > NUM_CALLS * BATCH // 4
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_draft_tokens > stats.num_drafts  # chains of 2 drafts were verified
    assert stats.accepted_per_position[1] > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks  # everything freed


@pytest.mark.parametrize("control", [AcceptEverything, RecoverFromTarget])
def test_negative_controls_fail_the_same_test(setup, control):
    llm = make_llm(setup, "draft_model")
    llm.engine.verifier = control()
    counts = sample_counts(llm, NUM_CONTROL_CALLS, seed_base=5 * 10**6, temperatures=(1.0,))
    res = assert_differs(setup["exact"][1.0], counts[1.0], label=f"control {control.__name__}, T=1.0")
    assert res.pvalue < ALPHA * 1e-3  # not a near miss: the test has ample power against this bias
