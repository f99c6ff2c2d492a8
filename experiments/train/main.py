"""``python -m experiments.train``: the Hydra entry point (``conf/train.yaml``) and its printed summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from experiments.config import register_configs, to_train_config
from experiments.tracking import run_tracked
from experiments.train.loop import brief
from experiments.train.pipeline import run_training

#: ``experiments/conf``: the config search path.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines: data, time, held-out accuracy, τ."""
    m = summary["final_metrics"]
    n = summary["num_prompts"]
    lines = [
        f"{summary['method']} heads for {summary['target']} -> {summary['out_dir']} "
        f"({summary['size_bytes'] / 1e6:.1f} MB)",
        f"data: {n['train']} + {n['heldout']} held-out prompts, {summary['num_training_tokens']} training "
        f"response tokens ({'cached' if summary['data_cached'] else 'generated'}: {summary['data_dir']})",
        f"training: {summary['train_time_s']:.0f} s, {summary['steps']} steps, "
        f"{summary['epochs']:.2f} epochs; train loss {summary['initial_train_loss']:.4f} -> "
        f"{summary['final_train_loss']:.4f}",
        f"held-out: {brief(m)}",
    ]
    if "rank_accuracy" in m:
        for k, ranks in enumerate(m["rank_accuracy"]):
            lines.append(f"  head {k + 1} accuracy at ranks 0..9: " + " ".join(f"{x:.3f}" for x in ranks))
    tau = summary.get("tau")
    if tau and tau.get("tau") is not None:
        per_pos = tau.get("accepted_per_position") or []
        lines.append(
            f"tau {tau['tau']:.2f} on {tau['num_prompts']} held-out prompts; acceptance per position "
            + " ".join(f"{x:.2f}" for x in per_pos)
        )
    return "\n".join(lines)


register_configs()


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="train")
def main(dcfg: DictConfig) -> dict[str, Any]:
    """Hydra entry point: compose and check the config (before any model loads), train, save, print."""
    from hydra.core.hydra_config import HydraConfig

    cfg = to_train_config(dcfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    summary = run_tracked(
        cfg, run_dir, lambda tracker: run_training(cfg, run_dir, tracker=tracker), job_type="train"
    )
    print(format_summary(summary))
    print(f"wall time {summary['wall_time_s']:.1f} s; run files in {run_dir}")
    return {k: v for k, v in summary.items() if k not in ("git", "versions", "history")}
