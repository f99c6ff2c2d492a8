"""Architecture description of a supported decoder, read from an HF ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.errors import CorruptModelError, UnknownModelError

#: HF ``model_type`` values our decoder implements (Llama family, Qwen2 family).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelArchConfig:
    """Everything the decoder needs to know about an architecture.

    ``qkv_bias``/``o_bias``: Qwen2 has biases on q/k/v only; Llama has them on all four projections
    when ``attention_bias`` is set. ``inv_freq`` is RoPE's ``[head_dim // 2]`` inverse frequencies,
    ``rope_scaling`` the factor transformers applies to cos/sin (1.0 for plain RoPE).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    inv_freq: tuple[float, ...]
    rope_attention_scaling: float
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, hf_config) -> ModelArchConfig:
        """Build from a transformers config.

        Raises:
            UnknownModelError: the model type or RoPE type is not one we implement.
        """
        model_type = hf_config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnknownModelError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        head_dim = (
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        inv_freq, attention_scaling = _rope_inv_freq(hf_config, head_dim)
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            max_position_embeddings=int(hf_config.max_position_embeddings),
            inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=float(attention_scaling),
            bos_token_id=hf_config.bos_token_id,
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelArchConfig:
        """Read ``config.json`` from an HF-format directory (never runs remote code).

        Raises:
            CorruptModelError: the config is missing or unreadable.
            UnknownModelError: the architecture is not supported.
        """
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise CorruptModelError(f"cannot read config.json in {model_dir}: {e}") from e
        return cls.from_hf_config(hf_config)


def _rope_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies, using transformers' RoPE initialisers for scaled variants."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type == "default":
        # Same float32 arithmetic as transformers, so that cos/sin agree bit for bit.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type in ("dynamic", "longrope"):
        raise UnknownModelError(f"rope_type {rope_type!r} (sequence-length dependent RoPE) is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnknownModelError(f"unknown rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)
