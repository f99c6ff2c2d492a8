"""Decoding beside another CPU-bound process: what the engine keeps of its idle speed.

For each thread setting (``LLM(cpu_threads=...)``: ``auto``, the default, and ``none``, torch's own
fixed count) and each method (plain, n-gram), batch-1 greedy decoding of one prompt is timed idle, then
twice while a competitor runs: a second Python process multiplying 1024×1024 float32 matrices on
``competitor_threads`` threads (an everyday situation for a researcher: a training run or another
benchmark on the same machine). Reports tokens/s idle and busy (the better of the two busy runs), the
fraction kept, and the thread counts the ``auto`` policy chose.

    python -m experiments.bench_contention dtype=float32
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from experiments.harness import HarnessConfig, benchmark, require_choice, require_positive, require_subset

PROMPT = (
    "Write a Python function that checks whether a string is a palindrome, "
    "then write it again with type hints."
)
COMPETITOR = (
    "import time, torch\n"
    "torch.set_num_threads({threads})\n"
    "a = torch.randn(1024, 1024)\n"
    "end = time.time() + 900\n"
    "while time.time() < end:\n"
    "    a @ a\n"
)


@dataclass
class BenchContentionConfig(HarnessConfig):
    """Attributes:
    model: zoo name or HF-format directory.
    dtype: float32 or bfloat16.
    settings: ``cpu_threads`` values to compare: ``auto`` and/or ``none``.
    methods: ``plain`` and/or ``ngram`` (k = 4).
    max_tokens: new tokens per timed request.
    competitor_threads: threads of the competing process.
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    settings: list[str] = field(default_factory=lambda: ["auto", "none"])
    methods: list[str] = field(default_factory=lambda: ["plain", "ngram"])
    max_tokens: int = 128
    competitor_threads: int = 2

    def validate(self) -> None:
        super().validate()
        require_choice("dtype", self.dtype, ("float32", "bfloat16"))
        require_subset("settings", self.settings, ("auto", "none"))
        require_subset("methods", self.methods, ("plain", "ngram"))
        require_positive(self, "max_tokens", "competitor_threads")


def run(cfg: BenchContentionConfig) -> dict[str, Any]:
    import torch

    from sampling.params import SamplingParams
    from specdec.llm import LLM, chat_token_ids

    result: dict[str, Any] = {"model": cfg.model, "dtype": cfg.dtype}
    threads_at_start = torch.get_num_threads()  # every row starts from it (an auto row may lower it)
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=True)
    for setting in cfg.settings:
        for method in cfg.methods:
            spec = {"method": "ngram", "num_speculative_tokens": 4} if method == "ngram" else None
            threads = None if setting == "none" else "auto"
            torch.set_num_threads(threads_at_start)
            llm = LLM(cfg.model, dtype=cfg.dtype, device="cpu", cpu_threads=threads, speculative_config=spec)
            prompt = {
                "prompt_token_ids": chat_token_ids(llm.tokenizer, [{"role": "user", "content": PROMPT}])
            }
            llm.generate([prompt], params)  # warm-up

            def timed(llm: LLM = llm, prompt: dict = prompt) -> float:
                t0 = time.perf_counter()
                llm.generate([prompt], params)
                return cfg.max_tokens / (time.perf_counter() - t0)

            idle = timed()
            code = COMPETITOR.format(threads=cfg.competitor_threads)
            competitor = subprocess.Popen([sys.executable, "-c", code])
            try:
                time.sleep(2.0)
                busy = max(timed(), timed())
            finally:
                competitor.kill()
                competitor.wait()
            key = f"{setting}_{method}"
            result[f"{key}_idle_tokens_per_s"] = idle
            result[f"{key}_busy_tokens_per_s"] = busy
            result[f"{key}_fraction_kept"] = busy / idle
            if llm.engine.threads is not None:
                result[f"{key}_threads_chosen"] = list(llm.engine.threads.history)
            del llm
    return result


#: ``main()``: Hydra's command line; ``main(["dtype=bfloat16"])``: compose, run, return the result.
main = benchmark("bench_contention", BenchContentionConfig, run, device="cpu")

if __name__ == "__main__":
    main()
