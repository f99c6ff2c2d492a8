"""Quality of quantized weights and of the int8 KV cache, measured: perplexity of the real SmolLM2.

Text: the source of the standard library's ``textwrap`` module (``inspect.getsource(textwrap)`` of the
running Python), its first 1,024 tokens under SmolLM2's tokenizer. Perplexity is computed through our
engine's model runner and paged KV cache (the ``LLM``'s own ``engine.runner``): four chunks of 256 tokens,
each attending to the earlier chunks through the cache (with int8 KV every key and value is read back
dequantized), float32 activations, ``exp(mean NLL)`` of tokens 2..1024.

Measured (Python 3.11, torch 2.13 CPU; the figures move only with the text, i.e. the Python version):

=====================================================  ==========  ===========
configuration                                          perplexity  vs float32
=====================================================  ==========  ===========
float32                                                13.716
int8 KV cache                                          13.724      +0.06 %
int8 weights (per output channel, LM head included)    13.798      +0.60 %
int4, zero point, group 32 (LM head included)          14.61       +6.5 %
int4 symmetric, group 64 (the ``"int4"`` default)      24.61       +79 %
int4 symmetric, group 32 (measured once, not rerun)   19.51       +42 %
=====================================================  ==========  ===========

Asserted: int8 weights and int8 KV within 1 % of float32, int4 with zero points (group 32) within 10 %.
Symmetric int4 does not meet 10 % on this checkpoint, and the reason is the checkpoint: the zoo's SmolLM2
is converted from ``SmolLM2-135M-Instruct.Q4_1.gguf``, so its layers already hold 16 levels per group of
32 columns, asymmetric (every group of 32 has at most 16 distinct values). An asymmetric group-32
quantization finds that grid again (its int4 error is the LM head's, whose embedding table is stored at
higher precision in the GGUF); a symmetric one rounds the 4-bit grid onto another 4-bit grid and adds its
whole error. Asserted for it: it is worse than the zero-point variant and below 2x float32 (a regression
bound, not a quality claim).
"""

from __future__ import annotations

import inspect
import math
import textwrap
from typing import Any

import pytest
import torch

from specdec.model_runner import Segment, build_inputs

NUM_TOKENS = 1024
CHUNK = 256
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def token_ids(smollm2_dir) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.encode(inspect.getsource(textwrap), add_special_tokens=False)[:NUM_TOKENS]
    assert len(ids) == NUM_TOKENS
    return ids


def perplexity(model_dir, ids: list[int], **llm_kwargs: Any) -> float:
    """``exp`` of the mean negative log-likelihood of ``ids[1:]``, through ``LLM(...).engine.runner``."""
    from specdec import LLM

    num_blocks = -(-len(ids) // BLOCK_SIZE)
    llm = LLM(
        model_dir,
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=False,
        **llm_kwargs,
    )
    runner = llm.engine.runner
    blocks = list(range(num_blocks))
    nll, count = 0.0, 0
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        logits = runner.execute(
            build_inputs([Segment(blocks, start, chunk, len(chunk))], BLOCK_SIZE, runner.device)
        )
        targets = torch.tensor(ids[start + 1 : start + 1 + len(chunk)])
        logprobs = torch.log_softmax(logits[: len(targets)].double(), dim=-1)
        nll -= float(logprobs[torch.arange(len(targets)), targets].sum())
        count += len(targets)
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def perplexities(smollm2_dir, token_ids) -> dict[str, float]:
    configs: dict[str, dict[str, Any]] = {
        "float32": {},
        "int8 KV": {"kv_cache_dtype": "int8"},
        "int8": {"quantization": "int8"},
        "int4 zero point g32": {"quantization": {"method": "int4", "group_size": 32, "zero_point": True}},
        "int4 symmetric g64": {"quantization": "int4"},
    }
    out = {name: perplexity(smollm2_dir, token_ids, **kw) for name, kw in configs.items()}
    base = out["float32"]
    for name, p in out.items():
        print(f"[perplexity] {name:22s} {p:8.3f}  {100 * (p / base - 1):+6.2f} %")
    return out


def test_float32_perplexity_is_the_measured_one(perplexities):
    assert perplexities["float32"] == pytest.approx(13.716, rel=0.01)


def test_int8_weights_within_1_percent(perplexities):
    assert perplexities["int8"] <= 1.01 * perplexities["float32"]


def test_int8_kv_cache_within_1_percent(perplexities):
    assert perplexities["int8 KV"] <= 1.01 * perplexities["float32"]
    assert perplexities["int8 KV"] != perplexities["float32"]  # the KV really went through int8


def test_int4_zero_point_within_10_percent(perplexities):
    assert perplexities["int4 zero point g32"] <= 1.10 * perplexities["float32"]


def test_int4_symmetric_is_worse_on_this_gguf_converted_checkpoint(perplexities):
    base = perplexities["float32"]
    assert perplexities["int4 zero point g32"] < perplexities["int4 symmetric g64"] < 2 * base
