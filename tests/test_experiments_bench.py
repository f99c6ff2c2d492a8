"""``experiments.bench`` on tiny random models: every row, the derived columns and the run directory
(no timing assertions: benchmarks are measured on an idle machine, never in tests)."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

from experiments.config import BenchConfig, register_configs, to_bench_config


@pytest.fixture(scope="module")
def hydra_conf():
    register_configs()
    with initialize_config_module(config_module="experiments.conf", version_base=None):
        yield


def bench_cfg(*overrides: str) -> BenchConfig:
    return to_bench_config(compose(config_name="bench", overrides=list(overrides)))


def test_bench_defaults_and_errors(hydra_conf):
    cfg = bench_cfg()
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.methods == ["plain", "ngram"]
    assert cfg.concurrency == [1, 4, 16] and cfg.dataset.limit == 8
    assert cfg.speculative_config("plain") is None
    assert cfg.speculative_config("ngram") == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    qwen = bench_cfg("model=qwen2.5-coder-1.5b-instruct", "methods=[plain,draft_model]")
    assert qwen.speculative_config("draft_model") == {
        "method": "draft_model",
        "model": "qwen2.5-coder-0.5b-instruct",
        "num_speculative_tokens": 4,
    }
    with pytest.raises(ValueError, match=r"methods must be a non-empty subset"):
        bench_cfg("methods=[plain,medusa]")
    with pytest.raises(ValueError, match=r"has no default draft model: set draft_model="):
        bench_cfg("methods=[draft_model]")
    mismatch = r"draft_model=qwen2\.5-coder-0\.5b-instruct does not fit.*vocabulary \(151936 tokens\) differs"
    with pytest.raises(ValueError, match=mismatch):
        bench_cfg("methods=[draft_model]", "draft_model=qwen2.5-coder-0.5b-instruct")
    with pytest.raises(ValueError, match=r"concurrency"):
        bench_cfg("concurrency=[0]")
    with pytest.raises(ValueError, match=r"num_speculative_tokens"):
        bench_cfg("num_speculative_tokens=0")
    with pytest.raises(ConfigCompositionException, match=r"max_token"):
        bench_cfg("max_token=3")


def test_bench_tiny_models(hydra_conf, tiny_model_dirs, tmp_path):
    from experiments.bench import run_bench

    target, draft = tiny_model_dirs["llama-gqa3-tied"], tiny_model_dirs["llama-mha-untied"]
    cfg = bench_cfg(
        f"model.name={target}",
        "dataset=synthetic",
        "dataset.limit=2",
        "dataset.prompt_len=16",
        "methods=[plain,ngram,draft_model]",
        f"draft_model={draft}",
        "concurrency=[1,3]",
        "transformers_static_batch=[2]",
        "max_tokens=6",
        "engine=cpu",
        "engine.dtype=float32",
        "engine.torch_threads=1",
        "bandwidth_bytes=1048576",
    )
    result = run_bench(cfg, out_dir=tmp_path)
    rows = {(r["system"], r["method"], r["concurrency"]): r for r in result["rows"]}
    assert set(rows) == {
        *((s, m, 1) for s in ("specdec", "transformers") for m in ("plain", "ngram", "draft_model")),
        *(("specdec", m, 3) for m in ("plain", "ngram", "draft_model")),
        ("transformers", "plain (static batch)", 2),
    }
    floor = result["floor"]
    assert floor["weight_bytes"] == sum(p.numel() * 4 for p in _hf_params(target))
    assert floor["tokens_per_s_batch1"] == pytest.approx(
        floor["read_bandwidth_GBps"] * 1e9 / floor["weight_bytes"]
    )
    for (system, method, c), r in rows.items():
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0
        base = rows.get((system, "plain", c)) or r
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
        assert r["floor_tokens_per_s"] == pytest.approx(c * floor["tokens_per_s_batch1"])
        if system == "specdec" and c == 1:
            other = rows[("transformers", method, 1)]
            assert r["ratio_vs_transformers"] == pytest.approx(r["tokens_per_s"] / other["tokens_per_s"])
        if method in ("ngram", "draft_model"):
            assert r["tau"] is not None and r["tau"] >= 1.0
    # float32 greedy: every batch-1 row, transformers' included, reproduces specdec's plain outputs
    assert all(rows[(s, m, 1)]["greedy_equal"] for s in ("specdec", "transformers") for m in cfg.methods)
    assert rows[("specdec", "ngram", 1)]["acceptance_rate"] is not None
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["kind"] == "bench" and len(saved["rows"]) == len(rows)
    assert saved["git"] and saved["versions"]["transformers"] and saved["seeds"]["engine"] == 0
    table = (tmp_path / "bench.md").read_text()
    assert table == result["table"]
    assert "| transformers | ngram (prompt_lookup_num_tokens, k=4) | 1 (alone) |" in table
    assert "| specdec | draft_model (k=4) | 3 |" in table
    for name in ("config.yaml", "run_info.json"):
        assert (tmp_path / name).is_file()


def _hf_params(model_dir):
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def test_bench_engine_reads_llama_cpp_when_built(tmp_path):
    """The llama.cpp peer row: skipped with a reason where the peer is not built, parsed from
    ``llama-bench -o json`` where it is (a stand-in script prints its output here)."""
    import stat

    from experiments.bench_engine import BenchEngineConfig, bench_llama_cpp

    cfg = BenchEngineConfig(llama_cpp_dir=str(tmp_path), max_tokens=16)
    assert "absent" in bench_llama_cpp(cfg, 10**8)["llama_cpp_skipped"]
    assert "null" in bench_llama_cpp(BenchEngineConfig(llama_cpp_dir=None), 10**8)["llama_cpp_skipped"]
    (tmp_path / "build" / "bin").mkdir(parents=True)
    (tmp_path / "smollm2-bf16.gguf").write_bytes(b"")
    fake = tmp_path / "build" / "bin" / "llama-bench"
    tests = '[{"n_prompt": 512, "n_gen": 0, "avg_ts": 650.0}, {"n_prompt": 0, "n_gen": 16, "avg_ts": 101.5}]'
    fake.write_text(f"#!/bin/sh\necho '{tests}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    row = bench_llama_cpp(cfg, 2 * 10**8)
    assert row["llama_cpp_tokens_per_s_batch1"] == 101.5
    assert row["llama_cpp_prefill_tokens_per_s"] == 650.0
    assert row["llama_cpp_GBps"] == pytest.approx(20.3)
    assert "-p 512 -n 16" in row["llama_cpp_command"]
    fake.write_text('#!/bin/sh\necho \'[{"n_gen": 16, "avg_ts": 101.5}]\'\n')  # prefill skipped (-p 0)
    row = bench_llama_cpp(cfg, 2 * 10**8)
    assert row["llama_cpp_tokens_per_s_batch1"] == 101.5 and "llama_cpp_prefill_tokens_per_s" not in row
    other = BenchEngineConfig(llama_cpp_dir=str(tmp_path), model="qwen2.5-coder-0.5b-instruct")
    assert "SmolLM2 only" in bench_llama_cpp(other, 10**8)["llama_cpp_skipped"]
