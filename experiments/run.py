"""Main job: decode a prompt set without and with speculation in one process and report the speedup.

    python -m experiments.run                                   # smollm2 target, n-gram drafter, builtin
    python -m experiments.run drafter.num_speculative_tokens=6 max_tokens=256
    python -m experiments.run model=qwen2.5-coder-1.5b-instruct drafter=draft_model
    python -m experiments.run dataset=jsonl dataset.limit=26    # Spec-Bench, per-category table
    python -m experiments.run dataset=humaneval drafter=none     # baseline only
    python -m experiments.run experiment=qwen_coder_pair logger=wandb
    python -m experiments.run -m drafter.num_speculative_tokens=1,2,4,8        # a local sweep
    python -m experiments.run -m sweep=drafters_k hydra/launcher=ray +hydra.launcher.ray.init.num_cpus=8

Prompts run one at a time (batch 1, the usual latency setting of speculative decoding), each timed;
tokens/s of a pass is its generated tokens over the summed per-prompt times. The speculative pass runs
first (so a bad drafter fails before the baseline's minutes), then its model is freed and the baseline
loads. Both passes are warmed up on a short prompt first.

Metrics (from counts summed over prompts; ``engine.spec_stats`` when the engine has it, else the
per-request metrics):

- ``acceptance_rate`` = accepted draft tokens / proposed draft tokens.
- ``mean_acceptance_length`` (τ) = 1 + accepted draft tokens / draft steps: the tokens one verification
  step of the target emits (accepted drafts plus the target's own token).
- ``accepted_per_position[i]`` = the fraction of draft steps in which the draft token at position i
  (0-based) was accepted; non-increasing in i, as acceptance stops at the first rejection.
- ``speedup`` = tokens/s with speculation / tokens/s without. ``speedup_median`` = the median over
  prompts of each prompt's own speedup: robust to a one-off stall (another process on a shared CPU).
- ``greedy_equal``: every speculative output equals the baseline output token for token (greedy only;
  null when sampling, where outputs legitimately differ). In bfloat16 a verification forward over
  K+1 tokens rounds differently from a one-token decode step, so near-ties can flip the argmax and
  outputs drift apart after a few dozen tokens; ``model.dtype=float32`` makes it an exact check.

Outputs in the Hydra run dir: ``summary.json`` (metrics, per-category metrics, resolved config, git
commit, package versions, seeds), ``results.jsonl`` (one line per prompt), ``config.yaml`` (the resolved
config), ``run_info.json`` (provenance: git, versions, seeds, device, command line, Hydra overrides) and
``plots/`` (per-position and per-category acceptance, PNG and SVG). After a multirun, the sweep directory
gets the aggregated figures and table (``plots/``, see :mod:`experiments.plot`). With ``logger=wandb``
each job logs one wandb run (offline by default) and finishes it.
"""

from __future__ import annotations

import gc
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import hydra
from omegaconf import DictConfig

from experiments.config import (
    DatasetConfig,
    EngineConfig,
    ExperimentConfig,
    GrammarConfig,
    ModelConfig,
    NoGrammarConfig,
    SamplingConfig,
    config_to_dict,
    register_configs,
    sampling_params_kwargs,
    to_experiment_config,
)
from experiments.datasets import Prompt, load_prompts
from experiments.tables import format_cell
from experiments.tracking import (
    NullTracker,
    Tracker,
    pick_device,
    run_info,
    run_tracked,
    write_run_files,
)

logger = logging.getLogger("experiments.run")

#: Builds an ``LLM`` (or anything with its ``generate``) for a ``speculative_config`` (None: plain).
LLMFactory = Callable[[dict[str, Any] | None], Any]

_COUNT_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_steps")
_TIME_KEYS = ("draft_time_s", "verify_time_s")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WARMUP_MAX_TOKENS = 8


# ---------------------------------------------------------------------------------- model helpers
def has_tokenizer(model: str) -> bool:
    """False only for a local model directory without tokenizer files (zoo models always have one)."""
    d = Path(model).expanduser()
    if not d.is_dir():
        return True
    return any((d / f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(model: str) -> Any:
    """The HF tokenizer of a zoo name or local directory (None when the directory has none)."""
    if not has_tokenizer(model):
        return None
    from transformers import AutoTokenizer

    from specdec.zoo import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model)))


class LLMSettings(Protocol):
    """What :func:`default_llm_factory` reads of a config (:class:`ExperimentConfig`,
    :class:`~experiments.config.ConcurrencyConfig`...)."""

    model: ModelConfig
    engine: EngineConfig
    seed: int


def default_llm_factory(cfg: LLMSettings, device: str | None = None) -> LLMFactory:
    """Build ``specdec.LLM`` for the configured target, engine options and seed, on ``device``
    (default: :func:`experiments.tracking.pick_device` of ``engine.device``)."""
    device = device or pick_device(cfg.engine.device)

    def make(speculative_config: dict[str, Any] | None) -> Any:
        from specdec import LLM

        return LLM(
            cfg.model.name,
            device=device,
            seed=cfg.seed,
            speculative_config=speculative_config,
            skip_tokenizer_init=not has_tokenizer(cfg.model.name),
            **cfg.engine.llm_kwargs(cfg.model),
        )

    return make


def prompt_token_ids(tokenizer: Any, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Token ids of every prompt under the tokenizer's chat template (plain encoding without one);
    prompts that carry their own ``token_ids`` keep them."""
    from specdec.llm import chat_token_ids

    if all(p.token_ids is not None for p in prompts):
        return [list(p.token_ids or []) for p in prompts]
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("the tokenizer has no chat template: prompts are encoded as plain text")
    out = []
    for p in prompts:
        if p.token_ids is not None:
            out.append(list(p.token_ids))
        elif getattr(tokenizer, "chat_template", None):
            out.append(chat_token_ids(tokenizer, p.messages))
        else:
            out.append(list(tokenizer.encode(p.text)))
    return out


# ------------------------------------------------------------------------------------ spec stats
def _engine_stats(llm: Any) -> dict[str, Any] | None:
    """A snapshot of ``llm.engine.spec_stats`` (None when the engine has none)."""
    stats = getattr(getattr(llm, "engine", None), "spec_stats", None)
    if stats is None:
        return None
    snap: dict[str, Any] = {k: int(getattr(stats, k, 0) or 0) for k in _COUNT_KEYS}
    snap.update({k: float(getattr(stats, k, 0.0) or 0.0) for k in _TIME_KEYS})
    snap["accepted_per_position"] = [int(x) for x in (getattr(stats, "accepted_per_position", None) or [])]
    return snap


def _reset_engine_stats(llm: Any) -> None:
    reset = getattr(getattr(llm, "engine", None), "reset_spec_stats", None)
    if callable(reset):
        reset()


def _sub_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) - (b[i] if i < len(b) else 0) for i in range(n)]


def _spec_counts(
    before: dict[str, Any] | None, after: dict[str, Any] | None, metrics: dict[str, Any]
) -> dict[str, Any] | None:
    """Draft counts of one generate call: the change in ``spec_stats`` or, without it, the request's
    own metrics. None when neither has any (no speculation)."""
    if after is not None:
        base = before or {}
        out: dict[str, Any] = {k: after[k] - base.get(k, 0) for k in (*_COUNT_KEYS, *_TIME_KEYS)}
        out["accepted_per_position"] = _sub_lists(
            after["accepted_per_position"], base.get("accepted_per_position", [])
        )
        return out
    if not any(k in metrics for k in _COUNT_KEYS):
        return None
    out = {k: int(metrics.get(k) or 0) for k in _COUNT_KEYS}
    out.update(dict.fromkeys(_TIME_KEYS))
    out["accepted_per_position"] = [int(x) for x in (metrics.get("accepted_per_position") or [])]
    return out


# -------------------------------------------------------------------------------------- running
def run_pass(
    llm: Any,
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    max_tokens: int,
    warmup_ids: Sequence[int] | None = None,
    labels: Sequence[str] | None = None,
    pass_name: str = "",
    grammar: GrammarConfig | None = None,
) -> list[dict[str, Any]]:
    """Warm ``llm`` up, then generate for each prompt alone (batch 1), timing each call.

    Returns one dict per prompt: ``token_ids``, ``text``, ``finish_reason``, ``num_tokens``,
    ``time_s``, ``spec`` (draft counts of that prompt, or None without speculation).
    """
    from specdec import SamplingParams

    if warmup_ids is not None and len(warmup_ids) > 0:
        llm.generate(
            [{"prompt_token_ids": list(warmup_ids)}],
            SamplingParams(temperature=0.0, max_tokens=WARMUP_MAX_TOKENS),
        )
    records: list[dict[str, Any]] = []
    for i, ids in enumerate(prompt_ids):
        seed = None if sampling.seed is None else sampling.seed + i
        params = SamplingParams(
            **sampling_params_kwargs(sampling, grammar or NoGrammarConfig()), max_tokens=max_tokens, seed=seed
        )
        _reset_engine_stats(llm)
        before = _engine_stats(llm)
        t0 = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": list(ids)}], params)
        elapsed = time.perf_counter() - t0
        completion = out.outputs[0]
        spec = _spec_counts(before, _engine_stats(llm), dict(getattr(out, "metrics", None) or {}))
        rec = {
            "token_ids": [int(t) for t in completion.token_ids],
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "num_tokens": len(completion.token_ids),
            "time_s": elapsed,
            "spec": spec,
        }
        records.append(rec)
        label = labels[i] if labels is not None else str(i)
        tau = _tau(spec)
        logger.info(
            "%s %d/%d %s: %d tokens in %.2f s (%.1f tok/s)%s",
            pass_name,
            i + 1,
            len(prompt_ids),
            label,
            rec["num_tokens"],
            elapsed,
            rec["num_tokens"] / max(elapsed, 1e-9),
            "" if tau is None else f", tau {tau:.2f}",
        )
    return records


def _free(llm: Any) -> None:
    del llm
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass


def _tau(spec: dict[str, Any] | None) -> float | None:
    if not spec or not spec["num_drafts"]:
        return None
    return 1.0 + spec["num_accepted_tokens"] / spec["num_drafts"]


def aggregate(records: Sequence[dict[str, Any]], greedy: bool, speculative: bool) -> dict[str, Any]:
    """Throughput, speedup and acceptance metrics of a group of per-prompt records (see the module
    docstring for the definitions); speculative fields are None when ``speculative`` is False."""
    base_tokens = sum(r["baseline"]["num_tokens"] for r in records)
    base_time = sum(r["baseline"]["time_s"] for r in records)
    out: dict[str, Any] = {
        "num_prompts": len(records),
        "tokens_baseline": base_tokens,
        "time_s_baseline": base_time,
        "tokens_per_s_baseline": base_tokens / base_time if base_time > 0 else None,
        "tokens_spec": None,
        "time_s_spec": None,
        "tokens_per_s_spec": None,
        "speedup": None,
        "speedup_median": None,
        "mean_acceptance_length": None,
        "acceptance_rate": None,
        "accepted_per_position": None,
        "num_drafts": None,
        "num_draft_tokens": None,
        "num_accepted_tokens": None,
        "accepted_per_position_counts": None,
        "draft_time_s": None,
        "verify_time_s": None,
        "greedy_equal": None,
        "num_greedy_mismatches": None,
    }
    if not speculative:
        return out
    spec_tokens = sum(r["spec"]["num_tokens"] for r in records)
    spec_time = sum(r["spec"]["time_s"] for r in records)
    out.update(tokens_spec=spec_tokens, time_s_spec=spec_time)
    if spec_time > 0:
        out["tokens_per_s_spec"] = spec_tokens / spec_time
    if out["tokens_per_s_spec"] is not None and out["tokens_per_s_baseline"]:
        out["speedup"] = out["tokens_per_s_spec"] / out["tokens_per_s_baseline"]
    ratios = [
        (r["spec"]["num_tokens"] / r["spec"]["time_s"])
        / (r["baseline"]["num_tokens"] / r["baseline"]["time_s"])
        for r in records
        if r["spec"]["time_s"] > 0 and r["baseline"]["time_s"] > 0 and r["baseline"]["num_tokens"] > 0
    ]
    if ratios:
        out["speedup_median"] = statistics.median(ratios)
    counts = [r["spec"]["counts"] for r in records if r["spec"]["counts"] is not None]
    if counts:
        drafts = sum(c["num_drafts"] for c in counts)
        draft_tokens = sum(c["num_draft_tokens"] for c in counts)
        accepted = sum(c["num_accepted_tokens"] for c in counts)
        steps = sum(c.get("num_steps") or 0 for c in counts)
        per_pos = [0] * max((len(c["accepted_per_position"]) for c in counts), default=0)
        for c in counts:
            for i, n in enumerate(c["accepted_per_position"]):
                per_pos[i] += n
        out.update(
            num_drafts=drafts,
            num_draft_tokens=draft_tokens,
            num_accepted_tokens=accepted,
            accepted_per_position_counts=per_pos,
            acceptance_rate=accepted / draft_tokens if draft_tokens else None,
            mean_acceptance_length=1.0 + accepted / drafts if drafts else None,
            # tokens per target forward over every sampling step (SpecStats.tokens_per_step)
            num_steps=steps,
            tokens_per_step=1.0 + accepted / steps if steps else None,
            accepted_per_position=[n / drafts for n in per_pos] if drafts else None,
        )
        for key in _TIME_KEYS:
            times = [c[key] for c in counts]
            out[key] = None if any(t is None for t in times) else sum(times)
    if greedy:
        mismatches = sum(1 for r in records if not r["equal"])
        out.update(greedy_equal=mismatches == 0, num_greedy_mismatches=mismatches)
    return out


def run_prompts(
    llm_factory: LLMFactory,
    prompt_ids: Sequence[Sequence[int]],
    *,
    speculative_config: dict[str, Any] | None,
    sampling: SamplingConfig,
    max_tokens: int,
    ids: Sequence[str] | None = None,
    categories: Sequence[str] | None = None,
    warmup_ids: Sequence[int] | None = None,
    grammar: GrammarConfig | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run every prompt with speculation (when ``speculative_config`` is set) and without, one LLM at a
    time, and compare.

    Args:
        llm_factory: builds the LLM for a speculative config (None: plain decoding).
        prompt_ids: the prompts' token ids.
        ids, categories: per-prompt labels (default: their index, and one category "all").
        warmup_ids: a short prompt run once per LLM before timing (default: the first prompt's first
            eight tokens).
        grammar: constrains every prompt's output (default: unconstrained).

    Returns:
        ``(metrics, records)``: :func:`aggregate` of all prompts plus ``per_category``, and one record per
        prompt (``id``, ``category``, ``num_prompt_tokens``, ``baseline``, ``spec``, ``equal``).
    """
    if not prompt_ids:
        raise ValueError("no prompts to run")
    n = len(prompt_ids)
    ids = list(ids) if ids is not None else [str(i) for i in range(n)]
    categories = list(categories) if categories is not None else ["all"] * n
    if len(ids) != n or len(categories) != n:
        raise ValueError(f"got {len(ids)} ids and {len(categories)} categories for {n} prompts")
    if warmup_ids is None:
        warmup_ids = list(prompt_ids[0][:8])
    greedy = sampling.temperature < 1e-5  # as the engine: below this, argmax
    spec_records: list[dict[str, Any]] | None = None
    if speculative_config is not None:
        method = speculative_config.get("method", "spec")
        logger.info("speculative pass (%s): loading the model", method)
        llm = llm_factory(speculative_config)
        spec_records = run_pass(
            llm, prompt_ids, sampling, max_tokens, warmup_ids, ids, f"spec[{method}]", grammar
        )
        _free(llm)
    logger.info("baseline pass: loading the model")
    llm = llm_factory(None)
    base_records = run_pass(llm, prompt_ids, sampling, max_tokens, warmup_ids, ids, "baseline", grammar)
    _free(llm)

    records: list[dict[str, Any]] = []
    for i in range(n):
        base = base_records[i]
        rec: dict[str, Any] = {
            "id": ids[i],
            "category": categories[i],
            "num_prompt_tokens": len(prompt_ids[i]),
            "baseline": {k: base[k] for k in ("num_tokens", "time_s", "finish_reason", "text", "token_ids")},
            "spec": None,
            "equal": None,
        }
        if spec_records is not None:
            s = spec_records[i]
            rec["spec"] = {k: s[k] for k in ("num_tokens", "time_s", "finish_reason", "text", "token_ids")}
            rec["spec"]["counts"] = s["spec"]
            rec["spec"]["mean_acceptance_length"] = _tau(s["spec"])
            rec["equal"] = s["token_ids"] == base["token_ids"]
        records.append(rec)

    speculative = spec_records is not None
    metrics = aggregate(records, greedy, speculative)
    per_category: dict[str, dict[str, Any]] = {}
    for cat in dict.fromkeys(categories):
        per_category[cat] = aggregate([r for r in records if r["category"] == cat], greedy, speculative)
    metrics["per_category"] = per_category
    return metrics, records


# ------------------------------------------------------------------------------------ experiment
#: Summary keys that describe the run rather than measure it (kept out of the tracker's metrics).
_NON_METRIC_KEYS = ("config", "git", "versions", "seeds", "environment", "drafter", "model", "dataset")


def load_token_ids(
    model: str, dataset: DatasetConfig, prompt_ids: Sequence[Sequence[int]] | None = None
) -> tuple[list[list[int]], list[str], list[str], list[int] | None]:
    """``(token_ids, ids, categories, warmup_ids)`` of a dataset's prompts under ``model``'s chat
    template (or of ``prompt_ids``, when given: ids are their indices, the category "given").

    Raises:
        FileNotFoundError, ValueError: a missing or malformed dataset, or text prompts and a model
            without a tokenizer.
    """
    if prompt_ids is not None:
        token_ids = [list(p) for p in prompt_ids]
        ids = [str(i) for i in range(len(token_ids))]
        return token_ids, ids, ["given"] * len(token_ids), (token_ids[0][:8] if token_ids else None)
    prompts = load_prompts(dataset)
    if not prompts:
        raise ValueError(f"dataset {dataset.name!r} gave no prompts")
    ids = [p.id for p in prompts]
    categories = [p.category for p in prompts]
    if all(p.token_ids is not None for p in prompts):
        token_ids = [list(p.token_ids or []) for p in prompts]
        return token_ids, ids, categories, token_ids[0][:8]
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(
            f"model {model!r} has no tokenizer, so dataset={dataset.name} prompts cannot be "
            "tokenized; use dataset=synthetic (token ids) or pass prompt_ids to run_experiment"
        )
    token_ids = prompt_token_ids(tokenizer, prompts)
    warmup = prompt_token_ids(tokenizer, [Prompt("warmup", "warmup", [{"role": "user", "content": "Hi!"}])])[
        0
    ]
    return token_ids, ids, categories, warmup


def _step_metrics(rec: dict[str, Any]) -> dict[str, Any]:
    """Per-prompt ("step") metrics of one record, for the tracker."""
    base = rec["baseline"]
    out: dict[str, Any] = {
        "prompt/num_prompt_tokens": rec["num_prompt_tokens"],
        "baseline/num_tokens": base["num_tokens"],
        "baseline/tokens_per_s": base["num_tokens"] / base["time_s"] if base["time_s"] > 0 else None,
    }
    spec = rec["spec"]
    if spec is not None:
        counts = spec["counts"] or {}
        out.update(
            {
                "spec/num_tokens": spec["num_tokens"],
                "spec/tokens_per_s": spec["num_tokens"] / spec["time_s"] if spec["time_s"] > 0 else None,
                "spec/mean_acceptance_length": spec["mean_acceptance_length"],
                "spec/acceptance_rate": (
                    counts["num_accepted_tokens"] / counts["num_draft_tokens"]
                    if counts.get("num_draft_tokens")
                    else None
                ),
                "spec/equal": rec["equal"],
            }
        )
        if out["spec/tokens_per_s"] and out["baseline/tokens_per_s"]:
            out["spec/speedup"] = out["spec/tokens_per_s"] / out["baseline/tokens_per_s"]
    return {k: v for k, v in out.items() if v is not None}


def run_experiment(
    cfg: ExperimentConfig,
    out_dir: str | Path | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    llm_factory: LLMFactory | None = None,
    tracker: Tracker | None = None,
) -> dict[str, Any]:
    """Run the experiment ``cfg`` and return its summary (also written to ``out_dir``, when given:
    ``summary.json``, ``results.jsonl``, ``config.yaml``, ``run_info.json`` and, with ``cfg.plots``,
    ``plots/``).

    Args:
        cfg: a validated config (:func:`experiments.config.to_experiment_config`).
        out_dir: where to write the results (None: nowhere).
        prompt_ids: token ids to run instead of the configured dataset (e.g. for a model without a
            tokenizer); their ids are their indices and their category is "given".
        llm_factory: how to build an LLM (default: :func:`default_llm_factory`).
        tracker: where metrics and figures are logged besides the files (default: nowhere). The
            caller finishes it.

    Raises:
        FileNotFoundError, ValueError: from the dataset or the config, before any model loads.
        NotImplementedError: the engine cannot speculate with this drafter.
    """
    import torch

    tracker = tracker or NullTracker()
    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    if cfg.engine.torch_threads is not None:
        torch.set_num_threads(cfg.engine.torch_threads)
    try:
        torch.manual_seed(cfg.seed)
        device = pick_device(cfg.engine.device)
        seeds = {
            "engine": cfg.seed,
            "torch": cfg.seed,
            "sampling": cfg.sampling.seed,
            "dataset": getattr(cfg.dataset, "seed", None),
        }
        config = config_to_dict(cfg)
        info = run_info(seeds, device)
        if out_dir is not None:
            write_run_files(out_dir, config, info)
        token_ids, ids, categories, warmup = load_token_ids(cfg.model.name, cfg.dataset, prompt_ids)
        logger.info(
            "%d prompts, %d prompt tokens in all, on %s",
            len(token_ids),
            sum(len(t) for t in token_ids),
            device,
        )
        metrics, records = run_prompts(
            llm_factory or default_llm_factory(cfg, device),
            token_ids,
            speculative_config=cfg.drafter.speculative_config(),
            sampling=cfg.sampling,
            max_tokens=cfg.max_tokens,
            ids=ids,
            categories=categories,
            warmup_ids=warmup,
            grammar=cfg.grammar,
        )
        summary: dict[str, Any] = {
            **metrics,
            "drafter": cfg.drafter.method,
            "model": cfg.model.name,
            "dataset": cfg.dataset.name,
            "config": config,
            "seeds": seeds,
            "git": info["git"],
            "versions": info["versions"],
            "environment": info["environment"],
            "wall_time_s": time.perf_counter() - t_start,
        }
    finally:
        torch.set_num_threads(threads_before)
    for i, rec in enumerate(records):
        tracker.log(_step_metrics(rec), step=i)
    tracker.log_summary({k: v for k, v in summary.items() if k not in _NON_METRIC_KEYS})
    if out_dir is not None:
        out = Path(out_dir)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        with (out / "results.jsonl").open("w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
        if cfg.plots:
            from experiments.plot import plot_run

            figures = plot_run(out)
            if getattr(cfg.logger, "log_plots", True):
                tracker.log_images({f"plots/{name}": paths[0] for name, paths in figures.items()})
    return summary


# ------------------------------------------------------------------------------------- reporting
def format_summary(summary: dict[str, Any]) -> str:
    """The summary as text tables: the overall comparison, then one row per category (when several)."""
    cfg = summary["config"]
    drafter = summary["drafter"]
    k = cfg["drafter"].get("num_speculative_tokens")
    sampling = cfg["sampling"]
    head = (
        f"target {cfg['model']['name']} ({cfg['model']['dtype']}), drafter {drafter}"
        + (f" (K={k})" if k is not None else "")
        + f", dataset {cfg['dataset']['name']} ({summary['num_prompts']} prompts), "
        + ("greedy" if sampling["temperature"] == 0 else f"temperature {sampling['temperature']}")
        + f", max_tokens {cfg['max_tokens']}"
    )
    spec_col = drafter if drafter != "none" else "speculative"
    per_pos = summary["accepted_per_position"]
    rows = [
        ("tokens generated", format_cell(summary["tokens_baseline"]), format_cell(summary["tokens_spec"])),
        ("time (s)", format_cell(summary["time_s_baseline"]), format_cell(summary["time_s_spec"])),
        (
            "tokens/s",
            format_cell(summary["tokens_per_s_baseline"]),
            format_cell(summary["tokens_per_s_spec"]),
        ),
        ("speedup", "", format_cell(summary["speedup"], suffix="x")),
        ("speedup (median over prompts)", "", format_cell(summary["speedup_median"], suffix="x")),
        ("tau (mean acceptance length)", "", format_cell(summary["mean_acceptance_length"])),
        ("acceptance rate", "", format_cell(summary["acceptance_rate"], ".3f")),
        (
            "accepted per position",
            "",
            "-" if per_pos is None else " ".join(f"{x:.2f}" for x in per_pos),
        ),
        (
            "greedy_equal",
            "",
            format_cell(summary["greedy_equal"])
            + (
                f" ({summary['num_greedy_mismatches']}/{summary['num_prompts']} outputs differ)"
                if summary["greedy_equal"] is False
                else ""
            ),
        ),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len("baseline"), *(len(r[1]) for r in rows))
    lines = [head, f"{'':{w0}}  {'baseline':>{w1}}  {spec_col}"]
    lines += [f"{a:{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
    if summary["greedy_equal"] is False and cfg["model"]["dtype"] == "bfloat16":
        lines.append(
            "note: bfloat16 verification forwards round differently from one-token decode steps, so "
            "greedy outputs may drift apart; rerun with model.dtype=float32 for an exact check"
        )
    per_cat = summary.get("per_category") or {}
    if len(per_cat) > 1:
        cols = ("category", "n", "tok/s base", "tok/s spec", "speedup", "tau", "acc.rate", "equal")
        table = [
            (
                cat,
                str(m["num_prompts"]),
                format_cell(m["tokens_per_s_baseline"], ".1f"),
                format_cell(m["tokens_per_s_spec"], ".1f"),
                format_cell(m["speedup"], suffix="x"),
                format_cell(m["mean_acceptance_length"]),
                format_cell(m["acceptance_rate"], ".3f"),
                format_cell(m["greedy_equal"]),
            )
            for cat, m in per_cat.items()
        ]
        widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(cols)]
        lines += ["", "per category:"]
        lines.append(
            "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(cols))
        )
        for r in table:
            lines.append(
                "  ".join(v.ljust(widths[0]) if i == 0 else v.rjust(widths[i]) for i, v in enumerate(r))
            )
    return "\n".join(lines)


register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(dcfg: DictConfig) -> dict[str, Any]:
    """Hydra entry point: compose, convert to typed config (every check runs here, before any model
    loads), run, print and save the summary; with ``logger=wandb`` log the job as one wandb run and
    finish it."""
    from hydra.core.hydra_config import HydraConfig

    cfg = to_experiment_config(dcfg)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    summary = run_tracked(cfg, out_dir, lambda tracker: run_experiment(cfg, out_dir=out_dir, tracker=tracker))
    print(format_summary(summary))
    print(f"wall time {summary['wall_time_s']:.1f} s; results in {out_dir}")
    return {k: v for k, v in summary.items() if k not in ("git", "versions", "environment")}


if __name__ == "__main__":
    main()
