"""Learned draft heads on the target's features: Medusa-1 heads and the EAGLE head, and their checkpoints.

The *feature* ``f_t`` ``[hidden_size]`` is the target's final-norm hidden state at position t, the
vector its LM head maps to the distribution of token t+1. Both heads reuse the target's LM head (frozen,
not stored in the checkpoint), and the EAGLE head its token embedding.

- Medusa-1 (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
  Heads", ICML 2024): K heads; head k (1-based) is a residual block ``h + SiLU(W_k h + b_k)`` on ``f_t``
  followed by the LM head, and predicts token ``t + k + 1``.
- EAGLE (Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", ICML 2024):
  one decoder layer over ``FC([embed(x_{t+1}); f_t])`` predicts the next feature ``f_{t+1}``;
  autoregressive in feature space, the LM head turns a predicted feature into a draft distribution.

A checkpoint is a directory: ``config.json`` (:class:`HeadConfig` plus how it was trained) and
``model.safetensors`` (the head weights only).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec.attention.base import AttentionBackend, AttentionMetadata
from specdec.errors import ConfigError, CorruptModelError
from specdec.models.config import ModelArchConfig
from specdec.models.decoder import DecoderLayer, RopeTable

HEAD_METHODS = ("medusa", "eagle", "eagle3")
#: Checkpoints shipped with the package, loaded by name (``SpeculativeConfig(model=<name>)``).
BUILTIN_HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"


@dataclass
class HeadConfig:
    """What a head checkpoint needs to be rebuilt and checked against its target.

    Attributes:
        method: "medusa" or "eagle".
        target: the target model it was trained for (a zoo name or a directory name).
        hidden_size, vocab_size: the target's; checked when the heads are loaded.
        num_heads: Medusa heads K (head k predicts k + 1 tokens ahead); 1 for EAGLE.
        arch: EAGLE and EAGLE-3: the target's :class:`ModelArchConfig` fields its decoder layer copies.
        training: provenance: command, data and seed fingerprints, tokens, time, metrics.
        draft_vocab_size: EAGLE-3 only: ``V_d`` (:mod:`specdec.drafters.eagle3_head`).
        feature_layers: EAGLE-3 only: the three target layers whose input streams it fuses.
        norm_before_residual: EAGLE-3 only: the ``speculators`` layer variant.
    """

    method: str
    target: str
    hidden_size: int
    vocab_size: int
    num_heads: int = 1
    arch: dict[str, Any] | None = None
    training: dict[str, Any] = field(default_factory=dict)
    draft_vocab_size: int | None = None
    feature_layers: list[int] | None = None
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"head config {name} must be an integer, got {value!r}")
        if self.arch is not None and not isinstance(self.arch, dict):
            raise ConfigError(f"head config arch must be a mapping, got {type(self.arch).__name__}")
        if self.method not in HEAD_METHODS:
            raise ConfigError(f"head method must be one of {HEAD_METHODS}, got {self.method!r}")
        if self.num_heads < 1:
            raise ConfigError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.method in ("eagle", "eagle3") and self.arch is None:
            raise ConfigError(f"an {self.method} head config needs the target's arch")
        if self.method == "eagle3":
            if isinstance(self.draft_vocab_size, bool) or not isinstance(self.draft_vocab_size, int):
                raise ConfigError(
                    f"an eagle3 head config needs draft_vocab_size, got {self.draft_vocab_size!r}"
                )
            layers = self.feature_layers
            if not isinstance(layers, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in layers
            ):
                raise ConfigError(f"an eagle3 head config needs feature_layers (integers), got {layers!r}")


def head_arch(arch: ModelArchConfig) -> ModelArchConfig:
    """The architecture of an EAGLE or EAGLE-3 head's decoder layer on a target ``arch``.

    The target's shapes, RoPE (its global one), norm style, q/k norms, post-norms, activation and
    softmax scale, but global attention without soft-capping: the head sees a few recent positions in
    a feature space of its own, so it need not copy a target's sliding windows (Mistral, Gemma) or
    attention soft-cap (Gemma 2); its KV then needs every position, so windowed blocks are kept
    (:func:`specdec.engine.build.release_window`). EAGLE-3's public checkpoints use this layout on
    every target. The final soft-cap stays: EAGLE's draft logits are the target's LM head's.
    """
    return replace(
        arch,
        attn_logit_softcapping=None,
        sliding_window=None,
        layer_types=(),
        local_inv_freq=None,
        local_rope_attention_scaling=1.0,
    )


class MedusaHeads(nn.Module):
    """K Medusa-1 residual blocks (the LM head is the target's).

    Args:
        hidden_size: the target's hidden size H.
        num_heads: K.

    The blocks start at zero, so every head starts out predicting what the LM head does (Medusa's
    initialisation).
    """

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for param in self.blocks.parameters():
            nn.init.zeros_(param)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``features`` ``[N, H]`` -> ``[N, K, H]``; apply the LM head to get ``[N, K, vocab_size]``."""
        outs = [features + nn.functional.silu(block(features)) for block in self.blocks]
        return torch.stack(outs, dim=1)


class EagleHead(nn.Module):
    """The EAGLE draft head: an FC layer and one decoder layer of the target's shape.

    Args:
        arch: the target's architecture (hidden size, heads, RoPE, norm and MLP style); the head's own
            layer attends globally without soft-capping whatever the target does (:func:`head_arch`).
    """

    inv_freq: torch.Tensor

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.arch = arch = head_arch(arch)
        self.fc = nn.Linear(2 * arch.hidden_size, arch.hidden_size)
        self.layer = DecoderLayer(arch)
        self.register_buffer("inv_freq", torch.tensor(arch.inv_freq, dtype=torch.float32), persistent=False)
        self.rope = RopeTable()

    def forward(
        self,
        token_embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor | None, torch.Tensor | None],
        metadata: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """Predict next features over a flattened batch.

        Args:
            token_embeds: ``[T, H]`` embeddings of ``x_{t+1}``.
            features: ``[T, H]`` features ``f_t`` (the target's, or the head's own predictions).
            positions: ``[T]`` int64, ``t``.
            kv_cache: the head's ``(k_cache, v_cache)`` (None for cache-free backends).
            metadata, attention: as for the target's layers.

        Returns:
            ``[T, H]`` predicted features ``f_{t+1}``.
        """
        x = self.fc(torch.cat([token_embeds, features.to(token_embeds.dtype)], dim=-1))
        cos, sin = self.rope(positions, self.inv_freq, self.arch.rope_attention_scaling, x.dtype)
        k_cache, v_cache = kv_cache
        return self.layer(x, cos, sin, k_cache, v_cache, metadata, attention)


def build_heads(config: HeadConfig) -> nn.Module:
    """A freshly initialised head module for ``config``."""
    if config.method == "medusa":
        return MedusaHeads(config.hidden_size, config.num_heads)
    assert config.arch is not None
    if config.method == "eagle3":
        from specdec.drafters.eagle3_head import Eagle3Head

        assert config.draft_vocab_size is not None and config.feature_layers is not None
        return Eagle3Head(
            _arch(config.arch), config.draft_vocab_size, config.feature_layers, config.norm_before_residual
        )
    return EagleHead(_arch(config.arch))


def _arch(fields: dict[str, Any]) -> ModelArchConfig:
    values = dict(fields)
    values["inv_freq"] = tuple(values["inv_freq"])
    values["eos_token_ids"] = tuple(values["eos_token_ids"])
    for name in ("layer_types", "local_inv_freq"):  # JSON lists back to the dataclass's tuples
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    try:
        return ModelArchConfig(**values)
    except TypeError as e:
        raise CorruptModelError(f"head config arch does not describe a decoder: {e}") from e


def arch_fields(arch: ModelArchConfig) -> dict[str, Any]:
    """``arch`` as JSON-serialisable fields (for :attr:`HeadConfig.arch`)."""
    out = asdict(arch)
    out["inv_freq"] = list(arch.inv_freq)
    out["eos_token_ids"] = list(arch.eos_token_ids)
    return out


def save_heads(module: nn.Module, config: HeadConfig, directory: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (bfloat16) into ``directory``."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {  # integer and boolean buffers (EAGLE-3's vocabulary maps) keep their dtype
        k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous().cpu()
        for k, v in module.state_dict().items()
    }
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
    return out


def resolve_heads_dir(name_or_dir: str) -> Path:
    """A built-in head name (a folder of ``specdec/heads``) or a checkpoint directory.

    Raises:
        ConfigError: neither exists (the message lists the built-in names).
    """
    builtin = BUILTIN_HEADS_DIR / name_or_dir
    if "/" not in name_or_dir and "\\" not in name_or_dir and ".." not in name_or_dir and builtin.is_dir():
        return builtin
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return path
    names = (
        sorted(p.name for p in BUILTIN_HEADS_DIR.iterdir() if p.is_dir())
        if BUILTIN_HEADS_DIR.is_dir()
        else []
    )
    raise ConfigError(f"no draft heads named or at {name_or_dir!r}; built-in heads: {names}")


def default_heads_name(target: str | Path, method: str) -> str:
    """The built-in heads of a target: ``<target name>-<method>`` (e.g. ``smollm2-135m-instruct-eagle``)."""
    return f"{Path(str(target)).name}-{method}"


def load_heads(
    name_or_dir: str,
    target: ModelArchConfig,
    method: str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[nn.Module, HeadConfig]:
    """Load heads for ``target`` and check they fit it.

    Raises:
        ConfigError: unknown name, or heads of another method.
        CorruptModelError: unreadable config or weights, or weights that do not fit the config.
        InvalidRequestError: heads trained for a target of another hidden or vocabulary size.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from specdec.errors import InvalidRequestError

    directory = resolve_heads_dir(name_or_dir)
    try:
        raw = json.loads((directory / "config.json").read_text())
        config = HeadConfig(**raw)
    except (OSError, ValueError, TypeError) as e:  # ConfigError is a ValueError
        raise CorruptModelError(f"{directory}/config.json is not a head config: {e}") from e
    if config.method != method:
        raise ConfigError(f"{name_or_dir!r} holds {config.method} heads, not {method}")
    if (config.hidden_size, config.vocab_size) != (target.hidden_size, target.vocab_size):
        raise InvalidRequestError(
            f"heads {name_or_dir!r} were trained for hidden size {config.hidden_size} and vocabulary "
            f"{config.vocab_size}; the target has {target.hidden_size} and {target.vocab_size}"
        )
    try:
        module = build_heads(config)
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptModelError(f"{directory}/config.json does not describe {method} heads: {e!r}") from e
    try:
        state = load_file(str(directory / "model.safetensors"))
        module.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    except (OSError, SafetensorError, RuntimeError) as e:
        raise CorruptModelError(f"cannot load head weights from {directory}: {e}") from e
    if config.method == "eagle3":
        check_eagle3_fits(module, target, str(directory))
    module = module.to(device=device, dtype=dtype).eval()
    keep_rope_in_float32(module)
    return module, config


def keep_rope_in_float32(module: nn.Module) -> None:
    """Give a head's RoPE ``inv_freq`` buffers back their float32 values after a ``.to(dtype)`` (as the
    target keeps them, and transformers: in bfloat16, 0.1 becomes 0.10009765625 and the angles drift by
    ~0.1 rad at position 1000)."""
    for m in module.modules():
        arch = getattr(m, "arch", None)
        buf = getattr(m, "inv_freq", None)
        if isinstance(buf, torch.Tensor) and arch is not None and buf.dtype != torch.float32:
            m.inv_freq = torch.tensor(arch.inv_freq, dtype=torch.float32, device=buf.device)


def check_eagle3_fits(head: nn.Module, target: ModelArchConfig, where: str) -> None:
    """Check a loaded EAGLE-3 head against its target: vocabulary maps and feature layers.

    Raises:
        CorruptModelError: ``d2t``/``t2d`` do not describe an injective map into the vocabulary.
        InvalidRequestError: feature layers outside the target's ``[0, num_layers]``.
    """
    from specdec.drafters.eagle3_head import Eagle3Head, check_vocab_maps
    from specdec.errors import InvalidRequestError

    assert isinstance(head, Eagle3Head)
    try:
        check_vocab_maps(head.d2t, head.t2d, target.vocab_size)
    except ConfigError as e:
        raise CorruptModelError(f"{where}: {e}") from e
    bad = [i for i in head.feature_layers if not 0 <= i <= target.num_layers]
    if bad:
        raise InvalidRequestError(
            f"{where}: EAGLE-3 feature layers {list(head.feature_layers)} do not fit a target of "
            f"{target.num_layers} layers"
        )
