"""Speculative decoding is exact under greedy decoding: output equals plain greedy token for token."""

from __future__ import annotations

import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from specdec.drafters.base import DrafterBase, DraftInput, DraftProposal
from specdec.kv_cache.manager import cdiv
from specdec.request import Request

VOCAB = 128
DRAFT_NOISE = 0.01  # acceptance rate about 0.4 at k = 3


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory):
    """A tiny target and a draft model: the target with noise added to its weights, so that its drafts
    are accepted about half of the time (both acceptances and rejections happen)."""
    from tests.conftest import make_tiny_hf_model

    root = tmp_path_factory.mktemp("spec_models")
    target = make_tiny_hf_model("llama", 6, 2, True, vocab_size=VOCAB, seed=0)
    target.save_pretrained(root / "target")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * DRAFT_NOISE)
    target.save_pretrained(root / "draft")
    return {"target": root / "target", "draft": root / "draft"}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths; repetitive so that prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        motif = torch.randint(3, VOCAB, (3 + i % 4,), generator=g).tolist()
        out.append((motif * 8)[: 2 + 5 * i])
    return out


def _run(model_dir, prompts, max_tokens, spec=None, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, skip_tokenizer_init=True, block_size=4, speculative_config=spec, **kwargs)
    if not isinstance(max_tokens, list):
        max_tokens = [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], llm


def _spec(method: str, k: int, dirs) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    return {"method": "draft_model", "model": str(dirs["draft"]), "num_speculative_tokens": k}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equality(spec_models, method, k):
    for batch in (1, 3, 8):
        prompts = _prompts(batch, seed=batch)
        max_tokens = [20 + 3 * i for i in range(batch)]
        base, _ = _run(spec_models["target"], prompts, max_tokens)
        got, llm = _run(spec_models["target"], prompts, max_tokens, _spec(method, k, spec_models))
        assert got == base
        stats = llm.engine.spec_stats
        assert stats.num_drafts > 0
        assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_everything_accepted_with_target_as_draft(spec_models):
    prompts = _prompts(3)
    base, _ = _run(spec_models["target"], prompts, 30)
    spec = {"method": "draft_model", "model": str(spec_models["target"]), "num_speculative_tokens": 4}
    got, llm = _run(spec_models["target"], prompts, 30, spec)
    assert got == base
    assert llm.engine.spec_stats.acceptance_rate == 1.0
    # Every full draft step emits k + 1 tokens.
    assert llm.engine.spec_stats.mean_acceptance_length > 4.0


class _WrongDrafter(DrafterBase):
    """Proposes tokens the target never emits greedily: everything is rejected."""

    def __init__(self, banned: set[int]) -> None:
        self.tokens = [t for t in range(VOCAB) if t not in banned]

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        return [DraftProposal(self.tokens[: x.max_drafts]) for x in batch]

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        pass


def test_everything_rejected(spec_models):
    prompts = _prompts(4)
    base, _ = _run(spec_models["target"], prompts, 25)
    llm = LLM(
        spec_models["target"],
        skip_tokenizer_init=True,
        block_size=4,
        speculative_config=_spec("ngram", 3, None),
    )
    llm.engine.drafter = _WrongDrafter({t for seq in base for t in seq})
    sp = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert [o.outputs[0].token_ids for o in outs] == base
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("k", [4])
def test_eos_at_every_offset_of_an_accepted_block(spec_models, k):
    """With every draft accepted, a step emits k + 1 tokens; EOS at any offset of that block, including
    the bonus position, ends generation there, and streaming never shows a token past it. A stop token
    id takes the same path."""
    prompt = _prompts(2)[1]
    base, _ = _run(spec_models["target"], [prompt], 24)
    spec = {"method": "draft_model", "model": str(spec_models["target"]), "num_speculative_tokens": k}
    llm = LLM(spec_models["target"], skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    for offset in range(2 * (k + 1)):
        eos = base[0][offset]
        first = base[0].index(eos)
        for use_stop_ids in (False, True):
            if use_stop_ids:
                object.__setattr__(llm.engine.model_cfg, "eos_token_ids", ())
                sp = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[eos])
            else:
                object.__setattr__(llm.engine.model_cfg, "eos_token_ids", (eos,))
                sp = SamplingParams(temperature=0, max_tokens=24)
            streamed: list[int] = []
            final = None
            for chunk in llm.stream({"prompt_token_ids": prompt}, sp):
                streamed.extend(chunk.outputs[0].new_token_ids)
                final = chunk
            assert streamed == base[0][: first + 1]
            assert final is not None and final.finished and final.outputs[0].finish_reason == "stop"
            assert final.outputs[0].token_ids == streamed
    assert llm.engine.spec_stats.acceptance_rate == 1.0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_near_greedy_temperature_with_draft_equal_to_target(spec_models):
    """Target and draft distributions are (nearly) one-hot on the same token at temperature 1e-4: no NaN,
    no zero-probability token, and the output equals greedy decoding."""
    prompts = _prompts(3, seed=4)
    base, _ = _run(spec_models["target"], prompts, 20)
    spec = {"method": "draft_model", "model": str(spec_models["target"]), "num_speculative_tokens": 3}
    llm = LLM(spec_models["target"], skip_tokenizer_init=True, block_size=4, speculative_config=spec, seed=3)
    sp = [SamplingParams(temperature=1e-4, seed=s, max_tokens=20, ignore_eos=True) for s in (None, 1, 2)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert [o.outputs[0].token_ids for o in outs] == base
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_draft_model_with_another_vocabulary_fails_at_construction(spec_models, tmp_path):
    from specdec.errors import InvalidRequestError
    from tests.conftest import make_tiny_hf_model

    make_tiny_hf_model("llama", 6, 2, True, vocab_size=VOCAB // 2).save_pretrained(tmp_path / "small_vocab")
    spec = {"method": "draft_model", "model": str(tmp_path / "small_vocab"), "num_speculative_tokens": 2}
    with pytest.raises(
        InvalidRequestError, match=r"vocabulary \(64 tokens\) differs from the target's \(128\)"
    ):
        LLM(spec_models["target"], skip_tokenizer_init=True, speculative_config=spec)


def test_max_tokens_inside_an_accepted_block(spec_models):
    prompt = _prompts(3)[2]
    base, _ = _run(spec_models["target"], [prompt], 16)
    spec = {"method": "draft_model", "model": str(spec_models["target"]), "num_speculative_tokens": 5}
    llm = LLM(spec_models["target"], skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    for max_tokens in range(1, 16):
        out = llm.generate(
            {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=max_tokens)
        )[0]
        assert out.outputs[0].token_ids == base[0][:max_tokens]
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_prefix_caching_and_preemption_do_not_change_outputs(spec_models, method):
    shared = _prompts(1)[0] + list(range(10, 30))
    prompts = [shared + p for p in _prompts(4, seed=5)]
    base, _ = _run(spec_models["target"], prompts, 24, enable_prefix_caching=False)
    for k in (1, 3, 5):
        spec = _spec(method, k, spec_models)
        cached, llm = _run(spec_models["target"], prompts, 24, spec, enable_prefix_caching=True)
        assert cached == base
        # A pool just large enough for one request forces repeated preemption of the others.
        need = cdiv(max(len(p) for p in prompts) + 24 - 1 + k, 4)
        small, llm = _run(
            spec_models["target"], prompts, 24, spec, enable_prefix_caching=True, num_kv_blocks=need + 2
        )
        assert small == base
        preemptions = [r for r in llm.engine.scheduler.num_preemptions_by_request.values()]
        assert max(preemptions) >= 2
        assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def _gather_kv(kv_caches, block_ids: list[int], num_tokens: int, block_size: int) -> list[torch.Tensor]:
    slots = torch.tensor(
        [block_ids[p // block_size] * block_size + p % block_size for p in range(num_tokens)]
    )
    out = []
    for k_cache, v_cache in kv_caches:
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        out.append(torch.stack([flat_k[slots], flat_v[slots]]))
    return out


def test_kv_after_rejections_equals_a_run_that_never_drafted(spec_models):
    """Mid-generation, target and draft KV of every committed token equal a plain prefill's, and each
    request's block table covers exactly its committed tokens (lookahead slots released)."""
    prompts = _prompts(3, seed=11)
    spec = _spec("draft_model", 3, spec_models)
    llm = LLM(spec_models["target"], skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reqs = [eng.add_request(str(i), p, sp) for i, p in enumerate(prompts)]
    for _ in range(6):
        eng.step()
        for r in reqs:
            assert len(r.block_ids) == cdiv(r.num_computed_tokens, 4)
    assert eng.spec_stats.num_draft_tokens > eng.spec_stats.num_accepted_tokens > 0  # rejections happened
    plain = LLM(spec_models["target"], skip_tokenizer_init=True, block_size=4)
    plain_draft = LLM(spec_models["draft"], skip_tokenizer_init=True, block_size=4)
    for r in reqs:
        for ref_llm, caches, n in (
            (plain, eng.runner.kv_caches, r.num_computed_tokens),
            (plain_draft, eng.drafter.runner.kv_caches, eng.drafter.states.get(r).num_computed),
        ):
            ref_eng = ref_llm.engine
            ref = ref_eng.add_request(
                "ref", r.token_ids[:n] + [0], SamplingParams(temperature=0, max_tokens=1)
            )
            ref_eng.scheduler.schedule = _prefill_only(ref_eng.scheduler.schedule, ref, n)
            ref_eng.step()
            want = _gather_kv(ref_eng.runner.kv_caches, ref.block_ids, n, 4)
            got = _gather_kv(caches, r.block_ids, n, 4)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            ref_eng.abort_request("ref")


def _prefill_only(schedule, req, n):
    """Wrap ``schedule`` so the reference request computes exactly its first ``n`` tokens."""

    def wrapped():
        out = schedule()
        for s in out.scheduled:
            if s.request is req:
                s.num_new_tokens, s.sample = n, False
        return out

    return wrapped


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_request_same_alone_and_in_batches(spec_models, method):
    spec = _spec(method, 3, spec_models)
    prompts = _prompts(4, seed=3)
    seeded = SamplingParams(temperature=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    llm = LLM(spec_models["target"], skip_tokenizer_init=True, block_size=4, speculative_config=spec, seed=7)
    alone = llm.generate({"prompt_token_ids": prompts[0]}, seeded)[0].outputs[0].token_ids
    neighbours = [
        SamplingParams(temperature=1.0, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=20),
        SamplingParams(temperature=1.3, seed=99, max_tokens=20),
    ]
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], [seeded, *neighbours])
    assert batched[0].outputs[0].token_ids == alone
    reordered = llm.generate([{"prompt_token_ids": p} for p in prompts[::-1]], [*neighbours[::-1], seeded])
    assert reordered[-1].outputs[0].token_ids == alone


@pytest.mark.real_model
def test_smollm2_ngram_greedy_equality(smollm2_dir, smol_reference):
    prompts, refs = smol_reference
    for k in (1, 3, 5):
        llm = LLM(
            smollm2_dir, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": k}
        )
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=64)
        )
        assert [o.outputs[0].token_ids for o in outs] == refs
        assert llm.engine.spec_stats.num_accepted_tokens > 0
