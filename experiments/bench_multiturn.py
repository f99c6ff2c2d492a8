"""Multi-turn benchmark: prompt lookup vs suffix decoding vs the hybrid, τ per turn, on conversations
whose later turns repeat and edit earlier output (:mod:`experiments.multiturn`).

Each method runs every conversation turn by turn (greedy, batch 1, conversations one after another, so
that with sharing on, a conversation can draft from the earlier ones); every turn's output is checked
against plain decoding's (exactness; a mismatch is reported). Per method: tokens/s, speedup over plain,
τ overall, per kind and per turn, and for the hybrid its members' counts and the oracle (the best member
per step in hindsight). Skipped (an empty result and a message) when the shared HumanEval file is
absent.

    python -m experiments.bench_multiturn limit=3 turns=3 max_tokens=96 out=multiturn.json
    python -m experiments.bench_multiturn 'methods=[plain,ngram,suffix16]' \
        '+extra_methods.suffix16={method: suffix, num_speculative_tokens: 16}'
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.harness import (
    HarnessConfig,
    benchmark,
    check_speculative_configs,
    require_choice,
    require_extra_methods,
    require_positive,
    require_subset,
)
from experiments.multiturn import DEFAULT_HUMANEVAL, Conversation, load_multiturn, next_messages
from specdec.errors import ConfigError

K = 4
METHODS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": K},
    "suffix": {"method": "suffix", "num_speculative_tokens": K},
    "suffix-shared": {"method": "suffix", "num_speculative_tokens": K, "suffix_share_across_requests": True},
    "suffix-tree": {"method": "suffix", "num_speculative_tokens": K, "tree": "dynamic", "max_tree_nodes": 8},
    "hybrid": {"method": "hybrid", "num_speculative_tokens": K},
}


def _tau(accepted: int, drafts: int) -> float | None:
    return None if not drafts else 1 + accepted / drafts


def run_method(
    model: str,
    spec: dict[str, Any] | None,
    convs: list[Conversation],
    max_tokens: int,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Every conversation, turn by turn; per-turn counts, outputs and time."""
    from sampling.params import SamplingParams
    from specdec import LLM

    llm = LLM(model, dtype=dtype, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.chat([{"role": "user", "content": "warm up"}], SamplingParams(temperature=0, max_tokens=4))
    if llm.engine.drafter is not None and hasattr(llm.engine.drafter, "cache"):
        cache = llm.engine.drafter.cache
        if cache is not None:  # forget the warm-up request
            while cache.entries:
                cache.evict()
    outputs: dict[str, list[list[int]]] = {}
    per_turn: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0])  # drafts, accepted, tokens
    seconds = 0.0
    for conv in convs:
        answers: list[str] = []
        outputs[conv.id] = []
        for turn in range(conv.num_turns):
            t0 = time.perf_counter()
            out = llm.chat(next_messages(conv, answers), params)[0]
            seconds += time.perf_counter() - t0
            c = out.outputs[0]
            answers.append(c.text)
            outputs[conv.id].append(list(c.token_ids))
            row = per_turn[(conv.category, turn)]
            row[0] += out.metrics.get("num_drafts", 0)
            row[1] += out.metrics.get("num_accepted_tokens", 0)
            row[2] += len(c.token_ids)
    tokens = sum(r[2] for r in per_turn.values())
    drafts = sum(r[0] for r in per_turn.values())
    accepted = sum(r[1] for r in per_turn.values())
    result: dict[str, Any] = {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else None,
        "tau": _tau(accepted, drafts),
        "per_turn": {f"{cat}/turn{t + 1}": _tau(r[1], r[0]) for (cat, t), r in sorted(per_turn.items())},
        "outputs": outputs,
    }
    for cat in sorted({c for c, _ in per_turn}):
        rows = [r for (c, _), r in per_turn.items() if c == cat]
        result[f"tau/{cat}"] = _tau(sum(r[1] for r in rows), sum(r[0] for r in rows))
    drafter = llm.engine.drafter
    if drafter is not None and hasattr(drafter, "report"):
        result["hybrid"] = drafter.report()
    return result


@dataclass
class BenchMultiturnConfig(HarnessConfig):
    """Options of ``python -m experiments.bench_multiturn``.

    Attributes:
        model: the target (a zoo name or an HF-format folder).
        humaneval: HumanEval's ``.jsonl.gz`` (the conversations are built from its problems).
        limit: HumanEval problems used (conversations per kind).
        turns: turns per conversation.
        max_tokens: new tokens per turn at most.
        dtype: the target's dtype, ``float32`` or ``bfloat16``.
        methods: of :data:`METHODS` or ``extra_methods``, ``plain`` first (the speedups' and exactness's
            baseline).
        extra_methods: more rows, a name -> its ``speculative_config`` (another k, another budget); a name
            may not be one of :data:`METHODS`.
    """

    model: str = "smollm2-135m-instruct"
    humaneval: str = DEFAULT_HUMANEVAL
    limit: int = 3
    turns: int = 3
    max_tokens: int = 96
    dtype: str = "float32"
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    extra_methods: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        super().validate()
        require_positive(self, "limit", "turns", "max_tokens")
        require_choice("dtype", self.dtype, ("float32", "bfloat16"))
        require_extra_methods(self.extra_methods, METHODS)
        require_subset("methods", self.methods, [*METHODS, *self.extra_methods])
        if self.methods[:1] != ["plain"]:
            raise ConfigError(f"methods must start with plain (the baseline), got {self.methods}")


def run(cfg: BenchMultiturnConfig) -> dict[str, Any]:
    """Every method of ``cfg.methods`` on the conversations; per method its figures (outputs left out)."""
    rows = {**METHODS, **cfg.extra_methods}
    specs = {m: rows[m] for m in cfg.methods}
    check_speculative_configs(specs.values())
    if not Path(cfg.humaneval).exists():
        print(f"skipped: no HumanEval file at {cfg.humaneval}", file=sys.stderr)
        return {}
    convs = load_multiturn(cfg.humaneval, cfg.limit, cfg.turns)
    results = {m: run_method(cfg.model, specs[m], convs, cfg.max_tokens, cfg.dtype) for m in cfg.methods}
    base = results["plain"]
    for r in results.values():
        r["exact"] = r["outputs"] == base["outputs"]
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
    return {m: {k: v for k, v in r.items() if k != "outputs"} for m, r in results.items()}


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """One line per method: speed, speedup, τ overall and per kind, exactness; then τ per turn, and the
    hybrid's members and oracle."""

    def f(x: float | None, d: int = 2) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    results = {m: r for m, r in results.items() if isinstance(r, dict) and "per_turn" in r}
    if not results:
        return "skipped (no HumanEval file)"

    kinds = sorted({k for r in results.values() for k in r if k.startswith("tau/")})
    lines = ["method          tok/s  speedup  tau   " + "  ".join(kinds) + "  exact"]
    for name, r in results.items():
        kinds_cols = "  ".join(f"{f(r.get(k)):>{len(k)}}" for k in kinds)
        lines.append(
            f"{name:14s} {f(r['tokens_per_s'], 1):>6} {f(r['speedup']):>8} {f(r['tau']):>5}  {kinds_cols}  "
            f"{r['exact']}"
        )
    turns = sorted({t for r in results.values() for t in r["per_turn"]})
    lines.append("tau per turn: " + ", ".join(turns))
    for name, r in results.items():
        if name != "plain":
            lines.append(f"  {name:14s} " + " ".join(f(r["per_turn"].get(t)) for t in turns))
    for name, r in results.items():
        if "hybrid" in r:
            rep = r["hybrid"]
            lines.append(
                f"{name}: oracle tau {f(rep['oracle_mean_acceptance_length'])} (hindsight, best member)"
            )
            for member, s in rep["members"].items():
                alone = _tau(s["hindsight_accepted"], rep["oracle_steps"])
                lines.append(
                    f"  {member}: chosen {s['num_chosen']} steps, accepted {s['num_accepted_tokens']} of "
                    f"{s['num_draft_tokens']} drafted; alone (hindsight) tau {f(alone)}"
                )
    return "\n".join(lines)


#: ``main()``: Hydra's command line; ``main(["limit=1"])``: compose, run, return the result.
main = benchmark("bench_multiturn", BenchMultiturnConfig, run, format_table)

if __name__ == "__main__":
    main()
