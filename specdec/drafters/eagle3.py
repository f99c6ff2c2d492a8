"""EAGLE-3 drafter: multi-layer target features, a reduced draft vocabulary; chain or EAGLE-2 tree.

Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test",
2025 (the head: :mod:`specdec.drafters.eagle3_head`); the drafting loop, its paged head K/V, catch-up
and the dynamic tree are EAGLE's (:class:`specdec.drafters.eagle.EagleDrafter`). What differs:

- the features the engine hands over are the target's residual streams entering the head's three
  ``feature_layers``, concatenated ``[n, 3H]``, returned by the same verification forward (the drafter's
  :attr:`feature_layers` tell the engine which; no second pass);
- draft logits come from the head's own LM head over the draft vocabulary ``[R, V_d]``, mapped to target
  ids with ``d2t``: a draft step reads ``V_d x H`` LM-head weights instead of ``V x H``;
- sampled requests draw their chain drafts from the head's processed distribution
  (:func:`specdec.drafters.draft_model.draw_draft_tokens`, the sampler stack of the target's rows) and
  report it as ``draft_probs`` ``[k, V]``, zero outside the draft vocabulary; greedy requests and trees
  draft the top tokens deterministically. Verification is exact either way (Leviathan et al. 2023;
  Chen et al. 2023): a target token outside the draft vocabulary can still be emitted, as a recovered
  or bonus token.

Checkpoints: this library's layout (``python -m experiments.train drafter=eagle3``), SafeAILab's EAGLE-3
and vLLM's ``speculators`` layouts (:mod:`specdec.drafters.eagle3_layouts`).
"""

from __future__ import annotations

import torch

from specdec.drafters.base import DrafterContext, DraftInput, DraftProposal
from specdec.drafters.draft_model import draw_draft_tokens
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle3_head import Eagle3Head
from specdec.drafters.registry import register_drafter


@register_drafter(
    "eagle3",
    model="heads",
    trees=(None, "dynamic"),
    fields=("tree_topk", "max_tree_nodes", "quantization", "draft_stop_probability"),
)
class Eagle3Drafter(EagleDrafter):
    """EAGLE-3 (Li et al. 2025): fused low/middle/high target features, one decoder layer, a reduced
    draft vocabulary; chain or EAGLE-2 tree.

    Args:
        ctx: as :class:`~specdec.drafters.eagle.EagleDrafter`; ``ctx.model_dir`` holds the head in any
            layout :func:`~specdec.drafters.eagle3_layouts.load_eagle3_head` reads.
        head: an already loaded :class:`Eagle3Head` (tests); None loads it.

    Raises:
        ConfigError: ``tree_topk`` larger than the draft vocabulary.
        CorruptModelError, InvalidRequestError: an unreadable head or one that does not fit the target
            (hidden size, vocabulary, feature layers), before any drafting.
    """

    head: Eagle3Head
    drafts_through_target_lm_head = False

    def __init__(self, ctx: DrafterContext, head: Eagle3Head | None = None) -> None:
        super().__init__(ctx, head)
        self.generator = ctx.generator  # unseeded sampled requests draw from the engine's generator
        self._ids = self.head.target_ids().to(self.device)  # [V_d] target id of each draft token

    @staticmethod
    def _load_head(ctx: DrafterContext) -> torch.nn.Module:
        from specdec.drafters.eagle3_layouts import load_eagle3_head

        head, _ = load_eagle3_head(ctx.model_dir, ctx.target.cfg, ctx.dtype, ctx.device)
        return head

    @staticmethod
    def _draft_vocab_size(head: torch.nn.Module, vocab_size: int) -> int:
        assert isinstance(head, Eagle3Head)
        return head.draft_vocab_size

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose input streams the engine returns as features (``[n, 3H]``)."""
        return self.head.feature_layers

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden)

    def _to_target(self, indices: torch.Tensor) -> torch.Tensor:
        return self._ids[indices]

    def _choose(
        self, logits: torch.Tensor, batch: list[DraftInput], proposals: list[DraftProposal]
    ) -> list[int]:
        """Greedy requests: the top draft token. Sampled requests: a draw from the processed draft
        distribution over the whole vocabulary (``-inf`` outside the draft vocabulary), appended to
        their ``draft_probs``."""
        reqs = [x.request for x in batch]
        if all(r.sampling_params.greedy for r in reqs):
            return super()._choose(logits, batch, proposals)
        full = logits.new_full((logits.shape[0], self.target.cfg.vocab_size), float("-inf"))
        full[:, self._ids] = logits
        drafts = [p.token_ids for p in proposals]
        tokens, probs = draw_draft_tokens(full, reqs, drafts, [None] * len(reqs), self.generator)
        for proposal, p in zip(proposals, probs):
            if p is not None:
                row = p[None].float()
                proposal.draft_probs = (
                    row if proposal.draft_probs is None else torch.cat([proposal.draft_probs, row])
                )
        return tokens
