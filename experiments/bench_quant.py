"""Quantization benchmark: decode speed per weight format beside the calculator's floor, quantized
self-drafting beside prompt lookup and a draft model, and the kernel microbenchmark behind
:mod:`specdec.quantization.linear`'s path choice.

Rows per model (batch 1, greedy, ``max_tokens`` new tokens per prompt, built-in chat prompts):

- **decode**: plain decoding tokens/s with float32 and bfloat16 weights, and int8 and int4 weights (with
  bfloat16 activations: the packed kernels pay there, see ``specdec/quantization/linear.py``), each beside
  :func:`specdec.memory.estimate`'s bandwidth floor (bytes a step reads ÷ the measured read bandwidth)
  and the fraction of it reached;
- **speculative** (bfloat16 target): plain, ``ngram`` (prompt lookup), ``quantized_self`` int4 (default
  symmetric group 64, and group 32 with zero points: the zoo checkpoints' own grid) and int8 (drafter in
  bfloat16), and for Qwen2.5-Coder-1.5B the 0.5B ``draft_model``: tokens/s, speedup over
  plain, τ (tokens per draft step; these drafters draft every step, so also per target forward),
  acceptance per position, and whether the output equals plain greedy decoding (it must);
- **kernels** (``kernels=true``): milliseconds per call of dense, int8 and int4 (packed kernel and
  dequantize-then-matmul) for the model's LM head and fused gate/up shapes, per row count and dtype,
  weights cycled through enough copies to defeat the caches.

    python -m experiments.bench_quant 'models=[smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct]'
    python -m experiments.bench_quant kernels=true threads=1
    python -m experiments.bench_quant smoke=true   # a tiny random model, seconds, checks the script only

Results go to ``experiments/results/quant_<model>.json`` (``out_dir``; not with ``smoke=true``), and
everything with ``run_info`` to ``out`` when set. Run on an idle machine: the figures are wall-clock.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from experiments.harness import (
    HarnessConfig,
    benchmark,
    measure_batch1,
    require_positive,
    require_positive_list,
    require_subset,
)
from specdec.errors import ConfigError

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
#: Speculative rows (``plain`` always runs; ``draft_model`` only for targets of :data:`DRAFT_MODELS`).
SPEC_ROWS = (
    "plain",
    "ngram",
    "quantized_self-int4",
    "quantized_self-int4-g32-zero-point",
    "quantized_self-int8",
    "draft_model",
)


@dataclass
class BenchQuantConfig(HarnessConfig):
    """Attributes:
    models: zoo names or HF-format directories.
    decode: decode rows, of :data:`DECODE_ROWS` ([]: none).
    spec: speculative rows besides ``plain``, of :data:`SPEC_ROWS` ([]: plain only).
    k: num_speculative_tokens.
    max_tokens: new tokens per prompt (EOS ignored).
    num_prompts: built-in chat prompts.
    kernels: run the kernel microbenchmark instead.
    kernel_rows: rows (tokens) per kernel call.
    bandwidth_gbs: read bandwidth in GB/s (null: measured).
    out_dir: where ``quant_<model>.json`` / ``quant_kernels.json`` go (null: ``experiments/results``).
    smoke: a tiny random model, few tokens: checks the script.
    """

    models: list[str] = field(
        default_factory=lambda: ["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"]
    )
    decode: list[str] = field(default_factory=lambda: list(DECODE_ROWS))
    spec: list[str] = field(
        default_factory=lambda: [
            "ngram",
            "quantized_self-int4",
            "quantized_self-int4-g32-zero-point",
            "quantized_self-int8",
            "draft_model",
        ]
    )
    k: int = 4
    max_tokens: int = 128
    num_prompts: int = 8
    kernels: bool = False
    kernel_rows: list[int] = field(default_factory=lambda: [1, 5, 16, 128])
    bandwidth_gbs: float | None = None
    out_dir: str | None = None
    smoke: bool = False

    def validate(self) -> None:
        super().validate()
        if not self.models:
            raise ConfigError("models must list at least one model")
        if self.decode:  # [] skips the decode rows
            require_subset("decode", self.decode, DECODE_ROWS)
        if self.spec:  # [] runs plain only
            require_subset("spec", self.spec, SPEC_ROWS)
        require_positive(self, "k", "max_tokens", "num_prompts")
        require_positive_list("kernel_rows", self.kernel_rows)
        if self.bandwidth_gbs is not None and self.bandwidth_gbs <= 0:
            raise ConfigError(f"bandwidth_gbs must be > 0 or null (measured), got {self.bandwidth_gbs}")


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
    from specdec.memory import estimate

    row, _ = measure_batch1(
        model,
        None,
        ids,
        max_tokens,
        dtype=dtype,
        ignore_eos=True,
        warmup=ids[0][:8],
        device="cpu",
        quantization=quantization,
        skip_tokenizer_init=True,
    )
    tokens_per_s = row["tokens_per_s"]
    context = sum(len(p) for p in ids) // len(ids) + max_tokens // 2  # mean KV length during decode
    est = estimate(model, context, 1, dtype, quantization, bandwidth_bytes_per_s=bandwidth)
    return {
        "dtype": dtype,
        "quantization": est.quantization,
        "tokens_per_s": tokens_per_s,
        "weight_bytes": est.weight_bytes,
        "step_read_bytes": est.step_read_bytes,
        "floor_tokens_per_s": est.floor_tokens_per_s,
        "fraction_of_floor": tokens_per_s / est.floor_tokens_per_s,
    }


def spec_row(
    model: str, spec: dict[str, Any] | None, ids: list[list[int]], max_tokens: int
) -> tuple[dict[str, Any], list[list[int]]]:
    """Batch-1 greedy generation of every prompt with a bfloat16 target
    (:func:`experiments.harness.measure_batch1`); tokens/s, τ and acceptance per position."""
    row, timed = measure_batch1(
        model,
        spec,
        ids,
        max_tokens,
        dtype="bfloat16",
        ignore_eos=True,
        device="cpu",
        skip_tokenizer_init=True,
    )
    return row, timed.outputs


def run_model(model: str, cfg: BenchQuantConfig, bandwidth: float) -> dict[str, Any]:
    ids = prompts_for(model, cfg.num_prompts, cfg.smoke)
    result: dict[str, Any] = {
        "model": model,
        "num_prompts": len(ids),
        "max_tokens": cfg.max_tokens,
        "threads": torch.get_num_threads(),
        "read_bandwidth_GBps": bandwidth / 1e9,
    }
    decode: dict[str, Any] = {}
    for name in cfg.decode:
        dtype, quantization = DECODE_ROWS[name]
        if cfg.smoke and isinstance(quantization, str) and quantization == "int4":
            quantization = {"method": "int4", "group_size": 32}  # the tiny model's sizes take groups of 32
        decode[name] = decode_row(model, ids, cfg.max_tokens, dtype, quantization, bandwidth)
        print(model, name, json.dumps(decode[name]), flush=True)
    result["decode"] = decode
    int4 = {"method": "int4", "group_size": 32} if cfg.smoke else "int4"
    rows: dict[str, Any] = {}
    base: list[list[int]] | None = None
    for name, spec in spec_rows(model, cfg.k, int4).items():
        if name not in cfg.spec and name != "plain":
            continue
        row, outs = spec_row(model, spec, ids, cfg.max_tokens)
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


def tiny_model_dir(root: Path) -> Path:
    """A tiny random Llama (hidden 64, 2 layers, vocabulary 128) for ``smoke=true``, saved in
    ``root / "tiny"``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = root / "tiny"
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def run(cfg: BenchQuantConfig) -> dict[str, Any]:
    if not cfg.smoke:
        return _run(cfg)
    with tempfile.TemporaryDirectory(prefix="bench_quant_") as tmp:
        tiny = str(tiny_model_dir(Path(tmp)))
        smoke = dataclasses.replace(cfg, models=[tiny], max_tokens=6, num_prompts=2, kernel_rows=[1, 5])
        return _run(smoke)


def _run(cfg: BenchQuantConfig) -> dict[str, Any]:
    from specdec.memory import measure_read_bandwidth

    out_dir = Path(cfg.out_dir) if cfg.out_dir is not None else RESULTS
    if cfg.kernels:
        from specdec.memory import arch_config

        results: dict[str, Any] = {"threads": torch.get_num_threads(), "models": {}}
        for model in cfg.models:
            arch = arch_config(model)
            shapes = {
                "lm_head": (arch.vocab_size, arch.hidden_size),
                "gate_up_proj": (2 * arch.intermediate_size, arch.hidden_size),
            }
            min_bytes = 1e6 if cfg.smoke else 256e6
            results["models"][model] = bench_kernels(
                shapes, cfg.kernel_rows, 32 if cfg.smoke else 64, min_bytes
            )
        if not cfg.smoke:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "quant_kernels.json").write_text(json.dumps(results, indent=2) + "\n")
        return results
    bandwidth = (
        cfg.bandwidth_gbs * 1e9
        if cfg.bandwidth_gbs
        else measure_read_bandwidth(num_bytes=1 << 24 if cfg.smoke else 1 << 30)
    )
    all_results: dict[str, Any] = {}
    for model in cfg.models:
        res = run_model(model, cfg, bandwidth)
        all_results[model] = res
        if not cfg.smoke:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"quant_{model}.json").write_text(json.dumps(res, indent=2) + "\n")
    return all_results


def format_tables(results: dict[str, Any]) -> str:
    """:func:`format_table` of every model (nothing after the kernel microbenchmark: it prints its rows
    as it goes)."""
    if "models" in results and "threads" in results:
        return ""
    return "\n\n".join(format_table(res) for res in results.values())


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


#: ``main()``: Hydra's command line; ``main(["smoke=true"])``: compose, run, return the results (one
#: entry per model; with ``kernels=true``: ``{"threads", "models"}``).
main = benchmark("bench_quant", BenchQuantConfig, run, format_tables, device="cpu")

if __name__ == "__main__":
    main()
