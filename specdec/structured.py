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


def forced_tokens(
    grammar: Grammar,
    max_tokens: int,
    vocab_size: int,
    eos_token_ids: Collection[int],
    context: Sequence[int] = (),
) -> list[int]:
    """Up to ``max_tokens`` tokens the grammar forces from its current state, never EOS; the grammar is
    left as it was.

    A backend's ``forced_tokens()`` hook (fast-forward tokens) answers first, if it has one. Then, step
    by step (:func:`_forced_by_mask`): the only token the mask allows; or, where every allowed token's
    bytes are a prefix of the longest one's (``c`` and ``cd`` when the grammar forces ``cd``), that
    longest token; or, where that holds once optional leading whitespace is set aside (``"`` and
    `` "`` after ``,`` in JSON), the variant the request's own text chose after the same byte the last
    time (``context``: its token ids, the drafts before these included). The walk stops at a real choice
    or where EOS is allowed. Drafting them is exact whatever they are (they are verified like any draft);
    a token that is the only one allowed has probability 1 under the masked target and is always
    accepted, the others are accepted unless the target prefers another tokenization or spacing.
    """
    from grammars.bitmask import allocate_token_bitmask

    out: list[int] = []
    hook = getattr(grammar, "forced_tokens", None)
    if hook is not None and max_tokens > 0:
        for t in hook()[:max_tokens]:
            if t in eos_token_ids or not 0 <= t < vocab_size or not grammar.accept_token(t):
                break
            out.append(t)
    vocabulary = getattr(getattr(grammar, "compiled", None), "vocabulary", None)
    text = b""
    if vocabulary is not None:
        text = b"".join(_piece(vocabulary, t) for t in list(context[-CONTEXT_TOKENS:]) + out)
    try:
        row = allocate_token_bitmask(1, vocab_size)
        while len(out) < max_tokens and not grammar.is_terminated():
            grammar.fill_bitmask(row, 0)
            t = _forced_by_mask(row[0], vocabulary, eos_token_ids, text)
            if t is None or not grammar.accept_token(t):
                break
            out.append(t)
            text += _piece(vocabulary, t)
    finally:
        grammar.rollback(len(out))
    return out


#: more allowed tokens than this at a step is a real choice (not a forced string's tokenizations)
_MAX_PREFIX_CHAIN = 16
#: the request's last tokens searched for its spacing habits
CONTEXT_TOKENS = 256
_WHITESPACE = (b" ", b"\t", b"\n", b"\r")


def _piece(vocabulary, t: int) -> bytes:
    b = vocabulary.token_bytes[t] if vocabulary is not None and 0 <= t < vocabulary.size else None
    return b or b""


def _allowed_ids(row: torch.Tensor, limit: int) -> list[int] | None:
    """The ids set in a packed row ``[ceil(V / 32)]``, or None when more than ``limit``."""
    words = row.nonzero().flatten().tolist()
    if len(words) > limit:
        return None
    allowed: list[int] = []
    for w in words:
        bits = int(row[w]) & 0xFFFFFFFF
        while bits:
            low = bits & -bits
            allowed.append(32 * w + low.bit_length() - 1)
            bits ^= low
            if len(allowed) > limit:
                return None
    return allowed


def _longest_of_chain(ids: list[int], pieces: list[bytes]) -> int | None:
    """The id of the longest piece when every piece is a prefix of it, else None."""
    longest = max(range(len(ids)), key=lambda i: len(pieces[i]))
    return ids[longest] if all(pieces[longest].startswith(p) for p in pieces) else None


def _forced_by_mask(row: torch.Tensor, vocabulary, eos_token_ids: Collection[int], text: bytes) -> int | None:
    """The forced token of one packed mask row ``[ceil(V / 32)]`` (see :func:`forced_tokens`), or None."""
    allowed = _allowed_ids(row, _MAX_PREFIX_CHAIN)
    if not allowed or any(t in eos_token_ids for t in allowed):
        return None
    if len(allowed) == 1:
        return allowed[0]
    if vocabulary is None:
        return None
    pieces = [_piece(vocabulary, t) for t in allowed]
    if not all(pieces):
        return None
    forced = _longest_of_chain(allowed, pieces)
    if forced is not None or not text:
        return forced
    # optional whitespace: what followed the same byte the last time
    last = text[-1:]
    seen = text[:-1].rfind(last)
    if seen < 0:
        return None
    spaced = text[seen + 1 : seen + 2] in _WHITESPACE
    keep = [i for i, p in enumerate(pieces) if (p[:1] in _WHITESPACE) == spaced]
    if not keep:
        return None
    return _longest_of_chain([allowed[i] for i in keep], [pieces[i] for i in keep])
