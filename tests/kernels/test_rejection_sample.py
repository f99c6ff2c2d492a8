"""Rejection sampling: the Triton kernel against the reference on identical random numbers (exact), and
``RejectionSampler.verify``'s flattened path against its per-request definition (exact, same seeds).

The batches (:func:`kernels.testing.make_rejection_batch`) mix greedy and random requests, empty draft
chains, drafts always accepted (draft = target), sometimes accepted, usually rejected, a zero residual
(the fallback to the target row), argmax ties across vocabulary blocks, vocabularies not multiples of
the kernel's block, and ``max_spec_len`` above the longest chain (placeholder columns). The output is
poisoned (-7) before the launch.
"""

from __future__ import annotations

import pytest
import torch

from kernels.rejection_sample import (
    BLOCK_V,
    PLACEHOLDER,
    rejection_sample,
    rejection_sample_ref,
    rejection_sample_triton,
)
from kernels.testing import make_rejection_batch, random_probs
from sampling.rejection_sampler import RejectionSampler

COUNTS = [3, 0, 4, 2, 5, 1, 3, 0, 4, 2]


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft-probs", "deterministic"])
@pytest.mark.parametrize("vocab", [70, BLOCK_V + 100])
def test_kernel_matches_reference(device, vocab, with_draft_probs):
    batch = make_rejection_batch(COUNTS, vocab, seed=vocab, with_draft_probs=with_draft_probs, max_spec_len=6)
    ref = rejection_sample_ref(*batch.args())
    out = torch.full((len(COUNTS), 7), -7, dtype=torch.int64, device=device)
    rejection_sample_triton(*batch.args(device), out=out)
    assert torch.equal(out.cpu(), ref)
    # The batch exercises what it claims: accepted runs, rejections, bonus tokens and placeholders.
    num_emitted = (ref != PLACEHOLDER).sum(dim=1)
    counts = torch.tensor(COUNTS)
    assert (num_emitted == counts + 1).any() and (num_emitted < counts + 1).any()
    assert (ref[:, -1] == PLACEHOLDER).all()
    if with_draft_probs:
        assert (num_emitted[0::5] == counts[0::5] + 1).all()  # draft = target: all accepted


def test_all_greedy_and_all_random(device):
    for greedy in ([True] * 4, [False] * 4):
        batch = make_rejection_batch([2, 3, 0, 1], 300, seed=len(greedy) + greedy[0], greedy=greedy)
        ref = rejection_sample_ref(*batch.args())
        assert torch.equal(rejection_sample_triton(*batch.args(device)).cpu(), ref)
    # Greedy: ties resolve to the first maximal index, as torch.argmax does.
    batch = make_rejection_batch([0, 0, 0, 0, 0], 2 * BLOCK_V + 5, seed=3, greedy=[True] * 5)
    out = rejection_sample_triton(*batch.args(device)).cpu()
    assert out[4, 0] == 3 and torch.equal(out[:, 0], batch.target_probs.argmax(dim=-1))


def test_dispatcher_off_cuda_is_the_reference():
    batch = make_rejection_batch(COUNTS, 50, seed=9)
    assert torch.equal(rejection_sample(*batch.args()), rejection_sample_ref(*batch.args()))


# ----------------------------------------------------- RejectionSampler: flattened path == definition
def _random_verify_batch(seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    n = 1 + seed % 7
    counts = [int(torch.randint(0, 5, (1,), generator=g)) for _ in range(n)]
    target = random_probs(sum(counts) + n, vocab, g, sharpness=1.5)
    drafts, dprobs = [], []
    t = 0
    for i, m in enumerate(counts):
        q = random_probs(m, vocab, g, sharpness=1.5)
        if i % 3 == 0:  # a drafter close to the target: long accepted runs
            q = 0.8 * target[t : t + m] + 0.2 * q
        drafts.append(torch.multinomial(q, 1, generator=g).squeeze(1).tolist() if m else [])
        dprobs.append(None if i % 4 == 1 else q)
        t += m + 1
    greedy = [i % 5 == 2 for i in range(n)]
    seeds = [None if i % 2 else 1000 * seed + i for i in range(n)]
    return target, drafts, dprobs, greedy, seeds


def _verify(method, args, default_seed: int):
    target, drafts, dprobs, greedy, seeds = args
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    return method(target, drafts, dprobs, greedy, gens, torch.Generator().manual_seed(default_seed))


def test_flattened_verify_equals_per_request_definition():
    """The CUDA path of ``verify`` (here with the op's torch reference) against the CPU path."""
    s = RejectionSampler()
    num_rejections = num_bonus = 0
    for seed in range(100):
        args = _random_verify_batch(seed, vocab=5 + seed % 40 if seed % 10 else 3000 + seed)
        flat = _verify(s._verify_flat, args, seed)
        ref = _verify(s._verify_per_request, args, seed)
        assert flat == ref, seed
        for r, d in zip(ref, args[1]):
            num_rejections += r.num_accepted < len(d)
            num_bonus += r.num_accepted == len(d)
    assert num_rejections > 30 and num_bonus > 30


def test_flattened_verify_rejects_bad_shapes():
    s = RejectionSampler()
    target = random_probs(5, 8, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="draft_probs of request 1"):
        s._verify_flat(target, [[1], [2, 3]], [None, torch.rand(1, 8)], [False, False], [None, None], None)
