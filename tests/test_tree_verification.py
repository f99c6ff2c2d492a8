"""Token trees (buffers, static and dynamic topologies) and exact tree verification.

Distribution tests (see :mod:`tests.stats`, chi-square at ``alpha = 1e-3``): a vocabulary of 6, an exact
target ``P(x1) P(x2 | x1)`` and a depth-2 tree with three children of the root (one of them a duplicate
token) and two children below the first. Each of 100,000 verifications emits the first token (and the
second when a child was accepted); when it emits one token the second is drawn from the exact
conditional, as the engine's next step would. The joint of the first two tokens (36 outcomes) must match
``P(x1) P(x2 | x1)`` for deterministic children and for children sampled from a draft distribution
(a fresh tree per verification). Negative controls (20,000 verifications each): the same walk without
the renormalisation after a rejection (deterministic children: accept with ``P(x)`` each time; sampled
children: no residual) must be rejected.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sampling.tree_rejection_sampler as trs
from sampling.token_tree import TokenTree
from sampling.tree_rejection_sampler import verify_tree
from specdec.drafters.tree import StaticTree, choices_from_accuracies, select_top_nodes
from tests.stats import assert_differs, assert_matches, counts_of

V = 6
N_SAMPLES = 100_000
N_CONTROL = 20_000


# ------------------------------------------------------------------------------------- tree buffers
def test_chain_is_a_tree():
    chain = TokenTree.chain([5, 6, 7])
    assert chain.parents == (-1, 0, 1) and chain.is_chain
    assert chain.depths() == [1, 2, 3]
    # A chain's mask over root + 3 nodes is plain causal.
    assert torch.equal(chain.attention_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert chain.retrieval_indices().tolist() == [[0, 1, 2, 3]]


def test_hand_written_tree_buffers():
    # root -> a(0), b(1); a -> c(2), d(3); c -> e(4)
    tree = TokenTree((10, 11, 12, 13, 14), (-1, -1, 0, 0, 2))
    assert tree.depths() == [1, 1, 2, 2, 3]
    assert tree.position_offsets() == [1, 1, 2, 2, 3]
    expected = torch.tensor(
        [
            # r  a  b  c  d  e
            [1, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0],  # a
            [1, 0, 1, 0, 0, 0],  # b
            [1, 1, 0, 1, 0, 0],  # c
            [1, 1, 0, 0, 1, 0],  # d
            [1, 1, 0, 1, 0, 1],  # e
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.attention_mask(), expected)
    # Two committed new tokens before the nodes (a chunk ending in the root): causal among them.
    mask2 = tree.attention_mask(num_prefix=2)
    assert mask2[0].tolist() == [True] + [False] * 6
    assert mask2[1, :2].tolist() == [True, True] and not mask2[1, 2:].any()
    assert torch.equal(mask2[2:, 2:], expected[1:, 1:]) and mask2[2:, :2].all()
    # Leaves b, d, e: paths as verification rows (0 = root, 1 + i = node i), padded with -1.
    assert tree.retrieval_indices().tolist() == [[0, 2, -1, -1], [0, 1, 4, -1], [0, 1, 3, 5]]
    assert tree.path(4) == [0, 2, 4] and tree.path_tokens(4) == [10, 12, 14]
    assert tree.first_path().token_ids == (10, 12, 14)
    small = tree.truncated(max_nodes=4, max_depth=2)
    assert small.token_ids == (10, 11, 12, 13) and small.parents == (-1, -1, 0, 0)


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-2,)])
def test_bad_tree_raises(parents):
    with pytest.raises(ValueError):
        TokenTree(tuple(range(len(parents))), parents)


def test_static_tree_from_choices():
    st = StaticTree.from_choices([[1], [0, 0], [0], [0, 1], [0, 0, 0]])
    assert st.choices == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert st.parents == (-1, -1, 0, 0, 2)
    assert st.depths == (1, 1, 2, 2, 3) and st.ranks == (0, 1, 0, 1, 0)
    cand = [[7, 8], [20, 21], [30]]  # per depth, candidates by rank
    assert st.tokens(cand).token_ids == (7, 8, 20, 21, 30)
    with pytest.raises(ValueError, match="no parent"):
        StaticTree.from_choices([[0], [1, 0]])
    with pytest.raises(ValueError, match="repeated"):
        StaticTree.from_choices([[0], [0]])


def test_choices_from_accuracies_best_first():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1]]
    # Path values: (0)=.6 (0,0)=.3 (1)=.2 (0,1)=.12 (2)=.1 (1,0)=.1 ...
    assert choices_from_accuracies(acc, 4) == [[0], [0, 0], [1], [0, 1]]


def test_select_top_nodes_keeps_ancestors():
    # cumulative log-probs; node 3 (child of 2) scores above node 1 but its parent is weak.
    scores = [-0.1, -2.0, -0.5, -0.6, -3.0]
    parents = [-1, -1, 0, 2, 1]
    assert select_top_nodes(scores, parents, 3) == [0, 2, 3]
    assert select_top_nodes(scores, parents, 4) == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- exact distributions
def _dist(gen: torch.Generator, rows: int, sharp: float = 2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, V, generator=gen) * sharp, dim=-1)


@pytest.fixture(scope="module")
def model():
    gen = torch.Generator().manual_seed(0)
    return {
        "p0": _dist(gen, 1)[0],  # target, first token
        "p_cond": _dist(gen, V),  # target, second token given the first
        "p_deep": _dist(gen, V),  # target rows of depth-2 nodes (unused by the joint of two)
        "q0": _dist(gen, 1)[0],  # draft, first token
        "q_cond": _dist(gen, V),  # draft, second token given the first
    }


def _exact_joint(m) -> np.ndarray:
    return (m["p0"].double()[:, None] * m["p_cond"].double()).numpy()


def _first_two(result_tokens: list[int], m, gen: torch.Generator) -> tuple[int, int]:
    if len(result_tokens) >= 2:
        return result_tokens[0], result_tokens[1]
    x1 = result_tokens[0]
    return x1, int(torch.multinomial(m["p_cond"][x1], 1, generator=gen))


def _rows(m, tree: TokenTree) -> torch.Tensor:
    """Verification rows: root, then per node the target after its path."""
    rows = [m["p0"]]
    for i, t in enumerate(tree.token_ids):
        rows.append(m["p_cond"][t] if tree.parents[i] < 0 else m["p_deep"][t])
    return torch.stack(rows)


def _run_deterministic(m, n: int, seed: int) -> list[tuple[int, int]]:
    # Root children: the draft's top-3 with a duplicate of the best; two children below the first.
    top = torch.argsort(m["q0"], descending=True).tolist()
    below = torch.argsort(m["q_cond"][top[0]], descending=True).tolist()
    tree = TokenTree((top[0], top[1], top[0], below[0], below[1]), (-1, -1, -1, 0, 0))
    rows = _rows(m, tree)
    gen = torch.Generator().manual_seed(seed)
    return [_first_two(verify_tree(rows, tree, False, gen).token_ids, m, gen) for _ in range(n)]


def _run_sampled(m, n: int, seed: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    root_kids = torch.multinomial(m["q0"], 3 * n, replacement=True, generator=gen).view(n, 3)
    below = torch.multinomial(m["q_cond"][root_kids[:, 0]], 2, replacement=True, generator=gen)
    out = []
    for i in range(n):
        r, b = root_kids[i].tolist(), below[i].tolist()
        tree = TokenTree((r[0], r[1], r[2], b[0], b[1]), (-1, -1, -1, 0, 0))
        rows = _rows(m, tree)
        draft = torch.stack([m["q0"], m["q_cond"][r[0]], m["q0"], m["q0"], m["q0"], m["q0"]])
        out.append(_first_two(verify_tree(rows, tree, False, gen, draft).token_ids, m, gen))
    return out


def test_deterministic_children_are_exact(model):
    samples = _run_deterministic(model, N_SAMPLES, seed=11)
    assert_matches(_exact_joint(model), counts_of(samples, (V, V)), label="tree, deterministic children")


def test_sampled_children_are_exact(model):
    samples = _run_sampled(model, N_SAMPLES, seed=12)
    assert_matches(_exact_joint(model), counts_of(samples, (V, V)), label="tree, sampled children")


@pytest.mark.parametrize("run", [_run_deterministic, _run_sampled], ids=["deterministic", "sampled"])
def test_negative_control_without_renormalising(model, run, monkeypatch):
    # After a rejection keep the original target row: no zeroing / no residual.
    monkeypatch.setattr(trs, "_normalise", lambda weights, fallback: fallback)
    samples = run(model, N_CONTROL, seed=13)
    assert_differs(_exact_joint(model), counts_of(samples, (V, V)), label=f"control {run.__name__}")


def test_greedy_walk_follows_the_argmax(model):
    rows = torch.stack([torch.eye(V)[2], torch.eye(V)[1], torch.eye(V)[4], torch.eye(V)[5]])
    # root -> 3 (wrong), 2 (right); 2 -> 4 (right)
    tree = TokenTree((3, 2, 4), (-1, -1, 1))
    res = verify_tree(rows, tree, True, None)
    assert res.token_ids == [2, 4, 5] and res.accepted_nodes == [1, 2] and res.num_accepted == 2
    with pytest.raises(ValueError):
        verify_tree(rows[:3], tree, True, None)
