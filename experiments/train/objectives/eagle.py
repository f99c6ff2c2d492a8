"""The EAGLE objective (Li et al. 2024, EAGLE-1), on whole sequences through
:class:`~specdec.drafters.heads.EagleHead` with ``DenseAttention``.

Row t reads ``(embed(x_{t+1}), f_t)`` and predicts ``f_{t+1}``; the loss is ``SmoothL1(f̂, f) + 0.1 ·
CE(lm_head(f̂), softmax(lm_head(f)))`` on response rows, with optional uniform noise on the input
features (EAGLE-1's augmentation) and optionally a second, unrolled step (``train.eagle_unroll=2``):
row t + 1 then reads the head's own ``f̂_{t+1}``, as when drafting a chain, attending to the
teacher-forced rows before it and to itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from experiments.train.data import DistilData
from experiments.train.target import FrozenTarget

#: One step's ``(predicted [N, H], target [N, H], next tokens [N], loss mask [N])``.
StepOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class EagleBatch:
    """Packed sequences for the EAGLE head: row t of a sequence reads ``(embed(x_{t+1}), f_t)`` at
    position t and is trained to give ``f_{t+1}``; ``mask`` marks the rows in the response (t >= start -
    1); ``next_tokens`` is ``x_{t+2}`` (-1 past the end)."""

    lens: list[int]
    tokens: torch.Tensor  # [T] x_{t+1}
    features: torch.Tensor  # [T, H] f_t (bfloat16)
    targets: torch.Tensor  # [T, H] f_{t+1} (bfloat16)
    positions: torch.Tensor  # [T]
    mask: torch.Tensor  # [T] bool
    next_tokens: torch.Tensor  # [T] int64


def eagle_batches(
    data: DistilData, batch_tokens: int, order: Sequence[int] | None = None
) -> Iterator[EagleBatch]:
    """Sequences (in ``order``) packed into batches of at most ``batch_tokens`` rows (longer ones alone)."""
    order = range(len(data)) if order is None else order
    pending: list[int] = []
    total = 0
    for i in order:
        n = len(data.tokens[i]) - 1
        if n < 1:
            continue
        if pending and total + n > batch_tokens:
            yield _eagle_batch(data, pending)
            pending, total = [], 0
        pending.append(i)
        total += n
    if pending:
        yield _eagle_batch(data, pending)


def _eagle_batch(data: DistilData, seqs: Sequence[int]) -> EagleBatch:
    lens, toks, feats, tgts, pos, mask, nxt = [], [], [], [], [], [], []
    for i in seqs:
        x, f, s = data.tokens[i], data.features[i], data.starts[i]
        n = len(x) - 1
        lens.append(n)
        toks.append(x[1:])
        feats.append(f[:-1])
        tgts.append(f[1:])
        rows = torch.arange(n)
        pos.append(rows)
        mask.append(rows >= s - 1)
        nxt.append(torch.cat([x[2:], torch.full((1,), -1, dtype=torch.int64)]))
    return EagleBatch(
        lens,
        torch.cat(toks),
        torch.cat(feats),
        torch.cat(tgts),
        torch.cat(pos),
        torch.cat(mask),
        torch.cat(nxt),
    )


def _unrolled_inputs(
    batch: EagleBatch, step1: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[int], torch.Tensor]:
    """Inputs of the second (unrolled) step: per sequence of n rows, the n teacher-forced rows again
    followed by n - 1 second-step rows; second-step row u (position u) reads ``(embed(x_{u+1}),
    f̂_u)`` with ``f̂_u`` the first step's output at row u - 1, and attends to the teacher-forced rows
    0..u-1 and to itself.

    Returns (token embeds, features, positions, masks, lengths, index of every second-step row in the
    packed output).
    """
    e_parts, f_parts, p_parts, masks, lens, rows2 = [], [], [], [], [], []
    offset = start = 0
    for n in batch.lens:
        e = embeds[start : start + n]
        f = features[start : start + n]
        s1 = step1[start : start + n]
        m = n - 1
        e_parts += [e, e[1:]]
        f_parts += [f, s1[:-1]]
        p_parts += [torch.arange(n), torch.arange(1, n)]
        masks.append(_unrolled_mask(n))
        lens.append(n + m)
        rows2.append(torch.arange(offset + n, offset + n + m))
        offset += n + m
        start += n
    return (
        torch.cat(e_parts),
        torch.cat(f_parts),
        torch.cat(p_parts),
        masks,
        lens,
        torch.cat(rows2),
    )


def _unrolled_mask(n: int) -> torch.Tensor:
    """The attention mask of one sequence of n teacher-forced rows followed by its n - 1 second-step
    rows (see :func:`_unrolled_inputs`)."""
    m = n - 1
    mask = torch.zeros(n + m, n + m, dtype=torch.bool)
    mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril_()
    if m:
        mask[n:, :n] = torch.ones(m, n, dtype=torch.bool).tril_()  # row u-1 of the block sees 0..u-1
        mask[n:, n:] = torch.eye(m, dtype=torch.bool)
    return mask


def _second_step_rows(batch: EagleBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """For every second-step row u >= 1 of every sequence: its index into the first step's rows (u,
    whose target f_{u+1} and next token it shares) and whether it is trained (u >= start)."""
    idx, start = [], 0
    for n in batch.lens:
        idx.append(torch.arange(start + 1, start + n))
        start += n
    rows = torch.cat(idx)
    prev = rows - 1
    return rows, batch.mask[prev]  # the first-step row u - 1 is in the response


def eagle_forward(
    head: nn.Module,
    target: FrozenTarget,
    batch: EagleBatch,
    unroll: int,
    noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[StepOutputs]:
    """Predicted features of each step: a list of ``(predicted [N, H], target [N, H], next tokens [N],
    loss mask [N])``, one entry per step (teacher-forced first, then the unrolled second)."""
    from specdec.attention.dense import DenseAttention, dense_metadata

    device = target.embed.device
    attention = DenseAttention()
    embeds = target.embed[batch.tokens.to(device)]
    features = batch.features.to(device).float()
    if noise > 0:
        features = features + (torch.rand(features.shape, generator=generator) * 2 - 1).to(device) * noise
    positions = batch.positions.to(device)
    step1 = head(embeds, features, positions, (None, None), dense_metadata(batch.lens, device), attention)
    targets = batch.targets.to(device)
    out = [(step1, targets, batch.next_tokens.to(device), batch.mask.to(device))]
    if unroll >= 2:
        e2, f2, p2, masks, lens, rows2 = _unrolled_inputs(batch, step1, embeds, features)
        meta = dense_metadata(lens, device)
        meta.new_token_masks = [m.to(device) for m in masks]
        both = head(e2, f2, p2.to(device), (None, None), meta, attention)
        step2 = both[rows2.to(device)]
        rows, mask2 = _second_step_rows(batch)
        rows = rows.to(device)
        out.append((step2, targets[rows], batch.next_tokens.to(device)[rows], mask2.to(device)))
    return out


def eagle_losses(
    target: FrozenTarget, predicted: torch.Tensor, wanted: torch.Tensor, mask: torch.Tensor, ce_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-1's loss over the masked rows: ``SmoothL1(f̂, f)`` (mean over features and rows) plus
    ``ce_weight`` times the cross-entropy of ``lm_head(f̂)`` against ``softmax(lm_head(f))``.
    Returns (total, feature loss, cross-entropy)."""
    p, w = predicted[mask], wanted[mask].float()
    if len(p) == 0:
        zero = predicted.sum() * 0.0
        return zero, zero.detach(), zero.detach()
    feat = F.smooth_l1_loss(p, w)
    with torch.no_grad():
        target_probs = torch.softmax(target.logits(w), dim=-1)
    logp = torch.log_softmax(target.logits(p), dim=-1)
    ce = -(target_probs * logp).sum(-1).mean()
    return feat + ce_weight * ce, feat.detach(), ce.detach()


def eagle_step(
    head: nn.Module,
    target: FrozenTarget,
    batch: EagleBatch,
    unroll: int,
    noise: float,
    generator: torch.Generator | None,
    ce_weight: float,
) -> tuple[float, dict[str, Any], int]:
    """One step's gradients (accumulated into ``head``): the mean over the unrolled steps of
    :func:`eagle_losses`. Returns the loss, each step's feature and cross-entropy losses, and the number
    of response rows."""
    steps = eagle_forward(head, target, batch, unroll, noise, generator)
    total = torch.zeros(())
    parts: dict[str, Any] = {}
    for i, (pred, wanted, _, mask) in enumerate(steps):
        loss, feat, ce = eagle_losses(target, pred, wanted, mask, ce_weight)
        total = total + loss
        parts[f"loss_feat_step{i + 1}"] = float(feat)
        parts[f"loss_ce_step{i + 1}"] = float(ce)
    total = total / len(steps)
    total.backward()
    return float(total.detach()), parts, int(batch.mask.sum())
