"""Multi-turn benchmark: prompt lookup vs suffix decoding vs the hybrid, τ per turn, on conversations
whose later turns repeat and edit earlier output (:mod:`experiments.multiturn`).

Each method runs every conversation turn by turn (greedy, batch 1, conversations one after another, so
that with sharing on, a conversation can draft from the earlier ones); every turn's output is checked
against plain decoding's (exactness; a mismatch is reported). Per method: tokens/s, speedup over plain,
τ overall, per kind and per turn, and for the hybrid its members' counts and the oracle (the best member
per step in hindsight). Skipped (exit 0, a message) when the shared HumanEval file is absent.

    python -m experiments.bench_multiturn --limit 3 --turns 3 --max-tokens 96 --out multiturn.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from experiments.multiturn import DEFAULT_HUMANEVAL, Conversation, load_multiturn, next_messages

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
    model: str, spec: dict[str, Any] | None, convs: list[Conversation], max_tokens: int
) -> dict[str, Any]:
    """Every conversation, turn by turn; per-turn counts, outputs and time."""
    from sampling.params import SamplingParams
    from specdec import LLM

    llm = LLM(model, speculative_config=spec)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--humaneval", default=DEFAULT_HUMANEVAL)
    parser.add_argument("--limit", type=int, default=3, help="HumanEval problems (conversations per kind)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, plain first")
    parser.add_argument("--out", default=None, help="write the result as JSON")
    args = parser.parse_args(argv)
    if not Path(args.humaneval).exists():
        print(f"skipped: no HumanEval file at {args.humaneval}", file=sys.stderr)
        return 0
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or methods[:1] != ["plain"]:
        raise SystemExit(f"methods must start with plain and be among {list(METHODS)}; got {methods}")
    convs = load_multiturn(args.humaneval, args.limit, args.turns)
    results = {m: run_method(args.model, METHODS[m], convs, args.max_tokens) for m in methods}
    base = results["plain"]
    for r in results.values():
        r["exact"] = r["outputs"] == base["outputs"]
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
    print(format_table(results))
    if args.out:
        slim = {m: {k: v for k, v in r.items() if k != "outputs"} for m, r in results.items()}
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": slim}, indent=1))
    return 0


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """One line per method: speed, speedup, τ overall and per kind, exactness; then τ per turn, and the
    hybrid's members and oracle."""

    def f(x: float | None, d: int = 2) -> str:
        return "-" if x is None else f"{x:.{d}f}"

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


if __name__ == "__main__":
    sys.exit(main())
