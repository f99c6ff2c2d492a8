"""Acceptance-rate figures and a results table from experiment runs.

    python -m experiments.plot RUN_DIR [RUN_DIR...] [--out DIR] [--formats png,svg]

Each RUN_DIR is a run directory (holding ``summary.json``) or any directory above some, e.g. a Hydra
multirun directory (``multirun/<date>/<time>``, one job per subdirectory); every ``summary.json`` below
is read. Written to ``--out`` (default: ``<first RUN_DIR>/plots``):

- ``acceptance_per_position.{png,svg}``: for each run, the fraction of draft steps whose draft at
  position i was accepted (bars).
- ``tau_speedup_vs_k.{png,svg}``: τ and speedup against ``num_speculative_tokens`` (γ) per drafter, the
  measured points beside the model of Leviathan et al. (2023): τ(γ) = (1 − α^(γ+1)) / (1 − α) and
  S(γ) = (1 − α^(γ+1)) / ((1 − α)(γc + 1)), with α fitted to the drafter's measured τ (least squares
  over its runs; the model's α is a per-token acceptance probability, so one run gives α exactly) and c
  the measured cost of one draft token relative to one plain decoding step of the target
  (draft time ÷ draft tokens × baseline tokens/s; about 0 for n-gram lookup).
- ``acceptance_per_category.{png,svg}``: acceptance rate per dataset category (Spec-Bench's 13
  categories with ``dataset=jsonl``).
- ``acceptance_vs_temperature.{png,svg}``: acceptance rate against ``sampling.temperature``; only
  when the speculative runs use more than one temperature.
- ``drafters.{png,svg}``: speedup, τ and acceptance rate of each drafter at its best draft length; only
  when the runs compare more than one drafter.
- ``results.md``: one row per run; ``aggregate.json``: the numbers behind every figure.

After a multirun, :class:`AggregateSweepCallback` (configured in ``conf/config.yaml``) does the same for
the sweep directory. The figures use matplotlib's object API (no pyplot state, no display needed).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from experiments.tables import format_cell

logger = logging.getLogger("experiments.plot")

FORMATS = ("png", "svg")
FIGURES = (
    "acceptance_per_position",
    "tau_speedup_vs_k",
    "acceptance_per_category",
    "acceptance_vs_temperature",
    "drafters",
)
#: Config keys that never distinguish runs in labels (bookkeeping, not the experiment).
_IGNORED_KEYS = ("logger.", "plots", "engine.torch_threads")
_SHORT_NAMES = {
    "drafter.num_speculative_tokens": "k",
    "sampling.temperature": "T",
    "model.name": "model",
    "drafter.model": "draft",
    "dataset.name": "dataset",
    "model.dtype": "dtype",
    "engine.dtype": "dtype",
}


# ------------------------------------------------------------------------------------------ runs
@dataclass
class Run:
    """One run: its directory and ``summary.json``."""

    path: Path
    summary: dict[str, Any]

    @property
    def config(self) -> dict[str, Any]:
        return self.summary["config"]

    @property
    def method(self) -> str:
        return str(self.summary.get("drafter") or self.config["drafter"]["method"])

    @property
    def k(self) -> int | None:
        return self.config["drafter"].get("num_speculative_tokens")

    @property
    def speculative(self) -> bool:
        return self.method != "none" and self.summary.get("tokens_per_s_spec") is not None


def _natural_key(path: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def find_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Every experiment run at or below ``paths`` (directories holding an experiment ``summary.json``),
    in natural path order (job 2 before job 10), each once.

    Raises:
        FileNotFoundError: a path does not exist.
    """
    seen: set[Path] = set()
    runs: list[Run] = []
    for p in paths:
        root = Path(p)
        if not root.exists():
            raise FileNotFoundError(f"no such run directory: {root}")
        files = [root / "summary.json"] if (root / "summary.json").is_file() else root.rglob("summary.json")
        for f in sorted(files, key=_natural_key):
            f = f.resolve()
            if f in seen:
                continue
            seen.add(f)
            summary = json.loads(f.read_text())
            if isinstance(summary, dict) and "config" in summary and "tokens_per_s_baseline" in summary:
                runs.append(Run(f.parent, summary))
    return runs


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list) else v
    return out


def varying_keys(runs: Sequence[Run]) -> list[str]:
    """Config keys whose values differ between the runs that have them (bookkeeping keys excluded; a
    key of one drafter only, such as ``drafter.prompt_lookup_max``, varies only if its runs differ)."""
    flat = [_flatten(r.config) for r in runs]
    keys = sorted({k for f in flat for k in f})
    return [
        k
        for k in keys
        if not k.startswith(_IGNORED_KEYS)
        and len({json.dumps(f[k], default=str) for f in flat if k in f}) > 1
    ]


def _short_value(key: str, value: Any) -> str:
    if key in ("model.name", "drafter.model") and isinstance(value, str):
        return Path(value).name
    return str(value)


def run_label(run: Run, varying: Sequence[str], exclude: Sequence[str] = ()) -> str:
    """``ngram k=4`` plus every other varying key (``T=0.7``, ``model=...``), minus ``exclude``."""
    parts = [run.method]
    if run.k is not None and "drafter.num_speculative_tokens" not in exclude:
        parts.append(f"k={run.k}")
    flat = _flatten(run.config)
    for key in varying:
        if key in ("drafter.method", "drafter.num_speculative_tokens") or key in exclude:
            continue
        if key not in flat:
            continue
        name = _SHORT_NAMES.get(key, key.split(".")[-1])
        parts.append(f"{name}={_short_value(key, flat[key])}")
    return " ".join(parts)


# -------------------------------------------------------------------------------- Leviathan model
def expected_tau(alpha: float, gamma: float) -> float:
    """Expected tokens per target forward with γ drafts of i.i.d. acceptance probability α:
    (1 − α^(γ+1)) / (1 − α) (γ + 1 at α = 1)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: float, c: float) -> float:
    """Leviathan et al. (2023), Theorem 3.8: S = (1 − α^(γ+1)) / ((1 − α)(γc + 1))."""
    return expected_tau(alpha, gamma) / (gamma * c + 1.0)


def fit_alpha(ks: Sequence[float], taus: Sequence[float]) -> float:
    """The α in [0, 1] minimising Σ (τ_model(α, k) − τ)² over the runs (exact for one run)."""
    pairs = [(k, t) for k, t in zip(ks, taus) if k is not None and t is not None and not math.isnan(t)]
    if not pairs:
        return float("nan")

    def loss(a: float) -> float:
        return sum((expected_tau(a, k) - t) ** 2 for k, t in pairs)

    # τ_model is increasing in α: a coarse grid, then golden-section search around its best point.
    grid = [i / 200 for i in range(201)]
    best = min(grid, key=loss)
    lo, hi = max(0.0, best - 0.005), min(1.0, best + 0.005)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        m1, m2 = hi - g * (hi - lo), lo + g * (hi - lo)
        if loss(m1) <= loss(m2):
            hi = m2
        else:
            lo = m1
    return (lo + hi) / 2


def cost_ratio(summary: dict[str, Any]) -> float | None:
    """c: seconds per draft token ÷ seconds per plain decoding step of the target (None when the
    draft time was not measured)."""
    draft_time, draft_tokens = summary.get("draft_time_s"), summary.get("num_draft_tokens")
    base = summary.get("tokens_per_s_baseline")
    if draft_time is None or not draft_tokens or not base:
        return None
    return float(draft_time) / float(draft_tokens) * float(base)


def run_alpha(summary: dict[str, Any]) -> float | None:
    """α that makes the model's τ at the run's k equal the measured τ."""
    k = summary["config"]["drafter"].get("num_speculative_tokens")
    tau = summary.get("mean_acceptance_length")
    if k is None or tau is None:
        return None
    return fit_alpha([k], [tau])


# ---------------------------------------------------------------------------------------- figures
def _figure(width: float = 8.0, height: float = 4.6, ncols: int = 1) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=150, layout="constrained")
    axes = fig.subplots(1, ncols) if ncols > 1 else fig.subplots()
    return fig, axes


def _save(fig: Any, out_dir: Path, name: str, formats: Sequence[str]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out_dir / f"{name}.{fmt}"
        fig.savefig(path, format=fmt)
        paths.append(path)
    return paths


def _skip(out_dir: Path, name: str, formats: Sequence[str], reason: str) -> str:
    """A figure whose axis does not vary is not drawn (a stale one from an earlier aggregation into
    ``out_dir`` is removed). Returns the reason, for the figure's ``"skipped"`` entry."""
    for fmt in formats:
        (out_dir / f"{name}.{fmt}").unlink(missing_ok=True)
    logger.info("%s not drawn: %s", name, reason)
    return reason


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in these runs", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _legend(ax: Any, n: int) -> None:
    """In the axes for a few entries, beside them (right) for many."""
    if not n:
        return
    if n <= 4:
        ax.legend(fontsize="small", loc="best", framealpha=0.85)
    else:
        ax.legend(
            fontsize="small",
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            ncols=1 if n <= 14 else 2,
            frameon=False,
        )


def _subtitle(runs: Sequence[Run]) -> str:
    """What the runs share: target, dtype, dataset, max_tokens (when equal across runs)."""
    if not runs:
        return ""
    models = {Path(r.config["model"]["name"]).name for r in runs}
    datasets = {r.config["dataset"]["name"] for r in runs}
    max_tokens = {r.config.get("max_tokens") for r in runs}
    prompts = {r.summary.get("num_prompts") for r in runs}
    parts = []
    if len(models) == 1:
        parts.append(f"target {models.pop()}")
    if len(datasets) == 1:
        n = prompts.pop() if len(prompts) == 1 else None
        parts.append(f"{datasets.pop()}" + (f" ({n} prompts)" if n else ""))
    if len(max_tokens) == 1:
        parts.append(f"max_tokens {max_tokens.pop()}")
    return ", ".join(parts)


def _title(ax_or_fig: Any, title: str, runs: Sequence[Run], fig_level: bool = False) -> None:
    sub = _subtitle(runs)
    text = f"{title}\n{sub}" if sub else title
    if fig_level:
        ax_or_fig.suptitle(text, fontsize="medium")
    else:
        ax_or_fig.set_title(text, fontsize="medium")


def plot_acceptance_per_position(
    runs: Sequence[Run], out_dir: Path, formats: Sequence[str] = FORMATS
) -> dict[str, Any]:
    """Bars: for each speculative run, ``accepted_per_position`` (fraction of draft steps whose draft at
    position i was accepted). Returns ``{"labels", "values": {label: [...]}, "files"}``."""
    spec = [r for r in runs if r.speculative and r.summary.get("accepted_per_position")]
    varying = varying_keys(runs)
    values = {run_label(r, varying): list(r.summary["accepted_per_position"]) for r in spec}
    fig, ax = _figure()
    if values:
        n = len(values)
        width = 0.8 / n
        for j, (label, fractions) in enumerate(values.items()):
            xs = [i + 1 + (j - (n - 1) / 2) * width for i in range(len(fractions))]
            ax.bar(xs, fractions, width=width, label=label)
        longest = max(len(v) for v in values.values())
        ax.set_xticks(range(1, longest + 1))
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("draft position (1 = first drafted token)")
        ax.set_ylabel("draft steps with this position accepted (fraction)")
        ax.grid(axis="y", alpha=0.3)
        _legend(ax, n)
    else:
        _no_data(ax, "speculative runs")
    _title(ax, "Acceptance per draft position", runs)
    files = _save(fig, out_dir, "acceptance_per_position", formats)
    return {"labels": list(values), "values": values, "files": [str(f) for f in files]}


def _group(runs: Sequence[Run], varying: Sequence[str], exclude: Sequence[str]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(run_label(r, varying, exclude), []).append(r)
    return groups


def plot_tau_speedup_vs_k(
    runs: Sequence[Run], out_dir: Path, formats: Sequence[str] = FORMATS
) -> dict[str, Any]:
    """τ and speedup against γ per drafter: measured points and Leviathan et al.'s model curves from the
    fitted α and the measured c. Returns ``{"groups": {label: {"k", "tau", "speedup", "alpha", "c",
    "model_k", "model_tau", "model_speedup"}}, "files"}``."""
    spec = [r for r in runs if r.speculative and r.k is not None]
    varying = varying_keys(runs)
    groups: dict[str, Any] = {}
    for label, members in _group(spec, varying, ["drafter.num_speculative_tokens"]).items():
        members = sorted(members, key=lambda r: r.k or 0)
        ks = [int(r.k or 0) for r in members]
        taus = [r.summary.get("mean_acceptance_length") for r in members]
        speedups = [r.summary.get("speedup") for r in members]
        alpha = fit_alpha(ks, [float("nan") if t is None else float(t) for t in taus])
        cs = [c for c in (cost_ratio(r.summary) for r in members) if c is not None]
        c = sum(cs) / len(cs) if cs else 0.0
        model_k = list(range(1, max(max(ks), 8) + 1))
        groups[label] = {
            "k": ks,
            "tau": taus,
            "speedup": speedups,
            "alpha": alpha,
            "c": c,
            "model_k": model_k,
            "model_tau": [expected_tau(alpha, k) for k in model_k] if not math.isnan(alpha) else [],
            "model_speedup": [expected_speedup(alpha, k, c) for k in model_k]
            if not math.isnan(alpha)
            else [],
        }
    fig, (ax_tau, ax_s) = _figure(11.0, 4.8 + 0.22 * ((len(groups) + 1) // 2), ncols=2)
    if groups:
        from matplotlib.lines import Line2D

        colors = [f"C{i % 10}" for i in range(len(groups))]
        handles = []
        for color, (label, g) in zip(colors, groups.items()):
            ax_tau.plot(g["k"], g["tau"], "o", color=color, ms=7)
            ax_s.plot(g["k"], g["speedup"], "o", color=color, ms=7)
            if g["model_tau"]:
                ax_tau.plot(g["model_k"], g["model_tau"], "--", color=color, alpha=0.8)
                ax_s.plot(g["model_k"], g["model_speedup"], "--", color=color, alpha=0.8)
            fit = f" (α={g['alpha']:.2f}, c={g['c']:.3f})" if g["model_tau"] else ""
            handles.append(Line2D([], [], color=color, marker="o", ls="--", label=f"{label}{fit}"))
        handles += [
            Line2D([], [], color="k", marker="o", ls="none", label="measured"),
            Line2D([], [], color="k", ls="--", label="Leviathan et al. model"),
        ]
        ax_s.axhline(1.0, color="grey", lw=0.8, ls=":")
        for ax in (ax_tau, ax_s):
            ax.set_xlabel("num_speculative_tokens γ (draft tokens per step)")
            ax.grid(alpha=0.3)
            ax.xaxis.get_major_locator().set_params(integer=True)
        fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize="small", frameon=False)
        ax_tau.set_ylabel("τ (tokens per target forward)")
        ax_s.set_ylabel("speedup over plain decoding (×)")
        ax_tau.set_title("Mean acceptance length τ", fontsize="medium")
        ax_s.set_title("Speedup; model S = (1−α^(γ+1)) / ((1−α)(γc+1))", fontsize="medium")
    else:
        _no_data(ax_tau, "speculative runs")
        _no_data(ax_s, "speculative runs")
    _title(fig, "τ and speedup against the draft length: measured vs Leviathan et al. (2023)", runs, True)
    files = _save(fig, out_dir, "tau_speedup_vs_k", formats)
    return {"groups": groups, "files": [str(f) for f in files]}


def plot_acceptance_per_category(
    runs: Sequence[Run], out_dir: Path, formats: Sequence[str] = FORMATS
) -> dict[str, Any]:
    """Grouped bars: acceptance rate per dataset category, one series per speculative run. Returns
    ``{"categories", "values": {label: {category: rate}}, "files"}``."""
    spec = [r for r in runs if r.speculative]
    varying = varying_keys(runs)
    values: dict[str, dict[str, float | None]] = {}
    categories: list[str] = []
    for r in spec:
        per_cat = r.summary.get("per_category") or {}
        values[run_label(r, varying)] = {c: m.get("acceptance_rate") for c, m in per_cat.items()}
        categories += [c for c in per_cat if c not in categories]
    fig, ax = _figure(max(8.0, 0.7 * len(categories) + 3), 4.8)
    if values and categories:
        n = len(values)
        width = 0.8 / n
        for j, (label, rates) in enumerate(values.items()):
            xs = [i + (j - (n - 1) / 2) * width for i in range(len(categories))]
            ax.bar(xs, [rates.get(c) or 0.0 for c in categories], width=width, label=label)
        ax.set_xticks(range(len(categories)))
        ax.set_xticklabels(
            categories,
            rotation=30 if len(categories) > 4 else 0,
            ha="right" if len(categories) > 4 else "center",
        )
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("dataset category")
        ax.set_ylabel("acceptance rate (accepted ÷ drafted tokens)")
        ax.grid(axis="y", alpha=0.3)
        _legend(ax, n)
    else:
        _no_data(ax, "speculative runs")
    _title(ax, "Acceptance per dataset category", runs)
    files = _save(fig, out_dir, "acceptance_per_category", formats)
    return {"categories": categories, "values": values, "files": [str(f) for f in files]}


def plot_acceptance_vs_temperature(
    runs: Sequence[Run], out_dir: Path, formats: Sequence[str] = FORMATS
) -> dict[str, Any]:
    """Acceptance rate against sampling temperature, one line per configuration; drawn only when the
    speculative runs use more than one temperature (else ``"files"`` is empty and ``"skipped"`` says
    why). Returns ``{"groups": {label: {"temperature", "acceptance_rate", "tau"}}, "files"}``."""
    spec = [r for r in runs if r.speculative]
    varying = varying_keys(runs)
    groups: dict[str, Any] = {}
    for label, members in _group(spec, varying, ["sampling.temperature", "sampling.seed"]).items():
        members = sorted(members, key=lambda r: r.config["sampling"]["temperature"])
        groups[label] = {
            "temperature": [r.config["sampling"]["temperature"] for r in members],
            "acceptance_rate": [r.summary.get("acceptance_rate") for r in members],
            "tau": [r.summary.get("mean_acceptance_length") for r in members],
        }
    if any(len(g["temperature"]) > 1 for g in groups.values()):  # draw the configurations swept over T
        groups = {label: g for label, g in groups.items() if len(g["temperature"]) > 1}
    temperatures = {r.config["sampling"]["temperature"] for r in spec}
    if len(temperatures) < 2:
        why = f"one temperature ({temperatures.pop()})" if temperatures else "no speculative runs"
        skipped = _skip(out_dir, "acceptance_vs_temperature", formats, why)
        return {"groups": groups, "files": [], "skipped": skipped}
    fig, ax = _figure()
    for label, g in groups.items():
        ax.plot(g["temperature"], g["acceptance_rate"], "o-", label=label)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("sampling temperature (0 = greedy)")
    ax.set_ylabel("acceptance rate (accepted ÷ drafted tokens)")
    ax.grid(alpha=0.3)
    _legend(ax, len(groups))
    _title(ax, "Acceptance against temperature", runs)
    files = _save(fig, out_dir, "acceptance_vs_temperature", formats)
    return {"groups": groups, "files": [str(f) for f in files]}


def _drafter_name(run: Run, varying: Sequence[str]) -> str:
    return run_label(
        run, varying, ["drafter.num_speculative_tokens", "sampling.temperature", "sampling.seed"]
    )


def plot_drafters(runs: Sequence[Run], out_dir: Path, formats: Sequence[str] = FORMATS) -> dict[str, Any]:
    """Each drafter at its best draft length (highest speedup): speedup, τ and acceptance rate side by
    side; drawn only when the runs compare more than one drafter (else ``"files"`` is empty and
    ``"skipped"`` says why). Returns ``{"drafters": {name: {"label", "k", "speedup", "tau",
    "acceptance_rate", "tokens_per_s_spec", "tokens_per_s_baseline"}}, "files"}``."""
    spec = [r for r in runs if r.speculative]
    varying = varying_keys(runs)
    best: dict[str, Run] = {}
    for r in spec:
        name = _drafter_name(r, varying)
        if name not in best or (r.summary.get("speedup") or 0) > (best[name].summary.get("speedup") or 0):
            best[name] = r
    drafters = {
        name: {
            "label": run_label(r, varying),
            "k": r.k,
            "speedup": r.summary.get("speedup"),
            "tau": r.summary.get("mean_acceptance_length"),
            "acceptance_rate": r.summary.get("acceptance_rate"),
            "tokens_per_s_spec": r.summary.get("tokens_per_s_spec"),
            "tokens_per_s_baseline": r.summary.get("tokens_per_s_baseline"),
        }
        for name, r in best.items()
    }
    if len(drafters) < 2:
        why = f"one drafter ({next(iter(drafters))})" if drafters else "no speculative runs"
        return {"drafters": drafters, "files": [], "skipped": _skip(out_dir, "drafters", formats, why)}
    fig, axes = _figure(12.0, 4.6, ncols=3)
    panels = (
        ("speedup", "speedup over plain decoding (×)", "Speedup"),
        ("tau", "τ (tokens per target forward)", "Mean acceptance length τ"),
        ("acceptance_rate", "acceptance rate (accepted ÷ drafted)", "Acceptance rate"),
    )
    names = list(drafters)
    for ax, (key, ylabel, title) in zip(axes, panels):
        vals = [drafters[n][key] or 0.0 for n in names]
        bars = ax.bar(range(len(names)), vals, color=[f"C{i % 10}" for i in range(len(names))])
        for bar, n, v in zip(bars, names, vals):
            setting = str(drafters[n]["label"]).removeprefix(n).strip() or f"k={drafters[n]['k']}"
            ax.annotate(
                f"{v:.2f}\n{setting}",
                (bar.get_x() + bar.get_width() / 2, v),
                ha="center",
                va="bottom",
                fontsize="x-small",
            )
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.replace(" ", "\n") for n in names], fontsize="small")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize="medium")
        ax.margins(y=0.2)
        ax.grid(axis="y", alpha=0.3)
        if key == "speedup":
            ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        if key == "acceptance_rate":
            ax.set_ylim(0, 1.15)
    _title(fig, "Drafters compared, each at its best draft length k", runs, True)
    files = _save(fig, out_dir, "drafters", formats)
    return {"drafters": drafters, "files": [str(f) for f in files]}


def plot_speedup_vs_concurrency(
    result: dict[str, Any], out_dir: str | Path, formats: Sequence[str] = FORMATS
) -> dict[str, Any]:
    """``experiments.concurrency``'s figure: speedup over plain decoding against concurrency (log2 axis),
    one panel per drafter, one line per policy, the oracle (the best static k in hindsight, plain
    included) dashed with its k beside each point, and 1.0 dotted.

    Args:
        result: ``experiments.concurrency``'s result (``summary.json``): its ``rows``, ``oracle`` and
            ``config``.

    Returns:
        ``{"drafters": {drafter: {"concurrency": [...], "policies": {policy: [speedup...]}, "oracle":
        [speedup...], "oracle_k": [...]}}, "files": [...]}``.
    """
    rows, cfg = result["rows"], result["config"]
    drafters: dict[str, Any] = {}
    for d in cfg["drafters"]:
        oracle = sorted((o for o in result["oracle"] if o["drafter"] == d), key=lambda o: o["concurrency"])
        cs = [o["concurrency"] for o in oracle]
        by_cell = {(r["policy"], r["concurrency"]): r for r in rows if r["drafter"] == d}
        drafters[d] = {
            "concurrency": cs,
            "policies": {
                p: [(by_cell.get((p, c)) or {}).get("speedup") for c in cs] for p in cfg["policies"]
            },
            "oracle": [o["speedup"] for o in oracle],
            "oracle_k": [o["k"] for o in oracle],
        }
    n = max(1, len(drafters))
    fig, axes = _figure(max(7.5, 4.4 * n), 5.0, ncols=n)  # room for the three-line title
    axes = [axes] if n == 1 else list(axes)
    for ax, (d, g) in zip(axes, drafters.items()):
        xs = g["concurrency"]
        for i, (p, ys) in enumerate(g["policies"].items()):
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", color=f"C{i % 10}", label=p)
        ax.plot(xs, g["oracle"], "s--", color="black", lw=1.2, ms=5, label="oracle (best static k)")
        for x, y, k in zip(xs, g["oracle"], g["oracle_k"]):
            if y is not None:
                ax.annotate(
                    f"k={k}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize="x-small",
                )
        ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="plain (1.0)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("concurrency (requests at once)")
        ax.set_ylabel("speedup over plain decoding (×)")
        ax.set_title(d, fontsize="medium")
        ax.margins(y=0.15)
        ax.grid(alpha=0.3)
        _legend(ax, len(g["policies"]) + 2 if ax is axes[0] else 0)
    if not drafters:
        _no_data(axes[0], "drafters")
    model = Path(cfg["model"]["name"]).name
    dataset = cfg["dataset"]["name"]
    fig.suptitle(
        f"Speedup against concurrency, policies at k={cfg['num_speculative_tokens']}\n"
        f"target {model} ({result.get('dtype')})\n"
        f"{dataset} ({result.get('num_prompts')} prompts), max_tokens {cfg['max_tokens']}",
        fontsize="medium",
    )
    files = _save(fig, Path(out_dir), "speedup_vs_concurrency", formats)
    return {"drafters": drafters, "files": [str(f) for f in files]}


# ------------------------------------------------------------------------------------------ table
def results_table(runs: Sequence[Run], root: Path | None = None) -> tuple[str, list[dict[str, Any]]]:
    """A markdown table with one row per run, and its rows as dicts."""
    columns = [
        ("run", "run"),
        ("model", "target"),
        ("dtype", "dtype"),
        ("drafter", "drafter"),
        ("k", "k"),
        ("dataset", "dataset"),
        ("temperature", "T"),
        ("num_prompts", "prompts"),
        ("tokens_per_s_baseline", "tok/s plain"),
        ("tokens_per_s_spec", "tok/s spec"),
        ("speedup", "speedup"),
        ("speedup_median", "median speedup"),
        ("mean_acceptance_length", "τ"),
        ("acceptance_rate", "acceptance"),
        ("alpha", "α (fit)"),
        ("c", "c"),
        ("greedy_equal", "equal"),
    ]
    rows = []
    for r in runs:
        cfg = r.config
        dtype = (cfg.get("engine") or {}).get("dtype") or cfg["model"]["dtype"]
        try:
            name = str(r.path.relative_to(root)) if root is not None else r.path.name
        except ValueError:
            name = str(r.path)
        rows.append(
            {
                "run": name if name != "." else r.path.name,
                "model": Path(cfg["model"]["name"]).name,
                "dtype": dtype,
                "drafter": r.method,
                "k": r.k,
                "dataset": cfg["dataset"]["name"],
                "temperature": cfg["sampling"]["temperature"],
                "num_prompts": r.summary.get("num_prompts"),
                "tokens_per_s_baseline": r.summary.get("tokens_per_s_baseline"),
                "tokens_per_s_spec": r.summary.get("tokens_per_s_spec"),
                "speedup": r.summary.get("speedup"),
                "speedup_median": r.summary.get("speedup_median"),
                "mean_acceptance_length": r.summary.get("mean_acceptance_length"),
                "acceptance_rate": r.summary.get("acceptance_rate"),
                "alpha": run_alpha(r.summary),
                "c": cost_ratio(r.summary),
                "greedy_equal": r.summary.get("greedy_equal"),
            }
        )
    fmt = {
        "tokens_per_s_baseline": ".1f",
        "tokens_per_s_spec": ".1f",
        "acceptance_rate": ".3f",
        "alpha": ".3f",
        "c": ".3f",
    }
    suffix = {"speedup": "×", "speedup_median": "×"}
    lines = [
        "| " + " | ".join(h for _, h in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        cells = [format_cell(row[k], fmt.get(k, ".2f"), suffix.get(k, "")) for k, _ in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", rows


# ------------------------------------------------------------------------------------ aggregation
def aggregate(
    paths: Sequence[str | Path], out_dir: str | Path | None = None, formats: Sequence[str] = FORMATS
) -> dict[str, Any]:
    """Every figure, ``results.md`` and ``aggregate.json`` of the runs under ``paths``, in ``out_dir``
    (default ``<paths[0]>/plots``).

    Returns:
        ``{"runs": [run dirs], "figures": {name: data (with "files")}, "table": markdown,
        "rows": [...], "out_dir": str}``.

    Raises:
        FileNotFoundError: a path is missing, or holds no run.
    """
    runs = find_runs(paths)
    if not runs:
        raise FileNotFoundError(f"no summary.json of an experiment run under {', '.join(map(str, paths))}")
    out = Path(out_dir) if out_dir is not None else Path(paths[0]) / "plots"
    figures = {
        "acceptance_per_position": plot_acceptance_per_position(runs, out, formats),
        "tau_speedup_vs_k": plot_tau_speedup_vs_k(runs, out, formats),
        "acceptance_per_category": plot_acceptance_per_category(runs, out, formats),
        "acceptance_vs_temperature": plot_acceptance_vs_temperature(runs, out, formats),
        "drafters": plot_drafters(runs, out, formats),
    }
    root = Path(paths[0]).resolve() if len(paths) == 1 else None
    table, rows = results_table(runs, root)
    (out / "results.md").write_text(table)
    result = {
        "runs": [str(r.path) for r in runs],
        "figures": figures,
        "table": table,
        "rows": rows,
        "out_dir": str(out),
    }
    (out / "aggregate.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def plot_run(run_dir: str | Path, formats: Sequence[str] = FORMATS) -> dict[str, list[Path]]:
    """The figures of one run in ``<run_dir>/plots``: acceptance per position and per category (only for
    a speculative run). Returns ``{name: [files]}`` (PNG first)."""
    runs = find_runs([run_dir])
    if not runs or not runs[0].speculative:
        return {}
    out = Path(run_dir) / "plots"
    return {
        "acceptance_per_position": [
            Path(f) for f in plot_acceptance_per_position(runs, out, formats)["files"]
        ],
        "acceptance_per_category": [
            Path(f) for f in plot_acceptance_per_category(runs, out, formats)["files"]
        ],
    }


# ------------------------------------------------------------------------------- hydra callback
class AggregateSweepCallback(Callback):
    """Hydra callback: after a multirun, aggregate the sweep directory (:func:`aggregate`) into
    ``<sweep dir>/plots``; with ``logger=wandb``, log the figures and the table as one more wandb run
    (job type ``aggregate``, grouped with the jobs)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            result = aggregate([sweep_dir])
        except FileNotFoundError as e:
            logger.warning("no figures for %s: %s", sweep_dir, e)
            return
        logger.info("sweep figures and table in %s", result["out_dir"])
        print(result["table"])
        logger_cfg = config.get("logger")
        if logger_cfg is None or logger_cfg.get("name") != "wandb":
            return
        from omegaconf import OmegaConf

        from experiments.config import WandbLoggerConfig
        from experiments.tracking import make_tracker

        schema = OmegaConf.structured(WandbLoggerConfig)
        wandb_cfg = OmegaConf.to_object(OmegaConf.merge(schema, logger_cfg))
        assert isinstance(wandb_cfg, WandbLoggerConfig)
        tracker = make_tracker(
            wandb_cfg,
            sweep_dir,
            {"sweep_dir": str(sweep_dir), "runs": result["runs"]},
            job_type="aggregate",
            name="aggregate",
            group=str(sweep_dir),
        )
        try:
            images = {f"plots/{n}": d["files"][0] for n, d in result["figures"].items() if d["files"]}
            tracker.log_images(images)
            rows = result["rows"]
            if rows:
                columns = list(rows[0])
                tracker.log_table("results", columns, [[row[c] for c in columns] for row in rows])
        finally:
            tracker.finish()


# ---------------------------------------------------------------------------------------------- cli
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.plot",
        description="Acceptance-rate figures and a markdown table from run or multirun directories.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run or multirun directories")
    parser.add_argument("--out", default=None, help="output directory (default: <first RUN_DIR>/plots)")
    parser.add_argument("--formats", default="png,svg", help="comma-separated image formats")
    args = parser.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    result = aggregate(args.run_dirs, args.out, formats)
    print(result["table"])
    print(f"{len(result['runs'])} runs; figures, results.md and aggregate.json in {result['out_dir']}")
    return result


if __name__ == "__main__":
    main()
