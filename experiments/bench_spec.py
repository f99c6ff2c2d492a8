"""Speculative decoding benchmark against transformers, at batch 1, same prompts, same process.

Rows:
- ``ngram``: our prompt-lookup drafter vs transformers ``generate(prompt_lookup_num_tokens=k)`` on
  SmolLM2-135M-Instruct with the built-in prompts.
- ``draft_model``: our draft-model drafter vs transformers ``generate(assistant_model=...)`` on the
  Qwen2.5-Coder 0.5B → 1.5B pair with a few HumanEval prompts (``--humaneval`` path).

For each row: tokens/s of plain greedy decoding and of speculative decoding for both systems, each
one's speedup over its own baseline, τ (tokens emitted per target forward: ours from the verifier's
counters, transformers' as tokens after the first ÷ the target model's forward calls after prefill),
and our wall-clock ratio to transformers.

    python -m experiments.bench_spec --rows ngram,draft_model --max-tokens 128

Kept for the figures quoted in the README; ``python -m experiments.bench`` measures the same rows (and
concurrency and the bandwidth floor) from Hydra configs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from experiments.bench import ForwardCounter, hf_generate

DEFAULT_HUMANEVAL = "../shared/humaneval/HumanEval.jsonl.gz"


def run_row(
    target: str,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: str,
    spec: dict[str, Any],
    hf_kwargs_fn,
    eos: int | None,
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from sampling.params import SamplingParams
    from specdec.llm import LLM
    from specdec.zoo import resolve_model

    torch_dtype = getattr(torch, dtype)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    result: dict[str, Any] = {
        "target": target,
        "num_prompts": len(prompts),
        "max_tokens": max_tokens,
        "spec": spec,
    }

    def ours(speculative_config) -> tuple[float, list[list[int]], Any]:
        llm = LLM(target, dtype=dtype, device="cpu", speculative_config=speculative_config)
        llm.generate({"prompt_token_ids": prompts[0][:8]}, SamplingParams(temperature=0, max_tokens=4))
        llm.engine.reset_spec_stats()
        outs, tokens, elapsed = [], 0, 0.0
        for p in prompts:  # batch 1
            llm.engine.kv.pool.reset_prefix_cache()
            t = time.perf_counter()
            o = llm.generate({"prompt_token_ids": p}, sp)[0]
            elapsed += time.perf_counter() - t
            outs.append(o.outputs[0].token_ids)
            tokens += len(o.outputs[0].token_ids)
        return tokens / elapsed, outs, llm.engine.spec_stats

    tps_plain, plain_outs, _ = ours(None)
    tps_spec, spec_outs, stats = ours(spec)
    result.update(
        ours_tokens_per_s_plain=tps_plain,
        ours_tokens_per_s_spec=tps_spec,
        ours_speedup=tps_spec / tps_plain,
        ours_tau=stats.mean_acceptance_length,
        ours_acceptance_rate=stats.acceptance_rate,
        ours_greedy_equal=plain_outs == spec_outs,
    )
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(target), dtype=torch_dtype).eval()
    counter = ForwardCounter(hf)
    extra = hf_kwargs_fn(torch_dtype)
    hf_generate(hf, prompts[0][:8], 4, counter, eos_token_id=eos, pad_token_id=eos)  # warm-up
    for name, kwargs in (("plain", {}), ("spec", extra)):
        tokens, elapsed, forwards = 0, 0.0, 0
        outs = []
        for p in prompts:
            new, secs, fw = hf_generate(
                hf, p, max_tokens, counter, eos_token_id=eos, pad_token_id=eos, **kwargs
            )
            tokens, elapsed, forwards = tokens + len(new), elapsed + secs, forwards + fw
            outs.append(new)
        result[f"hf_tokens_per_s_{name}"] = tokens / elapsed
        if name == "spec":
            # The prefill forward emits each prompt's first token; τ counts the tokens of the steps after it.
            result["hf_tau"] = (tokens - len(prompts)) / forwards
        result[f"hf_outputs_equal_ours_{name}"] = outs == plain_outs
    result["hf_speedup"] = result["hf_tokens_per_s_spec"] / result["hf_tokens_per_s_plain"]
    result["wall_clock_ratio_spec_ours_vs_hf"] = (
        result["ours_tokens_per_s_spec"] / result["hf_tokens_per_s_spec"]
    )
    return result


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", default="ngram,draft_model")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (prompt_lookup_num_tokens)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--draft-max-tokens", type=int, default=48)
    parser.add_argument("--draft-num-prompts", type=int, default=3)
    parser.add_argument("--humaneval", default=DEFAULT_HUMANEVAL)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from experiments.datasets import load_builtin, load_humaneval
    from specdec.llm import chat_token_ids
    from specdec.zoo import resolve_model

    rows = []
    for row in args.rows.split(","):
        if row == "ngram":
            target = "smollm2-135m-instruct"
            tok = AutoTokenizer.from_pretrained(resolve_model(target))
            prompts = [chat_token_ids(tok, p.messages) for p in load_builtin(limit=args.num_prompts)]
            spec = {"method": "ngram", "num_speculative_tokens": args.k}
            res = run_row(
                target,
                prompts,
                args.max_tokens,
                args.dtype,
                spec,
                lambda dt: {"prompt_lookup_num_tokens": args.k},
                tok.eos_token_id,
            )
        elif row == "draft_model":
            target, draft = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
            tok = AutoTokenizer.from_pretrained(resolve_model(target))
            prompts = [
                chat_token_ids(tok, p.messages)
                for p in load_humaneval(args.humaneval, limit=args.draft_num_prompts)
            ]
            spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}

            def assistant(dt: torch.dtype, draft: str = draft) -> dict[str, Any]:
                model = AutoModelForCausalLM.from_pretrained(resolve_model(draft), dtype=dt).eval()
                # Fixed k, as ours: transformers otherwise adapts the number of assistant tokens.
                model.generation_config.num_assistant_tokens = args.k
                model.generation_config.num_assistant_tokens_schedule = "constant"
                model.generation_config.assistant_confidence_threshold = 0.0
                return {"assistant_model": model}

            res = run_row(
                target, prompts, args.draft_max_tokens, args.dtype, spec, assistant, tok.eos_token_id
            )
        else:
            raise SystemExit(f"unknown row {row!r}; choose from ngram, draft_model")
        res["row"] = row
        rows.append(res)
        print(json.dumps(res, indent=2, default=str), flush=True)
    header = (
        f"{'row':12s} {'ours plain':>10s} {'ours spec':>10s} {'speedup':>8s} {'τ':>6s} | "
        f"{'HF plain':>9s} {'HF spec':>8s} {'speedup':>8s} {'τ':>6s} | ours/HF"
    )
    print(header)
    for r in rows:
        print(
            f"{r['row']:12s} {r['ours_tokens_per_s_plain']:10.1f} {r['ours_tokens_per_s_spec']:10.1f} "
            f"{r['ours_speedup']:8.2f} {r['ours_tau']:6.2f} | {r['hf_tokens_per_s_plain']:9.1f} "
            f"{r['hf_tokens_per_s_spec']:8.1f} {r['hf_speedup']:8.2f} {r['hf_tau']:6.2f} | "
            f"{r['wall_clock_ratio_spec_ours_vs_hf']:.2f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2, default=str))
    return rows


if __name__ == "__main__":
    main()
