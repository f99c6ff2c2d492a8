"""Drafting cost of model-free drafters at long context: seconds to index a prompt, then per step.

No model: a request of ``context`` tokens (code-like ids: 64 random lines, copied with edits, or
random ids with ``random_ids=true``, the trie's worst case) is indexed once (the prefill's share), then
``steps`` steps each commit ``accept`` + 1 tokens and draft k = 4. Compare the per-step figures with a
plain decoding step of the target at that context (e.g. ``experiments.bench_step``).

    python -m experiments.bench_suffix_cost context=32768 steps=200
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from experiments.harness import HarnessConfig, benchmark, require_positive
from sampling.params import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.drafters.base import DrafterContext, DraftInput
from specdec.drafters.registry import get_drafter
from specdec.errors import ConfigError
from specdec.request import Request


def tokens_for(context: int, rnd: bool, seed: int = 0) -> list[int]:
    """``context`` token ids: random in [0, 32000), or text with repeats (a line edited and copied)."""
    rng = random.Random(seed)
    if rnd:
        return [rng.randrange(32000) for _ in range(context)]
    out: list[int] = []
    lines = [[rng.randrange(2000) for _ in range(rng.randint(4, 16))] for _ in range(64)]
    while len(out) < context:
        line = list(rng.choice(lines))
        if rng.random() < 0.3:
            line[rng.randrange(len(line))] = rng.randrange(2000)
        out.extend(line)
    return out[:context]


def measure(method: str, tokens: list[int], steps: int, accept: int, **fields) -> dict[str, float]:
    config = SpeculativeConfig(method, 4, **fields)
    drafter = get_drafter(method).factory(
        DrafterContext(None, config, None, torch.float32, torch.device("cpu"), None)  # type: ignore[arg-type]
    )
    req = Request("r", tokens, SamplingParams(temperature=0, max_tokens=10**6), 0)
    t0 = time.perf_counter()
    drafter.propose([DraftInput(req, len(tokens), 4, 4)])  # indexes the prompt
    index_s = time.perf_counter() - t0
    rng = random.Random(1)
    t0 = time.perf_counter()
    for _ in range(steps):
        req.token_ids.extend(rng.choice(tokens[-512:]) for _ in range(accept + 1))
        drafter.propose([DraftInput(req, accept + 1, 4, 4)])
    step_s = (time.perf_counter() - t0) / steps
    suffix = drafter.members[0] if method == "hybrid" else drafter
    state = suffix.states.peek(req) if hasattr(suffix, "depth") else None
    nodes = state.num_nodes if state is not None else 0
    return {"index_s": index_s, "step_ms": step_s * 1e3, "nodes": nodes}


@dataclass
class BenchSuffixCostConfig(HarnessConfig):
    """Options of ``python -m experiments.bench_suffix_cost``.

    Attributes:
        context: tokens of the request indexed before the steps.
        steps: draft steps timed.
        accept: accepted drafts per step (tokens committed per step - 1).
        random_ids: random ids (no repeats: the trie's worst case) instead of copied lines.
    """

    context: int = 32768
    steps: int = 200
    accept: int = 2
    random_ids: bool = False

    def validate(self) -> None:
        super().validate()
        require_positive(self, "context", "steps")
        if self.accept < 0:
            raise ConfigError(f"accept must be >= 0, got {self.accept}")


#: The drafters and settings compared.
VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("ngram", {}),
    ("suffix", {}),
    ("suffix", {"suffix_max_match": 8}),
    ("hybrid", {}),
)


def run(cfg: BenchSuffixCostConfig) -> dict[str, Any]:
    """Per variant (``method key=value``): prompt indexing seconds, ms per step, the trie's nodes. The
    request's own trie is the C++ index where it is built (``SPECDEC_SUFFIX_INDEX=0``: the Python one;
    ``suffix_index`` in the result says which)."""
    from kernels import suffix_index

    tokens = tokens_for(cfg.context, cfg.random_ids, cfg.seed)
    out: dict[str, Any] = {"suffix_index": "c++" if suffix_index.available() else "python"}
    for method, fields in VARIANTS:  # (the module is loaded: no row pays for that)
        label = method + "".join(f" {k}={v}" for k, v in fields.items())
        out[label] = measure(method, tokens, cfg.steps, cfg.accept, **fields)
    return out


def format_table(result: dict[str, Any]) -> str:
    return "\n".join(
        f"{label:28s} index {1e3 * r['index_s']:.1f} ms   per step {r['step_ms']:.3f} ms   "
        f"trie nodes {r['nodes']:,}"
        for label, r in result.items()
        if isinstance(r, dict) and "step_ms" in r
    )


#: ``main()``: Hydra's command line; ``main(["context=4096"])``: compose, run, return the result.
main = benchmark("bench_suffix_cost", BenchSuffixCostConfig, run, format_table)

if __name__ == "__main__":
    main()
