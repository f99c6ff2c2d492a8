"""Load an HF-format directory (config.json + safetensors) into :class:`DecoderLM`.

Safetensors only: weights are never unpickled. Checkpoint names follow transformers' layout
(``model.layers.N.self_attn.q_proj.weight``...); q/k/v and gate/up are concatenated into our fused
matrices, except for Phi-3 whose checkpoints store them fused already (``qkv_proj``, ``gate_up_proj``).
Gemma's norms are renamed onto our layer's (see :class:`~specdec.models.decoder.DecoderLayer`):
``pre_feedforward_layernorm`` -> ``post_attention_layernorm`` (the norm before the MLP),
``post_attention_layernorm`` -> ``attn_output_norm``, ``post_feedforward_layernorm`` -> ``mlp_output_norm``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specdec.errors import CorruptModelError
from specdec.models.config import ModelArchConfig
from specdec.models.decoder import DecoderLM
from specdec.models.families import FUSED_CHECKPOINT_TYPES
from specdec.quantization.apply import quantize_model
from specdec.quantization.config import QuantizationConfig


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CorruptModelError(f"{index} is not a valid safetensors index: {e}") from e
        return sorted({model_dir / f for f in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CorruptModelError(
            f"no *.safetensors weights in {model_dir} (only safetensors are loaded, never pickles)"
        )
    return files


def read_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory's safetensors files, by checkpoint name.

    Raises:
        CorruptModelError: a file is missing, truncated or not valid safetensors.
    """
    model_dir = Path(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(model_dir):
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CorruptModelError(f"cannot read weights {f}: {e} (file truncated or corrupt?)") from e
    return tensors


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    quantization: QuantizationConfig | None = None,
) -> DecoderLM:
    """Build our decoder for ``model_dir`` and load its weights.

    Args:
        model_dir: an HF-format directory.
        dtype: the model's dtype (weights, activations).
        device: where it runs.
        quantization: weight-only quantization of the linear layers (None: none); the scales are computed
            from the float32 checkpoint weights, before the cast to ``dtype``
            (see :func:`specdec.quantization.apply.quantize_model`).

    Raises:
        CorruptModelError: missing, unexpected or misshapen tensors, NaN or infinite weights, or
            unreadable files.
        UnknownModelError: unsupported architecture.
        ConfigError: the quantization does not fit the architecture (checked before reading weights).
    """
    cfg = ModelArchConfig.from_pretrained(model_dir)
    if quantization is not None:
        quantization.check_model(cfg)
    state = read_state_dict(model_dir)
    for name, tensor in state.items():  # corrupted values (bytes overwritten) most often decode to NaN/inf
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CorruptModelError(
                f"{model_dir}: weight {name!r} holds NaN or infinite values (file corrupted?)"
            )
    with torch.device("meta"):
        model = DecoderLM(cfg)
    ours = _to_our_names(state, cfg, str(model_dir))
    try:
        model.load_state_dict(ours, strict=True, assign=True)
    except RuntimeError as e:
        raise CorruptModelError(f"{model_dir}: weights do not fit the config: {e}") from e
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = torch.tensor(cfg.inv_freq, dtype=torch.float32)
    if cfg.local_inv_freq is not None:
        model.local_inv_freq = torch.tensor(cfg.local_inv_freq, dtype=torch.float32)
    if quantization is not None:
        quantize_model(model, quantization, dtype=dtype, device=device)
    return model.to(device=device, dtype=dtype).eval()


def _to_our_names(
    state: dict[str, torch.Tensor], cfg: ModelArchConfig, where: str
) -> dict[str, torch.Tensor]:
    """Map transformers' checkpoint names onto our fused module layout."""
    state = dict(state)

    def take(name: str) -> torch.Tensor:
        try:
            return state.pop(name).float()
        except KeyError:
            raise CorruptModelError(f"{where}: weight {name!r} is missing from the checkpoint") from None

    out: dict[str, torch.Tensor] = {"embed_tokens.weight": take("model.embed_tokens.weight")}
    fused = cfg.model_type in FUSED_CHECKPOINT_TYPES
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        o = f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            if fused:
                out[o + f"qkv_proj.{kind}"] = take(attn + f"qkv_proj.{kind}")
            else:
                out[o + f"qkv_proj.{kind}"] = torch.cat([take(attn + f"{n}_proj.{kind}") for n in "qkv"])
        out[o + "o_proj.weight"] = take(attn + "o_proj.weight")
        if cfg.o_bias:
            out[o + "o_proj.bias"] = take(attn + "o_proj.bias")
        for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            if fused:
                out[o + f"gate_up_proj.{kind}"] = take(mlp + f"gate_up_proj.{kind}")
            else:
                out[o + f"gate_up_proj.{kind}"] = torch.cat(
                    [take(mlp + f"gate_proj.{kind}"), take(mlp + f"up_proj.{kind}")]
                )
            out[o + f"down_proj.{kind}"] = take(mlp + f"down_proj.{kind}")
        out[o + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        if cfg.post_norms:  # Gemma's names (see the module docstring)
            out[o + "post_attention_layernorm.weight"] = take(p + "pre_feedforward_layernorm.weight")
            out[o + "attn_output_norm.weight"] = take(p + "post_attention_layernorm.weight")
            out[o + "mlp_output_norm.weight"] = take(p + "post_feedforward_layernorm.weight")
        else:
            out[o + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        if cfg.qk_norm:
            out[o + "q_norm.weight"] = take(attn + "q_norm.weight")
            out[o + "k_norm.weight"] = take(attn + "k_norm.weight")
    out["norm.weight"] = take("model.norm.weight")
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        out["lm_head.weight"] = out["embed_tokens.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    # Rotary buffers some checkpoints carry are recomputed from the config.
    leftover = [k for k in state if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise CorruptModelError(f"{where}: unexpected tensors in the checkpoint: {leftover[:5]}")
    expected = {
        "embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
        "lm_head.weight": (cfg.vocab_size, cfg.hidden_size),
    }
    for name, shape in expected.items():
        if tuple(out[name].shape) != shape:
            raise CorruptModelError(f"{where}: {name} has shape {tuple(out[name].shape)}, expected {shape}")
    return out
