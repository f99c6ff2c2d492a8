"""A decoder's whole layer stack for short queries on the CPU in one call: the kernels of each layer run
from C++, without Python between them.

At batch 1 a SmolLM2-135M bfloat16 step spent ~180 of each layer's ~470 µs outside its four linears:
module calls, argument conversion and dispatch around the layer's small kernels. :class:`DecodeStack`
(``csrc/cpu_decode_stack.cpp``) calls the same kernels (:mod:`kernels.cpu_layer_ops`,
:mod:`kernels.cpu_gemv`, :mod:`kernels.cpu_attention`) in the same order on the same tensors, so its
output equals the per-layer path bit for bit; its reference is that path,
:meth:`specdec.models.decoder.DecoderLM.layer_stack` with the stack off, which the tests compare it with
(``tests/kernels/test_cpu_decode_stack.py``).

Layers it takes (:class:`StackLayer`): a pre-norm layer with an RMSNorm (Llama or Gemma form) before
attention and before a SiLU-gated MLP, fused QKV and gate/up weights with optional biases (dense, or int8
codes with per-row scales: an int8-quantized model such as the quantized self-drafter), RoPE on every
query and key head, grouped-query attention with an optional sliding window and score soft-cap: Llama,
SmolLM2, Qwen2, Mistral. Batches it takes: decode rows, verification chains and token trees (every
short query within the short-query kernel's limit: a request's new tokens, or a short chunk and the
drafts after it), no prefill chunk.

``SPECDEC_CPU_DECODE_STACK=0`` (or ``SPECDEC_FORCE_REFERENCE=1``) turns it off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import cpu_gemv, cpu_gemv_int8
from kernels.cpu_attention import PromptChunk, ShortQueries
from kernels.cpu_ext import enabled, require_extension

__all__ = ["DecodeStack", "StackLayer", "available"]

DISABLE_ENV = "SPECDEC_CPU_DECODE_STACK"


def available() -> bool:
    """Whether the stack can be used here: not disabled and the CPU kernels built (on the first call)."""
    return enabled(DISABLE_ENV) and hasattr(require_extension(), "DecodeStack")


@dataclass(frozen=True)
class StackLayer:
    """One layer's weights (the model's own tensors, not copied) and shape.

    Weights: ``input_norm`` / ``post_norm`` ``[hidden]``; ``qkv`` ``[(H + 2 KVH) D, hidden]``; ``o``
    ``[hidden, H D]``; ``gate_up`` ``[2 I, hidden]``; ``down`` ``[hidden, I]``; biases ``[out]`` or None;
    all contiguous, of one dtype (float32 or bfloat16). ``eps``, ``gemma``: the norms' (Gemma's form
    scales by ``1 + w``); ``scale``: the attention softmax scale; ``window``: sliding window in positions
    (0: none); ``softcap``: attention score soft-cap (0: none). ``*_packed``: the linears' packed
    weights (:func:`kernels.cpu_gemv.pack_weight`: AMX or oneDNN) or None; a product takes its packed weight
    where :func:`kernels.cpu_gemv.packed_rows` says so and the layer has one, as the linear layers do; for
    an int8 linear, its codes in tile order (:func:`kernels.cpu_gemv_int8.pack_tiles`) or None.
    ``*_scales``: for a linear held as int8 codes ``[out, in]`` (an int8
    :class:`~specdec.quantization.linear.QuantizedLinear`), its scales ``[out]`` float32, and the product
    runs :func:`kernels.cpu_gemv_int8.gemv_int8` as the layer does; None for a dense linear.
    """

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    gemma: bool
    scale: float
    window: int = 0
    softcap: float = 0.0
    qkv_packed: torch.Tensor | None = None
    o_packed: torch.Tensor | None = None
    gate_up_packed: torch.Tensor | None = None
    down_packed: torch.Tensor | None = None
    qkv_scales: torch.Tensor | None = None
    o_scales: torch.Tensor | None = None
    gate_up_scales: torch.Tensor | None = None
    down_scales: torch.Tensor | None = None


_NO_BIAS = torch.empty(0)


class DecodeStack:
    """The layers of one model, run for short queries by the C++ stack (see the module docstring).

    Args:
        layers: the model's layers, in order.

    Raises:
        ValueError: no layers, or layers of mixed dtypes (int8 codes aside).
        RuntimeError: the CPU kernels are not built here (check :func:`available` first), or a layer's
            weights do not fit its stated head counts.
    """

    def __init__(self, layers: Sequence[StackLayer]) -> None:
        if not layers:
            raise ValueError("DecodeStack needs at least one layer")
        self.dtype = layers[0].input_norm.dtype
        if any(
            t.dtype not in (self.dtype, torch.int8)
            for lay in layers
            for t in (lay.input_norm, lay.qkv, lay.o, lay.gate_up, lay.down)
        ):
            raise ValueError("DecodeStack: every weight must have one dtype (or be int8 codes)")
        # Rows it takes: any number where every linear has a packed weight (past the GEMV kernel's rows
        # a linear layer multiplies on its packed weight, AMX or oneDNN, and so does the stack, through
        # the same rule: the same bits), else the GEMV kernel's rows (past them a linear layer takes
        # F.linear, which the stack does not). On SmolLM2 bfloat16 with AMX a 33-row step took the
        # per-layer path at 2.6x a 32-row step's time (37.9 against 14.7 ms).
        linears = [(lay.qkv, lay.o, lay.gate_up, lay.down) for lay in layers]
        copies = [(lay.qkv_packed, lay.o_packed, lay.gate_up_packed, lay.down_packed) for lay in layers]
        codes = [w.dtype == torch.int8 for ws in linears for w in ws]
        packed = all(t is not None for ts in copies for t in ts) and not any(codes)
        #: The most rows (batched tokens) a forward through the stack may have.
        self.max_rows = 2**31 if packed else cpu_gemv.max_rows(self.dtype)
        if all(codes):  # an int8 model: the int8 kernel's rows (passes of 16)
            self.max_rows = cpu_gemv_int8.MAX_ROWS
        elif any(codes):
            self.max_rows = min(self.max_rows, cpu_gemv_int8.MAX_ROWS)
        #: Whether prompt chunks may go through the stack (no layer has a sliding window or soft-cap).
        self.takes_prefill = all(lay.window <= 0 and lay.softcap == 0 for lay in layers)
        self._stack = require_extension().DecodeStack()
        for lay in layers:
            self._stack.add_layer(
                lay.input_norm, lay.qkv, _bias(lay.qkv_bias), lay.o, _bias(lay.o_bias), lay.post_norm,
                lay.gate_up, _bias(lay.gate_up_bias), lay.down, _bias(lay.down_bias), lay.num_heads,
                lay.num_kv_heads, lay.head_dim, lay.eps, lay.gemma, lay.scale, lay.window, lay.softcap,
                _bias(lay.qkv_packed), _bias(lay.o_packed), _bias(lay.gate_up_packed), _bias(lay.down_packed),
                _bias(lay.qkv_scales), _bias(lay.o_scales), _bias(lay.gate_up_scales), _bias(lay.down_scales),
            )  # fmt: skip

    def __len__(self) -> int:
        return len(self._stack)

    def __deepcopy__(self, memo: dict) -> None:
        """A deep copy of a model holding a stack gets none (it would run the original's weights): the
        copy runs its per-layer path until :func:`specdec.models.decoder.use_cpu_layer_ops` builds one."""
        return None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        slot_mapping: torch.Tensor,
        short: ShortQueries,
        feature_layers: Sequence[int] = (),
        attention_input: torch.Tensor | None = None,
        prefills: Sequence[PromptChunk] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run every layer on ``hidden`` ``[T, hidden]`` (the embedded new tokens).

        Args:
            hidden: ``[T, hidden_size]``, the weights' dtype.
            cos, sin: ``[T, 1, head_dim]`` RoPE tables, hidden's dtype, contiguous.
            kv_caches: per layer ``(k_cache, v_cache)`` ``[num_blocks, block_size, KVH, D]``, hidden's
                dtype; the new tokens' K/V are written at ``slot_mapping`` ``[T]`` int64 (-1: skipped).
            short: every request of the batch (:class:`ShortQueries`).
            feature_layers: layers whose input residual streams are returned too (the layer count: the
                last layer's output).
            attention_input: ``[T, qkv in_features]`` contiguous, hidden's dtype: the first layer's
                attention input in place of its input norm of ``hidden`` (an EAGLE-3 layer, whose input is
                its embeddings' and features' norms side by side; ``hidden`` is then the residual only).
            prefills: prompt chunks among the rows (:class:`PromptChunk`), attended by SDPA's fused kernel
                as the per-layer path attends them; ``short`` then holds the other requests (possibly
                none). Only where :attr:`takes_prefill`.

        Returns:
            ``(hidden, streams)``: the residual stream after the last layer ``[T, hidden_size]`` and one
            ``[T, hidden_size]`` stream per ``feature_layers`` entry.

        Raises:
            RuntimeError: shapes, dtypes or devices the kernels do not take.
        """
        out = self._stack.forward(
            hidden, cos, sin, [k for k, _ in kv_caches], [v for _, v in kv_caches], slot_mapping,
            short.block_table, short.reqs, short.q_start, short.q_len, short.seq_len, short.mask_offset,
            short.masks, list(feature_layers), _bias(attention_input),
            [v for c in prefills for v in (c.start, c.query_len, c.num_keys)],
            [_bias(c.blocks) for c in prefills], [_bias(c.mask) for c in prefills],
        )  # fmt: skip
        return out[0], out[1:]


def _bias(t: torch.Tensor | None) -> torch.Tensor:
    """An optional tensor as the C++ stack takes it: empty for None."""
    return _NO_BIAS if t is None else t
