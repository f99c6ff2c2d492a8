"""EAGLE-3 with a reduced draft vocabulary, and the EAGLE-2 head with one (``draft_vocab``), sample exactly
the target's distribution.

The set-up of :mod:`tests.test_spec_distribution` (a tiny random Llama with a vocabulary of 8, the exact
joint distribution of the first three generated tokens enumerated in float64, mixed batches of seeded,
unseeded and greedy requests at temperatures 0.7 / 1.0 / 1.5, chi-square at ``alpha = 1e-3``), with a
random EAGLE-3 head whose draft vocabulary holds 5 of the 8 tokens, fusing the target's three layer
streams (0, 1, 2):

- chains: sampled requests draw each draft from the head's processed distribution, zero outside the
  draft vocabulary, and report it as ``draft_probs``; greedy requests draft the top token;
- EAGLE-2 trees: deterministic top-k children (no ``draft_probs``), verified by SpecInfer's rule.

40,000 sampled requests per mode. Negative control (must fail the same test): the drafter samples from
the masked distribution but reports the *unmasked* one (the tokens outside the draft vocabulary given
the lowest draft logit instead of -inf), the bug a reduced vocabulary invites; 5,000 requests at T = 1.

The EAGLE-2 head over the same 5-token ``draft_vocab`` (deterministic drafts, chains and trees): 20,000
sampled requests per mode; its negative control reports the top-1 drafts with the reduced head's softmax
as ``draft_probs`` (a deterministic draft claimed to be a draw), which the same test must reject.
"""

from __future__ import annotations

import pytest
import torch

from specdec import LLM
from specdec.drafters.eagle3_head import Eagle3Head
from specdec.drafters.heads import HeadConfig, arch_fields, save_heads
from specdec.models.config import ModelArchConfig
from tests.conftest import first_three_logits, save_random_eagle_head, save_target_and_draft
from tests.stats import ALPHA, assert_differs
from tests.test_spec_distribution import (
    BATCH,
    NUM_GREEDY,
    PROMPT,
    TEMPERATURES,
    V,
    check_all,
    exact_joint,
    sample_counts,
)

K = 2
NUM_CALLS = 16  # 40,000 sampled requests per mode
NUM_CONTROL_CALLS = 2
DRAFT_VOCAB = [0, 2, 3, 5, 6]

pytestmark = pytest.mark.usefixtures("fast_cpu_settings")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_dist")
    target = save_target_and_draft(root, V, 1, 2)
    logits = first_three_logits(target, PROMPT, V)
    exact = {t: exact_joint(logits, t) for t in TEMPERATURES}
    save_random_eagle3_head(root / "target", DRAFT_VOCAB, root / "head")
    return {"target": root / "target", "head": root / "head", "exact": exact, "greedy": greedy_chain(logits)}


def greedy_chain(logits) -> list[int]:
    """The greedy first three tokens of :func:`~tests.conftest.first_three_logits`' output."""
    l1, l2, l3 = logits
    a = int(l1.argmax())
    b = int(l2[a].argmax())
    return [a, b, int(l3[a, b].argmax())]


def save_random_eagle3_head(target_dir, draft_vocab: list[int], out, seed: int = 11) -> None:
    """A random EAGLE-3 head (weights N(0, 0.3)) for the target in ``target_dir``, fusing its layers
    (0, 1, 2), over ``draft_vocab``, saved in ``out``."""
    arch = ModelArchConfig.from_pretrained(target_dir)
    torch.manual_seed(seed)
    head = Eagle3Head(arch, len(draft_vocab), (0, 1, 2))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    head.set_vocab(draft_vocab)
    cfg = HeadConfig(
        method="eagle3", target=str(target_dir), hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
        arch=arch_fields(arch), draft_vocab_size=len(draft_vocab), feature_layers=[0, 1, 2],
    )  # fmt: skip
    save_heads(head, cfg, out)


def make_llm(
    setup, tree: bool, quantization: str | None = None, stop: float | None = None, hybrid: bool = False
) -> LLM:
    spec = {"method": "eagle3", "model": str(setup["head"]), "num_speculative_tokens": K}
    if hybrid:  # the head as a hybrid member beside the copiers (its top-1 probability ranks its proposals)
        spec.update(method="hybrid", hybrid_members=["eagle3", "suffix", "ngram"])
    if quantization is not None:
        spec["quantization"] = quantization
    if stop is not None:
        spec["draft_stop_probability"] = stop
    if tree:
        spec.update(tree="dynamic", tree_topk=2, max_tree_nodes=4)
    n = BATCH + NUM_GREEDY
    return LLM(
        setup["target"],
        skip_tokenizer_init=True,
        speculative_config=spec,
        seed=4321,
        block_size=4,
        num_kv_blocks=4 * n + 16,
        max_model_len=32,
        max_num_seqs=n,
        max_num_batched_tokens=n * (len(PROMPT) + 8),
    )


@pytest.mark.parametrize(
    ("tree", "quantization", "stop", "hybrid"),
    [
        (False, None, None, False),
        (True, None, None, False),
        (False, "int8", None, False),
        (False, None, 0.35, False),
        (False, None, None, True),
    ],
    ids=["chain", "tree", "chain-int8", "chain-stop", "chain-hybrid"],
)
def test_eagle3_reduced_vocabulary_output_distribution_matches_target(
    setup, tree, quantization, stop, hybrid, monkeypatch
):
    """``chain-int8``: the head's weights quantized (``speculative_config["quantization"]``): sampled
    drafts come from the quantized head's distribution, which is what they report. ``chain-stop``: chains
    cut after a draft whose head distribution gives its top token less than 0.35
    (``draft_stop_probability``), so steps draft 1 or 2 tokens. ``chain-hybrid``: the head as a member of
    the hybrid drafter beside suffix decoding and n-gram lookup, chosen per step by its top-1 probability
    (never by its sampled draft), skipped where a copier outranks it."""
    import specdec.drafters.eagle3 as eagle3

    drafted: list[int] = []
    with_probs = []
    draw = eagle3.draw_draft_tokens

    def recording(logits, reqs, drafts, bitmasks, generator):
        tokens, probs = draw(logits, reqs, drafts, bitmasks, generator)
        drafted.extend(tokens)
        with_probs.extend(p for p in probs if p is not None)
        return tokens, probs

    monkeypatch.setattr(eagle3, "draw_draft_tokens", recording)
    llm = make_llm(setup, tree, quantization, stop, hybrid)
    if quantization is not None:
        from specdec.quantization.linear import QuantizedLinear

        assert isinstance(llm.engine.drafter.head.lm_head, QuantizedLinear)
    counts = sample_counts(llm, NUM_CALLS, seed_base=7 * 10**6, greedy_chain=setup["greedy"])
    label = f"eagle3 {'tree' if tree else 'chain'}{'' if quantization is None else ' ' + quantization}"
    label += ("" if stop is None else f" stop {stop}") + (" hybrid" if hybrid else "")
    check_all(setup, counts, label)
    if hybrid:  # the head drafted, ranked by its top-1 probability's bucket
        assert llm.engine.drafter.report()["members"]["eagle3"]["num_chosen"] > 0
        assert {kind for kind, _ in llm.engine.drafter.calibration[0]} == {"prob"}
    stats = llm.engine.spec_stats
    print(f"[spec] {label}: {stats.as_dict()}")
    assert stats.num_drafts > NUM_CALLS * BATCH // 4
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_position[1] > 0
    if stop is not None:  # some chains were cut after one draft, others went on to K
        assert stats.num_drafts < stats.num_draft_tokens < K * stats.num_drafts
    outside = [t for t in range(V) if t not in DRAFT_VOCAB]
    if not tree:  # sampled chains: drafts and their distributions stay in the draft vocabulary
        assert len(with_probs) > NUM_CALLS * BATCH // 4 and set(drafted) <= set(DRAFT_VOCAB)
        assert max(float(p[outside].max()) for p in with_probs[:2000]) == 0.0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_unmasked_draft_probs_fail_the_same_test(setup, monkeypatch):
    import specdec.drafters.eagle3 as eagle3

    draw = eagle3.draw_draft_tokens

    def lying(logits, reqs, drafts, bitmasks, generator):
        tokens, probs = draw(logits, reqs, drafts, bitmasks, generator)
        masked = torch.isinf(logits)
        lowest = logits.masked_fill(masked, float("inf")).amin(-1, keepdim=True)
        unmasked = torch.softmax(torch.where(masked, lowest, logits), dim=-1)  # T = 1: no other processing
        return tokens, [None if p is None else unmasked[i] for i, p in enumerate(probs)]

    monkeypatch.setattr(eagle3, "draw_draft_tokens", lying)
    llm = make_llm(setup, tree=False)
    counts = sample_counts(llm, NUM_CONTROL_CALLS, seed_base=9 * 10**6, temperatures=(1.0,))
    res = assert_differs(setup["exact"][1.0], counts[1.0], label="control: unmasked draft_probs, T=1.0")
    assert res.pvalue < ALPHA * 1e-3


# ---------------------------------------------------------------- the EAGLE-2 head, reduced vocabulary
NUM_EAGLE_CALLS = 8  # 20,000 sampled requests per mode


@pytest.fixture(scope="module")
def eagle_head(setup):
    """A random EAGLE-2 head for the same tiny target (drafting over ``DRAFT_VOCAB`` via ``draft_vocab``)."""
    return save_random_eagle_head(setup["target"], setup["target"].parent / "eagle_head")


def make_eagle_llm(setup, head, tree: bool) -> LLM:
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": K, "draft_vocab": DRAFT_VOCAB}
    if tree:
        spec.update(tree="dynamic", tree_topk=2, max_tree_nodes=4)
    n = BATCH + NUM_GREEDY
    return LLM(
        setup["target"], skip_tokenizer_init=True, speculative_config=spec, seed=4321, block_size=4,
        num_kv_blocks=4 * n + 16, max_model_len=32, max_num_seqs=n,
        max_num_batched_tokens=n * (len(PROMPT) + 8),
    )  # fmt: skip


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_eagle_reduced_vocabulary_output_distribution_matches_target(setup, eagle_head, tree):
    """The EAGLE-2 head over a 5-of-8-token ``draft_vocab``: deterministic drafts (top-1 chains, top-k
    trees) from the reduced LM head, every draft inside the vocabulary; the first three tokens follow the
    target's exact distribution."""
    llm = make_eagle_llm(setup, eagle_head, tree)
    drafted: list[int] = []
    drafter = llm.engine.drafter
    to_target = drafter._to_target

    def recording(indices):
        ids = to_target(indices)
        drafted.extend(ids.flatten().tolist())
        return ids

    drafter._to_target = recording
    counts = sample_counts(llm, NUM_EAGLE_CALLS, seed_base=11 * 10**6, greedy_chain=setup["greedy"])
    label = f"eagle draft_vocab {'tree' if tree else 'chain'}"
    check_all(setup, counts, label)
    stats = llm.engine.spec_stats
    assert stats.num_drafts > NUM_EAGLE_CALLS * BATCH // 4
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert drafted and set(drafted) <= set(DRAFT_VOCAB)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_eagle_drafts_reported_as_sampled_fail_the_same_test(setup, eagle_head, monkeypatch):
    """Negative control: the reduced head's top-1 drafts reported with the head's softmax over the draft
    vocabulary as ``draft_probs`` (as if sampled from it) — a deterministic draft claimed to be a draw —
    must be rejected."""
    from specdec.drafters.eagle import EagleDrafter

    choose = EagleDrafter._choose

    def claiming(self, logits, batch, proposals):
        tokens = choose(self, logits, batch, proposals)
        full = torch.zeros(logits.shape[0], V)
        full[:, self.vocab.ids] = torch.softmax(logits.float(), dim=-1)
        for proposal, row in zip(proposals, full):
            prev = proposal.draft_probs
            proposal.draft_probs = row[None] if prev is None else torch.cat([prev, row[None]])
        return tokens

    monkeypatch.setattr(EagleDrafter, "_choose", claiming)
    llm = make_eagle_llm(setup, eagle_head, tree=False)
    counts = sample_counts(llm, NUM_CONTROL_CALLS, seed_base=13 * 10**6, temperatures=(1.0,))
    res = assert_differs(
        setup["exact"][1.0], counts[1.0], label="control: top-1 drafts claimed as draws, T=1.0"
    )
    assert res.pvalue < ALPHA * 1e-3
