"""The sampler stack through ``LLM.generate``: logprobs (with and without speculation), ``n``, stop
strings, ``min_tokens``, and penalties in greedy decoding equal to transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sampling.params import SamplingParams
from specdec import LLM
from tests.hf_reference import hf_processors

PROMPT = [5, 17, 33, 48, 9, 70, 5, 17, 33]


def hf_logprobs(model, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """``[len(output), V]`` log-probabilities of the processed distribution, by transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    rows = []
    for i in range(len(output)):
        ids = torch.tensor([prompt + output[:i]])
        procs = hf_processors(params, len(prompt))
        rows.append(torch.log_softmax(procs(ids, logits[i : i + 1].clone()), dim=-1)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("speculative", [False, True])
def test_logprobs_equal_log_softmax_of_the_processed_distribution(tiny_model_dirs, speculative):
    d = tiny_model_dirs["llama-mha-untied"]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    # The target as its own draft model: drafts are accepted (then the emitted tokens are accepted
    # drafts and bonus tokens), and rejected now and then through float rounding only.
    spec = {"method": "draft_model", "model": str(d), "num_speculative_tokens": 3} if speculative else None
    llm = LLM(d, skip_tokenizer_init=True, speculative_config=spec)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(
            temperature=0.8, top_k=20, top_p=0.9, max_tokens=12, logprobs=5, seed=3, ignore_eos=True
        ),
        SamplingParams(temperature=1.0, max_tokens=12, logprobs=0, seed=4, ignore_eos=True),
    ]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params)
    if speculative:
        assert llm.engine.spec_stats.num_accepted_tokens > 0  # some tokens came from accepted drafts
    for out, p in zip(outs, params):
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 12
        ref = hf_logprobs(hf, PROMPT, c.token_ids, p)
        total = 0.0
        for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            assert next(iter(lp)) == tok and len(lp) <= 1 + p.logprobs
            top = ref[i].topk(p.logprobs).indices.tolist() if p.logprobs else []
            assert set(top) <= set(lp)
            for t, v in lp.items():
                assert v.logprob == pytest.approx(float(ref[i, t]), abs=1e-4)
            total += lp[tok].logprob
        assert c.cumulative_logprob == pytest.approx(total)


def test_no_logprobs_unless_asked(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama-mha-untied"], skip_tokenizer_init=True)
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=3))
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_n_samples_per_prompt(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama-mha-untied"], skip_tokenizer_init=True)
    prompt = {"prompt_token_ids": PROMPT}
    seeded = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate(prompt, seeded)
    samples = [c.token_ids for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(s) for s in samples}) == 4  # independent samples differ
    (alone,) = llm.generate(prompt, SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True))
    assert alone.outputs[0].token_ids == samples[0]  # sample 0 keeps the seed
    (again,) = llm.generate([prompt], [seeded])
    assert [c.token_ids for c in again.outputs] == samples  # derived seeds are reproducible
    (greedy,) = llm.generate(prompt, SamplingParams(temperature=0, n=3, max_tokens=8, ignore_eos=True))
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_min_tokens_defers_eos_and_stop_tokens(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama-mha-untied"], skip_tokenizer_init=True)
    prompt = {"prompt_token_ids": PROMPT}
    (free,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    first = free.outputs[0].token_ids[2]  # make the third greedy token a stop token
    sp = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first])
    (stopped,) = llm.generate(prompt, sp)
    assert stopped.outputs[0].token_ids == free.outputs[0].token_ids[:3]
    assert stopped.outputs[0].stop_reason == first
    sp = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first], min_tokens=6)
    (deferred,) = llm.generate(prompt, sp)
    toks = deferred.outputs[0].token_ids
    assert len(toks) >= 6 and first not in toks[:6]


@pytest.mark.real_model
def test_stop_strings_cut_the_text_and_end_at_the_completing_token(smollm2_dir):
    llm = LLM(smollm2_dir)
    msgs = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    (full,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40))
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    assert stop.strip() and text.find(stop) == len(text) // 2
    (out,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40, stop=[stop, "never appears 123"]))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: len(text) // 2]
    n = len(c.token_ids)
    assert c.token_ids == full.outputs[0].token_ids[:n]
    decoded = llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert stop in decoded and stop not in llm.tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
    # Speculation applies stop strings token by token inside an accepted run: the same output.
    spec = LLM(smollm2_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    (sout,) = spec.chat(msgs, SamplingParams(temperature=0, max_tokens=40, stop=stop))
    assert sout.outputs[0].token_ids == c.token_ids and sout.outputs[0].text == c.text


@pytest.mark.real_model
def test_greedy_with_repetition_penalty_equals_transformers(smollm2_dir):
    from specdec.llm import chat_token_ids

    llm = LLM(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = chat_token_ids(llm.tokenizer, [{"role": "user", "content": "List the days of the week."}])
    (out,) = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.3)
    )
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
            repetition_penalty=1.3,
            eos_token_id=llm.tokenizer.eos_token_id,
        )[0, len(ids) :].tolist()
    assert out.outputs[0].token_ids == ref
    (plain,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=32))
    assert plain.outputs[0].token_ids != ref  # the penalty changed the output


def test_numpy_scalars_are_accepted_as_their_python_values():
    import numpy as np

    from sampling import BeamSearchParams

    p = SamplingParams(
        top_k=np.int64(5), max_tokens=np.int32(8), temperature=np.float32(0.5), seed=np.int64(3)
    )
    assert (p.top_k, p.max_tokens, p.temperature, p.seed) == (5, 8, 0.5, 3)
    assert type(p.top_k) is int and type(p.temperature) is float
    assert BeamSearchParams(beam_width=np.int64(2), max_tokens=np.int64(4)).beam_width == 2
    with pytest.raises(ValueError, match="top_k must be an integer"):
        SamplingParams(top_k=np.float64(2.0))
