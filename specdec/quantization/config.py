"""``QuantizationConfig``: which weight-only scheme a model is loaded with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdec.errors import ConfigError
from specdec.quantization.schemes import DEFAULT_GROUP_SIZE, GROUP_SIZES, SCHEMES

if TYPE_CHECKING:
    from specdec.models.config import ModelArchConfig

#: ``kernel`` choices of :class:`QuantizationConfig` (see :mod:`specdec.quantization.linear`).
KERNELS = ("auto", "packed", "reference")


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight-only quantization of a model's linear layers at load time.

    Attributes:
        method: ``"int8"`` (one scale per output channel) or ``"int4"`` (one scale per group of
            ``group_size`` input columns); see :mod:`specdec.quantization.schemes`.
        group_size: int4 only: 32, 64 or 128 (None: 64); must divide every quantized layer's input size.
        zero_point: int4 only: asymmetric groups (a zero point per group, as GGUF's Q4_1 and AWQ) instead
            of symmetric ones; same bytes in torch's packed layout. For the zoo's GGUF-converted models
            ``{"method": "int4", "group_size": 32, "zero_point": True}`` reproduces their own 4-bit grid
            (see :mod:`specdec.quantization.schemes`).
        lm_head: quantize the LM head too (default True: it is the largest single matrix of small models,
            e.g. 21 % of SmolLM2-135M's weights). A tied embedding stays in full precision for lookups,
            so a tied model then holds the head twice (full-precision embedding + quantized head).
        kernel: ``"auto"`` (the measured choice, see :mod:`specdec.quantization.linear`), ``"packed"``
            (torch's packed weight-only kernels wherever they support the shape) or ``"reference"``
            (dequantize, then a dense matmul).

    Raises:
        ConfigError (a ValueError): unknown method or kernel, a group size outside 32/64/128 or a zero
            point given for int8, a non-bool ``lm_head`` or ``zero_point``.
    """

    method: str
    group_size: int | None = None
    lm_head: bool = True
    kernel: str = "auto"
    zero_point: bool = False

    def __post_init__(self) -> None:
        if self.method not in SCHEMES:
            raise ConfigError(f"quantization method must be one of {list(SCHEMES)}, got {self.method!r}")
        if self.method == "int8" and self.group_size is not None:
            raise ConfigError(
                "int8 quantization has one scale per output channel; group_size applies to int4 only"
            )
        gs = self.group_size
        if gs is not None and (isinstance(gs, bool) or not isinstance(gs, int) or gs not in GROUP_SIZES):
            raise ConfigError(f"quantization group_size must be one of {GROUP_SIZES}, got {gs!r}")
        if not isinstance(self.lm_head, bool):
            raise ConfigError(f"quantization lm_head must be a bool, got {self.lm_head!r}")
        if not isinstance(self.zero_point, bool):
            raise ConfigError(f"quantization zero_point must be a bool, got {self.zero_point!r}")
        if self.method == "int8" and self.zero_point:
            raise ConfigError("int8 quantization is symmetric; zero_point applies to int4 only")
        if self.kernel not in KERNELS:
            raise ConfigError(f"quantization kernel must be one of {KERNELS}, got {self.kernel!r}")

    @property
    def resolved_group_size(self) -> int | None:
        """Columns per scale for int4 (the default filled in); None for int8 (per output channel)."""
        if self.method == "int8":
            return None
        return DEFAULT_GROUP_SIZE if self.group_size is None else self.group_size

    def check_model(self, cfg: ModelArchConfig) -> None:
        """Fail before loading when the int4 group size does not divide a quantized layer's input size.

        Raises:
            ConfigError: e.g. group size 128 for SmolLM2, whose hidden size is 576 = 4.5 × 128.
        """
        gs = self.resolved_group_size
        if gs is None:
            return
        inputs = {
            "hidden_size": cfg.hidden_size,
            "num_heads * head_dim": cfg.num_heads * cfg.head_dim,
            "intermediate_size": cfg.intermediate_size,
        }
        bad = {name: n for name, n in inputs.items() if n % gs}
        if bad:
            fits = [g for g in GROUP_SIZES if all(n % g == 0 for n in inputs.values())]
            raise ConfigError(
                f"int4 group_size {gs} does not divide the model's {bad}; group sizes that fit: {fits}"
            )

    @classmethod
    def from_any(cls, value: Any) -> QuantizationConfig | None:
        """Accept None (or ``"none"``), a method name (``"int8"``, ``"int4"``), a dict of the fields, or a
        config.

        Raises:
            ConfigError: another type, unknown keys or invalid values.
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return None if value == "none" else cls(value)
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ConfigError(
                    f"unknown quantization keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}"
                )
            if "method" not in value:
                raise ConfigError("a quantization dict needs 'method' ('int8' or 'int4')")
            return cls(**value)
        raise ConfigError(
            f"quantization must be None, 'int8', 'int4', a dict or a QuantizationConfig, got {value!r}"
        )
