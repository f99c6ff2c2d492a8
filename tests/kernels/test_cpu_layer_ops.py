"""The CPU kernels of a layer's small operations (``kernels/csrc/cpu_layer_ops.cpp``) against their torch
references (:mod:`kernels.cpu_layer_ops`), and the model using them.

- RoPE: equal to the reference bit for bit in float32 and bfloat16 (products rounded before the sum,
  no fused multiply-adds), on the strided query/key view of a fused QKV tensor.
- RMSNorm (Llama and Gemma forms) and SiLU · up: float32 within 1e-6 relative (a sum of squares or
  ``exp`` in another order / library); bfloat16 at most one bfloat16 step from the reference, and equal
  on at least 99 % of the elements.
- Rows from 1 to 40 (inline and across threads), widths with and without a tail of the 8-wide loop.
- A SmolLM2-shaped random model: logits with the kernels within float32 rounding of the references',
  and ``use_cpu_layer_ops`` leaves training (autograd) and ``torch.compile`` traces on the references.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_layer_ops

needs_kernel = pytest.mark.skipif(not cpu_layer_ops.available(), reason="the CPU kernels do not build here")
pytestmark = needs_kernel

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    diff = (got.float() - want.float()).abs()
    step = want.float().abs() * 2**-7 + 1e-30  # one bfloat16 step (8 significant bits)
    assert bool((diff <= step).all()), float((diff / step).max())
    assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 576), (5, 45), (40, 64), (17, 8)])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_equals_reference(dtype, rows, width, gemma):
    g = torch.Generator().manual_seed(rows * width)
    base = (torch.randn(rows, width + 3, generator=g) * 3).to(dtype)
    x = base[:, :width]  # strided rows
    w = (torch.randn(width, generator=g) * 0.3 + (0.0 if gemma else 1.0)).to(dtype)
    with torch.inference_mode():
        got = cpu_layer_ops.rms_norm(x, w, 1e-6, gemma, use_kernel=True)
        _close(got, cpu_layer_ops.rms_norm_reference(x, w, 1e-6, gemma))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, heads, kv_heads, head_dim", [(1, 9, 3, 64), (6, 4, 2, 16), (33, 2, 1, 128)])
def test_rope_equals_reference_bit_for_bit(dtype, rows, heads, kv_heads, head_dim):
    from specdec.models.decoder import rope_cos_sin

    g = torch.Generator().manual_seed(rows + head_dim)
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    qk = qkv[:, : heads + kv_heads]  # the layer's view: rows strided past the value heads
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    cos, sin = rope_cos_sin(torch.arange(100, 100 + rows), inv_freq, 1.0, dtype)
    with torch.inference_mode():
        got = cpu_layer_ops.rope(qk, cos, sin, use_kernel=True)
        assert torch.equal(got, cpu_layer_ops.rope_reference(qk, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inner", [(1, 1536), (7, 100), (40, 96)])
def test_silu_mul_equals_reference(dtype, rows, inner):
    g = torch.Generator().manual_seed(rows * inner)
    gate_up = (torch.randn(rows, 2 * inner, generator=g) * 4).to(dtype)
    with torch.inference_mode():
        _close(cpu_layer_ops.silu_mul(gate_up, use_kernel=True), cpu_layer_ops.silu_mul_reference(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_at_the_extremes(dtype):
    """Gates far below exp's range (SiLU -> -0: an eight-lane exp once wrapped its exponent there and
    returned about the gate), far above, infinities and NaN, in the vector lanes and in the tail."""
    specials = [-1e4, -100.0, -88.5, -87.5, 87.5, 100.0, 1e4, float("-inf"), float("inf"), float("nan"), 0.0]
    gate = torch.tensor(specials * 2, dtype=torch.float32)[None]  # 22 columns: two blocks of 8 and a tail
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)], dim=1).to(dtype)
    with torch.inference_mode():
        got = cpu_layer_ops.silu_mul(gate_up, use_kernel=True)
        want = cpu_layer_ops.silu_mul_reference(gate_up)
    # exp(88.5) is finite but past the eight-lane exp's 88.38 clamp: SiLU there 0 instead of -3e-37
    torch.testing.assert_close(got, want, equal_nan=True, rtol=2**-7, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inner", [(5, 1536), (16, 1536), (5, 100), (3, 17)])
def test_silu_mul_bits_do_not_depend_on_the_threads(dtype, rows, inner):
    """More than four rows split into column parts (multiples of 16 columns, the row's tail in the last
    part) over the threads: one to four threads give the same bits, each element taking the same path
    (sixteen lanes, eight, or the scalar tail) as in one pass over its row."""
    g = torch.Generator().manual_seed(rows + inner)
    gate_up = (torch.randn(rows, 2 * inner, generator=g) * 8).to(dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        with torch.inference_mode():
            for n in (1, 2, 3, 4):
                torch.set_num_threads(n)
                outs.append(cpu_layer_ops.silu_mul(gate_up, use_kernel=True))
                # each row alone (a decode row, inline) gives the row's bits in the batch
                outs.append(
                    torch.cat(
                        [cpu_layer_ops.silu_mul(gate_up[r : r + 1], use_kernel=True) for r in range(rows)]
                    )
                )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    _close(outs[0], cpu_layer_ops.silu_mul_reference(gate_up))


def test_bad_shapes_are_refused_by_the_kernels():
    with torch.inference_mode(), pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.specdec_cpu.rms_norm(torch.randn(2, 8), torch.randn(9), 1e-6, False)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="even D"):
        torch.ops.specdec_cpu.rope(torch.randn(2, 3, 7), torch.randn(2, 1, 7), torch.randn(2, 1, 7))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.specdec_cpu.silu_mul(torch.randn(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_with_the_kernels_matches_the_references(dtype):
    """A 3-layer model with SmolLM2's widths: logits over a prefill and two decode rows with the kernels
    equal the references' within float32 rounding (bfloat16: within a few bfloat16 steps of the logit
    scale); with autograd on, the references run (gradients flow)."""
    from specdec.attention.dense import DenseAttention, dense_metadata
    from specdec.models.config import ModelArchConfig
    from specdec.models.decoder import DecoderLM, use_cpu_layer_ops

    head_dim = 64
    cfg = ModelArchConfig(
        model_type="llama", vocab_size=300, hidden_size=576, intermediate_size=1536, num_layers=3,
        num_heads=9, num_kv_heads=3, head_dim=head_dim, rms_norm_eps=1e-5, tie_word_embeddings=True,
        qkv_bias=False, o_bias=False, mlp_bias=False, max_position_embeddings=256,
        inv_freq=tuple((1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)).tolist()),
        rope_attention_scaling=1.0, bos_token_id=1, eos_token_ids=(2,),
    )  # fmt: skip
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() == 2 else p.normal_(1.0, 0.1)
    model = model.to(dtype).eval()
    ids = torch.randint(0, 300, (12,))
    args = (ids, torch.arange(12), [(None, None)] * 3, dense_metadata([12]), DenseAttention())
    with torch.inference_mode():
        want = model(*args, logits_indices=torch.arange(12))[0]
        assert use_cpu_layer_ops(model) == 3 + 2 * 3 + 1  # the layers, their two norms, the final norm
        got = model(*args, logits_indices=torch.arange(12))[0]
    tol = 1e-4 if dtype == torch.float32 else 0.05 * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    # a model moved after the switch (here to float64) falls back to the references call by call
    import copy

    model64 = copy.deepcopy(model).double()
    with torch.inference_mode():
        moved = model64(*args, logits_indices=torch.arange(12))[0]
    torch.testing.assert_close(moved, want, rtol=0, atol=tol)
    # autograd on: the references (the kernels have no backward)
    emb = model.embed_tokens.weight
    emb.requires_grad_(True)
    model(*args, logits_indices=torch.tensor([11]))[0].sum().backward()
    assert emb.grad is not None and float(emb.grad.abs().sum()) > 0
