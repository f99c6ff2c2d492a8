"""The memory calculator (:mod:`specdec.memory`) against what the engine actually allocates and admits.

- KV bytes per token: for every zoo model (config only), float32 and bfloat16, KV ``"auto"`` and
  ``"int8"``, equal to the bytes of the KV tensors the engine's ``ModelRunner`` allocates, per token.
- Weight bytes: equal to the bytes of the tensors a quantized or dense model holds after loading (tiny
  models in every scheme and dtype, and the real SmolLM2 in bfloat16 int4).
- Requests a budget holds: the engine sizes its pool from the same KV budget to the same number of
  blocks, runs that many requests of ``context`` tokens without preemption, and preempts with one more.
"""

from __future__ import annotations

import json

import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from specdec.errors import ConfigError
from specdec.memory import arch_config, estimate, main, measure_read_bandwidth, weight_bytes
from specdec.model_runner import ModelRunner
from specdec.models.loader import load_model
from specdec.quantization.config import QuantizationConfig
from specdec.zoo import ZOO

BANDWIDTH = 30e9  # given, so no test measures the machine


class _ConfigOnly(torch.nn.Module):
    """Stands in for a model where ``ModelRunner`` reads only ``cfg`` and the first parameter's device and
    dtype: the engine's own KV allocation for a zoo model without loading its weights."""

    def __init__(self, cfg, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=dtype))


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_kv_bytes_per_token_equal_the_engines_allocation(name, dtype, kv_cache_dtype):
    cfg = arch_config(name)
    num_blocks, block_size = 3, 16
    runner = ModelRunner(
        _ConfigOnly(cfg, getattr(torch, dtype)), num_blocks, block_size, kv_cache_dtype=kv_cache_dtype
    )
    allocated = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    est = estimate(name, 100, dtype=dtype, kv_cache_dtype=kv_cache_dtype, bandwidth_bytes_per_s=BANDWIDTH)
    assert est.kv_bytes_per_token * num_blocks * block_size == allocated
    assert est.kv_bytes_per_token * 100 == est.kv_bytes_per_request
    assert (
        ModelRunner.kv_bytes_per_block(runner.model, block_size, runner.dtype, kv_cache_dtype)
        == est.kv_bytes_per_block
    )
    elem = 1 if kv_cache_dtype == "int8" else torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_head = cfg.head_dim * elem + (4 if kv_cache_dtype == "int8" else 0)
    assert est.kv_bytes_per_token == cfg.num_layers * 2 * cfg.num_kv_heads * per_head


def test_smollm2_kv_bytes_per_token_figures():
    """The figures quoted in :mod:`specdec.quantization.kv_cache`."""
    got = {
        (dt, kv): estimate(
            "smollm2-135m-instruct", 1, dtype=dt, kv_cache_dtype=kv, bandwidth_bytes_per_s=BANDWIDTH
        ).kv_bytes_per_token
        for dt, kv in (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8"))
    }
    assert got == {("float32", "auto"): 46080, ("bfloat16", "auto"): 23040, ("bfloat16", "int8"): 12240}


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter and buffer (tied tensors once; the RoPE table is not a weight)."""
    seen: dict[int, int] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name == "inv_freq":
            continue
        seen[t.data_ptr()] = t.nbytes
    return sum(seen.values())


QUANTIZATIONS = [
    None,
    {"method": "int8"},
    {"method": "int4", "group_size": 32},
    {"method": "int4", "group_size": 32, "zero_point": True},
    {"method": "int8", "lm_head": False},
    {"method": "int4", "group_size": 32, "lm_head": False, "kernel": "reference"},
]


@pytest.mark.parametrize("model_name", ["llama-gqa3-tied", "qwen2-gqa2-untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "quantization", QUANTIZATIONS, ids=lambda q: "dense" if q is None else "-".join(map(str, q.values()))
)
def test_weight_bytes_equal_the_loaded_model(tiny_model_dirs, model_name, dtype, quantization):
    d = tiny_model_dirs[model_name]
    qconfig = QuantizationConfig.from_any(quantization)
    model = load_model(d, dtype, quantization=qconfig)
    num_params, held, _ = weight_bytes(arch_config(d), dtype, qconfig)
    assert held == _held_bytes(model)
    dense = load_model(d, torch.float32)
    assert num_params == sum(p.numel() for p in dense.parameters())  # parameters() counts tied ones once


def test_weight_bytes_smollm2_int4(smollm2_dir):
    qconfig = QuantizationConfig("int4")
    model = load_model(smollm2_dir, torch.bfloat16, quantization=qconfig)
    est = estimate(smollm2_dir, 64, dtype="bfloat16", quantization=qconfig, bandwidth_bytes_per_s=BANDWIDTH)
    assert est.weight_bytes == _held_bytes(model)
    # Read per step: everything but the embedding table, of which one row per request.
    table = model.embed_tokens.weight.nbytes
    assert est.weight_read_bytes == est.weight_bytes - table + 576 * 2


def test_dense_bfloat16_smollm2_is_the_readme_figure():
    """269 MB held and read per step (the tied head reads the embedding table), as README's floor."""
    est = estimate("smollm2-135m-instruct", 1, dtype="bfloat16", bandwidth_bytes_per_s=BANDWIDTH)
    assert est.weight_bytes == est.weight_read_bytes == 2 * est.num_params
    assert round(est.weight_bytes / 1e6) == 269
    assert est.step_read_bytes == est.weight_read_bytes + est.kv_bytes_per_token
    assert est.floor_step_s == pytest.approx(est.step_read_bytes / BANDWIDTH)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_requests_that_fit_equal_what_the_engine_admits_before_preempting(tiny_model_dirs, kv_cache_dtype):
    """A KV budget of 22.05 float32 blocks: the calculator says how many requests of 16 tokens of KV
    (prompt 6, max_tokens 11) fit; the engine, sized from the same budget, runs exactly that many without
    preemption and preempts with one more."""
    d = tiny_model_dirs["qwen2-gqa2-untied"]  # 2 layers, 2 KV heads of 16: 512 bytes/token in float32
    block_size, prompt_len, max_tokens = 4, 6, 11
    budget = 22 * 512 * block_size + 100
    est = estimate(
        d,
        prompt_len + max_tokens - 1,
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        kv_cache_memory_bytes=budget,
        bandwidth_bytes_per_s=BANDWIDTH,
    )
    expected = {"auto": (22, 5), "int8": (70, 17)}[kv_cache_dtype]  # 2048 / 640 bytes per block
    assert (est.num_kv_blocks, est.max_requests) == expected
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for n, preempts in ((est.max_requests, False), (est.max_requests + 1, True)):
        llm = LLM(
            d,
            skip_tokenizer_init=True,
            block_size=block_size,
            kv_cache_memory_bytes=budget,
            kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=False,
            max_num_seqs=64,
            max_model_len=256,
        )
        assert llm.engine.num_kv_blocks == est.num_kv_blocks
        prompts = [
            {"prompt_token_ids": torch.randint(3, 128, (prompt_len,), generator=g).tolist()} for _ in range(n)
        ]
        outs = llm.generate(prompts, sp)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        assert (llm.engine.scheduler.num_preemptions > 0) == preempts, (
            n,
            llm.engine.scheduler.num_preemptions,
        )


def test_memory_budget_counts_the_weights_first(tiny_model_dirs):
    d = tiny_model_dirs["qwen2-gqa2-untied"]
    est = estimate(d, 16, dtype="float32", block_size=4, memory_bytes=10**6, bandwidth_bytes_per_s=BANDWIDTH)
    assert est.kv_budget_bytes == 10**6 - est.weight_bytes
    assert est.num_kv_blocks == est.kv_budget_bytes // 2048
    small = estimate(
        d, 16, dtype="float32", memory_bytes=est.weight_bytes - 1, bandwidth_bytes_per_s=BANDWIDTH
    )
    assert small.max_requests == 0


def test_cli_prints_json(tiny_model_dirs, capsys):
    d = tiny_model_dirs["llama-gqa3-tied"]
    args = ["--model", str(d), "--context", "40", "--batch", "3", "--dtype", "float32"]
    args += ["--quantization", "int4", "--group-size", "32", "--kv-cache-dtype", "int8"]
    est = main(args + ["--bandwidth-gbs", "12.5", "--kv-memory-gib", "0.001", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["weight_bytes"] == est.weight_bytes and out["quantization"] == "int4 g32"
    assert out["bandwidth_bytes_per_s"] == 12.5e9 and out["bandwidth_measured"] is False
    assert out["floor_tokens_per_s"] == pytest.approx(3 / (out["step_read_bytes"] / 12.5e9))
    assert out["max_requests"] == int(0.001 * 1024**3) // out["kv_bytes_per_block"] // 3


def test_bad_arguments_are_rejected(tiny_model_dirs):
    d = tiny_model_dirs["llama-gqa3-tied"]
    for kwargs in ({"context": 0}, {"context": 8, "batch": 0}, {"context": 8, "kv_cache_dtype": "int4"},
                   {"context": 8, "quantization": "int4"}, {"context": 8, "memory_bytes": -1},
                   {"context": 8, "bandwidth_bytes_per_s": 0.0}):  # fmt: skip
        with pytest.raises(ConfigError):
            estimate(d, **{"bandwidth_bytes_per_s": BANDWIDTH, **kwargs})


@pytest.mark.parametrize("huge_pages", [False, True])
def test_measure_read_bandwidth_is_positive(huge_pages):
    assert measure_read_bandwidth(num_bytes=1 << 24, repeats=2, huge_pages=huge_pages) > 0
