"""Drafter-side token trees: static topologies from Medusa-style choices and EAGLE-2's dynamic trees.

A tree of draft tokens is a :class:`~sampling.token_tree.TokenTree` (defined in ``sampling``, beside
the tree verifier, and re-exported here): nodes in topological order below the root, the last committed
token; see :mod:`sampling.token_tree` for the verification rows, tree attention mask, positions and
retrieval indices built from it.

Static trees come from index paths (Medusa's "choices": ``(0, 1)`` is the second candidate of depth 2
below the first candidate of depth 1; Cai et al. 2024); dynamic trees (EAGLE-2, Li et al. 2024) keep the
nodes with the highest cumulative draft probability (:func:`select_top_nodes`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from sampling.token_tree import TokenTree

__all__ = ["StaticTree", "TokenTree", "choices_from_accuracies", "select_top_nodes"]


@dataclass(frozen=True)
class StaticTree:
    """A static tree topology from Medusa-style choices.

    Attributes:
        choices: index paths, sorted by length then value; each path's prefix is also a path.
        parents: per node, the parent node (-1 = root).
        depths: per node, its depth (1-based): which head (Medusa) or draft step proposes it.
        ranks: per node, which candidate of its depth's ranking it takes (0 = the most likely).
    """

    choices: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> StaticTree:
        """Build from index paths.

        Raises:
            ValueError: empty, negative, repeated, or a path whose prefix is missing.
        """
        paths = [tuple(int(x) for x in c) for c in choices]
        if not paths or any(not p or min(p) < 0 for p in paths):
            raise ValueError("tree choices must be non-empty index paths of non-negative integers")
        if len(set(paths)) != len(paths):
            raise ValueError("tree choices contain a repeated path")
        paths.sort(key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(paths)}
        parents = []
        for p in paths:
            if len(p) > 1 and p[:-1] not in index:
                raise ValueError(f"tree choice {list(p)} has no parent {list(p[:-1])} among the choices")
            parents.append(index[p[:-1]] if len(p) > 1 else -1)
        return cls(tuple(paths), tuple(parents), tuple(len(p) for p in paths), tuple(p[-1] for p in paths))

    @property
    def num_nodes(self) -> int:
        return len(self.choices)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    def tokens(self, candidates: Sequence[Sequence[int]]) -> TokenTree:
        """The tree whose node at depth d and rank r takes ``candidates[d - 1][r]``."""
        return TokenTree(tuple(candidates[d - 1][r] for d, r in zip(self.depths, self.ranks)), self.parents)


def choices_from_accuracies(rank_accuracy: Sequence[Sequence[float]], num_nodes: int) -> list[list[int]]:
    """The static tree of ``num_nodes`` nodes with the largest expected accepted length (Medusa §3.3.2).

    A path ``(r_1, ..., r_d)`` is accepted (approximately, treating heads as independent) with
    probability ``prod_j rank_accuracy[j][r_j]``; the expected accepted length of a tree is the sum of its
    paths' probabilities, and since extending a path never raises its probability, taking paths
    best-first gives the optimal tree with every prefix included.

    Args:
        rank_accuracy: ``[depth][rank]``: probability that the true token at that depth is the candidate
            of that rank (measured on held-out data).
        num_nodes: tree size.
    """
    heap: list[tuple[float, tuple[int, ...]]] = [(-a, (r,)) for r, a in enumerate(rank_accuracy[0])]
    heapq.heapify(heap)
    out: list[list[int]] = []
    while heap and len(out) < num_nodes:
        neg, path = heapq.heappop(heap)
        out.append(list(path))
        if len(path) < len(rank_accuracy):
            for r, a in enumerate(rank_accuracy[len(path)]):
                heapq.heappush(heap, (neg * a, path + (r,)))
    return out


def select_top_nodes(scores: Sequence[float], parents: Sequence[int], budget: int) -> list[int]:
    """EAGLE-2's reranking: the ``budget`` nodes with the highest cumulative draft log-probability.

    A node's score never exceeds its parent's, so the kept set contains every ancestor of a kept node
    (ties break toward shallower, earlier nodes).

    Args:
        scores: per candidate node, its cumulative log-probability (sum along its path).
        parents: per candidate node, its parent (-1 = root), in topological order.

    Returns:
        The kept node indices in increasing (topological) order.
    """
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], depth[i], i))
    kept: set[int] = set()
    for i in order:
        if len(kept) >= budget:
            break
        if parents[i] < 0 or parents[i] in kept:
            kept.add(i)
    return sorted(kept)
