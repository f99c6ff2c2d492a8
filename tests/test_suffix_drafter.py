"""Suffix decoding's data structures and drafter (no model): tries, drafts, the global cache's memory
bound and LRU eviction (property-tested), the cross-request knob, incremental updates, ConfigErrors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sampling.params import SamplingParams
from sampling.token_tree import TokenTree
from specdec.config import SpeculativeConfig
from specdec.drafters.base import DrafterContext, DraftProposal
from specdec.drafters.suffix import SuffixDrafter
from specdec.drafters.suffix_tree import SuffixCache, SuffixTrie, draft_from
from specdec.errors import ConfigError
from specdec.request import Request, RequestStatus


def _request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=100), 0)


def _drafter(**fields) -> SuffixDrafter:
    k = fields.pop("k", 4)
    config = SpeculativeConfig("suffix", k, **fields)
    return SuffixDrafter(DrafterContext(None, config, None, torch.float32, torch.device("cpu"), None))  # type: ignore[arg-type]


def _finish(drafter: SuffixDrafter, req: Request) -> None:
    req.status = RequestStatus.FINISHED_LENGTH
    drafter.reset(req)


# ------------------------------------------------------------------------------------------ the trie
def test_trie_counts_every_substring_up_to_its_depth():
    trie = SuffixTrie(3)
    trie.insert([1, 2, 1, 2])
    count = trie.count
    assert count[trie.find([1])] == 2 and count[trie.find([1, 2])] == 2 and count[trie.find([2, 1])] == 1
    assert count[trie.find([1, 2, 1])] == 1 and trie.find([1, 2, 1, 2]) is None  # deeper than 3
    # 1, 2, 12, 21, 121, 212 (substrings of length <= 3)
    assert trie.num_nodes == 6
    trie.remove([1, 2, 1, 2])
    assert trie.num_nodes == 0 and trie.to_dict() == {}


def test_chain_follows_the_most_frequent_continuation_and_tree_ranks_by_path_probability():
    trie = SuffixTrie(8)
    trie.insert([5, 1, 2, 5, 1, 2, 5, 1, 3, 5])
    node = trie.find([5])  # 5 is followed by 1, 1, 1; 5 1 by 2, 2, 3
    chain = draft_from(trie, node, 4, 4, 0.0, False, 1)
    assert chain.token_ids == [1, 2, 5, 1] and chain.parents is None
    tree = draft_from(trie, node, 3, 4, 0.2, True, 1)
    assert tree.token_ids == [1, 2, 5, 3] and tree.parents == [-1, 0, 1, 0]
    assert tree.score == pytest.approx(1 + 2 / 3 + 2 / 3 + 1 / 3)
    TokenTree(tuple(tree.token_ids), tuple(tree.parents))  # a valid tree for the verifier
    assert draft_from(trie, node, 3, 4, 0.5, True, 1).token_ids == [1, 2, 5]  # 3 is below min_prob


# ------------------------------------------------------------------------------------------ the cache
sequences = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(seqs=sequences, max_nodes=st.integers(0, 80), touches=st.lists(st.integers(0, 11), max_size=6))
def test_cache_stays_within_its_node_budget_and_evicts_least_recently_used(seqs, max_nodes, touches):
    """At every moment (inserts included) the trie has at most ``max_nodes`` nodes; after every
    operation it equals a trie built afresh from the sequences kept, and those are the most recently
    used ones that fit; a sequence too large on its own evicts nothing."""
    cache = SuffixCache(4, max_nodes)
    peak = [0]
    extend = cache.trie.extend

    def tracked(*args, **kwargs):
        out = extend(*args, **kwargs)
        peak[0] = max(peak[0], cache.trie.num_nodes)
        return out

    cache.trie.extend = tracked
    order: list[int] = []  # ids, least recently used first (the model of the LRU)
    for seq in seqs:
        for t in touches:
            if t in order:
                cache.touch(t)
                order.remove(t)
                order.append(t)
        before = list(cache.entries)
        got = cache.add(seq)
        assert cache.num_nodes <= max_nodes and peak[0] <= max_nodes
        fresh = SuffixTrie(4)
        for kept in cache.entries.values():
            fresh.insert(kept)
        assert cache.trie.to_dict() == fresh.to_dict() and cache.num_nodes == fresh.num_nodes
        _check_node_ids(cache.trie)
        if got is not None:
            order.append(got)
        kept_ids = list(cache.entries)
        assert kept_ids == order[len(order) - len(kept_ids) :]  # a suffix of the LRU order: the newest
        order = kept_ids
        if got is None:
            single = SuffixTrie(4)
            single.insert(seq)
            assert max_nodes == 0 or single.num_nodes > max_nodes
            assert list(cache.entries) == before  # refused without evicting anything


def _check_node_ids(trie: SuffixTrie) -> None:
    """Every node id is either reachable from the root (with a count > 0) or free, never both: removed
    nodes' ids are reused, so a stale one would alias a live node."""
    reachable: list[int] = []
    stack = [trie.root]
    while stack:
        for child in (trie.children(stack.pop()) or {}).values():
            reachable.append(child)
            stack.append(child)
    assert len(reachable) == len(set(reachable)) == trie.num_nodes
    assert all(trie.count[n] > 0 for n in reachable) and not set(reachable) & set(trie._free)
    assert len(trie.count) == 1 + trie.num_nodes + len(trie._free)


def _stale_nodes(cache: SuffixCache) -> list[tuple[list[int], int]]:
    """``(path, seq)`` of every node of the cache whose ``seq`` is not a cached sequence containing the
    node's string."""
    bad = []

    trie = cache.trie

    def walk(node: int, path: list[int]) -> None:
        for t, child in (trie.children(node) or {}).items():
            kept = cache.entries.get(trie.seq[child])
            p = [*path, t]
            if kept is None or not any(kept[i : i + len(p)] == p for i in range(len(kept))):
                bad.append((p, trie.seq[child]))
            walk(child, p)

    walk(cache.trie.root, [])
    return bad


@settings(max_examples=60, deadline=None)
@given(seqs=sequences, max_nodes=st.integers(1, 80), touches=st.lists(st.integers(0, 11), max_size=6))
def test_after_evictions_every_node_names_a_live_sequence_through_it(seqs, max_nodes, touches):
    """Issue #8: a node's ``seq`` (the sequence a draft from it touches) never names an evicted sequence:
    eviction re-points the nodes that named it to a live sequence through them."""
    cache = SuffixCache(3, max_nodes)
    for i, seq in enumerate(seqs):
        for t in touches[i % 2 :: 2]:  # older sequences become recently used: LRU order is not id order
            cache.touch(t)
        cache.add(seq)
        assert _stale_nodes(cache) == []
        for node, ends in cache._ends.items():  # its records of sequence ends: live nodes and sequences
            assert cache.trie.count[node] > 0 and all(
                i in cache.entries for i in ([ends] if isinstance(ends, int) else ends)
            )
    while cache.entries:
        cache.evict()
        assert _stale_nodes(cache) == []
        _check_node_ids(cache.trie)
    assert not cache._ends and cache.num_nodes == 0


def test_drafting_after_an_eviction_touches_a_live_source():
    d = _drafter(suffix_share_across_requests=True, suffix_cache_max_nodes=40, suffix_max_match=2, k=1)
    _finish(d, _request([7, 8, 9, 10], "a"))  # 9 nodes (depth 3)
    _finish(d, _request([7, 8, 9, 10, 11], "b"))  # 3 more; every node of a now names b, the latest
    d.cache.touch(0)  # a is used: b is now the least recently used
    _finish(d, _request(list(range(20, 31)), "c"))  # 30 nodes: b is evicted, a fits
    shared = d.cache.trie
    assert list(d.cache.entries) == [0, 2] and shared.count[shared.find([7, 8])] == 1
    assert shared.seq[shared.find([7, 8])] == 0  # a, not the evicted b
    assert d.draft(_request([1, 7, 8], "q"), 1, 0).token_ids == [9]
    assert list(d.cache.entries) == [2, 0]  # a, the source, was touched


def test_drafting_from_the_cache_touches_the_source():
    d = _drafter(suffix_share_across_requests=True, suffix_cache_max_nodes=200, suffix_spec_factor=1.0)
    first = _request([7, 8, 9, 10, 11, 12], "a")
    _finish(d, first)
    second = _request([20, 21, 22, 23, 24, 25], "b")
    _finish(d, second)
    assert list(d.cache.entries) == [0, 1]
    q = _request([1, 7, 8], "c")
    assert d.draft(q, 3, 0).token_ids == [9, 10]  # a 2-token match: budget 2
    assert list(d.cache.entries) == [1, 0]  # "a" drafted: now the most recently used
    assert d.num_global_drafts == 1


# ------------------------------------------------------------------------------------------ the drafter
def test_drafts_from_the_request_itself_incrementally():
    d = _drafter(k=4, suffix_spec_factor=1.0)
    req = _request([1, 2, 3, 4, 5, 6, 1, 2])
    assert d.draft(req, 4, 0).token_ids == [3, 4]  # a 2-token match: budget ceil(1.0 * 2) = 2
    state = d.states.peek(req)
    nodes = state.num_nodes
    req.token_ids.extend([3, 4])
    assert d.draft(req, 4, 0).token_ids == [5, 6, 1, 2]
    assert state.num_indexed == 10
    assert state.num_nodes - nodes <= 2 * d.depth  # O(depth) new nodes per token, no rebuild
    assert d.draft(req, 0, 0) is None


def test_a_request_is_indexed_only_when_it_drafts_and_reports_its_backlog():
    from specdec.drafters.base import DraftInput

    d = _drafter()
    req = _request(list(range(50)) * 2)
    assert d.draft_backlog(req, 40) == 39  # a first draft after the first chunk would index 39 + 1
    assert d.propose([DraftInput(req, 40, 0, 0)]) == [DraftProposal([])]  # a prompt chunk: no drafts
    assert d.states.peek(req) is None and (d.catch_up_s, d.catch_up_tokens) == (0.0, 0)  # not indexed
    req.num_computed_tokens = 40
    assert d.draft_backlog(req, 60) == 99
    (proposal,) = d.propose([DraftInput(req, 60, 4, 0)])  # last chunk: indexes everything, drafts
    assert d.states.peek(req).num_indexed == 100 and proposal.token_ids == [0, 1, 2, 3]
    assert d.catch_up_tokens == 99 and d.catch_up_s > 0
    req.num_computed_tokens = 100
    req.token_ids.append(0)
    assert d.draft_backlog(req, 1) == 0  # drafting every step: one token a step, no backlog
    d.propose([DraftInput(req, 1, 4, 0)])
    assert (d.catch_up_s, d.catch_up_tokens) == (0.0, 0) and d.states.peek(req).num_indexed == 101
    req.token_ids.extend([1, 2, 3])  # three steps held back by a policy: not indexed
    req.num_computed_tokens = 103
    assert d.propose([DraftInput(req, 1, 0, 0)]) == [DraftProposal([])]
    assert d.states.peek(req).num_indexed == 101 and d.draft_backlog(req, 1) == 2


def test_spec_factor_and_tree_budget():
    req = _request([1, 2, 3, 4, 5, 6, 1, 2])
    assert _drafter(suffix_spec_factor=0.5).draft(req, 4, 0).token_ids == [3]
    assert _drafter(suffix_spec_factor=4.0).draft(req, 4, 0).token_ids == [3, 4, 5, 6]
    t = _drafter(tree="dynamic", max_tree_nodes=4, suffix_spec_factor=8.0)
    tree_req = _request([8, 1, 2, 3, 8, 1, 2, 4, 8, 1, 2])  # 8 1 2 was followed by 3, then by 4
    draft = t.draft(tree_req, 2, 4)  # depth 2, 4 nodes; every path has probability 1/2
    assert draft.match_length == 3 and draft.score == pytest.approx(2.0)
    assert draft.token_ids == [4, 8, 3, 8] and draft.parents == [-1, 0, -1, 2]  # the more recent first


def test_requests_do_not_draft_from_each_other_unless_enabled():
    for share in (False, True):
        d = _drafter(suffix_share_across_requests=share, suffix_spec_factor=1.0)
        a = _request([11, 12, 13, 14, 15, 16, 17], "a")
        d.draft(a, 4, 0)
        _finish(d, a)
        b = _request([3, 11, 12, 13], "b")
        got = d.draft(b, 4, 0)
        if share:
            assert got.token_ids == [14, 15, 16] and d.cache.num_tokens == 7  # a 3-token match
        else:
            assert got is None and d.cache is None


def test_preempted_and_failed_requests_do_not_join_the_cache():
    d = _drafter(suffix_share_across_requests=True)
    a = _request([1, 2, 3], "a")
    a.status = RequestStatus.PREEMPTED
    d.reset(a)
    a.status = RequestStatus.FINISHED_ERROR
    d.reset(a)
    assert not d.cache.entries and d.states.peek(a) is None


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("suffix_max_match", 0, "suffix_max_match must be an integer in"),
        ("suffix_max_match", 2.5, "suffix_max_match must be an integer in"),
        ("suffix_min_token_prob", 1.5, "suffix_min_token_prob must be a number in"),
        ("suffix_spec_factor", 0, "suffix_spec_factor must be a finite number > 0"),
        ("suffix_spec_factor", float("inf"), "suffix_spec_factor must be a finite number > 0"),
        ("suffix_accept_threshold", "fast", 'suffix_accept_threshold must be "auto" or a number in'),
        ("suffix_accept_threshold", 1.5, 'suffix_accept_threshold must be "auto" or a number in'),
        ("suffix_accept_threshold", True, 'suffix_accept_threshold must be "auto" or a number in'),
        ("suffix_accept_threshold", float("nan"), 'suffix_accept_threshold must be "auto" or a number in'),
        ("suffix_cache_max_nodes", -1, "suffix_cache_max_nodes must be an integer >= 0"),
        ("suffix_share_across_requests", "yes", "suffix_share_across_requests must be a bool"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_field(field, value, message):
    for method in ("suffix", "hybrid"):
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig(method, **{field: value})


def test_a_fixed_accept_threshold_with_a_tree_is_refused():
    """The chain cut applies to chains; with a tree a number would be silently ignored."""
    for method in ("suffix", "hybrid"):
        with pytest.raises(ConfigError, match="suffix_accept_threshold cuts chains"):
            SpeculativeConfig(method, tree="dynamic", suffix_accept_threshold=0.2)
        assert SpeculativeConfig(method, tree="dynamic").suffix_accept_threshold == "auto"


def test_suffix_fields_belong_to_suffix_and_hybrid_and_trees_are_dynamic():
    with pytest.raises(ConfigError, match="applies to method 'suffix' or 'hybrid' only"):
        SpeculativeConfig("ngram", suffix_max_match=4)
    with pytest.raises(ConfigError, match="tree='static' needs method"):
        SpeculativeConfig("suffix", tree="static")
    with pytest.raises(ConfigError, match="takes no model"):
        SpeculativeConfig("suffix", model="x")
    for bad, message in (
        ([], "non-empty list"),
        (["suffix", "suffix"], "distinct"),
        (["nope"], "hybrid_members: .*must be one of"),
        (["draft_model"], "'draft_model' drafts with a model of its own"),
        (["quantized_self", "ngram"], "'quantized_self' drafts with a model"),  # registered with none to load
        (["eagle", "medusa", "ngram"], r"at most one learned head .*\['eagle', 'medusa'\]"),
        (["ngram", ["suffix"]], r"must list drafter names \(str\), got \['suffix'\]"),
        (["hybrid"], "cannot contain"),
    ):
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig("hybrid", hybrid_members=bad)
    # max_tree_nodes' default: 15 drafts, 16 rows with the root
    assert SpeculativeConfig("suffix", tree="dynamic").num_draft_slots == 15
    # A learned member: the config's model is its heads (a built-in head when None); without one, no model.
    from specdec.drafters.registry import model_method

    with pytest.raises(ConfigError, match="takes no model"):
        SpeculativeConfig("hybrid", model="x")
    learned = SpeculativeConfig(
        "hybrid", hybrid_members=["suffix", "eagle"], model="my-head", draft_vocab=[1, 2]
    )
    assert model_method(learned) == ("heads", "eagle")
    assert model_method(SpeculativeConfig("hybrid")) == ("none", "hybrid")
    assert model_method(SpeculativeConfig("eagle")) == ("heads", "eagle")


def test_hydra_and_cli_take_suffix_and_hybrid():
    from hydra import compose, initialize_config_module

    from experiments.config import register_configs, to_experiment_config
    from specdec.cli import build_parser

    register_configs()
    with initialize_config_module("experiments.conf", version_base=None):
        suffix = to_experiment_config(
            compose("config", overrides=["drafter=suffix", "drafter.share_across_requests=true"])
        )
        hybrid = to_experiment_config(compose("config", overrides=["drafter=hybrid", "drafter.tree=dynamic"]))
        learned = to_experiment_config(
            compose(
                "config",
                overrides=["drafter=hybrid", "drafter.members=[eagle,suffix]", "drafter.draft_vocab=[1,2,3]"],
            )
        )
    spec = learned.drafter.speculative_config()
    assert spec["hybrid_members"] == ["eagle", "suffix"] and spec["draft_vocab"] == [1, 2, 3]
    assert "model" not in spec  # the target's built-in head
    SpeculativeConfig(**spec)
    spec = suffix.drafter.speculative_config()
    assert spec["method"] == "suffix" and spec["suffix_share_across_requests"] is True
    assert SpeculativeConfig(**spec).suffix_max_match == 16
    spec = hybrid.drafter.speculative_config()
    assert spec["hybrid_members"] == ["suffix", "ngram"] and spec["tree"] == "dynamic"
    SpeculativeConfig(**spec)
    args = build_parser().parse_args(["generate", "--drafter", "suffix", "--suffix-share-across-requests"])
    assert args.drafter == "suffix" and args.suffix_share_across_requests


def test_per_request_metrics_have_the_hybrids_keys():
    """Issue #11: ``method="suffix"`` fills ``request.drafter_metrics["suffix"]`` (``metrics["drafter"]``)
    with the figures the hybrid reports per member; as a hybrid member it leaves them to the hybrid."""
    from specdec.drafters.base import DraftInput
    from specdec.drafters.draft_stats import MemberStats

    d = _drafter(k=4, suffix_spec_factor=1.0)
    req = _request([1, 2, 3, 4, 5, 6, 1, 2])
    (p,) = d.propose([DraftInput(req, 8, 4)])
    assert p.token_ids == [3, 4]
    req.token_ids.extend([3, 9])  # one accepted, then 9
    d.on_verified(req, 2, 1)
    (p,) = d.propose([DraftInput(req, 1, 4)])  # no earlier 9: nothing drafted
    assert p.token_ids == []
    req.token_ids.extend([5])
    d.on_verified(req, 0, 0)
    req.token_ids.extend([6, 1, 2])
    (p,) = d.propose([DraftInput(req, 1, 4)])
    assert p.token_ids == [3, 9, 5, 6]  # what followed 5 6 1 2
    req.token_ids.extend([3, 9])  # the request's last step (max_tokens): no on_verified
    _finish(d, req)
    assert set(req.drafter_metrics) == {"suffix"}
    assert req.drafter_metrics["suffix"] == MemberStats(
        num_chosen=2, num_draft_tokens=6, num_accepted_tokens=3, hindsight_accepted=3
    )

    from specdec.drafters.hybrid import HybridDrafter

    config = SpeculativeConfig("hybrid", 4, hybrid_members=["suffix"], suffix_spec_factor=1.0)
    hybrid = HybridDrafter(DrafterContext(None, config, None, torch.float32, torch.device("cpu"), None))  # type: ignore[arg-type]
    req = _request([1, 2, 3, 4, 5, 6, 1, 2], "h")
    hybrid.propose([DraftInput(req, 8, 4)])
    req.token_ids.extend([3, 9])
    hybrid.on_verified(req, 2, 1)
    assert set(req.drafter_metrics) == {"suffix"}
    assert req.drafter_metrics["suffix"] == MemberStats(1, 2, 1, 0)  # the hybrid's counts only
