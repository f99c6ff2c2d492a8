"""The C++ layer stack (:mod:`kernels.cpu_decode_stack`) against its reference, the model's per-layer
path: the same kernels in the same order, so residual streams, feature streams and the K/V written to
the cache are equal bit for bit, for decode rows, verification chains and token trees, in float32 and
bfloat16, over every layer option it takes (QKV bias, Gemma-form norms, sliding windows, score
soft-caps). Through the engine: greedy tokens equal with the stack on and off (plain, n-gram chains,
token trees), and the stack serves the decode and verification steps."""

from __future__ import annotations

import copy

import pytest
import torch

from kernels import cpu_decode_stack
from kernels.testing import make_paged_batch, random_tree_mask

pytestmark = pytest.mark.skipif(not cpu_decode_stack.available(), reason="the CPU kernels do not build here")

HEAD_DIM = 32
_ONEDNN = cpu_decode_stack.available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _model(dtype: torch.dtype, layers: int = 3, **overrides):
    from specdec.models.config import ModelArchConfig
    from specdec.models.cpu_linear import use_gemv_linears, use_packed_weights
    from specdec.models.decoder import DecoderLM, use_cpu_layer_ops

    fields = dict(
        model_type="llama", vocab_size=200, hidden_size=128, intermediate_size=1024, num_layers=layers,
        num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, rms_norm_eps=1e-5, tie_word_embeddings=True,
        qkv_bias=False, o_bias=False, mlp_bias=False, max_position_embeddings=512,
        inv_freq=tuple((1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)).tolist()),
        rope_attention_scaling=1.0, bos_token_id=1, eos_token_ids=(2,),
    )  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(0)
    model = DecoderLM(ModelArchConfig(**fields))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.normal_(1.0, 0.1)
    model = model.to(dtype).eval()
    use_gemv_linears(model)
    # bfloat16: the wide products of 5+ rows and every product of 12+ take oneDNN's packed GEMM, in the
    # stack as in the linear layers (both checked below)
    assert (use_packed_weights(model) > 0) == (dtype == torch.bfloat16 and _ONEDNN)
    use_cpu_layer_ops(model)
    return model


VARIANTS = {
    "llama": {},
    "qwen2-bias": dict(model_type="qwen2", qkv_bias=True),
    "mistral-window": dict(model_type="mistral", sliding_window=6, layer_types=("sliding_attention",) * 3),
    "gemma-norm-softcap-mixed-window": dict(
        norm_style="gemma",
        attn_logit_softcapping=20.0,
        sliding_window=5,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    ),
}

# (query_len, context_len) per request: decode rows, a k = 4 chain, trees of 5 and 9 nodes
BATCHES = {
    "decode-1": [(1, 13)],
    "decode-3": [(1, 3), (1, 17), (1, 9)],
    "chain+decode": [(5, 11), (1, 20)],
    "trees": [(5, 7), (9, 12), (1, 4)],
    # 40 rows (8 chains of 5): past the GEMV kernel's 32, taken where every linear has a packed weight
    "wide": [(5, 3 + 2 * i) for i in range(8)],
    # prompt chunks (over 32 queries) beside short queries: a chunk after 8 cached tokens and a decode
    # row; a prompt with no earlier keys and a chain. Taken where every linear has a packed weight (past
    # 32 rows) and no layer has a sliding window or soft-cap.
    "chunk+decode": [(40, 8), (1, 20)],
    "prompt+chain": [(36, 0), (5, 9)],
}
CHUNKS = ("chunk+decode", "prompt+chain")


def _run(model, batch, caches, features=()):
    from specdec.attention.cpu_backend import CpuAttention

    model.set_feature_layers(features)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.cfg.vocab_size, (sum(batch.query_lens),), generator=g)
    positions = torch.cat(
        [torch.arange(s - q, s) for q, s in zip(batch.query_lens, batch.seq_lens_host)]
    )  # chain positions; the tree tests' depths only move RoPE, equal on both paths
    with torch.inference_mode():
        return model.layer_stack(ids, positions, caches, batch.metadata(), CpuAttention())


def _caches(model, batch):
    g = torch.Generator().manual_seed(9)
    out = []
    for _ in model.layers:
        k, v = batch.k_cache.clone(), batch.v_cache.clone()
        for c in (k, v):
            owned = ~c.isnan()
            c[owned] = torch.randn(int(owned.sum()), generator=g).to(c.dtype)
        out.append((k, v))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", list(BATCHES))
def test_stack_equals_the_per_layer_path_bit_for_bit(dtype, variant, shape):
    model = _model(dtype, **VARIANTS[variant])
    assert model.decode_stack is not None and len(model.decode_stack) == 3
    seqs = BATCHES[shape]
    g = torch.Generator().manual_seed(3)
    masks = [random_tree_mask(q, g) if q > 1 and shape == "trees" else None for q, _ in seqs]
    batch = make_paged_batch(
        seqs, 4, 2, HEAD_DIM, block_size=4, dtype=dtype, new_token_masks=masks, write_new=False
    )
    features = (0, 2, 3)
    caches_ref = _caches(model, batch)
    caches_got = [(k.clone(), v.clone()) for k, v in caches_ref]
    calls = _count_stack_calls(model)
    got, got_features = _run(model, batch, caches_got, features)
    # the stack served this batch; 40 rows only with packed weights (bfloat16 with AMX or oneDNN), prompt
    # chunks only in layers without a sliding window or soft-cap
    packed = dtype == torch.bfloat16 and _ONEDNN  # as _model packs
    plain_attention = "window" not in variant
    served = (packed or shape not in ("wide", *CHUNKS)) and (plain_attention or shape not in CHUNKS)
    assert calls == [int(served)]
    assert model.decode_stack.takes_prefill == plain_attention
    assert (model.decode_stack.max_rows >= 40) == packed
    stack, model.decode_stack = model.decode_stack, None
    want, want_features = _run(model, batch, caches_ref, features)
    model.decode_stack = stack
    assert torch.equal(got, want)
    assert torch.equal(got_features, want_features) and got_features.shape[-1] == 3 * 128
    for (kg, vg), (kr, vr) in zip(caches_got, caches_ref):  # the new K/V written alike, nothing else
        torch.testing.assert_close(kg, kr, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(vg, vr, rtol=0, atol=0, equal_nan=True)


def _count_stack_calls(model) -> list[int]:
    calls = [0]
    inner = model.decode_stack.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    model.decode_stack.forward = counted
    return calls


def test_batches_and_models_it_does_not_take_fall_back():
    """A prefill chunk past the float32 kernel's rows, autograd, a model copied or moved after the
    switch, and layers it does not take (q/k norms, norms after attention, GeLU) run the per-layer path."""
    model = _model(torch.float32)
    calls = _count_stack_calls(model)
    batch = make_paged_batch([(40, 0), (1, 5)], 4, 2, HEAD_DIM, block_size=4, write_new=False)
    _run(model, batch, _caches(model, batch))
    assert calls == [0]  # 41 rows: past the float32 GEMV kernel's 32 (no packed weights)
    decode = make_paged_batch([(1, 5)], 4, 2, HEAD_DIM, block_size=4, write_new=False)
    with torch.enable_grad():
        ids, pos = torch.tensor([3]), torch.tensor([5])
        from specdec.attention.cpu_backend import CpuAttention

        model.layer_stack(ids, pos, _caches(model, decode), decode.metadata(), CpuAttention())
    assert calls == [0]
    copied = copy.deepcopy(model)  # new weights: a copy gets no stack (it would run the original's)
    assert copied.decode_stack is None and model.decode_stack is not None
    _run(copied, decode, _caches(copied, decode))
    assert calls == [0]
    _run(model, decode, _caches(model, decode))
    assert calls == [1]
    # a layer's linear swapped after the stack was built: the stack holds the old weight, so it steps aside
    from specdec.models.cpu_linear import GemvLinear

    old = model.layers[1].o_proj
    fresh = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        fresh.weight.copy_(old.weight)
    model.layers[1].o_proj = GemvLinear(fresh)
    _run(model, decode, _caches(model, decode))
    assert calls == [1]
    model.layers[1].o_proj = old
    _run(model, decode, _caches(model, decode))
    assert calls == [2]
    for overrides in (dict(qk_norm=True), dict(post_norms=True), dict(hidden_act="gelu_pytorch_tanh")):
        assert _model(torch.float32, **overrides).decode_stack is None


def test_switch_off(monkeypatch):
    monkeypatch.setenv(cpu_decode_stack.DISABLE_ENV, "0")
    assert not cpu_decode_stack.available()
    assert _model(torch.float32).decode_stack is None


@pytest.mark.parametrize(
    "spec",
    [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}],
    ids=["plain", "ngram-k3"],
)
def test_engine_greedy_tokens_equal_with_the_stack_off(tiny_model_dirs, monkeypatch, spec):
    from sampling.params import SamplingParams
    from specdec import LLM

    g = torch.Generator().manual_seed(11)
    motif = torch.randint(3, 128, (4,), generator=g).tolist()
    prompts = [{"prompt_token_ids": (motif * 6)[:n]} for n in (5, 14, 23)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kwargs = dict(skip_tokenizer_init=True, block_size=16, speculative_config=spec)
    d = tiny_model_dirs["llama-gqa3-tied"]
    llm = LLM(d, **kwargs)
    calls = _count_stack_calls(llm.engine.model)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls[0] >= 11  # every decode / verification step of the batch
    if spec:
        assert llm.engine.spec_stats.num_accepted_tokens > 0
    monkeypatch.setenv(cpu_decode_stack.DISABLE_ENV, "0")
    off = LLM(d, **kwargs)
    assert off.engine.model.decode_stack is None
    assert [o.outputs[0].token_ids for o in off.generate(prompts, params)] == got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_draft_heads_layer_takes_a_stack_of_one(dtype):
    """An EAGLE head's decoder layer (outside any stacked model) gets a one-layer stack: its predicted
    features and the K/V it writes equal the per-layer path's bit for bit."""
    from specdec.attention.cpu_backend import CpuAttention
    from specdec.drafters.heads import EagleHead
    from specdec.models.cpu_linear import use_gemv_linears
    from specdec.models.decoder import use_cpu_layer_ops

    torch.manual_seed(1)
    head = EagleHead(_model(torch.float32).cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.normal_(1.0, 0.1)
    head = head.to(dtype).eval()
    use_gemv_linears(head)
    use_cpu_layer_ops(head)
    assert head.layer.decode_stack is not None and len(head.layer.decode_stack) == 1
    batch = make_paged_batch([(1, 9), (3, 6)], 4, 2, HEAD_DIM, block_size=4, dtype=dtype, write_new=False)
    g = torch.Generator().manual_seed(2)
    embeds, feats = (torch.randn(4, 128, generator=g).to(dtype) for _ in range(2))
    positions = torch.tensor([9, 6, 7, 8])
    calls = [0]
    inner = head.layer.decode_stack.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    head.layer.decode_stack.forward = counted
    caches = [(batch.k_cache.clone(), batch.v_cache.clone()) for _ in range(2)]
    with torch.inference_mode():
        got = head(embeds, feats, positions, caches[0], batch.metadata(), CpuAttention())
        assert calls == [1]
        head.layer.decode_stack = None
        want = head(embeds, feats, positions, caches[1], batch.metadata(), CpuAttention())
    assert torch.equal(got, want)
    for a, b in zip(caches[0], caches[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("quantize", [False, True], ids=["dense", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_an_eagle3_layer_takes_a_stack_of_one_with_its_attention_input(dtype, quantize):
    """An EAGLE-3 head's layer (attention input: its embeddings' and features' norms side by side, twice the
    hidden size) runs as a one-layer stack given that input: predicted hidden states and the K/V written
    equal the per-layer path's bit for bit (dense and int8 weights); a negative control without the input
    differs."""
    from specdec.attention.cpu_backend import CpuAttention
    from specdec.drafters.eagle3_head import Eagle3Head
    from specdec.models.cpu_linear import use_gemv_linears
    from specdec.models.decoder import use_cpu_layer_ops
    from specdec.quantization.apply import quantize_linears
    from specdec.quantization.config import QuantizationConfig

    torch.manual_seed(1)
    head = Eagle3Head(_model(torch.float32).cfg, 64, (0, 1, 2))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.normal_(1.0, 0.1)
    head = head.to(dtype).eval()
    if quantize:
        quantize_linears(head, QuantizationConfig(method="int8"), dtype)
    use_gemv_linears(head)
    use_cpu_layer_ops(head)
    stack = head.layer.decode_stack
    assert stack is not None and len(stack) == 1
    batch = make_paged_batch([(1, 9), (3, 6)], 4, 2, HEAD_DIM, block_size=4, dtype=dtype, write_new=False)
    g = torch.Generator().manual_seed(2)
    embeds = torch.randn(4, 128, generator=g).to(dtype)
    feats = torch.randn(4, 3 * 128, generator=g).to(dtype)
    positions = torch.tensor([9, 6, 7, 8])
    inner = stack.forward  # uncounted, for the negative control
    calls = _count_stack_calls(head.layer)
    caches = [(batch.k_cache.clone(), batch.v_cache.clone()) for _ in range(3)]
    with torch.inference_mode():
        got = head(embeds, feats, positions, caches[0], batch.metadata(), CpuAttention())
        assert calls == [1]
        head.layer.decode_stack = None
        want = head(embeds, feats, positions, caches[1], batch.metadata(), CpuAttention())
        # Negative control: the two norms swapped in the attention input (a plausible slip) must show.
        layer, residual = head.layer, head.fc(feats)
        swapped = torch.cat([layer.hidden_norm(residual), layer.input_layernorm(embeds)], dim=-1)
        cos, sin = head.rope(positions, head.inv_freq, head.arch.rope_attention_scaling, dtype)
        metadata = batch.metadata()
        short = CpuAttention().short_queries(metadata, caches[2][0])
        wrong, _ = inner(residual, cos, sin, [caches[2]], metadata.slot_mapping, short, (), swapped)
    assert torch.equal(got, want)
    for a, b in zip(caches[0], caches[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(wrong, want)


# -- sampled distribution through the stack -------------------------------------------------------------
# The distribution tests of tests/test_spec_distribution.py verify 2,500 requests per step, past the rows
# the stack takes; here at most 5 requests run at once and a step holds at most 5 x (K + 1) = 15 tokens
# (prefills chunked to fit), so every target forward goes through its stack, and the draft model's too.
STACK_SEQS = 5
STACK_CALLS = 8  # 20,000 sampled requests at T = 1


@pytest.fixture(scope="module")
def dist_setup(tmp_path_factory):
    from tests.conftest import first_three_logits, save_target_and_draft
    from tests.test_eagle3_distribution import greedy_chain
    from tests.test_spec_distribution import PROMPT, V, exact_joint

    root = tmp_path_factory.mktemp("stack_dist")
    logits = first_three_logits(save_target_and_draft(root, V, 1, 2), PROMPT, V)
    return {"root": root, "exact": {1.0: exact_joint(logits, 1.0)}, "greedy": greedy_chain(logits)}


def _stack_llm(setup):
    from specdec import LLM
    from tests.test_spec_distribution import K

    spec = {"method": "draft_model", "model": str(setup["root"] / "draft"), "num_speculative_tokens": K}
    llm = LLM(
        setup["root"] / "target", skip_tokenizer_init=True, seed=7, speculative_config=spec,
        block_size=4, num_kv_blocks=64, max_model_len=32, max_num_seqs=STACK_SEQS,
        max_num_batched_tokens=STACK_SEQS * (K + 1),  # every step within the stack's 16 float32 rows
    )  # fmt: skip
    target_calls = _count_stack_calls(llm.engine.model)
    draft_calls = _count_stack_calls(llm.engine.drafter.model)
    return llm, target_calls, draft_calls


@pytest.mark.usefixtures("fast_cpu_settings")
def test_sampled_distribution_through_the_stack(dist_setup):
    """Speculative sampling (a draft model, chains of 2) with every decode and verification step in the
    C++ stacks: the first three tokens match the exact joint (chi-square, alpha = 1e-3), and accepting
    every draft fails the same test (5,000 requests; p below alpha / 1000)."""
    from tests.stats import ALPHA, assert_differs
    from tests.test_rejection_sampler import AcceptEverything
    from tests.test_spec_distribution import check_all, sample_counts

    llm, target_calls, draft_calls = _stack_llm(dist_setup)
    counts = sample_counts(
        llm, STACK_CALLS, seed_base=31 * 10**6, temperatures=(1.0,), greedy_chain=dist_setup["greedy"]
    )
    check_all(dist_setup, counts, "draft_model through the stack")
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and stats.accepted_per_position[1] > 0
    assert target_calls[0] == llm.engine.num_steps  # every target forward (prefill chunks included)
    assert draft_calls[0] > 0  # the draft model's steps too
    control, _, _ = _stack_llm(dist_setup)
    control.engine.verifier = AcceptEverything()
    counts = sample_counts(control, 2, seed_base=32 * 10**6, temperatures=(1.0,))
    res = assert_differs(dist_setup["exact"][1.0], counts[1.0], label="control: stack, every draft accepted")
    assert res.pvalue < ALPHA * 1e-3


@pytest.mark.parametrize("k", [1, 4])
def test_bfloat16_speculation_equals_plain_decoding_bit_for_bit_with_tiles(tiny_model_dirs, k):
    """Batch invariance on a CPU with AMX or AVX512_BF16: the tile kernels sum each output row independently
    of the other rows, and every other kernel of the stack works row by row (the attention softmax
    included: its sum does not depend on how many masked keys follow), so a verification row gets the
    logits a decode row gets. Greedy n-gram speculation then returns plain greedy decoding's tokens and
    logprobs exactly, in bfloat16, in one continuous batch of three requests on a tiny random model. It
    does not catch every rounding difference (it passed with the softmax's old tail too); the SmolLM2 test
    below does."""
    from kernels import cpu_gemv
    from sampling.params import SamplingParams
    from specdec import LLM

    if not cpu_gemv.tiles():
        pytest.skip("no tile kernel (AMX or AVX512_BF16) on this CPU")
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(3, 128, (5,), generator=g).tolist()
    prompts = [{"prompt_token_ids": (motif * 8)[:n]} for n in (7, 19, 33)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    d = tiny_model_dirs["llama-gqa3-tied"]
    kwargs = dict(skip_tokenizer_init=True, block_size=16, dtype="bfloat16")
    plain = LLM(d, **kwargs).generate(prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    llm = LLM(d, speculative_config=spec, **kwargs)
    ngram = llm.generate(prompts, params)
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    for a, b in zip(plain, ngram):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.real_model
def test_smollm2_bfloat16_speculation_equals_plain_decoding_with_tiles(smollm2_dir):
    """The same on the real SmolLM2 in bfloat16: 8 held-out chat prompts, each alone (batch 1, as the
    drafter benchmark runs), 96 tokens, greedy plain decoding against n-gram (k = 4) and EAGLE (k = 4,
    reduced vocabulary) speculation: the same tokens for every prompt. Before the softmax's tail took the
    vector path (its sum then depended on how many masked keys followed a row) the benchmark's check
    matched 11 of 16 prompts for n-gram and 10 of 16 for EAGLE (``bench_drafters prompts=heldout
    limit=16``), and this test failed. Across a continuous batch the tokens can still part: prefill
    chunks attend through SDPA, whose sums depend on how the scheduler cut the prompts into chunks."""
    from experiments.datasets import round_robin
    from experiments.train import load_heldout_prompts
    from kernels import cpu_gemv
    from sampling.params import SamplingParams
    from specdec import LLM
    from specdec.llm import chat_token_ids

    if not cpu_gemv.tiles():
        pytest.skip("no tile kernel (AMX or AVX512_BF16) on this CPU")
    plain = LLM(smollm2_dir, dtype="bfloat16")
    prompts = [
        {"prompt_token_ids": chat_token_ids(plain.tokenizer, p.messages)}
        for p in round_robin(load_heldout_prompts())[:8]
    ]
    params = SamplingParams(temperature=0, max_tokens=96)
    want = [plain.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "eagle", "num_speculative_tokens": 4, "draft_vocab": "smollm2-135m-instruct-eagle3"},
    ):
        llm = LLM(smollm2_dir, dtype="bfloat16", speculative_config=spec)
        got = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        assert llm.engine.spec_stats.num_accepted_tokens > 0
        assert got == want, spec["method"]


@pytest.mark.parametrize("tiles", [False, True], ids=["rowmajor", "tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_stack_takes_int8_layers_bit_for_bit(dtype, tiles):
    """An int8-quantized model (the quantized self-drafter's form) gets the C++ stack, whose output and
    K/V equal the per-layer path's (QuantizedLinear on the same kernel) bit for bit, with the codes
    row-major or given their tile-order copies (as an eager engine's are)."""
    from kernels import cpu_decode_stack, cpu_gemv_int8
    from kernels.testing import make_paged_batch
    from specdec.models.cpu_linear import use_packed_weights
    from specdec.models.decoder import use_cpu_layer_ops
    from specdec.quantization.apply import quantize_model
    from specdec.quantization.config import QuantizationConfig

    if not cpu_decode_stack.available():
        pytest.skip("the layer stack does not build here")
    if tiles and not cpu_gemv_int8.tiles():
        pytest.skip("the int8 tile kernel needs AVX512_VNNI")
    model = quantize_model(_model(dtype), QuantizationConfig("int8"))
    if tiles:
        assert use_packed_weights(model) == 4 * len(model.layers) + 1  # and the LM head
    use_cpu_layer_ops(model)
    assert model.decode_stack is not None and len(model.decode_stack) == 3
    batch = make_paged_batch([(1, 13), (5, 9)], 4, 2, HEAD_DIM, block_size=4, dtype=dtype, write_new=False)
    caches_ref = _caches(model, batch)
    caches_got = [(k.clone(), v.clone()) for k, v in caches_ref]
    calls = _count_stack_calls(model)
    got, _ = _run(model, batch, caches_got)
    assert calls == [1]
    stack, model.decode_stack = model.decode_stack, None
    want, _ = _run(model, batch, caches_ref)
    model.decode_stack = stack
    assert torch.equal(got, want)
    for (kg, vg), (kr, vr) in zip(caches_got, caches_ref):
        torch.testing.assert_close(kg, kr, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(vg, vr, rtol=0, atol=0, equal_nan=True)
    # the codes swapped after the stack was built: it holds the old ones, so it steps aside
    layer = model.layers[1].o_proj
    layer.qweight = layer.qweight.clone()
    _run(model, batch, [(k.clone(), v.clone()) for k, v in caches_ref])
    assert calls == [1]
