"""Medusa drafter: K heads on the target's last feature propose a chain or a static token tree.

Medusa-1 (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", ICML 2024). After a step, the feature ``f_t`` of the row the last committed token was sampled
from is known (the engine hands it over through :meth:`MedusaDrafter.observe`, taken from the same
verification forward: no second pass). Head k maps it to the distribution of token ``t + k + 1``, i.e.
of draft position k. A chain takes each head's top-1; a static tree (Medusa's "choices") takes, at depth
d, the head-d candidate of each node's rank. Candidates are deterministic, so verification is exact
with the deterministic-children rule (:mod:`sampling.tree_rejection_sampler`).
"""

from __future__ import annotations

import torch

from specdec.config import SpeculativeConfig
from specdec.drafters.base import DraftInput, DraftProposal
from specdec.drafters.heads import MedusaHeads
from specdec.drafters.tree import StaticTree
from specdec.errors import ConfigError
from specdec.models.decoder import DecoderLM
from specdec.request import Request


class MedusaDrafter:
    """Proposes from Medusa heads.

    Args:
        target: the target model (its LM head turns head outputs into logits).
        heads: trained :class:`MedusaHeads`.
        config: ``num_speculative_tokens`` (chain length / deepest level, at most the number of heads),
            ``tree`` None or "static", ``tree_choices``.

    Raises:
        ConfigError: k larger than the number of heads, or a tree rank beyond the vocabulary.
    """

    uses_hidden_states = True

    def __init__(self, target: DecoderLM, heads: MedusaHeads, config: SpeculativeConfig) -> None:
        if config.num_speculative_tokens > heads.num_heads:
            raise ConfigError(
                f"num_speculative_tokens={config.num_speculative_tokens} but the checkpoint has only "
                f"{heads.num_heads} Medusa heads"
            )
        self.target = target
        self.heads = heads
        self.config = config
        self.tree = StaticTree.from_choices(config.static_tree_choices()) if config.tree == "static" else None
        vocab_size = target.cfg.vocab_size
        if self.tree is not None and self.tree.max_rank >= vocab_size:
            raise ConfigError(
                f"tree_choices ask for candidate rank {self.tree.max_rank}, but the vocabulary has only "
                f"{vocab_size} tokens"
            )

    def observe(self, request: Request, start_position: int, hidden_states: torch.Tensor) -> None:
        request.drafter_state = hidden_states[-1].detach()

    @torch.inference_mode()
    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        proposals = [DraftProposal([]) for _ in batch]
        drafting = [
            i
            for i, x in enumerate(batch)
            if x.max_drafts > 0 and isinstance(x.request.drafter_state, torch.Tensor)
        ]
        if not drafting:
            return proposals
        features = torch.stack([batch[i].request.drafter_state for i in drafting])  # [B, H]
        depth = min(self.config.num_speculative_tokens, max(batch[i].max_drafts for i in drafting))
        hidden = self.heads(features.to(next(self.heads.parameters()).dtype))[:, :depth]  # [B, depth, H]
        logits = self.target.lm_head(hidden.to(self.target.dtype))  # [B, depth, V]
        if self.tree is None:
            tokens = logits.argmax(dim=-1).tolist()
            for row, i in enumerate(drafting):
                proposals[i] = DraftProposal(tokens[row][: batch[i].max_drafts])
            return proposals
        top = logits.topk(self.tree.max_rank + 1, dim=-1).indices.tolist()  # [B, depth, ranks]
        for row, i in enumerate(drafting):
            tree = self.tree
            tokens = [top[row][d - 1][r] if d <= depth else 0 for d, r in zip(tree.depths, tree.ranks)]
            proposals[i] = DraftProposal(tokens, parents=list(tree.parents))
        return proposals

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Nothing to roll back: the next feature arrives through :meth:`observe`."""
