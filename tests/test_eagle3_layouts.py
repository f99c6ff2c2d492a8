"""EAGLE-3 heads in the three layouts (:mod:`specdec.drafters.eagle3_layouts`): one random head saved in this
library's layout and written, weight for weight, as SafeAILab/EAGLE and vLLM ``speculators`` checkpoints
(their config fields and weight names, synthetic files) loads into the same :class:`Eagle3Head`, state
and forward bit-exact in float32; detection; every mismatch raises its error before a head is built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdec.attention.dense import DenseAttention, dense_metadata
from specdec.drafters import eagle3_layouts
from specdec.drafters.eagle3_head import Eagle3Head
from specdec.drafters.eagle3_layouts import detect_eagle3_layout, load_eagle3_head
from specdec.drafters.heads import HeadConfig, arch_fields, save_heads
from specdec.errors import ConfigError, CorruptModelError, InvalidRequestError
from specdec.models.config import ModelArchConfig

V, H, INTER, HEADS, KV_HEADS, LAYERS, V_D = 64, 32, 48, 4, 2, 8, 20
HD = H // HEADS
FEATURES = (2, 4, 5)  # default_feature_layers(8)


def _target() -> ModelArchConfig:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    return ModelArchConfig.from_hf_config(cfg)


TARGET = _target()


def _random_head(norm_before_residual: bool, seed: int = 0) -> Eagle3Head:
    """Random weights rounded to bfloat16 (what :func:`save_heads` stores, so every layout holds the same
    values) and a non-trivial draft vocabulary."""
    torch.manual_seed(seed)
    head = Eagle3Head(TARGET, V_D, FEATURES, norm_before_residual)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(
                (1.0 + 0.1 * torch.randn_like(p))
                if name.endswith("norm.weight")
                else 0.2 * torch.randn_like(p)
            )
            p.copy_(p.bfloat16().float())
    head.set_vocab(torch.randperm(V)[:V_D].tolist())
    assert head.d2t.any()
    return head


def _public_state(head: Eagle3Head, prefix: str) -> dict[str, torch.Tensor]:
    """``head``'s weights under the public names: separate q/k/v and gate/up, the layer under
    ``prefix``, and a (random) target embedding as both projects store it."""
    sd = {k: v.clone() for k, v in head.state_dict().items()}
    q, k, v = sd.pop("layer.qkv_proj.weight").split([HEADS * HD, KV_HEADS * HD, KV_HEADS * HD])
    gate, up = sd.pop("layer.gate_up_proj.weight").split([INTER, INTER])
    out = {
        "fc.weight": sd.pop("fc.weight"),
        "norm.weight": sd.pop("norm.weight"),
        "lm_head.weight": sd.pop("lm_head.weight"),
        "d2t": sd.pop("d2t"),
        "t2d": sd.pop("t2d"),
        "embed_tokens.weight": torch.randn(V, H),
        f"{prefix}self_attn.q_proj.weight": q,
        f"{prefix}self_attn.k_proj.weight": k,
        f"{prefix}self_attn.v_proj.weight": v,
        f"{prefix}mlp.gate_proj.weight": gate,
        f"{prefix}mlp.up_proj.weight": up,
    }
    for name in list(sd):
        rest = name.removeprefix("layer.")
        module = {"o_proj.weight": "self_attn.", "down_proj.weight": "mlp."}.get(rest, "")
        out[f"{prefix}{module}{rest}"] = sd.pop(name)
    return {k: v.contiguous() for k, v in out.items()}


def _safeailab_config(norm_before_residual: bool) -> dict:
    """As SafeAILab's ``eagle/traineagle3/config.json`` (a transformers Llama config plus
    ``draft_vocab_size``); SpecForge adds ``norm_before_residual``."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "use_cache": True,
        "vocab_size": V,
        "draft_vocab_size": V_D,
    }
    if norm_before_residual:
        cfg["norm_before_residual"] = True
    return cfg


def _speculators_config(norm_before_residual: bool) -> dict:
    """As ``speculators``' ``Eagle3SpeculatorConfig`` saves it."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny-llama"},
        },
        "transformer_layer_config": {
            "model_type": "llama",
            "vocab_size": V,
            "hidden_size": H,
            "intermediate_size": INTER,
            "num_hidden_layers": 1,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HD,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": False,
        },
        "draft_vocab_size": V_D,
        "norm_before_residual": norm_before_residual,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(FEATURES),
        "torch_dtype": "float32",
    }


def _write(directory: Path, config: dict, state: dict[str, torch.Tensor], bin_file: bool) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name in (*eagle3_layouts.WEIGHT_FILES, eagle3_layouts.PICKLED_WEIGHTS):
        (directory / name).unlink(missing_ok=True)
    if bin_file:
        torch.save(state, directory / "pytorch_model.bin")
    else:
        save_file(state, str(directory / "model.safetensors"))
    return directory


def _save_all(root: Path, head: Eagle3Head, norm_before_residual: bool) -> dict[str, Path]:
    native = HeadConfig(
        method="eagle3",
        target="tiny-llama",
        hidden_size=H,
        vocab_size=V,
        arch=arch_fields(TARGET),
        draft_vocab_size=V_D,
        feature_layers=list(FEATURES),
        norm_before_residual=norm_before_residual,
    )
    return {
        "specdec": save_heads(head, native, root / "specdec"),
        # SafeAILab's released heads are pytorch_model.bin files, converted once to safetensors
        "safeailab": _write(
            root / "safeailab",
            _safeailab_config(norm_before_residual),
            _public_state(head, "midlayer."),
            False,
        ),
        "speculators": _write(
            root / "speculators",
            _speculators_config(norm_before_residual),
            _public_state(head, "layers.0."),
            False,
        ),
    }


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return _save_all(tmp_path_factory.mktemp("eagle3_layouts"), _random_head(False), False)


def _forward(head: Eagle3Head) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    n = 7
    embeds, features = torch.randn(n, H), torch.randn(n, 3 * H)
    with torch.no_grad():
        out = head(embeds, features, torch.arange(n), (None, None), dense_metadata([n]), DenseAttention())
        again = head(embeds, out, torch.arange(n), (None, None), dense_metadata([n]), DenseAttention())
        return out, head.logits(again)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_three_layouts_load_the_same_head(tmp_path, norm_before_residual):
    head = _random_head(norm_before_residual, seed=3)
    paths = _save_all(tmp_path, head, norm_before_residual)
    loaded = {}
    for layout, path in paths.items():
        assert detect_eagle3_layout(path) == layout
        loaded[layout], config = load_eagle3_head(path, TARGET, torch.float32, "cpu")
        assert config.method == "eagle3" and config.draft_vocab_size == V_D
        assert (
            tuple(config.feature_layers) == FEATURES and config.norm_before_residual is norm_before_residual
        )
        assert loaded[layout].feature_layers == FEATURES and not loaded[layout].training
    want_state = {k: v.float() if v.is_floating_point() else v for k, v in head.state_dict().items()}
    want_out, want_logits = _forward(head)
    for layout, got in loaded.items():
        state = got.state_dict()
        assert state.keys() == want_state.keys(), layout
        for k in want_state:
            assert state[k].dtype == want_state[k].dtype and torch.equal(state[k], want_state[k]), (layout, k)
        assert torch.equal(got.inv_freq, head.inv_freq), layout
        out, logits = _forward(got)
        assert torch.equal(out, want_out) and torch.equal(logits, want_logits), layout


def test_vocabulary_maps_derived_or_identity(tmp_path, dirs):
    head, _ = load_eagle3_head(dirs["speculators"], TARGET, torch.float32)
    # t2d alone gives d2t, d2t alone gives t2d (vLLM reads d2t only)
    for drop in ("d2t", "t2d"):
        state = _public_state(head, "layers.0.")
        del state[drop]
        path = _write(tmp_path / drop, _speculators_config(False), state, False)
        got, _ = load_eagle3_head(path, TARGET, torch.float32)
        assert torch.equal(got.d2t, head.d2t) and torch.equal(got.t2d, head.t2d)
    # a full-vocabulary head without maps: identity maps
    full = Eagle3Head(TARGET, V, FEATURES)
    state = _public_state(full, "layers.0.")
    del state["d2t"], state["t2d"]
    config = {
        **_speculators_config(False),
        "draft_vocab_size": V,
        "eagle_aux_hidden_state_layer_ids": [1, 4, 8],
    }
    got, cfg = load_eagle3_head(_write(tmp_path / "full", config, state, False), TARGET, torch.float32)
    assert torch.equal(got.target_ids(), torch.arange(V)) and bool(got.t2d.all())
    assert got.feature_layers == (1, 4, 8) and cfg.target == "tiny-llama"


def test_detection(tmp_path, dirs):
    for layout, path in dirs.items():
        assert detect_eagle3_layout(path) == layout
    with pytest.raises(CorruptModelError, match="no EAGLE-3 head directory"):
        detect_eagle3_layout(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorruptModelError, match=r"config\.json"):
        detect_eagle3_layout(tmp_path / "empty")
    # an EAGLE-1 head of SafeAILab (layers.0.* without hidden_norm, no draft vocabulary): not EAGLE-3
    eagle1 = {"layers.0.self_attn.q_proj.weight": torch.zeros(H, H), "fc.weight": torch.zeros(H, 2 * H)}
    path = _write(tmp_path / "eagle1", {"model_type": "llama", "hidden_size": H}, eagle1, False)
    with pytest.raises(CorruptModelError, match="not an EAGLE-3 head of a known layout"):
        detect_eagle3_layout(path)
    spec = shutil.copytree(dirs["speculators"], tmp_path / "mlp")
    (spec / "config.json").write_text(
        json.dumps({**_speculators_config(False), "speculators_model_type": "eagle"})
    )
    with pytest.raises(ConfigError, match="'eagle'"):
        detect_eagle3_layout(spec)


def _edit(src: Path, dst: Path, config=None, state=None) -> Path:
    """A copy of the checkpoint in ``src`` with ``config(dict)`` / ``state(dict)`` applied."""
    path = shutil.copytree(src, dst)
    raw = json.loads((path / "config.json").read_text())
    if config is not None:
        config(raw)
        (path / "config.json").write_text(json.dumps(raw))
    if state is not None:
        weights = eagle3_layouts._read_weights(eagle3_layouts._weights_file(path))
        state(weights)
        _write(path, raw, weights, (path / "pytorch_model.bin").exists())
    return path


def _set(**kw):
    return lambda d: d.update(kw)


def _set_layer(**kw):
    return lambda d: d["transformer_layer_config"].update(kw)


def _bad_d2t(w):  # draft tokens 0 and 1 both map to target token 5
    w["d2t"] = torch.tensor([5, 4] + [0] * (V_D - 2))


def _no_maps(w):
    del w["d2t"], w["t2d"]


def _rename_midlayer(w):
    for k in [k for k in w if k.startswith("midlayer.")]:
        w[k.replace("midlayer.", "mid.")] = w.pop(k)


CASES = [
    # (layout, config edit, weights edit, error, message)
    ("safeailab", _set(hidden_size=48), None, InvalidRequestError, "hidden_size is 48.*hidden size is 32"),
    ("speculators", _set_layer(hidden_size=48), None, InvalidRequestError, "hidden_size is 48"),
    ("speculators", _set(target_hidden_size=64), None, InvalidRequestError, "target_hidden_size is 64"),
    ("safeailab", _set(vocab_size=100), None, InvalidRequestError, "vocab_size is 100.*has 64"),
    (
        "speculators",
        None,
        lambda w: w.update(t2d=torch.ones(100, dtype=torch.bool)),
        InvalidRequestError,
        "t2d",
    ),
    (
        "safeailab",
        None,
        lambda w: w.update({"embed_tokens.weight": torch.zeros(V, 16)}),
        InvalidRequestError,
        "embed",
    ),
    (
        "speculators",
        _set(eagle_aux_hidden_state_layer_ids=[2, 4, 9]),
        None,
        InvalidRequestError,
        r"\[9\] outside",
    ),
    (
        "safeailab",
        _set(eagle_config={"eagle_aux_hidden_state_layer_ids": [-1, 4, 5]}),
        None,
        InvalidRequestError,
        "-1",
    ),
    ("speculators", _set(eagle_aux_hidden_state_layer_ids=[2, 4]), None, ConfigError, "3 layers only"),
    ("speculators", None, _bad_d2t, CorruptModelError, "two draft tokens"),
    (
        "safeailab",
        None,
        lambda w: w.update(d2t=torch.zeros(V_D + 1, dtype=torch.long)),
        CorruptModelError,
        "d2t",
    ),
    ("speculators", _set(draft_vocab_size=V_D + 1), None, CorruptModelError, "d2t"),
    ("safeailab", None, _no_maps, CorruptModelError, "no d2t or t2d"),
    (
        "speculators",
        None,
        lambda w: w.update({"layers.0.self_attn.q_proj.weight": torch.zeros(24, 2 * H)}),
        CorruptModelError,
        r"self_attn.q_proj.weight has shape \[24, 64\], expected \[32, 64\]",
    ),
    (
        "safeailab",
        _set(num_attention_heads=2, head_dim=16),
        None,
        CorruptModelError,
        "k_proj.weight has shape",
    ),
    (
        "safeailab",
        None,
        lambda w: w.update({"lm_head.weight": torch.zeros(V_D, 16)}),
        CorruptModelError,
        "lm_head",
    ),
    ("safeailab", None, lambda w: w.pop("midlayer.hidden_norm.weight"), CorruptModelError, "hidden_norm"),
    (
        "speculators",
        None,
        lambda w: w.update({"layers.0.extra.weight": torch.zeros(2)}),
        CorruptModelError,
        "extra",
    ),
    (
        "speculators",
        None,
        lambda w: w.update({"layers.1.hidden_norm.weight": torch.ones(H)}),
        ConfigError,
        "layer 1",
    ),
    ("speculators", None, lambda w: w.update({"fc.bias": torch.ones(H)}), ConfigError, "fc.bias"),
    ("speculators", _set(norm_before_fc=True), None, ConfigError, "norm_before_fc"),
    ("speculators", lambda d: d.pop("norm_before_residual"), None, CorruptModelError, "norm_before_residual"),
    ("speculators", _set(transformer_layer_config=[1]), None, CorruptModelError, "transformer_layer_config"),
    ("safeailab", _set(num_attention_heads="4"), None, CorruptModelError, "must be an integer|invalid"),
]


def test_mismatches_raise_before_a_head_is_built(tmp_path, dirs, monkeypatch):
    real = eagle3_layouts.Eagle3Head

    def only_on_meta(*args, **kwargs):  # shapes may be taken from a meta head; no real one may be built
        assert torch.empty(0).device.type == "meta", "a head was built before the error"
        return real(*args, **kwargs)

    monkeypatch.setattr(eagle3_layouts, "Eagle3Head", only_on_meta)
    for n, (layout, config, state, error, message) in enumerate(CASES):
        path = _edit(dirs[layout], tmp_path / f"case{n}", config, state)
        with pytest.raises(error, match=message):
            load_eagle3_head(path, TARGET, torch.float32)
    # the unchanged checkpoints load (after their checks, a real head is built), in bfloat16 too
    monkeypatch.setattr(eagle3_layouts, "Eagle3Head", real)
    for path in dirs.values():
        head, _ = load_eagle3_head(path, TARGET, torch.bfloat16)
        assert head.fc.weight.dtype == torch.bfloat16 and head.d2t.dtype == torch.int64
        assert torch.equal(head.inv_freq, torch.tensor(TARGET.inv_freq))  # RoPE stays float32


def test_unknown_layout_and_unreadable_weights(tmp_path, dirs):
    path = _edit(dirs["safeailab"], tmp_path / "renamed", state=_rename_midlayer)
    with pytest.raises(CorruptModelError, match="not an EAGLE-3 head of a known layout"):
        load_eagle3_head(path, TARGET, torch.float32)
    path = shutil.copytree(dirs["speculators"], tmp_path / "truncated")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelError, match="cannot read"):
        load_eagle3_head(path, TARGET, torch.float32)
    path = shutil.copytree(dirs["speculators"], tmp_path / "noweights")
    (path / "model.safetensors").unlink()
    with pytest.raises(CorruptModelError, match=r"no model\.safetensors in"):
        load_eagle3_head(path, TARGET, torch.float32)
    # pickled weights (SafeAILab's releases) are refused, never unpickled, with how to convert them
    torch.save({"fc.weight": torch.zeros(2, 2)}, path / "pytorch_model.bin")
    with pytest.raises(CorruptModelError, match=r"never unpickles.*convert it once to model\.safetensors"):
        load_eagle3_head(path, TARGET, torch.float32)
