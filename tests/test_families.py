"""Every supported family against transformers: tiny random checkpoints of Qwen3, Mistral, Gemma 2,
Gemma 3 (text), Phi-3 and Llama 3.x (``rope_type: llama3``) built and saved in-process.

Proven per family, in float32:

- logits within 1e-4 of transformers in one-shot prefill (a flattened batch of four prompts), chunked
  prefill (chunks of 5, and a 35-token chunk over context, the prefill path), paged decode across block
  boundaries (batched, then a lone decode row), with sliding windows shorter than the prompts;
- the engine's greedy output equals transformers' ``generate``, batched with chunked prefill under
  preemption, and queued with prefix-cache hits;
- n-gram and draft-model speculation give the same greedy tokens;
- where every layer is windowed (Mistral), blocks behind a request's window go back to the pool as it
  decodes (a bounded number held), with prefix caching, preemption and n-gram speculation still equal to
  transformers; the mixed Gemmas, and a draft model's KV, release nothing.

Gemma 2 also checks a token tree under a sliding window (each branch equals its own sequence).
"""

from __future__ import annotations

import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from specdec.attention.base import AttentionMetadata
from specdec.attention.reference import ReferenceAttention
from specdec.errors import CorruptModelError, UnknownModelError
from specdec.kv_cache.manager import RELEASED
from specdec.memory import estimate, weight_bytes
from specdec.models.config import SUPPORTED_MODEL_TYPES, ModelArchConfig
from specdec.models.loader import load_model
from tests.conftest import hf_greedy
from tests.test_model_parity import PagedRun, hf_logits

TOL = 1e-4
VOCAB = 160

# name: (family, heads, kv_heads, tie, extra config fields). Windows (5-7) are shorter than the prompts.
FAMILIES = {
    "qwen3-gqa2-untied-hd32": ("qwen3", 4, 2, False, dict(head_dim=32)),
    "mistral-mqa-tied-window6": ("mistral", 4, 1, True, dict(sliding_window=6)),
    "gemma2-gqa2-tied-window5": (
        "gemma2",
        4,
        2,
        True,
        dict(
            sliding_window=5,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3-mqa-untied-window7": (
        "gemma3_text",
        4,
        1,
        False,
        dict(
            sliding_window=7,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
    "phi3-mha-untied": ("phi3", 4, 4, False, dict()),
    "llama3-rope-gqa2-untied": (
        "llama",
        4,
        2,
        False,
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500_000.0,
            }
        ),
    ),
}


def make_family_model(name: str, seed: int = 0, vocab_size: int = VOCAB):
    """A randomly initialised transformers model of ``FAMILIES[name]`` (float32, 2 layers, hidden 64)."""
    import transformers as tf

    family, heads, kv_heads, tie, extra = FAMILIES[name]
    config_cls, model_cls = {
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    }[family]
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family in ("gemma2", "gemma3_text", "mistral"):
        fields["head_dim"] = 16
    fields.update(extra)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields))
    # Larger-than-default init so the logits are far from uniform and attention matters; norms off 1
    # (Llama style) or off 0 (Gemma's (1 + w)), so a wrong norm formula shows.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            else:
                p.add_(torch.randn(p.shape) * 0.1)
    return model.float().eval()


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """name -> (target dir, draft dir: the target with noise, so drafts are sometimes rejected)."""
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    g = torch.Generator().manual_seed(1)
    for name in FAMILIES:
        model = make_family_model(name)
        model.save_pretrained(root / name / "target")
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.add_(torch.randn(p.shape, generator=g) * 0.02)
        model.save_pretrained(root / name / "draft")
        dirs[name] = (root / name / "target", root / name / "draft")
    return dirs


def _hf(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def _prompts(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_configs_read_as_intended(family_dirs):
    """The fixtures exercise what they claim: windows per layer, Gemma 3's local RoPE, soft-caps, q/k
    norms, explicit head_dim, llama3 RoPE scaling."""
    cfg = {n: ModelArchConfig.from_pretrained(d) for n, (d, _) in family_dirs.items()}
    q3 = cfg["qwen3-gqa2-untied-hd32"]
    assert q3.qk_norm and q3.head_dim == 32 and q3.layer_window(0) is None and not q3.qkv_bias
    assert [cfg["mistral-mqa-tied-window6"].layer_window(i) for i in (0, 1)] == [6, 6]
    g2 = cfg["gemma2-gqa2-tied-window5"]
    assert [g2.layer_window(i) for i in (0, 1)] == [5, None]
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.attention_scale) == (2.0, 3.0, 24**-0.5)
    assert g2.norm_style == "gemma" and g2.post_norms and g2.hidden_act == "gelu_pytorch_tanh"
    g3 = cfg["gemma3-mqa-untied-window7"]
    assert g3.qk_norm and g3.uses_local_rope(0) and not g3.uses_local_rope(1)
    assert g3.local_inv_freq is not None and g3.local_inv_freq[1] != g3.inv_freq[1]
    assert g3.attn_logit_softcapping is None and g3.final_logit_softcapping is None
    assert cfg["phi3-mha-untied"].layer_window(0) is None
    assert cfg["llama3-rope-gqa2-untied"].inv_freq[-1] < 1.0 / 500_000 ** (30 / 32)  # scaled low frequencies


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_parity(family_dirs, name):
    d = family_dirs[name][0]
    hf_model = _hf(d)
    ours = load_model(d, dtype=torch.float32)
    prompts = _prompts([1, 7, 23, 40])
    refs = [hf_logits(hf_model, p) for p in prompts]

    # 1. One-shot prefill of all prompts in one flattened batch (the 40-token one through the prefill path).
    run = PagedRun(ours, 4)
    for out, ref in zip(run.forward({run.add_seq(): p for p in prompts}), refs):
        assert (out - ref).abs().max().item() <= TOL

    # 2. Chunked prefill: chunks of 5 tokens, sequences advancing together (the short-query path).
    run = PagedRun(ours, 4)
    ids = [run.add_seq() for _ in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for offset in range(0, 40, 5):
        chunk = {s: p[offset : offset + 5] for s, p in zip(ids, prompts) if offset < len(p)}
        for s, out in zip(chunk, run.forward(chunk)):
            got[s].append(out)
    for s, ref in zip(ids, refs):
        assert (torch.cat(got[s]) - ref).abs().max().item() <= TOL

    # 3. Paged decode, one token per step for every sequence (crossing block boundaries of 4), then one
    # sequence alone (the single-row path, which reads only the window's blocks).
    extra = _prompts([6] * len(prompts), seed=1)
    for step in range(5):
        outs = run.forward({s: [extra[s][step]] for s in ids})
        for s, out in zip(ids, outs):
            ref = hf_logits(hf_model, prompts[s] + extra[s][: step + 1])[-1]
            assert (out[-1] - ref).abs().max().item() <= TOL, (s, step)
    out = run.forward({ids[3]: [extra[3][5]]})[0]
    assert (out[-1] - hf_logits(hf_model, prompts[3] + extra[3])[-1]).abs().max().item() <= TOL

    # 4. A long chunk over context: 10 tokens, then 35 (the prefill path skipping blocks outside windows).
    long = _prompts([45], seed=2)[0]
    run = PagedRun(ours, 4)
    s = run.add_seq()
    first, rest = run.forward({s: long[:10]})[0], run.forward({s: long[10:]})[0]
    assert (torch.cat([first, rest]) - hf_logits(hf_model, long)).abs().max().item() <= TOL


def test_tree_under_sliding_window(family_dirs):
    """Gemma 2 (window 5 on layer 0, soft-capped scores): a token tree verified after a 13-token prompt
    gives each branch the logits it has as its own sequence (window positions from tree depths)."""
    model = load_model(family_dirs["gemma2-gqa2-tied-window5"][0], dtype=torch.float32)
    prompt = _prompts([13], seed=3)[0]
    # a -> b -> d, a -> c: positions 13, 14, 14, 15.
    a, b, c, d = 5, 17, 33, 40
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    run = PagedRun(model, 4)
    s = run.add_seq()
    run.forward({s: prompt})
    start = run.lens[s]
    while len(run.tables[s]) * 4 < start + 4:
        run.tables[s].append(run.free.pop())
    slots = torch.tensor([run.tables[s][p // 4] * 4 + p % 4 for p in range(start, start + 4)])
    meta = AttentionMetadata(
        torch.tensor([0, 4]), torch.tensor([start + 4]), slots, torch.tensor([run.tables[s]]), [4],
        [start + 4], [mask],
    )  # fmt: skip
    with torch.no_grad():
        tree, _ = model(
            torch.tensor([a, b, c, d]), torch.tensor([13, 14, 14, 15]), run.caches, meta, ReferenceAttention()
        )
    for branch, row in (([a, b, d], 3), ([a, c], 2), ([a, b], 1)):
        ref = PagedRun(model, 4)
        r = ref.add_seq()
        want = ref.forward({r: prompt + branch})[0][-1]
        assert (tree[row] - want).abs().max().item() <= TOL


def _engine_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, VOCAB, (9,), generator=g).tolist()  # a shared "system prompt"
    return [shared + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 4, 11, 20)]


MAX_TOKENS = [20, 9, 20, 14]


@pytest.fixture(scope="module")
def hf_refs(family_dirs):
    """transformers' greedy continuations of :func:`_engine_prompts`, per family."""
    out = {}
    for name, (d, _) in family_dirs.items():
        hf_model = _hf(d)
        out[name] = [hf_greedy(hf_model, p, m, eos=None) for p, m in zip(_engine_prompts(), MAX_TOKENS)]
    return out


def _generate(d, spec=None, **kwargs) -> tuple[list[list[int]], LLM, int]:
    """Greedy tokens, the engine, and the prompt tokens served from the prefix cache."""
    llm = LLM(d, skip_tokenizer_init=True, dtype="float32", speculative_config=spec, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in _engine_prompts()], params)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks  # every block free at the end
    cached = sum(o.metrics["num_cached_prompt_tokens"] for o in outs)
    return [o.outputs[0].token_ids for o in outs], llm, cached


@pytest.mark.parametrize("name", list(FAMILIES))
def test_engine_greedy_equals_transformers(family_dirs, hf_refs, name, fast_cpu_settings):
    d = family_dirs[name][0]
    # Only Mistral windows every layer: its blocks behind the window are released (the Gemmas' global
    # layers keep every block), so it needs a smaller pool to be preempted.
    releases = ModelArchConfig.from_pretrained(d).uniform_sliding_window is not None
    assert releases == (name == "mistral-mqa-tied-window6")
    # Batched, chunked prefill (16-token budget), preempted for lack of blocks.
    got, llm, _ = _generate(
        d,
        block_size=4,
        enable_prefix_caching=True,
        num_kv_blocks=12 if releases else 14,
        max_num_batched_tokens=16,
    )
    assert got == hf_refs[name]
    assert llm.engine.scheduler.num_preemptions > 0
    assert (llm.engine.kv.num_released_blocks > 0) == releases
    # Queued two at a time: later requests reuse the shared prefix's cached blocks.
    got, llm, cached = _generate(d, block_size=3, enable_prefix_caching=True, max_num_seqs=2)
    assert got == hf_refs[name]
    assert cached > 0
    assert (llm.engine.kv.num_released_blocks > 0) == releases


@pytest.mark.parametrize("name", list(FAMILIES))
def test_speculation_greedy_equals_transformers(family_dirs, hf_refs, name, fast_cpu_settings):
    target, draft = family_dirs[name]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    got, llm, _ = _generate(target, ngram, block_size=4)
    assert got == hf_refs[name]
    assert llm.engine.spec_stats.num_drafts > 0
    releases = name == "mistral-mqa-tied-window6"  # every layer windowed, a drafter without KV
    assert (llm.engine.kv.num_released_blocks > 0) == releases
    model = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    got, llm, _ = _generate(target, model, block_size=4)
    assert got == hf_refs[name]
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert llm.engine.kv.sliding_window is None  # the draft model's KV may lag behind the window
    assert llm.engine.kv.num_released_blocks == 0


WINDOWED = "mistral-mqa-tied-window6"  # window 6 on both layers


def _step_all(llm, checks=None) -> None:
    """Step the engine until every request ends, calling ``checks()`` after each step."""
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        llm.engine.kv.pool.check_invariants()
        if checks is not None:
            checks()


@pytest.mark.parametrize("ngram, backend", [(False, "auto"), (True, "auto"), (True, "reference")])
def test_window_bounds_the_kv_a_decoding_request_holds(family_dirs, ngram, backend, fast_cpu_settings):
    """Mistral with window 6, blocks of 4, prompts of 30 and 13 tokens (longer than the window): after
    each decode step a request holds at most ceil((6 + k) / 4) + 1 blocks (k = 3 n-gram draft slots, 0
    without), the blocks behind its window are back in the pool, the greedy output equals transformers'
    (batched, and with n-gram speculation) and every block is free at the end. ``reference``: the
    pure-torch backend, whose padded verification batch gathers released entries (as block 0, masked)."""
    d = family_dirs[WINDOWED][0]
    prompts = _prompts([30, 13], seed=3)
    prompts[0][20:30] = prompts[0][5:15]  # a repeat for the n-gram drafter to find
    max_tokens = [24, 18]
    hf_model = _hf(d)
    want = [hf_greedy(hf_model, p, m, eos=None) for p, m in zip(prompts, max_tokens)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3} if ngram else None
    llm = LLM(d, skip_tokenizer_init=True, dtype="float32", block_size=4, speculative_config=spec)
    if backend == "reference":
        llm.engine.runner.attention = ReferenceAttention()
    kv = llm.engine.kv
    assert kv.sliding_window == 6
    reqs = [
        llm.engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    bound = -(-(6 + (3 if ngram else 0)) // 4) + 1
    most = [0, 0]

    def checks():
        for i, r in enumerate(reqs):
            if not r.status.finished and r.num_output_tokens >= 2:  # its last step was a decode step
                live = kv.num_live_blocks(r)
                assert live <= bound, (r, live)
                most[i] = max(most[i], live)
                assert len(r.block_ids) == -(-r.num_computed_tokens // 4)  # indexing by position kept
        assert kv.num_free_blocks == llm.engine.num_kv_blocks - sum(
            kv.num_live_blocks(r) for r in reqs if not r.status.finished
        )

    _step_all(llm, checks)
    assert [r.output_token_ids for r in reqs] == want
    assert min(most) > 0 and kv.num_released_blocks >= (30 + 24 - 6) // 4 - 1
    assert kv.num_free_blocks == llm.engine.num_kv_blocks
    if ngram:
        assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_window_release_keeps_prefix_hits_valid(family_dirs, fast_cpu_settings):
    """A request decoding past its window releases its prompt's cached blocks; a second request with the
    same 20-token prefix arrives then, is served the prefix from the cache (the 3 blocks before its first
    query's window entered as released, the 2 others revived or shared), and both equal transformers.
    Prefix caching with a tiny pool (preemption) is covered by ``test_engine_greedy_equals_transformers``.
    """
    d = family_dirs[WINDOWED][0]
    shared, tails = _prompts([20], seed=4)[0], _prompts([3, 5], seed=5)
    prompts = [shared + tails[0], shared + tails[1]]
    hf_model = _hf(d)
    want = [hf_greedy(hf_model, p, 12, eos=None) for p in prompts]
    llm = LLM(d, skip_tokenizer_init=True, dtype="float32", block_size=4, enable_prefix_caching=True)
    kv, params = llm.engine.kv, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = llm.engine.add_request("a", prompts[0], params)
    while a.num_output_tokens < 4:
        llm.engine.step()
    assert a.num_released_blocks >= 4
    released_before = kv.num_released_blocks
    b = llm.engine.add_request("b", prompts[1], params)
    llm.engine.step()
    assert b.stats.num_cached_prompt_tokens == 20
    assert b.block_ids[:3] == [RELEASED] * 3 and b.num_released_blocks >= 3
    assert kv.num_released_blocks >= released_before + 3
    _step_all(llm)
    assert [a.output_token_ids, b.output_token_ids] == want
    assert kv.num_free_blocks == llm.engine.num_kv_blocks


def test_beam_search_under_window_release_equals_transformers(family_dirs, fast_cpu_settings):
    """Beam search on the windowed Mistral: beams forked from parents whose early blocks were released
    (the released entries stay released in the child) give transformers' best beam."""
    from sampling.beam_search import BeamSearchParams

    d = family_dirs[WINDOWED][0]
    prompts = _prompts([25, 14], seed=9)
    hf_model = _hf(d)
    llm = LLM(d, skip_tokenizer_init=True, dtype="float32", block_size=4)
    outs = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=16)
    )
    assert llm.engine.kv.num_released_blocks > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    llm.engine.kv.pool.check_invariants()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                num_beams=3,
                do_sample=False,
                max_new_tokens=16,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.sequences[0].token_ids == want


@pytest.mark.parametrize("name", list(FAMILIES))
def test_learned_heads_greedy_equal_transformers(family_dirs, hf_refs, name, fast_cpu_settings, tmp_path):
    """Random Medusa heads drafting chains and static token trees (trees under sliding windows on the
    Mistral and Gemma targets), random EAGLE heads (chains and EAGLE-2 trees) and random EAGLE-3 heads
    (chains over a reduced draft vocabulary, trees) on every family, windowed and soft-capped targets
    included: greedy output unchanged. The EAGLE heads attend globally without soft-capping
    (:func:`~specdec.drafters.heads.head_arch`) and keep KV of their own, so no block is released."""
    from specdec.drafters.eagle3_head import Eagle3Head
    from specdec.drafters.heads import HeadConfig, arch_fields, build_heads, head_arch, save_heads

    target = family_dirs[name][0]
    arch = ModelArchConfig.from_pretrained(target)
    torch.manual_seed(0)
    medusa_cfg = HeadConfig(
        method="medusa", target=str(target), hidden_size=64, vocab_size=VOCAB, num_heads=3
    )
    heads = build_heads(medusa_cfg)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    save_heads(heads, medusa_cfg, tmp_path / "medusa")
    tree = {"tree": "static", "tree_choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}
    for extra in ({}, tree):
        spec = {"method": "medusa", "model": str(tmp_path / "medusa"), "num_speculative_tokens": 3, **extra}
        got, llm, _ = _generate(target, spec, block_size=4)
        assert got == hf_refs[name]
        assert llm.engine.spec_stats.num_drafts > 0
        # Medusa keeps no KV: on Mistral blocks behind the window go back while trees are verified.
        assert (llm.engine.kv.num_released_blocks > 0) == (name == WINDOWED)

    fields = dict(target=str(target), hidden_size=64, vocab_size=VOCAB, arch=arch_fields(arch))
    eagle_cfg = HeadConfig(method="eagle", num_heads=1, **fields)
    eagle = build_heads(eagle_cfg)
    assert eagle.layer.attention_kwargs == {}  # global, no soft-cap, whatever the target's layers do
    assert eagle.arch == head_arch(arch) and head_arch(arch).hidden_act == arch.hidden_act
    save_heads(eagle, eagle_cfg, tmp_path / "eagle")
    eagle3 = Eagle3Head(arch, 96, (0, 1, 2))
    with torch.no_grad():
        for p in eagle3.parameters():
            p.normal_(0, 0.2)
    eagle3.set_vocab(list(range(0, VOCAB, 2)) + list(range(1, 33, 2)))
    eagle3_cfg = HeadConfig(method="eagle3", draft_vocab_size=96, feature_layers=[0, 1, 2], **fields)
    save_heads(eagle3, eagle3_cfg, tmp_path / "eagle3")
    dynamic = {"tree": "dynamic", "tree_topk": 2, "max_tree_nodes": 6}
    for method, extra in (("eagle", {}), ("eagle", dynamic), ("eagle3", {}), ("eagle3", dynamic)):
        spec = {"method": method, "model": str(tmp_path / method), "num_speculative_tokens": 3, **extra}
        got, llm, _ = _generate(target, spec, block_size=4)
        assert got == hf_refs[name], spec
        assert llm.engine.spec_stats.num_drafts > 0
        assert llm.engine.kv.num_released_blocks == 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_train_on_a_windowed_soft_capped_target(family_dirs, hf_refs, method, tmp_path):
    """EAGLE and EAGLE-3 heads train on Gemma 2 (sliding windows on alternate layers, attention and
    final soft-caps) through ``experiments.train``: the loss falls, and the trained head drafts tokens
    the target accepts on the prompts it trained on, while the greedy output stays transformers'."""
    from hydra import compose, initialize_config_module

    from experiments.config import register_configs, to_train_config
    from experiments.train import run_training

    name = "gemma2-gqa2-tied-window5"
    target = family_dirs[name][0]
    register_configs()
    overrides = [
        f"drafter={method}",
        f"model.name={target}",
        "model.dtype=float32",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.max_new_tokens=24",
        "data.heldout_fraction=0.0",
        "train.time_budget_s=null",
        "train.eval=false",
        "train.torch_threads=1",
        "train.warmup_steps=5",
        "train.log_every=5",
        "train.lr=0.01",
        "train.epochs=40",
        "train.batch_tokens=72",
        f"train.out_dir={tmp_path / 'heads'}",
    ]
    if method == "eagle3":
        overrides += [
            "data.feature_layers=[0,1,2]",
            "train.eagle3_draft_vocab_size=64",
            "train.eagle3_ttt_steps=3",
        ]
    else:
        overrides += ["train.eagle_unroll=2"]
    with initialize_config_module(config_module="experiments.conf", version_base=None):
        cfg = to_train_config(compose(config_name="train", overrides=overrides))
    # Trained on the prompts it is then run on (a fit, not a generalisation: what the head learned from
    # the training pipeline's features must be what the engine hands it at run time).
    summary = run_training(cfg, None, prompt_ids=_engine_prompts() + _prompts([12] * 6, seed=5))
    assert summary["final_train_loss"] < 0.8 * summary["initial_train_loss"]
    spec = {"method": method, "model": str(tmp_path / "heads"), "num_speculative_tokens": 3}
    got, llm, _ = _generate(target, spec, block_size=4)
    assert got == hf_refs[name]
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_compiled_forward_carries_window_and_softcap(family_dirs, hf_refs, fast_cpu_settings):
    """Gemma 2 compiled (``backend="eager"``: the traced graph with attention in the custom op, which
    carries each layer's window and soft-cap): greedy output still equals transformers'."""
    name = "gemma2-gqa2-tied-window5"
    got, llm, _ = _generate(
        family_dirs[name][0], block_size=4, compile={"buckets": (4, 16), "backend": "eager"}
    )
    assert got == hf_refs[name]
    assert llm.engine.runner.compile_stats.compiled_calls > 0


@pytest.mark.parametrize("name", list(FAMILIES))
def test_memory_calculator_knows_each_family(family_dirs, name):
    """Parameters as transformers counts them, bytes as our loaded model holds them, and the KV a decode
    step reads: ``min(context, sliding_window)`` tokens in windowed layers."""
    d = family_dirs[name][0]
    cfg = ModelArchConfig.from_pretrained(d)
    num_params, held, _ = weight_bytes(cfg, torch.float32)
    assert num_params == sum(p.numel() for p in _hf(d).parameters())
    ours = load_model(d, dtype=torch.float32)
    assert held == sum(p.nbytes for p in ours.parameters())  # a tied head is one parameter
    est = estimate(d, 40, dtype="float32", bandwidth_bytes_per_s=1e9)
    per_layer = est.kv_bytes_per_token // cfg.num_layers
    windows = [cfg.layer_window(i) or 40 for i in range(cfg.num_layers)]
    assert est.kv_read_bytes_per_request == sum(per_layer * min(40, w) for w in windows)
    assert est.kv_bytes_per_request == 40 * est.kv_bytes_per_token  # held at the peak: the whole context
    assert est.step_read_bytes == est.weight_read_bytes + est.kv_read_bytes_per_request


def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(UnknownModelError) as info:
        ModelArchConfig.from_pretrained(tmp_path)
    assert "'gpt2'" in str(info.value)
    assert all(t in str(info.value) for t in SUPPORTED_MODEL_TYPES)


def test_longrope_is_refused_by_name(tmp_path):
    """Phi-3 128k's LongRoPE switches frequencies with the sequence length: refused, named."""
    from transformers import Phi3Config

    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 64,
    }
    sizes = dict(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    Phi3Config(
        **sizes,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_parameters=rope,
        pad_token_id=0,
    ).save_pretrained(tmp_path)
    with pytest.raises(UnknownModelError, match="longrope"):
        ModelArchConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "rope", [{"rope_type": "yarn"}, {"type": "su"}, {"rope_type": "dynamic", "factor": "x"}], ids=str
)
def test_malformed_rope_parameters_are_a_specdec_error(tmp_path, rope):
    """A hand-edited config.json with RoPE parameters transformers cannot use: a ``SpecdecError``
    naming the folder (corrupt) or the RoPE type (unsupported), not transformers' own exception."""
    import json

    from transformers import LlamaConfig

    from specdec.errors import SpecdecError

    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2).save_pretrained(tmp_path)  # fmt: skip
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = rope
    path.write_text(json.dumps(config))
    with pytest.raises(SpecdecError, match=rf"{tmp_path.name}|rope_type") as info:
        ModelArchConfig.from_pretrained(tmp_path)
    assert isinstance(info.value, (CorruptModelError, UnknownModelError))
