"""The engine with the Triton attention backend (interpreted on a CPU) gives the reference backend's
greedy tokens on a tiny model: prefill, chunked prefill over cached context, batched decode, and
n-gram speculative decoding (verification segments of k + 1 tokens)."""

from __future__ import annotations

import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from specdec.attention.reference import ReferenceAttention
from specdec.attention.triton_backend import TritonAttention
from specdec.model_runner import select_attention_backend


class _Counting:
    """Wraps a backend; records the longest query of every forward."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.max_query_lens: list[int] = []

    def forward(self, query, key, value, k_cache, v_cache, metadata, scale, **kwargs):
        self.max_query_lens.append(max(metadata.query_lens))
        return self.inner.forward(query, key, value, k_cache, v_cache, metadata, scale, **kwargs)


def _generate(model_dir, backend: str, **kwargs) -> tuple[list[list[int]], LLM, _Counting]:
    prompts = _prompts()
    llm = LLM(model_dir, skip_tokenizer_init=True, block_size=16, **kwargs)
    counting = _Counting(select_attention_backend(llm.engine.runner.device, backend))
    llm.engine.runner.attention = counting
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], llm, counting


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(max_num_batched_tokens=16),  # chunked prefill: later chunks attend over cached context
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
    ],
    ids=["chunked-prefill", "ngram-k3"],
)
def test_triton_backend_greedy_equals_reference(tiny_model_dirs, engine_kwargs):
    d = tiny_model_dirs["llama-gqa3-tied"]  # 6 heads over 2 KV heads, head_dim 16
    ref, _, _ = _generate(d, "reference", **engine_kwargs)
    got, llm, counting = _generate(d, "triton", **engine_kwargs)
    assert got == ref
    assert isinstance(counting.inner, TritonAttention) and len(counting.max_query_lens) > 8
    if "speculative_config" in engine_kwargs:
        assert llm.engine.spec_stats.num_drafts > 0  # verification segments went through the kernel
        assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_backend_selection(tiny_model_dirs):
    cpu = torch.device("cpu")
    assert isinstance(select_attention_backend(cpu), ReferenceAttention)  # auto on a CPU
    assert isinstance(select_attention_backend(cpu, "triton"), TritonAttention)
    backend = ReferenceAttention()
    assert select_attention_backend(cpu, backend) is backend
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention_backend(cpu, "flash")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    motif = torch.randint(3, 128, (4,), generator=g).tolist()
    return [(motif * 6)[:n] for n in (5, 14, 23)]  # repetitive: prompt lookup finds drafts


def _oracle_trees_through_triton(model_dir, base: list[list[int]], **llm_kwargs) -> list[list[int]]:
    """Greedy tokens with the Triton backend verifying an oracle's token trees (the right token last
    among wrong siblings, so every accepted path is compacted); checks that drafts were accepted."""
    from tests.test_tree_engine import OracleTreeDrafter

    prompts = _prompts()
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(model_dir, skip_tokenizer_init=True, speculative_config=spec, **llm_kwargs)
    llm.engine.runner.attention = select_attention_backend(llm.engine.runner.device, "triton")
    llm.engine.drafter = OracleTreeDrafter({tuple(p): b for p, b in zip(prompts, base)}, 3, 2)
    llm.engine.num_draft_slots = llm.engine.scheduler.num_draft_slots = 15
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    return got


def test_triton_backend_verifies_token_trees(tiny_model_dirs):
    """Token-tree verification (tree attention mask, depth positions, compaction) through the Triton
    kernel gives the reference backend's greedy tokens."""
    d = tiny_model_dirs["llama-gqa3-tied"]
    base, _, _ = _generate(d, "reference")
    assert _oracle_trees_through_triton(d, base, block_size=16) == base


@pytest.mark.parametrize("family", ["gemma2-gqa2-tied-window5", "mistral-mqa-tied-window6"])
def test_triton_backend_verifies_token_trees_under_sliding_windows(family, tmp_path):
    """Token trees on windowed targets (Gemma 2: window 5 on alternate layers with soft-capped scores;
    Mistral: window 6 on every layer, blocks released behind it) through the Triton kernel, whose window
    measures a tree node's position as context + depth: the reference backend's greedy tokens."""
    from tests.test_families import make_family_model

    d = tmp_path / family
    make_family_model(family).save_pretrained(d)
    base, _, _ = _generate(d, "reference", dtype="float32")
    assert _oracle_trees_through_triton(d, base, block_size=4, dtype="float32") == base
