"""Speculative decoding benchmark against transformers, at batch 1, same prompts, same process.

Rows:
- ``ngram``: our prompt-lookup drafter vs transformers ``generate(prompt_lookup_num_tokens=k)`` on
  SmolLM2-135M-Instruct with the built-in prompts.
- ``draft_model``: our draft-model drafter vs transformers ``generate(assistant_model=...)`` on the
  Qwen2.5-Coder 0.5B → 1.5B pair with a few HumanEval prompts (``humaneval=`` path).

For each row: tokens/s of plain greedy decoding and of speculative decoding for both systems, each
one's speedup over its own baseline, τ (tokens emitted per target forward: ours from the verifier's
counters, transformers' as tokens after the first ÷ the target model's forward calls after prefill),
and our wall-clock ratio to transformers.

    python -m experiments.bench_spec 'rows=[ngram,draft_model]' max_tokens=128

Kept for the figures quoted in the README; ``python -m experiments.bench`` measures the same rows (and
concurrency and the bandwidth floor) from Hydra configs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from experiments.harness import (
    ForwardCounter,
    HarnessConfig,
    benchmark,
    hf_assistant,
    hf_batch1,
    hf_generate,
    measure_batch1,
    require_choice,
    require_positive,
    require_subset,
)

DEFAULT_HUMANEVAL = "../shared/humaneval/HumanEval.jsonl.gz"
ROWS = ("ngram", "draft_model")


@dataclass
class BenchSpecConfig(HarnessConfig):
    """Attributes:
    rows: of ``ngram`` (SmolLM2, built-in prompts) and ``draft_model`` (Qwen2.5-Coder 1.5B ← 0.5B,
        HumanEval).
    dtype: float32 or bfloat16, both systems.
    k: num_speculative_tokens (transformers: prompt_lookup_num_tokens, assistant tokens).
    max_tokens, num_prompts: of the ngram row.
    draft_max_tokens, draft_num_prompts: of the draft_model row.
    humaneval: HumanEval.jsonl.gz.
    """

    rows: list[str] = field(default_factory=lambda: list(ROWS))
    dtype: str = "bfloat16"
    k: int = 4
    max_tokens: int = 128
    num_prompts: int = 8
    draft_max_tokens: int = 48
    draft_num_prompts: int = 3
    humaneval: str = DEFAULT_HUMANEVAL

    def validate(self) -> None:
        super().validate()
        require_subset("rows", self.rows, ROWS)
        require_choice("dtype", self.dtype, ("float32", "bfloat16"))
        require_positive(self, "k", "max_tokens", "num_prompts", "draft_max_tokens", "draft_num_prompts")


def run_row(
    target: str,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: str,
    spec: dict[str, Any],
    hf_kwargs_fn: Callable[[torch.dtype], dict[str, Any]],
    eos: int | None,
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from specdec.zoo import resolve_model

    torch_dtype = getattr(torch, dtype)
    result: dict[str, Any] = {
        "target": target,
        "num_prompts": len(prompts),
        "max_tokens": max_tokens,
        "spec": spec,
    }
    warmup = prompts[0][:8]
    plain, plain_run = measure_batch1(
        target, None, prompts, max_tokens, dtype=dtype, warmup=warmup, device="cpu"
    )
    fast, spec_run = measure_batch1(
        target, spec, prompts, max_tokens, dtype=dtype, warmup=warmup, device="cpu"
    )
    result.update(
        ours_tokens_per_s_plain=plain["tokens_per_s"],
        ours_tokens_per_s_spec=fast["tokens_per_s"],
        ours_speedup=fast["tokens_per_s"] / plain["tokens_per_s"],
        ours_tau=fast.get("tau"),
        ours_acceptance_rate=fast.get("acceptance_rate"),
        ours_greedy_equal=plain_run.outputs == spec_run.outputs,
    )
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(target), dtype=torch_dtype).eval()
    counter = ForwardCounter(hf)
    extra = hf_kwargs_fn(torch_dtype)
    hf_generate(hf, warmup, 4, counter, eos_token_id=eos, pad_token_id=eos)  # warm-up
    for name, kwargs in (("plain", {}), ("spec", extra)):
        timed = hf_batch1(hf, prompts, max_tokens, counter, eos_token_id=eos, pad_token_id=eos, **kwargs)
        result[f"hf_tokens_per_s_{name}"] = timed.tokens_per_s
        if name == "spec":
            # The prefill forward emits each prompt's first token; τ counts the tokens of the steps after it.
            result["hf_tau"] = (timed.tokens - len(prompts)) / timed.forwards
        result[f"hf_outputs_equal_ours_{name}"] = timed.outputs == plain_run.outputs
    result["hf_speedup"] = result["hf_tokens_per_s_spec"] / result["hf_tokens_per_s_plain"]
    result["wall_clock_ratio_spec_ours_vs_hf"] = (
        result["ours_tokens_per_s_spec"] / result["hf_tokens_per_s_spec"]
    )
    return result


def run(cfg: BenchSpecConfig) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from experiments.datasets import load_builtin, load_humaneval
    from specdec.llm import chat_token_ids
    from specdec.zoo import resolve_model

    rows = []
    for row in cfg.rows:
        if row == "ngram":
            target = "smollm2-135m-instruct"
            tok = AutoTokenizer.from_pretrained(resolve_model(target))
            prompts = [chat_token_ids(tok, p.messages) for p in load_builtin(limit=cfg.num_prompts)]
            spec = {"method": "ngram", "num_speculative_tokens": cfg.k}
            res = run_row(
                target,
                prompts,
                cfg.max_tokens,
                cfg.dtype,
                spec,
                lambda dt: {"prompt_lookup_num_tokens": cfg.k},
                tok.eos_token_id,
            )
        else:  # draft_model
            target, draft = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
            tok = AutoTokenizer.from_pretrained(resolve_model(target))
            prompts = [
                chat_token_ids(tok, p.messages)
                for p in load_humaneval(cfg.humaneval, limit=cfg.draft_num_prompts)
            ]
            spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": cfg.k}

            def assistant(dt: torch.dtype, draft: str = draft) -> dict[str, Any]:
                return {"assistant_model": hf_assistant(resolve_model(draft), dt, cfg.k)}

            res = run_row(target, prompts, cfg.draft_max_tokens, cfg.dtype, spec, assistant, tok.eos_token_id)
        res["row"] = row
        rows.append(res)
        print(json.dumps(res, indent=2, default=str), flush=True)
    return {"rows": rows}


def _cell(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else format("–", f">{spec.split('.')[0]}")


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'row':12s} {'ours plain':>10s} {'ours spec':>10s} {'speedup':>8s} {'τ':>6s} | "
        f"{'HF plain':>9s} {'HF spec':>8s} {'speedup':>8s} {'τ':>6s} | ours/HF"
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['row']:12s} {r['ours_tokens_per_s_plain']:10.1f} {r['ours_tokens_per_s_spec']:10.1f} "
            f"{r['ours_speedup']:8.2f} {_cell(r['ours_tau'], '6.2f')} | {r['hf_tokens_per_s_plain']:9.1f} "
            f"{r['hf_tokens_per_s_spec']:8.1f} {r['hf_speedup']:8.2f} {r['hf_tau']:6.2f} | "
            f"{r['wall_clock_ratio_spec_ours_vs_hf']:.2f}"
        )
    return "\n".join(lines)


#: ``main()``: Hydra's command line; ``main(["rows=[ngram]"])``: compose, run, return ``{"rows": [...]}``.
main = benchmark("bench_spec", BenchSpecConfig, run, format_table, device="cpu")

if __name__ == "__main__":
    main()
