"""Our decoder for the Llama family (SmolLM2, Llama 2/3) and the Qwen2 family (Qwen2, Qwen2.5).

Pre-norm transformer: RMSNorm, rotary position embeddings (RoPE, Su et al. 2021) from the config,
grouped-query attention (Ainslie et al. 2023) through a paged KV cache, SwiGLU MLP (Shazeer 2020), tied
or untied LM head. Qwen2 differs from Llama only in its q/k/v biases. q/k/v and gate/up are fused into
one matrix each, so a layer is four matrix products.

The forward takes a flattened variable-length batch (see :mod:`specdec.attention.base`) and returns
logits only at the rows asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdec.attention.base import AttentionBackend, AttentionMetadata
from specdec.models.config import ModelArchConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32 as transformers does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos and sin ``[T, 1, head_dim]`` for ``positions`` ``[T]``, ``inv_freq`` ``[head_dim / 2]``."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        x = self.input_layernorm(hidden)
        qkv = self.qkv_proj(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # RoPE on the query and key heads in one go; values pass through.
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        attn = attention.forward(q, k, v, k_cache, v_cache, metadata, self.scale)
        hidden = hidden + self.o_proj(attn.reshape(num_tokens, self.q_size))
        x = self.post_attention_layernorm(hidden)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up)


class DecoderLM(nn.Module):
    """A causal decoder LM over a paged KV cache.

    Args:
        cfg: the architecture (see :class:`ModelArchConfig`).
    """

    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", torch.tensor(cfg.inv_freq, dtype=torch.float32), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (the embedding table's), whatever form the linear layers take."""
        return self.embed_tokens.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` for ``positions`` ``[T]``, as transformers computes them."""
        return rope_cos_sin(positions, self.inv_freq, self.cfg.rope_attention_scaling, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        attention: AttentionBackend,
        logits_indices: torch.Tensor | None = None,
        all_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the flattened batch through the model.

        Args:
            input_ids: ``[T]`` token ids.
            positions: ``[T]`` position of each token in its sequence (explicit, so token trees work).
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads,
                head_dim]``; written at ``metadata.slot_mapping``.
            metadata: the flattened batch.
            attention: the attention backend.
            logits_indices: ``[R]`` rows whose logits are wanted; None for all rows.
            all_hidden: return the hidden states of every row, not only of the logits rows.

        Returns:
            ``(logits, hidden)``: ``logits`` ``[R, vocab_size]`` float32, and ``hidden`` the final-norm
            hidden states (the features learned drafters read): ``[R, hidden_size]`` at the logits rows,
            or ``[T, hidden_size]`` at every row when ``all_hidden``.
        """
        hidden = self.layer_stack(input_ids, positions, kv_caches, metadata, attention)
        return self.final(hidden, logits_indices, all_hidden)

    def layer_stack(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        attention: AttentionBackend | Sequence[AttentionBackend],
    ) -> torch.Tensor:
        """Embedding, RoPE and every decoder layer: the residual stream ``[T, hidden_size]`` before the
        final norm. ``attention`` is one backend for every layer, or one per layer (the compiled forward
        of :mod:`specdec.compilation` passes per-layer custom-op calls, with no caches or metadata)."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, hidden.dtype)
        per_layer = attention if isinstance(attention, Sequence) else [attention] * len(self.layers)
        for layer, (k_cache, v_cache), attn in zip(self.layers, kv_caches, per_layer):
            hidden = layer(hidden, cos, sin, k_cache, v_cache, metadata, attn)
        return hidden

    def final(
        self, hidden: torch.Tensor, logits_indices: torch.Tensor | None, all_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm and LM head on the residual stream ``hidden`` ``[T, hidden_size]``; see
        :meth:`forward` for ``logits_indices``, ``all_hidden`` and the returned shapes."""
        if all_hidden:
            hidden = self.norm(hidden)
            rows = hidden if logits_indices is None else hidden[logits_indices]
            return self.lm_head(rows).float(), hidden
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        hidden = self.norm(hidden)
        return self.lm_head(hidden).float(), hidden
