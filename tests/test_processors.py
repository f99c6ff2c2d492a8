"""Each logits processor equals the matching transformers ``LogitsProcessor``, row by row, on random
logits with ties and ``-inf`` entries, in batches where every row has its own parameters."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sampling.logprobs import token_logprobs
from sampling.params import SamplingParams
from sampling.processors import (
    RowGroup,
    apply_min_p,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    build_sampling_metadata,
    process_logits,
)
from sampling.sampler import argmax_rows, sample
from tests.hf_reference import hf_processors

V = 64


def tied_logits(rows: int, seed: int, num_neg_inf: int = 6) -> torch.Tensor:
    """``[rows, V]`` float32 logits on a coarse grid (many exact ties) with some ``-inf`` entries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (rows, V), generator=g).float() * 0.5
    for r in range(rows):
        idx = torch.randperm(V, generator=g)[:num_neg_inf]
        x[r, idx] = -math.inf
    return x


def hf_rows(proc_for_row, logits: torch.Tensor, input_ids: list[list[int]] | None = None) -> torch.Tensor:
    """transformers' processor applied to each row alone."""
    out = []
    for r in range(logits.shape[0]):
        ids = torch.tensor([input_ids[r] if input_ids else [0]])
        proc = proc_for_row(r)
        out.append(logits[r : r + 1].clone() if proc is None else proc(ids, logits[r : r + 1].clone()))
    return torch.cat(out)


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isneginf(ours), torch.isneginf(theirs)), "different tokens removed"
    finite = torch.isfinite(theirs)
    assert torch.equal(ours[finite], theirs[finite])


def test_temperature_equals_transformers():
    logits = tied_logits(4, 0)
    temps = [0.3, 1.0, 1.7, 1e-5]
    ours = apply_temperature(logits, torch.tensor(temps))
    assert_same(ours, hf_rows(lambda r: TemperatureLogitsWarper(temps[r]), logits))


@pytest.mark.parametrize("seed", range(3))
def test_top_k_equals_transformers_with_ties_and_k_at_least_vocab(seed):
    logits = tied_logits(7, seed)
    ks = [1, 2, 5, 17, V - 6, V, V + 10]  # V - 6 = the number of finite entries; >= V keeps all
    ours = apply_top_k(logits, torch.tensor(ks))
    theirs = hf_rows(lambda r: TopKLogitsWarper(ks[r]), logits)
    assert_same(ours, theirs)
    # Ties at the k-th value are kept: with this grid some row keeps more than k tokens.
    kept = torch.isfinite(ours).sum(dim=1).tolist()
    assert any(n > k for n, k in zip(kept, ks) if k < V - 6)


def test_top_k_off_rows_are_untouched():
    logits = tied_logits(3, 5)
    ours = apply_top_k(logits, torch.tensor([0, 3, 0]))
    assert torch.equal(ours[[0, 2]], logits[[0, 2]])
    assert_same(ours[1:2], TopKLogitsWarper(3)(torch.tensor([[0]]), logits[1:2].clone()))


@pytest.mark.parametrize("seed", range(3))
def test_top_p_equals_transformers(seed):
    logits = tied_logits(6, seed) * 0.7
    ps = [0.05, 0.3, 0.5, 0.8, 0.95, 1.0]
    thr = torch.tensor([1 - p for p in ps], dtype=torch.float32)
    ours = apply_top_p(logits, thr)
    theirs = hf_rows(lambda r: None if ps[r] == 1.0 else TopPLogitsWarper(ps[r]), logits)
    assert_same(ours, theirs)
    assert torch.equal(ours[5], logits[5])  # top_p = 1 changes nothing
    assert bool(torch.isfinite(ours).any(dim=1).all())  # at least one token always stays


@pytest.mark.parametrize("seed", range(3))
def test_min_p_equals_transformers(seed):
    logits = tied_logits(5, seed)
    mps = [0.0, 0.05, 0.2, 0.6, 1.0]
    ours = apply_min_p(logits, torch.tensor(mps))
    theirs = hf_rows(lambda r: None if mps[r] == 0 else MinPLogitsWarper(mps[r]), logits)
    assert_same(ours, theirs)
    assert torch.equal(ours[0], logits[0])  # min_p = 0 changes nothing
    # min_p = 1 keeps exactly the tokens tied at the maximum.
    assert torch.equal(torch.isfinite(ours[4]), logits[4] == logits[4].max())


def test_repetition_penalty_equals_transformers_over_prompt_and_output():
    logits = tied_logits(4, 7)
    logits[:, :10] = torch.linspace(-3, 3, 10)  # seen tokens with negative, zero and positive logits
    penalties = [1.3, 0.7, 1.0, 2.0]
    seen = [[0, 1, 2, 8, 9, 2], [3, 4, 5], [1, 2], [0, 9, 9, 4]]
    groups = [
        RowGroup(SamplingParams(repetition_penalty=p), ids, num_prompt_tokens=2)
        for p, ids in zip(penalties, seen)
    ]
    meta = build_sampling_metadata(groups, V)
    assert meta.repetition_penalty is not None and meta.penalty_mask is not None
    ours = apply_repetition_penalty(logits, meta.repetition_penalty, meta.penalty_mask)
    theirs = hf_rows(lambda r: RepetitionPenaltyLogitsProcessor(penalties[r]), logits, seen)
    assert_same(ours, theirs)


def test_repetition_penalty_lowers_the_probability_of_a_seen_token_with_a_negative_logit():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    meta = build_sampling_metadata([RowGroup(SamplingParams(repetition_penalty=1.5), [1], 1)], 4)
    processed = process_logits(logits, meta)
    assert processed[0, 1] == -1.5  # multiplied, not divided
    assert torch.softmax(processed, -1)[0, 1] < torch.softmax(logits, -1)[0, 1]


def test_presence_and_frequency_penalties_follow_openai_over_output_tokens_only():
    logits = torch.zeros(2, 6)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Prompt [0, 1]; output [2, 2, 3]; the second group has drafts [4, 2] before its rows.
    groups = [
        RowGroup(params, [0, 1, 2, 2, 3], num_prompt_tokens=2),
        RowGroup(params, [0, 1, 2, 2, 3], 2, draft_token_ids=[4, 2], num_rows=1),
    ]
    meta = build_sampling_metadata(groups, 6)
    assert meta.output_counts is not None
    assert meta.output_counts.tolist() == [[0, 0, 2, 1, 0, 0], [0, 0, 3, 1, 1, 0]]
    assert meta.presence_penalty is not None and meta.frequency_penalty is not None
    out = apply_presence_frequency_penalties(
        logits, meta.presence_penalty, meta.frequency_penalty, meta.output_counts
    )
    assert out[0].tolist() == [0, 0, -1.0, -0.75, 0, 0]
    assert out[1].tolist() == [0, 0, -1.25, -0.75, -0.75, 0]


def test_penalties_and_min_tokens_see_the_drafts_before_each_verification_row():
    params = SamplingParams(repetition_penalty=2.0, min_tokens=3, max_tokens=8)
    g = RowGroup(
        params, [5, 6, 1], num_prompt_tokens=2, stop_token_ids={0}, draft_token_ids=[3, 4], num_rows=3
    )
    meta = build_sampling_metadata([g], 8)
    assert meta.penalty_mask is not None
    assert meta.penalty_mask.nonzero().tolist() == [
        [0, 1], [0, 5], [0, 6],
        [1, 1], [1, 3], [1, 5], [1, 6],
        [2, 1], [2, 3], [2, 4], [2, 5], [2, 6],
    ]  # fmt: skip
    # One output token so far: rows 0 and 1 (1 and 2 output tokens) ban the stop token, row 2 does not.
    assert meta.banned_rows is not None and meta.banned_rows.tolist() == [0, 1]


def test_min_tokens_bans_stop_tokens_like_transformers():
    logits = tied_logits(2, 11, num_neg_inf=0)
    g0 = RowGroup(SamplingParams(min_tokens=4, max_tokens=8), [9, 9, 9, 9], 2, stop_token_ids={2, 7})
    g1 = RowGroup(SamplingParams(min_tokens=2, max_tokens=8), [9, 9, 9, 9], 2, stop_token_ids={2, 7})
    ours = process_logits(logits, build_sampling_metadata([g0, g1], V))
    proc = MinNewTokensLengthLogitsProcessor(2, 4, [2, 7])
    assert_same(ours[0:1], proc(torch.tensor([[9, 9, 9, 9]]), logits[0:1].clone()))
    assert torch.equal(ours[1], logits[1])  # two outputs generated: min_tokens = 2 is met


def test_a_batch_where_every_row_has_different_parameters_equals_transformers_row_by_row():
    params = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=1.0, min_tokens=5, max_tokens=9),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0, top_k=1),
    ]
    logits = tied_logits(len(params), 3)
    seq = [list(range(r, r + 6)) for r in range(len(params))]
    groups = [RowGroup(p, s, 3, stop_token_ids={2}) for p, s in zip(params, seq)]
    ours = process_logits(logits, build_sampling_metadata(groups, V))
    for r, p in enumerate(params):
        theirs = hf_processors(p, 3)(torch.tensor([seq[r]]), logits[r : r + 1].clone())
        assert_same(ours[r : r + 1], theirs)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.5, 1.0, 1.5]),
            st.integers(-1, 70),
            st.sampled_from([0.2, 0.7, 1.0]),
            st.sampled_from([0.0, 0.1, 0.5]),
            st.sampled_from([1.0, 1.3]),
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 1000),
)
def test_processing_a_row_in_a_batch_equals_processing_it_alone(rows, seed):
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r)
        for t, k, p, m, r in rows
    ]
    groups = [RowGroup(p, [i, i + 1, 7], 1) for i, p in enumerate(params)]
    logits = tied_logits(len(params), seed)
    batched = process_logits(logits, build_sampling_metadata(groups, V))
    for i, g in enumerate(groups):
        alone = process_logits(logits[i : i + 1], build_sampling_metadata([g], V))
        assert_same(batched[i : i + 1], alone)


def test_tiny_temperature_and_huge_logits_give_no_inf_or_nan_and_temperature_zero_is_greedy():
    logits = torch.tensor([[1e4, -1e4, 1e4 - 1.0, 0.0], [-1e4, -1e4, 5.0, -1e4]])
    for temperature in (1e-5, 0.0):
        params = SamplingParams(temperature=temperature, top_p=0.9, top_k=3, min_p=0.1)
        groups = [RowGroup(params, [0], 1)] * 2
        meta = build_sampling_metadata(groups, 4)
        processed = process_logits(logits, meta)
        probs = torch.softmax(processed, dim=-1)
        assert not torch.isnan(probs).any() and not torch.isinf(probs).any()
        tokens = sample(processed, meta.greedy, [torch.Generator().manual_seed(0)] * 2)
        assert tokens.tolist() == [0, 2]
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=1e-5).greedy


def test_logprobs_equal_log_softmax_of_the_processed_distribution():
    logits = tied_logits(3, 9)
    params = [
        SamplingParams(temperature=0.8, top_k=10, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    groups = [
        RowGroup(params[0], [1, 2], 1, num_rows=1),
        RowGroup(params[1], [1, 2], 1, draft_token_ids=[4], num_rows=2),
    ]
    processed = process_logits(logits, build_sampling_metadata(groups, V))
    chosen = [int(processed[0].argmax()), 3, 11]
    out = token_logprobs(processed, chosen, [5, 0, 0])
    ref = torch.log_softmax(processed, dim=-1)
    for r, d in enumerate(out):
        assert next(iter(d)) == chosen[r]
        for tok, lp in d.items():
            assert lp.logprob == pytest.approx(float(ref[r, tok]), abs=1e-6)
            assert lp.rank == 1 + int((ref[r] > ref[r, tok]).sum())
    top5 = ref[0].topk(5).indices.tolist()
    assert set(top5) <= set(out[0])
    assert len(out[1]) == 1 and len(out[2]) == 1


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.sampled_from([1, 7, 64, 49152]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    nan=st.booleans(),
)
def test_argmax_rows_equals_argmax_with_ties_and_nan(rows, vocab, dtype, levels, seed, nan):
    """The greedy token everywhere (sampler, verifiers, drafters): torch.max's indices must be argmax's
    first maximum, on rows of few distinct values (many ties) and with NaN (argmax picks it)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, vocab), generator=g).to(dtype)
    if nan:
        x[0, int(torch.randint(0, vocab, (1,), generator=g))] = float("nan")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert int(argmax_rows(x[-1])) == int(x[-1].argmax())


@pytest.mark.parametrize("greedy", [[True, True, True], [True, False, True], [False, False, False]])
def test_sample_takes_the_callers_argmax_and_leaves_it_unchanged(greedy):
    """The engine passes the argmax of its finiteness check's max-reduction: the same tokens as when
    ``sample`` reduces the rows itself (seeded random rows included), and the caller's tensor is not
    written (random rows' tokens go into a copy)."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    top = x.max(dim=-1).indices
    given = top.clone()

    def gens():
        return [torch.Generator().manual_seed(i) for i in range(3)]

    want = sample(x, greedy, gens())
    got = sample(x, greedy, gens(), argmax=given)
    assert torch.equal(got, want) and torch.equal(given, top)
    assert torch.equal(got[torch.tensor(greedy)], top[torch.tensor(greedy)])
    # The given indices are what greedy rows take (no second reduction): a different argmax shows through.
    other = (top + 1) % x.shape[1]
    got = sample(x, greedy, gens(), argmax=other)
    mask = torch.tensor(greedy)
    assert torch.equal(got[mask], other[mask]) and torch.equal(got[~mask], want[~mask])
