"""specdec against transformers ``generate``: same model, prompts, dtype, device and ``max_tokens``, one
process, greedy.

    python -m experiments.bench                                   # SmolLM2 bf16: plain and ngram
    python -m experiments.bench model=qwen2.5-coder-1.5b-instruct dataset=humaneval dataset.limit=3 \\
        methods=[plain,draft_model] max_tokens=48                 # the Qwen2.5-Coder 1.5B <- 0.5B pair
    python -m experiments.bench methods=[plain] concurrency=[1,4,16] transformers_static_batch=[16]

Rows (``methods`` × ``systems``):

- ``plain``: specdec without speculation | transformers ``generate``.
- ``ngram``: specdec's prompt-lookup drafter | ``generate(prompt_lookup_num_tokens=k,
  max_matching_ngram_size=prompt_lookup_max)``.
- ``draft_model``: specdec's draft-model drafter | ``generate(assistant_model=...)`` with k assistant
  tokens per step, constant schedule (transformers otherwise adapts k).
- any other registered drafter (``medusa``, ``eagle``...): specdec only (``systems=[specdec]``).

At concurrency 1 every prompt runs alone (batch 1) and is timed alone; tokens/s is generated tokens over
the summed times. specdec also runs each method with ``concurrency`` = 4 and 16 requests submitted
together (prompts reused round-robin), timed as one call; ``transformers_static_batch`` adds
transformers' plain ``generate`` on left-padded static batches.

Columns: tokens/s; speedup over the same system's plain decoding at the same concurrency; τ (tokens per
target forward: specdec's from the verifier's counters, transformers' as tokens after each prompt's first
÷ target forwards after the prefill); acceptance rate (specdec); the ratio specdec ÷ transformers for the
matching row; and the **memory-bandwidth floor**: one decoding step must read every weight of the target
once, so at batch b tokens/s cannot exceed b × read bandwidth ÷ weight bytes (bandwidth measured here by
``torch.sum`` over ``bandwidth_bytes``; KV reads and the draft model's weights ignored). Each run
directory gets ``summary.json`` (rows, floor, config, git, versions, seeds), ``bench.md``,
``config.yaml`` and ``run_info.json``. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from experiments.config import BenchConfig, bench_methods, config_to_dict, register_configs, to_bench_config
from experiments.harness import (
    ForwardCounter,
    free_memory,
    hf_assistant,
    hf_batch1,
    hf_generate,
    spec_stats_fields,
    time_batch1,
    time_hf_static_batch,
    time_together,
    warm_up,
)
from experiments.tables import format_cell
from experiments.tracking import (
    NullTracker,
    Tracker,
    pick_device,
    run_info,
    run_tracked,
    write_run_files,
)
from specdec.memory import measure_read_bandwidth
from specdec.memory import weight_bytes as step_weight_bytes

logger = logging.getLogger("experiments.bench")

#: transformers' name of each method.
HF_METHOD_NAMES = {
    "plain": "generate",
    "ngram": "prompt_lookup_num_tokens",
    "draft_model": "assistant_model",
}


# ------------------------------------------------------------------------------------- specdec
def _spec_fields(llm: Any) -> dict[str, Any]:
    fields = spec_stats_fields(llm)
    return {"tau": fields.get("tau"), "acceptance_rate": fields.get("acceptance_rate")}


def _make_llm(cfg: BenchConfig, method: str, device: str) -> Any:
    from experiments.run import has_tokenizer
    from specdec import LLM

    return LLM(
        cfg.model.name,
        device=device,
        seed=cfg.seed,
        speculative_config=cfg.speculative_config(method),
        skip_tokenizer_init=not has_tokenizer(cfg.model.name),
        **cfg.engine.llm_kwargs(cfg.model),
    )


def run_specdec(
    cfg: BenchConfig, method: str, prompts: list[list[int]], device: str, warmup: list[int]
) -> tuple[list[dict[str, Any]], list[list[int]] | None, int]:
    """specdec rows of one method at every concurrency; returns (rows, batch-1 outputs, target weight
    bytes)."""
    from sampling.params import SamplingParams
    from specdec.quantization.config import QuantizationConfig

    llm = _make_llm(cfg, method, device)
    # Bytes one batch-1 decode step reads (the calculator's count: every layer, the LM head, one row).
    quantization = QuantizationConfig.from_any(cfg.engine.quantization_arg())
    weight_bytes = step_weight_bytes(llm.engine.model.cfg, llm.engine.model.dtype, quantization)[2]
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos)
    warm_up(llm, warmup)
    rows: list[dict[str, Any]] = []
    outputs: list[list[int]] | None = None
    for c in cfg.concurrency:
        if c == 1:
            timed = time_batch1(llm, prompts, sp)
            outputs = timed.outputs
            n_requests = len(prompts)
        else:
            timed = time_together(llm, [prompts[i % len(prompts)] for i in range(c)], sp)
            n_requests = c
        tokens, elapsed = timed.tokens, timed.time_s
        row = {
            "system": "specdec",
            "method": method,
            "concurrency": c,
            "num_requests": n_requests,
            "tokens": tokens,
            "time_s": elapsed,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
            **_spec_fields(llm),
        }
        logger.info(
            "specdec %s c=%d: %d tokens in %.2f s (%.1f tok/s)",
            method,
            c,
            tokens,
            elapsed,
            row["tokens_per_s"] or 0,
        )
        rows.append(row)
    del llm
    free_memory()
    return rows, outputs, weight_bytes


# -------------------------------------------------------------------------------- transformers
def _hf_eos(model_dir: Path, hf_model: Any) -> int | None:
    from experiments.run import has_tokenizer

    if has_tokenizer(str(model_dir)):
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(str(model_dir)).eos_token_id
        if eos is not None:
            return int(eos)
    eos = hf_model.generation_config.eos_token_id
    if isinstance(eos, list):
        return int(eos[0]) if eos else None
    return None if eos is None else int(eos)


def run_transformers(
    cfg: BenchConfig, prompts: list[list[int]], device: str, warmup: list[int]
) -> tuple[list[dict[str, Any]], dict[str, list[list[int]]]]:
    """transformers rows (batch 1 per method, then static batches); returns (rows, batch-1 outputs per
    method)."""
    from transformers import AutoModelForCausalLM

    from specdec.config import resolve_dtype
    from specdec.zoo import resolve_model

    dtype = resolve_dtype((cfg.engine.dtype or cfg.model.dtype).value)
    model_dir = resolve_model(cfg.model.name)
    hf: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    hf = hf.to(torch.device(device)).eval()
    counter = ForwardCounter(hf)
    eos = _hf_eos(model_dir, hf)
    pad = eos if eos is not None else 0
    common: dict[str, Any] = {"eos_token_id": eos, "pad_token_id": pad}
    rows: list[dict[str, Any]] = []
    outputs: dict[str, list[list[int]]] = {}
    hf_generate(hf, warmup, 4, counter, **common)
    k = cfg.num_speculative_tokens
    for method in cfg.methods:
        extra: dict[str, Any] = {}
        if method == "ngram":
            extra = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": cfg.prompt_lookup_max}
        elif method == "draft_model":
            draft = cfg.resolved_draft_model()
            assert draft is not None
            extra = {"assistant_model": hf_assistant(resolve_model(draft), dtype, k, device)}
            hf_generate(hf, warmup, 4, counter, **common, **extra)
        timed = hf_batch1(hf, prompts, cfg.max_tokens, counter, cfg.ignore_eos, **common, **extra)
        tokens, elapsed, forwards = timed.tokens, timed.time_s, timed.forwards
        outputs[method] = timed.outputs
        rows.append(
            {
                "system": "transformers",
                "method": method,
                "concurrency": 1,
                "num_requests": len(prompts),
                "tokens": tokens,
                "time_s": elapsed,
                "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
                # The prefill forward emits each prompt's first token; τ counts the tokens after it.
                "tau": (tokens - len(prompts)) / forwards if method != "plain" and forwards else None,
                "acceptance_rate": None,
            }
        )
        logger.info("transformers %s: %d tokens in %.2f s", method, tokens, elapsed)
        extra.clear()
        free_memory()
    for b in cfg.transformers_static_batch:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        tokens, elapsed = time_hf_static_batch(hf, batch, cfg.max_tokens, pad, cfg.ignore_eos)
        rows.append(
            {
                "system": "transformers",
                "method": "plain (static batch)",
                "concurrency": b,
                "num_requests": b,
                "tokens": tokens,
                "time_s": elapsed,
                "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
                "tau": None,
                "acceptance_rate": None,
            }
        )
    del hf
    free_memory()
    return rows, outputs


# ------------------------------------------------------------------------------------ the bench
def _derive(rows: list[dict[str, Any]], floor_b1: float | None) -> None:
    """Fill speedup (against the same system's plain row at the same concurrency), the specdec ÷
    transformers ratio and the bandwidth floor into every row."""

    def find(system: str, method: str, c: int) -> dict[str, Any] | None:
        for r in rows:
            if (r["system"], r["method"], r["concurrency"]) == (system, method, c):
                return r
        return None

    for r in rows:
        base_method = "plain (static batch)" if r["method"] == "plain (static batch)" else "plain"
        base = find(r["system"], base_method, r["concurrency"])
        if base is None and r["method"] == "plain (static batch)":
            base = r
        r["speedup"] = (
            r["tokens_per_s"] / base["tokens_per_s"]
            if base is not None and base["tokens_per_s"] and r["tokens_per_s"]
            else None
        )
        r["ratio_vs_transformers"] = None
        if r["system"] == "specdec":
            other = find("transformers", r["method"], r["concurrency"])
            if other is None and r["method"] == "plain":
                other = find("transformers", "plain (static batch)", r["concurrency"])
            if other is not None and other["tokens_per_s"] and r["tokens_per_s"]:
                r["ratio_vs_transformers"] = r["tokens_per_s"] / other["tokens_per_s"]
        r["floor_tokens_per_s"] = floor_b1 * r["concurrency"] if floor_b1 else None
        r["fraction_of_floor"] = (
            r["tokens_per_s"] / r["floor_tokens_per_s"]
            if r["floor_tokens_per_s"] and r["tokens_per_s"]
            else None
        )


def format_table(result: dict[str, Any]) -> str:
    """The rows as a markdown table, then the floor's inputs."""
    k = result["config"]["num_speculative_tokens"]
    header = (
        "| system | method | requests | tok/s | speedup vs own plain | τ | acceptance | "
        "specdec ÷ transformers | floor tok/s | % of floor | greedy equal |"
    )
    lines = [header, "|" + "---|" * 11]
    for r in result["rows"]:
        method = r["method"]
        if r["system"] == "transformers" and method in HF_METHOD_NAMES and method != "plain":
            method = f"{method} ({HF_METHOD_NAMES[method]}, k={k})"
        elif r["system"] == "specdec" and method != "plain":
            method = f"{method} (k={k})"
        pct = None if r["fraction_of_floor"] is None else 100 * r["fraction_of_floor"]
        lines.append(
            "| "
            + " | ".join(
                [
                    r["system"],
                    method,
                    "1 (alone)" if r["concurrency"] == 1 else str(r["concurrency"]),
                    format_cell(r["tokens_per_s"], ".1f"),
                    format_cell(r["speedup"], ".2f", "×"),
                    format_cell(r["tau"]),
                    format_cell(r["acceptance_rate"], ".3f"),
                    format_cell(r["ratio_vs_transformers"], ".2f", "×"),
                    format_cell(r["floor_tokens_per_s"], ".0f"),
                    format_cell(pct, ".0f", "%"),
                    format_cell(r.get("greedy_equal")),
                ]
            )
            + " |"
        )
    f = result["floor"]
    lines.append("")
    lines.append(
        f"Target {result['config']['model']['name']} in {result['dtype']} on {result['device']}, "
        f"{result['num_prompts']} prompts, max_tokens {result['config']['max_tokens']}, "
        f"{result['torch_threads']} torch threads. Floor: {f['weight_bytes'] / 1e6:.0f} MB of weights "
        f"÷ {f['read_bandwidth_GBps']:.1f} GB/s read bandwidth = {f['tokens_per_s_batch1']:.0f} tok/s "
        "at batch 1 (× the batch size above it). greedy equal: the outputs equal specdec's plain outputs "
        "token for token."
    )
    return "\n".join(lines) + "\n"


def run_bench(
    cfg: BenchConfig,
    out_dir: str | Path | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    tracker: Tracker | None = None,
) -> dict[str, Any]:
    """Run the benchmark ``cfg``; return (and write to ``out_dir``) its rows, table and floor.

    Args:
        prompt_ids: token ids to run instead of the configured dataset.
        tracker: logs the rows as a table and the summary (the caller finishes it).
    """
    from experiments.run import load_token_ids

    tracker = tracker or NullTracker()
    threads_before = torch.get_num_threads()
    if cfg.engine.torch_threads is not None:
        torch.set_num_threads(cfg.engine.torch_threads)
    try:
        torch.manual_seed(cfg.seed)
        device = pick_device(cfg.engine.device)
        seeds = {"engine": cfg.seed, "torch": cfg.seed, "dataset": getattr(cfg.dataset, "seed", None)}
        config = config_to_dict(cfg)
        info = run_info(seeds, device)
        if out_dir is not None:
            write_run_files(out_dir, config, info)
        prompts, _ids, _cats, warmup = load_token_ids(cfg.model.name, cfg.dataset, prompt_ids)
        warmup = warmup or prompts[0][:8]
        rows: list[dict[str, Any]] = []
        specdec_outputs: dict[str, list[list[int]] | None] = {}
        weight_bytes = None
        if "specdec" in cfg.systems:
            for method in cfg.methods:
                m_rows, outs, weight_bytes = run_specdec(cfg, method, prompts, device, warmup)
                rows += m_rows
                specdec_outputs[method] = outs
        hf_outputs: dict[str, list[list[int]]] = {}
        if "transformers" in cfg.systems:
            hf_rows, hf_outputs = run_transformers(cfg, prompts, device, warmup)
            rows += hf_rows
        if weight_bytes is None:  # transformers only: count the checkpoint's weights
            from specdec.zoo import resolve_model

            weight_bytes = _safetensors_bytes(resolve_model(cfg.model.name), cfg)
        bandwidth = measure_read_bandwidth(cfg.bandwidth_bytes, device=device)
        floor_b1 = bandwidth / weight_bytes if weight_bytes else None
        reference = specdec_outputs.get("plain")
        for r in rows:
            if r["concurrency"] != 1 or reference is None:
                r["greedy_equal"] = None
            elif r["system"] == "specdec":
                r["greedy_equal"] = specdec_outputs.get(r["method"]) == reference
            else:
                r["greedy_equal"] = hf_outputs.get(r["method"]) == reference
        order = {m: i for i, m in enumerate((*bench_methods(), "plain (static batch)"))}
        rows.sort(key=lambda r: (r["concurrency"], order.get(r["method"], 9), r["system"] != "specdec"))
        _derive(rows, floor_b1)
        result: dict[str, Any] = {
            "kind": "bench",
            "rows": rows,
            "floor": {
                "weight_bytes": weight_bytes,
                "read_bandwidth_GBps": bandwidth / 1e9,
                "tokens_per_s_batch1": floor_b1,
                "bandwidth_probe_bytes": cfg.bandwidth_bytes,
            },
            "device": device,
            "dtype": (cfg.engine.dtype or cfg.model.dtype).value,
            "torch_threads": torch.get_num_threads(),
            "num_prompts": len(prompts),
            "config": config,
            "seeds": seeds,
            "git": info["git"],
            "versions": info["versions"],
        }
    finally:
        torch.set_num_threads(threads_before)
    result["table"] = format_table(result)
    columns = [
        "system",
        "method",
        "concurrency",
        "tokens_per_s",
        "speedup",
        "tau",
        "acceptance_rate",
        "ratio_vs_transformers",
        "fraction_of_floor",
    ]
    tracker.log_table("bench", columns, [[r.get(c) for c in columns] for r in rows])
    tracker.log_summary(
        {
            f"{r['system']}/{r['method']}/c{r['concurrency']}/{key}": r[key]
            for r in rows
            for key in ("tokens_per_s", "speedup", "tau", "ratio_vs_transformers")
        }
        | {"floor/tokens_per_s_batch1": floor_b1, "floor/read_bandwidth_GBps": bandwidth / 1e9}
    )
    if out_dir is not None:
        out = Path(out_dir)
        (out / "summary.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (out / "bench.md").write_text(result["table"])
    return result


def _safetensors_bytes(model_dir: Path, cfg: BenchConfig) -> int:
    """Weight bytes of a model directory's safetensors at the benchmark's dtype."""
    from safetensors import safe_open

    from specdec.config import resolve_dtype

    elem = torch.tensor([], dtype=resolve_dtype((cfg.engine.dtype or cfg.model.dtype).value)).element_size()
    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                numel = 1
                for d in st.get_slice(name).get_shape():
                    numel *= int(d)
                total += numel
    return total * elem


register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="bench")
def main(dcfg: DictConfig) -> dict[str, Any]:
    """Hydra entry point: compose ``conf/bench.yaml``, validate (before any model loads), run, print
    and save the table."""
    from hydra.core.hydra_config import HydraConfig

    cfg = to_bench_config(dcfg)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    result = run_tracked(
        cfg, out_dir, lambda tracker: run_bench(cfg, out_dir=out_dir, tracker=tracker), "bench"
    )
    print(result["table"])
    print(f"results in {out_dir}")
    return {"rows": result["rows"], "floor": result["floor"]}


if __name__ == "__main__":
    main()
