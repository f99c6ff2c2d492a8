"""Linear layers with weights pre-packed for oneDNN, for bfloat16 decoding on the CPU.

Decode is memory-bound: each step reads every weight once, so what matters is how fast a matrix-vector
product streams its weight. ``torch.nn.functional.linear`` in bfloat16 on the CPU hands oneDNN a plain
row-major weight and pays for a layout change on every call; a weight reordered once into oneDNN's
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's weight freezing does)
streams faster. Measured on this project's 2-core CPU for SmolLM2-135M's 121 linear layers (random
bf16 weights, one process): 18.4 → 13.0 ms per step at 1 row, 33.2 → 17.9 ms at 16 rows, and the outputs
are bit-identical to ``F.linear`` at every row count tried (1 to 300).

Only bfloat16 on the CPU is packed: float32 packing (``torch.ops.mkl._mkl_linear``) measured faster at
1 row only and slower at 5 and 64, and CUDA has its own GEMM path. Set ``SPECDEC_PACKED_LINEAR=0`` to
keep plain ``nn.Linear`` (for A/B benchmarks).
"""

from __future__ import annotations

import os

import torch
from torch import nn

ENV_DISABLE = "SPECDEC_PACKED_LINEAR"


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in oneDNN's blocked layout (inference only, no autograd).

    Args:
        linear: the bfloat16 CPU ``nn.Linear`` to pack; its weight is not kept (except through
            ``keep_weight``), so memory does not double.
        keep_weight: also keep the dense weight as ``.weight`` (for a tied LM head, whose weight is the
            embedding table anyway).

    Shapes: input ``[..., in_features]``, output ``[..., out_features]``, both bfloat16.
    """

    def __init__(self, linear: nn.Linear, keep_weight: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.dtype = w.dtype
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed_weight, self.bias, "none", [], "")
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True when linears of ``dtype`` on ``device`` are packed (bfloat16, CPU, oneDNN with bf16)."""
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return False
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack_linears(model: nn.Module, memo: dict[int, PackedLinear] | None = None) -> int:
    """Swap every plain bfloat16 CPU ``nn.Linear`` of ``model`` for a :class:`PackedLinear`, in place.

    Modules that are not plain ``nn.Linear`` (quantized ones, for instance) are left alone, as are
    linears in other dtypes or on other devices. A linear whose weight is shared with another parameter
    of the model (a tied LM head) keeps its dense weight. Pass the same ``memo`` when packing models that
    share ``nn.Linear`` modules (a quantized self-drafter shares the target's LM head): a shared module
    is packed once. Returns the number of layers swapped.
    """
    memo = {} if memo is None else memo
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    swaps: list[tuple[nn.Module, str, PackedLinear]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear and packing_supported(child.weight.dtype, child.weight.device):
                if id(child) not in memo:
                    memo[id(child)] = PackedLinear(child, keep_weight=uses[id(child.weight)] > 1)
                swaps.append((parent, name, memo[id(child)]))
    for parent, name, packed in swaps:
        setattr(parent, name, packed)
    return len(swaps)
