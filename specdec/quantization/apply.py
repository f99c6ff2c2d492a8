"""Quantize a loaded :class:`~specdec.models.decoder.DecoderLM`: swap its linear layers for
:class:`~specdec.quantization.linear.QuantizedLinear` in place (``LLM(..., quantization=...)``), or build
a quantized copy that shares the rest with the original (the quantized self-drafter).

Quantized: every decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj``, and the LM
head when ``QuantizationConfig.lm_head`` (the default). Not quantized: the embedding table (a lookup reads
one row per token, so its size does not slow decode; a tied LM head therefore becomes a separate quantized
matrix while the embedding stays in full precision), the RMSNorm weights and the biases.

Order with :func:`specdec.models.packed_linear.pack_linears`: quantize first, then pack; packing only
touches the plain ``nn.Linear`` layers left.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from specdec.errors import ConfigError
from specdec.models.decoder import DecoderLM
from specdec.quantization.config import QuantizationConfig
from specdec.quantization.linear import QuantizedLinear

#: The linear layers of each decoder layer that are quantized.
LAYER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
#: The norms a decoder layer may hold (shared, never quantized).
LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "q_norm",
    "k_norm",
    "attn_output_norm",
    "mlp_output_norm",
)


def dense_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [N, K] float32, bias [N] or None)`` of a linear layer: an ``nn.Linear``, a
    :class:`QuantizedLinear` (dequantized: re-quantizing starts from what the layer computes with), or any
    module with a dense ``weight`` tensor.

    Raises:
        TypeError: the module holds no dense weight (e.g. a oneDNN-packed layer: quantize before packing).
    """
    if isinstance(module, QuantizedLinear):
        return module.dequantized_weight(), module.bias
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"{type(module).__name__} has no dense weight to quantize (quantize before packing the model)"
        )
    return weight.detach().float(), getattr(module, "bias", None)


def _quantized(
    module: nn.Module, config: QuantizationConfig, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    weight, bias = dense_weight(module)
    return QuantizedLinear.from_weight(
        weight,
        bias,
        config.method,
        config.resolved_group_size,
        dtype,
        device,
        config.kernel,
        config.zero_point,
    )


def quantize_model(
    model: DecoderLM,
    config: QuantizationConfig,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> DecoderLM:
    """Swap ``model``'s linear layers for quantized ones, in place (see the module docstring).

    Args:
        model: a loaded decoder (weights in any float dtype; quantized from float32 copies).
        config: scheme, group size, LM head, kernel.
        dtype: activation dtype of the quantized layers (None: the model's); the loader passes the dtype
            the model is about to be cast to, so scales come straight from the float32 weights.
        device: where the quantized layers live (None: the model's device).

    Returns:
        ``model``.

    Raises:
        ConfigError: the int4 group size does not divide a layer's input size.
    """
    config.check_model(model.cfg)
    dtype = model.dtype if dtype is None else dtype
    device = model.embed_tokens.weight.device if device is None else torch.device(device)
    for layer in model.layers:
        for name in LAYER_LINEARS:
            setattr(layer, name, _quantized(getattr(layer, name), config, dtype, device))
    if config.lm_head:
        model.lm_head = _quantized(model.lm_head, config, dtype, device)  # type: ignore[assignment]
    return model


def quantize_linears(module: nn.Module, config: QuantizationConfig, dtype: torch.dtype) -> int:
    """Swap every ``nn.Linear`` inside ``module`` (a drafter's head: EAGLE, EAGLE-3, Medusa) for a
    :class:`QuantizedLinear` of ``config``'s scheme, in place, on the layer's own device (a layer named
    ``lm_head`` only with ``config.lm_head``). Returns the number swapped.

    Raises:
        ConfigError: the int4 group size does not divide a layer's input size.
    """
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in module.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear and (config.lm_head or name != "lm_head"):
                k, gs = child.in_features, config.resolved_group_size
                if gs is not None and k % gs:
                    raise ConfigError(
                        f"int4 group_size {gs} does not divide the input size {k} of the head's layer "
                        f"{name!r}"
                    )
                swaps.append((parent, name, _quantized(child, config, dtype, child.weight.device)))
    for parent, name, layer in swaps:
        setattr(parent, name, layer)
    return len(swaps)


def quantized_copy(
    model: DecoderLM, config: QuantizationConfig, dtype: torch.dtype | None = None
) -> DecoderLM:
    """A second decoder whose linear layers are ``model``'s quantized, sharing everything else.

    The embedding, the norms, the RoPE buffer (and the LM head when ``config.lm_head`` is False) are the
    very same tensors as ``model``'s when ``dtype`` is the model's (no extra memory); in another dtype they
    are converted copies. ``model`` itself is not modified.

    Args:
        model: the source (dense or quantized layers; quantized ones are dequantized first).
        config: the copy's quantization.
        dtype: the copy's activation dtype (None: the model's).

    Raises:
        ConfigError: the int4 group size does not divide a layer's input size.
    """
    config.check_model(model.cfg)
    dtype = model.dtype if dtype is None else dtype
    device = model.embed_tokens.weight.device

    def shared(module: nn.Module) -> nn.Module:
        return module if dtype == model.dtype else copy.deepcopy(module).to(dtype)

    with torch.device("meta"):
        out = DecoderLM(model.cfg)
    out.embed_tokens = shared(model.embed_tokens)  # type: ignore[assignment]
    out.norm = shared(model.norm)  # type: ignore[assignment]
    for src, dst in zip(model.layers, out.layers):
        for name in LAYER_NORMS:  # the family's norms (q/k and output norms only where it has them)
            if getattr(src, name, None) is not None:
                setattr(dst, name, shared(getattr(src, name)))
        for name in LAYER_LINEARS:
            setattr(dst, name, _quantized(getattr(src, name), config, dtype, device))
    if config.lm_head:
        out.lm_head = _quantized(model.lm_head, config, dtype, device)  # type: ignore[assignment]
    elif dtype == model.dtype:
        out.lm_head = model.lm_head
    else:
        weight, bias = dense_weight(model.lm_head)
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=device, dtype=dtype)
        with torch.no_grad():
            head.weight.copy_(weight)
            if bias is not None:
                head.bias.copy_(bias)
        if model.cfg.tie_word_embeddings:
            head.weight = out.embed_tokens.weight
        out.lm_head = head
    out.inv_freq = model.inv_freq
    out.local_inv_freq = model.local_inv_freq
    left = [n for n, t in [*out.named_parameters(), *out.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"quantized_copy left tensors unset: {left[:5]}")
    return out.eval()
