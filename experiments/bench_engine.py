"""Plain (non-speculative) decoding benchmark: our engine vs transformers ``generate``.

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


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best-of-N streaming read bandwidth in bytes/s: ``torch.sum`` over a ``num_bytes`` float32 tensor."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return num_bytes / best


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    from specdec.llm import chat_token_ids

    return [
        chat_token_ids(tokenizer, [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]) for i in range(n)
    ]


def bench_hf(hf_model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> float:
    """transformers greedy ``generate`` on a static (left-padded) batch; returns generated tokens/s."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=pad_id)
    with torch.no_grad():
        hf_model.generate(
            ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=pad_id
        )  # warm-up
        t = time.perf_counter()
        out = hf_model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
        elapsed = time.perf_counter() - t
    assert out.shape[1] - width == max_tokens
    return len(prompts) * max_tokens / elapsed


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
    from specdec.zoo import resolve_model

    dtype = resolve_dtype(args.dtype)
    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = chat_prompts(tok, max(batch_sizes))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    llm = LLM(model_dir, dtype=args.dtype, device="cpu")
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
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
