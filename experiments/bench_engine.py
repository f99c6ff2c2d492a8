"""Plain (non-speculative) decoding benchmark: our engine vs transformers ``generate``.

Kept for the figures quoted in the README; ``python -m experiments.bench methods=[plain]
transformers_static_batch=[16] ignore_eos=true`` measures the same with Hydra configs and provenance.

Same model, prompts, dtype and process. Reports tokens/s at batch 1, our throughput at 4 and 16
concurrent requests against transformers' static batch of 16, and the memory-bandwidth floor: the
weight bytes a decode step must read ÷ this machine's measured read bandwidth. Prefill: prompt tokens/s
of one ``prefill_tokens``-token prompt (time to first token) against transformers' forward over it and
llama.cpp's ``llama-bench -p``.

    python -m experiments.bench_engine dtype=bfloat16 max_tokens=128
    python -m experiments.bench_engine dtype=float32 'batch_sizes=[1,4]' skip_hf_batch=true out=engine.json
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from experiments.harness import (
    HarnessConfig,
    benchmark,
    require_choice,
    require_positive,
    require_positive_list,
    time_hf_static_batch,
    time_together,
    warm_up,
)
from specdec.errors import ConfigError

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


@dataclass
class BenchEngineConfig(HarnessConfig):
    """Attributes:
    model: zoo name or HF-format directory (with a tokenizer: the prompts are chat prompts).
    dtype: float32 or bfloat16, both systems.
    max_tokens: new tokens per request (EOS ignored).
    batch_sizes: our engine's numbers of concurrent requests (1 is the batch-1 comparison).
    skip_hf_batch: skip transformers' static batch of 16.
    compile: also run our engine with ``compile=True`` (:mod:`specdec.compilation`): rows
        ``ours_compiled_*``, the compile time of each bucket, and the speedups over eager.
    llama_cpp_dir: the work folder of ``shared/peers/llama_cpp.sh`` (its ``build/bin/llama-bench`` and
        the zoo's SmolLM2 as ``smollm2-bf16.gguf`` / ``smollm2-f32.gguf``): llama.cpp's batch-1 decode
        of the same weights in the same run (``llama-bench -n max_tokens``, this process's threads),
        rows ``llama_cpp_*``, our ratio to it, and the floor at the bandwidth llama.cpp streams. None, a
        folder without them, or another model: skipped (``llama_cpp_skipped`` says why).
    prefill_tokens: prompt length of the prefill rows (``*_prefill_tokens_per_s``: a prompt of random
        token ids, new each time so that no prefix-cache hit shortens it, one token generated;
        transformers: one forward, the last position's logits; medians of ``prefill_repeats``;
        llama.cpp: ``llama-bench -p``); 0 skips them.
    prefill_repeats: timed prefills of each system (after one warm-up).
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "bfloat16"
    max_tokens: int = 128
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    skip_hf_batch: bool = False
    compile: bool = True
    llama_cpp_dir: str | None = "/tmp/llama-cpp-peer"
    prefill_tokens: int = 512
    prefill_repeats: int = 5

    def validate(self) -> None:
        super().validate()
        require_choice("dtype", self.dtype, ("float32", "bfloat16"))
        require_positive(self, "max_tokens", "prefill_repeats")
        if type(self.prefill_tokens) is not int or self.prefill_tokens < 0:
            raise ConfigError(f"prefill_tokens must be an integer >= 0, got {self.prefill_tokens!r}")
        require_positive_list("batch_sizes", self.batch_sizes)
        if 1 not in self.batch_sizes:
            raise ConfigError(
                f"batch_sizes must include 1 (the comparison at batch 1), got {self.batch_sizes}"
            )


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    from specdec.llm import chat_token_ids

    return [
        chat_token_ids(tokenizer, [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]) for i in range(n)
    ]


def bench_hf(hf_model: Any, prompts: list[list[int]], max_tokens: int, pad_id: int) -> float:
    """transformers greedy ``generate`` on a static (left-padded) batch; returns generated tokens/s."""
    tokens, elapsed = time_hf_static_batch(hf_model, prompts, max_tokens, pad_id, ignore_eos=True)
    assert tokens == len(prompts) * max_tokens
    return tokens / elapsed


def bench_ours(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """Our engine on ``prompts`` submitted together (a warm-up first); returns generated tokens/s."""
    from sampling.params import SamplingParams

    warm_up(llm, prompts[0][:8])
    # The same batch, whole: a compiled engine compiles the buckets it needs here, and the first full run
    # after a compilation was 10-20 % slower than the next ones here (both engines get the same warm-up).
    time_together(llm, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    timed = time_together(llm, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert all(len(o) == max_tokens for o in timed.outputs)
    return timed.tokens_per_s


def prefill_prompts(vocab_size: int, length: int, count: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids (seeded; ids past the first 100, which hold most
    special tokens), distinct, so that prefix caching never shortens a timed prefill."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab_size, (count, length), generator=g).tolist()


def _prompt_tokens_per_s(prefill: Any, prompts: list[list[int]]) -> float:
    """Prompt tokens/s of ``prefill(ids)`` over ``prompts`` (equal lengths): the first a warm-up, the
    median of the rest."""
    import statistics
    import time

    times = []
    for ids in prompts:
        t0 = time.perf_counter()
        prefill(ids)
        times.append(time.perf_counter() - t0)
    return len(prompts[0]) / statistics.median(times[1:])


def bench_ours_prefill(llm: Any, prompts: list[list[int]]) -> float:
    """Our prompt tokens/s: one request per prompt, one token generated (time to first token)."""
    from sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    return _prompt_tokens_per_s(lambda ids: llm.generate([{"prompt_token_ids": ids}], params), prompts)


def bench_hf_prefill(hf_model: Any, prompts: list[list[int]]) -> float:
    """transformers' prompt tokens/s: one eager forward over each prompt with the last position's logits
    only (``logits_to_keep=1``, as ``generate``'s first step computes them)."""
    with torch.inference_mode():
        return _prompt_tokens_per_s(lambda ids: hf_model(torch.tensor([ids]), logits_to_keep=1), prompts)


def run(cfg: BenchEngineConfig) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.config import resolve_dtype
    from specdec.llm import LLM
    from specdec.memory import measure_read_bandwidth
    from specdec.memory import weight_bytes as step_weight_bytes
    from specdec.zoo import resolve_model

    dtype = resolve_dtype(cfg.dtype)
    model_dir = resolve_model(cfg.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompts(tok, max(cfg.batch_sizes))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    llm = LLM(model_dir, dtype=cfg.dtype, device="cpu")
    # Bytes one batch-1 decode step reads (the calculator's count: every layer, the LM head, one row).
    weight_bytes = step_weight_bytes(llm.engine.model_cfg, dtype)[2]
    # The floor's buffer on the pages the engine's weights are on (huge pages unless turned off).
    bandwidth = measure_read_bandwidth(huge_pages=llm.huge_pages is not None and not llm.huge_pages.reason)
    floor_s = weight_bytes / bandwidth
    result: dict[str, Any] = {
        "model": cfg.model,
        "dtype": cfg.dtype,
        "max_tokens": cfg.max_tokens,
        "threads": torch.get_num_threads(),
        "weight_bytes": weight_bytes,
        "read_bandwidth_GBps": bandwidth / 1e9,
        "floor_step_ms": floor_s * 1e3,
        "floor_tokens_per_s_batch1": 1 / floor_s,
    }
    for b in cfg.batch_sizes:
        result[f"ours_tokens_per_s_batch{b}"] = bench_ours(llm, prompts[:b], cfg.max_tokens)
    if cfg.prefill_tokens:
        long_prompts = prefill_prompts(
            llm.engine.model_cfg.vocab_size, cfg.prefill_tokens, cfg.prefill_repeats + 1
        )
        result["prefill_tokens"] = cfg.prefill_tokens
        result["ours_prefill_tokens_per_s"] = bench_ours_prefill(llm, long_prompts)
    del llm
    if cfg.compile:
        import time

        t0 = time.perf_counter()
        llm = LLM(model_dir, dtype=cfg.dtype, device="cpu", compile=True)
        for b in cfg.batch_sizes:
            result[f"ours_compiled_tokens_per_s_batch{b}"] = bench_ours(llm, prompts[:b], cfg.max_tokens)
        stats = llm.engine.runner.compile_stats
        assert stats is not None
        result["compile_time_s_by_bucket"] = dict(stats.compile_time_s)
        result["compile_time_s_total"] = stats.total_compile_time_s
        result["compiled_run_wall_s"] = time.perf_counter() - t0
        for b in cfg.batch_sizes:
            result[f"speedup_compiled_vs_eager_batch{b}"] = (
                result[f"ours_compiled_tokens_per_s_batch{b}"] / result[f"ours_tokens_per_s_batch{b}"]
            )
        del llm
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    result["hf_tokens_per_s_batch1"] = bench_hf(hf_model, prompts[:1], cfg.max_tokens, pad)
    if cfg.prefill_tokens:
        result["hf_prefill_tokens_per_s"] = bench_hf_prefill(hf_model, long_prompts)
        result["prefill_speedup_vs_hf"] = (
            result["ours_prefill_tokens_per_s"] / result["hf_prefill_tokens_per_s"]
        )
    if not cfg.skip_hf_batch and 16 in cfg.batch_sizes:
        result["hf_tokens_per_s_static_batch16"] = bench_hf(hf_model, prompts[:16], cfg.max_tokens, pad)
    result["speedup_batch1_vs_hf"] = result["ours_tokens_per_s_batch1"] / result["hf_tokens_per_s_batch1"]
    result["fraction_of_floor_batch1"] = (
        result["ours_tokens_per_s_batch1"] / result["floor_tokens_per_s_batch1"]
    )
    if "hf_tokens_per_s_static_batch16" in result:
        result["speedup_batch16_vs_hf_static"] = (
            result["ours_tokens_per_s_batch16"] / result["hf_tokens_per_s_static_batch16"]
        )
    if cfg.compile:
        best = result["ours_compiled_tokens_per_s_batch1"]
        result["compiled_speedup_batch1_vs_hf"] = best / result["hf_tokens_per_s_batch1"]
        result["compiled_fraction_of_floor_batch1"] = best / result["floor_tokens_per_s_batch1"]
        if "hf_tokens_per_s_static_batch16" in result:
            result["compiled_speedup_batch16_vs_hf_static"] = (
                result["ours_compiled_tokens_per_s_batch16"] / result["hf_tokens_per_s_static_batch16"]
            )
    result.update(bench_llama_cpp(cfg, weight_bytes))
    if "llama_cpp_tokens_per_s_batch1" in result:
        result["ours_vs_llama_cpp_batch1"] = (
            result["ours_tokens_per_s_batch1"] / result["llama_cpp_tokens_per_s_batch1"]
        )
        result["fraction_of_llama_cpp_floor_batch1"] = result["ours_vs_llama_cpp_batch1"]
    if "llama_cpp_prefill_tokens_per_s" in result and "ours_prefill_tokens_per_s" in result:
        result["prefill_ours_vs_llama_cpp"] = (
            result["ours_prefill_tokens_per_s"] / result["llama_cpp_prefill_tokens_per_s"]
        )
    return result


def bench_llama_cpp(cfg: BenchEngineConfig, weight_bytes: int) -> dict[str, Any]:
    """llama.cpp's batch-1 decode of the same weights (see ``llama_cpp_dir``): tok/s, and the bandwidth
    it streams (our count of a step's weight bytes x its tok/s), which is the practical floor here."""
    import json
    import subprocess
    from pathlib import Path

    if cfg.llama_cpp_dir is None:
        return {"llama_cpp_skipped": "llama_cpp_dir=null"}
    root = Path(cfg.llama_cpp_dir)
    gguf = root / f"smollm2-{'bf16' if cfg.dtype == 'bfloat16' else 'f32'}.gguf"
    bench = root / "build" / "bin" / "llama-bench"
    if cfg.model != "smollm2-135m-instruct":
        return {"llama_cpp_skipped": f"the peer script converts SmolLM2 only, not {cfg.model}"}
    if not (bench.is_file() and gguf.is_file()):
        return {"llama_cpp_skipped": f"{bench} or {gguf} is absent (run shared/peers/llama_cpp.sh)"}
    threads = str(torch.get_num_threads())
    cmd = [
        str(bench),
        "-m",
        str(gguf),
        "-p",
        str(cfg.prefill_tokens),
        "-n",
        str(cfg.max_tokens),
        "-t",
        threads,
        "-r",
        "3",
        "-o",
        "json",
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
        # One entry per test: prompt processing (n_gen 0, when -p > 0), then generation (n_prompt 0).
        tests = json.loads(out)
        tps = next(float(t["avg_ts"]) for t in tests if int(t.get("n_gen", 0)) > 0)
        pp = [float(t["avg_ts"]) for t in tests if int(t.get("n_prompt", 0)) > 0 and not t.get("n_gen")]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError, StopIteration) as e:
        return {"llama_cpp_skipped": f"llama-bench failed: {type(e).__name__}: {e}"}
    result = {
        "llama_cpp_tokens_per_s_batch1": tps,
        "llama_cpp_GBps": weight_bytes * tps / 1e9,
        "llama_cpp_command": " ".join(cmd),
    }
    if pp:
        result["llama_cpp_prefill_tokens_per_s"] = pp[0]
    return result


#: ``main()``: Hydra's command line; ``main(["dtype=float32"])``: compose, run, return the result. The
#: table is the result's ``key  value`` listing.
main = benchmark("bench_engine", BenchEngineConfig, run, device="cpu")

if __name__ == "__main__":
    main()
