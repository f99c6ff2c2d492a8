"""A request that ends in the step that computed its prompt (``max_tokens=1``; speculation that emits
every token it may at once is the same path) still leaves its full prompt blocks in the prefix cache: the
next request with the same prompt is served from it, and its output is unchanged. Without the fix the
plain case fails (nothing cached)."""

from __future__ import annotations

import pytest

from sampling.params import SamplingParams
from specdec.llm import LLM


@pytest.mark.parametrize(
    "spec", [None, {"method": "ngram", "num_speculative_tokens": 4}], ids=["plain", "ngram"]
)
def test_a_prompt_that_ends_at_its_prefill_is_cached(tiny_model_dirs, spec):
    llm = LLM(tiny_model_dirs["llama-gqa3-tied"], skip_tokenizer_init=True, speculative_config=spec)
    prompt = {"prompt_token_ids": [(7 * i) % 100 + 3 for i in range(50)]}  # 3 full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=1 if spec is None else 2, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert llm.engine.kv.num_prefix_hits == 0
    again = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert llm.engine.kv.num_prefix_hits == 48  # the three full blocks
    assert again == first
