"""The main job's configs, prompt sets and run logic (``experiments/``)."""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException, MissingConfigException

from experiments.config import (
    BuiltinDatasetConfig,
    ChoiceGrammarConfig,
    DraftModelDrafterConfig,
    Dtype,
    Eagle3DrafterConfig,
    EagleDrafterConfig,
    EngineConfig,
    ExperimentConfig,
    HumanEvalDatasetConfig,
    HybridDrafterConfig,
    JsonlDatasetConfig,
    JsonSchemaGrammarConfig,
    MedusaDrafterConfig,
    ModelConfig,
    NgramDrafterConfig,
    NoDrafterConfig,
    NoGrammarConfig,
    NoLoggerConfig,
    QuantizedSelfDrafterConfig,
    RegexGrammarConfig,
    RegisteredDrafterConfig,
    SamplingConfig,
    SuffixDrafterConfig,
    SyntheticDatasetConfig,
    WandbLoggerConfig,
    config_to_dict,
    register_configs,
    sampling_params_kwargs,
    to_experiment_config,
)
from experiments.datasets import load_builtin, load_humaneval, load_jsonl, load_prompts, round_robin
from experiments.run import format_summary, run_experiment, run_prompts

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "experiments" / "conf"
SPECBENCH = REPO / ".." / "shared" / "specbench" / "question.jsonl"
HUMANEVAL = REPO / ".." / "shared" / "humaneval" / "HumanEval.jsonl.gz"
GROUPS = ("model", "drafter", "dataset", "sampling")
OPTIONS = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml")) for g in GROUPS}
ALL_GROUPS = (*GROUPS, "grammar", "engine", "logger", "experiment", "sweep")
CONFIG_FILES = sorted(str(p.relative_to(CONF)) for p in CONF.rglob("*.yaml"))


@pytest.fixture(scope="module")
def hydra_conf():
    register_configs()
    with initialize_config_module(config_module="experiments.conf", version_base=None):
        yield


def load_cfg(*overrides: str) -> ExperimentConfig:
    return to_experiment_config(compose(config_name="config", overrides=list(overrides)))


def error_text(exc: BaseException) -> str:
    """The message of an exception and of its causes."""
    parts = []
    e: BaseException | None = exc
    while e is not None:
        parts.append(str(e))
        e = e.__cause__
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------ config
def test_every_group_has_its_options():
    assert OPTIONS["model"] == [
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
        "smollm2-135m-instruct",
    ]
    assert OPTIONS["drafter"] == [
        "draft_model",
        "eagle",
        "eagle3",
        "hybrid",
        "medusa",
        "ngram",
        "none",
        "quantized_self",
        "registered",
        "suffix",
    ]
    assert OPTIONS["dataset"] == ["builtin", "humaneval", "jsonl", "synthetic"]
    assert OPTIONS["sampling"] == ["greedy", "random"]
    options = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml")) for g in ALL_GROUPS}
    assert options["grammar"] == ["choice", "json_schema", "none", "regex"]
    assert options["engine"] == ["cpu", "cuda", "default"]
    assert options["logger"] == ["none", "wandb"]
    assert options["experiment"] and options["sweep"]


def test_default_config(hydra_conf):
    cfg = load_cfg()
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.model.dtype is Dtype.float32
    assert isinstance(cfg.drafter, NgramDrafterConfig)
    assert cfg.drafter.speculative_config() == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    assert isinstance(cfg.dataset, BuiltinDatasetConfig) and cfg.dataset.limit == 12
    assert cfg.sampling == SamplingConfig(temperature=0.0, seed=None)
    assert (cfg.max_tokens, cfg.seed, cfg.plots) == (128, 0, True)
    assert isinstance(cfg.grammar, NoGrammarConfig) and cfg.grammar.sampling_kwargs() == {}
    assert cfg.engine == EngineConfig()  # specdec.LLM's own defaults
    assert cfg.engine.llm_kwargs(cfg.model)["dtype"] == "float32"
    assert isinstance(cfg.logger, NoLoggerConfig)


# Companion overrides a file needs to compose (a draft model needs a target of its family; the generic
# option needs a registered method).
NEEDS = {
    "drafter/draft_model.yaml": ["model=qwen2.5-coder-1.5b-instruct"],
    "drafter/registered.yaml": ["drafter.method=ngram"],
}
EXPECTED_TYPES = {
    "drafter": {
        "none": NoDrafterConfig,
        "ngram": NgramDrafterConfig,
        "suffix": SuffixDrafterConfig,
        "hybrid": HybridDrafterConfig,
        "draft_model": DraftModelDrafterConfig,
        "medusa": MedusaDrafterConfig,
        "eagle": EagleDrafterConfig,
        "eagle3": Eagle3DrafterConfig,
        "quantized_self": QuantizedSelfDrafterConfig,
        "registered": RegisteredDrafterConfig,
    },
    "dataset": {
        "builtin": BuiltinDatasetConfig,
        "jsonl": JsonlDatasetConfig,
        "humaneval": HumanEvalDatasetConfig,
        "synthetic": SyntheticDatasetConfig,
    },
    "grammar": {
        "none": NoGrammarConfig,
        "json_schema": JsonSchemaGrammarConfig,
        "regex": RegexGrammarConfig,
        "choice": ChoiceGrammarConfig,
    },
    "logger": {"none": NoLoggerConfig, "wandb": WandbLoggerConfig},
}


@pytest.mark.parametrize("path", CONFIG_FILES)
def test_every_config_file_composes_and_validates(hydra_conf, path):
    """Each file of experiments/conf, selected on its own, composes against its schema and converts to
    validated dataclasses (hydra/launcher files: the launcher config composes with its plugin's)."""
    from omegaconf import OmegaConf

    from experiments.config import BenchConfig, to_bench_config

    parts = Path(path).with_suffix("").parts
    if path == "config.yaml":
        assert isinstance(load_cfg(), ExperimentConfig)
        return
    if path == "train.yaml":
        from experiments.config import TrainConfig, to_train_config

        cfg = to_train_config(compose(config_name="train"))
        assert isinstance(cfg, TrainConfig) and isinstance(cfg.drafter, MedusaDrafterConfig)
        return
    if path == "bench.yaml":
        cfg = to_bench_config(compose(config_name="bench"))
        assert isinstance(cfg, BenchConfig) and cfg.methods == ["plain", "ngram"]
        assert cfg.engine.llm_kwargs(cfg.model)["dtype"] == "bfloat16"
        return
    if path == "concurrency.yaml":  # tests/test_experiments_concurrency.py checks it in depth
        from experiments.config import ConcurrencyConfig, to_concurrency_config

        # policies named: the default lists one (ucb) that may not be registered yet
        dcfg = compose(config_name="concurrency", overrides=["policies=[goodput,batch_size]"])
        cfg = to_concurrency_config(dcfg)
        assert isinstance(cfg, ConcurrencyConfig) and cfg.drafters == ["ngram"]
        assert cfg.engine.llm_kwargs(cfg.model)["dtype"] == "bfloat16"
        return
    if parts[0] == "hydra":
        pytest.importorskip(
            {
                "ray_local": "hydra_plugins.hydra_ray_launcher",
                "slurm": "hydra_plugins.hydra_submitit_launcher",
            }[parts[-1]]
        )
        group, option = "/".join(parts[:-1]), parts[-1]
        full = compose(config_name="config", overrides=[f"{group}={option}"], return_hydra_config=True)
        launcher = OmegaConf.to_container(full.hydra.launcher, resolve=False)
        assert isinstance(launcher, dict) and launcher["_target_"].startswith("hydra_plugins.")
        if option == "slurm":
            assert launcher["gpus_per_node"] == 1 and "partition" in launcher
        else:
            assert launcher["ray"]["remote"]["num_cpus"] == 1
        return
    group, option = parts
    cfg = load_cfg(*NEEDS.get(path, []), f"{group}={option}")
    if group in EXPECTED_TYPES:
        assert type(getattr(cfg, group)) is EXPECTED_TYPES[group][option]
    if group == "sweep":
        full = compose(config_name="config", overrides=[f"sweep={option}"], return_hydra_config=True)
        params = OmegaConf.to_container(full.hydra.sweeper.params)
        assert isinstance(params, dict) and params
        for key, values in params.items():  # every swept value composes and validates too
            for value in str(values).split(","):
                overrides = [f"sweep={option}", f"{key}={value}"]
                if key == "drafter" and value == "draft_model":
                    overrides.append("model=qwen2.5-coder-1.5b-instruct")
                load_cfg(*overrides)
    if group == "grammar":
        from sampling.params import SamplingParams

        kwargs = cfg.grammar.sampling_kwargs()
        params = SamplingParams(**kwargs)
        given = [f for f in ("json_schema", "regex", "choice") if getattr(params, f) is not None]
        assert given == ([] if option == "none" else [option])


def test_experiment_deltas(hydra_conf):
    cfg = load_cfg("experiment=qwen_coder_pair")
    assert cfg.model.name == "qwen2.5-coder-1.5b-instruct" and isinstance(
        cfg.drafter, DraftModelDrafterConfig
    )
    assert isinstance(cfg.dataset, HumanEvalDatasetConfig) and cfg.dataset.limit == 6
    cfg = load_cfg("experiment=smoke", "max_tokens=4")  # the command line wins over the delta
    assert (cfg.dataset.limit, cfg.max_tokens) == (2, 4)
    with pytest.raises(ConfigCompositionException):
        load_cfg("experiment=nonexistent")


def test_engine_and_grammar_options(hydra_conf):
    cfg = load_cfg("engine=cuda", "engine.num_kv_blocks=64", "engine.enable_prefix_caching=false")
    kwargs = cfg.engine.llm_kwargs(cfg.model)
    assert cfg.engine.device == "cuda"
    assert kwargs["dtype"] == "bfloat16" and kwargs["num_kv_blocks"] == 64
    assert kwargs["enable_prefix_caching"] is False
    assert load_cfg("model.dtype=bfloat16").engine.llm_kwargs(ModelConfig("m", Dtype.bfloat16))["dtype"] == (
        "bfloat16"
    )
    cfg = load_cfg(
        "engine.quantization=int4", "engine.quantization_group_size=32", "engine.kv_cache_dtype=int8"
    )
    kwargs = cfg.engine.llm_kwargs(cfg.model)
    assert (
        kwargs["quantization"] == {"method": "int4", "group_size": 32} and kwargs["kv_cache_dtype"] == "int8"
    )
    assert load_cfg().engine.llm_kwargs(cfg.model)["quantization"] is None
    cfg = load_cfg("drafter=quantized_self", "drafter.zero_point=true", "drafter.group_size=32")
    assert cfg.drafter.speculative_config() == {
        "method": "quantized_self",
        "quantization": {"method": "int4", "group_size": 32, "zero_point": True},
        "num_speculative_tokens": 4,
    }
    cfg = load_cfg("grammar=choice", "grammar.choice=[yes,no]")
    assert sampling_params_kwargs(cfg.sampling, cfg.grammar)["choice"] == ["yes", "no"]
    cfg = load_cfg("grammar=json_schema")
    assert sampling_params_kwargs(cfg.sampling, cfg.grammar)["json_schema"]["required"] == ["name", "age"]
    cfg = load_cfg("grammar=regex", "grammar.regex='[0-9]+'")
    assert cfg.grammar.sampling_kwargs() == {"regex": "[0-9]+"}


@pytest.fixture(scope="module")
def zoo_configs_here(tmp_path_factory) -> Path:
    """A zoo cache (for ``SPECDEC_CACHE_DIR``) where every zoo model counts as converted, with a
    ``config.json`` of its real vocabulary size (tiny otherwise): the drafter's ``check_target`` reads the
    configs of converted models, never downloading one."""
    from transformers import LlamaConfig, Qwen2Config

    from specdec.zoo import MARKER_FILENAME, ZOO

    root = tmp_path_factory.mktemp("zoo_cache")
    small: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    for name, entry in ZOO.items():
        d = root / "models" / name
        if name.startswith("smollm2"):
            LlamaConfig(vocab_size=49152, **small).save_pretrained(d)
        else:
            Qwen2Config(vocab_size=151936, **small).save_pretrained(d)
        (d / MARKER_FILENAME).write_text(json.dumps({"name": name, "sha256": entry.sha256}))
    return root


@pytest.mark.parametrize("model,drafter,dataset,sampling", list(itertools.product(*OPTIONS.values())))
def test_every_combination_composes(
    hydra_conf, zoo_configs_here, monkeypatch, model, drafter, dataset, sampling
):
    overrides = [f"model={model}", f"drafter={drafter}", f"dataset={dataset}", f"sampling={sampling}"]
    if drafter == "draft_model" and model.startswith("smollm2"):
        # The vocabularies are compared by the library, from the models' configs when they are here.
        monkeypatch.setenv("SPECDEC_CACHE_DIR", str(zoo_configs_here))
        with pytest.raises(ValueError, match=r"vocabulary.*model=qwen2\.5-coder-1\.5b-instruct"):
            load_cfg(*overrides)
        return
    method = drafter
    if drafter == "registered":  # the generic option runs a registered method by name
        method = "ngram"
        overrides.append(f"drafter.method={method}")
    cfg = load_cfg(*overrides)
    assert cfg.model.name == model
    expected_drafter = EXPECTED_TYPES["drafter"][drafter]
    assert type(cfg.drafter) is expected_drafter and cfg.drafter.method == method
    expected_dataset = EXPECTED_TYPES["dataset"][dataset]
    assert type(cfg.dataset) is expected_dataset and cfg.dataset.name == dataset
    assert cfg.sampling.temperature == (0.0 if sampling == "greedy" else 1.0)


def test_user_overrides(hydra_conf, monkeypatch):
    monkeypatch.delenv("SPECDEC_SPECBENCH", raising=False)
    cfg = load_cfg(
        "model=qwen2.5-coder-1.5b-instruct",
        "drafter=draft_model",
        "drafter.num_speculative_tokens=6",
        "dataset=jsonl",
        "dataset.path=/data/q.jsonl",
        "dataset.limit=5",
        "sampling.temperature=0.7",
        "max_tokens=32",
    )
    assert cfg.drafter.speculative_config() == {
        "method": "draft_model",
        "model": "qwen2.5-coder-0.5b-instruct",
        "num_speculative_tokens": 6,
    }
    assert isinstance(cfg.dataset, JsonlDatasetConfig)
    assert (cfg.dataset.path, cfg.dataset.limit) == ("/data/q.jsonl", 5)
    assert (cfg.sampling.temperature, cfg.max_tokens) == (0.7, 32)
    assert load_cfg("drafter=none").drafter.speculative_config() is None
    # A reduced draft vocabulary for the EAGLE-2 head and Medusa: an EAGLE-3 head's name, or token ids.
    eagle = load_cfg("drafter=eagle", "drafter.draft_vocab=smollm2-135m-instruct-eagle3").drafter
    assert eagle.speculative_config()["draft_vocab"] == "smollm2-135m-instruct-eagle3"
    medusa = load_cfg("drafter=medusa", "drafter.draft_vocab=[3,1,2]").drafter
    assert medusa.speculative_config()["draft_vocab"] == [3, 1, 2]
    assert "draft_vocab" not in load_cfg("drafter=eagle").drafter.speculative_config()
    assert (
        config_to_dict(load_cfg("dataset=jsonl"))["dataset"]["path"] == "../shared/specbench/question.jsonl"
    )
    monkeypatch.setenv("SPECDEC_SPECBENCH", "/elsewhere/q.jsonl")
    assert config_to_dict(load_cfg("dataset=jsonl"))["dataset"]["path"] == "/elsewhere/q.jsonl"


def test_wrong_key_fails_clearly(hydra_conf):
    with pytest.raises(ConfigCompositionException) as info:
        load_cfg("drafter.num_speculative_token=3")
    assert "drafter.num_speculative_token" in error_text(info.value)
    with pytest.raises(ValueError, match=r"unknown key\(s\) drafter\.num_speculative_token\b"):
        load_cfg("+drafter.num_speculative_token=3")  # '+' bypasses the schema: caught on conversion
    # a key of another option is wrong too: n-gram drafters have no draft model
    with pytest.raises(ConfigCompositionException):
        load_cfg("drafter.model=qwen2.5-coder-0.5b-instruct")
    for bad in ("engine.block_sise=8", "logger.projekt=x", "grammar.regex=a"):
        with pytest.raises(ConfigCompositionException) as info:
            load_cfg(bad)
        assert bad.split("=")[0] in error_text(info.value)


def test_wrong_type_fails_clearly(hydra_conf):
    with pytest.raises(ConfigCompositionException) as info:
        load_cfg("max_tokens=abc")
    text = error_text(info.value)
    assert "max_tokens" in text and "Integer" in text
    with pytest.raises(ConfigCompositionException) as info:
        load_cfg("model.dtype=float8")
    assert "dtype" in error_text(info.value)
    with pytest.raises(ConfigCompositionException) as info:
        load_cfg("engine.max_num_seqs=lots")
    assert "engine.max_num_seqs" in error_text(info.value)
    with pytest.raises(ConfigCompositionException) as info:
        load_cfg("grammar=choice", "grammar.choice=yes")
    assert "grammar.choice" in error_text(info.value)
    with pytest.raises(ConfigCompositionException):
        load_cfg("sampling.temperature=hot")


@pytest.mark.parametrize(
    "override,message",
    [
        ("max_tokens=0", "max_tokens"),
        ("dataset.limit=0", "dataset.limit"),
        ("sampling.temperature=-1", "temperature"),
        ("sampling.top_p=0", r"sampling: top_p must be in \(0, 1\]"),
        ("sampling.top_k=-2", "sampling: top_k"),
        # A group's name field relabels the run without changing it: refused, naming the group to choose.
        ("drafter.method=draft_model", r"drafter\.method='draft_model' contradicts the chosen group"),
        ("dataset.name=humaneval", r"dataset\.name='humaneval' contradicts"),
        ("logger.name=wandb", r"logger\.name='wandb' contradicts"),
        ("sampling.repetition_penalty=0", "sampling: repetition_penalty"),
        ("drafter.num_speculative_tokens=0", "num_speculative_tokens"),
        ("drafter.prompt_lookup_min=5", r"drafter\.prompt_lookup_max must be an integer >= 5"),
        (
            "drafter.num_speculative_tokens=17",
            r"drafter\.num_speculative_tokens must be an integer in \[1, 16\]",
        ),
        ("engine.block_size=0", r"engine\.block_size must be"),
        ("engine.max_num_seqs=0", r"engine\.max_num_seqs must be"),
        ("engine.torch_threads=0", r"engine\.torch_threads"),
        ("engine.device=gpu0", r"engine\.device"),
        ("dataset=synthetic dataset.low_token=200", r"dataset\.low_token"),
        ("logger=wandb logger.mode=sometimes", r"logger\.mode"),
        ("grammar=regex grammar.regex=''", r"grammar \(regex\): regex must be a non-empty string"),
        ("grammar=choice grammar.choice=[]", r"grammar \(choice\): choice must be a non-empty list"),
    ],
)
def test_invalid_values_fail_before_loading(hydra_conf, override, message):
    with pytest.raises(ValueError, match=message):
        load_cfg(*override.split(" "))


@pytest.mark.parametrize(
    "overrides, message, field",
    [
        (
            ["drafter=suffix", "drafter.spec_factor=0"],
            r"drafter\.spec_factor must be a finite number > 0",
            "suffix_",
        ),
        (
            ["drafter=hybrid", "drafter.max_match=0"],
            r"drafter\.max_match must be an integer in \[1, 64\]",
            "suffix_",
        ),
        (
            ["drafter=hybrid", "drafter.members=[suffix,suffix]"],
            r"drafter\.members must be distinct",
            "hybrid_",
        ),
        (
            ["drafter=hybrid", "drafter.members=[draft_model]"],
            r"drafter\.members: 'draft_model' drafts with a model of its own",
            "hybrid_",
        ),
        (
            ["drafter=hybrid", "drafter.quantization=int8"],
            r"drafter\.quantization='int8' quantizes the hybrid's learned member .* the members "
            r"\['suffix', 'ngram'\] include none",
            "hybrid_",
        ),
    ],
)
def test_suffix_and_hybrid_errors_name_the_hydra_key(hydra_conf, overrides, message, field):
    """Issue #7: the key the user typed (``drafter.spec_factor``), not the ``SpeculativeConfig`` field it
    sets (``suffix_spec_factor``)."""
    with pytest.raises(ValueError, match=f"^{message}") as info:
        load_cfg(*overrides)
    assert field not in str(info.value)


def test_registered_drafter_runs_by_name(hydra_conf):
    """``drafter=registered drafter.method=<name>``: a drafter registered outside the library, its fields
    passed through to ``speculative_config`` and checked by the library."""
    from specdec.config import SpeculativeConfig
    from specdec.drafters import DrafterBase, DraftProposal, register_drafter, unregister_drafter

    @register_drafter("test_repeat_last")
    class RepeatLast(DrafterBase):
        def __init__(self, ctx, scale: int = 1) -> None:
            self.k, self.scale = ctx.config.num_speculative_tokens, scale

        def propose(self, batch):
            return [DraftProposal([x.request.token_ids[-1]] * min(self.k, x.max_drafts)) for x in batch]

    try:
        cfg = load_cfg(
            "drafter=registered",
            "drafter.method=test_repeat_last",
            "drafter.num_speculative_tokens=3",
            "+drafter.drafter_kwargs.scale=2",
        )
        assert type(cfg.drafter) is RegisteredDrafterConfig and cfg.drafter.method == "test_repeat_last"
        spec = cfg.drafter.speculative_config()
        assert spec == {
            "method": "test_repeat_last",
            "num_speculative_tokens": 3,
            "model": None,
            "tree": None,
            "drafter_kwargs": {"scale": 2},
        }
        config = SpeculativeConfig.from_any(spec)
        assert config is not None and config.drafter_kwargs == {"scale": 2}
        # its entry allows chains only and no model: the library says so, keyed by the config
        with pytest.raises(ValueError, match=r"drafter\.tree='dynamic' needs method"):
            load_cfg("drafter=registered", "drafter.method=test_repeat_last", "drafter.tree=dynamic")
        with pytest.raises(ValueError, match=r"drafter: speculative method '\w+' takes no model"):
            load_cfg("drafter=registered", "drafter.method=test_repeat_last", "drafter.model=x")
    finally:
        unregister_drafter("test_repeat_last")
    # the method names the run only in this group: elsewhere it still cannot be overridden
    with pytest.raises(ValueError, match=r"drafter\.method='eagle' contradicts the chosen group"):
        load_cfg("drafter=medusa", "drafter.method=eagle")


def test_unregistered_drafter_names_the_registered_ones(hydra_conf):
    from specdec.drafters import drafter_names

    with pytest.raises(ValueError) as info:
        load_cfg("drafter=registered", "drafter.method=test_repeat_last")
    text = str(info.value)
    assert text.startswith("drafter.method: ") and "got 'test_repeat_last'" in text
    assert all(repr(name) in text for name in drafter_names())
    assert "drafter.import_module" in text  # how to register one's own
    with pytest.raises(Exception, match=r"drafter\.method"):
        load_cfg("drafter=registered")  # no method: missing mandatory value


def test_registered_drafter_module_is_imported(hydra_conf, tmp_path, monkeypatch):
    import sys

    from specdec.drafters import unregister_drafter

    (tmp_path / "my_test_drafters.py").write_text(
        "from specdec.drafters import DrafterBase, register_drafter\n\n\n"
        "@register_drafter('test_from_module')\n"
        "class FromModule(DrafterBase):\n"
        "    def propose(self, batch):\n"
        "        return []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cfg = load_cfg(
            "drafter=registered", "drafter.method=test_from_module", "drafter.import_module=my_test_drafters"
        )
        spec = cfg.drafter.speculative_config()
        assert spec is not None and spec["method"] == "test_from_module"
    finally:
        unregister_drafter("test_from_module")
        sys.modules.pop("my_test_drafters", None)
    with pytest.raises(ValueError, match=r"drafter\.import_module='no_such_drafters' cannot be imported"):
        load_cfg("drafter=registered", "drafter.method=ngram", "drafter.import_module=no_such_drafters")


# ----------------------------------------------------------------------------------------- builtin
def test_builtin_prompts_are_deterministic_and_varied():
    a, b = load_builtin(12, seed=0), load_builtin(12, seed=0)
    assert [(p.id, p.messages) for p in a] == [(p.id, p.messages) for p in b]
    assert len(a) == 12 and len({p.id for p in a}) == 12
    counts: dict[str, int] = {}
    for p in a:
        counts[p.category] = counts.get(p.category, 0) + 1
        assert p.messages and p.messages[0]["role"] == "user"
        assert 0 < len(p.text) <= 1200
    assert len(counts) >= 3
    assert max(counts.values()) - min(counts.values()) <= 1
    assert [p.id for p in load_builtin(12, seed=1)] != [p.id for p in a]


def test_builtin_cap_and_limit():
    small = load_builtin(8, seed=0, max_prompt_chars=700)
    assert len(small) == 8 and all(len(p.text) <= 700 for p in small)
    assert len(load_builtin(3)) == 3
    assert load_prompts(BuiltinDatasetConfig(limit=5))[0].id == load_builtin(5)[0].id
    with pytest.raises(ValueError, match="max_prompt_chars"):
        load_builtin(4, max_prompt_chars=20)


def test_synthetic_prompts():
    cfg = SyntheticDatasetConfig(limit=5, prompt_len=20, pattern_len=4, vocab_size=50, low_token=3, seed=1)
    prompts = load_prompts(cfg)
    assert [p.category for p in prompts] == ["repeat", "random", "repeat", "random", "repeat"]
    assert all(len(p.token_ids or []) == 20 and min(p.token_ids or []) >= 3 for p in prompts)
    assert all(max(p.token_ids or []) < 50 for p in prompts)
    rep = prompts[0].token_ids or []
    assert rep[:4] == rep[4:8] == rep[16:20]
    assert [p.token_ids for p in load_prompts(cfg)] == [p.token_ids for p in prompts]


# ------------------------------------------------------------------------------------------- jsonl
def write_specbench(path: Path, counts: dict[str, int]) -> None:
    qid = 0
    with path.open("w") as f:
        for cat, n in counts.items():
            for i in range(n):
                qid += 1
                f.write(json.dumps({"question_id": qid, "category": cat, "turns": [f"{cat} {i}?", "more"]}))
                f.write("\n")


def test_jsonl_stratified_limit(tmp_path):
    path = tmp_path / "question.jsonl"
    write_specbench(path, {"writing": 5, "math": 2, "coding": 1})
    prompts = load_jsonl(str(path), limit=4)
    assert [p.category for p in prompts] == ["writing", "math", "coding", "writing"]
    assert [p.text for p in prompts] == ["writing 0?", "math 0?", "coding 0?", "writing 1?"]
    assert len(load_jsonl(str(path))) == 8
    only = load_jsonl(str(path), limit=None, categories=["math", "coding"])
    assert [p.id for p in only] == ["6", "8", "7"]
    cfg = JsonlDatasetConfig(path=str(path), limit=2, categories=["writing"])
    assert [p.text for p in load_prompts(cfg)] == ["writing 0?", "writing 1?"]
    with pytest.raises(ValueError, match="poetry"):
        load_jsonl(str(path), categories=["poetry"])


def test_round_robin_keeps_order_within_category():
    from experiments.datasets import Prompt

    ps = [Prompt(str(i), c) for i, c in enumerate("aabacbb")]
    assert [p.id for p in round_robin(ps)] == ["0", "2", "4", "1", "5", "3", "6"]


def test_jsonl_errors(tmp_path):
    missing = tmp_path / "nope" / "question.jsonl"
    with pytest.raises(FileNotFoundError, match=r"dataset\.path") as info:
        load_jsonl(str(missing))
    assert str(missing) in str(info.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "x", "turns": ["a"]}\n{"question_id": 2}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_jsonl(str(bad))


@pytest.mark.skipif(not SPECBENCH.is_file(), reason="../shared/specbench/question.jsonl is absent")
def test_specbench_file():
    prompts = load_jsonl(str(SPECBENCH), limit=13)
    assert len({p.category for p in prompts}) == 13
    assert all(p.text for p in prompts)
    assert len(load_jsonl(str(SPECBENCH), limit=None)) == 480


# --------------------------------------------------------------------------------------- humaneval
def test_humaneval_reader(tmp_path):
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(3):
            row = {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    '''doc'''\n", "test": ""}
            f.write(json.dumps(row) + "\n")
    prompts = load_humaneval(str(path), limit=2)
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1"]
    assert (
        prompts[0].text
        == "Complete the following Python function:\n```python\ndef f0(x):\n    '''doc'''\n\n```"
    )
    assert prompts[0].category == "humaneval"
    assert len(load_prompts(HumanEvalDatasetConfig(path=str(path), limit=None))) == 3
    with pytest.raises(FileNotFoundError, match="SPECDEC_HUMANEVAL"):
        load_humaneval(str(tmp_path / "missing.jsonl.gz"))


@pytest.mark.skipif(not HUMANEVAL.is_file(), reason="../shared/humaneval/HumanEval.jsonl.gz is absent")
def test_humaneval_file():
    prompts = load_humaneval(str(HUMANEVAL), limit=5)
    assert len(prompts) == 5 and prompts[0].id == "HumanEval/0"


# ------------------------------------------------------------------------------------ run: logic
class FakeStats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = self.num_steps = 0
        self.accepted_per_position = [0, 0]
        self.draft_time_s = self.verify_time_s = 0.0


class FakeLLM:
    """Echoes the prompt's last tokens; as a 'speculative' LLM it reports 2 drafts of K=2 per prompt,
    of which positions (0) and (0, 1) were accepted."""

    def __init__(self, spec: dict[str, Any] | None, use_stats: bool, diverge: bool = False) -> None:
        self.spec, self.diverge = spec, diverge
        stats = FakeStats() if spec is not None and use_stats else None
        self.engine = SimpleNamespace(spec_stats=stats, reset_spec_stats=stats.reset if stats else None)
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        ids = list(prompts[0]["prompt_token_ids"])[-params.max_tokens :]
        if self.diverge and self.spec is not None:
            ids = [t + 1 for t in ids]
        metrics: dict[str, Any] = {"num_generated_tokens": len(ids)}
        if self.spec is not None:
            counts = {"num_drafts": 2, "num_draft_tokens": 4, "num_accepted_tokens": 3, "num_steps": 3}
            if self.engine.spec_stats is not None:
                s = self.engine.spec_stats
                s.num_steps += 3  # one of them drafted nothing
                s.num_drafts += 2
                s.num_draft_tokens += 4
                s.num_accepted_tokens += 3
                s.accepted_per_position = [s.accepted_per_position[0] + 2, s.accepted_per_position[1] + 1]
                s.draft_time_s += 0.01
            else:
                metrics.update(counts, accepted_per_position=[2, 1])
        out = SimpleNamespace(token_ids=ids, text=" ".join(map(str, ids)), finish_reason="length")
        return [SimpleNamespace(outputs=[out], metrics=metrics)]


@pytest.mark.parametrize("use_stats", [True, False])
def test_run_prompts_aggregates(use_stats):
    built: list[FakeLLM] = []

    def factory(spec):
        built.append(FakeLLM(spec, use_stats))
        return built[-1]

    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    metrics, records = run_prompts(
        factory,
        prompts,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        sampling=SamplingConfig(),
        max_tokens=3,
        categories=["a", "b", "a"],
    )
    assert [llm.spec is None for llm in built] == [False, True]  # speculative pass first
    assert all(llm.calls == 1 + len(prompts) for llm in built)  # warm-up + one call per prompt
    assert metrics["num_prompts"] == 3 and metrics["tokens_baseline"] == metrics["tokens_spec"] == 8
    assert metrics["greedy_equal"] is True and metrics["num_greedy_mismatches"] == 0
    assert metrics["num_drafts"] == 6 and metrics["num_draft_tokens"] == 12
    assert metrics["acceptance_rate"] == pytest.approx(9 / 12)
    assert metrics["mean_acceptance_length"] == pytest.approx(1 + 9 / 6)
    assert (metrics["num_steps"], metrics["tokens_per_step"]) == (9, pytest.approx(1 + 9 / 9))
    assert metrics["accepted_per_position"] == pytest.approx([1.0, 0.5])
    assert metrics["speedup"] == pytest.approx(
        metrics["tokens_per_s_spec"] / metrics["tokens_per_s_baseline"]
    )
    assert (metrics["draft_time_s"] is None) is (not use_stats)
    assert set(metrics["per_category"]) == {"a", "b"}
    assert metrics["per_category"]["a"]["num_prompts"] == 2
    assert metrics["per_category"]["b"]["num_drafts"] == 2
    assert [r["category"] for r in records] == ["a", "b", "a"]
    assert records[0]["spec"]["mean_acceptance_length"] == pytest.approx(2.5)


def test_run_prompts_mismatch_and_sampling():
    def diverging(spec):
        return FakeLLM(spec, True, diverge=True)

    metrics, _ = run_prompts(
        diverging, [[1, 2]], speculative_config={"method": "ngram"}, sampling=SamplingConfig(), max_tokens=2
    )
    assert metrics["greedy_equal"] is False and metrics["num_greedy_mismatches"] == 1
    assert metrics["speedup_median"] > 0
    summary = {
        **metrics,
        "drafter": "ngram",
        "config": {
            "model": {"name": "m", "dtype": "bfloat16"},
            "drafter": {"num_speculative_tokens": 2},
            "dataset": {"name": "builtin"},
            "sampling": {"temperature": 0.0},
            "max_tokens": 2,
        },
    }
    text = format_summary(summary)
    assert "false (1/1 outputs differ)" in text and "model.dtype=float32" in text
    metrics, records = run_prompts(
        diverging,
        [[1, 2]],
        speculative_config={"method": "ngram"},
        sampling=SamplingConfig(temperature=1.0, seed=0),
        max_tokens=2,
    )
    assert metrics["greedy_equal"] is None and records[0]["equal"] is False
    metrics, records = run_prompts(
        diverging, [[1, 2]], speculative_config=None, sampling=SamplingConfig(), max_tokens=2
    )
    assert metrics["speedup"] is None and metrics["greedy_equal"] is None and records[0]["spec"] is None


# -------------------------------------------------------------------------------- run: tiny model
def tiny_cfg(model_dir: Path, drafter: str) -> ExperimentConfig:
    cfg = load_cfg(f"drafter={drafter}", "model.dtype=float32", "max_tokens=8", "engine=cpu", "plots=false")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=str(model_dir)))


SUMMARY_KEYS = {
    "speedup",
    "mean_acceptance_length",
    "acceptance_rate",
    "accepted_per_position",
    "tokens_per_s_baseline",
    "tokens_per_s_spec",
    "greedy_equal",
    "num_prompts",
    "per_category",
    "config",
    "git",
    "versions",
    "seeds",
}


def test_run_experiment_tiny_baseline(hydra_conf, tiny_model_dirs, tmp_path):
    cfg = tiny_cfg(tiny_model_dirs["llama-gqa3-tied"], "none")
    prompt_ids = [[1, 5, 9, 17, 33, 5, 9], [1, 70, 71, 72, 73]]
    summary = run_experiment(cfg, out_dir=tmp_path, prompt_ids=prompt_ids)
    assert set(summary) >= SUMMARY_KEYS
    assert summary["num_prompts"] == 2 and summary["tokens_baseline"] > 0
    assert summary["tokens_per_s_baseline"] > 0
    assert summary["speedup"] is None and summary["tokens_per_s_spec"] is None
    assert summary["config"]["model"]["dtype"] == "float32"
    assert set(summary["versions"]) >= {"torch", "transformers", "specdec"}
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["num_prompts"] == 2
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["baseline"]["num_tokens"] > 0
    assert "baseline" in format_summary(summary)


def test_run_experiment_tiny_ngram(hydra_conf, tiny_model_dirs, tmp_path):
    cfg = tiny_cfg(tiny_model_dirs["qwen2-gqa2-untied"], "ngram")
    prompt_ids = [[1, 5, 9, 17, 5, 9, 17, 5, 9], [1, 70, 71, 72, 70, 71]]
    try:
        summary = run_experiment(cfg, out_dir=tmp_path, prompt_ids=prompt_ids)
    except NotImplementedError as e:
        pytest.skip(f"speculative decoding not available yet: {e}")
    assert set(summary) >= SUMMARY_KEYS
    assert summary["greedy_equal"] is True
    assert summary["tokens_spec"] == summary["tokens_baseline"] > 0
    assert summary["speedup"] is not None
    assert "ngram" in format_summary(summary)


def test_run_experiment_tiny_synthetic_writes_its_run_dir(hydra_conf, tiny_model_dirs, tmp_path):
    cfg = tiny_cfg(tiny_model_dirs["llama-gqa3-tied"], "ngram")
    cfg = dataclasses.replace(
        cfg,
        dataset=SyntheticDatasetConfig(limit=2, prompt_len=16),
        engine=EngineConfig(device="cpu"),
        plots=True,
    )
    logged: dict[str, Any] = {"steps": [], "summary": {}, "images": {}}

    class Recorder:
        def log(self, metrics, step=None):
            logged["steps"].append((step, dict(metrics)))

        def log_summary(self, metrics):
            logged["summary"].update(metrics)

        def log_images(self, images):
            logged["images"].update(images)

        def log_table(self, name, columns, rows):
            pass

        def finish(self, exit_code=0):
            pass

    summary = run_experiment(cfg, out_dir=tmp_path, tracker=Recorder())
    assert summary["num_prompts"] == 2 and set(summary["per_category"]) == {"repeat", "random"}
    assert summary["config"]["dataset"]["name"] == "synthetic"
    for name in ("summary.json", "results.jsonl", "config.yaml", "run_info.json"):
        assert (tmp_path / name).is_file()
    import yaml

    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved == summary["config"]
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["seeds"] == summary["seeds"] and info["versions"] == summary["versions"]
    assert [s for s, _ in logged["steps"]] == [0, 1]
    assert logged["summary"]["mean_acceptance_length"] == summary["mean_acceptance_length"]
    assert "config" not in logged["summary"]
    if summary["tokens_per_s_spec"] is not None:
        assert set(logged["images"]) == {"plots/acceptance_per_position", "plots/acceptance_per_category"}
        assert all(Path(p).suffix == ".png" and Path(p).is_file() for p in logged["images"].values())


def test_run_experiment_without_tokenizer_needs_ids(hydra_conf, tiny_model_dirs):
    cfg = tiny_cfg(tiny_model_dirs["llama-gqa3-tied"], "none")
    cfg = dataclasses.replace(cfg, dataset=BuiltinDatasetConfig(limit=1))
    with pytest.raises(ValueError, match="no tokenizer"):
        run_experiment(cfg)


# ------------------------------------------------------------- schemas are not group options (issue 24)
@pytest.mark.parametrize("override", ["drafter=ngram_schema", "model=model_schema", "dataset=builtin_schema"])
def test_schemas_are_not_offered_as_group_options(hydra_conf, override):
    with pytest.raises(MissingConfigException) as info:
        load_cfg(override)
    listed = str(info.value).split("Available options", 1)[1].split("Config search path", 1)[0]
    assert "schema" not in listed and listed.strip()


def test_a_misspelt_drafter_key_still_fails_at_composition(hydra_conf):
    with pytest.raises(Exception) as info:
        load_cfg("+drafter.prompt_lookup_maxx=3")
    assert "prompt_lookup_maxx" in error_text(info.value)
