"""The target's responses to the training prompts, through ``specdec.LLM``, and their cache file.

The responses are cached on their own (``<fingerprint[:16]>.responses.json`` beside the data directory)
before any feature is computed, so that a run stopped while the features are computed does not generate
them again.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from experiments.config import TrainDataConfig

logger = logging.getLogger("experiments.train")


def generate_responses(
    model: str,
    prompt_ids: Sequence[Sequence[int]],
    data: TrainDataConfig,
    dtype: str,
    device: str,
    skip_tokenizer_init: bool = False,
) -> list[list[list[int]]]:
    """The target's responses through ``specdec.LLM``: per prompt, ``data.n`` token-id lists (EOS
    included when the target ended). Prompts are submitted shortest first (less padding per batch);
    sampled prompt i uses seed ``data.seed + i``."""
    from specdec import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        device=device,
        seed=data.seed,
        max_num_seqs=data.max_num_seqs,
        max_num_batched_tokens=data.max_num_batched_tokens,
        skip_tokenizer_init=skip_tokenizer_init,
    )
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    params = [
        SamplingParams(
            temperature=data.temperature,
            max_tokens=data.max_new_tokens,
            n=data.n,
            seed=None if data.temperature == 0 else data.seed + i,
        )
        for i in order
    ]
    out: list[list[list[int]]] = [[] for _ in prompt_ids]
    t0 = last_log = time.perf_counter()
    done = generated = 0
    # The engine's request ids count prompts in submission order ("0", "1", ...).
    for chunk in llm.stream([{"prompt_token_ids": list(prompt_ids[i])} for i in order], params):
        if not chunk.finished:
            continue
        i = order[int(chunk.request_id)]
        assert list(chunk.prompt_token_ids) == list(prompt_ids[i]), "request ids out of order"
        out[i] = [list(c.token_ids) for c in chunk.outputs]
        done += 1
        generated += sum(len(c.token_ids) for c in chunk.outputs)
        now = time.perf_counter()
        if now - last_log > 30 or done == len(prompt_ids):
            last_log = now
            logger.info(
                "generated %d/%d prompts, %d tokens in %.0f s (%.1f tok/s)",
                done,
                len(prompt_ids),
                generated,
                now - t0,
                generated / max(now - t0, 1e-9),
            )
    del llm
    gc.collect()
    return out


def read_responses(responses_file: Path, fingerprint: str) -> tuple[list[list[list[int]]], float] | None:
    """The cached responses and their generation time, when ``responses_file`` holds those of
    ``fingerprint``; else None."""
    cached = json.loads(responses_file.read_text()) if responses_file.is_file() else {}
    if cached.get("fingerprint") != fingerprint:
        return None
    return cached["responses"], cached["generation_time_s"]


def write_responses(
    responses_file: Path, fingerprint: str, generation_time_s: float, responses: list[list[list[int]]]
) -> None:
    """Cache ``responses`` (atomically) for :func:`read_responses`."""
    responses_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = responses_file.with_name(f"{responses_file.name}.tmp{os.getpid()}")
    tmp.write_text(
        json.dumps(
            {"fingerprint": fingerprint, "generation_time_s": generation_time_s, "responses": responses}
        )
    )
    tmp.replace(responses_file)
