"""Weight-only quantization and the int8 KV cache: error bounds, packed kernels against the reference,
what outliers do to a per-tensor scale, configuration errors.

Outliers, measured on SmolLM2-135M-Instruct's real weights (the zoo checkpoint, read with safetensors):
the matrix with the largest ``max |W| / median |W|`` is ``model.layers.27.mlp.gate_proj.weight``
``[1536, 576]``: max 9.25, RMS 0.18, ratio 79. With one scale for the whole tensor its step is set by that
9.25, and the relative RMS error ``||W - dq(q(W))|| / ||W||`` is 11.7 % at int8 and 98.5 % at int4 (every
element but the outliers rounds to 0); one scale per output channel gives 0.84 % at int8 (14x less), one
per group of 64 columns 11.4 % at int4. A matrix without outliers (``layers.12.self_attn.v_proj``, ratio
7) loses little to a per-tensor scale (int8: 1.06 % against 0.79 %). ``test_outliers_on_smollm2_weights``
asserts these figures to two significant digits.
"""

from __future__ import annotations

import glob

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.attention.base import AttentionMetadata
from specdec.attention.reference import ReferenceAttention
from specdec.errors import ConfigError
from specdec.model_runner import ModelRunner, Segment, build_inputs, select_attention_backend
from specdec.models.loader import load_model
from specdec.quantization.apply import LAYER_LINEARS
from specdec.quantization.config import QuantizationConfig
from specdec.quantization.kv_cache import dequantize_kv, quantize_kv
from specdec.quantization.linear import QuantizedLinear
from specdec.quantization.schemes import (
    SCHEMES,
    dequantize,
    error_bound,
    pack_int4,
    quantize,
    quantize_per_tensor,
    unpack_int4,
)

EPS32 = torch.finfo(torch.float32).eps


def _weights(seed: int, n: int, k: int, outliers: int, offset: float) -> torch.Tensor:
    """Gaussian weights, an offset (skewed groups), and ``outliers`` elements 30-300x larger."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + offset
    if outliers:
        idx = torch.randint(0, n * k, (outliers,), generator=g)
        w.view(-1)[idx] = (
            (torch.rand(outliers, generator=g) * 270 + 30)
            * 0.05
            * torch.sign(torch.randn(outliers, generator=g))
        )
    return w


def _assert_within_bound(w: torch.Tensor, scheme: str, group_size: int | None, zero_point: bool) -> None:
    qw = quantize(w, scheme, group_size, zero_point)
    q_min, q_max = SCHEMES[scheme]
    assert qw.codes.dtype == torch.int8
    assert int(qw.codes.min()) >= q_min and int(qw.codes.max()) <= q_max
    err = (w - dequantize(qw)).abs()
    # Rounding to nearest is within half a step; the float32 arithmetic (w / s, q * s + z) adds at most
    # a few units in the last place of the values involved.
    slack = 4 * EPS32 * (w.abs() + error_bound(qw) * 2 * 8)
    assert bool((err <= error_bound(qw) + slack).all()), float((err - error_bound(qw)).max())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 12),
    groups=st.integers(1, 4),
    group_size=st.sampled_from([32, 64, 128]),
    outliers=st.integers(0, 20),
    offset=st.sampled_from([0.0, 0.02, -0.3]),
    zero_point=st.booleans(),
)
def test_int4_round_trip_within_half_a_step(seed, rows, groups, group_size, outliers, offset, zero_point):
    w = _weights(seed, rows, groups * group_size, outliers, offset)
    _assert_within_bound(w, "int4", group_size, zero_point)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 12),
    cols=st.integers(1, 300),
    outliers=st.integers(0, 20),
    offset=st.sampled_from([0.0, 0.02, -0.3]),
)
def test_int8_round_trip_within_half_a_step(seed, rows, cols, outliers, offset):
    w = _weights(seed, rows, cols, outliers, offset)
    _assert_within_bound(w, "int8", None, False)


def test_scales_are_per_channel_and_per_group():
    w = _weights(0, 6, 128, 0, 0.0)
    w[2, 70] = 40.0  # one outlier
    q8 = quantize(w, "int8")
    assert q8.scales.shape == (6, 1)
    assert q8.scales[2, 0] == pytest.approx(40.0 / 127)
    assert float(q8.scales[[0, 1, 3, 4, 5]].max()) < 0.3 / 127  # other rows keep their own step
    q4 = quantize(w, "int4", 32)
    assert q4.scales.shape == (6, 4)
    assert q4.scales[2, 2] == pytest.approx(40.0 / 7)  # columns 64..95 hold the outlier
    assert float(q4.scales[2, [0, 1, 3]].max()) < 0.3 / 7


def test_zero_and_constant_groups_are_exact():
    w = torch.zeros(4, 64)
    w[1] = 0.5  # a constant row: symmetric step 0.5 / 7 hits it exactly (7 * 0.5 / 7); asymmetric scale 0
    for zero_point in (False, True):
        qw = quantize(w, "int4", 32, zero_point)
        assert torch.equal(dequantize(qw)[0], torch.zeros(64))
        assert torch.allclose(dequantize(qw)[1], torch.full((64,), 0.5), rtol=0, atol=1e-7)
    assert torch.equal(dequantize(quantize(w, "int8"))[0], torch.zeros(64))


def test_int4_packing_round_trip():
    codes = torch.randint(-8, 8, (5, 96), dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 48) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize(
    "scheme,group_size,bad",
    [("int5", None, "scheme"), ("int4", 48, "group_size"), ("int4", 64, "divide"), ("int8", 32, "int8")],
)
def test_quantize_rejects_bad_arguments(scheme, group_size, bad):
    with pytest.raises(ValueError):
        quantize(torch.randn(4, 96), scheme, group_size)


def test_quantize_rejects_non_finite_weights():
    w = torch.randn(4, 64)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize(w, "int8")


# ------------------------------------------------------------------------------ packed vs reference
CASES = [("int8", None, False), ("int4", 32, False), ("int4", 64, True), ("int4", 128, False)]


@pytest.mark.parametrize("scheme,group_size,zero_point", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_packed_kernel_equals_reference(scheme, group_size, zero_point, dtype, rows):
    """Both paths compute ``x @ dequantize(W).T + b`` from the same codes and scales.

    Tolerance. float32: the same products summed in another order, so the difference is bounded by
    ``K · eps · Σ_k |x_k w_k|`` (the standard bound for recursive summation, Higham 2002 §4.2).
    bfloat16: the reference rounds every dequantized weight to bfloat16 (relative 2^-9) and the packed
    kernels do not (they multiply the bfloat16 scale in float32), and each rounds its output once to
    bfloat16: ``2^-8 · Σ_k |x_k w_k| + 2^-7 · |y|`` covers both (observed differences are 1-2 ulps).
    """
    torch.manual_seed(rows)
    w = _weights(rows, 96, 256, 5, 0.01)
    bias = torch.randn(96) * 0.1
    x = torch.randn(rows, 256).to(dtype)
    packed = QuantizedLinear.from_weight(
        w, bias, scheme, group_size, dtype, kernel="packed", zero_point=zero_point
    )
    ref = QuantizedLinear.from_weight(
        w, bias, scheme, group_size, dtype, kernel="reference", zero_point=zero_point
    )
    assert packed.int8_packed or packed.int4_packed  # the kernel really runs
    assert not (ref.int8_packed or ref.int4_packed)
    assert torch.equal(packed.codes(), ref.codes())  # torch's packed layout reads back exactly
    assert torch.equal(packed.dequantized_weight(), ref.dequantized_weight())
    y_packed, y_ref = packed(x).float(), ref(x).float()
    magnitude = x.float().abs() @ ref.dequantized_weight().abs().T + bias.abs()
    if dtype == torch.float32:
        bound = 256 * EPS32 * magnitude + 1e-7
    else:
        bound = 2**-8 * magnitude + 2**-7 * y_ref.abs()
    assert bool(((y_packed - y_ref).abs() <= bound).all()), float((y_packed - y_ref).abs().max())
    # And both are the dense product with the dequantized weight (float64 ground truth).
    exact = x.double() @ ref.dequantized_weight().double().T + bias.to(dtype).double()
    assert bool(((y_ref.double() - exact).abs() <= bound.double() + 1e-6).all())


def test_auto_kernel_choice():
    """int8: packed for decode-sized calls only (bf16 <= 16 rows, fp32 1 row); int4: the packed layout
    in bfloat16, two codes per byte and the reference in float32 or when N is not a multiple of 16."""
    w = torch.randn(32, 64)
    lin = QuantizedLinear.from_weight(w, None, "int8", None, torch.bfloat16)
    assert lin._use_packed(16, torch.bfloat16) and not lin._use_packed(17, torch.bfloat16)
    assert lin._use_packed(1, torch.float32) and not lin._use_packed(2, torch.float32)
    assert QuantizedLinear.from_weight(w, None, "int4", 32, torch.bfloat16).int4_packed
    assert not QuantizedLinear.from_weight(w, None, "int4", 32, torch.float32).int4_packed
    assert not QuantizedLinear.from_weight(
        w[:24], None, "int4", 32, torch.bfloat16, kernel="packed"
    ).int4_packed
    assert not QuantizedLinear.from_weight(
        w, None, "int8", None, torch.bfloat16, kernel="reference"
    )._use_packed(1, torch.bfloat16)


# ------------------------------------------------------------------------------------ outliers (real)
def _smollm2_tensor(name: str) -> torch.Tensor:
    from safetensors import safe_open

    from specdec.zoo import resolve_model

    (path,) = glob.glob(str(resolve_model("smollm2-135m-instruct") / "*.safetensors"))
    with safe_open(path, "pt") as f:
        return f.get_tensor(name).float()


def _relative_error(w: torch.Tensor, dq: torch.Tensor) -> float:
    return float((w - dq).pow(2).mean().sqrt() / w.pow(2).mean().sqrt())


def test_outliers_on_smollm2_weights():
    """See the module docstring: a per-tensor scale is ruined by one outlier; per-channel and per-group
    scales confine it to its row or group."""
    w = _smollm2_tensor("model.layers.27.mlp.gate_proj.weight")
    assert float(w.abs().max() / w.abs().median()) == pytest.approx(79, rel=0.02)
    per_tensor8 = _relative_error(w, quantize_per_tensor(w, "int8")[0])
    per_channel8 = _relative_error(w, dequantize(quantize(w, "int8")))
    per_tensor4 = _relative_error(w, quantize_per_tensor(w, "int4")[0])
    per_group4 = _relative_error(w, dequantize(quantize(w, "int4", 64)))
    print(
        f"[outliers] int8 tensor {per_tensor8:.4f} channel {per_channel8:.4f}; "
        f"int4 tensor {per_tensor4:.3f} g64 {per_group4:.3f}"
    )
    assert per_tensor8 == pytest.approx(0.117, abs=0.002)
    assert per_channel8 == pytest.approx(0.0084, abs=0.0002)
    assert per_tensor4 == pytest.approx(0.985, abs=0.005)
    assert per_group4 == pytest.approx(0.114, abs=0.002)
    calm = _smollm2_tensor("model.layers.12.self_attn.v_proj.weight")
    assert _relative_error(calm, quantize_per_tensor(calm, "int8")[0]) == pytest.approx(0.0106, abs=0.0002)
    assert _relative_error(calm, dequantize(quantize(calm, "int8"))) == pytest.approx(0.0079, abs=0.0002)


# -------------------------------------------------------------------------------------- the model
@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dirs):
    return tiny_model_dirs["qwen2-gqa2-untied"]  # hidden 64, intermediate 96, vocab 128, q/k/v biases


@pytest.mark.parametrize("lm_head", [True, False])
def test_quantize_model_replaces_the_linear_layers(tiny_model_dirs, lm_head):
    d = tiny_model_dirs["llama-gqa3-tied"]
    dense = load_model(d, torch.float32)
    model = load_model(d, torch.float32, quantization=QuantizationConfig("int4", 32, lm_head=lm_head))
    for layer in model.layers:
        assert all(isinstance(getattr(layer, n), QuantizedLinear) for n in LAYER_LINEARS)
    assert isinstance(model.lm_head, QuantizedLinear) == lm_head
    # The tied embedding stays in full precision for lookups.
    assert torch.equal(model.embed_tokens.weight, dense.embed_tokens.weight)
    assert model.dtype == torch.float32
    layer = model.layers[1].gate_up_proj
    assert torch.equal(
        layer.dequantized_weight(), dequantize(quantize(dense.layers[1].gate_up_proj.weight, "int4", 32))
    )


def test_quantized_model_logits_packed_equal_reference(tiny_dir):
    """The whole tiny model in bfloat16 with int8 and int4 layers: packed kernels against the reference,
    logits of a prefill chunk and of single decode rows (relative to the logits' scale, bf16 rounding)."""
    for cfg in (QuantizationConfig("int8"), QuantizationConfig("int4", 32, zero_point=True)):
        logits = {}
        for kernel in ("packed", "reference"):
            q = QuantizationConfig(cfg.method, cfg.group_size, kernel=kernel, zero_point=cfg.zero_point)
            model = load_model(tiny_dir, torch.bfloat16, quantization=q)
            runner = ModelRunner(model, 8, 4)
            ids = list(range(5, 15))
            out = [runner.execute(build_inputs([Segment([0, 1, 2], 0, ids[:8], 8)], 4, runner.device))]
            for p in (8, 9):
                out.append(
                    runner.execute(build_inputs([Segment([0, 1, 2], p, ids[p : p + 1], 1)], 4, runner.device))
                )
            logits[kernel] = torch.cat(out)
        scale = logits["reference"].abs().max()
        assert float((logits["packed"] - logits["reference"]).abs().max()) <= 0.03 * float(scale)


# --------------------------------------------------------------------------------------- int8 KV cache
def test_kv_int8_round_trip_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g) * torch.tensor([0.1, 1.0, 30.0])[None, :, None]
    x[2, 1] = 0.0  # an all-zero head
    rows = quantize_kv(x)
    assert rows.shape == (7, 3, 68) and rows.dtype == torch.int8
    scale = x.abs().amax(-1, keepdim=True) / 127
    err = (dequantize_kv(rows, torch.float32) - x).abs()
    assert bool((err <= scale / 2 + 4 * EPS32 * x.abs()).all())
    assert torch.equal(dequantize_kv(rows, torch.float32)[2, 1], torch.zeros(64))


def _metadata(
    query_lens: list[int], seq_lens: list[int], block_table: list[list[int]], bs: int
) -> AttentionMetadata:
    slots = []
    for q, s, table in zip(query_lens, seq_lens, block_table):
        slots += [table[p // bs] * bs + p % bs for p in range(s - q, s)]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    width = max(len(t) for t in block_table)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor(seq_lens),
        slot_mapping=torch.tensor(slots),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in block_table]),
        query_lens=query_lens,
        seq_lens_host=seq_lens,
    )


@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [([40], [40]), ([40], [70]), ([1], [37]), ([1, 3, 40], [9, 20, 45])],
    ids=["prefill", "chunk-with-context", "decode", "mixed"],
)
def test_int8_kv_attention_reads_what_it_wrote(query_lens, seq_lens):
    """Attention over an int8 cache equals attention over a float cache holding the dequantized K/V: the
    write quantizes at the slot mapping, every read dequantizes (prefill, batched and single decode)."""
    torch.manual_seed(0)
    bs, heads, kv_heads, d = 4, 4, 2, 16
    tables = [list(range(20 * i, 20 * i + 20)) for i in range(len(seq_lens))]
    num_blocks = 20 * len(seq_lens)
    k_hist = [torch.randn(s - q, kv_heads, d) for q, s in zip(query_lens, seq_lens)]
    v_hist = [torch.randn(s - q, kv_heads, d) for q, s in zip(query_lens, seq_lens)]
    t = sum(query_lens)
    q_new, k_new, v_new = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
    outs = {}
    for kind in ("int8", "float"):
        k_cache = torch.zeros(
            num_blocks,
            bs,
            kv_heads,
            d + 4 if kind == "int8" else d,
            dtype=torch.int8 if kind == "int8" else torch.float32,
        )
        v_cache = torch.zeros_like(k_cache)
        attn = ReferenceAttention()
        # History written through the same write path (a metadata whose queries are the history).
        hist_meta = _metadata(
            [s - q for q, s in zip(query_lens, seq_lens)],
            [s - q for q, s in zip(query_lens, seq_lens)],
            tables,
            bs,
        )
        kh, vh = torch.cat(k_hist), torch.cat(v_hist)
        kn, vn = k_new, v_new
        if kind == "float":  # the float cache holds exactly what the int8 one returns
            kh, vh = (
                dequantize_kv(quantize_kv(kh), torch.float32),
                dequantize_kv(quantize_kv(vh), torch.float32),
            )
            kn, vn = (
                dequantize_kv(quantize_kv(k_new), torch.float32),
                dequantize_kv(quantize_kv(v_new), torch.float32),
            )
        if len(kh):
            from specdec.attention.reference import write_kv

            write_kv(kh, vh, k_cache, v_cache, hist_meta.slot_mapping)
        meta = _metadata(query_lens, seq_lens, tables, bs)
        if kind == "float":
            # A float cache would use the fresh K/V of a context-free prefill; give it the dequantized ones.
            outs[kind] = attn.forward(q_new, kn, vn, k_cache, v_cache, meta, d**-0.5)
        else:
            outs[kind] = attn.forward(q_new, k_new, v_new, k_cache, v_cache, meta, d**-0.5)
    assert torch.allclose(outs["int8"], outs["float"], rtol=0, atol=1e-5)


def test_int8_kv_generation_is_independent_of_chunking_and_prefix_caching(tiny_dir):
    """int8 KV reads every key back from the cache, so greedy outputs do not depend on how prompts are
    chunked or whether their prefix came from the prefix cache."""
    from sampling.params import SamplingParams
    from specdec import LLM

    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 128, (12,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 9, 17)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for kw in (
        dict(enable_prefix_caching=False, max_num_batched_tokens=512),
        dict(enable_prefix_caching=True, max_num_batched_tokens=7),
    ):
        llm = LLM(tiny_dir, skip_tokenizer_init=True, block_size=4, kv_cache_dtype="int8", **kw)
        assert llm.engine.runner.kv_caches[0][0].dtype == torch.int8
        res = [llm.generate({"prompt_token_ids": p}, sp)[0].outputs[0].token_ids for p in prompts]
        outs.append(res)
    assert outs[0] == outs[1]


# ---------------------------------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    "value",
    [
        "int5",
        {"method": "int8", "group_size": 64},
        {"method": "int4", "group_size": 48},
        {"method": "int4", "group_size": True},
        {"method": "int4", "group_size": 32.0},  # a float equal to a valid size (found by a break test)
        {"method": None},
        {"method": "int4", "kernel": "fast"},
        {"method": "int4", "lm_head": "yes"},
        {"method": "int8", "zero_point": True},
        {"group_size": 32},
        {"method": "int4", "bits": 4},
        4,
    ],
)
def test_bad_quantization_configs_are_rejected(value):
    with pytest.raises(ConfigError):
        QuantizationConfig.from_any(value)


def test_none_means_no_quantization():
    assert QuantizationConfig.from_any(None) is None and QuantizationConfig.from_any("none") is None


def test_group_size_must_divide_the_model_before_loading(tiny_dir, monkeypatch):
    from specdec import LLM
    from specdec.models import loader

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the configuration was checked")

    monkeypatch.setattr(loader, "read_state_dict", no_weights)
    with pytest.raises(ConfigError, match="group sizes that fit: \\[32\\]"):
        LLM(tiny_dir, skip_tokenizer_init=True, quantization={"method": "int4", "group_size": 64})


def test_bad_kv_cache_dtype_and_triton_int8_are_rejected(tiny_dir):
    from specdec import LLM

    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM(tiny_dir, skip_tokenizer_init=True, kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="reference attention backend only"):
        select_attention_backend(torch.device("cpu"), "triton", kv_cache_dtype="int8")
    assert isinstance(select_attention_backend(torch.device("cpu"), "auto", "int8"), ReferenceAttention)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_dequantization_in_the_activation_dtype_rounds_once(dtype):
    """The int8 fast path (codes times scales in the activation dtype) gives the float32 computation's
    bits: a code times a scale is exact in float32, so both round once."""
    g = torch.Generator().manual_seed(2)
    layer = QuantizedLinear.from_weight(torch.randn(64, 96, generator=g) * 3, None, "int8", None, dtype)
    codes, scales = layer.codes().float(), layer.scales.float()
    assert torch.equal(layer.dequantized_weight(dtype), (codes * scales[:, None]).to(dtype))
