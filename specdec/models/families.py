"""Per-family readers: what each supported HF ``model_type`` adds to the shared decoder's description.

One decoder (:mod:`specdec.models.decoder`) serves every family; a family is a set of
:class:`~specdec.models.config.ModelArchConfig` field values read here from its transformers config:

========== ==============================================================================================
llama      Llama 2/3.x, SmolLM2: the base layout (RMSNorm, SwiGLU, RoPE incl. ``rope_type: llama3``);
           biases on all four attention projections when ``attention_bias``.
qwen2      Qwen2 / Qwen2.5: biases on q/k/v only.
qwen3      Qwen3 dense: RMSNorm over each query and key head before RoPE (``q_norm``/``k_norm``),
           explicit ``head_dim``, biases when ``attention_bias`` (none in released checkpoints).
mistral    Mistral: the Llama layout; ``sliding_window`` (when set) on every layer.
gemma2     Gemma 2 (Gemma Team 2024): GeGLU (``hidden_activation``, tanh-approximated GELU), (1 + w)
           RMSNorm, norms before and after attention and MLP, embeddings times sqrt(hidden_size),
           attention scale ``query_pre_attn_scalar ** -0.5``, tanh soft-capping of attention scores
           (``attn_logit_softcapping``) and of the final logits (``final_logit_softcapping``), sliding and
           global layers alternating (``layer_types``).
gemma3_text Gemma 3 text: Gemma 2's layout without soft-capping (unless the config sets it), plus (1 + w)
           RMSNorm on query and key heads, five sliding layers per global one (``layer_types`` /
           ``sliding_window_pattern``), local layers on their own RoPE base (``rope_local_base_freq``,
           ``rope_parameters["sliding_attention"]``).
phi3       Phi-3: the Llama layout with q/k/v and gate/up already fused in the checkpoint
           (``qkv_proj``, ``gate_up_proj``); ``sliding_window`` on every layer when set.
========== ==============================================================================================

Sequence-length dependent RoPE (``rope_type`` ``dynamic`` and Phi-3's ``longrope``) is refused with
:class:`~specdec.errors.UnknownModelError`: their inverse frequencies change once a sequence passes
``original_max_position_embeddings``, which a paged cache of already rotated keys cannot follow.
"""

from __future__ import annotations

import math
from typing import Any

from specdec.errors import UnknownModelError

#: HF ``model_type`` values our decoder implements.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")

#: Families whose checkpoints store q/k/v and gate/up fused (``qkv_proj``, ``gate_up_proj``).
FUSED_CHECKPOINT_TYPES = ("phi3",)

#: ``hidden_act`` / ``hidden_activation`` values the MLP implements.
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")

#: ``layer_types`` entries the attention implements.
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


def check_model_type(model_type: str) -> None:
    """Raises:
    UnknownModelError: ``model_type`` is not one of :data:`SUPPORTED_MODEL_TYPES`."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnknownModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def family_fields(hf_config: Any) -> dict[str, Any]:
    """The :class:`~specdec.models.config.ModelArchConfig` fields that depend on the family: biases,
    norm style, activation, q/k norms, post-norms, embedding scale, soft-caps, attention scale and the
    per-layer attention windows.

    Raises:
        UnknownModelError: an unsupported model type, activation, layer type, bidirectional attention or
            partial rotary embedding.
    """
    model_type = hf_config.model_type
    check_model_type(model_type)
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    gemma = model_type in ("gemma2", "gemma3_text")
    act = getattr(hf_config, "hidden_activation", None) if gemma else None
    act = act or getattr(hf_config, "hidden_act", None) or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnknownModelError(
            f"hidden activation {act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise UnknownModelError(f"{model_type}: use_bidirectional_attention (an encoder) is not supported")
    partial = float(getattr(hf_config, "partial_rotary_factor", 1.0) or 1.0)
    if partial != 1.0:
        raise UnknownModelError(
            f"{model_type}: partial_rotary_factor {partial} (partial RoPE) is not supported"
        )
    out: dict[str, Any] = dict(
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        hidden_act=act,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        norm_style="gemma" if gemma else "llama",
        post_norms=gemma,
        embed_scale=math.sqrt(hf_config.hidden_size) if gemma else 1.0,
        query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar) if gemma else None,
        attn_logit_softcapping=_positive_or_none(getattr(hf_config, "attn_logit_softcapping", None)),
        final_logit_softcapping=_positive_or_none(getattr(hf_config, "final_logit_softcapping", None)),
    )
    out.update(_windows(hf_config))
    return out


def _positive_or_none(value: Any) -> float | None:
    return float(value) if value else None


def _windows(hf_config: Any) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types``: per layer, global or windowed attention.

    transformers' rule (``masking_utils.sliding_window_overlay``): a query at position p sees key
    position j when ``p - sliding_window < j <= p``, so a window of W holds the query and W - 1 keys
    before it. With ``layer_types`` absent, a set ``sliding_window`` applies to every layer (Mistral,
    Phi-3)."""
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        layer_types = [SLIDING_ATTENTION if window else FULL_ATTENTION] * n
    layer_types = tuple(layer_types)[:n]
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown or len(layer_types) != n:
        raise UnknownModelError(
            f"layer_types {unknown or list(layer_types)} not supported: "
            f"{FULL_ATTENTION!r} and {SLIDING_ATTENTION!r} only, one per layer"
        )
    if SLIDING_ATTENTION not in layer_types or not window:
        return {"sliding_window": None, "layer_types": (FULL_ATTENTION,) * n}
    return {"sliding_window": int(window), "layer_types": layer_types}
