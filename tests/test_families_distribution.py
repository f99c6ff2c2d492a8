"""Speculative sampling on a Gemma 2 target keeps the target's distribution: the goodness-of-fit test
of :mod:`tests.test_spec_distribution` on the family whose every switch touches the logits (sliding
windows shorter than the context on alternate layers, attention soft-capping, final logit soft-capping,
``(1 + w)`` norms, GeGLU, a query pre-attention scalar).

The target is :func:`tests.test_families.make_family_model`'s Gemma 2 with a vocabulary of 8; the exact
joint distribution of the first three tokens after an 8-token prompt comes from transformers in float64.
At T = 1, 20,000 sampled requests per drafter (seeded and unseeded, ``max_tokens`` 3 and 4, greedy rows
mixed in), chi-square at ``alpha = 1e-3``:

- a draft model of the same family (a noisy copy: its own soft-capped distribution as ``draft_probs``);
- a random EAGLE-3 head (global attention without soft-caps, :func:`~specdec.drafters.heads.head_arch`)
  drafting chains sampled from its processed distribution over a 5-of-8 draft vocabulary.

Negative control: the draft model with every draft accepted must fail the same test (5,000 requests).
"""

from __future__ import annotations

import pytest
import torch

from specdec import LLM
from specdec.models.config import ModelArchConfig
from tests.conftest import first_three_logits
from tests.stats import ALPHA, assert_differs
from tests.test_eagle3_distribution import greedy_chain, save_random_eagle3_head
from tests.test_families import make_family_model
from tests.test_rejection_sampler import AcceptEverything
from tests.test_spec_distribution import BATCH, NUM_GREEDY, PROMPT, V, check_all, exact_joint, sample_counts

GEMMA2 = "gemma2-gqa2-tied-window5"
K = 2
NUM_CALLS = 8  # 20,000 sampled requests at T = 1 per drafter
NUM_CONTROL_CALLS = 2
DRAFT_VOCAB = [0, 2, 3, 5, 6]

pytestmark = pytest.mark.usefixtures("fast_cpu_settings")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2_dist")
    target = make_family_model(GEMMA2, seed=1, vocab_size=V)
    target.save_pretrained(root / "target")
    draft = make_family_model(GEMMA2, seed=1, vocab_size=V)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    draft.save_pretrained(root / "draft")
    logits = first_three_logits(target, PROMPT, V)
    arch = ModelArchConfig.from_pretrained(root / "target")
    assert arch.sliding_window is not None and arch.sliding_window < len(PROMPT)
    assert arch.attn_logit_softcapping is not None and arch.final_logit_softcapping is not None
    save_random_eagle3_head(root / "target", DRAFT_VOCAB, root / "eagle3")
    return {
        "root": root,
        "exact": {1.0: exact_joint(logits, 1.0)},
        "greedy": greedy_chain(logits),
    }


def make_llm(setup, method: str) -> LLM:
    model = setup["root"] / ("draft" if method == "draft_model" else "eagle3")
    n = BATCH + NUM_GREEDY
    return LLM(
        setup["root"] / "target", skip_tokenizer_init=True, seed=99,
        speculative_config={"method": method, "model": str(model), "num_speculative_tokens": K},
        block_size=4, num_kv_blocks=4 * n + 16, max_model_len=32, max_num_seqs=n,
        max_num_batched_tokens=n * (len(PROMPT) + K + 1),
    )  # fmt: skip


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_speculation_on_gemma2_samples_the_target_distribution(setup, method):
    llm = make_llm(setup, method)
    counts = sample_counts(
        llm, NUM_CALLS, seed_base=21 * 10**6, temperatures=(1.0,), greedy_chain=setup["greedy"]
    )
    check_all(setup, counts, f"gemma2 {method}")
    stats = llm.engine.spec_stats
    assert stats.num_drafts > NUM_CALLS * BATCH // 4
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_position[1] > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_accepting_every_draft_on_gemma2_fails_the_same_test(setup):
    llm = make_llm(setup, "draft_model")
    llm.engine.verifier = AcceptEverything()
    counts = sample_counts(llm, NUM_CONTROL_CALLS, seed_base=22 * 10**6, temperatures=(1.0,))
    res = assert_differs(setup["exact"][1.0], counts[1.0], label="control: gemma2, every draft accepted")
    assert res.pvalue < ALPHA * 1e-3
