"""Greedy parity: the engine under continuous batching equals transformers' greedy ``generate``."""

from __future__ import annotations

import itertools

import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from tests.conftest import hf_greedy


def _tiny_prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, vocab, (9,), generator=g).tolist()  # a shared "system prompt"
    return [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(block_size=16, enable_prefix_caching=False),
        dict(block_size=4, enable_prefix_caching=True, max_num_batched_tokens=7),  # chunked prefill
        dict(
            block_size=4, enable_prefix_caching=True, num_kv_blocks=18, max_num_batched_tokens=16
        ),  # preemption
        dict(block_size=3, enable_prefix_caching=True, max_num_seqs=2),  # queueing
    ],
    ids=["plain", "chunked-prefix", "preemption", "max-seqs"],
)
def test_tiny_greedy_parity(tiny_model_dirs, engine_kwargs):
    from transformers import AutoModelForCausalLM

    d = tiny_model_dirs["qwen2-gqa2-untied"]
    hf_model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    prompts = _tiny_prompts(128, [1, 4, 11, 20, 30])
    max_tokens = [24, 9, 24, 17, 24]
    refs = [hf_greedy(hf_model, p, m, eos=None) for p, m in zip(prompts, max_tokens)]
    llm = LLM(d, skip_tokenizer_init=True, **engine_kwargs)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for out, ref in zip(outs, refs):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
    kv = llm.engine.kv
    assert kv.num_free_blocks == llm.engine.num_kv_blocks  # every block free at the end
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    if engine_kwargs.get("enable_prefix_caching") and "max_num_seqs" in engine_kwargs:
        # Later requests reuse the shared prefix's first full blocks.
        assert sum(o.metrics["num_cached_prompt_tokens"] for o in outs) > 0


def test_requests_added_while_running(tiny_model_dirs):
    """A request added between steps joins the running batch and still equals its solo output."""
    d = tiny_model_dirs["llama-gqa3-tied"]
    llm = LLM(d, skip_tokenizer_init=True, block_size=4)
    prompts = _tiny_prompts(128, [3, 8, 15])
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    solo = [llm.generate({"prompt_token_ids": p}, sp)[0].outputs[0].token_ids for p in prompts]
    eng = llm.engine
    reqs = [eng.add_request("a", prompts[0], sp)]
    for _ in range(3):
        eng.step()
    reqs.append(eng.add_request("b", prompts[1], sp))
    eng.step()
    reqs.append(eng.add_request("c", prompts[2], sp))
    while eng.has_unfinished_requests():
        eng.step()
    assert [r.output_token_ids for r in reqs] == solo


def test_eos_and_stop_tokens(tiny_model_dirs):
    d = tiny_model_dirs["llama-mha-untied"]
    llm = LLM(d, skip_tokenizer_init=True)
    prompt = {"prompt_token_ids": _tiny_prompts(128, [5])[0]}
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop_at = full.token_ids[6]
    first = full.token_ids.index(stop_at)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].token_ids == full.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_stream_chunks_concatenate_to_output(tiny_model_dirs):
    d = tiny_model_dirs["llama-mha-untied"]
    llm = LLM(d, skip_tokenizer_init=True)
    prompts = [{"prompt_token_ids": p} for p in _tiny_prompts(128, [2, 13])]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    got: dict[str, list[int]] = {}
    finished = set()
    for chunk in llm.stream(prompts, sp):
        got.setdefault(chunk.request_id, []).extend(chunk.outputs[0].new_token_ids)
        if chunk.finished:
            finished.add(chunk.request_id)
    assert list(got.values()) == expected
    assert len(finished) == 2


def test_seeded_sampling_independent_of_batch(tiny_model_dirs):
    d = tiny_model_dirs["qwen2-mqa-tied"]
    llm = LLM(d, skip_tokenizer_init=True, seed=123)
    prompts = [{"prompt_token_ids": p} for p in _tiny_prompts(128, [4, 9, 2])]
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=15, ignore_eos=True)
    alone = llm.generate(prompts[0], seeded)[0].outputs[0].token_ids
    mixed = llm.generate(
        prompts,
        [
            seeded,
            SamplingParams(temperature=0.8, max_tokens=15),
            SamplingParams(temperature=0, max_tokens=15),
        ],
    )
    assert mixed[0].outputs[0].token_ids == alone
    other_seed = llm.generate(
        prompts[0], SamplingParams(temperature=1.0, seed=43, max_tokens=15, ignore_eos=True)
    )
    assert other_seed[0].outputs[0].token_ids != alone


@pytest.mark.real_model
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=True, num_kv_blocks=16, max_num_batched_tokens=64),
    ],
    ids=["batch", "prefix-caching", "preemption"],
)
def test_smollm2_greedy_parity(smollm2_dir, smol_reference, engine_kwargs):
    prompts, refs = smol_reference
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths
    llm = LLM(smollm2_dir, dtype="float32", **engine_kwargs)
    if engine_kwargs["enable_prefix_caching"]:
        # Warm the prefix cache with the shortest prompt; the batch then shares its system prompt.
        warm = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=64))
        assert warm[0].outputs[0].token_ids == refs[0]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=64)
    )
    for out, ref in zip(outs, refs):
        assert out.outputs[0].token_ids == ref
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    if engine_kwargs.get("num_kv_blocks"):
        assert llm.engine.scheduler.num_preemptions > 0
    elif engine_kwargs["enable_prefix_caching"]:
        # The shared system prompt is served from the prefix cache for every request of the batch.
        assert all(o.metrics["num_cached_prompt_tokens"] >= 16 for o in outs)


def test_stream_abort_gives_a_final_chunk_and_abandoned_streams_free_their_requests(tiny_model_dirs):
    d = tiny_model_dirs["llama-mha-untied"]
    llm = LLM(d, skip_tokenizer_init=True, block_size=4)
    prompts = [{"prompt_token_ids": p} for p in _tiny_prompts(128, [2, 13, 6])]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    chunks = []
    for chunk in llm.stream(prompts, sp):
        chunks.append(chunk)
        if len(chunks) == 3:
            llm.engine.abort_request(chunks[0].request_id)
    by_id: dict[str, list] = {}
    for c in chunks:
        by_id.setdefault(c.request_id, []).append(c)
    aborted = by_id[chunks[0].request_id][-1]
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    others = [v[-1] for k, v in by_id.items() if k != chunks[0].request_id]
    assert [o.outputs[0].token_ids for o in others] == expected[1:]  # neighbours unchanged
    # Abandoning a stream aborts its requests: nothing is left running and every block is free.
    it = llm.stream(prompts, sp)
    next(it)
    it.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_a_paused_stream_loses_nothing_when_other_calls_step_the_engine(tiny_model_dirs):
    d = tiny_model_dirs["llama-mha-untied"]
    llm = LLM(d, skip_tokenizer_init=True)
    p, q = [{"prompt_token_ids": x} for x in _tiny_prompts(128, [5, 9])]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = llm.generate(p, sp)[0].outputs[0].token_ids
    stream = llm.stream(p, sp)
    chunks = [next(stream)]
    llm.generate(q, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))  # finishes p as well
    chunks.extend(stream)
    assert [t for c in chunks for t in c.outputs[0].new_token_ids] == expected
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    # Two interleaved streams: each sees all of its tokens and its final chunk.
    a, b = llm.stream(p, sp), llm.stream(q, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    got: dict[str, list] = {"a": [], "b": []}
    for name, it in itertools.islice(itertools.cycle([("a", a), ("b", b)]), 100):  # bounded
        chunk = next(it, None)
        if chunk is not None:
            got[name].append(chunk)
        if got["a"] and got["a"][-1].finished and got["b"] and got["b"][-1].finished:
            break
    assert [t for c in got["a"] for t in c.outputs[0].new_token_ids] == expected
    assert sum(len(c.outputs[0].new_token_ids) for c in got["b"]) == 4
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
