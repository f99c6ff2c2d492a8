"""Constrained decoding on real schemas: JSONSchemaBench (``../shared/jsonschemabench``) with SmolLM2.

For a deterministic sample of schemas (``per_subset`` smallest of each subset, or all of them with
``per_subset=null``):

- compile success rate and compile time p50 / p90 (one at a time, outlines-core backend, 10 s limit);
- SmolLM2 generates one object per compiled schema (short chat prompt asking for an example, greedy,
  ``max_tokens`` 256, all schemas in one continuously batched ``generate``), with and without n-gram
  speculation: share of finished outputs that are schema-valid (``jsonschema``), split by whether the
  schema uses keywords outlines-core ignores, share ended by length, and per-token mask time p50 / p99
  (µs; ``Grammar.fill_bitmask`` calls, timed in place);
- decode speed at batch 1 on ``speed_prompts`` schemas: tokens/s with the grammar vs the same prompts
  without it, each with and without n-gram speculation (same process, same prompts).

    python -m experiments.bench_grammar per_subset=5 out=grammar_bench.json
    python -m experiments.bench_grammar per_subset=null     # every schema
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.harness import HarnessConfig, benchmark, require_positive, time_batch1, warm_up
from specdec.errors import ConfigError

BENCH = Path(__file__).resolve().parents[1] / ".." / "shared" / "jsonschemabench"
#: The compile figures, first in the report.
COMPILE_KEYS = (
    "num_schemas",
    "compiled",
    "compile_success_rate",
    "compile_failures",
    "compile_time_s_p50",
    "compile_time_s_p90",
)


@dataclass
class BenchGrammarConfig(HarnessConfig):
    """Attributes:
    per_subset: the smallest schemas of each subset (null: every schema).
    max_tokens: of the batched generation.
    speed_prompts: schemas of the batch-1 speed figures.
    speed_max_tokens: new tokens per batch-1 request at most.
    """

    per_subset: int | None = 5
    max_tokens: int = 256
    speed_prompts: int = 4
    speed_max_tokens: int = 96

    def validate(self) -> None:
        super().validate()
        if self.per_subset is not None and self.per_subset < 1:
            raise ConfigError(f"per_subset must be >= 1 or null (every schema), got {self.per_subset}")
        require_positive(self, "max_tokens", "speed_prompts", "speed_max_tokens")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def select(per_subset: int | None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (BENCH / "index.jsonl").read_text().splitlines() if line.strip()]
    if per_subset is None:
        return rows
    out: list[dict[str, Any]] = []
    taken: dict[str, int] = {}
    for r in sorted(rows, key=lambda r: (r["subset"], r["bytes"])):
        if taken.get(r["subset"], 0) < per_subset:
            taken[r["subset"]] = taken.get(r["subset"], 0) + 1
            out.append(r)
    return out


def prompt_for(llm: Any, schema: dict[str, Any]) -> dict[str, list[int]]:
    from specdec.llm import chat_token_ids

    title = schema.get("title") or schema.get("description") or "a record"
    msg = f"Write one example JSON object for {str(title)[:120]}. Reply with JSON only."
    return {"prompt_token_ids": chat_token_ids(llm.tokenizer, [{"role": "user", "content": msg}])}


class MaskTimer:
    """Times every ``fill_bitmask`` call of the outlines-core grammar class (µs)."""

    def __init__(self) -> None:
        from grammars.outlines_backend import OutlinesGrammar

        self.cls = OutlinesGrammar
        self.original = OutlinesGrammar.fill_bitmask
        self.times_us: list[float] = []
        timer = self

        def timed(self_: Any, bitmask: Any, row: int) -> None:
            t = time.perf_counter()
            timer.original(self_, bitmask, row)
            timer.times_us.append((time.perf_counter() - t) * 1e6)

        OutlinesGrammar.fill_bitmask = timed  # type: ignore[method-assign,assignment]

    def close(self) -> None:
        self.cls.fill_bitmask = self.original  # type: ignore[method-assign]


def run(cfg: BenchGrammarConfig) -> dict[str, Any]:
    if not (BENCH / "index.jsonl").exists():
        raise SystemExit(f"{BENCH} is absent")

    from grammars import GrammarCompileError, GrammarSpec
    from grammars.schema import find_ignored_keywords
    from sampling.params import SamplingParams
    from specdec import LLM

    warnings.simplefilter("ignore")
    rows = select(cfg.per_subset)
    llm = LLM("smollm2-135m-instruct")
    backend = llm._grammar_backend()
    schemas: list[tuple[dict[str, Any], dict[str, Any], bool]] = []
    compile_s: list[float] = []
    failures: dict[str, int] = {}
    for r in rows:
        schema = json.loads((BENCH / r["file"]).read_text())["schema"]
        t = time.perf_counter()
        try:
            backend.compile(GrammarSpec.json_schema(schema))
        except (GrammarCompileError, ValueError) as e:
            failures[type(e).__name__] = failures.get(type(e).__name__, 0) + 1
            continue
        compile_s.append(time.perf_counter() - t)
        schemas.append((r, schema, bool(find_ignored_keywords(schema)[0])))
    report: dict[str, Any] = {
        "num_schemas": len(rows),
        "compiled": len(schemas),
        "compile_success_rate": len(schemas) / len(rows),
        "compile_failures": failures,
        "compile_time_s_p50": percentile(compile_s, 0.5),
        "compile_time_s_p90": percentile(compile_s, 0.9),
    }
    prompts = [prompt_for(llm, s) for _, s, _ in schemas]
    for label, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
        runner = llm if spec is None else LLM("smollm2-135m-instruct", speculative_config=spec)
        runner.engine.grammar_backend = backend
        timer = MaskTimer()
        t = time.perf_counter()
        params = [
            SamplingParams(temperature=0, max_tokens=cfg.max_tokens, json_schema=s) for _, s, _ in schemas
        ]
        outs = runner.generate(prompts, params)
        wall = time.perf_counter() - t
        timer.close()
        finished = [
            (o.outputs[0], ign)
            for o, (_, _, ign) in zip(outs, schemas)
            if o.outputs[0].finish_reason == "stop"
        ]
        clean = [c for c, ign in finished if not ign]
        report[label] = {
            "wall_s": wall,
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "finished": len(finished),
            "finished_valid_share": sum(bool(c.schema_valid) for c, _ in finished) / max(len(finished), 1),
            "finished_no_ignored_keywords": len(clean),
            "finished_no_ignored_keywords_valid_share": sum(bool(c.schema_valid) for c in clean)
            / max(len(clean), 1),
            "invalid_without_ignored_keywords": [
                r["file"]
                for o, (r, _, ign) in zip(outs, schemas)
                if o.outputs[0].finish_reason == "stop" and not ign and not o.outputs[0].schema_valid
            ],
            "length_share": sum(o.outputs[0].finish_reason == "length" for o in outs) / max(len(outs), 1),
            "mask_us_p50": percentile(timer.times_us, 0.5),
            "mask_us_p99": percentile(timer.times_us, 0.99),
            "num_mask_calls": len(timer.times_us),
        }
        print(
            json.dumps(
                {label: {k: v for k, v in report[label].items() if k != "invalid_without_ignored_keywords"}}
            )
        )
    # Decode speed at batch 1: grammar vs none, plain vs ngram.
    speed: dict[str, float] = {}
    sub = list(zip(prompts, schemas))[: cfg.speed_prompts]
    for label, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
        runner = llm if spec is None else LLM("smollm2-135m-instruct", speculative_config=spec)
        runner.engine.grammar_backend = backend
        warm_up(runner, sub[0][0]["prompt_token_ids"])
        for constrained in (False, True):
            params = [
                SamplingParams(
                    temperature=0, max_tokens=cfg.speed_max_tokens, json_schema=s if constrained else None
                )
                for _, (_, s, _) in sub
            ]
            timed = time_batch1(
                runner, [p["prompt_token_ids"] for p, _ in sub], params, reset_prefix_cache=False
            )
            speed[f"{label}_{'grammar' if constrained else 'free'}_tok_s"] = timed.tokens_per_s
    speed["grammar_over_free_plain"] = speed["plain_grammar_tok_s"] / speed["plain_free_tok_s"]
    speed["grammar_over_free_ngram"] = speed["ngram_grammar_tok_s"] / speed["ngram_free_tok_s"]
    report["speed_batch1"] = speed
    report["forward_ms_per_token_plain_free"] = 1e3 / speed["plain_free_tok_s"]
    report["compile_time_s_median"] = statistics.median(compile_s) if compile_s else None
    return report


def format_table(report: dict[str, Any]) -> str:
    """The compile figures and the batch-1 speeds as one JSON line, then the median compile time."""
    summary = {"compile": {k: report[k] for k in COMPILE_KEYS}, "speed_batch1": report["speed_batch1"]}
    return f"{json.dumps(summary)}\nmedian compile {report['compile_time_s_median']}"


#: ``main()``: Hydra's command line; ``main(["per_subset=2"])``: compose, run, return the report.
main = benchmark("bench_grammar", BenchGrammarConfig, run, format_table)

if __name__ == "__main__":
    main()
