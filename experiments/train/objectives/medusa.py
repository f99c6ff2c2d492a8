"""The Medusa objective (Cai et al. 2024, Medusa-1): head k (1-based) on the target's feature ``f_t``
predicts ``x_{t+k+1}``; cross-entropy through the target's frozen LM head, summed over heads, on response
positions only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from experiments.train.data import DistilData
from experiments.train.target import FrozenTarget


@dataclass
class MedusaExamples:
    """Response positions of Medusa training: ``features[i]`` is ``f_t``; ``labels[i, k - 1]`` is
    ``x_{t+k+1}`` (-100 past the end)."""

    features: torch.Tensor  # [P, H] bfloat16
    labels: torch.Tensor  # [P, K] int64

    def __len__(self) -> int:
        return len(self.labels)


def medusa_examples(data: DistilData, num_heads: int) -> MedusaExamples:
    """Every position t with ``start - 1 <= t <= L - 3`` of every sequence (the positions where the
    target has just emitted a response token and head 1 has a label)."""
    feats, labels = [], []
    for x, s, f in zip(data.tokens, data.starts, data.features):
        n = len(x)
        lo, hi = max(s - 1, 0), n - 2  # rows lo..hi-1
        if hi <= lo:
            continue
        rows = torch.arange(lo, hi)
        lab = torch.full((len(rows), num_heads), -100, dtype=torch.int64)
        for k in range(1, num_heads + 1):
            idx = rows + k + 1
            ok = idx < n
            lab[ok, k - 1] = x[idx[ok]]
        feats.append(f[lo:hi])
        labels.append(lab)
    if not feats:
        return MedusaExamples(
            torch.zeros(0, 0, dtype=torch.bfloat16), torch.zeros(0, num_heads, dtype=torch.int64)
        )
    return MedusaExamples(torch.cat(feats), torch.cat(labels))


def medusa_head_outputs(heads: nn.Module, features: torch.Tensor, k: int) -> torch.Tensor:
    """Head ``k`` (0-based) alone on ``features`` ``[N, H]`` -> ``[N, H]`` (what ``MedusaHeads.forward``
    computes for that head)."""
    block: nn.Module = heads.get_submodule(f"blocks.{k}")
    return features + F.silu(block(features))


def medusa_step(
    heads: nn.Module, target: FrozenTarget, features: torch.Tensor, labels: torch.Tensor
) -> tuple[float, list[float]]:
    """One step's gradients (accumulated into ``heads``): cross-entropy of each head, backpropagated head
    by head (one ``[N, V]`` logits tensor alive at a time). Returns the summed loss and each head's."""
    f = features.float()
    per_head = []
    for k in range(labels.shape[1]):
        lab = labels[:, k]
        if not bool((lab >= 0).any()):
            per_head.append(0.0)
            continue
        logits = target.logits(medusa_head_outputs(heads, f, k))
        loss = F.cross_entropy(logits, lab, ignore_index=-100)
        loss.backward()
        per_head.append(float(loss.detach()))
    return sum(per_head), per_head
