"""Typed engine configuration, validated with ``ValueError`` at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.errors import ConfigError

if TYPE_CHECKING:
    from specdec.quantization.config import QuantizationConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_int(name: str, value: object, minimum: int, optional: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= ``minimum`` (or None when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = f"an integer >= {minimum}" + (" or None" if optional else "")
        raise ConfigError(f"{name} must be {kind}, got {value!r}")


@dataclass
class CacheConfig:
    """Paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        num_kv_blocks: blocks in the pool; None sizes the pool to hold ``max_num_seqs`` full-length
            sequences, capped at ``kv_cache_memory_bytes``.
        enable_prefix_caching: share full blocks of equal prefixes between requests.
        kv_cache_memory_bytes: memory budget for the pool when ``num_kv_blocks`` is None.
        kv_cache_dtype: ``"auto"`` (the model's dtype) or ``"int8"`` (one float32 scale per token and KV
            head; see :mod:`specdec.quantization.kv_cache`). A draft model's KV stays in its own dtype.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int = 2 * 1024**3
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        from specdec.quantization.kv_cache import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)
        _check_int("block_size", self.block_size, 1)
        _check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")


@dataclass
class SchedulerConfig:
    """Continuous batching.

    Attributes:
        max_num_batched_tokens: token budget of one forward (prefill chunks + decode tokens + drafts).
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence (prompt + output); None: the model's maximum.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 2, optional=True)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` or a torch dtype.

    Raises:
        ConfigError (a ValueError): any other dtype.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None picks CUDA when available, else the CPU.

    Raises:
        ConfigError: not a device torch knows, or CUDA asked for where it is not available.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device must be 'cpu', 'cuda', 'cuda:N' or None, got {device!r} ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available here")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be a CPU or CUDA device, got {device!r}")
    return dev


#: Largest ``num_speculative_tokens`` accepted (beyond this, acceptance of the last positions is ~0).
MAX_SPECULATIVE_TOKENS = 16
SPECULATIVE_METHODS = ("ngram", "draft_model", "medusa", "eagle", "quantized_self")
TREE_KINDS = (None, "static", "dynamic")
#: Largest token tree verified per request per step.
MAX_TREE_NODES = 64
#: Medusa's static tree when ``tree="static"`` and no ``tree_choices`` are given: 16 nodes over 4 heads,
#: built by :func:`specdec.drafters.tree.choices_from_accuracies` from held-out per-rank accuracies of
#: the built-in SmolLM2 heads (see specdec/heads/smollm2-135m-instruct-medusa/config.json).
DEFAULT_TREE_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (0, 0), (2,), (3,), (0, 1), (4,), (5,),
    (1, 0), (0, 2), (6,), (7,), (0, 3), (8,), (2, 0), (0, 4),
)  # fmt: skip


@dataclass
class SpeculativeConfig:
    """Speculative decoding: which drafter proposes tokens, how many, and in what shape.

    Attributes:
        method: "ngram" (prompt lookup, Saxena 2023), "draft_model" (a smaller model with the
            target's tokenizer; Leviathan et al. 2023, Chen et al. 2023), "medusa" (Medusa-1 heads, Cai
            et al. 2024), "eagle" (an EAGLE head, Li et al. 2024) or "quantized_self" (the target's own
            weights quantized, see ``quantization``; a draft model that needs no second checkpoint).
        num_speculative_tokens: k, the most draft tokens per step of a chain, or the deepest level of a
            tree (1..16).
        prompt_lookup_max, prompt_lookup_min: n-gram sizes tried by "ngram", longest first.
        model: "draft_model": a zoo name or an HF-format directory; "medusa"/"eagle": a built-in head name
            (a folder of ``specdec/heads``) or a head checkpoint directory, None for the target's
            built-in heads (``<target zoo name>-<method>``).
        draft_dtype: dtype of the draft model or heads; None: the target's.
        quantization: "quantized_self" only: the drafter is the target's own weights quantized, ``"int4"``,
            ``"int8"`` or a dict of :class:`~specdec.quantization.config.QuantizationConfig` fields (e.g.
            ``{"method": "int4", "group_size": 32}``); it shares the target's tokenizer and embedding, has
            its own KV, and the full-precision target verifies its drafts as any draft model's.
        tree: None (a chain of k drafts), "static" (a Medusa tree from ``tree_choices``; medusa only) or
            "dynamic" (EAGLE-2's tree; eagle only).
        tree_choices: the static tree's index paths (None: :data:`DEFAULT_TREE_CHOICES`); paths deeper than
            k are dropped.
        tree_topk: "dynamic": children drafted per expanded node, and nodes expanded per level.
        max_tree_nodes: "dynamic": draft tokens kept after reranking (the verified tree's size).

    Raises:
        ConfigError (a ValueError): unknown method, k outside 1..16, bad n-gram sizes, missing draft model,
            a tree for a drafter that proposes chains, bad tree settings.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    draft_dtype: str | None = None
    quantization: str | dict | None = None
    tree: str | None = None
    tree_choices: list[list[int]] | None = None
    tree_topk: int = 4
    max_tree_nodes: int = 16

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative method 'draft_model' needs model=<zoo name or directory>")
        if self.method == "ngram" and self.model is not None:
            raise ConfigError(f"speculative method {self.method!r} takes no model (got model={self.model!r})")
        if self.tree not in TREE_KINDS:
            raise ConfigError(f"tree must be one of {TREE_KINDS}, got {self.tree!r}")
        if self.tree is not None and self.method not in ("medusa", "eagle"):
            raise ConfigError(
                f"tree={self.tree!r} needs method 'medusa' or 'eagle' ({self.method} drafts chains)"
            )
        if self.tree == "dynamic" and self.method != "eagle":
            raise ConfigError("tree='dynamic' (EAGLE-2) needs method 'eagle'")
        if self.tree == "static" and self.method != "medusa":
            raise ConfigError(
                "tree='static' (Medusa's tree) needs method 'medusa'; eagle uses tree='dynamic'"
            )
        _check_int("tree_topk", self.tree_topk, 1)
        _check_int("max_tree_nodes", self.max_tree_nodes, 1)
        if self.max_tree_nodes > MAX_TREE_NODES:
            raise ConfigError(f"max_tree_nodes must be <= {MAX_TREE_NODES}, got {self.max_tree_nodes}")
        if self.method == "quantized_self":
            if self.model is not None:
                raise ConfigError(
                    "speculative method 'quantized_self' drafts with the target's own weights "
                    f"(got model={self.model!r})"
                )
            if self.quantization is None:
                raise ConfigError("speculative method 'quantized_self' needs quantization='int4' or 'int8'")
        elif self.quantization is not None:
            raise ConfigError(
                f"quantization={self.quantization!r} applies to method 'quantized_self' only "
                "(quantize the target itself with LLM(..., quantization=...))"
            )
        self.quantization_config()  # validates the scheme and group size
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(f"model must be a name or a directory (str), got {self.model!r}")
        if self.tree_choices is not None:
            if self.tree != "static":
                raise ConfigError("tree_choices need tree='static'")
            from specdec.drafters.tree import StaticTree

            paths = self.tree_choices
            if (
                isinstance(paths, (str, bytes))
                or not isinstance(paths, (list, tuple))
                or any(
                    isinstance(c, (str, bytes))
                    or not isinstance(c, (list, tuple))
                    or any(isinstance(r, bool) or not isinstance(r, int) for r in c)
                    for c in paths
                )
            ):
                raise ConfigError(f"tree_choices must be a list of lists of ints, got {paths!r}")
            if len(paths) > MAX_TREE_NODES:
                raise ConfigError(f"tree_choices has {len(paths)} nodes; at most {MAX_TREE_NODES}")
            try:
                StaticTree.from_choices(paths)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"tree_choices: {e}") from None

    def quantization_config(self) -> QuantizationConfig | None:
        """The quantized self-drafter's :class:`~specdec.quantization.config.QuantizationConfig` (None for
        other methods)."""
        from specdec.quantization.config import QuantizationConfig

        return QuantizationConfig.from_any(self.quantization)

    def static_tree_choices(self) -> list[list[int]]:
        """The static tree's paths, limited to depth k (and for Medusa, to k heads)."""
        choices = self.tree_choices if self.tree_choices is not None else DEFAULT_TREE_CHOICES
        return [list(c) for c in choices if len(c) <= self.num_speculative_tokens]

    @property
    def num_draft_slots(self) -> int:
        """KV slots a request reserves for drafts per step: k for a chain, the tree's size for a tree."""
        if self.tree == "static":
            return len(self.static_tree_choices())
        if self.tree == "dynamic":
            return self.max_tree_nodes
        return self.num_speculative_tokens

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """Accept a SpeculativeConfig, a dict of its fields, or None.

        Raises:
            ValueError: unknown keys or invalid values.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(value)}")
        known = set(cls.__dataclass_fields__)
        unknown = set(value) - known
        if unknown:
            raise ConfigError(f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**value)
