"""Architecture description of a supported decoder, read from an HF ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.errors import CorruptModelError, SpecdecError, UnknownModelError
from specdec.models.families import (
    SLIDING_ATTENTION,
    SUPPORTED_MODEL_TYPES,
    check_model_type,
    family_fields,
)

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelArchConfig"]


@dataclass(frozen=True)
class ModelArchConfig:
    """Everything the decoder needs to know about an architecture.

    ``qkv_bias``/``o_bias``: Qwen2 has biases on q/k/v only; Llama has them on all four projections
    when ``attention_bias`` is set. ``inv_freq`` is RoPE's ``[head_dim // 2]`` inverse frequencies,
    ``rope_attention_scaling`` the factor transformers applies to cos/sin (1.0 for plain RoPE).

    Family differences (read by :func:`specdec.models.families.family_fields`; the defaults are the
    Llama layout, so a config built by hand for Llama needs none of them):

    - ``hidden_act``: the MLP's gate activation, HF ``hidden_act`` / ``hidden_activation``: ``"silu"``
      (SwiGLU) or ``"gelu_pytorch_tanh"`` / ``"gelu"`` (GeGLU).
    - ``norm_style``: ``"llama"`` RMSNorm ``w * norm(x)`` (cast to the activation dtype before the
      product) or ``"gemma"`` ``(1 + w) * norm(x)`` computed in float32.
    - ``qk_norm``: an RMSNorm over each query and key head (``head_dim``) before RoPE (Qwen3, Gemma 3).
    - ``post_norms``: norms on the attention and MLP outputs before the residual adds (Gemma 2/3).
    - ``embed_scale``: embeddings times this, as a tensor of the activation dtype (Gemma:
      ``sqrt(hidden_size)``).
    - ``query_pre_attn_scalar``: softmax scale ``query_pre_attn_scalar ** -0.5`` (Gemma); None:
      ``head_dim ** -0.5``.
    - ``attn_logit_softcapping``: attention scores become ``c * tanh(s / c)`` (Gemma 2); None: off.
    - ``final_logit_softcapping``: logits become ``c * tanh(logits / c)`` (Gemma 2); None: off.
    - ``sliding_window``, ``layer_types``: layer i attends within the last ``sliding_window`` positions
      (the query's included) when ``layer_types[i] == "sliding_attention"``, to everything when
      ``"full_attention"``; empty ``layer_types``: every layer global.
    - ``local_inv_freq``, ``local_rope_attention_scaling``: RoPE of the sliding layers when it differs
      from the global layers' (Gemma 3's ``rope_local_base_freq``); None: the same RoPE everywhere.
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
    hidden_act: str = "silu"
    norm_style: str = "llama"
    qk_norm: bool = False
    post_norms: bool = False
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    local_inv_freq: tuple[float, ...] | None = None
    local_rope_attention_scaling: float = 1.0

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window in positions (the query's own included), None when global."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when *every* layer attends within one (Mistral or Phi-3 with ``sliding_window``
        set, a Gemma config whose ``layer_types`` are all sliding); None when some layer is global."""
        if self.sliding_window is None or not self.layer_types:
            return None
        if all(self.layer_window(i) is not None for i in range(self.num_layers)):
            return self.sliding_window
        return None

    @property
    def attention_scale(self) -> float:
        """The softmax scale: ``query_pre_attn_scalar ** -0.5`` when set (Gemma), else
        ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates with :attr:`local_inv_freq` (a Gemma 3 sliding layer)."""
        return self.local_inv_freq is not None and self.layer_window(layer) is not None

    @classmethod
    def from_hf_config(cls, hf_config) -> ModelArchConfig:
        """Build from a transformers config.

        Raises:
            UnknownModelError: the model type or RoPE type is not one we implement.
        """
        model_type = hf_config.model_type
        check_model_type(model_type)
        head_dim = (
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        family = family_fields(hf_config)
        local_inv_freq, local_scaling = None, 1.0
        if _per_layer_type_rope(hf_config):  # Gemma 3: one RoPE per layer type
            inv_freq, attention_scaling = _rope_inv_freq(hf_config, head_dim, "full_attention")
            if SLIDING_ATTENTION in family["layer_types"]:
                local, local_scaling = _rope_inv_freq(hf_config, head_dim, SLIDING_ATTENTION)
                local_inv_freq = tuple(local.tolist())
        else:
            inv_freq, attention_scaling = _rope_inv_freq(hf_config, head_dim)
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
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
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            max_position_embeddings=int(hf_config.max_position_embeddings),
            inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=float(attention_scaling),
            bos_token_id=hf_config.bos_token_id,
            eos_token_ids=eos_ids,
            local_inv_freq=local_inv_freq,
            local_rope_attention_scaling=float(local_scaling),
            **family,
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
        except Exception as e:  # a user's file: whatever transformers' validation raises
            raise CorruptModelError(f"cannot read config.json in {model_dir}: {type(e).__name__}: {e}") from e
        try:
            return cls.from_hf_config(hf_config)
        except SpecdecError:  # UnknownModelError (a ValueError too) names what is not supported
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a field missing or malformed
            raise CorruptModelError(
                f"config.json in {model_dir} ({hf_config.model_type}) is malformed: {type(e).__name__}: {e}"
            ) from e


def _per_layer_type_rope(hf_config) -> bool:
    """Whether ``rope_parameters`` holds one entry per layer type (Gemma 3), not one for all layers."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return isinstance(params.get("full_attention"), dict) or isinstance(params.get("sliding_attention"), dict)


def _rope_inv_freq(hf_config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[head_dim // 2]`` and the cos/sin scale, using transformers' RoPE
    initialisers for scaled variants; ``layer_type`` picks the entry of a per-layer-type
    ``rope_parameters`` (Gemma 3).

    Raises:
        UnknownModelError: a sequence-length dependent (``dynamic``, ``longrope``) or unknown rope_type.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type == "default":
        # Same float32 arithmetic as transformers, so that cos/sin agree bit for bit.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type == "longrope":
        raise UnknownModelError(
            "rope_type 'longrope' (Phi-3 128k / LongRoPE: the inverse frequencies switch from short_factor "
            "to long_factor once a sequence passes original_max_position_embeddings) is not supported; "
            "Phi-3 checkpoints without rope_scaling (e.g. the 4k ones) are"
        )
    if rope_type == "dynamic":
        raise UnknownModelError(f"rope_type {rope_type!r} (sequence-length dependent RoPE) is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnknownModelError(f"unknown rope_type {rope_type!r}")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)
