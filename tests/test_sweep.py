"""Hydra multiruns of ``python -m experiments.run`` on a tiny random model, in this process: the local
launcher and Ray's, figures and table of the sweep, wandb offline and ``logger=none``, and config errors
raised before any model loads."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import make_tiny_hf_model

#: The sweep of the issue, scaled down: 2 drafters x 2 draft lengths, 4 synthetic prompts, CPU.
DRAFTERS = ("ngram", "tiny_draft")
KS = (1, 2)
COMMON = [
    "model=tiny",
    "dataset=synthetic",
    "dataset.limit=4",
    "dataset.prompt_len=24",
    "max_tokens=12",
    "sampling.ignore_eos=true",
    "engine=cpu",
    "engine.torch_threads=1",
]
#: What a speculative run measures without a clock: equal across launchers.
EXACT_KEYS = (
    "num_prompts",
    "tokens_baseline",
    "tokens_spec",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "accepted_per_position_counts",
    "accepted_per_position",
    "acceptance_rate",
    "mean_acceptance_length",
    "greedy_equal",
)
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens, every connection is refused


@pytest.fixture(scope="module")
def tiny_conf(tmp_path_factory) -> Path:
    """A config directory (added with ``hydra.searchpath``) with ``model=tiny`` (a random Llama) and
    ``drafter=tiny_draft`` (a draft model: the same weights, slightly perturbed)."""
    root = tmp_path_factory.mktemp("tiny_sweep")
    target = make_tiny_hf_model("llama", 4, 2, True, seed=0)
    draft = make_tiny_hf_model("llama", 4, 2, True, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    target.save_pretrained(root / "target", safe_serialization=True)
    draft.save_pretrained(root / "draft", safe_serialization=True)
    conf = root / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "drafter").mkdir()
    (conf / "model" / "tiny.yaml").write_text(
        f"defaults:\n  - /schema/model/model@_here_\n  - _self_\nname: {root / 'target'}\ndtype: float32\n"
    )
    (conf / "drafter" / "tiny_draft.yaml").write_text(
        f"defaults:\n  - draft_model\n  - _self_\nmodel: {root / 'draft'}\n"
    )
    return conf


@contextmanager
def cli(argv: list[str], cwd: Path, env: dict[str, str] | None = None, unset: tuple[str, ...] = ()):
    """Run ``python -m experiments.run ARGV`` in this process (errors raised as themselves)."""
    from hydra.core.global_hydra import GlobalHydra

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setenv("HYDRA_FULL_ERROR", "1")
        for k, v in (env or {}).items():
            mp.setenv(k, v)
        for k in unset:
            mp.delenv(k, raising=False)
        mp.setattr(sys, "argv", ["experiments/run.py", *argv])
        GlobalHydra.instance().clear()
        try:
            yield
        finally:
            GlobalHydra.instance().clear()


def run_main(argv: list[str], cwd: Path, **kwargs: Any) -> None:
    from experiments.run import main

    with cli(argv, cwd, **kwargs):
        main()


def sweep_args(conf: Path, sweep_dir: Path, drafters=DRAFTERS, ks=KS) -> list[str]:
    return [
        "-m",
        f"hydra.searchpath=[file://{conf}]",
        *COMMON,
        f"drafter={','.join(drafters)}",
        f"drafter.num_speculative_tokens={','.join(map(str, ks))}",
        f"hydra.sweep.dir={sweep_dir}",
    ]


def job_summaries(sweep_dir: Path) -> dict[tuple[str, int], dict[str, Any]]:
    out = {}
    for f in sorted(sweep_dir.glob("*/summary.json")):
        s = json.loads(f.read_text())
        out[(s["drafter"], s["config"]["drafter"]["num_speculative_tokens"])] = s
    return out


def wandb_env(tmp: Path) -> dict[str, str]:
    """wandb with no reachable server, and its caches out of the home directory."""
    return {
        "WANDB_BASE_URL": UNREACHABLE,
        "HTTP_PROXY": UNREACHABLE,
        "HTTPS_PROXY": UNREACHABLE,
        "WANDB_CONFIG_DIR": str(tmp / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp / "wandb_data"),
        "WANDB_SILENT": "true",
    }


WANDB_UNSET = ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_DISABLED")


def read_run(run_dir: Path, key: str, timeout_s: float = 20.0) -> dict[str, Any]:
    """The offline run, once wandb's service process has written its exit record and ``key``
    (``run.finish()`` may return just before the file is complete)."""
    import time

    from experiments.tracking import read_offline_run

    deadline = time.monotonic() + timeout_s
    while True:
        run = read_offline_run(run_dir)
        if (run["finished"] and key in run["summary"]) or time.monotonic() > deadline:
            return run
        time.sleep(0.2)


@pytest.fixture(scope="module")
def local_sweep(tiny_conf, tmp_path_factory) -> Path:
    """The 4-job multirun on Hydra's local launcher, logger=none (the default)."""
    work = tmp_path_factory.mktemp("local_sweep")
    sweep_dir = work / "multirun"
    run_main(sweep_args(tiny_conf, sweep_dir), work)
    return sweep_dir


# ------------------------------------------------------------------------------------ local sweep
def test_local_multirun_writes_every_job_and_the_aggregate(local_sweep):
    jobs = sorted(p for p in local_sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert [p.name for p in jobs] == ["0", "1", "2", "3"]
    for job in jobs:
        for name in ("summary.json", "results.jsonl", "config.yaml", "run_info.json"):
            assert (job / name).is_file(), f"{job / name} missing"
        info = json.loads((job / "run_info.json").read_text())
        assert info["git"]["commit"] is None or len(info["git"]["commit"]) == 40
        assert info["versions"]["torch"] == torch.__version__
        assert info["seeds"]["engine"] == 0 and info["environment"]["device"] == "cpu"
        assert info["hydra"]["mode"] == "MULTIRUN"
        assert {p.name for p in (job / "plots").iterdir()} == {
            f"{n}.{ext}"
            for n in ("acceptance_per_position", "acceptance_per_category")
            for ext in ("png", "svg")
        }
    summaries = job_summaries(local_sweep)
    assert set(summaries) == {(d, k) for d in ("ngram", "draft_model") for k in KS}
    for (_, k), s in summaries.items():
        assert s["greedy_equal"] is True  # float32 greedy: speculation changes nothing
        assert s["tokens_spec"] == s["tokens_baseline"] == 4 * 12
        assert len(s["accepted_per_position"]) == k
        assert set(s["per_category"]) == {"repeat", "random"}
        assert s["environment"]["device"] == "cpu"
    assert summaries[("draft_model", 2)]["num_accepted_tokens"] > 0
    plots = local_sweep / "plots"
    from experiments.plot import FIGURES

    for name in FIGURES:
        if name == "acceptance_vs_temperature":  # every job samples at one temperature: not drawn
            assert not (plots / f"{name}.png").exists()
            continue
        for ext in ("png", "svg"):
            assert (plots / f"{name}.{ext}").stat().st_size > 1000
    table = (plots / "results.md").read_text()
    assert table.count("\n") == 2 + 4 and "| draft_model | 2 |" in table


def test_plot_numbers_equal_the_summaries(local_sweep):
    from experiments.plot import aggregate, expected_tau, fit_alpha

    summaries = job_summaries(local_sweep)
    saved = json.loads((local_sweep / "plots" / "aggregate.json").read_text())
    again = aggregate([local_sweep], local_sweep / "plots_again", formats=["png"])
    for result in (saved, again):
        figs = result["figures"]
        positions = figs["acceptance_per_position"]["values"]
        assert positions == {f"{d} k={k}": s["accepted_per_position"] for (d, k), s in summaries.items()}
        groups = figs["tau_speedup_vs_k"]["groups"]
        assert set(groups) == {"ngram", "draft_model"}
        for name, g in groups.items():
            assert g["k"] == list(KS)
            assert g["tau"] == [summaries[(name, k)]["mean_acceptance_length"] for k in KS]
            assert g["speedup"] == [summaries[(name, k)]["speedup"] for k in KS]
            assert g["alpha"] == pytest.approx(fit_alpha(g["k"], g["tau"]))
            assert g["model_tau"][0] == pytest.approx(expected_tau(g["alpha"], 1))
        categories = figs["acceptance_per_category"]["values"]
        for (d, k), s in summaries.items():
            assert categories[f"{d} k={k}"] == {c: m["acceptance_rate"] for c, m in s["per_category"].items()}
        temps = figs["acceptance_vs_temperature"]["groups"]
        assert temps["ngram k=1"]["acceptance_rate"] == [summaries[("ngram", 1)]["acceptance_rate"]]
        drafters = figs["drafters"]["drafters"]
        for d in ("ngram", "draft_model"):
            best = max((summaries[(d, k)] for k in KS), key=lambda s: s["speedup"])
            assert drafters[d]["speedup"] == best["speedup"]
            assert drafters[d]["tau"] == best["mean_acceptance_length"]
        rows = {(r["drafter"], r["k"]): r for r in result["rows"]}
        for key, s in summaries.items():
            assert rows[key]["tokens_per_s_spec"] == s["tokens_per_s_spec"]
            assert rows[key]["mean_acceptance_length"] == s["mean_acceptance_length"]
    assert (local_sweep / "plots_again" / "drafters.png").is_file()
    assert not (local_sweep / "plots_again" / "drafters.svg").exists()


def test_logger_none_creates_nothing(local_sweep):
    assert not list(local_sweep.rglob("wandb")) and not list(local_sweep.rglob("*.wandb"))
    assert not (local_sweep.parent / "wandb").exists()
    assert {p.name for p in local_sweep.parent.iterdir()} == {"multirun"}  # nothing outside the sweep dir


# --------------------------------------------------------------------------------------------- ray
@pytest.fixture
def local_ray(tmp_path):
    """A local Ray instance with 2 CPUs, started and stopped by this test."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    if ray.is_initialized():
        pytest.skip("a Ray instance is already running in this process")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in wandb_env(tmp_path).items():  # inherited by Ray's workers
            mp.setenv(k, v)
        for k in WANDB_UNSET:
            mp.delenv(k, raising=False)
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=78643200,
            configure_logging=False,
        )
        try:
            yield ray
        finally:
            ray.shutdown()


def test_ray_launcher_equals_local_and_logs_wandb_offline(local_sweep, local_ray, tiny_conf, tmp_path):
    from experiments.tracking import offline_runs

    sweep_dir = tmp_path / "ray_sweep"
    args = sweep_args(tiny_conf, sweep_dir, DRAFTERS, (2,))
    args += ["hydra/launcher=ray", "logger=wandb"]
    run_main(args, tmp_path, env=wandb_env(tmp_path), unset=WANDB_UNSET)
    assert local_ray.is_initialized()  # the launcher used the instance this test started
    ray_runs = job_summaries(sweep_dir)
    local_runs = job_summaries(local_sweep)
    assert set(ray_runs) == {("ngram", 2), ("draft_model", 2)}
    for key, s in ray_runs.items():
        for field in EXACT_KEYS:
            assert s[field] == local_runs[key][field], (key, field)
        assert s["environment"]["ray_gpu_ids"] == []  # a Ray task granted no GPU runs on the CPU
        assert s["environment"]["device"] == "cpu"
    for job in ("0", "1"):
        ray_ids = [
            json.loads(line)["spec"]["token_ids"] for line in (sweep_dir / job / "results.jsonl").open()
        ]
        s = json.loads((sweep_dir / job / "summary.json").read_text())
        local_job = next(
            p.parent
            for p in local_sweep.glob("*/summary.json")
            if json.loads(p.read_text())["drafter"] == s["drafter"]
            and json.loads(p.read_text())["config"]["drafter"]["num_speculative_tokens"] == 2
        )
        local_ids = [json.loads(line)["spec"]["token_ids"] for line in (local_job / "results.jsonl").open()]
        assert ray_ids == local_ids
        # each job logged and finished its own offline wandb run, under its own directory
        (run_dir,) = offline_runs(sweep_dir / job / "wandb")
        run = read_run(run_dir, "speedup")
        assert run["finished"] and run["config"]["drafter"]["method"] == s["drafter"]
        assert run["summary"]["mean_acceptance_length"] == pytest.approx(s["mean_acceptance_length"])
        assert run["summary"]["speedup"] == pytest.approx(s["speedup"])
        assert len([h for h in run["history"] if "spec/mean_acceptance_length" in h]) == 4
    assert (sweep_dir / "plots" / "tau_speedup_vs_k.png").is_file()
    (aggregate_run,) = offline_runs(sweep_dir / "wandb")  # the sweep's figures, logged on the driver
    assert read_run(aggregate_run, "plots/drafters/_type")["summary"]["plots/drafters/_type"] == "image-file"


# ------------------------------------------------------------------------------------------- wandb
def test_wandb_offline_without_network(tiny_conf, tmp_path):
    from experiments.tracking import offline_runs

    run_dir = tmp_path / "run"
    args = [f"hydra.searchpath=[file://{tiny_conf}]", *COMMON, "drafter=ngram", "logger=wandb"]
    run_main([*args, f"hydra.run.dir={run_dir}"], tmp_path, env=wandb_env(tmp_path), unset=WANDB_UNSET)
    summary = json.loads((run_dir / "summary.json").read_text())
    (offline,) = offline_runs(run_dir / "wandb")
    assert offline.name.startswith("offline-run-")
    run = read_run(offline, "plots/acceptance_per_position/_type")
    assert run["finished"] and run["project"] == "specdec"
    assert run["config"]["drafter"]["method"] == "ngram" and run["config"]["max_tokens"] == 12
    for key in ("mean_acceptance_length", "acceptance_rate", "speedup", "tokens_per_s_spec", "num_drafts"):
        assert run["summary"][key] == pytest.approx(summary[key]), key
    assert run["summary"]["accepted_per_position"] == pytest.approx(summary["accepted_per_position"])
    assert run["summary"]["per_category/repeat/acceptance_rate"] == pytest.approx(
        summary["per_category"]["repeat"]["acceptance_rate"]
    )
    steps = [h for h in run["history"] if "spec/tokens_per_s" in h]
    assert [h["_step"] for h in steps] == [0, 1, 2, 3]
    assert run["summary"]["plots/acceptance_per_position/_type"] == "image-file"
    assert not (tmp_path / "wandb").exists()  # everything under the run directory


def test_wandb_mode_follows_the_environment(monkeypatch):
    from experiments.config import WandbLoggerConfig

    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert WandbLoggerConfig().resolved_mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert WandbLoggerConfig().resolved_mode() == "online"
    assert WandbLoggerConfig(mode="offline").resolved_mode() == "offline"


# ------------------------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    "override,error,key",
    [
        ("drafter.num_speculative_tokens=0", ValueError, "drafter.num_speculative_tokens"),
        ("drafter.num_speculative_tokens=40", ValueError, "drafter.num_speculative_tokens"),
        ("engine.block_size=0", ValueError, "engine.block_size"),
        ("sampling.top_p=2", ValueError, "top_p"),
        ("engine.block_sise=8", "composition", "engine.block_sise"),
        ("engine.enable_prefix_caching=maybe", "composition", "engine.enable_prefix_caching"),
        ("max_tokens=many", "composition", "max_tokens"),
        ("+drafter.temperature=1", ValueError, "drafter.temperature"),
    ],
)
def test_bad_config_fails_before_any_model_loads(tiny_conf, tmp_path, monkeypatch, override, error, key):
    from hydra.errors import ConfigCompositionException

    import specdec

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(specdec.LLM, "__init__", no_loading)
    expected = ConfigCompositionException if error == "composition" else error
    args = [f"hydra.searchpath=[file://{tiny_conf}]", *COMMON, override, f"hydra.run.dir={tmp_path / 'run'}"]
    with pytest.raises(expected) as info:
        run_main(args, tmp_path)
    text = str(info.value) + str(info.value.__cause__ or "")
    assert key in text
    assert not (tmp_path / "run" / "summary.json").exists()
