"""Grammar-aware drafting: the tokens a request's grammar forces, appended to any drafter's chain.

Under a grammar many tokens are forced (punctuation, property names, closing brackets: the only
continuation the grammar allows, or a fast-forward string of llguidance's). Nobody drafts them, yet
verifying a draft costs about nothing in a bandwidth-bound step, and a token that is the only one the
grammar allows has probability 1 under the masked target: it is always accepted. So:

- ``speculative_config={..., "grammar_forced_drafts": True}`` wraps the configured drafter: its chain is
  cut at the first token the grammar forbids, then extended by the tokens the grammar forces after it
  (:func:`specdec.structured.forced_tokens`), up to ``max_drafts + max_forced_drafts`` positions: k,
  then ``SpeculativeConfig.max_forced_drafts`` more reserved for constrained requests (forced tokens are
  always accepted, so they need not compete with the drafter's guesses for k). A deterministic
  drafter with a ``continue_draft(request, drafts, max_drafts)`` method (n-gram lookup has one) drafts
  again after each run of forced tokens, from the context they extend: forced, looked up, forced, ...;
- ``method="grammar"`` drafts the forced tokens alone (a drafter of its own, no model).

Exactness: forced tokens are drafts like any other, verified by the exact rejection sampler. Their
``draft_probs`` rows (when the inner drafter samples) are one-hot, the distribution they were "drawn"
from, so the acceptance ratio of each is ``p(token)`` and the output distribution stays the target's
(Leviathan et al. 2023); for greedy requests a draft is accepted iff it is the masked argmax. Tree
proposals pass through unchanged (an empty one becomes the forced chain): the engine prunes a tree's
forbidden nodes itself. Requests without a grammar see the inner drafter alone.

The idea is jump-forward decoding (SGLang's compressed FSM; llguidance's fast-forward tokens), moved from
the sampler into the drafter, so the forced tokens are verified in the same forward as the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.drafters.base import Drafter, DrafterBase, DrafterContext, DraftInput, DraftProposal
from specdec.drafters.registry import register_drafter
from specdec.request import Request
from specdec.structured import CONTEXT_TOKENS, forced_tokens

if TYPE_CHECKING:
    from specdec.model_runner import ModelRunner


class GrammarForcedDrafter(DrafterBase):
    """Wraps ``inner`` (or nothing): constrained requests' chains get the grammar's forced tokens.

    Args:
        inner: the drafter whose chains are extended; None drafts forced tokens only.
        vocab_size: the model's vocabulary size (bitmask width).

    Attributes:
        num_forced_drafts: forced tokens appended so far (all requests), for the benchmarks.
    """

    def __init__(self, inner: Drafter | None, vocab_size: int) -> None:
        self.inner = inner
        self.vocab_size = vocab_size
        self.uses_hidden_states = bool(inner is not None and inner.uses_hidden_states)
        self.num_forced_drafts = 0
        self._num_inner: dict[str, int] = {}  # request id -> inner drafts kept in its last proposal

    def __getattr__(self, name: str):  # the inner drafter's own attributes (model, runner, states ...)
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        inner = self.inner.propose(batch) if self.inner is not None else [DraftProposal([]) for _ in batch]
        return [self._extend(x, p) for x, p in zip(batch, inner)]

    def _extend(self, x: DraftInput, proposal: DraftProposal) -> DraftProposal:
        req, grammar = x.request, x.request.grammar
        total = x.max_drafts + x.max_forced_drafts  # the chain's length: the drafter's part, then more
        if grammar is None or total <= 0 or (proposal.parents is not None and proposal.token_ids):
            self._num_inner[req.request_id] = len(proposal.token_ids)
            return proposal
        probs = proposal.draft_probs
        # a deterministic inner drafter that can continue a hypothetical context (n-gram lookup) drafts
        # again after each run of forced tokens
        resume = getattr(self.inner, "continue_draft", None) if probs is None else None
        tokens: list[int] = []  # accepted by the grammar as they are added; rolled back at the end
        forced_rows: list[int] = []  # positions of forced tokens in ``tokens``

        def take(candidates) -> int:
            """Accept ``candidates`` up to the first the grammar forbids; how many were taken."""
            n = 0
            for t in candidates:
                if not grammar.accept_token(int(t)):
                    break
                tokens.append(int(t))
                n += 1
            return n

        try:
            self._num_inner[req.request_id] = take(proposal.token_ids[: x.max_drafts])
            context = req.token_ids[-CONTEXT_TOKENS:]  # what forced_tokens reads of the request
            while len(tokens) < total:
                forced = forced_tokens(
                    grammar, total - len(tokens), self.vocab_size, req.stop_ids, context + tokens
                )
                forced_rows.extend(range(len(tokens), len(tokens) + take(forced)))
                more = 0
                if resume is not None and forced and len(tokens) < total:
                    more = take(resume(req, tokens, total - len(tokens)))
                if not more:
                    break
        finally:
            grammar.rollback(len(tokens))
        self.num_forced_drafts += len(forced_rows)
        if probs is not None and forced_rows:  # forced tokens follow the inner chain: one-hot rows
            one_hot = torch.zeros(len(forced_rows), probs.shape[-1], dtype=probs.dtype, device=probs.device)
            one_hot[torch.arange(len(forced_rows)), torch.tensor(tokens[-len(forced_rows) :])] = 1
            probs = torch.cat([probs[: len(tokens) - len(forced_rows)], one_hot])
        elif probs is not None:
            probs = probs[: len(tokens)]
        return DraftProposal(tokens, probs)

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        n = min(self._num_inner.pop(request.request_id, num_drafts), num_drafts)
        if self.inner is not None:
            self.inner.on_verified(request, n, min(num_accepted, n))

    def observe(self, request: Request, start_position: int, hidden_states: torch.Tensor) -> None:
        if self.inner is not None:
            self.inner.observe(request, start_position, hidden_states)

    def reset(self, request: Request) -> None:
        self._num_inner.pop(request.request_id, None)
        if self.inner is not None:
            self.inner.reset(request)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0 if self.inner is None else self.inner.kv_bytes_per_block(block_size)

    def bind_kv(self, num_blocks: int, block_size: int) -> None:
        if self.inner is not None:
            self.inner.bind_kv(num_blocks, block_size)

    def bind_target_kv(self, runner: ModelRunner) -> None:
        bind = getattr(self.inner, "bind_target_kv", None)
        if bind is not None:
            bind(runner)


@register_drafter("grammar")
def grammar_drafter(ctx: DrafterContext) -> GrammarForcedDrafter:
    """The tokens a request's grammar forces, and nothing else (no model; unconstrained requests get no
    drafts): jump-forward decoding verified as speculation."""
    return GrammarForcedDrafter(None, ctx.vocab_size)
