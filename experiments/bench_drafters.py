"""Drafter comparison at batch 1: τ, acceptance per position and speed of every drafter on the same prompts.

Methods (greedy, SmolLM2-135M-Instruct by default, one request at a time):

- ``plain``: no speculation (our baseline), and transformers' greedy ``generate`` on the same prompts
  in the same process (the peer);
- ``ngram``: prompt lookup, k = 4;
- ``medusa`` / ``medusa-tree``: our Medusa heads, a chain of 4 / the default static tree;
- ``eagle`` / ``eagle-tree``: our EAGLE head, a chain of 4 / EAGLE-2's dynamic tree;
- any other registered drafter, by its name: a chain of 4 (:func:`method_spec`).

Per method: tokens/s, speedup over our plain decoding and over transformers, τ (tokens emitted per
target forward), acceptance per position (the fraction of draft steps whose draft at depth i was
accepted), and, with ``--prompts specbench``, τ per Spec-Bench category. Every speculative method's
output is checked against plain greedy decoding (exactness; a mismatch is reported, not hidden).

Generation stops at the target's EOS (or ``--max-tokens``), as in Spec-Bench and the EAGLE papers:
past EOS a model writes text no drafter was trained on, so ``--ignore-eos`` (every request makes
``--max-tokens`` tokens, for equal work per method) lowers the τ of the learned drafters.

    python -m experiments.bench_drafters --prompts heldout --limit 24 --max-tokens 96
    python -m experiments.bench_drafters --prompts specbench --per-category 3 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

METHODS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "medusa": {"method": "medusa", "num_speculative_tokens": 4},
    "medusa-tree": {"method": "medusa", "num_speculative_tokens": 4, "tree": "static"},
    "eagle": {"method": "eagle", "num_speculative_tokens": 4},
    "eagle-tree": {"method": "eagle", "num_speculative_tokens": 5, "tree": "dynamic", "tree_topk": 4},
}
DEFAULT_SPECBENCH = "../shared/specbench/question.jsonl"


def method_spec(name: str) -> dict[str, Any] | None:
    """The ``speculative_config`` of a ``--methods`` name: a row of :data:`METHODS`, else any registered
    drafter (:func:`specdec.drafters.drafter_names`) as a chain of 4."""
    from specdec.drafters.registry import drafter_names

    if name in METHODS:
        return METHODS[name]
    if name in drafter_names():
        return {"method": name, "num_speculative_tokens": 4}
    raise SystemExit(
        f"unknown method {name!r}; choose from {list(dict.fromkeys([*METHODS, *drafter_names()]))}"
    )


def load_prompts(kind: str, limit: int, per_category: int, path: str) -> list[Any]:
    """Held-out built-in prompts (not used for training the heads) or Spec-Bench, ``per_category`` each."""
    from experiments import datasets

    if kind == "heldout":
        from experiments.train import load_heldout_prompts

        prompts = load_heldout_prompts()
        return datasets.round_robin(prompts)[:limit]
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

    from experiments.bench import ForwardCounter, hf_generate

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    counter = ForwardCounter(model)
    hf_generate(model, ids[0], 4, counter, ignore_eos=True)  # warm-up
    tokens, seconds = 0, 0.0
    for p in ids:
        out, dt, _ = hf_generate(model, p, max_tokens, counter, ignore_eos=ignore_eos)
        tokens += len(out)
        seconds += dt
    del model
    return {"tokens": tokens, "time_s": seconds, "tokens_per_s": tokens / seconds}


def run_method(
    model: str,
    spec: dict[str, Any] | None,
    ids: list[list[int]],
    cats: list[str],
    max_tokens: int,
    dtype: str,
    ignore_eos: bool = False,
) -> tuple[dict[str, Any], list[list[int]]]:
    from sampling.params import SamplingParams
    from specdec import LLM

    llm = LLM(model, dtype=dtype, speculative_config=spec)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    llm.generate([{"prompt_token_ids": ids[0]}], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.engine.reset_spec_stats()
    outs: list[list[int]] = []
    tokens, seconds = 0, 0.0
    per_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # category -> [accepted, draft steps]
    for p, cat in zip(ids, cats):
        llm.engine.kv.pool.reset_prefix_cache()
        t = time.perf_counter()
        (o,) = llm.generate([{"prompt_token_ids": p}], sp)
        seconds += time.perf_counter() - t
        out = list(o.outputs[0].token_ids)
        outs.append(out)
        tokens += len(out)
        if o.metrics.get("num_drafts"):
            per_cat[cat][0] += o.metrics["num_accepted_tokens"]
            per_cat[cat][1] += o.metrics["num_drafts"]
    stats = llm.engine.spec_stats
    row: dict[str, Any] = {"tokens": tokens, "time_s": seconds, "tokens_per_s": tokens / seconds}
    if stats is not None and stats.num_drafts:
        row["tau"] = stats.mean_acceptance_length
        row["acceptance_per_position"] = [n / stats.num_drafts for n in stats.accepted_per_position]
        row["draft_tokens_per_step"] = stats.num_draft_tokens / stats.num_drafts
        row["draft_time_s"] = stats.draft_time_s
        row["verify_time_s"] = stats.verify_time_s
        row["tau_per_category"] = {c: 1 + a / n for c, (a, n) in per_cat.items() if n}
    del llm
    return row, outs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", choices=("heldout", "specbench"), default="heldout")
    ap.add_argument("--specbench-path", default=DEFAULT_SPECBENCH)
    ap.add_argument("--limit", type=int, default=24, help="held-out prompts")
    ap.add_argument("--per-category", type=int, default=3, help="Spec-Bench prompts per category")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--ignore-eos", action="store_true", help="generate --max-tokens tokens per prompt, past EOS"
    )
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--plot", default=None, help="PNG of acceptance per position (and τ per category)")
    args = ap.parse_args(argv)

    from experiments.run import load_tokenizer, prompt_token_ids
    from specdec.zoo import resolve_model

    specs = {name: method_spec(name) for name in args.methods.split(",")}  # unknown names fail first
    torch.manual_seed(0)
    prompts = load_prompts(args.prompts, args.limit, args.per_category, args.specbench_path)
    ids = prompt_token_ids(load_tokenizer(args.model), prompts)
    cats = [p.category for p in prompts]
    result: dict[str, Any] = {"model": args.model, "prompts": args.prompts, "num_prompts": len(ids)}
    result["max_tokens"] = args.max_tokens
    result["ignore_eos"] = args.ignore_eos
    result["transformers_plain"] = _hf_plain(
        resolve_model(args.model), ids, args.max_tokens, getattr(torch, args.dtype), args.ignore_eos
    )
    rows: dict[str, Any] = {}
    base_outs: list[list[int]] | None = None
    for name, spec in specs.items():
        row, outs = run_method(args.model, spec, ids, cats, args.max_tokens, args.dtype, args.ignore_eos)
        if name == "plain":
            base_outs = outs
        elif base_outs is not None:
            row["matches_plain_greedy"] = sum(a == b for a, b in zip(outs, base_outs)) / len(outs)
        rows[name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "tau_per_category"}), flush=True)
    plain = rows.get("plain", {}).get("tokens_per_s")
    hf = result["transformers_plain"]["tokens_per_s"]
    for row in rows.values():
        row["speedup_vs_plain"] = row["tokens_per_s"] / plain if plain else None
        row["speedup_vs_transformers"] = row["tokens_per_s"] / hf
    result["methods"] = rows
    print(format_table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, args.plot)
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
        ax2.set_ylabel("τ (tokens per target forward)")
        ax2.axhline(1.0, color="grey", linewidth=0.5)
        ax2.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def format_table(result: dict[str, Any]) -> str:
    rows = result["methods"]
    lines = [
        f"{result['num_prompts']} {result['prompts']} prompts, {result['max_tokens']} tokens each, batch 1, "
        f"greedy; transformers plain: {result['transformers_plain']['tokens_per_s']:.1f} tok/s",
        "",
        "| method | tok/s | vs plain | vs transformers | τ | acceptance per position | matches greedy |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        acc = " / ".join(f"{a:.2f}" for a in r.get("acceptance_per_position", []))
        tau = f"{r['tau']:.2f}" if "tau" in r else "1.00"
        match = r.get("matches_plain_greedy")
        match_cell = "" if match is None else f"{match:.0%}"
        lines.append(
            f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain'] or 0:.2f}× | "
            f"{r['speedup_vs_transformers']:.2f}× | {tau} | {acc} | {match_cell} |"
        )
    cats = sorted({c for r in rows.values() for c in r.get("tau_per_category", {})})
    if cats:
        names = [n for n in rows if rows[n].get("tau_per_category")]
        lines += ["", "| category | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for c in cats:
            cells = [f"{rows[n]['tau_per_category'].get(c, float('nan')):.2f}" for n in names]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
