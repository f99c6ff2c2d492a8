"""Linear layers whose few-row products (decode, verification) run the CPU GEMV kernel.

:class:`GemvLinear` keeps the dense weight and sends inputs of at most
:func:`kernels.cpu_gemv.max_rows` rows to :func:`kernels.cpu_gemv.gemv` (which falls back to ``F.linear``
where the kernel does not build); wider inputs (float32 prefill chunks) go to ``F.linear``. See
:mod:`kernels.cpu_gemv` for the figures. ``SPECDEC_CPU_GEMV=0`` keeps plain ``nn.Linear`` (A/B runs).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_gemv, cpu_gemv_int8


class GemvLinear(nn.Module):
    """``y = x W^T + b`` through :func:`kernels.cpu_gemv.gemv` (inference; training keeps ``F.linear``).

    Args:
        linear: the CPU ``nn.Linear`` (float32 or bfloat16) whose weight and bias it takes (shared, not
            copied: a tied LM head stays tied).

    Shapes: input ``[..., in_features]``, output ``[..., out_features]``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.use_kernel = cpu_gemv.available()
        cpu_gemv.max_rows(linear.weight.dtype)  # decided now, not inside a torch.compile trace
        # The common call (2-D rows of the weight's dtype, no autograd) goes straight to the operator:
        # ~120 calls per decode step, where cpu_gemv.gemv's checks cost ~5 µs each.
        self.direct = (
            self.use_kernel
            and self.weight.device.type == "cpu"
            and self.weight.dtype in (torch.float32, torch.bfloat16)
            and self.weight.is_contiguous()
        )
        #: Packed copy of a bfloat16 weight (:func:`use_packed_weights`: AMX tile order or oneDNN's layout),
        #: None: the kernel only.
        self.packed: torch.Tensor | None = None
        self._use_packed: dict[int, bool] = {}  # rows -> cpu_gemv.packed_rows(rows, N, K)

    def _direct_rows(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is the common call the operators take directly (2-D rows of the weight's dtype on
        the CPU, no autograd)."""
        return (
            self.direct
            and x.dim() == 2
            and x.dtype == self.weight.dtype
            and x.dtype in (torch.float32, torch.bfloat16)
            and x.device.type == "cpu"
            and not torch.is_grad_enabled()
        )

    def _packed_for(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether a product of ``rows`` rows takes the packed weight (decided once per row count)."""
        if self.packed is None or torch.compiler.is_compiling():
            return False
        use_packed = self._use_packed.get(rows)
        if use_packed is None:
            use_packed = self._use_packed[rows] = rows > cpu_gemv.max_rows(dtype) or cpu_gemv.packed_rows(
                rows, self.out_features, self.in_features
            )
        return use_packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._direct_rows(x):
            rows = x.shape[0]
            if self._packed_for(rows, x.dtype):
                return torch.ops.specdec_cpu.linear_packed(x, self.weight, self.packed, self.bias)
            if rows <= cpu_gemv.max_rows(x.dtype):
                return torch.ops.specdec_cpu.gemv(x, self.weight, self.bias)
        return cpu_gemv.gemv(x, self.weight, self.bias, self.use_kernel)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()`` bit for bit, ``[..., out_features]`` float32 (an LM head's logits): a product
        on the packed weight writes float32 itself (:func:`kernels.cpu_gemv.linear_packed_logits`)."""
        if self._direct_rows(x) and self._packed_for(x.shape[0], x.dtype):
            return torch.ops.specdec_cpu.linear_packed_logits(x, self.weight, self.packed, self.bias)
        return self(x).float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel=cpu_gemv"


def use_packed_weights(model: nn.Module) -> int:
    """Give every bfloat16 :class:`GemvLinear` of ``model`` a packed copy of its weight
    (:func:`kernels.cpu_gemv.pack_weight`: the AMX kernel's tile order where the CPU has AMX, else oneDNN's
    layout), used where :func:`kernels.cpu_gemv.packed_rows` says it is faster than the kernel
    (verification and batched decode rows, prefill chunks): the weights' memory doubles. Likewise every int8
    :class:`~specdec.quantization.linear.QuantizedLinear` on the int8 kernel, where
    :func:`kernels.cpu_gemv_int8.tiles`: its codes in the int8 tile kernel's order, used for all its rows.
    Eager engines only (a ``torch.compile`` trace keeps the kernel). Returns the number of layers given one
    (0 where :func:`kernels.cpu_gemv.packing_supported` says no, e.g. ``SPECDEC_CPU_ONEDNN=0``, and there
    is no int8 layer)."""
    from specdec.quantization.linear import QuantizedLinear

    done = 0
    int8_tiles: bool | None = None  # asked once, at the first int8 layer
    for m in model.modules():
        if isinstance(m, QuantizedLinear) and m.int8_kernel and m.packed is None:
            if int8_tiles is None:
                int8_tiles = cpu_gemv_int8.tiles()
            if int8_tiles and m.qweight.device.type == "cpu":
                m.set_tile_codes(cpu_gemv_int8.pack_tiles(m.qweight))
                done += 1
            continue
        if (
            isinstance(m, GemvLinear)
            and m.packed is None
            and m.direct
            and cpu_gemv.packing_supported(m.weight)
        ):
            m.packed = cpu_gemv.pack_weight(m.weight)
            done += 1
    return done


def gemv_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True when linears of ``dtype`` on ``device`` use the kernel (CPU, float32/bfloat16, built here)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_gemv.available()


def use_gemv_linears(model: nn.Module, memo: dict[int, GemvLinear] | None = None) -> int:
    """Swap every plain CPU float32/bfloat16 ``nn.Linear`` of ``model`` for a :class:`GemvLinear`, in
    place (a module shared with another model, in ``memo``, is swapped once). Returns the number swapped."""
    memo = {} if memo is None else memo
    swaps: list[tuple[nn.Module, str, GemvLinear]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear and gemv_supported(child.weight.dtype, child.weight.device):
                if id(child) not in memo:
                    memo[id(child)] = GemvLinear(child)
                swaps.append((parent, name, memo[id(child)]))
    for parent, name, module in swaps:
        setattr(parent, name, module)
    return len(swaps)
