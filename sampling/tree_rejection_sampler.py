"""Exact verification of a token tree: multi-candidate speculative sampling, node by node.

Verification walks down from the root (see :mod:`sampling.token_tree` for rows and nodes). At the
current node with target distribution ``target_probs[row]`` it tries the node's children in order:

- **deterministic children** (``draft_probs`` None: the children are fixed functions of the draft, such
  as the top-k tokens of a Medusa head or of EAGLE-2's dynamic tree): child ``c`` with token ``x`` is
  accepted with the *current* target probability of ``x``; on rejection that probability is set to zero
  and the distribution renormalised; a token already tried is skipped. Each attempt is an exact
  sampling step (accept ``x`` with probability ``P(x)``, else continue with ``P`` conditioned on not
  ``x``), so the emitted token is distributed as ``target_probs[row]``. This is the rule of SpecInfer's
  greedy-candidate case and of Medusa's typical-free exact verification (Miao et al., "SpecInfer:
  Accelerating Large Language Model Serving with Tree-based Speculative Inference and Verification",
  ASPLOS 2024; Cai et al. 2024, §2.3).
- **sampled children** (``draft_probs[row]`` the draft distribution ``Q`` every child of that node was
  drawn from, independently): SpecInfer's multi-step speculative sampling (Miao et al. 2024, Algorithm
  2 / Theorem 4.2): child ``x`` is accepted with probability ``min(1, P(x) / Q(x))``; on rejection
  ``P`` becomes the residual ``normalise(max(0, P - Q))``. Each attempt is Leviathan et al.'s step
  against the current ``P``, so the emitted token is distributed as the original ``P``.

After an acceptance verification descends into the accepted child; when every child is rejected (or the
node is a leaf) one token is drawn from the current ``P`` (the recovered or bonus token) and the walk
ends. Greedy requests accept the child whose token is the target's argmax, then emit the argmax.

Randomness: one uniform per tried child, then one exponential race (:mod:`sampling.sampler`) for the
final token, in walk order, from the request's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sampling.rejection_sampler import RejectionSampler, VerifyResult
from sampling.sampler import argmax_rows
from sampling.token_tree import TokenTree

if TYPE_CHECKING:
    from sampling.verifier import VerifyInput

_TINY = torch.finfo(torch.float32).tiny


@dataclass
class TreeVerifyResult(VerifyResult):
    """``token_ids``: the accepted path's tokens + one recovered or bonus token; ``accepted_nodes``: the
    accepted nodes, root to leaf (``num_accepted`` of them)."""

    accepted_nodes: list[int] = field(default_factory=list)


def _normalise(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = float(weights.sum())
    if not (total > _TINY and total < float("inf")):
        return fallback
    return weights / total


def verify_tree(
    target_probs: torch.Tensor,
    tree: TokenTree,
    greedy: bool,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> TreeVerifyResult:
    """Verify one request's token tree.

    Args:
        target_probs: ``[N + 1, vocab_size]`` float32 verification rows (row 0 the root, row ``1 + i``
            node i): the target's processed probabilities (for greedy requests any scores with the same
            argmax).
        tree: the ``N`` draft nodes.
        greedy: take the greedy path.
        generator: the request's generator (None: torch's default).
        draft_probs: None for deterministic children; else ``[N + 1, vocab_size]``: row r is the
            distribution the children of row r's node were sampled from (rows of leaves are unused).

    Returns:
        The emitted tokens (accepted path + one) and the accepted nodes.

    Raises:
        ValueError: row counts that do not match the tree.
    """
    n = tree.num_nodes
    if target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, a tree of {n} nodes needs {n + 1}")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)}, expected {tuple(target_probs.shape)}"
        )
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        children.setdefault(p, []).append(i)
    tokens = tree.token_ids
    accepted: list[int] = []
    node = -1
    if greedy:
        argmax = argmax_rows(target_probs).tolist()
        while True:
            best = argmax[node + 1]
            nxt = next((c for c in children.get(node, ()) if tokens[c] == best), None)
            if nxt is None:
                return TreeVerifyResult([tokens[c] for c in accepted] + [best], len(accepted), accepted)
            accepted.append(nxt)
            node = nxt
    while True:
        row = target_probs[node + 1]
        probs = row
        kids = children.get(node, [])
        nxt = None
        if kids:
            uniforms = torch.rand(len(kids), generator=generator, device=row.device).tolist()
            if draft_probs is None:
                tried: set[int] = set()
                probs = row.clone()
                for c, u in zip(kids, uniforms):
                    x = tokens[c]
                    if x in tried:
                        continue
                    tried.add(x)
                    if u < float(probs[x]):
                        nxt = c
                        break
                    probs[x] = 0.0
                    probs = _normalise(probs, row)
            else:
                q = draft_probs[node + 1]
                for c, u in zip(kids, uniforms):
                    x = tokens[c]
                    if RejectionSampler.accept(u, float(probs[x]), float(q[x])):
                        nxt = c
                        break
                    probs = _normalise((probs - q).clamp_(min=0.0), probs)
        if nxt is None:
            final = RejectionSampler._race(probs, row, generator)
            return TreeVerifyResult([tokens[c] for c in accepted] + [final], len(accepted), accepted)
        accepted.append(nxt)
        node = nxt


class TreeVerifier:
    """:class:`~sampling.verifier.Verifier` for token trees: :func:`verify_tree` per request (a chain is
    verified as the one-path tree it is, deterministic drafts only)."""

    def verify_batch(
        self,
        target_probs: torch.Tensor,
        batch: Sequence[VerifyInput],
        default_generator: torch.Generator | None = None,
    ) -> list[VerifyResult]:
        """Raises:
        ValueError: rows that do not match the trees, or a sampled chain (``draft_probs`` set).
        """
        results: list[VerifyResult] = []
        start = 0
        for x in batch:
            tree = x.tree
            if tree is None:
                if x.draft_probs is not None:
                    raise ValueError(
                        "TreeVerifier verifies deterministic drafts; sampled chains need a RejectionSampler"
                    )
                tree = TokenTree.chain(x.draft_token_ids)
            gen = x.generator if x.generator is not None else default_generator
            results.append(verify_tree(target_probs[start : start + x.num_rows], tree, x.greedy, gen))
            start += x.num_rows
        if start != target_probs.shape[0]:
            raise ValueError(f"target_probs has {target_probs.shape[0]} rows, drafts need {start}")
        return results
