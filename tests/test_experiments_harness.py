"""``experiments/harness.py`` and the six benchmark scripts on it: typed configs composed from Hydra
overrides (defaults as the old argparse options had them, misspelt keys and bad values refused), the
sampler and quantization benchmarks end to end on small settings, the Hydra command line, and the shared
batch-1 timing against ``LLM.generate`` (no timing assertions: benchmarks are measured on an idle
machine, never in tests; no zoo model is loaded)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments import bench_drafters, bench_engine, bench_grammar, bench_quant, bench_sampler, bench_spec
from experiments.harness import HarnessConfig
from specdec.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_the_old_argparse_defaults():
    engine = bench_engine.main.config([])
    assert isinstance(engine, bench_engine.BenchEngineConfig) and isinstance(engine, HarnessConfig)
    assert (engine.model, engine.dtype, engine.max_tokens) == ("smollm2-135m-instruct", "bfloat16", 128)
    assert engine.batch_sizes == [1, 4, 16] and engine.skip_hf_batch is False
    assert (engine.out, engine.threads, engine.seed) == (None, None, 0)

    spec = bench_spec.main.config([])
    assert spec.rows == ["ngram", "draft_model"] and (spec.dtype, spec.k) == ("bfloat16", 4)
    assert (spec.max_tokens, spec.num_prompts, spec.draft_max_tokens, spec.draft_num_prompts) == (
        128,
        8,
        48,
        3,
    )
    assert spec.humaneval == "../shared/humaneval/HumanEval.jsonl.gz"

    sampler = bench_sampler.main.config([])
    assert sampler.repeats == 10 and sampler.vocab_sizes == [49152, 151936] and sampler.rows == [1, 16]

    drafters = bench_drafters.main.config([])
    assert (drafters.model, drafters.prompts, drafters.limit, drafters.per_category) == (
        "smollm2-135m-instruct",
        "heldout",
        24,
        3,
    )
    assert (drafters.max_tokens, drafters.dtype, drafters.ignore_eos, drafters.plot) == (
        96,
        "bfloat16",
        False,
        None,
    )
    assert drafters.methods == [
        "plain",
        "ngram",
        "medusa",
        "medusa-tree",
        "eagle",
        "eagle-tree",
        "eagle3",
        "eagle3-tree",
        "medusa-v8k",
        "eagle-v8k",
        "eagle-v8k-tree",
        "hybrid-eagle",
        "hybrid-eagle3-int8",
        "eagle-v8k-int8",
        "eagle3-int8",
        "medusa-v8k-int8",
        "quantized-int8",
        "quantized-int8-v8k",
    ]
    assert drafters.specbench_path == "../shared/specbench/question.jsonl"

    grammar = bench_grammar.main.config([])
    assert (grammar.per_subset, grammar.max_tokens, grammar.speed_prompts, grammar.speed_max_tokens) == (
        5,
        256,
        4,
        96,
    )
    assert bench_grammar.main.config(["per_subset=null"]).per_subset is None  # the old --all
    assert (grammar.generate_schemas, grammar.modes) == (32, ["plain", "ngram"])
    assert bench_grammar.spread(list(range(10)), 4) == [0, 2, 5, 7]
    assert bench_grammar.spread(list(range(3)), 4) == [0, 1, 2]

    quant = bench_quant.main.config([])
    assert quant.models == ["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"]
    assert quant.decode == ["float32", "bfloat16", "int8", "int4", "int4-g32-zero-point"]
    assert quant.spec == [
        "ngram",
        "quantized_self-int4",
        "quantized_self-int4-g32-zero-point",
        "quantized_self-int8",
        "draft_model",
    ]
    assert (quant.k, quant.max_tokens, quant.num_prompts, quant.kernel_rows) == (4, 128, 8, [1, 5, 16, 128])
    assert (quant.kernels, quant.smoke, quant.threads, quant.bandwidth_gbs) == (False, False, None, None)

    # overrides are typed: lists, bools, null
    engine = bench_engine.main.config(
        ["dtype=float32", "max_tokens=64", "batch_sizes=[1,4]", "skip_hf_batch=true"]
    )
    assert (engine.dtype, engine.max_tokens, engine.batch_sizes, engine.skip_hf_batch) == (
        "float32",
        64,
        [1, 4],
        True,
    )


def test_misspelt_keys_and_bad_values_are_refused():
    with pytest.raises(
        ConfigError, match=r"(?s)bench_engine: Could not override 'max_token'.*keys: .*'max_tokens'"
    ):
        bench_engine.main.config(["max_token=3"])
    with pytest.raises(ConfigError, match=r"(?s)max_tokens=abc.*full_key: max_tokens"):
        bench_engine.main.config(["max_tokens=abc"])
    with pytest.raises(ConfigError, match=r"^max_tokens must be >= 1, got 0$"):
        bench_engine.main.config(["max_tokens=0"])
    with pytest.raises(ConfigError, match=r"dtype must be one of \['float32', 'bfloat16'\], got 'float16'"):
        bench_engine.main.config(["dtype=float16"])
    with pytest.raises(ConfigError, match=r"batch_sizes must include 1"):
        bench_engine.main.config(["batch_sizes=[4,16]"])
    with pytest.raises(ConfigError, match=r"threads must be >= 1 or null, got 0"):
        bench_sampler.main.config(["threads=0"])
    with pytest.raises(ConfigError, match=r"rows must be a non-empty subset of \['ngram', 'draft_model'\]"):
        bench_spec.main.config(["rows=[ngram,medusa]"])
    with pytest.raises(ConfigError, match=r"per_subset must be >= 1 or null"):
        bench_grammar.main.config(["per_subset=0"])
    with pytest.raises(ConfigError, match=r"modes must be a non-empty subset of \['plain', 'ngram'"):
        bench_grammar.main.config(["modes=[plain,medusa]"])
    with pytest.raises(ConfigError, match=r"generate_schemas must be >= 1 or null, got 0"):
        bench_grammar.main.config(["generate_schemas=0"])
    with pytest.raises(ConfigError, match=r"decode must be a non-empty subset of \['float32'"):
        bench_quant.main.config(["decode=[int3]"])
    with pytest.raises(ConfigError, match=r"bandwidth_gbs must be > 0 or null"):
        bench_quant.main.config(["bandwidth_gbs=0"])

    from specdec.drafters.registry import drafter_names

    with pytest.raises(
        ConfigError, match=r"methods must be a non-empty subset of .*unknown: \['nagram'\]"
    ) as e:
        bench_drafters.main.config(["methods=[plain,nagram]"])
    assert all(repr(name) in str(e.value) for name in (*bench_drafters.METHODS, *drafter_names()))
    assert bench_drafters.main.config(["methods=[plain,draft_model]"]).methods == ["plain", "draft_model"]


def test_bench_sampler_end_to_end(tmp_path, capsys):
    out = tmp_path / "sub" / "sampler.json"
    threads_before = torch.get_num_threads()
    result = bench_sampler.main(["vocab_sizes=[1000]", "rows=[1,2]", "repeats=1", "threads=1", f"out={out}"])
    keys = ["vocab_size", "rows", "ours_ms", "hf_ms", "ours_temperature_only_ms", "hf_over_ours"]
    assert [list(r) for r in result["results"]] == [keys, keys]
    assert [(r["vocab_size"], r["rows"]) for r in result["results"]] == [(1000, 1), (1000, 2)]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [list(r) for r in printed] == [keys, keys]
    assert torch.get_num_threads() == threads_before  # restored
    saved = json.loads(out.read_text())
    assert saved["results"] == result["results"]
    info = saved["run_info"]
    assert info["benchmark"] == "bench_sampler" and info["environment"]["torch_threads"] == 1
    assert info["git"]["commit"] and info["versions"]["torch"] and info["seeds"]["torch"] == 0
    assert info["config"]["vocab_sizes"] == [1000] and info["config"]["out"] == str(out)


def test_bench_quant_smoke(tmp_path, capsys):
    results = bench_quant.main(
        ["smoke=true", "threads=1", f"out_dir={tmp_path}", f"out={tmp_path / 'q.json'}"]
    )
    (model,) = [m for m in results if m != "run_info"]
    res = results[model]
    assert (res["num_prompts"], res["max_tokens"], res["threads"]) == (2, 6, 1)
    assert list(res["decode"]) == list(bench_quant.DECODE_ROWS)
    for row in res["decode"].values():
        assert set(row) == {
            "dtype",
            "quantization",
            "tokens_per_s",
            "weight_bytes",
            "step_read_bytes",
            "floor_tokens_per_s",
            "fraction_of_floor",
        }
    spec = res["speculative"]
    assert list(spec) == [
        "plain",
        "ngram",
        "quantized_self-int4",
        "quantized_self-int4-g32-zero-point",
        "quantized_self-int8",
    ]
    assert spec["plain"]["speedup_vs_plain"] == 1.0 and "tau" not in spec["plain"]
    for name in list(spec)[1:]:
        assert spec[name]["matches_plain_greedy"] == 1.0  # greedy speculation is exact
        for key in ("tokens", "time_s", "tokens_per_s", "tau", "acceptance_per_position", "draft_time_s"):
            assert key in spec[name], (name, key)
    out = capsys.readouterr().out
    assert "| weights | activations | tok/s | floor tok/s | of floor |" in out
    assert "| drafter (bf16 target) | tok/s | speedup | τ | matches greedy |" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.json"]  # smoke writes no quant_<model>.json
    assert "run_info" in json.loads((tmp_path / "q.json").read_text())


def test_batch1_timing_equals_llm_generate(tiny_model_dirs, fast_cpu_settings):
    from transformers import AutoModelForCausalLM

    from experiments.harness import (
        ForwardCounter,
        hf_batch1,
        measure_batch1,
        measure_batch1_interleaved,
        time_batch1,
        warm_up,
    )
    from sampling.params import SamplingParams
    from specdec import LLM

    d = tiny_model_dirs["llama-mha-untied"]
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 9], [11, 12, 13, 11, 12, 13], [40, 41, 42, 43, 44]]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(d, skip_tokenizer_init=True)
    expected = [
        list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    ]
    warm_up(llm, prompts[0][:4])
    timed = time_batch1(llm, prompts, sp)
    assert timed.outputs == expected and timed.tokens == 3 * 8 and timed.time_s > 0
    assert len(timed.metrics) == 3
    assert len(timed.seconds) == 3 and sum(timed.seconds) == pytest.approx(timed.time_s)

    row, plain = measure_batch1(
        d, None, prompts, 8, dtype="float32", ignore_eos=True, skip_tokenizer_init=True
    )
    assert plain.outputs == expected and set(row) == {"tokens", "time_s", "tokens_per_s"}
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    row, spec = measure_batch1(
        d, ngram, prompts, 8, dtype="float32", ignore_eos=True, skip_tokenizer_init=True
    )
    assert spec.outputs == expected  # greedy speculation is exact
    assert row["tau"] >= 1.0 and len(row["acceptance_per_position"]) == 3
    assert {"acceptance_rate", "draft_tokens_per_step", "draft_time_s", "verify_time_s"} <= set(row)
    assert "oracle_tau" not in row  # only a drafter with an oracle reports one
    # The hybrid: its oracle (best member per step in hindsight) over the timed prompts, never below τ.
    hybrid = {"method": "hybrid", "num_speculative_tokens": 3}
    row, spec = measure_batch1(
        d, hybrid, prompts, 8, dtype="float32", ignore_eos=True, skip_tokenizer_init=True
    )
    assert spec.outputs == expected
    assert set(row["members_chosen"]) == {"suffix", "ngram"} and sum(row["members_chosen"].values()) > 0
    assert row["oracle_tau"] >= row["tau"] - 1e-9
    # Interleaved (every prompt by every row in turn): the same outputs and fields per row.
    both = measure_batch1_interleaved(
        d, {"plain": None, "ngram": ngram, "hybrid": hybrid}, prompts, 8, dtype="float32", ignore_eos=True,
        skip_tokenizer_init=True, kv_cache_memory_bytes=2**20,
    )  # fmt: skip
    assert all(timed.outputs == expected and len(timed.seconds) == 3 for _, timed in both.values())
    assert set(both["plain"][0]) == {"tokens", "time_s", "tokens_per_s"}
    assert both["ngram"][0]["tau"] >= 1.0 and "oracle_tau" not in both["ngram"][0]
    assert both["hybrid"][0]["oracle_tau"] >= both["hybrid"][0]["tau"] - 1e-9

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    hf_timed = hf_batch1(hf, prompts, 8, ForwardCounter(hf), ignore_eos=True, pad_token_id=0)
    assert hf_timed.outputs == expected and hf_timed.forwards == 3 * 7


def test_rows_share_the_target_unless_told_not_to_or_compiled(tiny_model_dirs, fast_cpu_settings):
    from experiments.harness import interleaved_bytes, shared_or_own
    from specdec import LLM
    from specdec.memory import arch_config, weight_bytes

    d = tiny_model_dirs["llama-mha-untied"]
    built: list[dict] = []

    def build(spec):
        built.append(spec)
        return LLM(d, skip_tokenizer_init=True, speculative_config=spec, kv_cache_memory_bytes=2**20)

    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    plain = LLM(d, skip_tokenizer_init=True, kv_cache_memory_bytes=2**20)
    assert shared_or_own(plain, ngram, build).engine.model is plain.engine.model and not built
    assert shared_or_own(plain, ngram, build, share=False).engine.model is not plain.engine.model
    assert shared_or_own(None, ngram, build).engine.model is not plain.engine.model
    compiled = LLM(d, skip_tokenizer_init=True, kv_cache_memory_bytes=2**20, compile=True)
    assert not compiled.target_shareable and plain.target_shareable
    assert shared_or_own(compiled, ngram, build).engine.model is not compiled.engine.model
    assert built == [ngram] * 3
    # memory: the target (and its packed copy) once when shared, per row when not
    _, held, _ = weight_bytes(arch_config(d), torch.float32)
    assert interleaved_bytes(d, "float32", 3, 100) == 2 * held + 3 * (held // 2 + 100)
    assert interleaved_bytes(d, "float32", 3, 100, share_target=False) == 3 * (2 * held + held // 2 + 100)


def test_hydra_command_line(tmp_path):
    """``python -m experiments.bench_sampler``: a real ``@hydra.main`` (``--cfg job``, ``-m`` sweeps, a
    misspelt key refused), each job writing ``result.json`` into its run directory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "experiments.bench_sampler", *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    sweep = cli(
        "-m",
        "vocab_sizes=[100]",
        "rows=[1]",
        "repeats=1,2",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert sweep.returncode == 0, sweep.stderr
    results = [json.loads((tmp_path / "sweep" / str(i) / "result.json").read_text()) for i in (0, 1)]
    assert [r["run_info"]["config"]["repeats"] for r in results] == [1, 2]
    assert results[1]["run_info"]["hydra"]["overrides"] == ["vocab_sizes=[100]", "rows=[1]", "repeats=2"]
    assert sweep.stdout.count('"hf_over_ours"') == 2
    job = cli("--cfg", "job", "repeats=3", "rows=[2]")
    assert job.returncode == 0, job.stderr
    assert (
        "repeats: 3\n" in job.stdout
        and "rows:\n- 2\n" in job.stdout
        and "vocab_sizes:\n- 49152\n" in job.stdout
    )
    typo = cli("repeat=2", "--cfg", "job")
    assert typo.returncode != 0 and "Key 'repeat' not in 'BenchSamplerConfig'" in typo.stderr


def test_bench_step_tree_and_config():
    from experiments import bench_step

    positions, mask = bench_step.tree_segment_fields(7, start=10)
    # A binary tree filled level by level: depths 0, 1, 1, 2, 2, 2, 2.
    assert positions == [10, 11, 11, 12, 12, 12, 12]
    # Node 5 sees itself, its parent 2 and the root 0 only.
    assert mask[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert mask.sum().item() == 1 + 2 * 2 + 4 * 3
    with pytest.raises(ConfigError, match="tree_nodes"):
        bench_step.main(["tree_nodes=0"])
    with pytest.raises(ConfigError, match="dtype"):
        bench_step.main(["dtype=float16"])


def test_bench_drafters_checks_every_method_before_any_work(monkeypatch):
    """A method whose settings are wrong (``quantized_self`` without a scheme) is a ConfigError before a
    prompt is loaded or a model built; the ``quantized-int8`` row names its scheme."""

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the methods were checked")

    monkeypatch.setattr(bench_drafters, "load_prompts", no_work)
    cfg = bench_drafters.main.config(["methods=[plain,quantized_self]"])
    with pytest.raises(ConfigError, match="quantized_self' needs quantization"):
        bench_drafters.run(cfg)
    assert bench_drafters.method_spec("quantized-int8")["quantization"] == "int8"


def test_bench_drafters_extra_methods(monkeypatch):
    """``extra_methods`` adds named rows (a head of your own beside the shipped one): the row's
    ``speculative_config`` is used as given, ``{model}`` filled in; a clash with a built-in name, a row
    without a method and a wrong setting are ConfigErrors before any work."""

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the methods were checked")

    monkeypatch.setattr(bench_drafters, "load_prompts", no_work)
    mine = "+extra_methods.mine={method: eagle3, num_speculative_tokens: 3, model: /tmp/heads/x-eagle3}"
    cfg = bench_drafters.main.config(["methods=[plain,eagle3,mine]", mine])
    assert cfg.methods == ["plain", "eagle3", "mine"]
    assert bench_drafters.method_spec("mine", cfg.model, cfg.extra_methods) == {
        "method": "eagle3",
        "num_speculative_tokens": 3,
        "model": "/tmp/heads/x-eagle3",
    }
    vocab = "+extra_methods.v={method: eagle, num_speculative_tokens: 4, draft_vocab: '{model}-eagle3'}"
    cfg = bench_drafters.main.config(["methods=[plain,v]", vocab])
    assert bench_drafters.method_spec("v", "tiny", cfg.extra_methods)["draft_vocab"] == "tiny-eagle3"
    with pytest.raises(ConfigError, match="'eagle' is already a method"):
        bench_drafters.main.config(["+extra_methods.eagle={method: eagle}"])
    with pytest.raises(ConfigError, match=r"extra_methods\.x must be a speculative_config"):
        bench_drafters.main.config(["+extra_methods={x: {num_speculative_tokens: 4}}"])
    with pytest.raises(ConfigError, match="unknown: \\['mine'\\]"):
        bench_drafters.main.config(["methods=[plain,mine]"])
    cfg = bench_drafters.main.config(
        ["methods=[plain,bad]", "+extra_methods.bad={method: eagle3, num_speculative_tokens: 0}"]
    )
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        bench_drafters.run(cfg)


def test_bench_drafters_speed_per_category(monkeypatch):
    """Tokens per second per prompt category from each prompt's own seconds, and the speedup over plain per
    category in the result and the table (made-up timings: 2 categories, plain 10 / 20 tok/s, a drafter
    twice as fast on one and level on the other)."""
    from experiments.harness import Timed

    seconds = {None: [1.0, 1.0, 0.5], "ngram": [0.5, 0.5, 0.5]}

    def fake_measure(model, spec, ids, max_tokens, **kwargs):
        name = None if spec is None else spec["method"]
        outs = [[0] * 10, [0] * 10, [0] * 10]
        return {"tokens": 30, "time_s": sum(seconds[name]), "tokens_per_s": 30 / sum(seconds[name])}, Timed(
            outs, sum(seconds[name]), [{}] * 3, seconds=seconds[name]
        )

    monkeypatch.setattr(bench_drafters, "measure_batch1", fake_measure)
    cats = ["code", "code", "chat"]
    row, _ = bench_drafters.run_method("m", None, [[1]] * 3, cats, 10, "float32")
    assert row["tokens_per_s_per_category"] == {"code": 10.0, "chat": 20.0}
    row, _ = bench_drafters.run_method("m", {"method": "ngram"}, [[1]] * 3, cats, 10, "float32")
    assert row["tokens_per_s_per_category"] == {"code": 20.0, "chat": 20.0}
    monkeypatch.setattr(
        bench_drafters, "load_prompts", lambda *a: [type("P", (), {"category": c})() for c in cats]
    )
    monkeypatch.setattr(bench_drafters, "_hf_plain", lambda *a: {"tokens_per_s": 5.0})
    monkeypatch.setattr("experiments.run.load_tokenizer", lambda model: None)
    monkeypatch.setattr("experiments.run.prompt_token_ids", lambda tok, prompts: [[1]] * len(prompts))
    monkeypatch.setattr("specdec.zoo.resolve_model", lambda model: model)
    result = bench_drafters.run(bench_drafters.main.config(["methods=[plain,ngram]", "interleave=false"]))
    assert result["methods"]["ngram"]["speedup_per_category"] == {"code": 2.0, "chat": 1.0}
    assert result["interleaved"] is False
    # Interleaving that would not fit in memory falls back to one row after another (the fake above).
    monkeypatch.setattr(bench_drafters, "interleaved_bytes", lambda *a: 10**12)
    monkeypatch.setattr(bench_drafters, "available_bytes", lambda: 10**9)
    fallback = bench_drafters.run(bench_drafters.main.config(["methods=[plain,ngram]"]))
    assert (
        fallback["interleaved"] is False
        and fallback["methods"]["ngram"]["speedup_per_category"]["code"] == 2.0
    )
    table = bench_drafters.format_table(result)
    assert "| code | 2.00× |" in table and "| chat | 1.00× |" in table
    # Paired prompt by prompt against compare_to (plain): ratios 2, 2 (code) and 1 (chat), no spread.
    paired = result["methods"]["ngram"]["paired_speedup_per_category"]
    assert paired["code"] == pytest.approx([2.0, 2.0, 2.0, 2])
    assert paired["chat"][0] == pytest.approx(1.0) and math.isnan(paired["chat"][1])  # n = 1: no interval
    assert paired["chat"][3] == 1
    assert paired["all"][0] == pytest.approx(2 ** (2 / 3)) and paired["all"][3] == 3
    assert "paired speedup over plain" in table and "| code | 2.00× (2.00-2.00, n = 2) |" in table
    assert "| chat | 1.00× (n = 1) |" in table
    with pytest.raises(ConfigError, match="compare_to"):
        bench_drafters.main.config(["methods=[plain,ngram]", "compare_to=ngarm"])
    # transformers=false: no reference row, the ratios to it None, the table says so.
    monkeypatch.setattr(bench_drafters, "_hf_plain", lambda *a: pytest.fail("transformers ran"))
    no_hf = bench_drafters.run(bench_drafters.main.config(["methods=[plain,ngram]", "transformers=false"]))
    assert "transformers_plain" not in no_hf and no_hf["methods"]["ngram"]["speedup_vs_transformers"] is None
    assert no_hf["methods"]["ngram"]["speedup_per_category"]["code"] == 2.0
    assert "transformers plain: not run" in bench_drafters.format_table(no_hf)


def test_bench_drafters_tokens_per_forward_counts_steps_that_did_not_draft():
    """τ per category counts draft steps only; tokens per forward counts every sampling step: a drafter
    that sat out half its steps (prompt lookup without a match) has τ 3 but 2 tokens per forward."""
    from experiments.harness import Timed

    metrics = [
        {"num_accepted_tokens": 4, "num_drafts": 2, "num_steps": 4},  # code: 8 tokens in 4 forwards
        {"num_accepted_tokens": 2, "num_drafts": 2, "num_steps": 2},  # chat: drafted every step
    ]
    timed = Timed([[0] * 8, [0] * 4], 2.0, metrics, seconds=[1.0, 1.0])
    row = bench_drafters.with_categories({"tau": 2.5, "tokens_per_step": 2.0}, timed, ["code", "chat"])
    assert row["tau_per_category"] == {"code": 3.0, "chat": 2.0}
    assert row["tokens_per_step_per_category"] == {"code": 2.0, "chat": 2.0}
    result = {
        "num_prompts": 2,
        "prompts": "p",
        "max_tokens": 8,
        "methods": {"d": {**row, "tokens_per_s": 6.0, "speedup_vs_plain": 1.5}},
    }
    table = bench_drafters.format_table(result)
    assert "| d | 6.0 | 1.50× | - | 2.50 | 2.00 |" in table
    assert "tokens per target forward per category" in table and "| code | 2.00 |" in table


def test_paired_speedups_match_a_t_interval_on_log_ratios():
    """bench_drafters.paired_speedups: per category the geometric mean of per-prompt speed ratios and
    its 95 % interval equal scipy's one-sample t interval on the log ratios, exponentiated (8 made-up
    prompts of one category, output lengths differing between the rows: tokens per second, not seconds,
    are paired); a category of one prompt has no interval; lists of different lengths are an error."""
    from scipy import stats

    ratios = [1.10, 1.02, 0.97, 1.21, 1.05, 1.13, 0.99, 1.08]
    ref = {"tokens_per_prompt": [50] * 9, "seconds_per_prompt": [1.0] * 9}
    row = {
        "tokens_per_prompt": [40] * 8 + [50],
        "seconds_per_prompt": [40 / (50 * r) for r in ratios] + [0.5],
    }
    got = bench_drafters.paired_speedups(ref, row, ["qa"] * 8 + ["rag"])
    logs = [math.log(r) for r in ratios]
    lo, hi = stats.ttest_1samp(logs, 0.0).confidence_interval(0.95)
    assert got["qa"] == pytest.approx([math.exp(sum(logs) / 8), math.exp(lo), math.exp(hi), 8])
    assert got["rag"][0] == pytest.approx(2.0) and math.isnan(got["rag"][1]) and got["rag"][3] == 1
    assert got["all"][1] < got["all"][0] < got["all"][2] and got["all"][3] == 9
    with pytest.raises(ValueError, match="lengths"):  # a prompt missing from one row: not paired silently
        bench_drafters.paired_speedups(ref, {k: v[:8] for k, v in row.items()}, ["qa"] * 8 + ["rag"])


def test_engines_unequal_on_huge_pages_are_flagged():
    """Engines compared in one process must stream their weights through the same page size: a refused
    window, or one engine collapsed and another not, is a warning naming them; alike engines (all
    collapsed, or none asked) give none."""
    from types import SimpleNamespace

    from experiments.harness import huge_page_fields, unequal_huge_pages
    from specdec.engine.huge_pages import HugePageStats

    ok = huge_page_fields(SimpleNamespace(huge_pages=HugePageStats(collapsed_bytes=6_642_000_000)))
    assert ok == {"collapsed_mb": 6642.0, "refused_mb": 0.0, "reason": ""}
    short = huge_page_fields(
        SimpleNamespace(huge_pages=HugePageStats(collapsed_bytes=6_986_000_000, refused_bytes=1_923_000_000))
    )
    off = huge_page_fields(SimpleNamespace(huge_pages=None))
    assert off is None
    assert unequal_huge_pages({"plain": ok, "ngram": ok}) is None
    few = {"collapsed_mb": 552.0, "refused_mb": 2.0, "reason": ""}  # a window or two: not a warning
    assert unequal_huge_pages({"plain": few, "ngram": ok}) is None
    assert unequal_huge_pages({"plain": off, "ngram": off}) is None
    warning = unequal_huge_pages({"plain": ok, "draft_model": short})
    assert warning is not None and "draft_model: 1923 MB refused" in warning and "huge_pages=false" in warning
    warning = unequal_huge_pages({"plain": ok, "ngram": off})
    assert warning is not None and "ngram: none collapsed" in warning and "plain" not in warning.split("(")[1]
