"""The engine's side of constrained decoding: token bitmasks along a draft, and grammar completion.

Speculation stays exact under a grammar (see :mod:`grammars`) because every logits row, of the draft
model and of the target's verification, is masked by the grammar state *after the draft tokens
before it*: the grammar is advanced through the draft prefix to fill each row's bitmask, then rolled
back, so only the tokens verification accepts advance it for good. A draft token the grammar forbids
gets probability 0 under the masked target and is simply rejected.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from grammars.base import Grammar


def draft_bitmask(
    grammar: Grammar, draft_token_ids: Sequence[int], num_rows: int, vocab_size: int
) -> torch.Tensor:
    """Packed bitmasks ``[num_rows, ceil(vocab_size / 32)]`` int32 for a request's logits rows.

    Row j is the grammar's mask after the first ``len(draft_token_ids) - num_rows + 1 + j`` drafts
    (the convention of :class:`sampling.processors.RowGroup`). The grammar is left as it was. Rows after
    a draft the grammar rejects stay all-allowed: that draft is rejected at its own row, so they are
    never used.
    """
    from grammars.bitmask import allocate_token_bitmask

    bitmask = allocate_token_bitmask(num_rows, vocab_size)
    first = len(draft_token_ids) - num_rows + 1
    advanced = 0
    try:
        for t in draft_token_ids[:first]:
            if not grammar.accept_token(t):
                return bitmask
            advanced += 1
        for j in range(num_rows):
            grammar.fill_bitmask(bitmask, j)
            if first + j < len(draft_token_ids):
                if not grammar.accept_token(draft_token_ids[first + j]):
                    break
                advanced += 1
    finally:
        grammar.rollback(advanced)
    return bitmask


def grammar_complete(grammar: Grammar, eos_token_ids: Collection[int], vocab_size: int) -> bool:
    """True when the request must end: EOS was accepted, or the match is complete and nothing but EOS
    may follow (then the request stops without generating EOS)."""
    if grammar.is_terminated():
        return True
    if not grammar.is_final():
        return False
    from grammars.bitmask import allocate_token_bitmask, unpack_bitmask

    bitmask = allocate_token_bitmask(1, vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist()
    return all(t in eos_token_ids for t in allowed)
