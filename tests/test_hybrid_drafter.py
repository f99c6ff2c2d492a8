"""The hybrid drafter without a model: what its members are told after verification, and its counts."""

from __future__ import annotations

import torch

from sampling.params import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.drafters.base import DrafterContext, DraftInput, DraftProposal
from specdec.drafters.draft_stats import draft_depth
from specdec.drafters.hybrid import HybridDrafter
from specdec.request import Request


def _hybrid(members: list[str], k: int = 3) -> HybridDrafter:
    config = SpeculativeConfig("hybrid", k, hybrid_members=members)
    return HybridDrafter(DrafterContext(None, config, None, torch.float32, torch.device("cpu"), None))  # type: ignore[arg-type]


def test_a_tree_member_is_counted_by_its_depth():
    """A tree's submitted drafts are its depth (``TokenTree.max_depth``), capped by the step's depth."""
    hybrid = _hybrid(["suffix"], k=2)
    req = Request("t", [8, 1, 2, 3, 8, 1, 2, 4, 8, 1, 2], SamplingParams(temperature=0, max_tokens=20), 0)
    tree = DraftProposal([4, 8, 3, 8, 5], parents=[-1, 0, -1, 2, 3])  # depth 3
    hybrid.members[0].propose = lambda batch: [tree for _ in batch]
    (proposal,) = hybrid.propose([DraftInput(req, 1, 2, 5)])
    assert proposal is tree and req.drafter_metrics["suffix"].num_draft_tokens == 2
    assert draft_depth(tree) == 3 and draft_depth(DraftProposal([1, 2])) == 2
    assert draft_depth(DraftProposal([1, 2], parents=[-1, 5])) == 0  # malformed: the engine drops it
