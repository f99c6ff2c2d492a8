"""The engine's step on a fake model runner (``tests/engine/fake_runner.py``): no model on disk.

Every greedy run is compared token for token with :func:`greedy_reference`, a plain Python loop over the
fake's logits table; the fake reads each row's context back from its simulated paged KV cache, so a wrong
token, slot, position, tree mask, compaction or rollback anywhere changes the logits (or raises
``FakeRunnerError``). Acceptance counters are checked exactly against a count of what each drafter must
get accepted. Everything goes through public constructor arguments and attributes (``LLMEngine.from_parts``,
``engine.verifier``, ``engine.spec_stats``, ``engine.scheduler``...).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from sampling.params import SamplingParams
from sampling.rejection_sampler import RejectionSampler, VerifyResult
from sampling.tree_rejection_sampler import TreeVerifier
from sampling.verifier import SpeculativeVerifier, Verifier, VerifyInput
from specdec.drafters.base import DrafterBase, DraftInput, DraftProposal
from specdec.request import Request, RequestStatus
from tests.engine.fake_runner import (
    EOS,
    VOCAB,
    FakeRunner,
    FakeRunnerError,
    assert_all_freed,
    features_of,
    greedy_reference,
    make_engine,
    run,
    run_requests,
)

K = 3

# Lengths 1 .. 17 across block boundaries (block_size 4): 1, 3, 4, 5, 8, 9, 13, 17.
PROMPTS = [[(5 * i + 3 * j + 1) % VOCAB for j in range(n)] for i, n in enumerate((1, 3, 4, 5, 8, 9, 13, 17))]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


# ------------------------------------------------------------------------------------------ drafters
class RecordingDrafter(DrafterBase):
    """Records every ``reset`` with the request's status at that moment."""

    def __init__(self) -> None:
        self.resets: list[tuple[str, RequestStatus]] = []

    def reset(self, request: Request) -> None:
        self.resets.append((request.request_id, request.status))


class ChainDrafter(RecordingDrafter):
    """Proposes ``max_drafts`` tokens: the first ``num_right`` are the reference's next tokens (all of them
    when None), the rest are wrong (the right token + 1)."""

    def __init__(self, num_right: int | None = None) -> None:
        super().__init__()
        self.num_right = num_right

    def drafts(self, x: DraftInput) -> list[int]:
        if x.max_drafts == 0:
            return []
        truth = greedy_reference(x.request.token_ids, x.max_drafts)
        right = len(truth) if self.num_right is None else self.num_right
        return [t if i < right else (t + 1) % VOCAB for i, t in enumerate(truth)]

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        return [DraftProposal(self.drafts(x)) for x in batch]


class TreeDrafter(RecordingDrafter):
    """Token trees in which the right token is the *last* child of its parent, after ``width - 1`` wrong
    siblings that each have a wrong child, on ``accept_depth`` levels: every accepted path is made of
    non-first nodes, so its K/V must be compacted before the next step."""

    def __init__(self, width: int, accept_depth: int) -> None:
        super().__init__()
        self.width = width
        self.accept_depth = accept_depth

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        out = []
        for x in batch:
            levels = min(x.max_drafts, self.accept_depth)
            truth = greedy_reference(x.request.token_ids, levels) if levels else []
            tokens: list[int] = []
            parents: list[int] = []
            parent = -1
            for right in truth:
                for w in range(self.width - 1):
                    wrong = (right + 1 + w) % VOCAB
                    tokens.append(wrong)
                    parents.append(parent)
                    tokens.append((wrong + 7) % VOCAB)
                    parents.append(len(tokens) - 2)
                tokens.append(right)
                parents.append(parent)
                parent = len(tokens) - 1
            out.append(DraftProposal(tokens, parents=parents))
        return out


def tree_spec(width: int, depth: int = 4) -> dict:
    """A config whose draft slots hold ``depth`` levels of :class:`TreeDrafter` trees (EAGLE's dynamic
    tree entry only sets the geometry: the drafter passed in proposes)."""
    return {
        "method": "eagle",
        "num_speculative_tokens": depth,
        "tree": "dynamic",
        "max_tree_nodes": depth * (2 * (width - 1) + 1),
    }


# ------------------------------------------------------------------------- expected acceptance counts
def expected_counts(
    max_tokens: int, k: int, per_step: Callable[[int], tuple[int, int]]
) -> tuple[int, int, int]:
    """``(draft steps, draft tokens, accepted tokens)`` of one request of ``max_tokens`` whose drafts are
    ``d = min(k, max_tokens left - 1)`` deep at each step (the scheduler's depth), ``per_step(d)`` giving
    the draft tokens verified and accepted then."""
    steps = drafted = acc = 0
    left = max_tokens
    while left > 0:
        d = min(k, left - 1)
        n, a = per_step(d) if d else (0, 0)
        if n:
            steps += 1
            drafted += n
            acc += a
        left -= a + 1
    return steps, drafted, acc


def chain_step(accepted: int | None) -> Callable[[int], tuple[int, int]]:
    """A chain of ``d`` drafts whose first ``accepted`` (all when None) are right."""
    return lambda d: (d, d if accepted is None else min(accepted, d))


def tree_step(
    width: int, accept_depth: int, max_nodes: int, nodes: bool = False
) -> Callable[[int], tuple[int, int]]:
    """A :class:`TreeDrafter` tree of ``min(d, accept_depth)`` levels, cut by the engine to its first
    ``max_nodes`` nodes (in order) of depth ``<= d``: its draft tokens as ``SpecStats`` counts them (the
    depth of the nodes kept; ``nodes``: their number) and the right tokens among them."""

    def step(d: int) -> tuple[int, int]:
        kept: list[tuple[int, bool]] = []  # (depth, is the right token)
        for level in range(1, min(d, accept_depth) + 1):
            for _ in range(width - 1):
                kept += [(level, False), (level + 1, False)]  # a wrong child and its child
            kept.append((level, True))
        kept = [x for x in kept if x[0] <= d][:max_nodes]
        drafted = len(kept) if nodes else max((depth for depth, _ in kept), default=0)
        return drafted, sum(right for _, right in kept)

    return step


def check_stats(
    engine, reqs: list[Request], max_tokens: list[int], k: int, per_step: Callable[[int], tuple[int, int]]
) -> None:
    """Each request's and the engine's acceptance counters equal :func:`expected_counts`."""
    total = [0, 0, 0]
    for r, m in zip(reqs, max_tokens):
        steps, drafted, acc = expected_counts(m, k, per_step)
        got = (r.spec_stats.num_drafts, r.spec_stats.num_draft_tokens, r.spec_stats.num_accepted_tokens)
        assert got == (steps, drafted, acc), r.request_id
        total = [total[0] + steps, total[1] + drafted, total[2] + acc]
    s = engine.spec_stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == tuple(total)


# -------------------------------------------------------------------------------------- (a) plain greedy
@pytest.mark.parametrize("budget", [5, 8, 512])
def test_plain_greedy_matches_reference(budget):
    engine = make_engine(max_num_batched_tokens=budget)
    max_tokens = [9 + 2 * i for i in range(len(PROMPTS))]
    got = run(engine, PROMPTS, [greedy(m) for m in max_tokens])
    assert got == [greedy_reference(p, m) for p, m in zip(PROMPTS, max_tokens)]
    log = engine.runner.segments_log
    assert max(n for _, _, n, _, _, _ in log) <= budget
    if budget < 17:  # the longest prompt was prefilled in chunks
        assert any(not sample for *_, sample, _ in log)
    assert engine.spec_stats is None
    assert_all_freed(engine)


@pytest.mark.parametrize("drafter", [None, "chain"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_cached_blocks_are_read_back(drafter, prefix_caching):
    """A second wave shares 2 to 4 full blocks with the first: with prefix caching its context is
    read from the first wave's blocks (and drafts never roll back into them)."""
    engine = make_engine(
        ChainDrafter(num_right=1) if drafter else None,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=8,
    )
    first = [PROMPTS[6], PROMPTS[7]]
    second = [PROMPTS[6][:8] + [30, 31, 0], PROMPTS[7][:12] + [9], PROMPTS[7] + [4, 4]]
    got1 = run(engine, first, greedy(12), request_ids=["a0", "a1"])
    got2 = run(engine, second, greedy(12), request_ids=["b0", "b1", "b2"])
    assert got1 == [greedy_reference(p, 12) for p in first]
    assert got2 == [greedy_reference(p, 12) for p in second]
    first_start = {}
    for rid, start, *_ in engine.runner.segments_log:
        first_start.setdefault(rid, start)
    if prefix_caching:
        assert engine.kv.num_prefix_hits == 8 + 12 + 16
        assert [first_start[r] for r in ("b0", "b1", "b2")] == [8, 12, 16]
    else:
        assert engine.kv.num_prefix_hits == 0
        assert all(v == 0 for v in first_start.values())
    assert_all_freed(engine)


# ------------------------------------------------------------------------------------ (b) chain drafters
@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_chain_accepts_everything(k):
    """Drafts equal to the reference's next tokens: same output, every draft accepted, τ = k + 1."""
    engine = make_engine(
        ChainDrafter(), {"method": "ngram", "num_speculative_tokens": k}, max_num_batched_tokens=12
    )
    max_tokens = [(k + 1) * (3 + i % 3) for i in range(len(PROMPTS))]
    reqs = run_requests(engine, PROMPTS, [greedy(m) for m in max_tokens])
    assert [r.output_token_ids for r in reqs] == [greedy_reference(p, m) for p, m in zip(PROMPTS, max_tokens)]
    s = engine.spec_stats
    steps = sum(m // (k + 1) for m in max_tokens)
    assert s.num_drafts == steps
    assert s.num_draft_tokens == s.num_accepted_tokens == k * steps
    assert s.accepted_per_position == [steps] * k
    assert s.mean_acceptance_length == k + 1
    check_stats(engine, reqs, max_tokens, k, chain_step(None))
    assert_all_freed(engine)


@pytest.mark.parametrize("k", [1, 3])
def test_oracle_chain_with_uneven_max_tokens(k):
    """max_tokens that are not multiples of k + 1: the last steps draft fewer, all still accepted."""
    engine = make_engine(
        ChainDrafter(), {"method": "ngram", "num_speculative_tokens": k}, max_num_batched_tokens=7
    )
    max_tokens = [1, 2, 3, 5, 6, 7, 10, 11]
    reqs = run_requests(engine, PROMPTS, [greedy(m) for m in max_tokens])
    assert [r.output_token_ids for r in reqs] == [greedy_reference(p, m) for p, m in zip(PROMPTS, max_tokens)]
    check_stats(engine, reqs, max_tokens, k, chain_step(None))
    assert_all_freed(engine)


def test_wrong_chain_accepts_nothing():
    engine = make_engine(ChainDrafter(num_right=0), max_num_batched_tokens=8)
    max_tokens = [6 + i for i in range(len(PROMPTS))]
    reqs = run_requests(engine, PROMPTS, [greedy(m) for m in max_tokens])
    assert [r.output_token_ids for r in reqs] == [greedy_reference(p, m) for p, m in zip(PROMPTS, max_tokens)]
    s = engine.spec_stats
    assert s.num_accepted_tokens == 0
    assert s.num_drafts == sum(m - 1 for m in max_tokens)
    assert s.accepted_per_position == [0] * K
    check_stats(engine, reqs, max_tokens, K, chain_step(0))
    assert_all_freed(engine)


@pytest.mark.parametrize("num_right", [1, 2])
def test_partly_right_chain(num_right):
    """The first ``num_right`` drafts right, the next wrong: rollback of the rest, exact counts."""
    engine = make_engine(ChainDrafter(num_right=num_right), max_num_batched_tokens=9)
    max_tokens = [7 + 3 * i for i in range(len(PROMPTS))]
    reqs = run_requests(engine, PROMPTS, [greedy(m) for m in max_tokens])
    assert [r.output_token_ids for r in reqs] == [greedy_reference(p, m) for p, m in zip(PROMPTS, max_tokens)]
    check_stats(engine, reqs, max_tokens, K, chain_step(num_right))
    assert_all_freed(engine)


# -------------------------------------------------------------------------------------------- (c) trees
@pytest.mark.parametrize(("width", "accept_depth"), [(2, 3), (3, 2), (2, 4)])
def test_token_tree_matches_reference(width, accept_depth):
    engine = make_engine(TreeDrafter(width, accept_depth), tree_spec(width), max_num_batched_tokens=64)
    max_tokens = [10 + 3 * i for i in range(len(PROMPTS))]
    reqs = run_requests(engine, PROMPTS, [greedy(m) for m in max_tokens])
    assert [r.output_token_ids for r in reqs] == [greedy_reference(p, m) for p, m in zip(PROMPTS, max_tokens)]
    check_stats(
        engine, reqs, max_tokens, 4, tree_step(width, accept_depth, tree_spec(width)["max_tree_nodes"])
    )
    nodes_step = tree_step(width, accept_depth, tree_spec(width)["max_tree_nodes"], nodes=True)
    for r, m in zip(reqs, max_tokens):  # the nodes verified are counted apart (SpecStats.num_draft_nodes)
        assert r.spec_stats.num_draft_nodes == expected_counts(m, 4, nodes_step)[1], r.request_id
    assert engine.spec_stats.accepted_per_position[accept_depth:] == [0] * (4 - accept_depth)
    assert any(is_tree for *_, is_tree in engine.runner.segments_log)
    assert engine.runner.num_copied_slots > 0  # accepted paths were compacted
    assert_all_freed(engine)


class NoCompaction(FakeRunner):
    def copy_slots(self, src_slots: list[int], dst_slots: list[int]) -> None:
        self.num_copied_slots += len(src_slots)


def test_tree_negative_control_without_compaction():
    """A runner that ignores ``copy_slots`` leaves the accepted path's K/V in the wrong slots: the fake
    must notice (different output, or an inconsistent slot), proving the tree test can fail."""
    runner = NoCompaction(64, 4)
    engine = make_engine(TreeDrafter(2, 3), tree_spec(2), runner=runner)
    max_tokens = [12] * 4
    try:
        got = run(engine, PROMPTS[4:], [greedy(m) for m in max_tokens])
    except FakeRunnerError:
        return
    assert runner.num_copied_slots > 0
    assert got != [greedy_reference(p, m) for p, m in zip(PROMPTS[4:], max_tokens)]


# -------------------------------------------------------------------------------------- (d) preemption
@pytest.mark.parametrize("drafter", [None, "chain", "tree"])
def test_preemption_recomputes_and_resets_the_drafter(drafter):
    d = {None: None, "chain": ChainDrafter(num_right=2), "tree": TreeDrafter(2, 2)}[drafter]
    spec = tree_spec(2, depth=3) if drafter == "tree" else None
    engine = make_engine(d, spec, num_kv_blocks=14, block_size=4, max_num_batched_tokens=16)
    prompts = PROMPTS[3:8]
    max_tokens = [24, 20, 22, 18, 16]
    reqs = run_requests(engine, prompts, [greedy(m) for m in max_tokens])
    assert [r.output_token_ids for r in reqs] == [greedy_reference(p, m) for p, m in zip(prompts, max_tokens)]
    assert engine.scheduler.num_preemptions > 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    if d is not None:
        resets = d.resets
        preempted = Counter(rid for rid, status in resets if status == RequestStatus.PREEMPTED)
        assert preempted == Counter(engine.scheduler.num_preemptions_by_request)
        finished = Counter(rid for rid, status in resets if status.finished)
        assert finished == Counter(r.request_id for r in reqs)  # and once more when it finished
        assert len(resets) == sum(preempted.values()) + len(reqs)
    assert_all_freed(engine)


# ------------------------------------------------------------------------------------ (e) stop rules
DRAFTERS = {"plain": lambda: None, "chain": lambda: ChainDrafter(), "tree": lambda: TreeDrafter(2, 3)}


def engine_for(name: str, **kwargs):
    spec = tree_spec(2) if name == "tree" else None
    return make_engine(DRAFTERS[name](), spec, max_num_batched_tokens=16, **kwargs)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_max_tokens(name):
    engine = engine_for(name)
    max_tokens = [1, 2, 3, 4, 5, 7, 9, 16]
    reqs = run_requests(engine, PROMPTS, [greedy(m) for m in max_tokens])
    for r, p, m in zip(reqs, PROMPTS, max_tokens):
        assert r.output_token_ids == greedy_reference(p, m)
        assert r.num_output_tokens == m
        assert r.finish_reason == "length"
    assert_all_freed(engine)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_stop_token_ids(name):
    """The stop token ends the request where it is emitted, even in the middle of accepted drafts."""
    engine = engine_for(name)
    long = [greedy_reference(p, 40) for p in PROMPTS]
    stops = [out[3 + i % 5] for i, out in enumerate(long)]
    expected = [out[: out.index(s) + 1] for out, s in zip(long, stops)]
    reqs = run_requests(engine, PROMPTS, [greedy(40, stop_token_ids=[s]) for s in stops])
    for r, e, s in zip(reqs, expected, stops):
        assert r.output_token_ids == e
        assert r.finish_reason == "stop"
        assert r.stop_reason == s
    assert_all_freed(engine)


@functools.cache
def _eos_cases() -> tuple[list[list[int]], list[list[int]]]:
    """Prompts whose greedy continuation emits EOS within 40 tokens (found in the fixed table)."""
    prompts = [[(7 * i + j * j) % VOCAB for j in range(2 + i % 9)] for i in range(200)]
    hits = [p for p in prompts if EOS in greedy_reference(p, 40)][:5]
    assert len(hits) == 5
    return hits, [greedy_reference(p, 40) for p in hits]


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_eos_and_ignore_eos(name):
    prompts, long = _eos_cases()
    engine = engine_for(name)
    reqs = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40))
    for r, out in zip(reqs, long):
        assert r.output_token_ids == out[: out.index(EOS) + 1]
        assert r.finish_reason == "stop"
        assert r.stop_reason is None  # EOS, not a stop_token_ids entry
    reqs = run_requests(engine, prompts, greedy(40), request_ids=[f"i{i}" for i in range(len(prompts))])
    assert [r.output_token_ids for r in reqs] == long
    assert all(r.finish_reason == "length" for r in reqs)
    assert_all_freed(engine)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_min_tokens_masks_stop_tokens(name):
    engine = engine_for(name)
    long = [greedy_reference(p, 30) for p in PROMPTS]
    stops = [out[1] for out in long]  # would stop at the 2nd token
    expected = [greedy_reference(p, 30, stop_ids=(s,), min_tokens=6) for p, s in zip(PROMPTS, stops)]
    params = [greedy(30, stop_token_ids=[s], min_tokens=6) for s in stops]
    reqs = run_requests(engine, PROMPTS, params)
    assert [r.output_token_ids for r in reqs] == expected
    assert all(len(e) >= 6 for e in expected)  # each would have stopped at its 2nd token
    assert sum(r.finish_reason == "stop" for r in reqs) >= 1
    assert_all_freed(engine)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_max_model_len(name):
    engine = engine_for(name, max_model_len=22)
    prompts = PROMPTS[4:]  # 8, 9, 13, 17 tokens
    reqs = run_requests(engine, prompts, greedy(100))
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == greedy_reference(p, 100, max_model_len=22)
        assert r.num_tokens == 22
        assert r.finish_reason == "length"
    assert_all_freed(engine)


# ---------------------------------------------------------------------------- (f) invalid proposals
def _one_hot(tokens: list[int]) -> torch.Tensor:
    p = torch.zeros(len(tokens), VOCAB)
    p[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.int64)] = 1.0
    return p


def _zero_at_draft(tokens: list[int]) -> torch.Tensor:
    """Rows summing to 1 that give each draft token probability 0 (its acceptance test would divide by 0)."""
    return _one_hot([(t + 1) % VOCAB for t in tokens])


def _negative_rows(tokens: list[int]) -> torch.Tensor:
    p = _one_hot(tokens) * 1.5
    p[:, (torch.tensor(tokens) + 1) % VOCAB] = -0.5
    return p


def _nan_rows(tokens: list[int]) -> torch.Tensor:
    p = _one_hot(tokens)
    p[0, 0] = float("nan")
    return p


TOKENS = "draft token ids must be integers"
SHAPE = "draft_probs has shape"
TREE = "not a token tree"
#: kind: (the proposal made from the right drafts, what the engine's warning must say)
INVALID = {
    "negative_token": (lambda t: DraftProposal([-1, *t[1:]]), TOKENS),
    "token_equal_to_vocab": (lambda t: DraftProposal([*t[:-1], VOCAB]), TOKENS),
    "huge_token": (lambda t: DraftProposal([10**12]), TOKENS),
    "bool_token": (lambda t: DraftProposal([True]), TOKENS),
    "float_token": (lambda t: DraftProposal([float(t[0])]), TOKENS),
    "probs_wrong_shape": (
        lambda t: DraftProposal(t, torch.full((len(t), VOCAB - 1), 1.0 / (VOCAB - 1))),
        SHAPE,
    ),
    "probs_too_many_rows": (lambda t: DraftProposal(t, _one_hot([*t, t[0]])), SHAPE),
    "probs_not_a_tensor": (lambda t: DraftProposal(t, _one_hot(t).tolist()), SHAPE),
    "probs_rows_sum_to_half": (lambda t: DraftProposal(t, 0.5 * _one_hot(t)), "rows must sum to 1"),
    "probs_nan": (lambda t: DraftProposal(t, _nan_rows(t)), "not finite"),
    "probs_inf": (lambda t: DraftProposal(t, _one_hot(t) * float("inf")), "not finite"),
    "probs_negative": (lambda t: DraftProposal(t, _negative_rows(t)), "non-negative"),
    "parent_is_itself": (lambda t: DraftProposal(t, parents=list(range(len(t)))), TREE),
    "parent_after_child": (lambda t: DraftProposal(t, parents=[1, -1, 0][: len(t)]), TREE),
    "parent_below_root": (lambda t: DraftProposal(t, parents=[-2] * len(t)), TREE),
    "parents_too_short": (lambda t: DraftProposal(t, parents=[-1] * (len(t) - 1)), TREE),
    "tree_with_probs": (
        lambda t: DraftProposal(t, _one_hot(t), parents=list(range(-1, len(t) - 1))),
        "must be deterministic",
    ),
    "not_a_proposal": (lambda t: list(t), "not a DraftProposal"),
    "none": (lambda t: None, "not a DraftProposal"),
    "token_ids_none": (lambda t: DraftProposal(None), "token_ids must be a list"),
    "token_ids_an_int": (lambda t: DraftProposal(t[0]), "token_ids must be a list"),
    "parents_floats": (
        lambda t: DraftProposal(t, parents=[-1.0, *(i + 0.0 for i in range(len(t) - 1))]),
        "parents must be a list of ints",
    ),
    "zero_probability_draft": (lambda t: DraftProposal(t, _zero_at_draft(t)), "probability 0"),
}


class OneBadRequest(ChainDrafter):
    """Oracle drafts (all right) for every request but ``bad_id``, which gets ``make(drafts)``."""

    def __init__(self, make, bad_id: str = "1") -> None:
        super().__init__()
        self.make = make
        self.bad_id = bad_id
        self.num_bad = 0

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        out = []
        for x in batch:
            drafts = self.drafts(x)
            if x.request.request_id == self.bad_id and drafts:
                out.append(self.make(drafts))
                self.num_bad += 1
            else:
                out.append(DraftProposal(drafts))
        return out


@pytest.mark.parametrize("kind", list(INVALID))
def test_invalid_proposal_is_dropped_for_that_request_only(kind, caplog):
    make, reason = INVALID[kind]
    drafter = OneBadRequest(make)
    engine = make_engine(drafter, max_num_batched_tokens=16)
    prompts = PROMPTS[2:6]
    max_tokens = [12, 12, 12, 12]  # multiples of k + 1: the good requests accept everything
    with caplog.at_level(logging.WARNING, logger="specdec.engine"):
        reqs = run_requests(engine, prompts, [greedy(m) for m in max_tokens])
    dropped = [r.getMessage() for r in caplog.records if "drafts dropped" in r.getMessage()]
    assert len(dropped) == 11
    assert all(m.startswith("request 1: ") and reason in m for m in dropped), dropped[0]
    assert [r.output_token_ids for r in reqs] == [greedy_reference(p, m) for p, m in zip(prompts, max_tokens)]
    assert all(r.finish_reason == "length" and r.error is None for r in reqs)
    assert engine.num_failed_requests == 0
    bad = reqs[1]
    assert drafter.num_bad == 11  # proposed at every step but the last: it decoded one token per step
    assert bad.spec_stats.num_drafts == 0  # nothing of it was verified
    for r in reqs[:1] + reqs[2:]:
        assert r.spec_stats.num_accepted_tokens == r.spec_stats.num_draft_tokens == 9
    assert_all_freed(engine)


VALID = {
    "one_hot_probs": lambda t: DraftProposal(t, _one_hot(t)),
    "too_many_drafts": lambda t: DraftProposal(t + greedy_reference([], 2 * K)),
    "chain_as_parents": lambda t: DraftProposal(t, parents=list(range(-1, len(t) - 1))),
}


@pytest.mark.parametrize("kind", list(VALID))
def test_valid_proposals_are_kept(kind):
    """Positive controls of the above: valid ``draft_probs`` and chain-shaped parents are verified, and
    drafts beyond ``max_drafts`` are cut, not rejected (the request accepts its k right drafts per step)."""
    drafter = OneBadRequest(VALID[kind])
    engine = make_engine(drafter, max_num_batched_tokens=16)
    prompts = PROMPTS[2:6]
    reqs = run_requests(engine, prompts, greedy(12))
    assert [r.output_token_ids for r in reqs] == [greedy_reference(p, 12) for p in prompts]
    check_stats(engine, reqs, [12] * 4, K, chain_step(None))
    assert engine.spec_stats.accepted_per_position == [12] * K  # 4 requests x 3 steps, never deeper
    assert_all_freed(engine)


def test_too_large_tree_is_cut_to_slots_and_depth():
    """A tree deeper than k and wider than the slots is truncated (first nodes in order, depth <= k)."""
    drafter = TreeDrafter(width=3, accept_depth=8)
    engine = make_engine(drafter, tree_spec(3, depth=3) | {"max_tree_nodes": 10})
    reqs = run_requests(engine, PROMPTS[:4], greedy(16))
    assert [r.output_token_ids for r in reqs] == [greedy_reference(p, 16) for p in PROMPTS[:4]]
    # 10 slots hold the first two levels (5 nodes each): the right token of level 3 is cut.
    check_stats(engine, reqs, [16] * 4, 3, tree_step(3, 8, 10))
    assert tree_step(3, 8, 10, nodes=True)(3) == (10, 2)  # 10 nodes verified, 2 right
    assert tree_step(3, 8, 10)(3) == (3, 2)  # drafted 3 deep (a wrong node's child at depth 3)
    assert_all_freed(engine)


# ------------------------------------------------------------------------------------ (g) drafter faults
class RaisesFor(ChainDrafter):
    """Raises whenever request ``bad_id`` with at least ``after`` output tokens is in the batch."""

    def __init__(self, bad_id: str, after: int) -> None:
        super().__init__(num_right=2)
        self.bad_id = bad_id
        self.after = after

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        for x in batch:
            if x.request.request_id == self.bad_id and x.request.num_output_tokens >= self.after:
                raise RuntimeError("boom in the drafter")
        return super().propose(batch)


@pytest.mark.parametrize("after", [0, 5])
def test_drafter_raising_for_one_request_ends_it_alone(after):
    drafter = RaisesFor("2", after)
    engine = make_engine(drafter, max_num_batched_tokens=16)
    prompts = PROMPTS[3:7]
    reqs = run_requests(engine, prompts, greedy(14))
    refs = [greedy_reference(p, 14) for p in prompts]
    bad = reqs[2]
    assert bad.status == RequestStatus.FINISHED_ERROR
    assert bad.finish_reason == "error"
    assert "drafter failed" in bad.error and "boom in the drafter" in bad.error
    assert after <= bad.num_output_tokens < 14
    assert bad.output_token_ids == refs[2][: bad.num_output_tokens]  # it keeps the tokens it had
    for i in (0, 1, 3):
        assert reqs[i].output_token_ids == refs[i]
        assert reqs[i].finish_reason == "length" and reqs[i].error is None
    assert engine.num_failed_requests == 1
    assert ("2", RequestStatus.FINISHED_ERROR) in drafter.resets
    assert_all_freed(engine)


# ------------------------------------------------------------------------------------------ (h) verifier
class CountingVerifier:
    """Wraps a verifier and records the inputs of every call."""

    def __init__(self, inner: Verifier) -> None:
        self.inner = inner
        self.batches: list[list[VerifyInput]] = []

    def verify_batch(self, target_probs, batch, default_generator=None) -> list[VerifyResult]:
        self.batches.append(list(batch))
        return self.inner.verify_batch(target_probs, batch, default_generator)


class AcceptEverything:
    """A wrong verifier (negative control): accepts every draft, then the argmax of the last row."""

    def verify_batch(self, target_probs, batch, default_generator=None) -> list[VerifyResult]:
        out, start = [], 0
        for x in batch:
            last = int(target_probs[start + x.num_rows - 1].argmax())
            out.append(VerifyResult([*x.draft_token_ids, last], len(x.draft_token_ids)))
            start += x.num_rows
        return out


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_verifier_passed_in_is_used(shape):
    chain = CountingVerifier(RejectionSampler())
    tree = CountingVerifier(TreeVerifier())
    drafter = ChainDrafter(num_right=1) if shape == "chain" else TreeDrafter(2, 2)
    engine = make_engine(drafter, tree_spec(2) if shape == "tree" else None, max_num_batched_tokens=32)
    engine.verifier = SpeculativeVerifier(chain=chain, tree=tree)
    prompts = PROMPTS[:5]
    got = run(engine, prompts, greedy(15))
    assert got == [greedy_reference(p, 15) for p in prompts]
    used, unused = (chain, tree) if shape == "chain" else (tree, chain)
    assert not [x for b in unused.batches for x in b if x.draft_token_ids]
    verified = [x for b in used.batches for x in b if x.draft_token_ids]
    assert len(verified) == engine.spec_stats.num_drafts > 0
    assert sum(len(x.draft_token_ids) for x in verified) == engine.spec_stats.num_draft_nodes
    assert all((x.tree is not None) == (shape == "tree") for x in verified)
    assert all(x.greedy for x in verified)


def test_accept_everything_verifier_changes_the_output():
    """Negative control: with drafts that are always wrong, a verifier that accepts them all must change
    the output (so the equality tests above can fail)."""
    engine = make_engine(ChainDrafter(num_right=0), max_num_batched_tokens=16)
    engine.verifier = AcceptEverything()
    prompts = PROMPTS[:4]
    got = run(engine, prompts, greedy(12))
    refs = [greedy_reference(p, 12) for p in prompts]
    assert all(g != r for g, r in zip(got, refs))
    s = engine.spec_stats
    assert s.num_accepted_tokens == s.num_draft_tokens > 0


# ------------------------------------------------------------------------------- hidden-state drafters
class FeatureRecorder(DrafterBase):
    """A drafter that reads the target's features: records what ``observe`` receives."""

    uses_hidden_states = True

    def __init__(self, inner: DrafterBase) -> None:
        self.inner = inner
        self.seen: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        return self.inner.propose(batch)

    def observe(self, request: Request, start_position: int, hidden_states: torch.Tensor) -> None:
        self.seen.setdefault(request.request_id, []).append((start_position, hidden_states.clone()))


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_observe_gets_the_features_of_every_committed_token_once(shape):
    """Committed positions are observed once each, in order from 0, with the features of their context:
    prefill chunks, roots and accepted drafts or tree nodes. The step that finishes a request feeds the
    drafter nothing (its root and accepted drafts, at most 1 + depth positions, and the last token, which
    is never computed, are the only ones not observed)."""
    inner = ChainDrafter(num_right=2) if shape == "chain" else TreeDrafter(2, 3)
    drafter = FeatureRecorder(inner)
    engine = make_engine(drafter, tree_spec(2) if shape == "tree" else None, max_num_batched_tokens=6)
    reqs = run_requests(engine, PROMPTS, greedy(13))
    assert [r.output_token_ids for r in reqs] == [greedy_reference(p, 13) for p in PROMPTS]
    assert engine.runner.num_forwards_with_hidden == engine.runner.num_forwards > 0
    for r in reqs:
        pos = 0
        for start, h in drafter.seen[r.request_id]:
            assert start == pos
            for i in range(h.shape[0]):
                assert torch.equal(h[i], features_of(r.token_ids[: pos + i + 1])), (r.request_id, pos + i)
            pos += h.shape[0]
        depth = 4 if shape == "tree" else K
        assert r.num_tokens - 1 - (1 + depth) <= pos < r.num_tokens - 1
