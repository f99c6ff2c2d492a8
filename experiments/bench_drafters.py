"""Drafter comparison at batch 1: τ, acceptance per position and speed of every drafter on the same prompts.

Methods (greedy, SmolLM2-135M-Instruct by default, one request at a time):

- ``plain``: no speculation (our baseline), and transformers' greedy ``generate`` on the same prompts
  in the same process (the peer);
- ``ngram``: prompt lookup, k = 4;
- ``medusa`` / ``medusa-tree``: our Medusa heads, a chain of 4 / the default static tree;
- ``eagle`` / ``eagle-tree``: our EAGLE head, a chain of 4 / EAGLE-2's dynamic tree;
- ``eagle3`` / ``eagle3-tree``: our EAGLE-3 head, the same chain / tree;
- ``hybrid-eagle`` / ``hybrid-eagle3-int8``: the hybrid drafter over the EAGLE head (reduced
  vocabulary) / the int8 EAGLE-3 head, suffix decoding and prompt lookup;
- any other registered drafter, by its name: a chain of 4 (:func:`method_spec`);
- your own rows (``extra_methods``: a name -> its ``speculative_config``), e.g. a head you trained, beside
  the shipped one in the same run.

Per method: tokens/s, speedup over our plain decoding and over transformers, τ (tokens emitted per
draft step: 1 + accepted ÷ draft steps), tokens per target forward over every step (drafting or not:
prompt lookup drafts only where it finds a match, so its τ leaves out the steps it sat out; compare
drafters that draft at different rates by this figure), acceptance per position (the fraction of draft
steps whose draft at depth i was accepted), and, with ``prompts=specbench``, both per Spec-Bench
category. Every speculative method's
output is checked against plain greedy decoding (exactness; a mismatch is reported, not hidden). Each
row is also paired prompt by prompt with the ``compare_to`` row (``plain``; ``compare_to=ngram`` asks
whether a drafter beats prompt lookup): per category the geometric mean of the per-prompt speed ratios
and its 95 % interval (:func:`paired_speedups`), so that a category's difference can be told from the
run's noise.

Generation stops at the target's EOS (or ``max_tokens``), as in Spec-Bench and the EAGLE papers:
past EOS a model writes text no drafter was trained on, so ``ignore_eos=true`` (every request makes
``max_tokens`` tokens, for equal work per method) lowers the τ of the learned drafters.

    python -m experiments.bench_drafters prompts=heldout limit=24 max_tokens=96
    python -m experiments.bench_drafters prompts=specbench per_category=3 max_tokens=96
    python -m experiments.bench_drafters prompts=specbench per_category=8 'methods=[plain,ngram,suffix]' \
        compare_to=ngram
    python -m experiments.bench_drafters prompts=fresh limit=16 'methods=[plain,eagle,eagle3]'
    python -m experiments.bench_drafters 'methods=[plain,ngram,eagle]' out=drafters.json plot=drafters.png
    python -m experiments.bench_drafters 'methods=[plain,eagle3,mine]' \
        '+extra_methods.mine={method: eagle3, num_speculative_tokens: 4, model: /path/to/heads}'
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from experiments.harness import (
    ForwardCounter,
    HarnessConfig,
    Timed,
    available_bytes,
    benchmark,
    check_speculative_configs,
    hf_batch1,
    hf_generate,
    interleaved_bytes,
    measure_batch1,
    measure_batch1_interleaved,
    require_choice,
    require_extra_methods,
    require_positive,
    require_subset,
)
from specdec.errors import ConfigError

METHODS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "medusa": {"method": "medusa", "num_speculative_tokens": 4},
    "medusa-tree": {"method": "medusa", "num_speculative_tokens": 4, "tree": "static"},
    "eagle": {"method": "eagle", "num_speculative_tokens": 4},
    "eagle-tree": {"method": "eagle", "num_speculative_tokens": 5, "tree": "dynamic", "tree_topk": 4},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 4},
    "eagle3-tree": {"method": "eagle3", "num_speculative_tokens": 5, "tree": "dynamic", "tree_topk": 4},
    # Medusa and the EAGLE-2 head drafting over the target's EAGLE-3 head's draft vocabulary ({model}: the
    # target).
    "medusa-v8k": {"method": "medusa", "num_speculative_tokens": 4, "draft_vocab": "{model}-eagle3"},
    "eagle-v8k": {"method": "eagle", "num_speculative_tokens": 4, "draft_vocab": "{model}-eagle3"},
    "eagle-v8k-tree": {
        "method": "eagle",
        "num_speculative_tokens": 5,
        "tree": "dynamic",
        "tree_topk": 4,
        "draft_vocab": "{model}-eagle3",
    },
    # The hybrid with a learned member: per request and step, the EAGLE head (over the reduced vocabulary),
    # suffix decoding or prompt lookup, whichever is expected to have the most drafts accepted (issue 22).
    "hybrid-eagle": {
        "method": "hybrid",
        "num_speculative_tokens": 4,
        "hybrid_members": ["eagle", "suffix", "ngram"],
        "draft_vocab": "{model}-eagle3",
    },
    # The same with the EAGLE-3 head (int8), the fastest learned drafter here.
    "hybrid-eagle3-int8": {
        "method": "hybrid",
        "num_speculative_tokens": 4,
        "hybrid_members": ["eagle3", "suffix", "ngram"],
        "quantization": "int8",
    },
    # The heads' weights and the LM-head rows they draft through quantized to int8 per channel (half the
    # bytes a draft token reads).
    "eagle-v8k-int8": {
        "method": "eagle",
        "num_speculative_tokens": 4,
        "draft_vocab": "{model}-eagle3",
        "quantization": "int8",
    },
    "eagle3-int8": {"method": "eagle3", "num_speculative_tokens": 4, "quantization": "int8"},
    "medusa-v8k-int8": {
        "method": "medusa",
        "num_speculative_tokens": 4,
        "draft_vocab": "{model}-eagle3",
        "quantization": "int8",
    },
    # The target's own weights quantized to int8 per channel as its drafter.
    "quantized-int8": {"method": "quantized_self", "num_speculative_tokens": 4, "quantization": "int8"},
    # ... drafting over the EAGLE-3 head's 8k-token vocabulary (its LM head reads 1/6 of the rows).
    "quantized-int8-v8k": {
        "method": "quantized_self",
        "num_speculative_tokens": 4,
        "quantization": "int8",
        "draft_vocab": "{model}-eagle3",
    },
}
logger = logging.getLogger("experiments.bench_drafters")
DEFAULT_SPECBENCH = "../shared/specbench/question.jsonl"
#: Each engine's KV pool when the rows are interleaved (all alive at once; batch 1 needs little).
INTERLEAVED_KV_BYTES = 256 * 1024**2


def method_names() -> list[str]:
    """Every ``methods`` name: the rows of :data:`METHODS`, then the other registered drafters."""
    from specdec.drafters.registry import drafter_names

    return list(dict.fromkeys([*METHODS, *drafter_names()]))


@dataclass
class BenchDraftersConfig(HarnessConfig):
    """Attributes:
    model: the target (zoo name or HF-format directory).
    prompts: ``heldout`` (built-in prompts never trained on), ``specbench``, or ``fresh`` (everyday chat
        requests written by hand, never trained on: :func:`experiments.instruct.load_fresh_chat`).
    specbench_path: Spec-Bench's question.jsonl.
    limit: held-out prompts.
    per_category: Spec-Bench prompts per category.
    max_tokens: new tokens per request at most.
    dtype: float32, bfloat16 or float16.
    ignore_eos: generate ``max_tokens`` tokens per prompt, past EOS.
    methods: rows of :data:`METHODS`, registered drafter names (a chain of 4), or ``extra_methods``' names.
    extra_methods: more rows, a name -> its ``speculative_config`` (``{model}`` in its strings replaced
        by the target's name); a name may not be one of :data:`METHODS` or a registered drafter's, and every
        row is checked by :class:`~specdec.config.SpeculativeConfig` before any work.
    plot: PNG of acceptance per position (and τ per category).
    interleave: build every row's engine first, then generate each prompt with every row in turn
        (:func:`experiments.harness.measure_batch1_interleaved`), so that the host's drift during the run
        moves all rows alike; False: one row after the other, each with a fresh engine. Every engine is
        alive at once (the target once, with ``share_target``, and per row a drafter and a KV pool); where
        that would pass 80 % of the available memory the rows run one after the other, with a warning
        (``interleaved`` in the result says which).
    share_target: interleaved rows run over one target in memory (``LLM.with_speculation``): the same
        weights on the same pages for every row; False: each row's engine loads its own.
    transformers: also time transformers' greedy ``generate`` on the same prompts (the reference row,
        ``speedup_vs_transformers``); False skips it (minutes at 17 tok/s) where only our rows compare.
    compare_to: the row every other row is paired against, prompt by prompt
        (``paired_speedup_per_category``, :func:`paired_speedups`); ``plain`` by default, e.g. ``ngram``
        to ask whether a drafter is faster than prompt lookup per category. A name that is no method is
        a ConfigError; a method not among ``methods`` pairs nothing (logged).
    """

    model: str = "smollm2-135m-instruct"
    prompts: str = "heldout"
    specbench_path: str = DEFAULT_SPECBENCH
    limit: int = 24
    per_category: int = 3
    max_tokens: int = 96
    dtype: str = "bfloat16"
    ignore_eos: bool = False
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    extra_methods: dict[str, Any] = field(default_factory=dict)
    plot: str | None = None
    interleave: bool = True
    share_target: bool = True
    compare_to: str = "plain"
    transformers: bool = True

    def validate(self) -> None:
        super().validate()
        require_choice("prompts", self.prompts, ("heldout", "specbench", "fresh"))
        require_choice("dtype", self.dtype, ("float32", "bfloat16", "float16"))
        require_positive(self, "limit", "per_category", "max_tokens")
        names = method_names()
        require_extra_methods(self.extra_methods, names)
        require_subset("methods", self.methods, [*names, *self.extra_methods])
        if self.compare_to not in [*names, *self.extra_methods]:
            raise ConfigError(
                f"compare_to must be a methods name ({', '.join(self.methods)}), got {self.compare_to!r}"
            )


def method_spec(
    name: str, model: str = "", extra: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any] | None:
    """The ``speculative_config`` of a ``methods`` name: a row of :data:`METHODS` or of ``extra`` (the
    config's ``extra_methods``; ``{model}`` in their strings replaced by ``model``), else any registered
    drafter (:func:`specdec.drafters.drafter_names`) as a chain of 4."""
    from specdec.drafters.registry import drafter_names

    rows = {**METHODS, **(extra or {})}
    if name in rows:
        row = rows[name]
        return (
            None
            if row is None
            else {k: v.format(model=model) if isinstance(v, str) else v for k, v in row.items()}
        )
    if name in drafter_names():
        return {"method": name, "num_speculative_tokens": 4}
    raise ConfigError(f"methods must be a non-empty subset of {method_names()}, got unknown {name!r}")


def load_prompts(kind: str, limit: int, per_category: int, path: str) -> list[Any]:
    """Held-out built-in prompts (not used for training the heads), the fresh chat prompts, or Spec-Bench,
    ``per_category`` each."""
    from experiments import datasets

    if kind == "heldout":
        from experiments.train import load_heldout_prompts

        prompts = load_heldout_prompts()
        return datasets.round_robin(prompts)[:limit]
    if kind == "fresh":
        from experiments.instruct import load_fresh_chat

        return load_fresh_chat(limit)
    rows = datasets.load_jsonl(path)
    by_cat: dict[str, list[Any]] = defaultdict(list)
    for p in rows:
        if len(by_cat[p.category]) < per_category:
            by_cat[p.category].append(p)
    return [p for cat in sorted(by_cat) for p in by_cat[cat]]


def _hf_plain(
    model_dir: Path, ids: list[list[int]], max_tokens: int, dtype: torch.dtype, ignore_eos: bool
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    counter = ForwardCounter(model)
    hf_generate(model, ids[0], 4, counter, ignore_eos=True)  # warm-up
    timed = hf_batch1(model, ids, max_tokens, counter, ignore_eos=ignore_eos)
    del model
    return {"tokens": timed.tokens, "time_s": timed.time_s, "tokens_per_s": timed.tokens_per_s}


def run_method(
    model: str,
    spec: dict[str, Any] | None,
    ids: list[list[int]],
    cats: list[str],
    max_tokens: int,
    dtype: str,
    ignore_eos: bool = False,
) -> tuple[dict[str, Any], list[list[int]]]:
    """:func:`experiments.harness.measure_batch1`, plus tokens per second and τ per prompt category."""
    row, timed = measure_batch1(model, spec, ids, max_tokens, dtype=dtype, ignore_eos=ignore_eos)
    return with_categories(row, timed, cats), timed.outputs


def with_categories(row: dict[str, Any], timed: Timed, cats: list[str]) -> dict[str, Any]:
    """``row`` with ``tokens_per_s_per_category`` (each prompt's own seconds) and, for a drafter,
    ``tau_per_category`` (per draft step) and ``tokens_per_step_per_category`` (per target forward,
    drafting or not); ``cats[i]`` is prompt i's category."""
    spent: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # category -> [tokens, seconds]
    for out, secs, cat in zip(timed.outputs, timed.seconds, cats):
        spent[cat][0] += len(out)
        spent[cat][1] += secs
    row["tokens_per_s_per_category"] = {c: n / t for c, (n, t) in spent.items() if t > 0}
    if len(timed.seconds) == len(timed.outputs):
        row["tokens_per_prompt"] = [len(o) for o in timed.outputs]
        row["seconds_per_prompt"] = list(timed.seconds)
    if "tau" in row:
        # category -> [accepted, draft steps, sampling steps]
        per_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for m, cat in zip(timed.metrics, cats):
            per_cat[cat][0] += m.get("num_accepted_tokens", 0)
            per_cat[cat][1] += m.get("num_drafts", 0)
            per_cat[cat][2] += m.get("num_steps", 0)
        row["tau_per_category"] = {c: 1 + a / n for c, (a, n, _) in per_cat.items() if n}
        row["tokens_per_step_per_category"] = {c: 1 + a / s for c, (a, _, s) in per_cat.items() if s}
    return row


def paired_speedups(
    ref: dict[str, Any], row: dict[str, Any], cats: list[str], confidence: float = 0.95
) -> dict[str, list[float]]:
    """``row``'s speed against ``ref``'s, paired prompt by prompt: per category (and ``"all"``) the
    geometric mean over its prompts of (tokens / seconds of ``row``) / (tokens / seconds of ``ref``), its
    ``confidence`` interval (Student's t on the log ratios) and the prompts it pairs. Pairing removes what
    the prompts themselves vary by (length, how much they repeat); with the rows interleaved (each prompt
    run by every row in turn, ``interleave=true``) it also removes the host's drift, so the interval is
    the run's noise: an interval above 1 says ``row`` is faster on that category, one that holds 1 says
    one run cannot tell them apart. Rows run one after another (``interleave=false``) leave slow drift
    between them outside the interval.

    Args:
        ref, row: result rows with ``tokens_per_prompt`` and ``seconds_per_prompt`` (one entry per
            prompt, :func:`with_categories`).
        cats: ``[P]`` prompt i's category.
        confidence: the interval's coverage, in (0, 1).

    Returns:
        {category: [ratio, low, high, prompts]}; a category of one prompt has no interval (low and high
        NaN); a prompt with no tokens or no seconds in either row is left out of its category's count.

    Raises:
        ValueError: the rows' per-prompt lists and ``cats`` differ in length.
    """
    import math

    from scipy import stats

    lists = [ref["tokens_per_prompt"], ref["seconds_per_prompt"], row["tokens_per_prompt"]]
    lists += [row["seconds_per_prompt"], cats]
    if len({len(x) for x in lists}) != 1:
        raise ValueError(
            f"paired_speedups: per-prompt lists of lengths {[len(x) for x in lists]} (one per prompt)"
        )
    logs: dict[str, list[float]] = defaultdict(list)
    for n_a, s_a, n_b, s_b, cat in zip(*lists):
        if n_a and n_b and s_a > 0 and s_b > 0:
            r = math.log((n_b / s_b) / (n_a / s_a))
            logs[cat].append(r)
            logs["all"].append(r)
    out: dict[str, list[float]] = {}
    for cat, xs in logs.items():
        mean = sum(xs) / len(xs)
        if len(xs) < 2:
            out[cat] = [math.exp(mean), math.nan, math.nan, 1]
            continue
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        half = stats.t.ppf(0.5 + confidence / 2, len(xs) - 1) * sd / math.sqrt(len(xs))
        out[cat] = [math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(xs)]
    return out


def run(cfg: BenchDraftersConfig) -> dict[str, Any]:
    from experiments.run import load_tokenizer, prompt_token_ids
    from specdec.zoo import resolve_model

    specs = {name: method_spec(name, cfg.model, cfg.extra_methods) for name in cfg.methods}
    check_speculative_configs(specs.values())
    prompts = load_prompts(cfg.prompts, cfg.limit, cfg.per_category, cfg.specbench_path)
    ids = prompt_token_ids(load_tokenizer(cfg.model), prompts)
    cats = [p.category for p in prompts]
    result: dict[str, Any] = {"model": cfg.model, "prompts": cfg.prompts, "num_prompts": len(ids)}
    result["max_tokens"] = cfg.max_tokens
    result["ignore_eos"] = cfg.ignore_eos
    if cfg.transformers:
        result["transformers_plain"] = _hf_plain(
            resolve_model(cfg.model), ids, cfg.max_tokens, getattr(torch, cfg.dtype), cfg.ignore_eos
        )
    rows: dict[str, Any] = {}
    base_outs: list[list[int]] | None = None
    measured: dict[str, tuple[dict[str, Any], list[list[int]]]] = {}
    interleave = cfg.interleave
    if interleave:
        need, have = (
            interleaved_bytes(cfg.model, cfg.dtype, len(specs), INTERLEAVED_KV_BYTES, cfg.share_target),
            available_bytes(),
        )
        if have is not None and need > 0.8 * have:
            logger.warning(
                "interleaving %d rows needs up to %.1f GB, %.1f GB available: one row after another instead",
                len(specs), need / 1e9, have / 1e9,
            )  # fmt: skip
            interleave = False
    result["interleaved"] = interleave
    if interleave:
        both = measure_batch1_interleaved(
            cfg.model, specs, ids, cfg.max_tokens, dtype=cfg.dtype, ignore_eos=cfg.ignore_eos,
            kv_cache_memory_bytes=INTERLEAVED_KV_BYTES, share_target=cfg.share_target,
        )  # fmt: skip
        measured = {
            name: (with_categories(row, timed, cats), timed.outputs) for name, (row, timed) in both.items()
        }
    for name, spec in specs.items():
        if interleave:
            row, outs = measured[name]
        else:
            row, outs = run_method(cfg.model, spec, ids, cats, cfg.max_tokens, cfg.dtype, cfg.ignore_eos)
        if name == "plain":
            base_outs = outs
        elif base_outs is not None:
            row["matches_plain_greedy"] = sum(a == b for a, b in zip(outs, base_outs)) / len(outs)
        rows[name] = row
        skip = ("tau_per_category", "tokens_per_step_per_category", "tokens_per_prompt", "seconds_per_prompt")
        print(name, json.dumps({k: v for k, v in row.items() if k not in skip}), flush=True)
    plain = rows.get("plain", {}).get("tokens_per_s")
    hf = result["transformers_plain"]["tokens_per_s"] if cfg.transformers else None
    plain_cats = rows.get("plain", {}).get("tokens_per_s_per_category", {})
    for row in rows.values():
        row["speedup_vs_plain"] = row["tokens_per_s"] / plain if plain else None
        row["speedup_vs_transformers"] = row["tokens_per_s"] / hf if hf else None
        if plain_cats:  # the same prompts per category, so tokens per second compare
            row["speedup_per_category"] = {
                c: tps / plain_cats[c]
                for c, tps in row["tokens_per_s_per_category"].items()
                if c in plain_cats
            }
    ref = rows.get(cfg.compare_to)
    if ref is None:
        logger.info("compare_to=%s is not among the methods run: no paired speedups", cfg.compare_to)
    elif "seconds_per_prompt" in ref:
        result["compare_to"] = cfg.compare_to
        for name, row in rows.items():
            if name != cfg.compare_to and "seconds_per_prompt" in row:
                row["paired_speedup_per_category"] = paired_speedups(ref, row, cats)
    result["methods"] = rows
    if cfg.plot:
        plot(result, cfg.plot)
    return result


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Acceptance per draft position for every speculative method; with per-category τ, a second panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {n: r for n, r in result["methods"].items() if r.get("acceptance_per_position")}
    cats = sorted({c for r in rows.values() for c in r.get("tau_per_category", {})})
    fig, axes = plt.subplots(1, 2 if cats else 1, figsize=(12 if cats else 6, 4), squeeze=False)
    ax = axes[0][0]
    for name, r in rows.items():
        acc = r["acceptance_per_position"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} (τ {r['tau']:.2f})")
    ax.set_xticks(range(1, 1 + max(len(r["acceptance_per_position"]) for r in rows.values())))
    ax.set_xlabel("draft position (tree depth)")
    ax.set_ylabel("fraction of draft steps accepting it")
    ax.set_title(f"{result['model']}, {result['num_prompts']} {result['prompts']} prompts, batch 1, greedy")
    ax.legend(fontsize=8)
    if cats:
        ax2 = axes[0][1]
        width = 0.8 / len(rows)
        for i, (name, r) in enumerate(rows.items()):
            taus = [r.get("tau_per_category", {}).get(c, 0.0) for c in cats]
            ax2.bar([j + i * width for j in range(len(cats))], taus, width, label=name)
        ax2.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=45, ha="right", fontsize=8
        )
        ax2.set_ylabel("τ (tokens per draft step)")
        ax2.axhline(1.0, color="grey", linewidth=0.5)
        ax2.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}×"


def format_table(result: dict[str, Any]) -> str:
    rows = result["methods"]
    hf = result.get("transformers_plain")
    hf_cell = "not run" if hf is None else f"{hf['tokens_per_s']:.1f} tok/s"
    lines = [
        f"{result['num_prompts']} {result['prompts']} prompts, {result['max_tokens']} tokens each, batch 1, "
        f"greedy; transformers plain: {hf_cell}",
        "",
        "| method | tok/s | vs plain | vs transformers | τ | tokens per forward | acceptance per position | "
        "matches greedy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        acc = " / ".join(f"{a:.2f}" for a in r.get("acceptance_per_position", []))
        tau = f"{r['tau']:.2f}" if "tau" in r else "1.00"
        # plain: one token per forward; a drafter row of an older result without the figure: -
        per_step = (
            f"{r['tokens_per_step']:.2f}" if r.get("tokens_per_step") else "-" if "tau" in r else "1.00"
        )
        match = r.get("matches_plain_greedy")
        match_cell = "" if match is None else f"{match:.0%}"
        lines.append(
            f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain'] or 0:.2f}× | "
            f"{_ratio(r.get('speedup_vs_transformers'))} | {tau} | {per_step} | {acc} | {match_cell} |"
        )
    cats = sorted({c for r in rows.values() for c in r.get("tau_per_category", {})})
    if cats:
        names = [n for n in rows if rows[n].get("tau_per_category")]
        lines += ["", "| category | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for c in cats:
            cells = [f"{rows[n]['tau_per_category'].get(c, float('nan')):.2f}" for n in names]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        names = [n for n in rows if rows[n].get("tokens_per_step_per_category")]
        lines += [
            "",
            "tokens per target forward per category (every step, drafting or not; τ above counts draft "
            "steps only):",
            "",
            "| category | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for c in cats:
            cells = [f"{rows[n]['tokens_per_step_per_category'].get(c, float('nan')):.2f}" for n in names]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    names = [n for n in rows if n != "plain" and rows[n].get("speedup_per_category")]
    cats = sorted({c for n in names for c in rows[n]["speedup_per_category"]})
    if names:
        lines += ["", "speedup over plain per category:", "", "| category | " + " | ".join(names) + " |"]
        lines.append("|---|" + "---|" * len(names))
        for c in cats:
            cells = [f"{rows[n]['speedup_per_category'].get(c, float('nan')):.2f}×" for n in names]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    names = [n for n in rows if rows[n].get("paired_speedup_per_category")]
    order = "interleaved" if result.get("interleaved") else "run one after another"
    if names:
        cats = sorted(
            {c for n in names for c in rows[n]["paired_speedup_per_category"]}, key=lambda c: (c == "all", c)
        )
        lines += [
            "",
            f"paired speedup over {result.get('compare_to')} per category (geometric mean over prompts, 95 % "
            f"interval, prompts; rows {order}):",
            "",
            "| category | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for c in cats:
            cells = []
            for n in names:
                v = rows[n]["paired_speedup_per_category"].get(c)
                if v is None:
                    cells.append("")
                elif v[3] < 2:
                    cells.append(f"{v[0]:.2f}× (n = 1)")
                else:
                    cells.append(f"{v[0]:.2f}× ({v[1]:.2f}-{v[2]:.2f}, n = {v[3]})")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    for name, r in rows.items():
        if r.get("oracle_tau") is not None:
            chosen = ", ".join(f"{m} {n}" for m, n in r.get("members_chosen", {}).items())
            lines.append(
                f"{name}: oracle τ {r['oracle_tau']:.2f} (the best member per step, in hindsight); {chosen}"
            )
    return "\n".join(lines)


#: ``main()``: Hydra's command line; ``main(["methods=[plain,ngram]"])``: compose, run, return the result.
main = benchmark("bench_drafters", BenchDraftersConfig, run, format_table)

if __name__ == "__main__":
    main()
