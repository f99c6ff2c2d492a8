"""What a training run leaves behind and starts from: the heads (``config.json`` with the provenance in
``training``, ``model.safetensors`` in bfloat16, by :func:`~specdec.drafters.heads.save_heads`) and
``COMMAND.md`` (the exact command line and the figures), where ``train.out_dir`` / ``train.install``
say; and the heads ``train.init_from`` starts from, with their own provenance."""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from experiments.config import TrainConfig, config_to_dict
from experiments.tracking import package_versions
from experiments.train.data import DistilData
from experiments.train.loop import TrainResult
from experiments.train.prompts import prompt_id_of
from experiments.train.target import FrozenTarget

if TYPE_CHECKING:
    from specdec.drafters.heads import HeadConfig

logger = logging.getLogger("experiments.train")

#: Where ``train.install=true`` writes the heads (the built-in heads ``SpeculativeConfig`` loads by name).
HEADS_DIR = Path(__file__).resolve().parents[2] / "specdec" / "heads"


# ------------------------------------------------------------------------------------ init_from
def initialise_from(module: nn.Module, init_from: str | None, target: FrozenTarget, method: str) -> None:
    """Copy the weights of saved heads (a built-in name or a directory) into ``module`` (fine-tuning
    instead of a fresh initialisation); nothing when ``init_from`` is None.

    Raises:
        ConfigError: unknown heads, or heads of another method.
        CorruptModelError: unreadable heads, or heads of another shape (e.g. another number of heads).
        InvalidRequestError: heads of a target of another hidden or vocabulary size.
    """
    if init_from is None:
        return
    from specdec.drafters.heads import load_heads
    from specdec.errors import CorruptModelError

    saved, _ = load_heads(init_from, target.arch, method, torch.float32, "cpu")
    try:
        module.load_state_dict(saved.state_dict())
    except RuntimeError as e:
        raise CorruptModelError(f"heads {init_from!r} do not fit the heads being trained: {e}") from e
    logger.info("%s heads initialised from %s", method, init_from)


def init_provenance(init_from: str | None) -> dict[str, Any] | None:
    """What ``train.init_from`` heads were trained with (their command, data, steps and time, and their
    own starting point), for the new heads' record; None without ``init_from``."""
    if init_from is None:
        return None
    from specdec.drafters.heads import resolve_heads_dir

    directory = resolve_heads_dir(init_from)
    training = json.loads((directory / "config.json").read_text()).get("training") or {}
    keys = ("command", "data_fingerprint", "num_training_tokens", "steps", "epochs", "train_time_s")
    return {"heads": init_from, **{k: training.get(k) for k in keys}, "init_from": training.get("init_from")}


# ---------------------------------------------------------------------------------------- where
def target_name(model: str) -> str:
    """A zoo name as it is; a directory by its last component."""
    p = Path(model).expanduser()
    return p.name if (os.sep in model or p.is_dir()) else model


def default_out_dir(cfg: TrainConfig, run_dir: Path | None) -> Path:
    """``train.out_dir``, else ``specdec/heads/<target>-<method>`` with ``train.install``, else
    ``<run dir>/<target>-<method>``."""
    from specdec.drafters.heads import default_heads_name

    name = default_heads_name(cfg.model.name, cfg.drafter.method)
    if cfg.train.out_dir:
        return Path(cfg.train.out_dir).expanduser()
    if cfg.train.install:
        return HEADS_DIR / name
    if run_dir is None:
        raise ValueError("no run directory: set train.out_dir or train.install=true")
    return run_dir / name


# ----------------------------------------------------------------------------------- provenance
def command_line() -> str:
    """The command that started this process, as ``python -m experiments.train ...``."""
    argv = list(sys.argv)
    script = Path(argv[0]) if argv else None
    if script is not None and (
        script.name == "train.py" or (script.name == "__main__.py" and script.parent.name == "train")
    ):
        return (
            "python -m experiments.train " + shlex.join(argv[1:])
            if len(argv) > 1
            else "python -m experiments.train"
        )
    return shlex.join(argv)


def training_record(
    cfg: TrainConfig,
    command: str,
    data: DistilData,
    train: DistilData,
    heldout: DistilData,
    result: TrainResult,
    init_from: dict[str, Any] | None,
    seeds: dict[str, Any],
    info: dict[str, Any],
) -> dict[str, Any]:
    """The provenance of the heads (``training`` in their ``config.json``): command, data, split,
    seeds, steps and time, starting point, options, held-out metrics, git commit and versions."""
    data_meta = {k: v for k, v in data.meta.items() if k not in ("directory", "cached", "responses_cached")}
    return {
        "command": command,
        "method": cfg.drafter.method,
        "target": cfg.model.name,
        "data_fingerprint": data.meta["fingerprint"],
        "data": data_meta,
        "heldout_fraction": cfg.data.heldout_fraction,
        "seeds": seeds,
        "num_prompts": {
            "train": len({prompt_id_of(i) for i in train.ids}),
            "heldout": len({prompt_id_of(i) for i in heldout.ids}),
        },
        "num_training_tokens": train.num_response_tokens,
        "positions_seen": result.positions_seen,
        "steps": result.steps,
        "epochs": result.epochs,
        "train_time_s": result.train_time_s,
        "init_from": init_from,
        "options": config_to_dict(cfg.train),
        "final_metrics": result.metrics,
        "initial_train_loss": result.initial_loss,
        "final_train_loss": result.final_loss,
        "git": info["git"],
        "versions": package_versions(),
    }


# --------------------------------------------------------------------------------------- saving
def head_config(
    cfg: TrainConfig,
    target: FrozenTarget,
    num_heads: int,
    arch: dict[str, Any] | None,
    training: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> HeadConfig:
    """The ``config.json`` of the trained heads, with the provenance ``training`` and the method's own
    fields ``extra`` (EAGLE-3: ``draft_vocab_size``, ``feature_layers``)."""
    from specdec.drafters.heads import HeadConfig

    return HeadConfig(
        method=cfg.drafter.method,
        target=target_name(cfg.model.name),
        hidden_size=target.arch.hidden_size,
        vocab_size=target.arch.vocab_size,
        num_heads=num_heads,
        arch=arch,
        training=training,
        **(extra or {}),
    )


def save_artefacts(module: nn.Module, head_cfg: HeadConfig, out_dir: Path, command: str) -> None:
    """The heads (``config.json`` with the provenance ``head_cfg.training``, ``model.safetensors``) and
    ``COMMAND.md`` into ``out_dir``."""
    from specdec.drafters.heads import save_heads

    save_heads(module, head_cfg, out_dir)
    write_command_md(out_dir, command, head_cfg.training)


def write_command_md(out_dir: Path, command: str, training: dict[str, Any]) -> None:
    """``COMMAND.md``: the exact command line that produced the heads, and its figures."""
    d = training["data"]
    n = training["num_prompts"]
    lines = [
        f"# {out_dir.name}",
        "",
        f"{training['method']} heads for `{training['target']}`, trained by `experiments/train`:",
        "",
        "```bash",
        command,
        "```",
        "",
        f"- data: {n['train']} training and {n['heldout']} held-out prompts ({d['num_sequences']} sequences, "
        f"{d['num_tokens']} tokens, {d['num_response_tokens']} of them response tokens); "
        f"{training['num_training_tokens']} response tokens trained on; fingerprint "
        f"`{training['data_fingerprint'][:16]}`",
        f"- generation: `{json.dumps(d['generation'])}`; {d.get('generation_time_s', 0):.0f} s, then "
        f"{d.get('feature_time_s', 0):.0f} s for the features",
        f"- training: {training['train_time_s']:.0f} s, {training['steps']} steps, "
        f"{training['epochs']:.2f} epochs; seeds `{json.dumps(training['seeds'])}`",
        *_figure_lines(training),
    ]
    (out_dir / "COMMAND.md").write_text("\n".join(lines) + "\n")


def _figure_lines(training: dict[str, Any]) -> list[str]:
    """COMMAND.md's lines on the starting heads, the held-out accuracies and τ."""
    m = training.get("final_metrics") or {}
    lines = []
    init = training.get("init_from")
    if init:
        lines.append(
            f"- started from the heads `{init['heads']}` ({init['train_time_s']:.0f} s, {init['steps']} "
            f"steps on data `{str(init['data_fingerprint'])[:16]}`, by `{init['command']}`)"
        )
    if "rank_accuracy" in m:
        for k, ranks in enumerate(m["rank_accuracy"]):
            lines.append(
                f"- head {k + 1} (token t+{k + 2}), held out: top-1 {m['top1'][k]:.3f}, top-5 "
                f"{m['top5'][k]:.3f}; accuracy at ranks 0-9: " + " ".join(f"{x:.3f}" for x in ranks)
            )
    elif "top1" in m:
        lines.append(
            f"- held out, first step (teacher-forced): top-1 {m['top1']:.3f}, top-5 {m['top5']:.3f}; "
            f"second step (reading its own prediction): top-1 {m['top1_step2']:.3f}"
        )
    tau = training.get("tau")
    if tau and tau.get("tau") is not None:
        per_pos = " ".join(f"{x:.2f}" for x in tau.get("accepted_per_position") or [])
        lines.append(
            f"- tau on {tau['num_prompts']} held-out prompts (greedy, batch 1): {tau['tau']:.2f}; "
            f"acceptance per position {per_pos}"
        )
    return lines


def dir_size(directory: Path) -> int:
    """The bytes of the files directly in ``directory``."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
