"""Quantized self-drafting: the target's own weights, quantized to int8 or int4, as its draft model.

No second checkpoint and no training: the draft model is
:func:`~specdec.quantization.apply.quantized_copy` of the target, sharing its tokenizer (the same
vocabulary by construction), embedding table, norms and RoPE buffer, with its own linear layers
quantized (see :mod:`specdec.quantization`). It runs as any draft model does, through
:class:`~specdec.drafters.draft_model.DraftModelDrafter`: its own KV tensors (in its activation dtype,
not int8) on the target's block tables and slot mapping, greedy or sampled drafts, and exact verification
by the full-precision target (Leviathan et al. 2023; Chen et al. 2023), so the output distribution is the
target's whatever the quantization error.

Why it can pay: a decode step is bound by the bytes it reads. In bfloat16 an int4 copy reads about a
quarter of the target's linear-layer bytes (int8: about half), and, being the same network, it agrees
with the target far more often than a smaller model does. The drafter's own KV costs as much as the
target's (per token, in the drafter's dtype).
"""

from __future__ import annotations

import torch

from specdec.models.decoder import DecoderLM
from specdec.quantization.apply import quantized_copy
from specdec.quantization.config import QuantizationConfig


def quantized_self_draft_model(
    target: DecoderLM, quantization: QuantizationConfig, dtype: torch.dtype | None = None
) -> DecoderLM:
    """The draft model of ``SpeculativeConfig(method="quantized_self", quantization=...)``.

    Args:
        target: the loaded target (dense, or itself quantized: then its dequantized weights are
            re-quantized). Not modified.
        quantization: the drafter's scheme (``"int4"`` / ``"int8"``, group size, kernel).
        dtype: the drafter's activation dtype (``draft_dtype``; None: the target's). In the target's dtype
            the embedding and norms are shared, in another they are converted copies.

    Raises:
        ConfigError: the int4 group size does not divide one of the target's layer input sizes.
    """
    return quantized_copy(target, quantization, dtype)
