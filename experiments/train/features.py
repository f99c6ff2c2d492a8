"""The target's features: the final-norm hidden state ``f_t`` at every position of prompt + response,
from whole-sequence forwards of our decoder with :class:`~specdec.attention.dense.DenseAttention` and
``all_hidden=True`` (no KV cache), kept as bfloat16."""

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
    target: nn.Module, sequences: Sequence[torch.Tensor], batch_tokens: int
) -> list[torch.Tensor]:
    """The target's feature (final-norm hidden state) at every position of every sequence, from whole-
    sequence forwards with :class:`~specdec.attention.dense.DenseAttention` (no KV cache), as bfloat16
    ``[L, H]`` tensors on the CPU."""
    from specdec.attention.dense import DenseAttention, dense_metadata

    device = next(target.parameters()).device
    attention = DenseAttention()
    num_layers = len(target.layers)  # type: ignore[arg-type]
    out: list[torch.Tensor | None] = [None] * len(sequences)
    t0 = last_log = time.perf_counter()
    done = 0
    for batch in _dense_forward_batches([len(s) for s in sequences], batch_tokens):
        lens = [len(sequences[i]) for i in batch]
        ids = torch.cat([sequences[i] for i in batch]).to(device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(device)
        _, hidden = target(
            ids,
            positions,
            [(None, None)] * num_layers,
            dense_metadata(lens, device),
            attention,
            logits_indices=torch.zeros(1, dtype=torch.int64, device=device),  # no LM head over every row
            all_hidden=True,
        )
        for i, h in zip(batch, hidden.split(lens)):
            out[i] = h.to(torch.bfloat16).cpu().clone()
        done += sum(lens)
        now = time.perf_counter()
        if now - last_log > 30:
            last_log = now
            logger.info("features: %d tokens in %.0f s", done, now - t0)
    return [h for h in out if h is not None]


def featurise(
    model_dir: Path, dtype: str, device: str, sequences: Sequence[torch.Tensor], batch_tokens: int
) -> list[torch.Tensor]:
    """:func:`compute_features` of the target in ``model_dir``, loaded for the purpose and freed after."""
    from specdec.models.loader import load_model

    target = load_model(model_dir, _torch_dtype(dtype), device)
    features = compute_features(target, sequences, batch_tokens)
    del target
    gc.collect()
    return features
