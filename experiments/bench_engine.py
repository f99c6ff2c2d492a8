"""Plain (non-speculative) decoding benchmark: our engine vs transformers ``generate``.

Kept for the figures quoted in the README; ``python -m experiments.bench methods=[plain]
transformers_static_batch=[16] ignore_eos=true`` measures the same with Hydra configs and provenance.

Same model, prompts, dtype and process. Reports tokens/s at batch 1, our throughput at 4 and 16
concurrent requests against transformers' static batch of 16, and the memory-bandwidth floor: the
weight bytes a decode step must read ÷ this machine's measured read bandwidth.

    python -m experiments.bench_engine --dtype bfloat16 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from experiments.bench import hf_static_batch, measure_read_bandwidth

PROMPTS = [
    "Explain what a hash table is and when to use one.",
    "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?",
    "Describe how a bicycle gear system works.",
    "Give three tips for writing clear documentation.",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
    "What is the difference between TCP and UDP?",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    from specdec.llm import chat_token_ids

    return [
        chat_token_ids(tokenizer, [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]) for i in range(n)
    ]


def bench_hf(hf_model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> float:
    """transformers greedy ``generate`` on a static (left-padded) batch; returns generated tokens/s."""
    hf_static_batch(hf_model, [p[:8] for p in prompts], 4, pad_id, ignore_eos=False)  # warm-up
    tokens, elapsed = hf_static_batch(hf_model, prompts, max_tokens, pad_id, ignore_eos=True)
    assert tokens == len(prompts) * max_tokens
    return tokens / elapsed


def bench_ours(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from sampling.params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(
        [{"prompt_token_ids": prompts[0][:8]}], SamplingParams(temperature=0, max_tokens=4)
    )  # warm-up
    llm.engine.kv.pool.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return len(prompts) * max_tokens / elapsed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--skip-hf-batch", action="store_true", help="skip transformers' batch of 16")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.config import resolve_dtype
    from specdec.llm import LLM
    from specdec.memory import weight_bytes as step_weight_bytes
    from specdec.zoo import resolve_model

    dtype = resolve_dtype(args.dtype)
    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = chat_prompts(tok, max(batch_sizes))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    llm = LLM(model_dir, dtype=args.dtype, device="cpu")
    # Bytes one batch-1 decode step reads (the calculator's count: every layer, the LM head, one row).
    weight_bytes = step_weight_bytes(llm.engine.model_cfg, dtype)[2]
    bandwidth = measure_read_bandwidth()
    floor_s = weight_bytes / bandwidth
    result: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        "weight_bytes": weight_bytes,
        "read_bandwidth_GBps": bandwidth / 1e9,
        "floor_step_ms": floor_s * 1e3,
        "floor_tokens_per_s_batch1": 1 / floor_s,
    }
    for b in batch_sizes:
        result[f"ours_tokens_per_s_batch{b}"] = bench_ours(llm, prompts[:b], args.max_tokens)
    del llm
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    result["hf_tokens_per_s_batch1"] = bench_hf(hf_model, prompts[:1], args.max_tokens, pad)
    if not args.skip_hf_batch and 16 in batch_sizes:
        result["hf_tokens_per_s_static_batch16"] = bench_hf(hf_model, prompts[:16], args.max_tokens, pad)
    result["speedup_batch1_vs_hf"] = result["ours_tokens_per_s_batch1"] / result["hf_tokens_per_s_batch1"]
    result["fraction_of_floor_batch1"] = (
        result["ours_tokens_per_s_batch1"] / result["floor_tokens_per_s_batch1"]
    )
    if "hf_tokens_per_s_static_batch16" in result:
        result["speedup_batch16_vs_hf_static"] = (
            result["ours_tokens_per_s_batch16"] / result["hf_tokens_per_s_static_batch16"]
        )
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:{width}s}  {v:.3f}" if isinstance(v, float) else f"{k:{width}s}  {v}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
