"""Token trees through the engine: tree attention, exact greedy verification, compaction of the accepted
path's K/V, and release of every other slot.

An oracle drafter that knows each request's greedy continuation proposes trees in which the right token
is always the *last* child of its parent, after wrong siblings that have children of their own; so every
accepted path is made of non-first nodes and its K/V must move (compaction) before the next step. If the
tree mask, the node positions or the compaction were wrong, later logits would change: the test compares
the output tokens *and* the top-5 log-probabilities of every emitted token (computed from logits that
attend to the compacted K/V) with plain decoding.
"""

from __future__ import annotations

import pytest

from sampling.params import SamplingParams
from specdec import LLM
from specdec.drafters.base import DrafterBase, DraftInput, DraftProposal
from specdec.request import Request

VOCAB = 96


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from tests.conftest import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tree_engine")
    make_tiny_hf_model("llama", 6, 2, True, vocab_size=VOCAB, seed=3).save_pretrained(root)
    return root


class OracleTreeDrafter(DrafterBase):
    """Per level: ``width - 1`` wrong children (each with one wrong child), then the right token."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], width: int, accept_depth: int) -> None:
        self.truth = truth
        self.width = width
        self.accept_depth = accept_depth  # right tokens offered on at most this many levels

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        out = []
        for x in batch:
            req = x.request
            if x.max_drafts == 0:
                out.append(DraftProposal([]))
                continue
            cont = self.truth[tuple(req.token_ids[: req.num_prompt_tokens])][req.num_output_tokens :]
            tokens: list[int] = []
            parents: list[int] = []
            parent = -1
            for level in range(min(x.max_drafts, self.accept_depth, len(cont))):
                right = cont[level]
                for w in range(self.width - 1):
                    wrong = (right + 1 + w) % VOCAB
                    tokens.append(wrong)
                    parents.append(parent)
                    tokens.append((wrong + 7) % VOCAB)  # a grandchild below the wrong node
                    parents.append(len(tokens) - 2)
                tokens.append(right)
                parents.append(parent)
                parent = len(tokens) - 1
            out.append(DraftProposal(tokens, parents=parents))
        return out

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        pass


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % (VOCAB - 3) + 3 for j in range(5 + 4 * i)] for i in range(n)]


def _generate(llm: LLM, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=5) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize(("width", "accept_depth"), [(2, 3), (3, 2)])
def test_tree_verification_matches_plain_greedy(target_dir, batch, width, accept_depth):
    prompts = _prompts(batch)
    max_tokens = [17 + 3 * i for i in range(batch)]
    base = _generate(LLM(target_dir, skip_tokenizer_init=True, block_size=4), prompts, max_tokens)
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, base)}

    llm = LLM(
        target_dir,
        skip_tokenizer_init=True,
        block_size=4,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    engine = llm.engine
    engine.drafter = OracleTreeDrafter(truth, width, accept_depth)
    # Room for the trees: up to 4 levels of (2 * (width - 1) + 1) nodes.
    engine.num_draft_slots = engine.scheduler.num_draft_slots = 4 * (2 * (width - 1) + 1)
    got = _generate(llm, prompts, max_tokens)

    for g, b in zip(got, base):
        assert g.token_ids == b.token_ids
        for lp_got, lp_base in zip(g.logprobs, b.logprobs):
            assert lp_got.keys() == lp_base.keys()
            for t in lp_got:
                assert lp_got[t].logprob == pytest.approx(lp_base[t].logprob, abs=1e-4)
    stats = engine.spec_stats
    # The right token is offered at accept_depth levels: each full step accepts that many drafts.
    assert stats.num_accepted_tokens > 0
    assert max(i for i, n in enumerate(stats.accepted_per_position) if n) == accept_depth - 1
    assert stats.mean_acceptance_length > 1 + 0.6 * accept_depth
    assert engine.kv.num_free_blocks == engine.num_kv_blocks  # no slot or block leaked


def test_tree_acceptance_is_per_step_and_depth(target_dir):
    """Issue 24: a tree's acceptance rate counts its depth, not its nodes, as the drafted tokens (so
    chains and trees compare); the nodes verified are ``num_draft_nodes``; ``print`` shows the figures."""
    width, accept_depth = 3, 2  # 2 right levels, each after 2 wrong siblings with a child: depth 3
    prompts = _prompts(2)
    max_tokens = [15, 18]
    base = _generate(LLM(target_dir, skip_tokenizer_init=True, block_size=4), prompts, max_tokens)
    llm = LLM(
        target_dir,
        skip_tokenizer_init=True,
        block_size=4,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    engine = llm.engine
    engine.drafter = OracleTreeDrafter(
        {tuple(p): o.token_ids for p, o in zip(prompts, base)}, width, accept_depth
    )
    engine.num_draft_slots = engine.scheduler.num_draft_slots = 4 * (2 * (width - 1) + 1)
    verified: list[tuple[int, int]] = []  # (nodes, depth) of each tree verified (after fitting)

    def record(scheduled, logits):
        for x in scheduled:
            if x.sample and x.draft_token_ids:
                tree = x.draft_tree
                verified.append(
                    (len(x.draft_token_ids), len(x.draft_token_ids) if tree is None else tree.max_depth)
                )

    engine.fault_injector = record
    got = _generate(llm, prompts, max_tokens)
    engine.fault_injector = None
    assert [g.token_ids for g in got] == [b.token_ids for b in base]

    s = engine.spec_stats
    assert s.num_drafts == len(verified) > 0
    assert s.num_draft_nodes == sum(n for n, _ in verified)
    assert s.num_draft_tokens == sum(d for _, d in verified)  # depths, not nodes
    assert s.num_draft_tokens < s.num_draft_nodes
    assert s.acceptance_rate == pytest.approx(s.num_accepted_tokens / s.num_draft_tokens)
    assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)
    # The right token is offered at depths 1 and 2 (and always accepted there, greedy); depth 3 holds
    # only wrong grandchildren.
    rates = s.acceptance_rate_per_position
    assert rates[0] == 1.0 and rates[2] == 0.0 and rates[3] is None
    assert s.drafted_per_position[0] == s.num_drafts
    assert all(a <= d for a, d in zip(s.accepted_per_position, s.drafted_per_position))
    # Per request: the same definitions.
    per_request = [o.metrics for o in llm.generate([{"prompt_token_ids": prompts[0]}], _params(8))]
    assert per_request[0]["num_draft_nodes"] >= per_request[0]["num_draft_tokens"] > 0
    text = str(s)
    assert f"acceptance_rate={round(s.acceptance_rate, 4)}" in text
    assert f"mean_acceptance_length={round(s.mean_acceptance_length, 4)}" in text


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
