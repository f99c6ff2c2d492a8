"""Held-out evaluation of the heads: losses and accuracies on held-out data (during and after
training), and τ with ``specdec.LLM`` on held-out prompts (``train.eval``).

- Medusa, per head: loss, top-1/top-5 accuracy and the accuracy at each rank r < 10 (the fraction of
  positions whose true token is the head's r-th candidate: the input of a static tree).
- EAGLE: losses, top-1/top-5 of the first step (teacher-forced) and top-1 of the second (reading its
  own prediction).
- τ (tokens per verification step) and acceptance per position of ``specdec.LLM`` with the new heads,
  greedy, batch 1.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from experiments.config import SamplingConfig, TrainConfig
from experiments.train.data import DistilData
from experiments.train.objectives.eagle import StepOutputs, eagle_batches, eagle_forward, eagle_losses
from experiments.train.objectives.eagle3 import eagle3_batches, eagle3_forward
from experiments.train.objectives.medusa import MedusaExamples, medusa_head_outputs
from experiments.train.target import FrozenTarget

#: Ranks whose accuracy is recorded per Medusa head (for building static trees).
NUM_RANKS = 10

#: Builds an ``LLM`` for a ``speculative_config`` (None: plain), as in :mod:`experiments.run`.
LLMFactory = Callable[[dict[str, Any] | None], Any]


@torch.inference_mode()
def evaluate_medusa(
    heads: nn.Module,
    target: FrozenTarget,
    examples: MedusaExamples,
    max_positions: int | None = None,
    chunk: int = 1024,
) -> dict[str, Any]:
    """Held-out loss and, per head, top-1/top-5 accuracy and the accuracy at each rank r < 10."""
    n = len(examples) if max_positions is None else min(len(examples), max_positions)
    num_heads = examples.labels.shape[1]
    ranks = torch.zeros(num_heads, NUM_RANKS, dtype=torch.float64)
    counts = torch.zeros(num_heads, dtype=torch.float64)
    loss_sum = torch.zeros(num_heads, dtype=torch.float64)
    for a in range(0, n, chunk):
        f = examples.features[a : min(a + chunk, n)].float()
        lab = examples.labels[a : min(a + chunk, n)]
        for k in range(num_heads):
            ok = lab[:, k] >= 0
            if not bool(ok.any()):
                continue
            logits = target.logits(medusa_head_outputs(heads, f[ok], k))
            y = lab[ok, k]
            loss_sum[k] += F.cross_entropy(logits, y, reduction="sum").double()
            top = logits.topk(NUM_RANKS, dim=-1).indices
            ranks[k] += (top == y[:, None]).double().sum(0)
            counts[k] += len(y)
    acc = ranks / counts.clamp(min=1)[:, None]
    return {
        "loss": float((loss_sum / counts.clamp(min=1)).sum()),
        "loss_per_head": [float(x) for x in loss_sum / counts.clamp(min=1)],
        "top1": [float(a[0]) for a in acc],
        "top5": [float(a[:5].sum()) for a in acc],
        "rank_accuracy": [[float(x) for x in a] for a in acc],
        "num_positions": int(counts[0]),
    }


@torch.inference_mode()
def evaluate_eagle(
    head: nn.Module,
    target: FrozenTarget,
    data: DistilData,
    max_tokens: int | None = None,
    batch_tokens: int = 1024,
) -> dict[str, Any]:
    """Held-out losses, top-1/top-5 accuracy of the first (teacher-forced) step and top-1 of the second
    (reading its own first prediction) on the response rows, against the target's greedy token
    (``argmax lm_head(f_{t+1})``: the token greedy verification accepts; the sequence's own next token
    with greedy data, not with sampled data)."""
    sums = {
        "feat": 0.0,
        "ce": 0.0,
        "rows": 0,
        "top1": 0.0,
        "top5": 0.0,
        "acc_rows": 0,
        "top1_step2": 0.0,
        "rows2": 0,
    }
    used = 0
    for batch in eagle_batches(data, batch_tokens):
        if max_tokens is not None and used >= max_tokens:
            break
        used += sum(batch.lens)
        _accumulate_eagle(sums, target, eagle_forward(head, target, batch, unroll=2))
    num_rows = max(sums["rows"], 1)
    return {
        "loss_feat": sums["feat"] / num_rows,
        "loss_ce": sums["ce"] / num_rows,
        "top1": sums["top1"] / max(sums["acc_rows"], 1),
        "top5": sums["top5"] / max(sums["acc_rows"], 1),
        "top1_step2": sums["top1_step2"] / max(sums["rows2"], 1),
        "num_positions": int(sums["acc_rows"]),
    }


@torch.inference_mode()
def evaluate_eagle3(
    head: nn.Module,
    target: FrozenTarget,
    data: DistilData,
    steps: int,
    max_tokens: int | None = None,
    batch_tokens: int = 1024,
) -> dict[str, Any]:
    """Held-out loss and top-1 accuracy of each training-time-test step (the head's top draft token
    equals the target's top token, on rows whose target top token is in the draft vocabulary), and the
    product of the per-step accuracies up to each step (a rough chain acceptance)."""
    loss = [0.0] * steps
    hits = [0.0] * steps
    rows = [0] * steps
    used = 0
    for batch in eagle3_batches(data, batch_tokens, target.arch.hidden_size):
        if max_tokens is not None and used >= max_tokens:
            break
        used += batch.num_rows
        for j, s in enumerate(eagle3_forward(head, target, batch, steps)):
            loss[j] += float(s.loss) * s.rows
            hits[j] += s.hits
            rows[j] += s.rows
    top1 = [h / max(r, 1) for h, r in zip(hits, rows)]
    return {
        "loss": sum(x / max(r, 1) for x, r in zip(loss, rows)) / steps,
        "loss_per_step": [x / max(r, 1) for x, r in zip(loss, rows)],
        "top1_per_step": top1,
        "num_positions": rows[0],
    }


def _accumulate_eagle(sums: dict[str, Any], target: FrozenTarget, steps: Sequence[StepOutputs]) -> None:
    """Add one batch's losses (first step) and hits against the target's greedy token to ``sums``."""
    for step, (pred, wanted, nxt, mask) in enumerate(steps):
        rows = mask & (nxt >= 0)
        if not bool(rows.any()):
            continue
        logits = target.logits(pred[rows])
        y = target.logits(wanted[rows].float()).argmax(dim=-1)
        top = logits.topk(5, dim=-1).indices
        hit = top == y[:, None]
        if step == 0:
            n = int(mask.sum())
            _, feat, ce = eagle_losses(target, pred, wanted, mask, 0.0)
            sums["feat"] += float(feat) * n
            sums["ce"] += float(ce) * n
            sums["rows"] += n
            sums["top1"] += float(hit[:, 0].sum())
            sums["top5"] += float(hit.any(-1).sum())
            sums["acc_rows"] += len(y)
        else:
            sums["top1_step2"] += float(hit[:, 0].sum())
            sums["rows2"] += len(y)


def evaluate_tau(
    cfg: TrainConfig,
    heads_dir: Path,
    prompt_ids: Sequence[Sequence[int]],
    categories: Sequence[str],
    llm_factory: LLMFactory | None = None,
) -> dict[str, Any]:
    """τ and acceptance per position of ``specdec.LLM`` with the heads in ``heads_dir``, greedy, batch 1,
    over ``prompt_ids`` (counts summed over prompts; per category too)."""
    from experiments.run import run_pass

    spec = cfg.drafter.speculative_config()
    assert spec is not None
    spec["model"] = str(heads_dir)

    def make(speculative_config: dict[str, Any] | None) -> Any:
        from specdec import LLM

        return LLM(
            cfg.model.name,
            dtype=cfg.model.dtype.value,
            device=cfg.train.device,
            seed=cfg.train.seed,
            speculative_config=speculative_config,
        )

    llm = (llm_factory or make)(spec)
    records = run_pass(
        llm,
        prompt_ids,
        SamplingConfig(),
        cfg.train.eval_max_tokens,
        warmup_ids=prompt_ids[0][:16] if prompt_ids else None,
        pass_name="eval",
    )
    del llm
    gc.collect()
    out = _aggregate_tau(records)
    by_cat: dict[str, list[dict[str, Any]]] = {}
    for c, r in zip(categories, records):
        by_cat.setdefault(c, []).append(r)
    out["per_category"] = {c: _aggregate_tau(rs) for c, rs in by_cat.items()}
    return out


def _aggregate_tau(recs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """τ, acceptance rate and acceptance per position of a group of ``run_pass`` records."""
    drafts = sum(r["spec"]["num_drafts"] for r in recs if r["spec"])
    drafted = sum(r["spec"]["num_draft_tokens"] for r in recs if r["spec"])
    accepted = sum(r["spec"]["num_accepted_tokens"] for r in recs if r["spec"])
    per_pos: list[int] = []
    for r in recs:
        for i, x in enumerate((r["spec"] or {}).get("accepted_per_position") or []):
            per_pos += [0] * (i + 1 - len(per_pos))
            per_pos[i] += x
    tokens = sum(r["num_tokens"] for r in recs)
    secs = sum(r["time_s"] for r in recs)
    return {
        "num_prompts": len(recs),
        "tau": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "accepted_per_position": [x / drafts for x in per_pos] if drafts else None,
        "num_drafts": drafts,
        "tokens": tokens,
        "tokens_per_s": tokens / secs if secs else None,
    }
