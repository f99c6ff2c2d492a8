"""Cost of the sampler stack per decode step: specdec's batched processors vs transformers' processors.

Same logits, same parameters, same process: ``process_logits`` + one exponential-race draw per row
against transformers' ``LogitsProcessorList`` (repetition penalty, temperature, top-k, top-p, min-p)
+ ``torch.multinomial`` on the batch, at SmolLM2's vocabulary (49,152) and Qwen2.5's (151,936). Every
row has the same parameters here so that transformers can process the batch at once (specdec also
takes different parameters per row at the same cost). Prefix: 256 prompt + 128 output tokens per row.

    python -m experiments.bench_sampler
    python -m experiments.bench_sampler repeats=3 'vocab_sizes=[49152]' 'rows=[1,4,16]' out=sampler.json
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from experiments.harness import HarnessConfig, benchmark, require_positive, require_positive_list


@dataclass
class BenchSamplerConfig(HarnessConfig):
    """Attributes:
    repeats: timed calls per figure (the best is kept, after one untimed call).
    vocab_sizes: logits widths.
    rows: batch rows per call.
    """

    repeats: int = 10
    vocab_sizes: list[int] = field(default_factory=lambda: [49152, 151936])
    rows: list[int] = field(default_factory=lambda: [1, 16])

    def validate(self) -> None:
        super().validate()
        require_positive(self, "repeats")
        require_positive_list("vocab_sizes", self.vocab_sizes)
        require_positive_list("rows", self.rows)


def _time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench(vocab_size: int, rows: int, repeats: int = 10) -> dict[str, float]:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from sampling.params import SamplingParams
    from sampling.processors import RowGroup, build_sampling_metadata, process_logits
    from sampling.sampler import sample

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab_size, generator=g) * 3
    tokens = torch.randint(0, vocab_size, (rows, 384), generator=g)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1)
    plain = SamplingParams(temperature=0.8)
    groups = [RowGroup(params, tokens[r].tolist(), 256) for r in range(rows)]
    plain_groups = [RowGroup(plain, tokens[r].tolist(), 256) for r in range(rows)]
    hf = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(1.1),
            TemperatureLogitsWarper(0.8),
            TopKLogitsWarper(50),
            TopPLogitsWarper(0.9),
            MinPLogitsWarper(0.05),
        ]
    )

    def ours(gs: list[Any] = groups) -> None:
        meta = build_sampling_metadata(gs, vocab_size)
        sample(process_logits(logits, meta), meta.greedy, [None] * rows)

    def theirs() -> None:
        probs = torch.softmax(hf(tokens, logits.clone()), dim=-1)  # type: ignore[arg-type]
        torch.multinomial(probs, 1)

    return {
        "vocab_size": vocab_size,
        "rows": rows,
        "ours_ms": 1e3 * _time(ours, repeats),
        "hf_ms": 1e3 * _time(theirs, repeats),
        "ours_temperature_only_ms": 1e3 * _time(lambda: ours(plain_groups), repeats),
    }


def run(cfg: BenchSamplerConfig) -> dict[str, Any]:
    results = []
    for vocab in cfg.vocab_sizes:
        for rows in cfg.rows:
            r: dict[str, Any] = bench(vocab, rows, cfg.repeats)
            r["hf_over_ours"] = r["hf_ms"] / r["ours_ms"]
            results.append(r)
    return {"results": results}


def format_table(result: dict[str, Any]) -> str:
    """One JSON line per (vocabulary, rows), milliseconds rounded to 3 decimals."""
    return "\n".join(
        json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
        for r in result["results"]
    )


#: ``main()``: Hydra's command line; ``main(["repeats=3"])``: compose, run, return the result.
main = benchmark("bench_sampler", BenchSamplerConfig, run, format_table, device="cpu")

if __name__ == "__main__":
    main()
