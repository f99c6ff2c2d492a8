"""What one target step costs: plain decode against verification (chains, features, trees), and n-gram
speculation on a prompt whose drafts are always right.

Each row is one forward of the target through the engine's model runner (same KV cache, same attention
backend, eager or compiled), after a context of ``context`` tokens, timed ``repeats`` times after a
warm-up, the rows in turn (so that the host's drift moves them alike); the median is reported with its
ratio to the plain decode step:

- ``plain``: one new token, one logits row (a decode step).
- ``chain``: ``k + 1`` new tokens (the last accepted one and ``k`` drafts), ``k + 1`` logits rows.
- ``chain_features``: the same, also returning the hidden states the EAGLE and Medusa heads read.
- ``tree``: a token tree of ``tree_nodes`` nodes (branching 2 at the root's first levels, then chains)
  with its tree attention mask and depth positions, one logits row per node.

The end-to-end row runs the engine (``e2e_repeats`` generations of each, in turn; medians): greedy plain
decoding against n-gram speculation (``k`` drafts) on a prompt that already contains the continuation
(the model's own greedy answer, three times, then its start again: the model goes on repeating it), so
prompt lookup's drafts are nearly always right (τ is reported): speedup ÷ τ is what a verified token
costs against a decoded one (1.0 would be free verification).

    python -m experiments.bench_step dtype=bfloat16
    python -m experiments.bench_step dtype=float32 compile=true
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from experiments.harness import HarnessConfig, benchmark, require_choice, require_positive, shared_or_own

QUESTION = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


@dataclass
class BenchStepConfig(HarnessConfig):
    """Attributes:
    model: zoo name or HF-format directory.
    dtype: float32 or bfloat16.
    compile: run the compiled forward (``LLM(compile=True)``); buckets compile during the warm-up.
    k: drafts per chain (``num_speculative_tokens``).
    tree_nodes: rows of the token tree, its root included (the engine's default tree: 15 drafts + root).
    context: tokens already in the KV cache before each timed step.
    repeats: timed forwards per row (after 3 warm-up ones), the rows taken in turn.
    max_tokens: new tokens of the end-to-end n-gram row.
    e2e_repeats: timed generations of each end-to-end row (plain and n-gram in turn; medians).
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "bfloat16"
    compile: bool = False
    k: int = 4
    tree_nodes: int = 16
    context: int = 128
    repeats: int = 100
    max_tokens: int = 128
    e2e_repeats: int = 9

    def validate(self) -> None:
        super().validate()
        require_choice("dtype", self.dtype, ("float32", "bfloat16"))
        require_positive(self, "k", "tree_nodes", "context", "repeats", "max_tokens", "e2e_repeats")


def tree_segment_fields(num_nodes: int, start: int) -> tuple[list[int], torch.Tensor]:
    """Depth positions ``[num_nodes]`` and the tree attention mask ``[num_nodes, num_nodes]`` of a tree
    whose node ``i > 0`` hangs under node ``(i - 1) // 2`` (a binary tree, filled level by level)."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, num_nodes)]
    mask = torch.eye(num_nodes, dtype=torch.bool)
    depth = [0] * num_nodes
    for i in range(1, num_nodes):
        mask[i] |= mask[parents[i]]
        depth[i] = depth[parents[i]] + 1
    return [start + d for d in depth], mask


def step_rows(llm: Any, cfg: BenchStepConfig) -> dict[str, float]:
    """Median milliseconds of each forward kind (see the module docstring)."""
    from specdec.model_runner import Segment, build_inputs

    runner = llm.engine.runner
    block_size = runner.block_size
    span = cfg.context + max(cfg.k + 1, cfg.tree_nodes) + 1
    blocks = list(range(-(-span // block_size)))
    vocab = llm.engine.model_cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (span,), generator=g).tolist()
    with torch.inference_mode():
        for s in range(0, cfg.context, 64):  # the context, in chunks the buckets cover
            chunk = ids[s : min(s + 64, cfg.context)]
            runner.execute(build_inputs([Segment(blocks, s, chunk, 1)], block_size, runner.device))
        positions, mask = tree_segment_fields(cfg.tree_nodes, cfg.context)
        segments = {
            "plain": Segment(blocks, cfg.context, ids[cfg.context : cfg.context + 1], 1),
            "chain": Segment(blocks, cfg.context, ids[cfg.context : cfg.context + cfg.k + 1], cfg.k + 1),
            "tree": Segment(
                blocks,
                cfg.context,
                ids[cfg.context : cfg.context + cfg.tree_nodes],
                cfg.tree_nodes,
                positions=positions,
                mask=mask,
            ),
        }
        inputs = {name: build_inputs([seg], block_size, runner.device) for name, seg in segments.items()}
        calls = {
            "plain": lambda: runner.execute(inputs["plain"]),
            "chain": lambda: runner.execute(inputs["chain"]),
            "chain_features": lambda: runner.execute_with_hidden(inputs["chain"]),
            "tree": lambda: runner.execute(inputs["tree"]),
        }
        return _interleaved_median_ms(calls, cfg.repeats)


def _interleaved_median_ms(calls: dict[str, Any], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median milliseconds of each call, timed round-robin (one of each per round, after ``warmup``
    rounds), so that a host whose speed drifts during the run (±10 % over a minute here) moves every row
    alike and the ratios stay comparable."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(repeats + warmup):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def ngram_row(llm_plain: Any, llm_ngram: Any, cfg: BenchStepConfig) -> dict[str, float]:
    """Plain vs n-gram tokens/s and τ on a prompt that contains its own greedy continuation."""
    from experiments.harness import spec_stats_fields
    from sampling.params import SamplingParams
    from specdec.llm import chat_token_ids

    question = chat_token_ids(llm_plain.tokenizer, [{"role": "user", "content": QUESTION}])
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=True)
    answer = list(llm_plain.generate([{"prompt_token_ids": question}], params)[0].outputs[0].token_ids)
    # The answer three times, then its first 16 tokens: the model continues the repetition (pasting the
    # answer once before the question again had the model leave it after 8 tokens with some kernels).
    prompt = {"prompt_token_ids": answer * 3 + answer[:16]}
    out: dict[str, float] = {}
    llms = {"plain": llm_plain, "ngram": llm_ngram}
    for llm in llms.values():
        llm.generate([prompt], params)  # warm-up (and prefix caching of the prompt for both)
    llm_ngram.engine.reset_spec_stats()
    times = _interleaved_median_ms(
        {name: lambda llm=llm: llm.generate([prompt], params) for name, llm in llms.items()},
        cfg.e2e_repeats,
        warmup=0,
    )
    for name, ms in times.items():
        out[f"{name}_tokens_per_s"] = cfg.max_tokens / (ms / 1e3)
    stats = spec_stats_fields(llm_ngram)
    out["ngram_tau"] = stats["tau"]
    out["ngram_speedup"] = out["ngram_tokens_per_s"] / out["plain_tokens_per_s"]
    out["ngram_speedup_over_tau"] = out["ngram_speedup"] / out["ngram_tau"]
    return out


def run(cfg: BenchStepConfig) -> dict[str, Any]:
    from specdec.llm import LLM

    common = {"dtype": cfg.dtype, "device": "cpu", "compile": cfg.compile}
    llm = LLM(cfg.model, **common)
    rows = step_rows(llm, cfg)
    result: dict[str, Any] = {"model": cfg.model, "dtype": cfg.dtype, "compile": cfg.compile,
                              "threads": torch.get_num_threads()}  # fmt: skip
    for name, ms in rows.items():
        result[f"{name}_ms"] = ms
        if name != "plain":
            result[f"{name}_over_plain"] = ms / rows["plain"]
    spec = {"method": "ngram", "num_speculative_tokens": cfg.k}
    # over the plain engine's target (the same weights on the same pages) where it is eager
    ngram = shared_or_own(llm, spec, lambda sp: LLM(cfg.model, speculative_config=sp, **common))
    result.update(ngram_row(llm, ngram, cfg))
    return result


#: ``main()``: Hydra's command line; ``main(["dtype=float32"])``: compose, run, return the result.
main = benchmark("bench_step", BenchStepConfig, run, device="cpu")

if __name__ == "__main__":
    main()
