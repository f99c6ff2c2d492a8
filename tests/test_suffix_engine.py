"""Suffix decoding and the hybrid drafter through the real engine: greedy output equals plain decoding
(chains and token trees, with and without cross-request sharing, under a varying depth), and a
chi-square test of the sampled distribution (chains and trees) with negative controls that must fail.

False positives: each distribution test fails an exact engine with probability ``ALPHA`` = 1e-3 (the
chi-square test of :mod:`tests.stats`; nine such tests here: about 0.9 % per run of the file). Greedy
tests are deterministic. The negative controls must reach p < 1e-6; with their biases (accepting every
draft, keeping the target's row after a tree rejection, or accepting a union tree's first root child)
the observed p-values are far below that.
"""

from __future__ import annotations

import pytest
import torch

import sampling.tree_rejection_sampler as trs
from sampling.params import SamplingParams
from sampling.verifier import SpeculativeVerifier
from specdec import LLM
from tests.conftest import (
    first_three_logits,
    first_two_token_counts,
    save_random_eagle_head,
    save_target_and_draft,
)
from tests.stats import ALPHA, assert_differs, goodness_of_fit
from tests.test_rejection_sampler import AcceptEverything

V = 8
PROMPT = [3, 4, 5, 6, 7, 3, 4, 5]
BATCH = 48
CALLS = 50  # 2,400 samples of the first two tokens per test (64 cells, pooled below 5 expected)

pytestmark = pytest.mark.usefixtures("fast_cpu_settings")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("suffix")
    target = save_target_and_draft(root, V, 1, 2)
    l1, l2, _ = first_three_logits(target, PROMPT, V)
    exact = (torch.softmax(l1, -1)[:, None] * torch.softmax(l2, -1)).numpy()  # joint of t1, t2 at T = 1
    return {"target": root / "target", "exact": exact}


def _spec(method: str, tree: bool, share: bool, k: int = 3, **extra) -> dict:
    spec = {"method": method, "num_speculative_tokens": k, "suffix_share_across_requests": share, **extra}
    if tree:
        spec.update(tree="dynamic", max_tree_nodes=6)
    return spec


PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [1, 2, 1, 2, 1], [5, 6, 7, 5, 6], [2, 2, 3, 2, 2, 3, 2], [4, 1, 4, 1, 4, 1]]


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = [
        SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


CASES = [
    ("suffix", False, False, None),
    ("suffix", False, False, "cut"),
    ("suffix", False, True, None),
    ("suffix", True, True, None),
    ("suffix", True, True, "test_varying"),
    ("hybrid", False, True, None),
    ("hybrid", True, False, None),
]


@pytest.mark.parametrize("method, tree, share, policy", CASES)
def test_greedy_output_equals_plain_decoding(setup, method, tree, share, policy):
    import tests.test_policies  # noqa: F401  (registers the "test_varying" policy)

    common = dict(skip_tokenizer_init=True, block_size=4)
    base = _greedy(LLM(setup["target"], **common), PROMPTS)
    if policy == "cut":  # chains cut where a draft's estimated acceptance falls below 0.35
        spec = _spec(method, tree, share, suffix_accept_threshold=0.35)
    else:
        spec = _spec(method, tree, share, policy=policy or "static")
    llm = LLM(setup["target"], speculative_config=spec, **common)
    cuts: list[tuple[int, int]] = []  # (drafts offered, drafts kept) by the chain cut
    if policy == "cut":
        rule = llm.engine.drafter.length_rule
        length = rule.length
        rule.length = lambda p, n, counts=None: cuts.append((n, length(p, n, counts))) or cuts[-1][1]
    for _ in range(2):  # the second round drafts from the first's outputs when sharing
        assert _greedy(llm, PROMPTS) == base
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > 0
    if tree:
        assert stats.num_draft_nodes > stats.num_draft_tokens  # some steps verified branching trees
    drafter = llm.engine.drafter
    if method == "hybrid":
        report = drafter.report()
        assert sum(m["num_chosen"] for m in report["members"].values()) > 0
        assert report["oracle_steps"] > 0
        best_alone = max(m["hindsight_accepted"] for m in report["members"].values())
        assert report["oracle_accepted_tokens"] >= best_alone  # the oracle is at least the best member
        assert sum(m["num_chosen"] for m in report["members"].values()) == stats.num_drafts
        # the verifier's counts, but for each request's last step, cut by max_tokens
        chosen = sum(m["num_accepted_tokens"] for m in report["members"].values())
        assert stats.num_accepted_tokens - 3 * 2 * len(PROMPTS) <= chosen <= stats.num_accepted_tokens
    elif share:
        assert drafter.num_global_drafts > 0
    if policy == "cut":  # the cut shortened some chains, never to nothing, and learned from every chain
        assert any(kept < n for n, kept in cuts) and all(1 <= kept <= n for n, kept in cuts if n)
        # each request's last step (cut by max_tokens) reports no verification to the drafter
        assert stats.num_drafts - 2 * len(PROMPTS) <= drafter.length_rule.shared.steps <= stats.num_drafts


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_the_engine_hands_the_chain_cut_its_step_costs(setup, method):
    """``suffix_accept_threshold="auto"`` (the default): before the first step the engine profiles the
    target's step costs once and hands them to the suffix drafter (a hybrid's member); a fixed threshold
    asks for none, and the engine profiles nothing."""
    common = dict(skip_tokenizer_init=True, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(setup["target"], speculative_config=_spec(method, False, False), **common)
    llm.generate({"prompt_token_ids": PROMPTS[0]}, params)
    drafter = llm.engine.drafter
    suffix = drafter if method == "suffix" else drafter.members[0]
    assert llm.engine._step_costs is not None
    assert suffix.length_rule.row_cost is not None and suffix.length_rule.row_cost >= 0
    fixed = LLM(
        setup["target"], speculative_config=_spec(method, False, False, suffix_accept_threshold=0.2), **common
    )
    fixed.generate({"prompt_token_ids": PROMPTS[0]}, params)
    assert fixed.engine._step_costs is None and not fixed.engine.drafter.wants_step_costs


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_the_engine_hands_the_chain_cut_each_lone_decode_step(setup, method, caplog):
    """Each decode step of a lone request reaches the drafter as (rows, seconds), the rows being 1 plus
    the step's drafts: suffix decoding's observed row cost learns from them (through a hybrid too). A
    drafter that raises there is not asked again, and the output is unchanged."""
    common = dict(skip_tokenizer_init=True, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = _greedy(LLM(setup["target"], **common), PROMPTS[:1])
    llm = LLM(setup["target"], speculative_config=_spec(method, False, False), **common)
    drafter = llm.engine.drafter
    suffix = drafter if method == "suffix" else drafter.members[0]
    calls: list[tuple[int, float]] = []
    observe = suffix.observe_step_time
    suffix.observe_step_time = lambda n, s: calls.append((n, s)) or observe(n, s)
    distinct = [1, 2, 3, 4, 5, 6, 7]  # no repeat: the prompt's step drafts nothing
    llm.generate({"prompt_token_ids": distinct}, params)
    stats = llm.engine.spec_stats
    assert len(calls) == llm.engine.num_steps - 1  # every step but the prompt's
    assert sum(n - 1 for n, _ in calls) == stats.num_draft_tokens > 0
    assert all(1 <= n <= 4 and s > 0 for n, s in calls)
    # every step counted, bar steps left out as pauses (2x above the line), which the first 16 cannot be
    weight = suffix.length_rule.observed.weight
    assert len(calls) >= 16
    least, most = (sum(0.5 ** (i / 64) for i in range(n)) for n in (16, len(calls)))
    assert least - 1e-9 <= weight <= most + 1e-9
    calls.clear()
    twins = llm.generate([{"prompt_token_ids": distinct}] * 2, params)  # every step with both
    assert twins[0].outputs[0].token_ids == twins[1].outputs[0].token_ids and not calls

    def broken(n: int, s: float) -> None:
        raise RuntimeError("broken timer")

    suffix.observe_step_time = broken
    with caplog.at_level("WARNING"):
        assert _greedy(llm, PROMPTS[:1]) == base
        assert _greedy(llm, PROMPTS[:1]) == base
    assert sum("observe_step_time raised RuntimeError" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("method, threshold", [("suffix", 0.2), ("suffix", "auto"), ("hybrid", "auto")])
def test_a_seeded_request_repeats_under_the_chain_cut(setup, method, threshold):
    """The cut's shared counts grow with every request, and a sampled request draws one number per draft:
    a seeded request learns from its own chains alone (with ``"auto"``, at the profiled row cost, not
    the one observed from step times), and in a hybrid chooses its member without the engine-wide
    table, so it draws the same tokens alone, after other requests, and beside them (k = 3). Learning
    from the shared counts instead, the same request gave 2 different outputs in these 4 repeats (and 3
    with ``"auto"``)."""
    llm = LLM(
        setup["target"],
        skip_tokenizer_init=True,
        block_size=4,
        speculative_config=_spec(method, False, False, suffix_accept_threshold=threshold),
    )
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    outs = set()
    for _ in range(4):
        outs.add(tuple(llm.generate({"prompt_token_ids": PROMPTS[0]}, seeded)[0].outputs[0].token_ids))
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], others)  # the shared counts move on
    beside = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [seeded] + [others] * 4)
    outs.add(tuple(beside[0].outputs[0].token_ids))
    assert len(outs) == 1 and len(next(iter(outs))) == 40
    drafter = llm.engine.drafter
    suffix = drafter if method == "suffix" else drafter.members[0]
    assert suffix.length_rule.shared.steps > 0 and not suffix._own_counts
    if method == "hybrid":
        assert any(drafter.calibration[0].values())  # the table other requests choose with exists


@pytest.fixture(scope="module")
def eagle_head(setup):
    """A random EAGLE head for the tiny target: a learned hybrid member whose drafts are mostly wrong."""
    return save_random_eagle_head(setup["target"], setup["target"].parent / "eagle_head")


def _learned_spec(head, tree: bool, k: int = 3, **extra) -> dict:
    # EAGLE first: before any score the hybrid tries members in order, so the head drafts from the start.
    members = ["eagle", "suffix", "ngram"]
    return _spec("hybrid", tree, False, k=k, hybrid_members=members, model=str(head), **extra)


@pytest.mark.parametrize("union", [False, True], ids=["best-alone", "union"])
def test_the_union_of_the_members_chains_reaches_the_oracle(setup, eagle_head, union):
    """``hybrid_union``: the members' chains go in as one tree (``k × 3`` slots), so every step accepts
    its best member's hindsight drafts: greedy output equals plain decoding, and the verifier's accepted
    drafts equal the oracle's (the best member per step in hindsight), up to what ``max_tokens`` cut from
    each request's last step (at most k each; the oracle counts output tokens only). Submitting the best
    proposal alone stays below the oracle on the same prompts; the union verified branching trees, and
    each member was told its own path's counts (their sum exceeds the verifier's where paths share)."""
    common = dict(skip_tokenizer_init=True, block_size=4)
    base = _greedy(LLM(setup["target"], **common), PROMPTS)
    spec = _learned_spec(eagle_head, False, hybrid_union=union, hybrid_skip_outranked=False)
    llm = LLM(setup["target"], speculative_config=spec, **common)
    assert llm.engine.num_draft_slots == (9 if union else 3)
    assert _greedy(llm, PROMPTS) == base
    stats, report = llm.engine.spec_stats, llm.engine.drafter.report()
    oracle = report["oracle_accepted_tokens"]
    assert report["oracle_steps"] == stats.num_drafts
    if union:
        assert oracle <= stats.num_accepted_tokens <= oracle + 3 * len(PROMPTS)
        assert stats.num_draft_nodes > stats.num_draft_tokens
        members = report["members"]
        assert all(m["num_chosen"] > 0 for m in members.values())
        assert sum(m["num_accepted_tokens"] for m in members.values()) > stats.num_accepted_tokens
    else:
        assert stats.num_accepted_tokens < oracle
        assert stats.num_draft_nodes == stats.num_draft_tokens  # chains only


@pytest.mark.parametrize(
    "tree, quantization", [(False, None), (True, None), (False, "int8")], ids=["chain", "tree", "chain-int8"]
)
def test_a_learned_member_keeps_greedy_output_exact(setup, eagle_head, tree, quantization):
    """Greedy output equals plain decoding with the head as a member (chains, trees, the head's weights in
    int8), and the choice reads every member's per-step confidence: the head's first-draft probability,
    the copiers' match lengths, each in the engine-wide calibration table."""
    common = dict(skip_tokenizer_init=True, block_size=4)
    base = _greedy(LLM(setup["target"], **common), PROMPTS)
    spec = {**_learned_spec(eagle_head, tree), "quantization": quantization}
    llm = LLM(setup["target"], speculative_config=spec, **common)
    drafter = llm.engine.drafter
    assert llm.engine.drafter.uses_hidden_states  # the target's forward returns the head's features
    assert _greedy(llm, PROMPTS) == base
    head_buckets, *copier_buckets = ({kind for kind, _ in table} for table in drafter.calibration)
    assert head_buckets == {"prob"} and copier_buckets == [{"match"}, {"match"}]
    if quantization is not None:
        from specdec.quantization.linear import QuantizedLinear

        assert any(isinstance(m, QuantizedLinear) for m in drafter.members[0].head.modules())
    report = drafter.report()["members"]
    assert report["eagle"]["num_chosen"] > 0 and report["eagle"]["hindsight_accepted"] > 0
    assert report["suffix"]["num_chosen"] + report["ngram"]["num_chosen"] > 0  # and the copiers took over
    assert sum(m["num_chosen"] for m in report.values()) == llm.engine.spec_stats.num_drafts
    from specdec.engine.build import drafter_modules

    assert drafter_modules(drafter) == [drafter.members[0].head]  # the head takes the CPU linears


@pytest.mark.parametrize("method, names", [("hybrid", {"suffix", "ngram"}), ("suffix", {"suffix"})])
def test_per_request_drafter_metrics_say_which_member_drafted(setup, method, names):
    """``metrics["drafter"]``: the hybrid's figures per member; suffix decoding alone reports the same
    figures under its own name (issue #11)."""
    llm = LLM(
        setup["target"],
        skip_tokenizer_init=True,
        block_size=4,
        speculative_config=_spec(method, False, False),
    )
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )[0]
    members = out.metrics["drafter"]
    assert set(members) == names
    keys = {"num_chosen", "num_draft_tokens", "num_accepted_tokens", "hindsight_accepted"}
    assert all(set(m) == keys for m in members.values())
    assert sum(m["num_chosen"] for m in members.values()) == out.metrics["num_drafts"]
    accepted = sum(m["num_accepted_tokens"] for m in members.values())
    assert out.metrics["num_accepted_tokens"] - 3 <= accepted <= out.metrics["num_accepted_tokens"]


# ----------------------------------------------------------------------------------- distribution
def _llm(setup, spec: dict) -> LLM:
    return LLM(
        setup["target"], skip_tokenizer_init=True, seed=7, block_size=4, max_model_len=32,
        max_num_batched_tokens=512, speculative_config=spec,
    )  # fmt: skip


# Sharing on, with a small cache: drafts come from earlier samples and change as the cache evicts.
# Trees keep SuffixDecoding's budget of 1 × the match length: the tree control's power (p < 1e-6) was
# established with it (with a budget of 4 × it read p = 4e-6 once). "suffix-chain-cut" cuts chains where
# a draft's estimated acceptance falls below 0.35 (:mod:`specdec.drafters.draft_length`): chains of 1-3.
TREE = dict(suffix_min_token_prob=0.0, suffix_spec_factor=1.0)
DIST_CASES = {
    "suffix-chain": _spec("suffix", False, True, k=2, suffix_cache_max_nodes=400),
    "suffix-chain-cut": _spec(
        "suffix", False, True, k=3, suffix_cache_max_nodes=400, suffix_accept_threshold=0.35
    ),
    "suffix-tree": _spec("suffix", True, True, k=2, suffix_cache_max_nodes=400, **TREE),
    "hybrid-chain": _spec("hybrid", False, True, k=2, suffix_cache_max_nodes=400),
    "hybrid-tree": _spec("hybrid", True, True, k=2, suffix_cache_max_nodes=400, **TREE),
    # The members' chains (suffix, n-gram) verified as one tree: a branching tree where they differ.
    "hybrid-union": _spec("hybrid", False, True, k=2, suffix_cache_max_nodes=400, hybrid_union=True, **TREE),
}


@pytest.mark.parametrize("name", list(DIST_CASES))
def test_sampling_matches_the_target(setup, name):
    llm = _llm(setup, DIST_CASES[name])
    counts = first_two_token_counts(llm, PROMPT, V, BATCH, CALLS)
    res = goodness_of_fit(setup["exact"], counts)
    print(f"[gof] {name}: {res.describe()}")
    assert res.pvalue >= ALPHA, res.describe()
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if "tree" in name or "union" in name:
        assert stats.num_draft_nodes > stats.num_draft_tokens
    drafter = llm.engine.drafter
    suffix = drafter if name.startswith("suffix") else drafter.members[0]
    assert suffix.cache.num_evicted > 0 and suffix.num_global_drafts > 0


@pytest.mark.parametrize(
    "tree, union", [(False, False), (True, False), (False, True)], ids=["chain", "tree", "union"]
)
def test_sampling_with_a_learned_member_matches_the_target(setup, eagle_head, tree, union):
    """``union``: the members' chains verified as one tree (``hybrid_union``): the random head's chains
    mostly differ from the copiers', so many steps verify a branching tree (EAGLE's chains are its
    argmax drafts, deterministic: they join the union; a sampled chain that ranks first would go alone,
    tests/test_hybrid_drafter.py)."""
    llm = _llm(setup, _learned_spec(eagle_head, tree, k=2, hybrid_union=union))
    counts = first_two_token_counts(llm, PROMPT, V, BATCH, CALLS)
    res = goodness_of_fit(setup["exact"], counts)
    print(
        f"[gof] hybrid with an EAGLE member, {'union' if union else 'tree' if tree else 'chain'}: "
        f"{res.describe()}"
    )
    assert res.pvalue >= ALPHA, res.describe()
    members = llm.engine.drafter.report()["members"]
    assert members["eagle"]["num_chosen"] > 0 and members["eagle"]["num_accepted_tokens"] > 0
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if union:
        assert stats.num_draft_nodes > stats.num_draft_tokens  # some steps verified a union tree


def test_learned_member_negative_control_fails(setup, eagle_head):
    llm = _llm(setup, _learned_spec(eagle_head, False, k=2))
    llm.engine.verifier = AcceptEverything()
    counts = first_two_token_counts(llm, PROMPT, V, BATCH, CALLS, seed_base=10**6)
    res = assert_differs(setup["exact"], counts, label="hybrid with an EAGLE member, control")
    assert res.pvalue < ALPHA * 1e-3


class FirstChildAccepted(trs.TreeVerifier):
    """Negative control for token trees: the first root child is accepted outright, then one token is
    sampled from its row (the chain verifier beside it stays exact, so only union trees are biased)."""

    def verify_batch(self, target_probs, batch, default_generator=None):
        results, start = [], 0
        for x in batch:
            assert x.tree is not None
            gen = x.generator if x.generator is not None else default_generator
            child = x.tree.parents.index(-1)
            row = target_probs[start + 1 + child]
            final = int(torch.multinomial(row, 1, generator=gen))
            results.append(trs.TreeVerifyResult([x.tree.token_ids[child], final], 1, [child]))
            start += x.num_rows
        return results


def test_learned_member_union_negative_control_fails(setup, eagle_head):
    """The union with a random head: its chains mostly differ from the copiers', so many steps verify a
    tree; with those trees' first root child accepted outright (chains exact) the test must reject."""
    llm = _llm(setup, _learned_spec(eagle_head, False, k=2, hybrid_union=True))
    llm.engine.verifier = SpeculativeVerifier(tree=FirstChildAccepted())
    counts = first_two_token_counts(llm, PROMPT, V, BATCH, CALLS, seed_base=10**6)
    res = assert_differs(setup["exact"], counts, label="hybrid union with an EAGLE member, control")
    assert res.pvalue < ALPHA * 1e-3
    stats = llm.engine.spec_stats
    assert llm.engine.num_failed_requests == 0 and stats.num_draft_nodes > stats.num_draft_tokens


@pytest.mark.parametrize("name", ["suffix-chain", "suffix-chain-cut", "suffix-tree"])
def test_negative_controls_fail(setup, name, monkeypatch):
    llm = _llm(setup, DIST_CASES[name])
    if "tree" in name:  # after a rejection keep the target's row (no residual)
        monkeypatch.setattr(trs, "_normalise", lambda weights, fallback: fallback)
    else:
        llm.engine.verifier = AcceptEverything()
    counts = first_two_token_counts(llm, PROMPT, V, BATCH, CALLS, seed_base=10**6)
    res = assert_differs(setup["exact"], counts, label=f"{name} control")
    assert res.pvalue < ALPHA * 1e-3
