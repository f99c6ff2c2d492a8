"""Token trees: the topology drafters propose and the buffers the target verifies them with.

A tree hangs below the *root*, the last committed token (its logits row gives the distribution of the
first draft position). Node ``i`` holds a draft token and a parent: ``parents[i] == -1`` for a child of
the root, else an earlier node (nodes are in topological order, ``parents[i] < i``). A chain of m drafts
is the tree whose node i has parent i - 1.

Verification runs the root and the N nodes as ``N + 1`` new tokens of one request:

- **verification rows**: row 0 is the root, row ``1 + i`` is node i (its logits give the distribution
  after the path to node i);
- **tree attention mask** ``[N + 1, N + 1]``: a row sees the root, its ancestors and itself (plus all of
  the committed context, which the engine's attention always shows);
- **positions**: node i sits at ``root position + depth(i)`` (depth 1 for the root's children);
- **retrieval indices** ``[num_leaves, max_depth + 1]``: each root-to-leaf path as verification rows,
  padded with -1 (Medusa's ``retrieve_indices``).

:class:`TokenTree` lives in ``sampling`` because the tree verifier
(:mod:`sampling.tree_rejection_sampler`) reads it and ``sampling`` sits below ``specdec`` (see
``docs/layers.md``); drafters build trees with :mod:`specdec.drafters.tree` (static trees from choices,
EAGLE-2's dynamic trees).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["TokenTree"]


@dataclass(frozen=True)
class TokenTree:
    """Draft tokens with their parents.

    Attributes:
        token_ids: ``N`` draft token ids, node order.
        parents: ``N`` parent indices (-1 = the root), ``parents[i] < i``.

    Raises:
        ValueError: lengths differ or a parent does not precede its child.
    """

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must be -1 or an earlier node")

    @classmethod
    def chain(cls, token_ids: Sequence[int]) -> TokenTree:
        """The chain ``d_1 -> d_2 -> ...``."""
        return cls(tuple(token_ids), tuple(range(-1, len(token_ids) - 1)))

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node (1 for the root's children)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    @property
    def max_depth(self) -> int:
        return max(self.depths(), default=0)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (-1: the root), in node order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """Nodes from depth 1 down to ``node`` (empty for the root, -1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.token_ids[i] for i in self.path(node)]

    def attention_mask(self, num_prefix: int = 1) -> torch.Tensor:
        """Tree attention mask over ``num_prefix`` committed new tokens (the last one is the root)
        followed by the nodes.

        Returns:
            bool ``[num_prefix + N, num_prefix + N]``: ``mask[i, j]`` True when new token i may attend
            to new token j. The committed tokens are causal; a node sees them all, its ancestors and
            itself.
        """
        n = self.num_nodes
        size = num_prefix + n
        mask = torch.zeros(size, size, dtype=torch.bool)
        mask[:num_prefix, :num_prefix] = torch.ones(num_prefix, num_prefix, dtype=torch.bool).tril_()
        mask[num_prefix:, :num_prefix] = True
        for i in range(n):
            row = num_prefix + i
            mask[row, row] = True
            p = self.parents[i]
            if p >= 0:
                mask[row, num_prefix:] |= mask[num_prefix + p, num_prefix:]
        return mask

    def position_offsets(self) -> list[int]:
        """Position of each node relative to the root (its depth)."""
        return self.depths()

    def retrieval_indices(self) -> torch.Tensor:
        """Root-to-leaf paths as verification rows (0 = root, ``1 + i`` = node i).

        Returns:
            int64 ``[num_leaves, max_depth + 1]`` padded with -1; a tree without nodes gives ``[[0]]``.
        """
        has_child = {p for p in self.parents if p >= 0}
        leaves = [i for i in range(self.num_nodes) if i not in has_child]
        if not leaves:
            return torch.zeros(1, 1, dtype=torch.int64)
        width = self.max_depth + 1
        out = torch.full((len(leaves), width), -1, dtype=torch.int64)
        for r, leaf in enumerate(leaves):
            rows = [0] + [1 + i for i in self.path(leaf)]
            out[r, : len(rows)] = torch.tensor(rows)
        return out

    def truncated(self, max_nodes: int, max_depth: int) -> TokenTree:
        """The first nodes (in order) that have depth <= ``max_depth``, at most ``max_nodes`` of them, whose
        ancestors are all kept."""
        keep: dict[int, int] = {-1: -1}
        tokens: list[int] = []
        parents: list[int] = []
        for i, (t, p, d) in enumerate(zip(self.token_ids, self.parents, self.depths())):
            if len(tokens) >= max_nodes:
                break
            if d <= max_depth and p in keep:
                keep[i] = len(tokens)
                tokens.append(t)
                parents.append(keep[p])
        return TokenTree(tuple(tokens), tuple(parents))

    def pruned(self, keep: Sequence[bool]) -> TokenTree:
        """The nodes with ``keep[i]`` whose ancestors are all kept, in order (a node whose parent is
        dropped is dropped with it).

        Raises:
            ValueError: ``keep`` does not have one entry per node.
        """
        if len(keep) != self.num_nodes:
            raise ValueError(f"keep has {len(keep)} entries for {self.num_nodes} nodes")
        index: dict[int, int] = {-1: -1}
        tokens: list[int] = []
        parents: list[int] = []
        for i, (t, p) in enumerate(zip(self.token_ids, self.parents)):
            if keep[i] and p in index:
                index[i] = len(tokens)
                tokens.append(t)
                parents.append(index[p])
        return TokenTree(tuple(tokens), tuple(parents))

    def first_path(self) -> TokenTree:
        """The chain that follows each node's first child (the greedy path of a best-first tree)."""
        tokens: list[int] = []
        node = -1
        while True:
            kids = self.children(node)
            if not kids:
                return TokenTree.chain(tokens)
            node = kids[0]
            tokens.append(self.token_ids[node])
