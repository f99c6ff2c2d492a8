"""Drafting cost of model-free drafters at long context: seconds to index a prompt, then per step.

No model: a request of ``--context`` tokens (code-like text: HumanEval prompts' characters as token ids,
repeated with edits, or random ids with ``--random``) is indexed once (the prefill's share), then
``--steps`` steps each commit ``--accept`` + 1 tokens and draft k = 4. Compare the per-step figures with
a plain decoding step of the target at that context (e.g. ``experiments.bench_step``).

    python -m experiments.bench_suffix_cost --context 32768 --steps 200
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from sampling.params import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.drafters.base import DrafterContext, DraftInput
from specdec.drafters.registry import get_drafter
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
    nodes = state.trie.num_nodes if state is not None else 0
    return {"index_s": index_s, "step_ms": step_s * 1e3, "nodes": nodes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--accept", type=int, default=2, help="accepted drafts per step (tokens committed - 1)"
    )
    parser.add_argument(
        "--random", action="store_true", help="random ids (no repeats: the trie's worst case)"
    )
    args = parser.parse_args(argv)
    tokens = tokens_for(args.context, args.random)
    for method, fields in (
        ("ngram", {}),
        ("suffix", {}),
        ("suffix", {"suffix_max_match": 8}),
        ("hybrid", {}),
    ):
        r = measure(method, tokens, args.steps, args.accept, **fields)
        label = method + "".join(f" {k}={v}" for k, v in fields.items())
        print(
            f"{label:28s} index {r['index_s']:.2f} s   per step {r['step_ms']:.3f} ms   "
            f"trie nodes {r['nodes']:,}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
