"""Each method's training run: its heads, data, step and held-out evaluation, through the shared loop
(:func:`experiments.train.loop.train_loop`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from experiments.config import Eagle3DrafterConfig, EagleDrafterConfig, MedusaDrafterConfig, TrainConfig
from experiments.tracking import NullTracker, Tracker
from experiments.train.artefacts import initialise_from
from experiments.train.data import DistilData
from experiments.train.evaluate import evaluate_eagle, evaluate_eagle3, evaluate_medusa
from experiments.train.loop import TrainResult, make_optimizer, planned_steps, train_loop
from experiments.train.objectives.eagle import EagleBatch, eagle_batches, eagle_step
from experiments.train.objectives.eagle3 import (
    Eagle3Batch,
    eagle3_batches,
    eagle3_step,
    select_draft_vocab,
    vocab_coverage,
)
from experiments.train.objectives.medusa import MedusaExamples, medusa_examples, medusa_step
from experiments.train.target import FrozenTarget

logger = logging.getLogger("experiments.train")


def train_heads(
    cfg: TrainConfig, target: FrozenTarget, train: DistilData, heldout: DistilData, tracker: Tracker
) -> tuple[TrainResult, int, dict[str, Any] | None, dict[str, Any]]:
    """Train the heads of ``cfg.drafter``'s method; returns the result, the number of heads, for EAGLE
    and EAGLE-3 the head's architecture fields, and the method's other ``config.json`` fields."""
    from specdec.drafters.heads import arch_fields

    if isinstance(cfg.drafter, MedusaDrafterConfig):
        return train_medusa(cfg, target, train, heldout, tracker), cfg.train.medusa_num_heads, None, {}
    if isinstance(cfg.drafter, EagleDrafterConfig):
        return train_eagle(cfg, target, train, heldout, tracker), 1, arch_fields(target.arch), {}
    if isinstance(cfg.drafter, Eagle3DrafterConfig):
        result = train_eagle3(cfg, target, train, heldout, tracker)
        head = result.module
        extra = {
            "draft_vocab_size": head.draft_vocab_size,
            "feature_layers": list(head.feature_layers),
        }
        return result, 1, arch_fields(target.arch), extra
    # validate_train_config refuses it
    raise ValueError(f"cannot train drafter {cfg.drafter.method}")


def train_medusa(
    cfg: TrainConfig,
    target: FrozenTarget,
    train: DistilData,
    heldout: DistilData,
    tracker: Tracker | None = None,
) -> TrainResult:
    """Train ``train.medusa_num_heads`` Medusa heads (:mod:`experiments.train.objectives.medusa`)."""
    from specdec.drafters.heads import MedusaHeads

    t = cfg.train
    tracker = tracker or NullTracker()
    torch.manual_seed(t.seed)
    heads = MedusaHeads(target.arch.hidden_size, t.medusa_num_heads).to(t.device)
    initialise_from(heads, t.init_from, target, "medusa")
    examples = medusa_examples(train, t.medusa_num_heads)
    held = medusa_examples(heldout, t.medusa_num_heads)
    if len(examples) == 0:
        raise ValueError("no training positions: the responses are too short")
    batch = min(t.batch_tokens, len(examples))
    steps_per_epoch = math.ceil(len(examples) / batch)
    total_steps = planned_steps(cfg, steps_per_epoch)
    opt = make_optimizer(heads, cfg)
    gen = torch.Generator().manual_seed(t.seed)
    logger.info(
        "medusa: %d heads, %d training positions (batch %d, %d steps an epoch), %d held-out positions",
        t.medusa_num_heads,
        len(examples),
        batch,
        steps_per_epoch,
        len(held),
    )

    def evaluate(limit: int | None) -> dict[str, Any]:
        heads.eval()
        out = evaluate_medusa(heads, target, held, limit) if len(held) else {}
        heads.train()
        return out

    return train_loop(
        cfg,
        heads,
        opt,
        total_steps,
        steps_per_epoch,
        lambda: _medusa_batches(len(examples), batch, gen),
        lambda idx: _medusa_train_step(heads, target, examples, idx),
        evaluate,
        tracker,
    )


def _medusa_batches(n: int, batch: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    perm = torch.randperm(n, generator=gen)
    for a in range(0, n, batch):
        yield perm[a : a + batch]


def _medusa_train_step(
    heads: nn.Module, target: FrozenTarget, examples: MedusaExamples, idx: torch.Tensor
) -> tuple[float, dict[str, Any], int]:
    loss, per_head = medusa_step(heads, target, examples.features[idx], examples.labels[idx])
    return loss, {"loss_per_head": per_head}, len(idx)


def train_eagle(
    cfg: TrainConfig,
    target: FrozenTarget,
    train: DistilData,
    heldout: DistilData,
    tracker: Tracker | None = None,
) -> TrainResult:
    """Train the EAGLE head (:mod:`experiments.train.objectives.eagle`)."""
    from specdec.drafters.heads import EagleHead

    t = cfg.train
    tracker = tracker or NullTracker()
    torch.manual_seed(t.seed)
    head = EagleHead(target.arch).to(t.device).float()
    initialise_from(head, t.init_from, target, "eagle")
    gen = torch.Generator().manual_seed(t.seed)
    noise_gen = torch.Generator().manual_seed(t.seed + 1)
    steps_per_epoch = sum(1 for _ in eagle_batches(train, t.batch_tokens))
    if steps_per_epoch == 0:
        raise ValueError("no training sequences")
    total_steps = planned_steps(cfg, steps_per_epoch)
    opt = make_optimizer(head, cfg)
    logger.info(
        "eagle: %d training sequences (%d response rows, %d steps an epoch), %d held out, unroll %d",
        len(train),
        train.num_response_tokens,
        steps_per_epoch,
        len(heldout),
        t.eagle_unroll,
    )

    def batches() -> Iterator[EagleBatch]:
        return eagle_batches(train, t.batch_tokens, torch.randperm(len(train), generator=gen).tolist())

    def step(batch: EagleBatch) -> tuple[float, dict[str, Any], int]:
        return eagle_step(head, target, batch, t.eagle_unroll, t.eagle_noise, noise_gen, t.eagle_ce_weight)

    def evaluate(limit: int | None) -> dict[str, Any]:
        head.eval()
        out = evaluate_eagle(head, target, heldout, limit) if len(heldout) else {}
        head.train()
        return out

    return train_loop(cfg, head, opt, total_steps, steps_per_epoch, batches, step, evaluate, tracker)


def train_eagle3(
    cfg: TrainConfig,
    target: FrozenTarget,
    train: DistilData,
    heldout: DistilData,
    tracker: Tracker | None = None,
) -> TrainResult:
    """Train an EAGLE-3 head (:mod:`experiments.train.objectives.eagle3`) on data made with
    ``data.feature_layers``: the draft vocabulary is chosen from the training split, the head's LM head
    starts as the target's rows of it and its final norm as the target's.

    Raises:
        ValueError: data without fused features, or no training sequences.
    """
    from specdec.drafters.eagle3_head import Eagle3Head

    t = cfg.train
    tracker = tracker or NullTracker()
    arch = target.arch
    layers = train.meta.get("feature_layers") or _parts_feature_layers(train.meta)
    if not layers or train.top_tokens is None:
        raise ValueError("EAGLE-3 training needs data made with data.feature_layers")
    torch.manual_seed(t.seed)
    size = min(t.eagle3_draft_vocab_size, arch.vocab_size)
    draft_ids = select_draft_vocab(train, size, arch.eos_token_ids, arch.vocab_size)
    head = Eagle3Head(arch, size, layers).to(t.device).float()
    head.set_vocab(draft_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head[head.target_ids().to(target.lm_head.device)].float())
        if target.final_norm is not None:
            head.norm.weight.copy_(target.final_norm)
    initialise_from(head, t.init_from, target, "eagle3")
    coverage = vocab_coverage(train, draft_ids)
    held_coverage = vocab_coverage(heldout, draft_ids) if len(heldout) else None
    gen = torch.Generator().manual_seed(t.seed)
    h = arch.hidden_size
    steps_per_epoch = sum(1 for _ in eagle3_batches(train, t.batch_tokens, h))
    if steps_per_epoch == 0:
        raise ValueError("no training sequences")
    total_steps = planned_steps(cfg, steps_per_epoch)
    opt = make_optimizer(head, cfg)
    logger.info(
        "eagle3: layers %s, draft vocabulary %d (covers %.1f %% of the target's top tokens in training "
        "responses, %s held out), %d sequences (%d response rows, %d steps an epoch), TTT %d steps",
        layers,
        size,
        100 * coverage,
        "-" if held_coverage is None else f"{100 * held_coverage:.1f} %",
        len(train),
        train.num_response_tokens,
        steps_per_epoch,
        t.eagle3_ttt_steps,
    )
    tracker.log_summary({"draft_vocab_coverage": coverage, "draft_vocab_coverage_heldout": held_coverage})

    def batches() -> Iterator[Eagle3Batch]:
        order = torch.randperm(len(train), generator=gen).tolist()
        return eagle3_batches(train, t.batch_tokens, h, order)

    def step(batch: Eagle3Batch) -> tuple[float, dict[str, Any], int]:
        return eagle3_step(head, target, batch, t.eagle3_ttt_steps, t.eagle3_step_decay)

    def evaluate(limit: int | None) -> dict[str, Any]:
        head.eval()
        out = evaluate_eagle3(head, target, heldout, t.eagle3_ttt_steps, limit) if len(heldout) else {}
        out["draft_vocab_coverage"] = coverage
        head.train()
        return out

    return train_loop(cfg, head, opt, total_steps, steps_per_epoch, batches, step, evaluate, tracker)


def _parts_feature_layers(meta: dict[str, Any]) -> list[int] | None:
    """The feature layers of concatenated data (``data.include_greedy``): every part's, when equal."""
    layers = {tuple(p.get("feature_layers") or ()) for p in meta.get("parts", [])}
    return list(layers.pop()) if len(layers) == 1 else None
