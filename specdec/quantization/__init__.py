"""Weight-only quantization (int8 per output channel, int4 per group) and the int8 KV cache layout.

- :mod:`~specdec.quantization.schemes`: quantize / dequantize, the error bound, int4 packing.
- :mod:`~specdec.quantization.config`: :class:`QuantizationConfig` (``LLM(..., quantization=...)``).
- :mod:`~specdec.quantization.linear`: :class:`QuantizedLinear`, its reference and packed kernels.
- :mod:`~specdec.quantization.apply`: swap a loaded model's linear layers, or build a quantized copy.
- :mod:`~specdec.quantization.kv_cache`: KV cache tensors, ``auto`` (model dtype) or ``int8``.
"""

from specdec.quantization.config import QuantizationConfig
from specdec.quantization.linear import QuantizedLinear

__all__ = ["QuantizationConfig", "QuantizedLinear"]
