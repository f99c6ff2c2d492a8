"""Beam search on the paged KV cache.

1. SmolLM2 (fp32): our beams equal transformers' ``generate(num_beams=...)`` token for token, scores within
   1e-4, over beam widths, length penalties, early-stopping modes and ``num_return_sequences``, with beams
   that end in EOS early; prompts batched together equal each prompt alone.
2. A scripted model whose logits are a fixed function of the token prefix, which it reads back from its
   "KV cache" through the block tables: every forward sees exactly the beams an independent reference
   beam search expects (so each new beam continues the right parent's KV); an exhaustive beam equals the
   brute-force ranking of all sequences; a fork copies at most the last partial block; the blocks held
   always equal what the live beams' block tables need, and all are free at the end.
3. Invalid parameters and prompts raise ``ValueError`` subclasses before any work.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from torch import nn

from sampling import BeamSearchParams
from sampling.params import SamplingParams
from specdec.beam_search import beam_search, blocks_needed
from specdec.config import CacheConfig, SchedulerConfig
from specdec.engine import LLMEngine
from specdec.errors import InvalidRequestError, KVCacheExhaustedError
from specdec.kv_cache.manager import cdiv
from specdec.models.config import ModelArchConfig

# ---------------------------------------------------------------------------------------------------------
# 1. SmolLM2 against transformers

SYSTEM = "You are a concise, helpful assistant. Answer accurately and do not invent facts."
QUESTIONS = [  # short answers end in EOS well before max_tokens; the others run to the limit
    "What is the capital of France? Answer with one word.",
    "What is 2 + 2? Reply with just the number.",
    "Name a primary color.",
    "Explain in two sentences why the sky is blue.",
    "Translate 'good morning, how are you?' into French and Spanish, then explain the grammar of each "
    "translation in detail for a beginner.",
]
MAX_TOKENS = 12
# (beam_width, length_penalty, early_stopping, num_return_sequences): every listed setting at least once.
HF_GRID = [
    (2, 1.0, False, 1),
    (4, 0.5, True, 2),
    (4, 2.0, "never", 4),
    (2, 0.5, "never", 2),
    (4, 1.0, False, 3),
]


@pytest.fixture(scope="module")
def smol(smollm2_dir, fast_cpu_settings):
    """transformers' SmolLM2 (fp32), our LLM on the same weights, and the chat prompts. One intra-op
    thread (``fast_cpu_settings``): small batches gain little from a second one, and a single thread
    keeps the runtime stable when other processes share the two cores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec import LLM
    from specdec.llm import chat_token_ids

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [
        chat_token_ids(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    # A pool too small for every prompt's 4 beams at once (so prompts run in groups) and a token budget
    # that chunks the prefill.
    llm = LLM(smollm2_dir, dtype="float32", num_kv_blocks=32, max_num_batched_tokens=64)
    return tok, hf_model, llm, prompts


def hf_beam_search(hf_model, prompt, width, length_penalty, early_stopping, num_return, eos):
    """transformers' beam search of one prompt: (generated tokens without padding, sequences_scores)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            num_return_sequences=num_return,
            return_dict_in_generate=True,
            output_scores=True,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()  # generated tokens per sequence, before padding
    seqs = [out.sequences[i, len(prompt) : len(prompt) + n].tolist() for i, n in enumerate(lengths)]
    return seqs, out.sequences_scores.tolist()


@pytest.mark.real_model
@pytest.mark.parametrize(("width", "length_penalty", "early_stopping", "num_return"), HF_GRID)
def test_smollm2_equals_transformers(smol, width, length_penalty, early_stopping, num_return):
    tok, hf_model, llm, prompts = smol
    eos = tok.eos_token_id
    assert llm.engine.model_cfg.eos_token_ids == (eos,)  # one EOS, as in transformers' run
    params = BeamSearchParams(width, MAX_TOKENS, length_penalty, early_stopping, num_return)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    early_eos = 0
    for prompt, out in zip(prompts, outs):
        ref_seqs, ref_scores = hf_beam_search(
            hf_model, prompt, width, length_penalty, early_stopping, num_return, eos
        )
        assert out.prompt_token_ids == prompt
        assert [s.token_ids for s in out.sequences] == ref_seqs
        assert [s.score for s in out.sequences] == pytest.approx(ref_scores, abs=1e-4)
        for seq in out.sequences:
            n = len(seq.token_ids)
            assert seq.finish_reason == ("stop" if seq.token_ids[-1] == eos else "length")
            assert seq.finish_reason == "stop" or n == MAX_TOKENS
            assert seq.score == pytest.approx(seq.cum_logprob / n**length_penalty, rel=1e-6)
            assert seq.text == tok.decode(seq.token_ids, skip_special_tokens=True)
            early_eos += seq.finish_reason == "stop" and n < MAX_TOKENS
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
    assert early_eos > 0  # transformers, too, finished beams by EOS before max_tokens


@pytest.mark.real_model
def test_smollm2_batched_equals_alone(smol):
    _, _, llm, prompts = smol
    params = BeamSearchParams(3, 8, length_penalty=1.0, early_stopping=False, num_return_sequences=3)
    together = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, together):
        (alone,) = llm.beam_search({"prompt_token_ids": prompt}, params)
        assert [s.token_ids for s in alone.sequences] == [s.token_ids for s in out.sequences]
        assert [s.score for s in alone.sequences] == pytest.approx([s.score for s in out.sequences], abs=1e-5)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


# ---------------------------------------------------------------------------------------------------------
# 2. A scripted model: logits are a function of the prefix read back through the block tables

EOS = 0


def scripted_logits(prefix: list[int], vocab: int) -> torch.Tensor:
    """``[vocab]`` float32 logits, a fixed pseudo-random function of the prefix; EOS grows likelier with
    length so that beams end at various depths."""
    g = torch.Generator().manual_seed(zlib.crc32(np.asarray(prefix, dtype=np.int64).tobytes()))
    logits = torch.randn(vocab, generator=g) * 2.0
    logits[EOS] += 0.6 * (len(prefix) - 4)
    return logits


class ScriptedLM(nn.Module):
    """A ``DecoderLM`` stand-in. Its "K cache" stores ``token id + 1`` at each token's slot; each row's
    logits are :func:`scripted_logits` of the prefix it reads back through the row's block table. It
    records every forward's prefixes and, when ``check_blocks``, that the pool holds exactly the blocks
    of the forward's block tables, each referenced once per table holding it."""

    def __init__(self, vocab: int, max_len: int = 64) -> None:
        super().__init__()
        self.cfg = ModelArchConfig(
            model_type="llama",
            vocab_size=vocab,
            hidden_size=2,
            intermediate_size=2,
            num_layers=2,
            num_heads=1,
            num_kv_heads=1,
            head_dim=2,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            max_position_embeddings=max_len,
            inv_freq=(1.0,),
            rope_attention_scaling=1.0,
            bos_token_id=None,
            eos_token_ids=(EOS,),
        )
        self.anchor = nn.Parameter(torch.zeros(1))  # the runner reads device and dtype from a parameter
        self.forwards: list[list[list[int]]] = []
        self.query_lens: list[list[int]] = []
        self.engine: LLMEngine | None = None
        self.check_blocks = False

    def forward(self, input_ids, positions, kv_caches, metadata, attention, logits_indices=None):
        k_cache = kv_caches[-1][0]  # the last layer's: copy_blocks must copy every layer
        bs = k_cache.shape[1]
        flat = k_cache.view(-1, k_cache.shape[-1])
        flat[metadata.slot_mapping, 0] = input_ids.float() + 1
        self.query_lens.append(list(metadata.query_lens))
        prefixes: list[list[int]] = []
        for b, (qlen, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens_host)):
            table = metadata.block_table[b].tolist()
            stored = [int(flat[table[p // bs] * bs + p % bs, 0]) - 1 for p in range(seq_len)]
            assert min(stored) >= 0, "a prefix token's KV is missing from the block table"
            prefixes.extend(stored[: seq_len - qlen + i + 1] for i in range(qlen))
        rows = range(len(prefixes)) if logits_indices is None else logits_indices.tolist()
        self.forwards.append([prefixes[r] for r in rows])
        if self.check_blocks:
            self._check_blocks(metadata, bs)
        logits = torch.stack([scripted_logits(prefixes[r], self.cfg.vocab_size) for r in rows])
        return logits, logits

    def _check_blocks(self, metadata, bs: int) -> None:
        assert self.engine is not None
        pool = self.engine.kv.pool
        refs: dict[int, int] = {}
        for b, seq_len in enumerate(metadata.seq_lens_host):
            for block in metadata.block_table[b, : cdiv(seq_len, bs)].tolist():
                refs[block] = refs.get(block, 0) + 1
        assert pool.num_blocks - pool.num_free_blocks == len(refs)
        assert all(pool.blocks[block].ref_count == n for block, n in refs.items())


def scripted_engine(vocab: int, block_size: int, num_kv_blocks: int = 256, budget: int = 256) -> LLMEngine:
    model = ScriptedLM(vocab)
    engine = LLMEngine(
        "scripted",
        torch.float32,
        torch.device("cpu"),
        CacheConfig(block_size, num_kv_blocks, enable_prefix_caching=False),
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64),
        model=model,  # type: ignore[arg-type]
    )
    model.engine = engine
    return engine


def reference_beam_search(prompt, params, vocab, trace):
    """transformers' beam search semantics written out plainly over :func:`scripted_logits` (no KV).

    Appends to ``trace`` the sequences whose next-token logits each step needs (prompt + generated).
    Returns the best ``num_return_sequences`` (tokens, score, cum_logprob).
    """
    width, lp = params.beam_width, params.length_penalty
    eos = set() if params.ignore_eos else {EOS}
    keep = max(2, 1 + len(eos)) * width
    running: list[tuple[list[int], np.float32]] = [([], np.float32(0.0))]
    finished: list[tuple[list[int], float, float]] = []
    improvable = True
    for length in range(1, params.max_tokens + 1):
        trace.append([prompt + toks for toks, _ in running])
        cands: list[tuple[np.float32, int, list[int]]] = []
        for b, (toks, cum) in enumerate(running):
            logp = torch.log_softmax(scripted_logits(prompt + toks, vocab), dim=-1).numpy()
            cands.extend((np.float32(logp[v] + cum), b * vocab + v, toks + [v]) for v in range(vocab))
        cands.sort(key=lambda c: (-c[0], c[1]))
        cands = cands[:keep]
        hit = [length == params.max_tokens or c[2][-1] in eos for c in cands]
        full = len(finished) == width
        if improvable and not (full and params.early_stopping is True):
            for (cum, _, toks), h in zip(cands[:width], hit):
                if h:
                    score = (torch.tensor([cum], dtype=torch.float32) / (length**lp)).item()
                    finished.append((toks, score, float(cum)))
            finished.sort(key=lambda f: -f[1])
            del finished[width:]
        running = [(toks, cum) for (cum, _, toks), h in zip(cands, hit) if not h][:width]
        if running and len(finished) == width and improvable:
            best_len = params.max_tokens if params.early_stopping == "never" and lp > 0 else length
            bound = (torch.tensor([running[0][1]], dtype=torch.float32) / (best_len**lp)).item()
            improvable = bound > finished[-1][1]
        if not running or not improvable or (len(finished) == width and params.early_stopping is True):
            break
    return finished[: params.num_return_sequences]


SCRIPTED_PROMPTS = [[3, 1], [5, 2, 7, 1, 4], [2, 2, 6], [7, 3, 5, 1, 1, 6, 2]]
SCRIPTED_GRID = [
    BeamSearchParams(2, 7, 1.0, False, 2),
    BeamSearchParams(3, 8, 0.5, True, 3),
    BeamSearchParams(3, 8, 2.0, "never", 2),
    BeamSearchParams(4, 6, -1.0, False, 4),
    BeamSearchParams(1, 6, 1.0, "never", 1),
    BeamSearchParams(3, 6, 1.0, False, 2, ignore_eos=True),
]


@pytest.mark.parametrize(
    "params", SCRIPTED_GRID, ids=lambda p: f"w{p.beam_width}-lp{p.length_penalty}-{p.early_stopping}"
)
@pytest.mark.parametrize("block_size", [2, 3])
def test_scripted_beams_continue_the_right_parents(params, block_size):
    vocab = 8
    engine = scripted_engine(vocab, block_size)
    model = engine.model
    assert isinstance(model, ScriptedLM)
    model.check_blocks = True
    forks: list[tuple[int, list[int], list[int], list[tuple[int, int]]]] = []
    fork = engine.kv.fork

    def recording_fork(parent, child):
        copies = fork(parent, child)
        forks.append((parent.num_computed_tokens, list(parent.block_ids), list(child.block_ids), copies))
        return copies

    engine.kv.fork = recording_fork  # type: ignore[method-assign]
    copied: list[tuple[int, int]] = []
    copy_blocks = engine.runner.copy_blocks

    def recording_copy(src, dst):
        copied.extend(zip(src, dst))
        copy_blocks(src, dst)

    engine.runner.copy_blocks = recording_copy  # type: ignore[method-assign]

    outs = beam_search(engine, SCRIPTED_PROMPTS, params)

    traces = []
    for prompt, out in zip(SCRIPTED_PROMPTS, outs):
        trace: list[list[list[int]]] = []
        expected = reference_beam_search(prompt, params, vocab, trace)
        traces.append(trace)
        assert [s.token_ids for s in out.sequences] == [e[0] for e in expected]
        assert [s.score for s in out.sequences] == pytest.approx([e[1] for e in expected], abs=1e-6)
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([e[2] for e in expected], abs=1e-6)
        assert len(out.sequences) == params.num_return_sequences
    # Every forward read, through the block tables, exactly the beams the reference extends at that step.
    expected_forwards = [
        [seq for trace in traces if step < len(trace) for seq in trace[step]]
        for step in range(max(len(t) for t in traces))
    ]
    assert model.forwards == expected_forwards
    # Forks share the full blocks and copy only the partly filled last one.
    assert bool(forks) == (params.beam_width > 1)
    for num_computed, parent_blocks, child_blocks, copies in forks:
        num_full, partial = divmod(num_computed, block_size)
        assert child_blocks[:num_full] == parent_blocks[:num_full]
        assert len(child_blocks) == cdiv(num_computed, block_size)
        assert copies == ([(parent_blocks[num_full], child_blocks[-1])] if partial else [])
    assert copied == [c for *_, copies in forks for c in copies]
    if params.beam_width > 1:
        assert any(c for *_, c in forks) and any(not c for *_, c in forks)  # both cases exercised
    assert engine.kv.num_free_blocks == engine.num_kv_blocks
    engine.kv.pool.check_invariants()


def all_complete_sequences(prompt, vocab, max_tokens):
    """Brute force: every sequence that beam search could return, with its float32 cumulative logprob."""
    complete: list[tuple[list[int], np.float32]] = []
    live: list[tuple[list[int], np.float32]] = [([], np.float32(0.0))]
    for length in range(1, max_tokens + 1):
        grown: list[tuple[list[int], np.float32]] = []
        for toks, cum in live:
            logp = torch.log_softmax(scripted_logits(prompt + toks, vocab), dim=-1).numpy()
            for v in range(vocab):
                item = (toks + [v], np.float32(logp[v] + cum))
                (complete if v == EOS or length == max_tokens else grown).append(item)
        live = grown
    return complete


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0, -0.5])
def test_exhaustive_beam_equals_brute_force(length_penalty):
    """A beam wide enough to hold every live sequence, stopped only when no running beam can win at any
    length (``early_stopping="never"``), returns the best sequences of the brute-force ranking."""
    vocab, max_tokens = 3, 3
    width = (vocab - 1) ** (max_tokens - 1) * vocab  # every candidate of the widest step ranks < width
    params = BeamSearchParams(width, max_tokens, length_penalty, "never", num_return_sequences=6)
    engine = scripted_engine(vocab, block_size=2)
    prompt = [1, 2, 1]
    (out,) = beam_search(engine, [prompt], params)
    ranked = sorted(
        (
            (toks, float(cum) / len(toks) ** length_penalty)
            for toks, cum in all_complete_sequences(prompt, vocab, max_tokens)
        ),
        key=lambda x: -x[1],
    )
    assert len(ranked) == 1 + 2 + 4 * 3
    assert [s.token_ids for s in out.sequences] == [toks for toks, _ in ranked[:6]]
    assert [s.score for s in out.sequences] == pytest.approx([score for _, score in ranked[:6]], abs=1e-5)
    assert engine.kv.num_free_blocks == engine.num_kv_blocks


def test_groups_and_chunked_prefill_give_the_same_beams():
    """A pool that holds at most two prompts' beams at once and a 6-token budget (chunked prefill, two
    prompts of 3 beams per forward) give the same result as a roomy engine."""
    params = BeamSearchParams(3, 7, 1.0, False, 3)
    roomy = beam_search(scripted_engine(8, 3), SCRIPTED_PROMPTS, params)
    needs = [blocks_needed(len(p), 7, 3, 3) for p in SCRIPTED_PROMPTS]
    assert needs == [9, 10, 7, 11]  # groups of 20 blocks: prompts [0, 1], then [2, 3]
    tight = scripted_engine(8, 3, num_kv_blocks=20, budget=6)
    model = tight.model
    assert isinstance(model, ScriptedLM)
    assert beam_search(tight, SCRIPTED_PROMPTS, params) == roomy
    assert max(len(rows) for rows in model.forwards) == 6  # two prompts' beams together, never more
    assert max(sum(q) for q in model.query_lens) <= 6
    assert model.query_lens[:2] == [[2, 4], [1]]  # the second prompt's prefill is chunked
    assert tight.kv.num_free_blocks == tight.num_kv_blocks


def test_blocks_needed_bounds_the_blocks_held():
    """The capacity check's bound holds: the pool's peak use never exceeds :func:`blocks_needed`."""
    params = BeamSearchParams(4, 9, 1.0, "never", 1, ignore_eos=True)
    prompt = [1, 2, 3, 4, 5]
    engine = scripted_engine(8, block_size=2)
    peak = 0
    pool = engine.kv.pool
    allocate = pool.allocate

    def tracking_allocate(n):
        nonlocal peak
        ids = allocate(n)
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
        return ids

    pool.allocate = tracking_allocate  # type: ignore[method-assign]
    beam_search(engine, [prompt], params)
    need = blocks_needed(len(prompt), 9, 4, 2)
    assert need == 2 + 4 * (cdiv(5 + 8, 2) - 2)
    assert cdiv(5 + 8, 2) < peak <= need


# ---------------------------------------------------------------------------------------------------------
# 3. Bad parameters and prompts


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=True, max_tokens=4), "beam_width"),
        (dict(beam_width=2.0, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=4, num_return_sequences=3), "num_return_sequences"),
        (dict(beam_width=2, max_tokens=4, num_return_sequences=0), "num_return_sequences"),
        (dict(beam_width=2, max_tokens=4, early_stopping="always"), "early_stopping"),
        (dict(beam_width=2, max_tokens=4, early_stopping=1), "early_stopping"),
        (dict(beam_width=2, max_tokens=4, length_penalty=math.inf), "length_penalty"),
        (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), "length_penalty"),
        (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_invalid_params_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        BeamSearchParams(**kwargs)
    assert isinstance(info.value, InvalidRequestError)


def test_params_invalidated_after_construction_are_rejected_before_any_work():
    engine = scripted_engine(8, 2)
    params = BeamSearchParams(2, 4)
    params.num_return_sequences = 5
    with pytest.raises(InvalidRequestError, match="num_return_sequences"):
        beam_search(engine, [[1, 2]], params)
    model = engine.model
    assert isinstance(model, ScriptedLM)
    assert model.forwards == []


@pytest.mark.parametrize(
    ("prompts", "error", "match"),
    [
        ([[1, 2], []], InvalidRequestError, "empty"),
        ([[1, 2], [1] * 64], InvalidRequestError, "max_model_len"),
        ([[1, 2], [1, 8]], InvalidRequestError, r"\[0, 8\)"),
        ([[1, 2], [1, -1]], InvalidRequestError, r"\[0, 8\)"),
        ([[1, 2], [1, True]], InvalidRequestError, "integers"),
        ([[1, 2], [1] * 40], KVCacheExhaustedError, "KV blocks"),
    ],
)
def test_bad_prompts_rejected_before_any_work(prompts, error, match):
    engine = scripted_engine(8, 2, num_kv_blocks=20)
    with pytest.raises(error, match=match):
        beam_search(engine, prompts, BeamSearchParams(3, 8))
    model = engine.model
    assert isinstance(model, ScriptedLM)
    assert model.forwards == []
    assert engine.kv.num_free_blocks == engine.num_kv_blocks


def test_busy_engine_is_rejected():
    engine = scripted_engine(8, 2)
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3))
    with pytest.raises(InvalidRequestError, match="unfinished requests"):
        beam_search(engine, [[1, 2]], BeamSearchParams(2, 4))
    engine.abort_request("r")
    (out,) = beam_search(engine, [[1, 2]], BeamSearchParams(2, 4))
    assert len(out.sequences) == 1


def test_max_model_len_caps_max_tokens():
    engine = scripted_engine(8, 3)  # max_model_len 64
    prompt = [1, 2] * 30
    params = BeamSearchParams(2, 10, num_return_sequences=2, ignore_eos=True)
    (out,) = beam_search(engine, [prompt], params)
    capped = BeamSearchParams(2, 64 - len(prompt), num_return_sequences=2, ignore_eos=True)
    expected = reference_beam_search(prompt, capped, 8, [])
    assert [s.token_ids for s in out.sequences] == [e[0] for e in expected]
    assert [len(s.token_ids) for s in out.sequences] == [4, 4]
    assert {s.finish_reason for s in out.sequences} == {"length"}


def test_one_beam_with_early_stopping_is_greedy():
    """With one beam and ``early_stopping=True`` the first finished hypothesis ends the search, so beam
    search equals the engine's own greedy decoding (a separate code path)."""
    engine = scripted_engine(8, 2)
    for i, prompt in enumerate(SCRIPTED_PROMPTS):
        req = engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=9))
        while engine.has_unfinished_requests():
            engine.step()
        (out,) = beam_search(engine, [prompt], BeamSearchParams(1, 9, early_stopping=True))
        assert out.sequences[0].token_ids == req.output_token_ids
        assert out.sequences[0].finish_reason == req.finish_reason
