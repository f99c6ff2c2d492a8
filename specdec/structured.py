"""The engine's side of constrained decoding: token bitmasks along a draft, and grammar completion.

Speculation stays exact under a grammar (see :mod:`grammars`) because every logits row, of the draft
model and of the target's verification, is masked by the grammar state *after the draft tokens
before it*: the grammar is advanced through the draft prefix to fill each row's bitmask, then rolled
back, so only the tokens verification accepts advance it for good. A draft token the grammar forbids
gets probability 0 under the masked target and is simply rejected.

Token trees (SpecInfer; XGrammar and llguidance walk draft trees the same way): one depth-first walk
advances the grammar down each node's own path and rolls it back on the way up, so every node's row is
masked by the state after *its* path, not the other branches' (:func:`tree_bitmask`); nodes whose path
the grammar forbids are pruned with their subtrees before slots are assigned (:func:`grammar_tree_keep`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from grammars.base import Grammar
    from sampling.token_tree import TokenTree


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


def _walk_tree(grammar: Grammar, tree: TokenTree, visit) -> None:
    """Depth-first over the nodes whose whole path the grammar accepts: ``visit(node)`` is called with
    the grammar advanced through the node's path (``visit(-1)`` first, for the root); the grammar is
    left as it was."""
    children: list[list[int]] = [[] for _ in range(tree.num_nodes + 1)]
    for i, p in enumerate(tree.parents):
        children[p + 1].append(i)

    def down(node: int) -> None:
        visit(node)
        for c in children[node + 1]:
            if grammar.accept_token(tree.token_ids[c]):
                try:
                    down(c)
                finally:
                    grammar.rollback(1)

    down(-1)


def grammar_tree_keep(grammar: Grammar, tree: TokenTree) -> list[bool]:
    """Per node of ``tree``, whether the grammar accepts its whole path (the root's children first)
    from the current state; the grammar is left as it was. ``tree.pruned(keep)`` is the tree a
    constrained request verifies."""
    keep = [False] * tree.num_nodes

    def visit(node: int) -> None:
        if node >= 0:
            keep[node] = True

    _walk_tree(grammar, tree, visit)
    return keep


def tree_bitmask(grammar: Grammar, tree: TokenTree, vocab_size: int) -> torch.Tensor:
    """Packed bitmasks ``[1 + N, ceil(vocab_size / 32)]`` int32 for a tree's verification rows: row 0
    is the grammar's mask now (the root), row ``1 + i`` its mask after node i's path (the distribution
    of node i's children, its bonus or recovered token). Rows of nodes whose path the grammar forbids
    stay all-allowed: such a node is rejected at its parent's row, so they are never used. The grammar
    is left as it was; one accept and one rollback per node."""
    from grammars.bitmask import allocate_token_bitmask

    bitmask = allocate_token_bitmask(1 + tree.num_nodes, vocab_size)
    _walk_tree(grammar, tree, lambda node: grammar.fill_bitmask(bitmask, node + 1))
    return bitmask
