"""One training run end to end: data, training, saving and (``train.eval``) evaluation, with the run
directory's ``config.yaml``, ``run_info.json`` and ``summary.json``."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from experiments.config import TrainConfig, config_to_dict
from experiments.datasets import Prompt
from experiments.tracking import NullTracker, Tracker, run_info, write_run_files
from experiments.train.artefacts import (
    command_line,
    default_out_dir,
    dir_size,
    head_config,
    init_provenance,
    save_artefacts,
    training_record,
)
from experiments.train.data import DistilData, prepare_data
from experiments.train.evaluate import LLMFactory, evaluate_tau
from experiments.train.loop import TrainResult
from experiments.train.prompts import split_heldout, training_prompts
from experiments.train.target import FrozenTarget
from experiments.train.trainers import train_heads

if TYPE_CHECKING:
    from specdec.drafters.heads import HeadConfig

logger = logging.getLogger("experiments.train")


def run_training(
    cfg: TrainConfig,
    run_dir: str | Path | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    tracker: Tracker | None = None,
    llm_factory: LLMFactory | None = None,
) -> dict[str, Any]:
    """Data, training, saving and (``train.eval``) evaluation; returns the summary (also written to
    ``run_dir/summary.json`` with ``config.yaml`` and ``run_info.json``, when ``run_dir`` is given).

    Args:
        cfg: a validated config (:func:`experiments.config.to_train_config`).
        run_dir: the run directory (None: files only in the heads' directory).
        prompt_ids: token-id prompts to use instead of the built-in prompt sets (e.g. a model without a
            tokenizer); their ids are ``given/<i>``.
        tracker: where losses and accuracies are logged (default: nowhere). The caller finishes it.
        llm_factory: how the evaluation builds its ``LLM`` (default: ``specdec.LLM`` of the target).
    """
    from specdec.zoo import resolve_model

    tracker = tracker or NullTracker()
    if cfg.drafter.method == "eagle3" and cfg.data.feature_layers is None:  # its default fused layers
        cfg = replace(cfg, data=replace(cfg.data, feature_layers=[]))
    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    if cfg.train.torch_threads is not None:
        torch.set_num_threads(cfg.train.torch_threads)
    run_dir = None if run_dir is None else Path(run_dir)
    command = command_line()
    seeds = {"data": cfg.data.seed, "prompts": cfg.data.prompt_seed, "train": cfg.train.seed}
    info = run_info(seeds, cfg.train.device)
    if run_dir is not None:
        write_run_files(run_dir, config_to_dict(cfg), info)
    try:
        model_dir = resolve_model(cfg.model.name)
        prompts, ids = _prompts_and_ids(cfg, prompt_ids)
        from experiments.run import has_tokenizer

        skip_tokenizer_init = not has_tokenizer(cfg.model.name)
        data = prepare_data(cfg, prompts, ids, model_dir, skip_tokenizer_init=skip_tokenizer_init)
        target = FrozenTarget.load(model_dir, cfg.train.device)
        if cfg.drafter.method != "eagle3":  # Medusa and EAGLE read the final-norm features only
            data = data.final_features(target.arch.hidden_size)
        train, heldout = _split(data)
        provenance = init_provenance(cfg.train.init_from)  # read before install may overwrite them
        result, num_heads, arch, extra = train_heads(cfg, target, train, heldout, tracker)
        out_dir = default_out_dir(cfg, run_dir)
        training = training_record(cfg, command, data, train, heldout, result, provenance, seeds, info)
        head_cfg = head_config(cfg, target, num_heads, arch, training, extra)
        save_artefacts(result.module, head_cfg, out_dir, command)
        size = dir_size(out_dir)
        logger.info("heads saved to %s (%.1f MB)", out_dir, size / 1e6)
        if cfg.train.eval:
            _evaluate(cfg, prompts, ids, result.module, head_cfg, out_dir, command, tracker, llm_factory)
        summary = _summary(out_dir, size, data, result, training, info, t_start)
    finally:
        torch.set_num_threads(threads_before)
    _report(tracker, run_dir, result, summary)
    return summary


def _prompts_and_ids(
    cfg: TrainConfig, prompt_ids: Sequence[Sequence[int]] | None
) -> tuple[list[Prompt], list[list[int]]]:
    if prompt_ids is not None:
        prompts = [Prompt(f"given/{i}", "given", token_ids=list(ids)) for i, ids in enumerate(prompt_ids)]
        return prompts, [list(p) for p in prompt_ids]
    from experiments.run import load_tokenizer, prompt_token_ids

    prompts = training_prompts(cfg.data, cfg.model.name, cfg.model.dtype.value)
    if not prompts:
        raise ValueError(
            "no prompts: data.builtin_limit, data.chat_limit, data.instruct_limit and data.synth_prompts "
            "are all 0"
        )
    tokenizer = load_tokenizer(cfg.model.name)
    if tokenizer is None:
        raise ValueError(f"model {cfg.model.name} has no tokenizer: pass prompt token ids")
    return prompts, prompt_token_ids(tokenizer, prompts)


def _split(data: DistilData) -> tuple[DistilData, DistilData]:
    """The training and held-out sequences of ``data``, logged."""
    train, heldout = data.subset(False), data.subset(True)
    logger.info(
        "%d training sequences (%d response tokens), %d held out (%d response tokens)",
        len(train),
        train.num_response_tokens,
        len(heldout),
        heldout.num_response_tokens,
    )
    return train, heldout


def _evaluate(
    cfg: TrainConfig,
    prompts: Sequence[Prompt],
    ids: Sequence[Sequence[int]],
    module: nn.Module,
    head_cfg: HeadConfig,
    out_dir: Path,
    command: str,
    tracker: Tracker,
    llm_factory: LLMFactory | None,
) -> None:
    """τ on the first ``train.eval_prompts`` held-out prompts; it joins the heads' provenance (saved
    again) and the tracker's summary."""
    flags = split_heldout(prompts, cfg.data.heldout_fraction)
    held_prompts = [p for p, h in zip(prompts, flags) if h]
    held_ids = [i for i, h in zip(ids, flags) if h]
    k = cfg.train.eval_prompts
    tau = evaluate_tau(cfg, out_dir, held_ids[:k], [p.category for p in held_prompts[:k]], llm_factory)
    head_cfg.training["tau"] = tau
    save_artefacts(module, head_cfg, out_dir, command)  # the evaluation joins the provenance
    tracker.log_summary({"tau": {k: v for k, v in tau.items() if k != "per_category"}})


def _summary(
    out_dir: Path,
    size: int,
    data: DistilData,
    result: TrainResult,
    training: dict[str, Any],
    info: dict[str, Any],
    t_start: float,
) -> dict[str, Any]:
    """The run's summary: where the heads and the data are, the training history and record."""
    return {
        "out_dir": str(out_dir),
        "size_bytes": size,
        "data_dir": data.meta["directory"],
        "data_cached": data.meta["cached"],
        "responses_cached": data.meta.get("responses_cached", True),
        "history": result.history,
        **{k: v for k, v in training.items() if k not in ("versions", "git")},
        "git": info["git"],
        "versions": info["versions"],
        "wall_time_s": time.perf_counter() - t_start,
    }


def _report(tracker: Tracker, run_dir: Path | None, result: TrainResult, summary: dict[str, Any]) -> None:
    """The tracker's summary of the run, and ``run_dir/summary.json``."""
    tracker.log_summary(
        {
            "final": result.metrics,
            "train_time_s": result.train_time_s,
            "steps": result.steps,
            "epochs": result.epochs,
            "num_training_tokens": summary["num_training_tokens"],
        }
    )
    if run_dir is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
