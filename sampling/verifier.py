"""The verifier plug-in point: the :class:`Verifier` Protocol and the engine's default verifier.

A verifier turns one step's processed target distributions and each request's drafts into the tokens to
emit. Every implementation shipped here is exact: the emitted tokens follow the target's processed
distribution whatever was drafted (Leviathan et al. 2023; Chen et al. 2023; SpecInfer, Miao et al. 2024,
for trees). Implementations:

- :class:`sampling.rejection_sampler.RejectionSampler`: chains (flattened on CUDA or per request, an
  explicit ``path``);
- :class:`sampling.tree_rejection_sampler.TreeVerifier`: token trees, one request at a time;
- :class:`SpeculativeVerifier`: the engine's default, chains to the first and trees to the second.

The distribution tests install deliberately wrong verifiers (negative controls) through the same
Protocol (``LLMEngine.verifier``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from sampling.rejection_sampler import RejectionSampler, VerifyResult

if TYPE_CHECKING:
    from sampling.token_tree import TokenTree


@dataclass
class VerifyInput:
    """One request's drafts in a verification step.

    Attributes:
        draft_token_ids: its ``m >= 0`` drafts: a chain, or a token tree's nodes in order.
        draft_probs: ``[m, vocab_size]`` float32, the distribution each chain draft was drawn from, or
            None (deterministic drafts; trees are deterministic).
        tree: the drafts' tree, or None for a chain.
        greedy: take the greedy path (its rows only need the target's argmax).
        generator: the request's generator, or None (the verifier's default then).

    Its rows in ``target_probs`` are ``m + 1`` consecutive rows: the root (last committed token), then one
    per draft (chain position or tree node), in order.
    """

    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None
    tree: TokenTree | None = None
    greedy: bool = False
    generator: torch.Generator | None = None

    @property
    def num_rows(self) -> int:
        return 1 + len(self.draft_token_ids)


@runtime_checkable
class Verifier(Protocol):
    """Verifies a batch of drafts against the target."""

    def verify_batch(
        self,
        target_probs: torch.Tensor,
        batch: Sequence[VerifyInput],
        default_generator: torch.Generator | None = None,
    ) -> list[VerifyResult]:
        """Args:
            target_probs: ``[sum_i (m_i + 1), vocab_size]`` float32, request i's rows in order (processed
                probabilities; for greedy requests any scores with the target's argmax).
            batch: per request, its drafts.
            default_generator: for requests without a generator.

        Returns:
            Per request, the tokens to append (accepted drafts + one recovered or bonus token) and the
            number accepted; for a tree a :class:`~sampling.tree_rejection_sampler.TreeVerifyResult` with
            the accepted nodes.

        Raises:
            ValueError: rows or shapes that do not match the drafts, or a draft shape it does not verify.
        """
        ...


class SpeculativeVerifier:
    """Chains through ``chain`` (one batched call), each token tree through ``tree``.

    Args:
        chain: verifies chains (default :class:`RejectionSampler` with ``path="auto"``).
        tree: verifies trees (default :class:`~sampling.tree_rejection_sampler.TreeVerifier`).
    """

    def __init__(self, chain: Verifier | None = None, tree: Verifier | None = None) -> None:
        from sampling.tree_rejection_sampler import TreeVerifier

        self.chain: Verifier = chain if chain is not None else RejectionSampler()
        self.tree: Verifier = tree if tree is not None else TreeVerifier()

    def verify_batch(
        self,
        target_probs: torch.Tensor,
        batch: Sequence[VerifyInput],
        default_generator: torch.Generator | None = None,
    ) -> list[VerifyResult]:
        expected = sum(x.num_rows for x in batch)
        if target_probs.shape[0] != expected:
            raise ValueError(f"target_probs has {target_probs.shape[0]} rows, drafts need {expected}")
        results: list[VerifyResult | None] = [None] * len(batch)
        chain_rows: list[int] = []
        chains: list[int] = []
        start = 0
        for j, x in enumerate(batch):
            if x.tree is None:
                chains.append(j)
                chain_rows.extend(range(start, start + x.num_rows))
            else:
                rows = target_probs[start : start + x.num_rows]
                results[j] = self.tree.verify_batch(rows, [x], default_generator)[0]
            start += x.num_rows
        if chains:
            rows = target_probs if len(chain_rows) == start else target_probs[torch.tensor(chain_rows)]
            chain_batch = [batch[j] for j in chains]
            for j, res in zip(chains, self.chain.verify_batch(rows, chain_batch, default_generator)):
                results[j] = res
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]
