"""Paged attention as an opaque custom op: what ``torch.compile`` leaves out of the compiled graph.

vLLM's piecewise scheme: the dense work of a step (norms, projections, RoPE, MLP, LM head) is compiled;
attention, whose inputs (block tables, ragged lengths, tree masks) change every step, runs eagerly
inside one custom op per layer. The op takes only the layer's query, key and value and the layer index;
the KV caches, the batch's :class:`~specdec.attention.base.AttentionMetadata` and the backend are read
from the :func:`forward_context` the caller opens around the compiled call. The caches are mutated
behind the compiler's back on purpose: declaring them as mutated arguments would make the functionalised
graph copy them (vLLM reads its caches the same way).

Rows past :attr:`ForwardContext.num_tokens` are bucket padding: they are not written to the cache, do
not attend, and get zeros.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specdec.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    """What the attention op of one forward reads.

    Attributes:
        metadata: the flattened batch of ``num_tokens`` real rows.
        attention: the backend that writes K/V and attends.
        kv_caches: per layer ``(k_cache, v_cache)``.
        num_tokens: the real rows ``T``; the op's inputs may have more (bucket padding).
    """

    metadata: AttentionMetadata
    attention: AttentionBackend
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    num_tokens: int


_current: list[ForwardContext] = []


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    """Make ``ctx`` what :func:`paged_attention` reads until the block ends (nestable: a drafter's
    forward inside a target's)."""
    _current.append(ctx)
    try:
        yield
    finally:
        _current.pop()


@torch.library.custom_op("specdec::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Write the K/V of the real rows into layer ``layer``'s cache and attend.

    Args:
        query: ``[T_pad, num_heads, head_dim]``, RoPE applied.
        key, value: ``[T_pad, num_kv_heads, head_dim]``.
        layer: index into the context's ``kv_caches``.
        scale: softmax scale.
        sliding_window, softcap: the layer's window (positions) and score soft-cap, 0 when off (see
            :class:`~specdec.attention.base.AttentionBackend`).

    Returns:
        ``[T_pad, num_heads, head_dim]``: attention output of the first ``num_tokens`` rows, zeros after.

    Raises:
        RuntimeError: called outside :func:`forward_context`.
    """
    if not _current:
        raise RuntimeError("specdec::paged_attention called outside forward_context")
    ctx = _current[-1]
    n = ctx.num_tokens
    k_cache, v_cache = ctx.kv_caches[layer]
    extra: dict[str, float | int] = {}
    if sliding_window > 0:
        extra["sliding_window"] = sliding_window
    if softcap > 0:
        extra["softcap"] = softcap
    out = ctx.attention.forward(query[:n], key[:n], value[:n], k_cache, v_cache, ctx.metadata, scale, **extra)
    if n == query.shape[0]:
        return out
    padded = query.new_zeros(query.shape)
    padded[:n] = out
    return padded


@paged_attention.register_fake
def _paged_attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    return torch.empty_like(query)


class LayerAttentionOp:
    """An :class:`~specdec.attention.base.AttentionBackend` for layer ``layer`` of a compiled forward:
    ignores the caches and metadata it is handed (None there) and calls :func:`paged_attention`."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return torch.ops.specdec.paged_attention(
            query, key, value, self.layer, scale, sliding_window or 0, softcap or 0.0
        )
