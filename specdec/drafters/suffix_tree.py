"""Depth-limited suffix tries with occurrence counts: the data structures of suffix decoding.

SuffixDecoding (Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications") drafts from suffix trees over earlier text: the longest suffix of the current context
found in the tree is followed downward, children ranked by how often they occurred. Here the tree is a
trie of every substring of at most ``max_depth`` tokens (each node one token, each node's ``count`` the
number of occurrences of the string from the root to it), which keeps the two operations the drafter
needs simple and incremental:

- appending one token to a sequence already in the trie costs ``O(max_depth)`` (one step down from each
  of the ``max_depth`` "active" suffix nodes, :meth:`SuffixTrie.extend`): a request's trie grows with its
  committed tokens, never rebuilt;
- a sequence is removed by the same walk, decrementing counts and dropping nodes that reach 0
  (:meth:`SuffixTrie.remove`), so the global cache (:class:`SuffixCache`) evicts its least recently used
  sequences to stay within a node budget.

Memory is ``O(tokens × max_depth)`` nodes in the worst case (text that never repeats), about 270
bytes each in CPython 3.11 (tracemalloc); repeated text shares nodes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Draft:
    """What a trie proposes from one matched node.

    Attributes:
        token_ids: draft tokens, a chain (``parents`` None) or a token tree's nodes in topological order.
        parents: per node its parent node (-1: the last committed token), or None for a chain.
        score: the expected number of accepted tokens under the trie's frequencies (the sum of every
            node's path probability), which ranks drafts from different match lengths and tries.
        match_length: tokens of the context matched.
        source: id of the sequence the match came from (global cache), or -1.
    """

    token_ids: list[int]
    parents: list[int] | None
    score: float
    match_length: int
    source: int = -1


class SuffixTrie:
    """A trie of every substring of at most ``max_depth`` tokens of its sequences, with counts.

    Nodes are integer ids into three parallel lists (the root is node 0): ``count[node]``, the
    occurrences of the node's string in the indexed sequences (truncated at the trie's depth);
    ``seq[node]``, the latest sequence indexed through it (the global cache: the id of a cached sequence
    containing the node's string, for the LRU touch; a request's own trie: the position where the latest
    occurrence ends; larger is more recent, which breaks ties between equally frequent continuations);
    ``kids[node]``, next token -> child id (None for a leaf). No node is a Python object of its own:
    dicts of integers are not tracked by the cyclic garbage collector, so a trie of millions of nodes
    adds nothing to the collector's full passes (with one object per node those passes walked every
    node, and took 80-95 % of suffix decoding's drafting time). Ids of removed nodes are reused.

    Args:
        max_depth: the deepest node (longest indexed substring), >= 1.
    """

    root = 0

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.count: list[int] = [0]
        self.seq: list[int] = [-1]
        self.kids: list[dict[int, int] | None] = [None]
        self._free: list[int] = []
        #: Nodes below the root (the memory bound of :class:`SuffixCache`).
        self.num_nodes = 0

    def children(self, node: int) -> dict[int, int] | None:
        """Next token -> child of ``node`` (None for a leaf)."""
        return self.kids[node]

    def _delete_child(self, node: int, token: int) -> int:
        """Detach ``node``'s child for ``token`` (whose count reached 0) and free its id. Its own children
        stay until the removal walking through it deletes them (their counts reach 0 too: a string
        occurs no more often than its prefix), so the id is reused only after the removal."""
        children = self.kids[node]
        assert children is not None
        child = children.pop(token)
        if not children:
            self.kids[node] = None
        self._free.append(child)
        self.num_nodes -= 1
        return child

    def start(self) -> list[int]:
        """The active nodes of an empty sequence (for :meth:`extend`)."""
        return [self.root]

    def extend(self, active: list[int], token: int, seq: int = -1) -> list[int]:
        """Index one more token of a sequence: ``active[i]`` is the node of the sequence's suffix of
        length ``i`` (``active[0]`` the root); returns the new active list. ``O(max_depth)``."""
        kids, count, seqs, free = self.kids, self.count, self.seq, self._free
        new = [self.root]
        for node in active:
            children = kids[node]
            if children is None:
                children = kids[node] = {}
            child = children.get(token)
            if child is None:  # a new node (inline: this loop is the trie's hot path)
                if free:
                    child = free.pop()
                    count[child], seqs[child], kids[child] = 0, -1, None
                else:
                    child = len(count)
                    count.append(0)
                    seqs.append(-1)
                    kids.append(None)
                children[token] = child
                self.num_nodes += 1
            count[child] += 1
            seqs[child] = seq
            if len(new) < self.max_depth:
                new.append(child)
        return new

    def insert(self, tokens: Sequence[int], seq: int = -1) -> None:
        """Index every substring (of at most ``max_depth`` tokens) of ``tokens``."""
        active = self.start()
        for t in tokens:
            active = self.extend(active, int(t), seq)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo :meth:`insert` of ``tokens`` (which must have been inserted): counts drop, nodes reaching
        0 are deleted."""
        active = self.start()
        for t in tokens:
            t = int(t)
            new = [self.root]
            for node in active:
                children = self.kids[node]
                assert children is not None, "removing a sequence that was not inserted"
                child = children[t]
                self.count[child] -= 1
                if self.count[child] == 0:
                    self._delete_child(node, t)
                if len(new) < self.max_depth:
                    new.append(child)
            active = new

    def find(self, pattern: Sequence[int]) -> int | None:
        """The node of ``pattern`` (None if it never occurred, or is longer than ``max_depth``)."""
        node: int | None = self.root
        for t in pattern:
            children = self.kids[node] if node is not None else None
            if children is None:
                return None
            node = children.get(int(t))
        return node

    def matches(self, context: Sequence[int], max_match: int) -> list[tuple[int, int]]:
        """``(length, node)`` of each suffix of ``context`` (1 .. ``max_match`` tokens) found in the trie,
        shortest first (every substring of an indexed sequence is indexed, so they are consecutive)."""
        out = []
        for length in range(1, min(max_match, len(context), self.max_depth) + 1):
            node = self.find(context[len(context) - length :])
            if node is None or self.kids[node] is None:
                break
            out.append((length, node))
        return out

    def to_dict(self) -> dict:
        """The trie as nested ``{token: (count, children)}`` (tests compare tries built differently)."""

        def walk(node: int) -> dict:
            return {t: (self.count[c], walk(c)) for t, c in sorted((self.kids[node] or {}).items())}

        return walk(self.root)


def draft_from(
    trie: SuffixTrie,
    node: int,
    max_depth: int,
    budget: int,
    min_prob: float,
    tree: bool,
    match_length: int,
) -> Draft:
    """The draft below ``node`` (the matched suffix), children ranked by frequency.

    A child's probability is its count over the summed counts of its siblings (the empirical
    continuation distribution); a node's path probability is the product along its path. A chain follows
    the most frequent child; a tree keeps the ``budget`` nodes of highest path probability (best-first,
    so every kept node's parent is kept), as EAGLE-2 reranks its dynamic tree; ties go to the most
    recent continuation (``SuffixTrie.seq``). Nodes whose path probability falls below ``min_prob`` are
    not drafted.

    Args:
        trie: the trie ``node`` is in.
        node: the matched node; its subtree holds the continuations.
        max_depth: deepest draft (a chain's length).
        budget: most draft tokens (a tree's nodes).
        min_prob: smallest path probability drafted, in [0, 1].
        tree: a token tree (else a chain).
        match_length: recorded in the result.
    """
    tokens: list[int] = []
    parents: list[int] | None = [] if tree else None
    score = 0.0
    limit = budget if tree else min(max_depth, budget)
    order = itertools.count()
    # (-path probability, -recency, tiebreak, token, parent node index, depth, node)
    heap: list[tuple[float, int, int, int, int, int, int]] = []
    count, seqs = trie.count, trie.seq

    def push(below: int, prob: float, parent: int, depth: int) -> None:
        children = trie.kids[below]
        if not children or depth > max_depth:
            return
        total = sum(count[c] for c in children.values())
        if tree:
            candidates = children.items()
        else:  # the most frequent child (ties: the most recent)
            candidates = [max(children.items(), key=lambda item: (count[item[1]], seqs[item[1]]))]
        for token, child in candidates:
            p = prob * count[child] / total
            if p >= min_prob and p > 0:
                heapq.heappush(heap, (-p, -seqs[child], next(order), token, parent, depth, child))

    if limit > 0:
        push(node, 1.0, -1, 1)
    while heap and len(tokens) < limit:
        neg, _, _, token, parent, depth, child = heapq.heappop(heap)
        tokens.append(token)
        if parents is not None:
            parents.append(parent)
        score -= neg
        push(child, -neg, len(tokens) - 1, depth + 1)
    return Draft(tokens, parents, score, match_length)


def draft_budget(spec_factor: float, match_length: int, cap: int) -> int:
    """Drafts allowed after a match of ``match_length`` tokens: ``ceil(spec_factor × match_length)``
    (SuffixDecoding's ``MAX_SPEC = α p``), at most ``cap``."""
    return min(cap, math.ceil(spec_factor * match_length))


class RequestIndex:
    """A request's own text for suffix decoding: a :class:`SuffixTrie` of it and the nodes of its
    context's suffixes, grown token by token, and the best draft below them. The reference of the C++
    index (``kernels.suffix_index``: the same drafts and ties; ~4.5 against ~1.2 µs a token to grow a
    200-token prompt at depth 24, ~7 against ~4.6 at 32k tokens; ~9× faster to draft from), which serves
    where that one is not built.

    Args:
        max_depth: the trie's depth (the longest match plus the deepest draft).

    Attributes:
        num_indexed: tokens indexed so far (positions ``0 .. num_indexed - 1``).
    """

    def __init__(self, max_depth: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.active = self.trie.start()  # active[i]: the node of the sequence's suffix of length i
        self.num_indexed = 0

    @property
    def num_nodes(self) -> int:
        return self.trie.num_nodes

    @property
    def max_depth(self) -> int:
        return self.trie.max_depth

    def extend(self, tokens: Sequence[int], start: int) -> None:
        """Index ``tokens`` as positions ``start, start + 1, ...`` of the sequence (the next ones)."""
        trie, active = self.trie, self.active
        for i, t in enumerate(tokens, start):
            active = trie.extend(active, int(t), i)
        self.active = active
        self.num_indexed = max(self.num_indexed, start + len(tokens))

    def best_draft(
        self, max_match: int, max_drafts: int, cap: int, spec_factor: float, min_prob: float, tree: bool
    ) -> tuple[list[int], list[int] | None, float, int] | None:
        """The draft of highest score (:func:`draft_from`) below each suffix of the context of 1 ..
        ``max_match`` tokens (shortest first, up to the first without a continuation), each with a budget
        of ``min(cap, ceil(spec_factor × length))`` drafts; ties go to the longer match. None (nothing
        to draft), or ``(token_ids, parents, score, match_length)``."""
        best: Draft | None = None
        trie = self.trie
        for length in range(1, min(max_match, len(self.active) - 1) + 1):
            node = self.active[length]
            if trie.kids[node] is None:  # no earlier occurrence continued; nor will a longer suffix
                break
            budget = draft_budget(spec_factor, length, cap)
            d = draft_from(trie, node, max_drafts, budget, min_prob, tree, length)
            if d.token_ids and (best is None or d.score >= best.score):
                best = d
        return None if best is None else (best.token_ids, best.parents, best.score, best.match_length)

    def to_dict(self) -> dict:
        return self.trie.to_dict()


def standalone_nodes(tokens: Sequence[int], max_depth: int, limit: int) -> int | None:
    """Nodes a trie of ``tokens`` alone would hold (its distinct substrings of at most ``max_depth``
    tokens), or None as soon as they exceed ``limit`` (so at most ``limit`` nodes are built)."""
    trie = SuffixTrie(max_depth)
    active = trie.start()
    for t in tokens:
        active = trie.extend(active, t)
        if trie.num_nodes > limit:
            return None
    return trie.num_nodes


class SuffixCache:
    """The global suffix trie over earlier requests' prompts and outputs: bounded, LRU-evicted.

    Each cached sequence has an id; the trie's nodes remember the latest sequence indexed through them,
    and a draft taken from the cache touches that sequence (:meth:`touch`). Adding a sequence first
    evicts the least recently used ones (added or touched longest ago) until it fits within
    ``max_nodes`` nodes; a sequence too large for the budget on its own is not kept, and evicts nothing.

    Eviction leaves no node naming the evicted sequence: a node it named that other sequences still pass
    through is re-pointed to one of them, deepest nodes first: to a child's sequence (which continues the
    node's string), or, for a string no kept sequence continues within the trie's depth, to a sequence
    it ends (a maximal occurrence: a substring of ``max_depth`` tokens or a sequence's suffix, recorded
    per node for the sequences that have one there: about one record per cached token). ``O(tokens ×
    max_depth)`` per eviction, as removing the sequence's counts.

    Args:
        max_depth: the trie's depth (see :class:`SuffixTrie`).
        max_nodes: the node budget (0: nothing is cached).

    Attributes:
        num_evicted: sequences evicted so far.
    """

    def __init__(self, max_depth: int, max_nodes: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.max_nodes = max_nodes
        self.entries: OrderedDict[int, list[int]] = OrderedDict()  # least recently used first
        self._ids = itertools.count()
        self.num_evicted = 0
        # Per node of a maximal occurrence, the cached sequences with one there (one id, or a dict of ids
        # in insertion order: the last is the latest).
        self._ends: dict[int, int | dict[int, None]] = {}

    @property
    def num_nodes(self) -> int:
        return self.trie.num_nodes

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.entries.values())

    def add(self, tokens: Sequence[int]) -> int | None:
        """Cache ``tokens``; its id, or None when it does not fit the budget on its own (then nothing is
        evicted). Before inserting, least recently used sequences are evicted until the trie plus the
        nodes ``tokens`` would need alone (an upper bound of what it adds) fit ``max_nodes``, so the trie
        never exceeds its budget, not even during the insert."""
        if self.max_nodes <= 0 or not tokens:
            return None
        stored = [int(t) for t in tokens]
        need = len(stored) * self.trie.max_depth  # a bound, exact when nothing repeats
        if self.trie.num_nodes + need > self.max_nodes:
            need = standalone_nodes(stored, self.trie.max_depth, self.max_nodes)
            if need is None:
                return None
        while self.entries and self.trie.num_nodes + need > self.max_nodes:
            self.evict()
        seq = next(self._ids)
        self.entries[seq] = stored
        self._insert(stored, seq)
        return seq

    def _insert(self, tokens: list[int], seq: int) -> None:
        """:meth:`SuffixTrie.insert`, recording where ``seq`` has maximal occurrences."""
        trie = self.trie
        active = trie.start()
        for t in tokens:
            deepest = active[-1] if len(active) == trie.max_depth else None
            active = trie.extend(active, t, seq)
            if deepest is not None:  # its child: a substring of max_depth tokens
                self._add_end(trie.kids[deepest][t], seq)  # type: ignore[index]
        for node in active[1:]:  # the sequence's suffixes shorter than max_depth
            self._add_end(node, seq)

    def _add_end(self, node: int, seq: int) -> None:
        ends = self._ends.get(node)
        if ends is None:
            self._ends[node] = seq
        elif isinstance(ends, int):
            if ends != seq:
                self._ends[node] = {ends: None, seq: None}
        else:
            ends[seq] = None

    def _drop_end(self, node: int, seq: int) -> None:
        ends = self._ends.get(node)
        if isinstance(ends, dict):
            ends.pop(seq, None)
            if len(ends) == 1:
                self._ends[node] = next(iter(ends))
        elif ends == seq:
            del self._ends[node]

    def _live_seq(self, node: int) -> int:
        """A cached sequence through ``node`` (whose children already name cached sequences): the latest
        one it ends, or its latest child's, whichever is later."""
        ends = self._ends.get(node)
        best = -1 if ends is None else ends if isinstance(ends, int) else next(reversed(ends))
        children = self.trie.kids[node]
        if children:
            best = max(best, self.trie.seq[next(reversed(children.values()))])
        return best

    def touch(self, seq: int) -> None:
        """Mark ``seq`` as just used (ignored if it was evicted)."""
        if seq in self.entries:
            self.entries.move_to_end(seq)

    def evict(self) -> None:
        """Drop the least recently used sequence; the nodes that named it and remain are re-pointed to a
        cached sequence through them."""
        seq, tokens = self.entries.popitem(last=False)
        trie = self.trie
        depth = trie.max_depth
        named: list[dict[int, None]] = [{} for _ in range(depth + 1)]  # by depth, in order
        active = trie.start()
        count, seqs, kids = trie.count, trie.seq, trie.kids
        for t in tokens:  # SuffixTrie.remove, noting the nodes that name seq and its maximal occurrences
            new = [trie.root]
            for d, node in enumerate(active, 1):
                children = kids[node]
                assert children is not None, "removing a sequence that was not inserted"
                child = children[t]
                count[child] -= 1
                if count[child] == 0:
                    trie._delete_child(node, t)
                    self._ends.pop(child, None)  # no sequence passes through it: its id may be reused
                elif seqs[child] == seq:
                    named[d][child] = None
                if d < depth:
                    new.append(child)
                else:
                    self._drop_end(child, seq)
            active = new
        for node in active[1:]:
            self._drop_end(node, seq)
        for d in range(depth, 0, -1):  # deepest first: a node's children name cached sequences by then
            for node in named[d]:
                if count[node] > 0:
                    seqs[node] = self._live_seq(node)
        self.num_evicted += 1
