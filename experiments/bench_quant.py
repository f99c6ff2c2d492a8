"""Quantization benchmark: decode speed per weight format beside the calculator's floor, quantized
self-drafting beside prompt lookup and a draft model, and the kernel microbenchmark behind
:mod:`specdec.quantization.linear`'s path choice.

Rows per model (batch 1, greedy, ``--max-tokens`` new tokens per prompt, built-in chat prompts):

- **decode**: plain decoding tokens/s with float32 and bfloat16 weights, and int8 and int4 weights (with
  bfloat16 activations: the packed kernels pay there, see ``specdec/quantization/linear.py``), each beside
  :func:`specdec.memory.estimate`'s bandwidth floor (bytes a step reads ÷ the measured read bandwidth)
  and the fraction of it reached;
- **speculative** (bfloat16 target): plain, ``ngram`` (prompt lookup), ``quantized_self`` int4 (default
  symmetric group 64, and group 32 with zero points: the zoo checkpoints' own grid) and int8 (drafter in
  bfloat16), and for Qwen2.5-Coder-1.5B the 0.5B ``draft_model``: tokens/s, speedup over
  plain, τ (tokens per target forward), acceptance per position, and whether the output equals plain
  greedy decoding (it must);
- **kernels** (``--kernels``): milliseconds per call of dense, int8 and int4 (packed kernel and
  dequantize-then-matmul) for the model's LM head and fused gate/up shapes, per row count and dtype,
  weights cycled through enough copies to defeat the caches.

    python -m experiments.bench_quant --models smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct
    python -m experiments.bench_quant --kernels --threads 1
    python -m experiments.bench_quant --smoke      # a tiny random model, seconds, checks the script only

Results go to ``experiments/results/quant_<model>.json`` (``--out-dir``). Run on an idle machine: the
figures are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
#: Decode rows: name -> (dtype, quantization).
DECODE_ROWS: dict[str, tuple[str, Any]] = {
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
    "int4-g32-zero-point": ("bfloat16", {"method": "int4", "group_size": 32, "zero_point": True}),
}
DRAFT_MODELS = {"qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct"}


def spec_rows(model: str, k: int, int4: Any) -> dict[str, dict[str, Any] | None]:
    rows: dict[str, dict[str, Any] | None] = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k},
        "quantized_self-int4": {
            "method": "quantized_self",
            "quantization": int4,
            "num_speculative_tokens": k,
            "draft_dtype": "bfloat16",
        },
        "quantized_self-int4-g32-zero-point": {
            "method": "quantized_self",
            "quantization": {"method": "int4", "group_size": 32, "zero_point": True},
            "num_speculative_tokens": k,
            "draft_dtype": "bfloat16",
        },
        "quantized_self-int8": {
            "method": "quantized_self",
            "quantization": "int8",
            "num_speculative_tokens": k,
            "draft_dtype": "bfloat16",
        },
    }
    if model in DRAFT_MODELS:
        rows["draft_model"] = {
            "method": "draft_model",
            "model": DRAFT_MODELS[model],
            "num_speculative_tokens": k,
        }
    return rows


def decode_row(
    model: str, ids: list[list[int]], max_tokens: int, dtype: str, quantization: Any, bandwidth: float
) -> dict[str, Any]:
    """Plain decoding tokens/s at batch 1 (one prompt at a time) and the calculator's floor."""
    from experiments.bench_engine import bench_ours
    from specdec import LLM
    from specdec.memory import estimate

    llm = LLM(model, dtype=dtype, device="cpu", quantization=quantization, skip_tokenizer_init=True)
    tokens, seconds = 0, 0.0
    for p in ids:
        tps = bench_ours(llm, [p], max_tokens)  # a short warm-up inside, then one timed request
        seconds += max_tokens / tps
        tokens += max_tokens
    context = sum(len(p) for p in ids) // len(ids) + max_tokens // 2  # mean KV length during decode
    est = estimate(model, context, 1, dtype, quantization, bandwidth_bytes_per_s=bandwidth)
    del llm
    return {
        "dtype": dtype,
        "quantization": est.quantization,
        "tokens_per_s": tokens / seconds,
        "weight_bytes": est.weight_bytes,
        "step_read_bytes": est.step_read_bytes,
        "floor_tokens_per_s": est.floor_tokens_per_s,
        "fraction_of_floor": tokens / seconds / est.floor_tokens_per_s,
    }


def spec_row(
    model: str, spec: dict[str, Any] | None, ids: list[list[int]], max_tokens: int
) -> tuple[dict[str, Any], list[list[int]]]:
    """Batch-1 greedy generation of every prompt with a bfloat16 target (as ``bench_drafters.run_method``,
    prompts given as token ids); tokens/s, τ and acceptance per position."""
    from sampling.params import SamplingParams
    from specdec import LLM

    llm = LLM(model, dtype="bfloat16", device="cpu", speculative_config=spec, skip_tokenizer_init=True)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids[0]}], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.engine.reset_spec_stats()
    outs: list[list[int]] = []
    tokens, seconds = 0, 0.0
    for p in ids:
        llm.engine.kv.pool.reset_prefix_cache()
        t = time.perf_counter()
        (o,) = llm.generate([{"prompt_token_ids": p}], sp)
        seconds += time.perf_counter() - t
        outs.append(list(o.outputs[0].token_ids))
        tokens += len(o.outputs[0].token_ids)
    row: dict[str, Any] = {"tokens": tokens, "time_s": seconds, "tokens_per_s": tokens / seconds}
    stats = llm.engine.spec_stats
    if stats is not None and stats.num_drafts:
        row["tau"] = stats.mean_acceptance_length
        row["acceptance_per_position"] = [n / stats.num_drafts for n in stats.accepted_per_position]
        row["draft_time_s"], row["verify_time_s"] = stats.draft_time_s, stats.verify_time_s
    return row, outs


def run_model(model: str, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    ids = prompts_for(model, args.num_prompts, args.smoke)
    result: dict[str, Any] = {
        "model": model,
        "num_prompts": len(ids),
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        "read_bandwidth_GBps": bandwidth / 1e9,
    }
    decode: dict[str, Any] = {}
    for name in args.decode.split(","):
        dtype, quantization = DECODE_ROWS[name]
        if args.smoke and isinstance(quantization, str) and quantization == "int4":
            quantization = {"method": "int4", "group_size": 32}  # the tiny model's sizes take groups of 32
        decode[name] = decode_row(model, ids, args.max_tokens, dtype, quantization, bandwidth)
        print(model, name, json.dumps(decode[name]), flush=True)
    result["decode"] = decode
    int4 = {"method": "int4", "group_size": 32} if args.smoke else "int4"
    rows: dict[str, Any] = {}
    base: list[list[int]] | None = None
    for name, spec in spec_rows(model, args.k, int4).items():
        if name not in args.spec.split(",") and name != "plain":
            continue
        row, outs = spec_row(model, spec, ids, args.max_tokens)
        if base is None:
            base = outs
        else:
            row["matches_plain_greedy"] = sum(a == b for a, b in zip(outs, base)) / len(outs)
        row["speedup_vs_plain"] = row["tokens_per_s"] / rows["plain"]["tokens_per_s"] if rows else 1.0
        rows[name] = row
        print(model, name, json.dumps(row), flush=True)
    result["speculative"] = rows
    return result


def prompts_for(model: str, n: int, smoke: bool) -> list[list[int]]:
    if smoke:
        g = torch.Generator().manual_seed(0)
        return [(torch.randint(3, 128, (4,), generator=g).tolist() * 4) for _ in range(n)]
    from experiments.datasets import load_builtin
    from experiments.run import load_tokenizer, prompt_token_ids

    return prompt_token_ids(load_tokenizer(model), load_builtin(limit=n))


def bench_kernels(
    shapes: dict[str, tuple[int, int]], rows: list[int], group_size: int, min_bytes: float
) -> list[dict[str, Any]]:
    """ms per call of each path, best of 3 passes over enough weight copies to exceed ``min_bytes``."""
    import torch.nn.functional as F

    from specdec.quantization.linear import QuantizedLinear

    def timed(fns: list[Any]) -> float:
        for f in fns[:2]:
            f()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for f in fns:
                f()
            best = min(best, (time.perf_counter() - t) / len(fns))
        return best * 1e3

    out = []
    for name, (n, k) in shapes.items():
        copies = max(1, int(min_bytes // (n * k * 4)))
        weights = [torch.randn(n, k) * 0.05 for _ in range(copies)]
        for dtype in (torch.float32, torch.bfloat16):
            dense = [w.to(dtype) for w in weights]
            layers = {
                f"{scheme} {kernel}": [
                    QuantizedLinear.from_weight(
                        w, None, scheme, None if scheme == "int8" else group_size, dtype, kernel=kernel
                    )
                    for w in weights
                ]
                for scheme in ("int8", "int4")
                for kernel in ("packed", "reference")
            }
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                row: dict[str, Any] = {"shape": name, "N": n, "K": k, "dtype": str(dtype), "rows": m}
                row["dense_ms"] = timed([lambda w=w, x=x: F.linear(x, w) for w in dense])
                for label, mods in layers.items():
                    row[f"{label}_ms"] = timed([lambda q=q, x=x: q(x) for q in mods])
                print(json.dumps(row), flush=True)
                out.append(row)
            del dense, layers
    return out


def tiny_model_dir() -> Path:
    """A tiny random Llama (hidden 64, 2 layers, vocabulary 128) for ``--smoke``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = Path(tempfile.mkdtemp(prefix="bench_quant_")) / "tiny"
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--decode", default=",".join(DECODE_ROWS), help=f"decode rows, of {list(DECODE_ROWS)}")
    ap.add_argument(
        "--spec",
        default="ngram,quantized_self-int4,quantized_self-int4-g32-zero-point,quantized_self-int8,draft_model",
    )
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--kernels", action="store_true", help="run the kernel microbenchmark instead")
    ap.add_argument("--kernel-rows", default="1,5,16,128")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="read bandwidth (else measured)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--smoke", action="store_true", help="tiny random model, few tokens: checks the script")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec.memory import measure_read_bandwidth

    out_dir = Path(args.out_dir)
    if args.smoke:
        args.models, args.max_tokens, args.num_prompts = str(tiny_model_dir()), 6, 2
        args.kernel_rows = "1,5"
    if args.kernels:
        from specdec.memory import arch_config

        results: dict[str, Any] = {"threads": torch.get_num_threads(), "models": {}}
        for model in args.models.split(","):
            cfg = arch_config(model)
            shapes = {
                "lm_head": (cfg.vocab_size, cfg.hidden_size),
                "gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
            }
            min_bytes = 1e6 if args.smoke else 256e6
            rows = [int(r) for r in args.kernel_rows.split(",")]
            results["models"][model] = bench_kernels(shapes, rows, 32 if args.smoke else 64, min_bytes)
        if not args.smoke:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "quant_kernels.json").write_text(json.dumps(results, indent=2) + "\n")
        return results
    bandwidth = (
        args.bandwidth_gbs * 1e9
        if args.bandwidth_gbs
        else measure_read_bandwidth(num_bytes=1 << 24 if args.smoke else 1 << 30)
    )
    all_results: dict[str, Any] = {}
    for model in args.models.split(","):
        res = run_model(model, args, bandwidth)
        all_results[model] = res
        print(format_table(res))
        if not args.smoke:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"quant_{model}.json").write_text(json.dumps(res, indent=2) + "\n")
    return all_results


def format_table(res: dict[str, Any]) -> str:
    lines = [
        f"{res['model']}: batch 1, {res['num_prompts']} prompts × {res['max_tokens']} tokens, "
        f"{res['threads']} threads, read bandwidth {res['read_bandwidth_GBps']:.1f} GB/s",
        "",
        "| weights | activations | tok/s | floor tok/s | of floor |",
        "|---|---|---|---|---|",
    ]
    for name, r in res["decode"].items():
        lines.append(
            f"| {name} | {r['dtype']} | {r['tokens_per_s']:.1f} | {r['floor_tokens_per_s']:.1f} | "
            f"{r['fraction_of_floor']:.0%} |"
        )
    lines += ["", "| drafter (bf16 target) | tok/s | speedup | τ | matches greedy |", "|---|---|---|---|---|"]
    for name, r in res["speculative"].items():
        tau = f"{r['tau']:.2f}" if "tau" in r else "1.00"
        match = r.get("matches_plain_greedy")
        lines.append(
            f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f}× | {tau} | "
            f"{'' if match is None else f'{match:.0%}'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
