"""``experiments.plot``: the Leviathan et al. model, the α fit, and figures whose numbers are the runs'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from experiments.plot import (
    FIGURES,
    Run,
    aggregate,
    cost_ratio,
    expected_speedup,
    expected_tau,
    find_runs,
    fit_alpha,
    main,
    plot_acceptance_vs_temperature,
    plot_drafters,
    run_alpha,
    varying_keys,
)


# ------------------------------------------------------------------------------------------ model
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.75, 0.99])
@pytest.mark.parametrize("gamma", [1, 2, 5])
def test_expected_tau_is_the_mean_of_the_truncated_geometric(alpha, gamma):
    # accepted drafts a ~ alpha^a (1 - alpha) for a < gamma, alpha^gamma for a = gamma; a + 1 tokens emitted
    probs = [alpha**a * (1 - alpha) for a in range(gamma)] + [alpha**gamma]
    assert sum(probs) == pytest.approx(1.0)
    assert expected_tau(alpha, gamma) == pytest.approx(sum(p * (a + 1) for a, p in enumerate(probs)))


def test_expected_speedup_formula():
    assert expected_tau(1.0, 4) == 5.0 and expected_tau(0.0, 4) == 1.0
    assert expected_speedup(0.5, 2, 0.1) == pytest.approx((1 - 0.5**3) / ((1 - 0.5) * (2 * 0.1 + 1)))
    assert expected_speedup(0.8, 3, 0.0) == pytest.approx(expected_tau(0.8, 3))


@pytest.mark.parametrize("alpha", [0.1, 0.55, 0.9])
def test_fit_alpha_recovers_alpha(alpha):
    ks = [1, 2, 4, 8]
    assert fit_alpha(ks, [expected_tau(alpha, k) for k in ks]) == pytest.approx(alpha, abs=1e-6)
    assert fit_alpha([3], [expected_tau(alpha, 3)]) == pytest.approx(alpha, abs=1e-6)
    assert fit_alpha([], []) != fit_alpha([], [])  # nan: nothing to fit


# ------------------------------------------------------------------------------------------- runs
def make_summary(
    method: str = "ngram",
    k: int | None = 4,
    temperature: float = 0.0,
    tau: float | None = 2.0,
    acceptance: float | None = 0.25,
    speedup: float | None = 1.5,
    per_position: list[float] | None = None,
    categories: dict[str, float] | None = None,
    model: str = "smollm2-135m-instruct",
) -> dict[str, Any]:
    drafter: dict[str, Any] = {"method": method}
    if k is not None:
        drafter["num_speculative_tokens"] = k
    spec = method != "none"
    return {
        "drafter": method,
        "num_prompts": 4,
        "tokens_per_s_baseline": 10.0,
        "tokens_per_s_spec": 10.0 * speedup if spec and speedup else None,
        "speedup": speedup if spec else None,
        "speedup_median": speedup if spec else None,
        "mean_acceptance_length": tau if spec else None,
        "acceptance_rate": acceptance if spec else None,
        "accepted_per_position": (per_position or [0.5] * (k or 0)) if spec else None,
        "num_draft_tokens": 100 if spec else None,
        "draft_time_s": 0.5 if spec else None,
        "greedy_equal": True if spec else None,
        "per_category": {
            c: {"acceptance_rate": a if spec else None}
            for c, a in (categories or {"all": acceptance or 0}).items()
        },
        "config": {
            "model": {"name": model, "dtype": "float32"},
            "drafter": drafter,
            "dataset": {"name": "builtin", "limit": 4},
            "sampling": {"temperature": temperature, "seed": 0},
            "engine": {"dtype": None, "torch_threads": None},
            "logger": {"name": "none"},
            "max_tokens": 64,
        },
    }


def write_runs(root: Path, summaries: list[dict[str, Any]]) -> Path:
    for i, s in enumerate(summaries):
        d = root / str(i)
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps(s))
    return root


def test_find_runs_orders_naturally_and_skips_other_summaries(tmp_path):
    write_runs(tmp_path / "sweep", [make_summary(k=k) for k in range(1, 12)])
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "summary.json").write_text(json.dumps({"kind": "bench", "rows": []}))
    runs = find_runs([tmp_path])
    assert [r.path.name for r in runs] == [str(i) for i in range(11)]
    assert [r.k for r in runs] == list(range(1, 12))
    assert len(find_runs([tmp_path / "sweep" / "3", tmp_path / "sweep"])) == 11  # each run once
    with pytest.raises(FileNotFoundError):
        find_runs([tmp_path / "missing"])


def test_varying_keys_ignore_keys_of_one_drafter_only():
    a = make_summary("ngram", 2)
    a["config"]["drafter"]["prompt_lookup_max"] = 4
    b = make_summary("draft_model", 2)
    b["config"]["drafter"]["model"] = "qwen2.5-coder-0.5b-instruct"
    c = make_summary("ngram", 4, temperature=0.7)
    c["config"]["drafter"]["prompt_lookup_max"] = 4
    c["config"]["logger"] = {"name": "wandb"}
    runs = [Run(Path(str(i)), s) for i, s in enumerate((a, b, c))]
    assert varying_keys(runs) == ["drafter.method", "drafter.num_speculative_tokens", "sampling.temperature"]


def test_cost_ratio_and_run_alpha():
    s = make_summary(k=3, tau=expected_tau(0.6, 3))
    assert cost_ratio(s) == pytest.approx(0.5 / 100 * 10.0)
    assert run_alpha(s) == pytest.approx(0.6, abs=1e-6)
    assert cost_ratio(make_summary("none", None)) is None and run_alpha(make_summary("none", None)) is None


def sweep_summaries() -> list[dict[str, Any]]:
    out = []
    for method, alpha in (("ngram", 0.4), ("draft_model", 0.7)):
        for k in (1, 2, 4):
            out.append(
                make_summary(
                    method,
                    k,
                    tau=expected_tau(alpha, k),
                    acceptance=alpha * 0.9,
                    speedup=1.0 + 0.1 * k + (0.3 if method == "draft_model" else 0),
                    per_position=[alpha ** (i + 1) for i in range(k)],
                    categories={"coding": alpha, "writing": alpha / 2},
                )
            )
    for t in (0.3, 0.7, 1.0):
        out.append(make_summary("ngram", 4, temperature=t, acceptance=0.5 - t / 4, tau=1.5))
    out.append(make_summary("none", None))
    return out


def test_aggregate_figures_hold_the_summaries_numbers(tmp_path):
    summaries = sweep_summaries()
    root = write_runs(tmp_path / "multirun", summaries)
    result = aggregate([root])
    out = root / "plots"
    assert result["out_dir"] == str(out)
    for name in FIGURES:
        for ext in ("png", "svg"):
            assert (out / f"{name}.{ext}").stat().st_size > 1000, name
    assert (out / "results.md").read_text() == result["table"]
    assert json.loads((out / "aggregate.json").read_text())["runs"] == result["runs"]
    figs = result["figures"]

    positions = figs["acceptance_per_position"]["values"]
    assert positions["draft_model k=2 T=0.0"] == pytest.approx([0.7, 0.49])
    assert len(positions) == len(summaries) - 1  # every speculative run, not the plain one

    groups = figs["tau_speedup_vs_k"]["groups"]
    assert set(groups) == {"ngram T=0.0", "draft_model T=0.0", "ngram T=0.3", "ngram T=0.7", "ngram T=1.0"}
    dm = groups["draft_model T=0.0"]
    assert dm["k"] == [1, 2, 4] and dm["speedup"] == pytest.approx([1.4, 1.5, 1.7])
    assert dm["alpha"] == pytest.approx(0.7, abs=1e-6) and dm["c"] == pytest.approx(0.05)
    assert dm["model_tau"][:4] == pytest.approx([expected_tau(0.7, k) for k in (1, 2, 3, 4)])
    assert dm["model_speedup"][1] == pytest.approx(expected_speedup(0.7, 2, 0.05))
    assert groups["ngram T=0.0"]["alpha"] == pytest.approx(0.4, abs=1e-6)

    cats = figs["acceptance_per_category"]
    assert cats["categories"] == ["coding", "writing", "all"]  # the temperature runs have one category
    assert cats["values"]["ngram k=2 T=0.0"] == {"coding": 0.4, "writing": 0.2}

    temps = figs["acceptance_vs_temperature"]["groups"]["ngram k=4"]
    assert temps["temperature"] == [0.0, 0.3, 0.7, 1.0]
    assert temps["acceptance_rate"] == pytest.approx([0.36, 0.425, 0.325, 0.25])

    drafters = figs["drafters"]["drafters"]
    assert set(drafters) == {"ngram", "draft_model"}
    assert drafters["draft_model"]["k"] == 4 and drafters["draft_model"]["speedup"] == pytest.approx(1.7)
    assert drafters["ngram"]["speedup"] == pytest.approx(1.5)  # a T=0.3 run (1.5) beats greedy k=4 (1.4)
    assert drafters["ngram"]["label"] == "ngram k=4 T=0.3"

    rows = result["rows"]
    assert len(rows) == len(summaries) and rows[-1]["drafter"] == "none" and rows[-1]["speedup"] is None
    assert "| draft_model | 4 |" in result["table"] and result["table"].count("\n") == 2 + len(summaries)


def test_plot_cli_and_runs_without_speculation(tmp_path, capsys):
    root = write_runs(tmp_path / "plain", [make_summary("none", None), make_summary("none", None)])
    result = main([str(root), "--out", str(tmp_path / "figs"), "--formats", "png"])
    assert "2 runs" in capsys.readouterr().out
    for name in FIGURES:  # every figure with an axis exists, saying there is nothing speculative to show
        drawn = name not in ("acceptance_vs_temperature", "drafters")  # no temperatures, no drafters
        assert (tmp_path / "figs" / f"{name}.png").is_file() == drawn, name
        assert not (tmp_path / "figs" / f"{name}.svg").exists()
    assert result["figures"]["acceptance_per_position"]["values"] == {}
    assert result["figures"]["drafters"]["skipped"] == "no speculative runs"
    with pytest.raises(FileNotFoundError, match=r"no summary\.json"):
        aggregate([tmp_path / "figs"])


# ------------------------------------------------- figures drawn only when their axis varies (issue 24)
def test_a_k_sweep_draws_no_temperature_or_drafter_figure(tmp_path):
    # python -m experiments.run -m drafter.num_speculative_tokens=2,4: one drafter, one temperature
    runs = find_runs([write_runs(tmp_path / "sweep", [make_summary("ngram", k) for k in (2, 4)])])
    temps = plot_acceptance_vs_temperature(runs, tmp_path / "plots")
    assert temps["files"] == [] and temps["skipped"] == "one temperature (0.0)"
    assert temps["groups"]["ngram k=2"]["temperature"] == [0.0]  # the numbers are still reported
    drafters = plot_drafters(runs, tmp_path / "plots")
    assert drafters["files"] == [] and drafters["skipped"] == "one drafter (ngram)"
    assert set(drafters["drafters"]) == {"ngram"}
    assert not list((tmp_path / "plots").glob("acceptance_vs_temperature.*"))
    assert not list((tmp_path / "plots").glob("drafters.*"))
    result = aggregate([tmp_path / "sweep"])  # the aggregation writes the others only
    out = Path(result["out_dir"])
    assert (out / "tau_speedup_vs_k.png").is_file() and (out / "acceptance_per_position.png").is_file()
    assert not (out / "acceptance_vs_temperature.png").exists() and not (out / "drafters.png").exists()


def test_figures_are_drawn_when_temperature_or_drafter_varies(tmp_path):
    runs = find_runs(
        [
            write_runs(
                tmp_path / "sweep",
                [make_summary("ngram", 4, temperature=t) for t in (0.0, 0.7)]
                + [make_summary("draft_model", 4)],
            )
        ]
    )
    out = tmp_path / "plots"
    temps = plot_acceptance_vs_temperature(runs, out)
    assert "skipped" not in temps and all(Path(f).stat().st_size > 1000 for f in temps["files"])
    assert sorted(Path(f).name for f in temps["files"]) == [
        "acceptance_vs_temperature.png",
        "acceptance_vs_temperature.svg",
    ]
    drafters = plot_drafters(runs, out)
    assert "skipped" not in drafters and set(drafters["drafters"]) == {"ngram", "draft_model"}
    assert sorted(Path(f).name for f in drafters["files"]) == ["drafters.png", "drafters.svg"]
    # re-aggregating a narrower selection into the same directory removes the now-meaningless figures
    one = find_runs([tmp_path / "sweep" / "2"])
    assert plot_drafters(one, out)["files"] == [] and not (out / "drafters.png").exists()
    assert plot_acceptance_vs_temperature(one, out)["files"] == []
    assert not (out / "acceptance_vs_temperature.svg").exists()
