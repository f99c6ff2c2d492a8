"""The target's features: the final-norm hidden state ``f_t`` at every position of prompt + response,
from whole-sequence forwards of our decoder with :class:`~specdec.attention.dense.DenseAttention` and
``all_hidden=True`` (no KV cache), kept as bfloat16. For EAGLE-3 (``feature_layers``): the residual
streams entering those layers, then ``f_t``, ``[L, (n + 1) H]``, and the target's top token at every
position (from the same forward)."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger("experiments.train")


def _torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config's dtype name."""
    from specdec.config import resolve_dtype

    return resolve_dtype(name)


def _dense_forward_batches(lengths: Sequence[int], batch_tokens: int) -> Iterator[list[int]]:
    """Indices of sequences, shortest first, packed into batches of at most ``batch_tokens`` tokens (a
    longer sequence alone)."""
    batch: list[int] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if batch and total + lengths[i] > batch_tokens:
            yield batch
            batch, total = [], 0
        batch.append(i)
        total += lengths[i]
    if batch:
        yield batch


@torch.inference_mode()
def compute_features(
    target: nn.Module,
    sequences: Sequence[torch.Tensor],
    batch_tokens: int,
    feature_layers: Sequence[int] | None = None,
    starts: Sequence[int] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """The target's features at every position of every sequence, from whole-sequence forwards with
    :class:`~specdec.attention.dense.DenseAttention` (no KV cache), as bfloat16 tensors on the CPU.

    Returns:
        ``(features, top_tokens)``: without ``feature_layers``, per sequence ``[L, H]`` final-norm hidden
        states and None; with them, per sequence ``[L, (n + 1) H]`` (the streams entering the ``n``
        layers, then the final-norm hidden state) and ``[L]`` int32 the target's top token after each
        position (the argmax of its logits), computed only from position ``starts[i] - 1`` on when
        ``starts`` (the response starts) are given, -1 before (the LM head over every prompt row would
        cost a third of the forward).
    """
    from specdec.attention.dense import DenseAttention, dense_metadata

    device = next(target.parameters()).device
    attention = DenseAttention()
    num_layers = len(target.layers)  # type: ignore[arg-type]
    layers = tuple(feature_layers or ())
    out: list[torch.Tensor | None] = [None] * len(sequences)
    tops: list[torch.Tensor | None] = [None] * len(sequences)
    t0 = last_log = time.perf_counter()
    done = 0
    previous = target.feature_layers  # type: ignore[attr-defined]
    target.set_feature_layers(layers)  # type: ignore[operator]
    try:
        for batch in _dense_forward_batches([len(s) for s in sequences], batch_tokens):
            lens = [len(sequences[i]) for i in batch]
            ids = torch.cat([sequences[i] for i in batch]).to(device)
            positions = torch.cat([torch.arange(n) for n in lens]).to(device)
            meta = dense_metadata(lens, device)
            caches = [(None, None)] * num_layers
            if layers:
                hidden, aux = target.layer_stack(ids, positions, caches, meta, attention)  # type: ignore[operator]
                final = target.norm(hidden)  # type: ignore[operator]
                feats = torch.cat([aux, final], dim=-1)
                first = [max((starts[i] if starts is not None else 0) - 1, 0) for i in batch]
                offsets = [sum(lens[:j]) for j in range(len(lens))]
                wanted = torch.cat([torch.arange(o + f, o + n) for o, f, n in zip(offsets, first, lens)])
                rows = final[wanted.to(device)]
                top = torch.full((len(ids),), -1, dtype=torch.int64)
                top[wanted] = torch.cat([target.logits(r).argmax(-1) for r in rows.split(1024)]).cpu()  # type: ignore[operator]
                for i, t in zip(batch, top.split(lens)):
                    tops[i] = t.to(torch.int32).clone()
            else:
                _, feats = target(
                    ids,
                    positions,
                    caches,
                    meta,
                    attention,
                    logits_indices=torch.zeros(1, dtype=torch.int64, device=device),  # no LM head per row
                    all_hidden=True,
                )
            for i, h in zip(batch, feats.split(lens)):
                out[i] = h.to(torch.bfloat16).cpu().clone()
            done += sum(lens)
            now = time.perf_counter()
            if now - last_log > 30:
                last_log = now
                logger.info("features: %d tokens in %.0f s", done, now - t0)
    finally:
        target.set_feature_layers(previous)  # type: ignore[operator]
    features = [h for h in out if h is not None]
    return features, ([t for t in tops if t is not None] if layers else None)


def featurise(
    model_dir: Path,
    dtype: str,
    device: str,
    sequences: Sequence[torch.Tensor],
    batch_tokens: int,
    feature_layers: Sequence[int] | None = None,
    starts: Sequence[int] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """:func:`compute_features` of the target in ``model_dir``, loaded for the purpose and freed after."""
    from specdec.models.loader import load_model

    target = load_model(model_dir, _torch_dtype(dtype), device)
    features = compute_features(target, sequences, batch_tokens, feature_layers, starts)
    del target
    gc.collect()
    return features
