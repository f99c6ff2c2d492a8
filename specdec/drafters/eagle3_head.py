"""The EAGLE-3 draft head: a fusion of three target layers, one decoder layer, a reduced draft vocabulary.

Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test",
2025. The head differs from EAGLE-1's (:class:`specdec.drafters.heads.EagleHead`) in three ways:

- **Multi-layer features.** At a position the target has computed, the head's input is
  ``g_t = fc([a_t; b_t; c_t])``: the residual streams entering a low, a middle and a high target layer
  (``feature_layers``, by default ``(2, L // 2, L - 3)`` as in the paper's code and vLLM), concatenated,
  ``[3H] -> [H]``. At a drafted position the head reads its own previous output instead (it never
  regresses the target's features: the loss is on tokens only).
- **The layer reads token and feature side by side.** Its attention projections take
  ``[input_layernorm(embed(x_{t+1})); hidden_norm(g_t)]`` (``2H`` wide); the residual is ``g_t`` (or
  ``hidden_norm(g_t)`` with ``norm_before_residual``, a variant of vLLM's ``speculators`` checkpoints);
  then the usual MLP block.
- **A reduced draft vocabulary.** Its own LM head ``[H] -> [V_d]`` (after its own final norm) covers the
  ``V_d`` most frequent target tokens of its training data; ``d2t[i]`` is the offset of draft token ``i``
  (target id ``i + d2t[i]``, the layout of the paper's code and of vLLM) and ``t2d`` ``[V]`` bool marks
  the target tokens in the draft vocabulary. Draft distributions are zero outside it; verification stays
  exact whatever the drafter proposes (:mod:`sampling.rejection`).

Step ``t`` of a chain: ``h_{t+1} = layer(embed(x_{t+1}), g_t)``; the draft distribution of ``x_{t+2}``
is ``softmax(lm_head(norm(h_{t+1})))`` over the draft vocabulary; the next step reads ``g_{t+1} =
h_{t+1}``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specdec.attention.base import AttentionBackend, AttentionMetadata
from specdec.drafters.heads import head_arch
from specdec.errors import ConfigError
from specdec.models.config import ModelArchConfig
from specdec.models.decoder import DecoderLayer, RopeTable, make_norm, run_stack


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers of an ``num_layers``-layer target: ``(2, L // 2, L - 3)``
    (the inputs of those layers; the paper's code and vLLM's default).

    Raises:
        ConfigError: fewer than 6 layers (the three would not be distinct and increasing).
    """
    if num_layers < 7:  # (2, L // 2, L - 3) distinct and increasing
        raise ConfigError(
            f"EAGLE-3 needs a target of at least 7 layers for its default layers, got {num_layers}"
        )
    return (2, num_layers // 2, num_layers - 3)


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """Check ``d2t`` ``[V_d]`` (offsets) and ``t2d`` ``[V]`` (bool) describe one injective map from the
    draft vocabulary into the target's.

    Raises:
        ConfigError: shapes, ranges, duplicates, or ``t2d`` disagreeing with ``d2t``.
    """
    if d2t.dim() != 1 or t2d.dim() != 1:
        raise ConfigError(f"d2t and t2d must be 1-D, got shapes {tuple(d2t.shape)} and {tuple(t2d.shape)}")
    if t2d.shape[0] != vocab_size:
        raise ConfigError(f"t2d covers {t2d.shape[0]} tokens; the target's vocabulary has {vocab_size}")
    ids = torch.arange(d2t.shape[0]) + d2t.long().cpu()
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ConfigError(f"d2t maps draft tokens outside the target's vocabulary [0, {vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise ConfigError("d2t maps two draft tokens to one target token")
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    if not torch.equal(mask, t2d.bool().cpu()):
        raise ConfigError("t2d does not mark exactly the target tokens d2t maps to")


def vocab_maps(draft_to_target: Sequence[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` for the target ids of the draft vocabulary, in draft order (sorted ascending, as
    the paper's code builds them, so the offsets are non-negative).

    Raises:
        ConfigError: an id outside ``[0, vocab_size)`` or a repeated id.
    """
    ids = torch.tensor(sorted(int(i) for i in draft_to_target), dtype=torch.int64)
    if len(ids) and (ids[0] < 0 or ids[-1] >= vocab_size):
        raise ConfigError(f"draft vocabulary ids outside the target's vocabulary [0, {vocab_size})")
    d2t = ids - torch.arange(len(ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    check_vocab_maps(d2t, t2d, vocab_size)
    return d2t, t2d


class Eagle3Layer(DecoderLayer):
    """The head's decoder layer: attention over ``[input_layernorm(embeds); hidden_norm(hidden)]``
    (``2H`` wide), residual ``hidden`` (``hidden_norm(hidden)`` when ``norm_before_residual``), then
    :class:`DecoderLayer`'s MLP block."""

    def __init__(self, arch: ModelArchConfig, norm_before_residual: bool = False) -> None:
        super().__init__(arch)
        self.qkv_proj = nn.Linear(2 * arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.hidden_norm = make_norm(arch, arch.hidden_size)
        self.norm_before_residual = norm_before_residual

    def forward(  # type: ignore[override]
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """``embeds``, ``hidden`` ``[T, H]`` -> ``[T, H]``."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        residual = normed if self.norm_before_residual else hidden
        if self.decode_stack is not None:  # the C++ stack of one layer, x as its attention input
            fast = run_stack(
                self.decode_stack, self._stack_refs, residual, (cos, sin),
                [(k_cache, v_cache)], metadata, attention, (), attention_input=x,
            )  # fmt: skip
            if fast is not None:
                return fast[0]
        return self.block(residual, x, cos, sin, k_cache, v_cache, metadata, attention)  # type: ignore[arg-type]


class Eagle3Head(nn.Module):
    """The EAGLE-3 head (the module docstring has the equations).

    Args:
        arch: the target's architecture (its attention shape and RoPE are the layer's; global attention
            without soft-capping whatever the target's, :func:`~specdec.drafters.heads.head_arch`).
        draft_vocab_size: ``V_d``.
        feature_layers: the target layers whose input streams are fused (3 of them).
        norm_before_residual: the ``speculators`` variant (residual after ``hidden_norm``).

    Buffers ``d2t`` ``[V_d]`` int64 and ``t2d`` ``[V]`` bool are part of the checkpoint; a fresh head
    maps the draft vocabulary to the first ``V_d`` target tokens until :meth:`set_vocab` is called.

    Raises:
        ConfigError: ``V_d`` outside ``[1, V]``, or feature layers that are not three indices in
            ``[0, num_layers]``.
    """

    inv_freq: torch.Tensor
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(
        self,
        arch: ModelArchConfig,
        draft_vocab_size: int,
        feature_layers: Sequence[int],
        norm_before_residual: bool = False,
    ) -> None:
        super().__init__()
        arch = head_arch(arch)
        if not 1 <= draft_vocab_size <= arch.vocab_size:
            raise ConfigError(f"draft_vocab_size must be in [1, {arch.vocab_size}], got {draft_vocab_size}")
        layers = tuple(int(i) for i in feature_layers)
        if len(layers) != 3 or any(not 0 <= i <= arch.num_layers for i in layers):
            raise ConfigError(
                f"EAGLE-3 fuses three target layers in [0, {arch.num_layers}], got {list(feature_layers)}"
            )
        self.arch = arch
        self.draft_vocab_size = draft_vocab_size
        self.feature_layers = layers
        h = arch.hidden_size
        self.fc = nn.Linear(len(layers) * h, h, bias=False)
        self.layer = Eagle3Layer(arch, norm_before_residual)
        self.norm = make_norm(arch, h)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("inv_freq", torch.tensor(arch.inv_freq, dtype=torch.float32), persistent=False)
        self.rope = RopeTable()
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
        t2d[:draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    @property
    def feature_size(self) -> int:
        """Columns of the fused target features: ``3 * hidden_size``."""
        return len(self.feature_layers) * self.arch.hidden_size

    def set_vocab(self, draft_to_target: Sequence[int]) -> None:
        """Set the draft vocabulary to these target ids (``V_d`` of them, any order; stored sorted)."""
        if len(draft_to_target) != self.draft_vocab_size:
            raise ConfigError(
                f"{len(draft_to_target)} target ids for a draft vocabulary of {self.draft_vocab_size}"
            )
        d2t, t2d = vocab_maps(draft_to_target, self.arch.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def target_ids(self) -> torch.Tensor:
        """``[V_d]`` int64: the target id of each draft token."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def forward(
        self,
        token_embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor | None, torch.Tensor | None],
        metadata: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """The next hidden state over a flattened batch.

        Args:
            token_embeds: ``[T, H]`` target embeddings of ``x_{t+1}``.
            features: ``[T, 3H]`` the target's fused layers at t (then ``fc`` applies), or ``[T, H]`` the
                head's own previous outputs (drafted positions).
            positions: ``[T]`` int64, ``t``.
            kv_cache, metadata, attention: as for the target's layers.

        Returns:
            ``[T, H]`` hidden states ``h_{t+1}`` (before :attr:`norm`; :meth:`logits` gives the draft
            vocabulary's logits, the next step reads them as its ``features``).
        """
        features = features.to(token_embeds.dtype)
        if features.shape[-1] == self.feature_size and self.feature_size != self.arch.hidden_size:
            features = self.fc(features)
        cos, sin = self.rope(positions, self.inv_freq, self.arch.rope_attention_scaling, token_embeds.dtype)
        k_cache, v_cache = kv_cache
        return self.layer(token_embeds, features, cos, sin, k_cache, v_cache, metadata, attention)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` -> float32 ``[R, V_d]`` logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden)).float()
