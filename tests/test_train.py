"""The draft-head training pipeline (``experiments/train/``): config, prompts and split, data cache,
Medusa and EAGLE training on a tiny random target, checkpoints that reload to identical outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

from experiments.config import (
    EagleDrafterConfig,
    MedusaDrafterConfig,
    TrainConfig,
    register_configs,
    to_train_config,
)
from experiments.datasets import CHAT_CATEGORIES, CHAT_TEMPLATES, CHAT_TOPICS, load_chat
from experiments.train import (
    FrozenTarget,
    evaluate_tau,
    initialise_from,
    is_heldout,
    load_heldout_prompts,
    medusa_head_outputs,
    run_training,
    split_heldout,
    training_prompts,
)
from specdec.config import DEFAULT_MAX_TREE_NODES
from tests.conftest import make_tiny_hf_model


@pytest.fixture(scope="module")
def hydra_conf():
    register_configs()
    with initialize_config_module(config_module="experiments.conf", version_base=None):
        yield


def load_train_cfg(*overrides: str) -> TrainConfig:
    return to_train_config(compose(config_name="train", overrides=list(overrides)))


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("drafter,schema", [("medusa", MedusaDrafterConfig), ("eagle", EagleDrafterConfig)])
def test_train_config_composes(hydra_conf, drafter, schema):
    cfg = load_train_cfg(f"drafter={drafter}", "train.time_budget_s=60", "data.chat_limit=10")
    assert type(cfg.drafter) is schema and cfg.drafter.method == drafter
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.model.dtype.value == "bfloat16"
    assert (cfg.train.time_budget_s, cfg.data.chat_limit, cfg.data.heldout_fraction) == (60.0, 10, 0.1)
    spec = cfg.drafter.speculative_config()
    assert spec == {
        "method": drafter,
        "num_speculative_tokens": 4,
        "model": None,
        "tree": None,
        "tree_choices": None,
        "tree_topk": 4,
        "max_tree_nodes": 15,
    }
    # the Hydra default is the library's: a 16-row verification step with the root
    assert spec["max_tree_nodes"] == DEFAULT_MAX_TREE_NODES
    cfg = load_train_cfg(f"drafter={drafter}", "drafter.tree_choices=[[0],[1],[0,0]]", "drafter.model=x")
    assert cfg.drafter.speculative_config()["tree_choices"] == [[0], [1], [0, 0]]


def test_train_config_rejects_bad_values(hydra_conf):
    with pytest.raises(ConfigCompositionException):
        load_train_cfg("train.time_budget=5")  # misspelt key
    with pytest.raises(ValueError, match="drafter must be medusa, eagle or eagle3"):
        load_train_cfg("drafter=ngram")
    with pytest.raises(ValueError, match=r"train\.time_budget_s or train\.epochs"):
        load_train_cfg("train.time_budget_s=null")
    with pytest.raises(ValueError, match=r"data\.n=2 needs sampling"):
        load_train_cfg("data.n=2")
    with pytest.raises(ValueError, match=r"train\.medusa_num_heads=3"):
        load_train_cfg("drafter=medusa", "train.medusa_num_heads=3")
    with pytest.raises(ValueError, match=r"drafter\.tree must be"):
        load_train_cfg("drafter=eagle", "drafter.tree=bushy")
    with pytest.raises(ValueError, match=r"include_greedy=true needs data\.temperature > 0"):
        load_train_cfg("data.include_greedy=true")
    with pytest.raises(ValueError, match="eagle_unroll"):
        load_train_cfg("drafter=eagle", "train.eagle_unroll=3")
    with pytest.raises(ValueError, match=r"data\.synth_prompts must be >= 0, got -1"):
        load_train_cfg("data.synth_prompts=-1")


# ----------------------------------------------------------------------------------------- prompts
def test_chat_prompts_are_deterministic_and_categorised():
    a, b = load_chat(), load_chat()
    assert len(a) == len(CHAT_TEMPLATES) * len(CHAT_TOPICS) == 440
    assert [(p.id, p.text) for p in a] == [(p.id, p.text) for p in b]
    assert len({p.id for p in a}) == len(a)
    assert {p.category for p in a} == set(CHAT_CATEGORIES)
    assert [p.category for p in a[: len(CHAT_CATEGORIES)]] == list(CHAT_CATEGORIES)  # round-robin
    assert [p.id for p in load_chat(seed=1)] == [p.id for p in a]
    assert [p.text for p in load_chat(seed=1)] != [p.text for p in a]  # names and numbers move
    assert all("{" not in p.text for p in a)


def test_heldout_split_depends_on_the_id_only():
    from experiments.config import TrainDataConfig

    data = TrainDataConfig(builtin_limit=40, chat_limit=60)
    prompts = training_prompts(data)
    flags = split_heldout(prompts, 0.1)
    assert flags == [is_heldout(p.id, 0.1) for p in prompts]
    assert 0 < sum(flags) < len(prompts) * 0.3
    held = load_heldout_prompts(data)
    assert [p.id for p in held] == [p.id for p, f in zip(prompts, flags) if f]
    # a prompt's side does not depend on the other prompts
    assert split_heldout(prompts[::-1], 0.1) == flags[::-1]
    # tiny sets still get one prompt on each side
    few = prompts[:2]
    assert sorted(split_heldout(few, 0.1)) == [False, True]


# -------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("train_target") / "tiny-llama"
    make_tiny_hf_model("llama", 4, 2, False, vocab_size=96, seed=3).save_pretrained(
        d, safe_serialization=True
    )
    return d


def tiny_prompts(n: int = 10, length: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 96, (length,), generator=g).tolist() for _ in range(n)]


def tiny_cfg(target: Path, tmp: Path, drafter: str, *extra: str) -> TrainConfig:
    return load_train_cfg(
        f"drafter={drafter}",
        f"model.name={target}",
        "model.dtype=float32",
        f"data.cache_dir={tmp / 'cache'}",
        "data.max_new_tokens=24",
        "data.heldout_fraction=0.2",
        "train.time_budget_s=null",
        "train.eval=false",
        "train.torch_threads=1",
        "train.warmup_steps=5",
        "train.log_every=5",
        "train.lr=0.01",
        f"train.out_dir={tmp / ('heads-' + drafter)}",
        *extra,
    )


def test_medusa_trains_saves_and_reloads(hydra_conf, tiny_target, tmp_path):
    from specdec.drafters.heads import load_heads

    cfg = tiny_cfg(tiny_target, tmp_path, "medusa", "train.epochs=60", "train.batch_tokens=64")
    summary = run_training(cfg, tmp_path / "run", prompt_ids=tiny_prompts())
    assert summary["final_train_loss"] < 0.8 * summary["initial_train_loss"]
    m = summary["final_metrics"]
    assert len(m["top1"]) == 4 and len(m["rank_accuracy"]) == 4 and len(m["rank_accuracy"][0]) == 10
    for ranks, t1, t5 in zip(m["rank_accuracy"], m["top1"], m["top5"]):
        assert (
            ranks[0] == pytest.approx(t1) and sum(ranks[:5]) == pytest.approx(t5) and sum(ranks) <= 1 + 1e-9
        )
    out = Path(summary["out_dir"])
    assert (out / "COMMAND.md").is_file() and (out / "model.safetensors").is_file()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["method"] == "medusa"
    # reload: identical outputs to the trained heads rounded to the checkpoint's bfloat16
    target = FrozenTarget.load(tiny_target)
    heads, config = load_heads(str(out), target.arch, "medusa", torch.float32)
    assert config.num_heads == 4 and config.training["data_fingerprint"]
    assert config.training["num_training_tokens"] > 0 and config.training["final_metrics"] == m
    reference = _trained_module(summary, "medusa", target)
    f = torch.randn(7, target.arch.hidden_size)
    with torch.no_grad():
        got = heads(f)
        want = torch.stack([medusa_head_outputs(reference, f, k) for k in range(4)], dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a second run with the same data settings reads the cache
    again = run_training(
        tiny_cfg(tiny_target, tmp_path, "medusa", "train.epochs=1", "train.medusa_num_heads=5"),
        None,
        prompt_ids=tiny_prompts(),
    )
    assert again["data_cached"] and again["data_fingerprint"] == summary["data_fingerprint"]
    # without the featurised data, the cached responses are featurised again (no generation)
    shutil.rmtree(summary["data_dir"])
    third = run_training(
        tiny_cfg(tiny_target, tmp_path, "medusa", "train.epochs=1", "train.medusa_num_heads=5"),
        None,
        prompt_ids=tiny_prompts(),
    )
    assert not third["data_cached"] and third["responses_cached"]
    assert third["data"] == {**summary["data"], "feature_time_s": third["data"]["feature_time_s"]}


def test_eagle_trains_saves_and_reloads(hydra_conf, tiny_target, tmp_path):
    from specdec.attention.dense import DenseAttention, dense_metadata
    from specdec.drafters.heads import EagleHead, load_heads

    cfg = tiny_cfg(
        tiny_target,
        tmp_path,
        "eagle",
        "train.epochs=40",
        "train.batch_tokens=72",
        "train.eagle_unroll=2",
        "train.eagle_noise=0.01",
    )
    summary = run_training(cfg, tmp_path / "run", prompt_ids=tiny_prompts())
    assert summary["final_train_loss"] < 0.8 * summary["initial_train_loss"]
    m = summary["final_metrics"]
    assert {"loss_feat", "loss_ce", "top1", "top5", "top1_step2"} <= set(m)
    out = Path(summary["out_dir"])
    target = FrozenTarget.load(tiny_target)
    head, config = load_heads(str(out), target.arch, "eagle", torch.float32)
    assert config.arch is not None and config.num_heads == 1
    reference = _trained_module(summary, "eagle", target)
    n = 9
    args = (
        torch.randn(n, target.arch.hidden_size),
        torch.randn(n, target.arch.hidden_size),
        torch.arange(n),
        (None, None),
        dense_metadata([n]),
        DenseAttention(),
    )
    with torch.no_grad():
        torch.testing.assert_close(head(*args), reference(*args), rtol=0, atol=0)

    # Fine-tuning these heads on greedy + sampled responses: the greedy part comes from the cache, the
    # sampled part doubles the sequences, and training starts where the first run ended.
    def fine_tune(name: str, *extra: str) -> dict:
        return run_training(
            tiny_cfg(
                tiny_target,
                tmp_path,
                "eagle",
                "train.epochs=2",
                "train.batch_tokens=72",
                "train.eagle_unroll=2",
                "data.temperature=0.8",
                "data.include_greedy=true",
                f"train.out_dir={tmp_path / name}",
                *extra,
            ),
            None,
            prompt_ids=tiny_prompts(),
        )

    tuned = fine_tune("tuned", f"train.init_from={out}")
    fresh = fine_tune("fresh")  # the same run from a fresh initialisation
    parts = tuned["data"]["parts"]
    assert [p["generation"]["temperature"] for p in parts] == [0.0, 0.8]
    assert parts[0]["fingerprint"] == summary["data_fingerprint"] and parts[0]["cached"]
    assert tuned["data"]["num_sequences"] == 2 * summary["data"]["num_sequences"]
    assert tuned["num_prompts"] == summary["num_prompts"]  # the split is the prompts', not the parts'
    # (deterministic: same data, seeds and steps; only the starting weights differ)
    assert tuned["initial_train_loss"] < fresh["initial_train_loss"]
    assert tuned["final_train_loss"] < fresh["final_train_loss"]
    started = EagleHead(target.arch)
    initialise_from(started, str(out), target, "eagle")
    with torch.no_grad():
        torch.testing.assert_close(started(*args), head(*args), rtol=0, atol=0)
    _, tuned_config = load_heads(str(tmp_path / "tuned"), target.arch, "eagle", torch.float32)
    record = tuned_config.training["init_from"]
    assert record["heads"] == str(out) and record["steps"] == config.training["steps"]
    from specdec.errors import ConfigError

    with pytest.raises(ConfigError, match="holds eagle heads, not medusa"):
        run_training(
            tiny_cfg(tiny_target, tmp_path, "medusa", "train.epochs=1", f"train.init_from={out}"),
            None,
            prompt_ids=tiny_prompts(),
        )


def _trained_module(summary, method: str, target: FrozenTarget) -> torch.nn.Module:
    """The heads as trained, with weights rounded to bfloat16 (what the checkpoint stores), rebuilt
    from the safetensors file independently of load_heads."""
    from safetensors.torch import load_file

    from specdec.drafters.heads import EagleHead, MedusaHeads

    state = load_file(str(Path(summary["out_dir"]) / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    module = MedusaHeads(target.arch.hidden_size, 4) if method == "medusa" else EagleHead(target.arch)
    module.load_state_dict({k: v.float() for k, v in state.items()})
    return module.eval()


def test_evaluate_tau_aggregates_engine_counts(hydra_conf, tmp_path):
    """The tau evaluation against a stand-in LLM whose requests report fixed draft counts."""
    from types import SimpleNamespace

    cfg = load_train_cfg("drafter=eagle")
    counts = iter([(4, 16, 8, [4, 3, 1, 0]), (2, 8, 2, [1, 1, 0, 0])])

    class FakeLLM:
        def __init__(self, spec):
            assert spec["method"] == "eagle" and spec["model"] == str(tmp_path)

        def generate(self, prompts, params):
            if params.max_tokens == 8:  # the warm-up
                return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1], text="")], metrics={})]
            d, dt, a, per = next(counts)
            metrics = {
                "num_drafts": d,
                "num_draft_tokens": dt,
                "num_accepted_tokens": a,
                "accepted_per_position": per,
            }
            comp = SimpleNamespace(token_ids=[5] * 10, text="", finish_reason="length")
            return [SimpleNamespace(outputs=[comp], metrics=metrics)]

    out = evaluate_tau(cfg, tmp_path, [[1, 2, 3], [4, 5]], ["a", "b"], llm_factory=FakeLLM)
    assert out["tau"] == pytest.approx(1 + 10 / 6)
    assert out["acceptance_rate"] == pytest.approx(10 / 24)
    assert out["accepted_per_position"] == pytest.approx([5 / 6, 4 / 6, 1 / 6, 0])
    assert out["per_category"]["a"]["tau"] == pytest.approx(3.0)


@pytest.mark.real_model
@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_builtin_heads_fit_smollm2(smollm2_dir, method):
    """The heads shipped in specdec/heads load by name for SmolLM2, say how they were made, and stay small."""
    from specdec.drafters.heads import BUILTIN_HEADS_DIR, load_heads
    from specdec.models.config import ModelArchConfig

    name = f"smollm2-135m-instruct-{method}"
    _, config = load_heads(name, ModelArchConfig.from_pretrained(smollm2_dir), method, torch.bfloat16)
    assert config.target == "smollm2-135m-instruct" and config.training["command"].startswith(
        f"python -m experiments.train drafter={method}"
    )
    assert config.training["command"] in (BUILTIN_HEADS_DIR / name / "COMMAND.md").read_text()
    total = sum(f.stat().st_size for d in BUILTIN_HEADS_DIR.iterdir() if d.is_dir() for f in d.iterdir())
    # Medusa 2.7 MB, EAGLE 8.4 MB, EAGLE-3 19.7 MB (bf16; its 2H-wide layer and an 8,192-row LM head):
    # the wheel's budget for built-in heads is 32 MiB.
    assert total <= 32 * 1024**2
