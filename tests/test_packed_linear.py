"""oneDNN-packed bfloat16 linears: the same numbers as ``F.linear``, and the engine's tokens unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.packed_linear import PackedLinear, pack_linears, packing_supported

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bfloat16 on this CPU"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 77])
@pytest.mark.parametrize("shape", [(96, 64), (49, 130), (1000, 576)])
def test_packed_linear_equals_f_linear(shape, rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(shape[1], shape[0], bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
    with torch.no_grad():
        expected = F.linear(x, linear.weight, linear.bias)
        got = PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # Bit-identical on this CPU: oneDNN runs the same reduction, only the weight layout differs.
    assert torch.equal(got, expected)


def test_packed_linear_keeps_leading_dimensions():
    linear = nn.Linear(32, 48, bias=False).to(torch.bfloat16)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(PackedLinear(linear)(x), F.linear(x, linear.weight))


def test_pack_linears_swaps_only_bf16_plain_linears(tiny_model_dirs):
    from specdec.models.loader import load_model

    model = load_model(tiny_model_dirs["llama-gqa3-tied"], torch.bfloat16)
    assert pack_linears(model) == 4 * model.cfg.num_layers + 1
    # The tied LM head keeps its dense weight (it is the embedding table); the others drop theirs.
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].qkv_proj.weight is None
    assert pack_linears(model) == 0  # nothing left to pack
    fp32 = load_model(tiny_model_dirs["llama-gqa3-tied"], torch.float32)
    assert pack_linears(fp32) == 0


@pytest.mark.parametrize("name", ["llama-gqa3-tied", "qwen2-gqa2-untied"])
def test_engine_tokens_unchanged_by_packing(name, tiny_model_dirs, monkeypatch, fast_cpu_settings):
    """Greedy bfloat16 tokens with packed weights equal those with plain ``nn.Linear`` (batch of 3)."""
    from sampling import SamplingParams
    from specdec import LLM

    prompts = [{"prompt_token_ids": [5, 9, 11 + i, 40, 7][: 3 + i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(packed: bool) -> list[list[int]]:
        monkeypatch.setenv("SPECDEC_PACKED_LINEAR", "1" if packed else "0")
        monkeypatch.setenv("SPECDEC_CPU_GEMV", "0")  # the GEMV kernel, where it builds, goes first
        llm = LLM(tiny_model_dirs[name], dtype="bfloat16", skip_tokenizer_init=True)
        n_packed = sum(isinstance(m, PackedLinear) for m in llm.engine.model.modules())
        assert n_packed == (4 * llm.engine.model.cfg.num_layers + 1 if packed else 0)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    assert run(packed=True) == run(packed=False)
