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

from sampling.sampler import argmax_rows
from specdec.config import MAX_TREE_NODES, SpeculativeConfig
from specdec.drafters.base import DrafterBase, DrafterContext, DraftInput, DraftProposal
from specdec.drafters.draft_vocab import drafting_vocab
from specdec.drafters.heads import MedusaHeads, load_heads
from specdec.drafters.registry import register_drafter
from specdec.drafters.tree import StaticTree
from specdec.errors import ConfigError
from specdec.quantization.apply import quantize_linears
from specdec.request import Request


def check_medusa_config(config: SpeculativeConfig) -> None:
    """``tree_choices`` need ``tree="static"`` and must be a valid static tree of at most 64 nodes.

    Raises:
        ConfigError: otherwise.
    """
    paths = config.tree_choices
    if paths is None:
        return
    if config.tree != "static":
        raise ConfigError("tree_choices need tree='static'")
    if (
        isinstance(paths, (str, bytes))
        or not isinstance(paths, (list, tuple))
        or any(
            isinstance(c, (str, bytes))
            or not isinstance(c, (list, tuple))
            or any(isinstance(r, bool) or not isinstance(r, int) for r in c)
            for c in paths
        )
    ):
        raise ConfigError(f"tree_choices must be a list of lists of ints, got {paths!r}")
    if len(paths) > MAX_TREE_NODES:
        raise ConfigError(f"tree_choices has {len(paths)} nodes; at most {MAX_TREE_NODES}")
    try:
        StaticTree.from_choices(paths)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"tree_choices: {e}") from None


@register_drafter(
    "medusa",
    model="heads",
    trees=(None, "static"),
    fields=("tree_choices", "draft_vocab", "quantization"),
    check_config=check_medusa_config,
)
class MedusaDrafter(DrafterBase):
    """Medusa-1 heads (Cai et al. 2024) on the target's last feature: a chain or a static tree.

    Args:
        ctx: ``ctx.target`` (its LM head turns head outputs into logits); ``ctx.model_dir`` the heads'
            directory; ``ctx.config``: ``num_speculative_tokens`` (chain length / deepest level, at most
            the number of heads), ``tree`` None or "static", ``tree_choices``, ``draft_vocab`` (a reduced
            draft vocabulary: :class:`~specdec.drafters.draft_vocab.DraftVocab`).
        heads: already loaded heads (tests); None loads them from ``ctx.model_dir``.

    Raises:
        ConfigError: k larger than the number of heads, or a tree rank beyond the vocabulary.
        CorruptModelError, InvalidRequestError: see :func:`specdec.drafters.heads.load_heads`.
    """

    uses_hidden_states = True

    def __init__(self, ctx: DrafterContext, heads: MedusaHeads | None = None) -> None:
        target, config = ctx.target, ctx.config
        if heads is None:
            assert ctx.model_dir is not None, "the registry resolves the heads' directory"
            loaded, _ = load_heads(str(ctx.model_dir), target.cfg, "medusa", ctx.dtype, ctx.device)
            assert isinstance(loaded, MedusaHeads)
            heads = loaded
        if config.num_speculative_tokens > heads.num_heads:
            raise ConfigError(
                f"num_speculative_tokens={config.num_speculative_tokens} but the checkpoint has only "
                f"{heads.num_heads} Medusa heads"
            )
        self.target = target
        self.heads = heads
        self.config = config
        self.tree = StaticTree.from_choices(config.static_tree_choices()) if config.tree == "static" else None
        quantization = config.quantization_config()
        if quantization is not None:  # the heads' linears and the LM-head rows they draft through
            quantize_linears(heads, quantization, next(heads.parameters()).dtype)
        self.vocab = drafting_vocab(config.draft_vocab, target, ctx.dtype, quantization)
        vocab_size = target.cfg.vocab_size if self.vocab is None else len(self.vocab)
        if self.tree is not None and self.tree.max_rank >= vocab_size:
            raise ConfigError(
                f"tree_choices ask for candidate rank {self.tree.max_rank}, but the draft vocabulary has "
                f"only {vocab_size} tokens"
            )

        #: request id -> the feature of its last committed token ``[hidden_size]``.
        self.last_feature: dict[str, torch.Tensor] = {}

    def observe(self, request: Request, start_position: int, hidden_states: torch.Tensor) -> None:
        self.last_feature[request.request_id] = hidden_states[-1].detach()

    def reset(self, request: Request) -> None:
        self.last_feature.pop(request.request_id, None)

    @torch.inference_mode()
    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        proposals = [DraftProposal([]) for _ in batch]
        drafting = [
            i for i, x in enumerate(batch) if x.max_drafts > 0 and x.request.request_id in self.last_feature
        ]
        if not drafting:
            return proposals
        features = torch.stack([self.last_feature[batch[i].request.request_id] for i in drafting])  # [B, H]
        depth = min(self.config.num_speculative_tokens, max(batch[i].max_drafts for i in drafting))
        hidden = self.heads(features.to(next(self.heads.parameters()).dtype))[:, :depth]  # [B, depth, H]
        if self.vocab is None:
            logits = self.target.logits(hidden.to(self.target.dtype))  # [B, depth, V] float32
        else:
            logits = self.vocab.logits(hidden)  # [B, depth, V'] float32
        to_target = (lambda i: i) if self.vocab is None else self.vocab.to_target
        # The first head's top-1 probability per request (per-step confidence, for a hybrid).
        first = torch.softmax(logits[:, 0], -1).amax(-1).tolist() if self.reports_confidence else None
        if self.tree is None:
            tokens = to_target(argmax_rows(logits)).tolist()
            for row, i in enumerate(drafting):
                proposals[i] = DraftProposal(tokens[row][: batch[i].max_drafts])
        else:
            top = to_target(logits.topk(self.tree.max_rank + 1, dim=-1).indices).tolist()  # [B, depth, ranks]
            for row, i in enumerate(drafting):
                tree = self.tree
                tokens = [top[row][d - 1][r] if d <= depth else 0 for d, r in zip(tree.depths, tree.ranks)]
                proposals[i] = DraftProposal(tokens, parents=list(tree.parents))
        if first is not None:
            for row, i in enumerate(drafting):
                proposals[i].first_draft_prob = first[row]
        return proposals

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Nothing to roll back: the next feature arrives through :meth:`observe`."""
