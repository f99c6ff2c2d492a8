"""``experiments.concurrency`` on tiny random models: every cell, the derived columns (speedup, oracle,
targets), exactness of every cell, the run directory and figure, and the config's errors (no timing
assertions: benchmarks are measured on an idle machine, never in tests)."""

from __future__ import annotations

import json
import math

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

from experiments.config import ConcurrencyConfig, register_configs, to_concurrency_config

CHEAP = "policies=[goodput,batch_size]"  # registered whatever else is being added


@pytest.fixture(scope="module")
def hydra_conf():
    register_configs()
    with initialize_config_module(config_module="experiments.conf", version_base=None):
        yield


def conc_cfg(*overrides: str) -> ConcurrencyConfig:
    return to_concurrency_config(compose(config_name="concurrency", overrides=list(overrides)))


def test_concurrency_defaults(hydra_conf):
    from specdec.policies import policy_names

    if "ucb" not in policy_names():
        with pytest.raises(ValueError, match=r"policies: unknown speculation policy \['ucb'\]; registered: "):
            conc_cfg()
    cfg = conc_cfg(CHEAP)
    assert cfg.concurrency == [1, 2, 4, 8, 16, 32] and cfg.drafters == ["ngram"]
    assert cfg.static_k == [1, 2, 3, 4] and cfg.engine_k == 4 and cfg.ignore_eos
    assert [cfg.rounds(c) for c in cfg.concurrency] == [32, 16, 8, 4, 2, 1]
    assert cfg.dataset.limit == 32 and cfg.engine.dtype is not None and cfg.engine.dtype.value == "bfloat16"
    assert cfg.speculative_config("ngram") == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    deep = conc_cfg(
        CHEAP, "drafters=[quantized_self,eagle]", "static_k=[0,6]", "+drafter_options.eagle.tree=dynamic"
    )
    assert deep.engine_k == 6
    assert deep.speculative_config("quantized_self") == {
        "method": "quantized_self",
        "num_speculative_tokens": 6,
        "quantization": "int4",
    }
    assert deep.speculative_config("eagle") == {
        "method": "eagle",
        "num_speculative_tokens": 6,
        "tree": "dynamic",
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["policies=[goodput,nope]"],
            r"policies: unknown speculation policy \['nope'\]; registered: .*batch_size",
        ),
        (["concurrency=[1,0]"], r"concurrency must list integers >= 1, got \[1, 0\]"),
        (["concurrency=[128]"], r"concurrency 128 exceeds engine.max_num_seqs=64"),
        (["concurrency=[2,2]"], r"concurrency lists \[2\] more than once"),
        (
            ["drafters=[nope]"],
            r"drafters must be a non-empty list of registered drafters .*unknown: \['nope'\]",
        ),
        (["drafters=[draft_model]"], r"has no default draft model: set draft_model="),
        (["static_k=[-1]"], r"static_k must list integers in \[0, 16\]"),
        (["num_speculative_tokens=0"], r"num_speculative_tokens must be an integer in \[1, 16\]"),
        (["min_requests=0"], r"min_requests must be >= 1"),
        (["min_rounds=0"], r"min_rounds must be >= 1"),
        (["repeats=0"], r"repeats must be >= 1"),
        (["+policy_kwargs.batch_size.schedule=[[2,9]]"], r"policy_kwargs.batch_size: batch_size policy"),
        (["+policy_kwargs.ucb.c=1"], r"policy_kwargs has \['ucb'\], which policies does not list"),
        (["+drafter_options.ngram.tree=static"], r"drafters \(ngram\): tree='static' needs method 'medusa'"),
        (["policies=[]", "static_k=[]"], r"policies and static_k are both empty"),
    ],
)
def test_concurrency_config_errors(hydra_conf, overrides, message):
    with pytest.raises(ValueError, match=message):
        conc_cfg(CHEAP, *overrides)


def test_concurrency_misspelt_key(hydra_conf):
    with pytest.raises(ConfigCompositionException, match=r"concurency"):
        conc_cfg(CHEAP, "concurency=[1]")


def test_depth_recorder_caps_and_delegates():
    from experiments.concurrency import DepthRecorder

    class Deep:
        observed = 0

        def decide(self, batch):
            return [9, 0, "x"][: len(batch)]

        def observe_step(self, step):
            self.observed += 1

    class X:
        def __init__(self, max_drafts):
            self.max_drafts = max_drafts

    inner = Deep()
    rec = DepthRecorder(inner, 3)
    assert rec.decide([X(2), X(4), X(4)]) == [3, 0, "x"]  # capped at k; a bad answer left to the engine
    assert rec.mean_depth == 1.0  # (min(3, 2) + 0) / 2
    rec.observe_step(None)
    assert inner.observed == 1
    assert DepthRecorder(object(), 1).mean_depth is None
    assert getattr(DepthRecorder(object(), 1), "observe_step", None) is None


def test_kept_depth_recorder_hands_the_profile_over_once():
    """A kept recorder is re-assigned to the engine each pass, and the engine hands a newly assigned policy
    its profile again; the goodput policy would forget its learned corrections, so a kept recorder passes
    the profile on once. A fresh one passes every call on; a missing hook stays missing."""
    from experiments.concurrency import DepthRecorder

    class Learning:
        def __init__(self):
            self.calls = []

        def set_step_costs(self, step_s):
            self.calls.append(("step", step_s))

        def set_draft_costs(self, per_position, catch_up_s_per_token=0.0):
            self.calls.append(("draft", per_position, catch_up_s_per_token))

    inner = Learning()
    kept = DepthRecorder(inner, 2, kept=True)
    for _ in range(3):
        kept.set_step_costs({1: 0.01})
        kept.set_draft_costs({1: 0.002}, catch_up_s_per_token=0.001)
    assert inner.calls == [("step", {1: 0.01}), ("draft", {1: 0.002}, 0.001)]
    fresh_inner = Learning()
    fresh = DepthRecorder(fresh_inner, 2)
    fresh.set_step_costs({1: 0.01})
    fresh.set_step_costs({1: 0.02})
    assert fresh_inner.calls == [("step", {1: 0.01}), ("step", {1: 0.02})]
    assert getattr(DepthRecorder(object(), 1, kept=True), "set_draft_costs", None) is None
    kept.total, kept.count = 5, 2
    kept.new_cell()
    assert kept.mean_depth is None


def test_keep_policies_builds_one_policy_per_concurrency(
    hydra_conf, tiny_model_dirs, fast_cpu_settings, monkeypatch
):
    """keep_policies=true: the goodput rows of every pass at one concurrency run one policy object (built
    once per concurrency, plus the untimed profiling one), static rows a fresh one per pass; outputs stay
    plain decoding's (float32 greedy)."""
    import experiments.concurrency as conc

    built: list[tuple[str, int]] = []
    make = conc._policy

    def counting(name, k, tree, kwargs):
        policy = make(name, k, tree, kwargs)
        built.append((name, id(policy)))
        return policy

    monkeypatch.setattr(conc, "_policy", counting)
    target = tiny_model_dirs["llama-gqa3-tied"]
    cfg = conc_cfg(
        f"model.name={target}",
        "dataset=synthetic",
        "dataset.limit=3",
        "dataset.prompt_len=16",
        "drafters=[ngram]",
        "policies=[goodput]",
        "num_speculative_tokens=2",
        "static_k=[1]",
        "concurrency=[1,2]",
        "max_tokens=8",
        "min_requests=2",
        "engine=cpu",
        "engine.dtype=float32",
        "engine.torch_threads=1",
        "repeats=3",
        "keep_policies=true",
        "plots=false",
    )
    result = conc.run_concurrency(cfg, out_dir=None)
    goodput = [i for name, i in built if name == "goodput"]
    static = [i for name, i in built if name == "static"]
    assert len(goodput) == 1 + 2  # the profiling one, then one per concurrency for all 3 passes
    assert len(static) == 3 * 2  # a fresh static policy per pass and concurrency
    rows = [r for r in result["rows"] if r["label"] == "goodput"]
    assert len(rows) == 2 and all(len(r["tokens_per_s_passes"]) == 3 for r in rows)
    assert all(r["greedy_equal"] is True for r in result["rows"])
    for r in rows:  # goodput's self-corrections in its rows; the static policy has none
        assert r["calibration"] > 0 and 0.25 <= r["cost_calibration"] <= 4
        assert r["calibrations"] == [r["calibration"]] * 2  # one pooled factor, per position (k = 2)
        assert all(type(r[key]) is int and r[key] >= 0 for key in conc.CHECK_FIELDS)
    static_rows = [r for r in result["rows"] if r["system"] == "static"]
    assert static_rows and not any("check_suspended" in r or "calibration" in r for r in static_rows)


def test_depth_recorder_reports_the_cells_own_check_decisions():
    """A kept policy's check counters run on across cells: each cell's row gets what changed in it, and
    a row merged from passes sums them; a policy without a check or calibrations reports nothing."""
    from experiments.concurrency import CHECK_FIELDS, DepthRecorder, merge_passes

    class Check:
        num_suspended, num_rechecks, num_plain_probes = 10, 2, 1

    class Policy:
        calibration, cost_calibration = 0.8, 1.25
        speedup_check = Check()

    policy = Policy()
    rec = DepthRecorder(policy, 2, kept=True)
    rec.new_cell()
    Check.num_suspended, Check.num_rechecks = 25, 3
    first = rec.policy_fields()
    assert first == {
        "calibration": 0.8,
        "cost_calibration": 1.25,
        "check_suspended": 15,
        "check_rechecks": 1,
        "check_plain_probes": 0,
    }
    rec.new_cell()
    Check.num_plain_probes = 4
    second = rec.policy_fields()
    assert [second[key] for key in CHECK_FIELDS] == [0, 0, 3]
    passes = [
        {"tokens": 10, "time_s": 1.0, "num_requests": 1, "rounds": 1, "tokens_per_s": 10.0, **first},
        {"tokens": 30, "time_s": 2.0, "num_requests": 1, "rounds": 1, "tokens_per_s": 15.0, **second},
    ]
    merged = merge_passes(passes)
    assert [merged[key] for key in CHECK_FIELDS] == [15, 1, 3]
    assert DepthRecorder(object(), 1).policy_fields() == {}
    Policy.speedup_check = None  # goodput with its check off: calibrations only
    assert set(DepthRecorder(Policy(), 1).policy_fields()) == {"calibration", "cost_calibration"}
    Policy.calibrations = [0.9, 0.5]  # per draft position
    assert DepthRecorder(Policy(), 1).policy_fields()["calibrations"] == [0.9, 0.5]


def _row(drafter, system, label, c, tps, k=None):
    return {
        "drafter": drafter,
        "system": system,
        "policy": label if system != "static" else "static",
        "label": label,
        "k": k,
        "concurrency": c,
        "tokens_per_s": tps,
    }


def test_passes_merge_and_speedups_use_the_blocks_plain():
    from experiments.concurrency import derive, merge_passes

    a = {"concurrency": 1, "tokens": 100, "time_s": 1.0, "num_requests": 1, "rounds": 1}
    a.update(tokens_per_s=100.0, tau=1.5)
    b = {**a, "time_s": 4.0, "tokens_per_s": 25.0, "tau": 2.0}
    c = {**a, "time_s": 2.0, "tokens_per_s": 50.0, "tau": 3.0}
    row = merge_passes([a, b, c])
    assert row["tokens"] == 300 and row["time_s"] == 7.0 and row["rounds"] == 3
    assert row["tokens_per_s"] == pytest.approx(300 / 7) and row["tokens_per_s_passes"] == [100.0, 25.0, 50.0]
    assert row["tau"] == 3.0  # the other measurements: from the median pass
    rows = [_row(None, "plain", "plain", 1, 40.0), _row("ngram", "policy", "goodput", 1, 30.0)]
    rows.append(_row("ngram", "static", "static k=1", 1, 33.0, k=1))
    for r in rows[1:]:
        r["plain_tokens_per_s"] = 30.0  # the machine was slower during the drafter's block
    (oracle,) = derive(rows, ["ngram"])
    assert rows[1]["speedup"] == pytest.approx(1.0) and rows[2]["speedup"] == pytest.approx(1.1)
    assert oracle["k"] == 1 and rows[1]["vs_oracle"] == pytest.approx(30 / 33)
    assert all(r["steady_speedup"] is None for r in rows)  # not closed loop
    # Closed loop: the steady windows' tokens and seconds are summed over the passes too, and the steady
    # speedup is over the block's plain steady rate.
    for p, (n, t) in zip((a, b, c), ((60, 0.5), (50, 1.0), (40, 1.0))):
        p.update(steady_tokens=n, steady_time_s=t)
    row = merge_passes([a, b, c])
    assert (row["steady_tokens"], row["steady_time_s"]) == (150, 2.5) and row["steady_tokens_per_s"] == 60.0
    rows[1].update(steady_tokens_per_s=66.0, plain_steady_tokens_per_s=60.0)
    rows[0]["steady_tokens_per_s"] = 50.0
    derive(rows, ["ngram"])
    assert rows[1]["steady_speedup"] == pytest.approx(1.1) and rows[0]["steady_speedup"] == 1.0


def test_derive_oracle_and_targets():
    from experiments.concurrency import derive, targets

    rows = [
        _row(None, "plain", "plain", 1, 10.0),
        _row("ngram", "policy", "goodput", 1, 19.5),
        _row("ngram", "static", "static k=1", 1, 15.0, 1),
        _row("ngram", "static", "static k=4", 1, 20.0, 4),
        _row(None, "plain", "plain", 8, 40.0),
        _row("ngram", "policy", "goodput", 8, 36.0),
        _row("ngram", "static", "static k=1", 8, 38.0, 1),
        _row("ngram", "static", "static k=4", 8, 30.0, 4),
    ]
    oracle = derive(rows, ["ngram"])
    assert [(o["concurrency"], o["k"], o["system"], o["speedup"]) for o in oracle] == [
        (1, 4, "static", 2.0),
        (8, 0, "plain", 1.0),
    ]
    by = {(r["label"], r["concurrency"]): r for r in rows}
    assert by[("plain", 1)]["speedup"] == 1.0 and by[("plain", 1)]["vs_oracle"] is None
    assert by[("static k=4", 1)]["vs_oracle"] == 1.0 and by[("static k=4", 1)]["oracle_k"] == 4
    assert by[("goodput", 1)]["vs_oracle"] == pytest.approx(0.975) and by[("goodput", 1)]["meets_targets"]
    assert by[("goodput", 8)]["vs_oracle"] == pytest.approx(0.9) and by[("goodput", 8)]["oracle_k"] == 0
    assert by[("goodput", 8)]["meets_targets"] is False and by[("static k=1", 8)]["meets_targets"] is None
    t = targets(rows)["goodput"]
    assert (t["cells"], t["met"], t["failing"]) == (2, 1, ["ngram c=8"])
    assert t["min_speedup"] == pytest.approx(0.9) and t["min_vs_oracle"] == pytest.approx(0.9)


def test_concurrency_tiny_models(hydra_conf, tiny_model_dirs, tmp_path, fast_cpu_settings, monkeypatch):
    from experiments.concurrency import run_concurrency
    from specdec import LLM

    shared: list[tuple[int, int]] = []  # (id of the plain engine's target, id of the drafter engine's)
    with_speculation = LLM.with_speculation

    def spying(self, spec, **overrides):
        llm = with_speculation(self, spec, **overrides)
        shared.append((id(self.engine.model), id(llm.engine.model)))
        return llm

    monkeypatch.setattr(LLM, "with_speculation", spying)

    target, draft = tiny_model_dirs["llama-gqa3-tied"], tiny_model_dirs["llama-mha-untied"]
    concurrency, drafters, policies, static_k = (
        [1, 2, 4],
        ["ngram", "draft_model"],
        ["goodput", "batch_size"],
        [0, 1, 3],
    )
    cfg = conc_cfg(
        f"model.name={target}",
        "dataset=synthetic",
        "dataset.limit=3",
        "dataset.prompt_len=16",
        f"drafters=[{','.join(drafters)}]",
        f"draft_model={draft}",
        f"policies=[{','.join(policies)}]",
        "num_speculative_tokens=2",
        f"static_k=[{','.join(map(str, static_k))}]",
        f"concurrency=[{','.join(map(str, concurrency))}]",
        "max_tokens=8",
        "min_requests=3",
        "engine=cpu",
        "engine.dtype=float32",
        "engine.torch_threads=1",
        "repeats=2",
    )
    assert cfg.engine_k == 3
    result = run_concurrency(cfg, out_dir=tmp_path)
    # share_target (the default): each drafter's engine runs over the plain engine's target
    assert len(shared) == len(drafters) and all(a == b for a, b in shared)
    rows = result["rows"]
    assert len(rows) == len(concurrency) * (1 + len(drafters) * (len(policies) + len(static_k)))
    cells = {(r["drafter"], r["label"], r["concurrency"]): r for r in rows}
    assert len(cells) == len(rows)
    for r in rows:
        c = r["concurrency"]
        passes = 2 * (len(drafters) if r["system"] == "plain" else 1)  # plain: beside every drafter
        assert len(r["tokens_per_s_passes"]) == passes
        assert r["rounds"] == passes * math.ceil(3 / c) and r["num_requests"] == r["rounds"] * c
        assert r["tokens"] == 8 * r["num_requests"] and r["tokens_per_s"] > 0
        assert 0 < r["tpot_p50_ms"] <= r["tpot_p99_ms"] and r["ttft_p50_ms"] > 0
        # float32 greedy: speculation is exact, whatever the policy, depth or batch
        assert r["greedy_equal"] is True, (r["drafter"], r["label"], c)
        plain = cells[(None, "plain", c)]
        if r["system"] == "plain":
            assert r["speedup"] == 1.0 and r["tau"] is None and r["draft_share"] is None
            continue
        # over plain decoding measured in the same block (interleaved with the drafter's rows)
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["plain_tokens_per_s"])
        assert r["plain_tokens_per_s"] > 0 and plain["tokens_per_s"] > 0
        assert 0 <= r["draft_share"] < 1 and 0 < r["verify_share"] < 1
        assert r["draft_share"] + r["verify_share"] < 1
        cap = cfg.num_speculative_tokens if r["system"] == "policy" else r["k"]
        assert r["mean_depth"] is not None and 0 <= r["mean_depth"] <= cap
        if r["label"] == "static k=0":
            assert r["mean_depth"] == 0 and r["tau"] is None and r["acceptance_rate"] is None
        if r["label"] == "static k=3":
            assert r["tau"] >= 1.0 and r["draft_tokens_per_step"] <= 3
        assert r["vs_oracle"] == pytest.approx(r["tokens_per_s"] / r["oracle_tokens_per_s"])
        assert (r["meets_targets"] is None) == (r["system"] != "policy")
    assert len(result["oracle"]) == len(concurrency) * len(drafters)
    for o in result["oracle"]:
        d, c = o["drafter"], o["concurrency"]
        static = [cells[(d, f"static k={j}", c)] for j in static_k]
        block = {"tokens_per_s": static[0]["plain_tokens_per_s"]}  # plain, in this drafter's block
        best = max([block, *static], key=lambda r: r["tokens_per_s"])
        assert o["tokens_per_s"] == best["tokens_per_s"] and o["speedup"] >= 1.0
        assert all(r["vs_oracle"] <= 1.0 for r in static)
        if o["system"] == "static":
            assert cells[(d, f"static k={o['k']}", c)]["vs_oracle"] == 1.0
        else:
            assert o["k"] == 0
    assert set(result["targets"]) == set(policies)
    assert all(t["cells"] == len(concurrency) * len(drafters) for t in result["targets"].values())

    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["kind"] == "concurrency" and len(saved["rows"]) == len(rows) and saved["engine_k"] == 3
    assert saved["git"] and saved["versions"]["torch"] and saved["config"]["policies"] == policies
    table = (tmp_path / "concurrency.md").read_text()
    assert table == result["table"]
    # requests per row: rounds × passes (plain: 2 passes beside each of the 2 drafters)
    assert "| ngram | goodput | 2 | 8 |" in table and "| – | plain | 4 | 16 |" in table
    assert "| draft_model | 1 |" in table and "goodput: " in table
    for name in (
        "config.yaml",
        "run_info.json",
        "plots/speedup_vs_concurrency.png",
        "plots/speedup_vs_concurrency.svg",
    ):
        assert (tmp_path / name).is_file(), name


def test_closed_loop_cells_keep_c_requests_running(hydra_conf, tiny_model_dirs, fast_cpu_settings):
    # c clients: every request of the cell in one call, at most c running, a waiting one admitted when
    # one finishes; at least 3 requests per client; the engine's max_num_seqs restored afterwards.
    from experiments.concurrency import run_cell
    from sampling.params import SamplingParams
    from specdec import LLM

    cfg = conc_cfg(CHEAP, "arrivals=closed_loop", "min_requests=2")
    assert [cfg.rounds(c) for c in (1, 2, 4)] == [3, 3, 3]
    assert [
        conc_cfg(CHEAP, "arrivals=closed_loop", "min_requests=2", "min_rounds=5").rounds(c) for c in (1, 8)
    ] == [5, 5]
    assert conc_cfg(CHEAP, "arrivals=closed_loop", "min_requests=64", "min_rounds=5").rounds(8) == 8
    assert conc_cfg(CHEAP, "min_requests=2", "min_rounds=5").rounds(1) == 2  # rounds arrive together
    assert conc_cfg(CHEAP, "min_requests=2").rounds(1) == 2
    with pytest.raises(ValueError, match=r"arrivals must be one of \['together', 'closed_loop'\]"):
        conc_cfg(CHEAP, "arrivals=poisson")
    llm = LLM(tiny_model_dirs["llama-gqa3-tied"], skip_tokenizer_init=True, dtype="float32")
    running = []
    schedule = llm.engine.scheduler.schedule

    def counting():
        out = schedule()
        running.append(len(llm.engine.scheduler.running))
        return out

    llm.engine.scheduler.schedule = counting
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    row, outputs = run_cell(llm, prompts, 2, 3, params, "closed_loop")
    assert row["num_requests"] == len(outputs) == 6 and row["tokens"] == 24
    assert max(running) == 2 and running.count(2) > len(running) // 2  # two in flight until the last
    assert llm.engine.scheduler.config.max_num_seqs == 64
    assert outputs[5] == outputs[0]  # prompt 5 is prompt 0 again (cycling)
    # Plain decoding runs the pairs in lockstep: every step has two requests running, all of it counts.
    assert (
        row["steady_tokens"] == 24 and row["steady_steps"] == 12 and 0 < row["steady_time_s"] <= row["time_s"]
    )
    assert row["steady_tokens_per_s"] == pytest.approx(24 / row["steady_time_s"])
    assert "step" not in vars(llm.engine) and "schedule" not in vars(llm.engine.scheduler)  # unwrapped
    together, _ = run_cell(llm, prompts, 2, 3, params)
    assert together["num_requests"] == 6 and together["tokens"] == 24
    assert together["steady_tokens_per_s"] is None  # rounds submitted together: no steady window


def test_the_steady_window_leaves_out_the_drain(tiny_model_dirs, fast_cpu_settings):
    # Two requests running; the first writes 2 tokens, the others 6: the third runs its last two steps
    # alone (the drain), which the window leaves out.
    from experiments.concurrency import SteadyWindow
    from sampling.params import SamplingParams
    from specdec import LLM

    llm = LLM(tiny_model_dirs["llama-gqa3-tied"], skip_tokenizer_init=True, dtype="float32", max_num_seqs=2)
    prompts = [{"prompt_token_ids": [1 + i, 2 + i, 3 + i]} for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 6, 6)]
    with SteadyWindow(llm.engine) as window:
        outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 6, 6]
    assert (window.tokens, window.steps) == (2 + 6 + 4, 6) and window.time_s > 0
    assert "step" not in vars(llm.engine)


def test_plot_speedup_vs_concurrency(tmp_path):
    from experiments.concurrency import derive
    from experiments.plot import plot_speedup_vs_concurrency

    rows = []
    for c, base in ((1, 10.0), (4, 30.0), (16, 80.0)):
        rows.append(_row(None, "plain", "plain", c, base))
        for d, gain in (("ngram", 1.5), ("eagle", 1.2)):
            rows.append(_row(d, "policy", "goodput", c, base * gain / (1 + c / 16)))
            rows.append(_row(d, "static", "static k=2", c, base * gain / (1 + c / 10), 2))
    oracle = derive(rows, ["ngram", "eagle"])
    result = {
        "rows": rows,
        "oracle": oracle,
        "dtype": "float32",
        "num_prompts": 4,
        "config": {
            "drafters": ["ngram", "eagle"],
            "policies": ["goodput"],
            "num_speculative_tokens": 4,
            "max_tokens": 8,
            "model": {"name": "/tmp/tiny"},
            "dataset": {"name": "synthetic"},
        },
    }
    fig = plot_speedup_vs_concurrency(result, tmp_path / "plots", formats=("png", "svg"))
    assert [p.rsplit("/", 1)[-1] for p in fig["files"]] == [
        "speedup_vs_concurrency.png",
        "speedup_vs_concurrency.svg",
    ]
    assert all(
        (tmp_path / "plots" / n).stat().st_size > 1000
        for n in ("speedup_vs_concurrency.png", "speedup_vs_concurrency.svg")
    )
    ngram = fig["drafters"]["ngram"]
    assert ngram["concurrency"] == [1, 4, 16]
    assert ngram["policies"]["goodput"] == pytest.approx([1.5 / (1 + c / 16) for c in (1, 4, 16)])
    assert ngram["oracle"] == pytest.approx([1.5 / 1.1, 1.5 / 1.4, 1.0])
    assert ngram["oracle_k"] == [2, 2, 0]
    assert fig["drafters"]["eagle"]["oracle_k"] == [2, 0, 0]
