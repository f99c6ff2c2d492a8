"""Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"): draft by copying what followed the
most recent earlier occurrence of the context's last n tokens.

Each request keeps an index from every n-gram (``prompt_lookup_min <= n <= prompt_lookup_max``) of its
committed tokens to the position where its most recent occurrence ends, updated incrementally as tokens
are committed. A proposal is then ``O(prompt_lookup_max)`` dictionary look-ups and the index costs
``O(context length × n-gram sizes)`` in total, so a 32k-token prompt does not slow the steps that follow
its prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.drafters.base import DrafterBase, DrafterContext, DraftInput, DraftProposal, RequestStates
from specdec.drafters.registry import register_drafter
from specdec.request import Request


@dataclass
class _NgramIndex:
    """``last_end[n][ngram]`` = end position (exclusive) of the latest occurrence of ``ngram`` whose
    end is at most ``num_indexed``; n-grams ending at the very end of the context are indexed only
    when a later token arrives, so a look-up never finds the suffix itself."""

    last_end: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    num_indexed: int = 0


@register_drafter("ngram", fields=("prompt_lookup_max", "prompt_lookup_min"))
class NgramDrafter(DrafterBase):
    """Prompt lookup (Saxena 2023): deterministic drafts copied from the context (``draft_probs`` None).

    Args:
        ctx: its ``config`` gives ``prompt_lookup_max`` / ``prompt_lookup_min``, the n-gram sizes tried,
            longest first.
    """

    def __init__(self, ctx: DrafterContext) -> None:
        self.n_max = ctx.config.prompt_lookup_max
        self.n_min = ctx.config.prompt_lookup_min
        self.states: RequestStates[_NgramIndex] = RequestStates(
            lambda: _NgramIndex({n: {} for n in range(self.n_min, self.n_max + 1)})
        )

    def reset(self, request: Request) -> None:
        self.states.reset(request)

    def _index(self, request: Request) -> _NgramIndex:
        index = self.states.get(request)
        tokens = request.token_ids
        # Index n-grams ending at positions num_indexed+1 .. len-1 (exclusive ends), i.e. not the suffix.
        for end in range(index.num_indexed + 1, len(tokens)):
            for n, table in index.last_end.items():
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end
        index.num_indexed = max(index.num_indexed, len(tokens) - 1)
        return index

    def propose_one(self, request: Request, max_drafts: int) -> list[int]:
        """Up to ``max_drafts`` tokens that followed the latest earlier match of the longest suffix."""
        return self._match(request, max_drafts)[0]

    def _match(self, request: Request, max_drafts: int) -> tuple[list[int], int]:
        """:meth:`propose_one`'s drafts and the length of the suffix they follow (0: none)."""
        if max_drafts <= 0:
            return [], 0
        tokens = request.token_ids
        index = self._index(request)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(tokens) < n + 1:
                continue
            end = index.last_end[n].get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + max_drafts], n
        return [], 0

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        out = []
        for x in batch:
            drafts, n = self._match(x.request, x.max_drafts)
            out.append(DraftProposal(drafts, match_length=n if drafts else None))
        return out

    def continue_draft(self, request: Request, drafts: list[int], max_drafts: int) -> list[int]:
        """Up to ``max_drafts`` tokens continuing ``request.token_ids + drafts`` (a hypothetical context,
        e.g. after tokens a grammar forces): what followed the latest committed match of its longest
        suffix (:class:`~specdec.drafters.grammar_forced.GrammarForcedDrafter` calls it)."""
        if max_drafts <= 0:
            return []
        committed = request.token_ids
        index = self._index(request)
        context = committed[-self.n_max :] + list(drafts)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(context) < n:
                continue
            end = index.last_end[n].get(tuple(context[-n:]))
            if end is not None:
                return committed[end : end + max_drafts]
        return []

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Nothing to roll back: the index only ever holds committed tokens."""
