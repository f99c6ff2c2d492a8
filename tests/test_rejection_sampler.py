"""RejectionSampler.verify: hand-made unit cases, and the output distribution of the sampler alone.

The distribution test needs no model: the "target" and the "drafter" are Markov chains over a vocabulary
of 6 (the next token's distribution is a row of a fixed table picked by the previous token), so the
exact distribution of the first tokens is a product of table entries. Speculative generation is then
simulated exactly as the engine drives the sampler (draft, verify, append, repeat) for 100,000 requests,
batched 2,000 per ``verify`` call, mixing sampled drafts, deterministic drafts (``draft_probs`` None) and
empty drafts, 1-3 drafts per request, seeded and unseeded requests. Negative controls (accept every
draft; recovered token from the target instead of the residual) must fail the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampling.rejection_sampler import RejectionSampler, VerifyResult
from tests.stats import ALPHA, assert_differs, assert_matches, counts_of

V = 6


pytestmark = pytest.mark.usefixtures("fast_cpu_settings")


def one_hot(tokens: list[int], vocab: int = V) -> torch.Tensor:
    out = torch.zeros(len(tokens), vocab)
    out[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return out


def rand_rows(n: int, seed: int, vocab: int = V, zero_token: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.softmax(torch.randn(n, vocab, generator=g) * 1.5, dim=-1)
    if zero_token is not None:
        rows[:, zero_token] = 0.0
        rows /= rows.sum(-1, keepdim=True)
    return rows


def verify_one(
    sampler: RejectionSampler,
    target: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    seed: int | None = 0,
    greedy: bool = False,
) -> VerifyResult:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return sampler.verify(target, [drafts], [draft_probs], [greedy], [gen], torch.Generator().manual_seed(1))[
        0
    ]


# ------------------------------------------------------------------------------------------ unit cases
@pytest.mark.parametrize("sampled", [True, False], ids=["draft-probs", "deterministic"])
def test_accept_all_then_bonus_from_last_row(sampled):
    drafts = [2, 4, 1]
    target = torch.cat([one_hot(drafts), one_hot([5])])  # rows 0..2 certain of the drafts, row 3 of 5
    dp = one_hot(drafts) if sampled else None
    for seed in range(50):
        res = verify_one(RejectionSampler(), target, drafts, dp, seed)
        assert res.token_ids == [2, 4, 1, 5]
        assert res.num_accepted == 3


def test_bonus_drawn_from_row_m():
    """All drafts accepted (target certain of them); the bonus follows row m, never rows 0..m-1."""
    drafts = [0, 1]
    last = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.25, 0.25]])
    target = torch.cat([one_hot(drafts), last])
    seen = set()
    for seed in range(300):
        res = verify_one(RejectionSampler(), target, drafts, rand_rows(2, seed), seed)
        assert res.token_ids[:2] == drafts and res.num_accepted == 2 and len(res.token_ids) == 3
        seen.add(res.token_ids[2])
    assert seen == {2, 4, 5}


@pytest.mark.parametrize("sampled", [True, False], ids=["draft-probs", "deterministic"])
def test_reject_first_draft_with_zero_target_prob(sampled):
    drafts = [3, 1, 2]
    target = rand_rows(4, 11, zero_token=3)  # the first draft is impossible under the target
    dp = rand_rows(3, 12) if sampled else None
    seen = set()
    for seed in range(300):
        res = verify_one(RejectionSampler(), target, drafts, dp, seed)
        assert res.num_accepted == 0 and len(res.token_ids) == 1
        tok = res.token_ids[0]
        assert tok != 3  # the recovered token never repeats the rejected draft here
        residual = (target[0] - (dp[0] if sampled else one_hot([3])[0])).clamp(min=0)
        assert residual[tok] > 0
        seen.add(tok)
    assert len(seen) >= 2  # it really is drawn, not fixed


def test_recovered_token_never_the_rejected_deterministic_draft():
    """One-hot draft: the residual is the target without the draft token."""
    target = torch.tensor([[0.3, 0.2, 0.2, 0.1, 0.1, 0.1], [1 / 6] * 6])
    for seed in range(400):
        res = verify_one(RejectionSampler(), target, [0], None, seed)
        if res.num_accepted == 0:
            assert res.token_ids != [0]


def test_empty_draft_emits_one_token_from_row_0():
    target = torch.tensor([[0.0, 0.7, 0.0, 0.3, 0.0, 0.0]])
    seen = set()
    for seed in range(200):
        res = verify_one(RejectionSampler(), target, [], None, seed)
        assert res.num_accepted == 0 and len(res.token_ids) == 1
        seen.add(res.token_ids[0])
    assert seen == {1, 3}
    res = verify_one(RejectionSampler(), target, [], torch.zeros(0, V), 5)  # [0, V] draft probs
    assert len(res.token_ids) == 1


def test_greedy_path_accepts_while_draft_is_argmax():
    target = torch.tensor(
        [
            [0.1, 0.1, 0.5, 0.1, 0.1, 0.1],  # argmax 2
            [0.1, 0.1, 0.1, 0.1, 0.5, 0.1],  # argmax 4
            [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],  # argmax 0
            [0.1, 0.1, 0.1, 0.5, 0.1, 0.1],  # argmax 3
        ]
    )
    s = RejectionSampler()
    cases = {
        (2, 4, 0): ([2, 4, 0, 3], 3),  # all accepted + bonus argmax of row 3
        (2, 4, 1): ([2, 4, 0], 2),  # third draft is not the argmax: argmax 0 recovered
        (5, 4, 0): ([2], 0),
        (2, 1, 0): ([2, 4], 1),
    }
    for drafts, (tokens, acc) in cases.items():
        g = torch.Generator().manual_seed(3)
        state = g.get_state()
        res = s.verify(target, [list(drafts)], [rand_rows(3, 0)], [True], [g])[0]
        assert (res.token_ids, res.num_accepted) == (tokens, acc)
        assert torch.equal(g.get_state(), state)  # the greedy path draws nothing
    res = s.verify(target[:1], [[]], [None], [True], [None])[0]
    assert res.token_ids == [2] and res.num_accepted == 0


def test_draft_probs_none_equals_one_hot():
    s = RejectionSampler()
    g = torch.Generator().manual_seed(0)
    for seed in range(300):
        m = 1 + seed % 4
        target = rand_rows(m + 1, 1000 + seed, zero_token=seed % V if seed % 3 == 0 else None)
        drafts = torch.randint(0, V, (m,), generator=g).tolist()
        a = verify_one(s, target, drafts, None, seed)
        b = verify_one(s, target, drafts, one_hot(drafts), seed)
        assert a == b


def test_row_and_shape_mismatches_raise():
    s = RejectionSampler()
    target = rand_rows(3, 0)
    with pytest.raises(ValueError, match="rows"):
        s.verify(target, [[1, 2, 3]], [None], [False], [None])  # needs 4 rows
    with pytest.raises(ValueError, match="rows"):
        s.verify(target, [[1], [2]], [None, None], [False, False], [None, None])  # needs 4 rows
    with pytest.raises(ValueError, match="shape"):
        s.verify(target, [[1, 2]], [rand_rows(1, 0)], [False], [None])  # 1 draft-prob row for 2 drafts
    with pytest.raises(ValueError, match="shape"):
        s.verify(target, [[1, 2]], [rand_rows(2, 0, vocab=V + 1)], [False], [None])  # wrong vocab


def test_seeded_requests_are_reproducible_and_independent_of_the_batch():
    s = RejectionSampler()
    target = rand_rows(3, 5)
    drafts, dp = [1, 4], rand_rows(2, 6)
    alone = [verify_one(s, target, drafts, dp, seed) for seed in range(100)]
    assert alone == [verify_one(s, target, drafts, dp, seed) for seed in range(100)]
    assert len({tuple(r.token_ids) for r in alone}) > 1
    other_t = rand_rows(2 + 1 + 4, 7)  # neighbours: 1 draft, 0 drafts, 3 drafts
    for seed in range(100):
        for pos in range(4):
            reqs = [
                ([0], rand_rows(1, 8), None, other_t[0:2]),  # unseeded: default generator
                ([], None, torch.Generator().manual_seed(10**6 + seed), other_t[2:3]),
                ([2, 2, 5], None, None, other_t[3:7]),
            ]
            reqs.insert(pos, (drafts, dp, torch.Generator().manual_seed(seed), target))
            out = s.verify(
                torch.cat([r[3] for r in reqs]),
                [r[0] for r in reqs],
                [r[1] for r in reqs],
                [False] * 4,
                [r[2] for r in reqs],
                torch.Generator().manual_seed(seed + 77),
            )
            assert out[pos] == alone[seed]


def test_equal_target_and_draft_no_nan_and_never_zero_prob():
    s = RejectionSampler()
    for seed in range(200):
        m = 1 + seed % 3
        probs = rand_rows(m + 1, seed, zero_token=seed % V)
        drafts = [
            int(torch.multinomial(probs[j], 1, generator=torch.Generator().manual_seed(seed + j)))
            for j in range(m)
        ]
        res = verify_one(s, probs, drafts, probs[:m].clone(), seed)
        assert res.num_accepted == m  # q == p: u * q < p for every u in [0, 1)
        assert all(probs[j, t] > 0 for j, t in enumerate(res.token_ids))
    # Both one-hot on the same token, including in the last row.
    res = verify_one(s, one_hot([3, 3, 3]), [3, 3], one_hot([3, 3]), 0)
    assert res.token_ids == [3, 3, 3]


class _RejectAll(RejectionSampler):
    """Forces the rejection branch, so target == draft leaves an all-zero residual."""

    @staticmethod
    def accept(uniform: float, target_prob: float, draft_prob: float) -> bool:
        return False


def test_zero_residual_falls_back_to_target_row():
    s = _RejectAll()
    for seed in range(200):
        probs = rand_rows(2, seed, zero_token=seed % V)
        tok = int(torch.multinomial(probs[0], 1, generator=torch.Generator().manual_seed(seed)))
        res = verify_one(s, probs, [tok], probs[:1].clone(), seed)
        assert res.num_accepted == 0 and len(res.token_ids) == 1
        assert probs[0, res.token_ids[0]] > 0
    # The race itself: all-zero, NaN or infinite weights use the fallback row.
    fallback = torch.tensor([0.0, 0.0, 0.6, 0.0, 0.4, 0.0])
    for bad in (torch.zeros(V), torch.full((V,), float("nan")), torch.full((V,), float("inf"))):
        for seed in range(50):
            t = RejectionSampler._race(bad, fallback, torch.Generator().manual_seed(seed))
            assert fallback[t] > 0


# --------------------------------------------------------------------------- the output distribution
def _markov(seed: int, zero_first: int, zero_pairs: list[tuple[int, int]]) -> torch.Tensor:
    """``[V + 1, V]``: row ``v`` = next-token distribution after ``v``; row ``V`` = the first token's."""
    rows = rand_rows(V + 1, seed)
    rows[V, zero_first] = 0.0
    for a, b in zero_pairs:
        rows[a, b] = 0.0
    return rows / rows.sum(-1, keepdim=True)


TARGET = _markov(101, zero_first=3, zero_pairs=[(0, 5), (2, 2), (4, 0)])
DRAFT = _markov(202, zero_first=1, zero_pairs=[(1, 4), (5, 5)])
DETERMINISTIC = torch.tensor([1, 2, 3, 4, 5, 0, 3])  # next draft after v (row V: first), one-hot


def exact_joint(n: int) -> np.ndarray:
    """Exact ``[V] * n`` joint distribution of the first n emitted tokens (float64)."""
    t = TARGET.double().numpy()
    t = t / t.sum(-1, keepdims=True)
    joint = t[V]
    for _ in range(n - 1):
        joint = joint[..., :, None] * t[np.arange(V)].reshape((1,) * (joint.ndim - 1) + (V, V))
    return joint


def speculate(
    sampler: RejectionSampler, num_requests: int, num_tokens: int, seed: int, batch: int = 2000
) -> np.ndarray:
    """Speculative generation of ``num_tokens`` tokens per request; ``[num_requests, num_tokens]``.

    Request i: drafts sampled from DRAFT (i % 4 in {0, 1}), deterministic drafts from DETERMINISTIC
    (i % 4 == 2, draft_probs None) or no drafts (i % 4 == 3); 1 + (i // 4) % 3 drafts per step;
    its own seeded generator when (i // 12) % 2 == 1, else the batch's default generator.
    """
    draft_gen = torch.Generator().manual_seed(seed)
    default_gen = torch.Generator().manual_seed(seed + 1)
    out = np.empty((num_requests, num_tokens), dtype=np.int64)
    for b0 in range(0, num_requests, batch):
        ids = list(range(b0, min(b0 + batch, num_requests)))
        mode = [i % 4 for i in ids]
        k = [1 + (i // 4) % 3 for i in ids]
        gens = [torch.Generator().manual_seed(seed * 10**7 + i) if (i // 12) % 2 else None for i in ids]
        emitted: list[list[int]] = [[] for _ in ids]
        active = list(range(len(ids)))
        while active:
            n = len(active)
            state = torch.tensor([emitted[a][-1] if emitted[a] else V for a in active])
            sampled = torch.tensor([mode[a] < 2 for a in active])
            chain = [state]
            for _ in range(3):
                s = chain[-1]
                drawn = torch.multinomial(DRAFT[s], 1, generator=draft_gen)[:, 0]
                chain.append(torch.where(sampled, drawn, DETERMINISTIC[s]))
            seq = torch.stack(chain, dim=1)  # [n, 4]: state, d1, d2, d3
            qrows = DRAFT[seq[:, :3]]  # [n, 3, V]
            seq_l = seq.tolist()
            m = [0 if mode[a] == 3 else k[a] for a in active]  # tokens past num_tokens are dropped
            drafts = [seq_l[r][1 : 1 + m[r]] for r in range(n)]
            dprobs = [qrows[r, : m[r]] if mode[a] < 2 else None for r, a in enumerate(active)]
            rows = [x for r in range(n) for x in seq_l[r][: m[r] + 1]]
            results = sampler.verify(
                TARGET[rows], drafts, dprobs, [False] * n, [gens[a] for a in active], default_gen
            )
            for a, res in zip(active, results):
                emitted[a].extend(res.token_ids)
            active = [a for a in active if len(emitted[a]) < num_tokens]
        out[b0 : b0 + len(ids)] = [e[:num_tokens] for e in emitted]
    return out


NUM_SAMPLES = 100_000
NUM_CONTROL_SAMPLES = 20_000


def test_exact_tables_are_sane():
    joint = exact_joint(2)
    assert abs(joint.sum() - 1) < 1e-12 and joint[3].sum() == 0 and joint[0, 5] == 0
    assert (DRAFT[V, 3] > 0.05) and (DRAFT[V] - TARGET[V]).abs().sum() > 0.5  # drafts often wrong


def test_output_distribution_matches_target():
    """First emitted token and the joint of the first two: exactly the target chain's distribution."""
    samples = speculate(RejectionSampler(), NUM_SAMPLES, 2, seed=1234)
    assert_matches(exact_joint(1), counts_of(samples[:, 0], (V,)), label="rejection sampler, first token")
    assert_matches(exact_joint(2), counts_of(samples, (V, V)), label="rejection sampler, first two tokens")


class AcceptEverything(RejectionSampler):
    """Negative control: accepts every draft (a Verifier through RejectionSampler's per-request path)."""

    def __init__(self) -> None:
        super().__init__(path="per_request")

    @staticmethod
    def accept(uniform: float, target_prob: float, draft_prob: float) -> bool:
        return True


class RecoverFromTarget(RejectionSampler):
    """Negative control: the recovered token comes from the target, not the residual."""

    def __init__(self) -> None:
        super().__init__(path="per_request")

    @staticmethod
    def residual(target_row: torch.Tensor, draft_row: torch.Tensor | None, draft_token: int) -> torch.Tensor:
        return target_row.clone()


@pytest.mark.parametrize("control", [AcceptEverything, RecoverFromTarget])
def test_negative_controls_fail_the_same_test(control):
    samples = speculate(control(), NUM_CONTROL_SAMPLES, 2, seed=99)
    res = assert_differs(exact_joint(2), counts_of(samples, (V, V)), label=f"control {control.__name__}")
    assert res.pvalue < ALPHA * 1e-3  # not a near miss: the test has ample power against this bias
