"""The training loop both methods share: AdamW on float32 master weights, linear warm-up then cosine
decay over the budget (``train.time_budget_s`` and/or ``train.epochs``), gradient clipping, logging every
``train.log_every`` steps, a held-out evaluation on a subset every ``train.eval_interval_s`` and on all of
it at the end."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from experiments.config import TrainConfig
from experiments.tracking import Tracker

logger = logging.getLogger("experiments.train")

#: One training step on a batch: accumulates the gradients, returns (loss, logged parts, positions).
StepFn = Callable[[Any], tuple[float, dict[str, Any], int]]
#: A held-out evaluation limited to so many positions (None: all of them).
EvalFn = Callable[[int | None], dict[str, Any]]


class Schedule:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` of the peak over the
    budget's progress: the larger of elapsed / ``time_budget_s`` and step / total steps (epochs)."""

    def __init__(self, opts: Any, total_steps: int | None) -> None:
        self.opts = opts
        self.total_steps = total_steps
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def progress(self, step: int) -> float:
        p = 0.0
        if self.opts.time_budget_s is not None:
            p = max(p, self.elapsed() / self.opts.time_budget_s)
        if self.total_steps is not None:
            p = max(p, step / max(self.total_steps, 1))
        return min(p, 1.0)

    def done(self, step: int) -> bool:
        if self.total_steps is not None and step >= self.total_steps:
            return True
        return self.opts.time_budget_s is not None and self.elapsed() >= self.opts.time_budget_s

    def lr(self, step: int) -> float:
        o = self.opts
        warm = min(1.0, (step + 1) / o.warmup_steps) if o.warmup_steps > 0 else 1.0
        cos = 0.5 * (1 + math.cos(math.pi * self.progress(step)))
        return o.lr * warm * (o.min_lr_ratio + (1 - o.min_lr_ratio) * cos)


@dataclass
class TrainResult:
    """What a training run produced."""

    module: nn.Module
    metrics: dict[str, Any]  # the final held-out evaluation
    history: list[dict[str, Any]]  # logged training rows
    steps: int
    epochs: float
    train_time_s: float
    positions_seen: int
    initial_loss: float | None
    final_loss: float | None


def make_optimizer(module: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over ``module``'s parameters with ``train.lr`` and ``train.weight_decay``."""
    return torch.optim.AdamW(module.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)


def planned_steps(cfg: TrainConfig, steps_per_epoch: int) -> int | None:
    """The steps of ``train.epochs`` epochs (at least one); None without ``train.epochs``."""
    epochs = cfg.train.epochs
    return None if epochs is None else max(1, round(epochs * steps_per_epoch))


@dataclass
class _TrainLog:
    """The training losses: a row (the mean loss since the last one, ...) every ``log_every`` steps."""

    log_every: int
    steps_per_epoch: int
    tracker: Tracker
    history: list[dict[str, Any]] = field(default_factory=list)
    recent: list[float] = field(default_factory=list)
    first_losses: list[float] = field(default_factory=list)
    seen: int = 0

    def add(self, step: int, loss: float, parts: dict[str, Any], n: int, lr: float, elapsed: float) -> None:
        self.seen += n
        self.recent.append(loss)
        if len(self.first_losses) < self.log_every:
            self.first_losses.append(loss)
        if step % self.log_every != 0:
            return
        row = {
            "train/loss": sum(self.recent) / len(self.recent),
            "train/lr": lr,
            "train/epoch": step / self.steps_per_epoch,
            "train/positions": self.seen,
            "train/elapsed_s": elapsed,
            **{f"train/{k}": v for k, v in parts.items()},
        }
        self.history.append(row)
        self.tracker.log(row, step=step)
        logger.info(
            "step %d (epoch %.2f, %.0f s): loss %.4f, lr %.2e",
            step,
            row["train/epoch"],
            row["train/elapsed_s"],
            row["train/loss"],
            lr,
        )
        self.recent = []

    def close(self, step: int) -> None:
        """A last row for the steps since the last one."""
        if self.recent:
            self.history.append(
                {
                    "train/loss": sum(self.recent) / len(self.recent),
                    "train/epoch": step / self.steps_per_epoch,
                }
            )

    @property
    def initial_loss(self) -> float | None:
        return sum(self.first_losses) / len(self.first_losses) if self.first_losses else None

    @property
    def final_loss(self) -> float | None:
        last_losses = [h["train/loss"] for h in self.history[-1:]]
        return last_losses[0] if last_losses else None


def train_loop(
    cfg: TrainConfig,
    module: nn.Module,
    opt: torch.optim.Optimizer,
    total_steps: int | None,
    steps_per_epoch: int,
    batches: Callable[[], Iterator[Any]],
    step_fn: StepFn,
    evaluate: EvalFn,
    tracker: Tracker,
) -> TrainResult:
    """The loop both methods share: schedule, clipping, logging, periodic and final evaluation."""
    t = cfg.train
    module.train()
    sched = Schedule(t, total_steps)
    log = _TrainLog(t.log_every, steps_per_epoch, tracker)
    step = 0
    last_eval = 0.0
    while not sched.done(step):
        for batch in batches():
            if sched.done(step):
                break
            lr = sched.lr(step)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss, parts, n = step_fn(batch)
            torch.nn.utils.clip_grad_norm_(module.parameters(), t.grad_clip)
            opt.step()
            step += 1
            log.add(step, loss, parts, n, lr, sched.elapsed())
            if sched.elapsed() - last_eval >= t.eval_interval_s and not sched.done(step):
                metrics = evaluate(t.eval_max_positions)
                last_eval = sched.elapsed()
                tracker.log({"eval": metrics}, step=step)
                logger.info("held-out (subset) at step %d: %s", step, brief(metrics))
    train_time = sched.elapsed()
    log.close(step)
    module.eval()
    final = evaluate(None)
    tracker.log({"eval": final}, step=step)
    logger.info("held-out (all) after %d steps, %.0f s: %s", step, train_time, brief(final))
    return TrainResult(
        module,
        final,
        log.history,
        step,
        step / steps_per_epoch,
        train_time,
        log.seen,
        log.initial_loss,
        log.final_loss,
    )


def brief(metrics: dict[str, Any]) -> str:
    """The main figures of a held-out evaluation, on one line."""
    keys = ("loss", "top1", "top5", "loss_feat", "loss_ce", "top1_step2")

    def fmt(v: Any) -> str:
        if isinstance(v, list):
            return "[" + ", ".join(f"{x:.3f}" for x in v) + "]"
        return f"{v:.4f}"

    return ", ".join(f"{k} {fmt(metrics[k])}" for k in keys if k in metrics)
