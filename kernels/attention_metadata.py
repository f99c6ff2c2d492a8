"""Attention metadata for a flattened variable-length batch: what the paged attention kernels and their
torch references read.

One forward mixes prefill chunks, decode tokens and draft verification segments: the new tokens of every
scheduled request are concatenated into one ``[num_tokens]`` axis. Request ``b`` owns rows
``query_start_loc[b]:query_start_loc[b + 1]``; after this forward its sequence holds ``seq_lens[b]``
tokens of KV, the last ``query_len = seq_lens[b] - context_len`` of which are the new ones.

The K/V of token ``t`` is written into the paged cache at ``slot_mapping[t]`` (block id × block size +
offset in block); slot mapping is the only interface between the model and the cache.

Defined here, in the lowest package that reads it (see ``docs/layers.md``);
:mod:`specdec.attention.base` re-exports it beside the attention backend Protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["AttentionMetadata"]


@dataclass
class AttentionMetadata:
    """Flattened batch metadata. Shapes use B = scheduled requests, T = new tokens in the batch.

    Attributes:
        query_start_loc: ``[B + 1]`` int64, cumulative query lengths (0, len_0, len_0 + len_1, ...).
        seq_lens: ``[B]`` int64, tokens of KV each request has after this forward (context + new).
        slot_mapping: ``[T]`` int64, cache slot of each new token's K/V; -1 means do not write.
        block_table: ``[B, max_blocks]`` int64, the KV blocks of each request in order (padded with 0).
        query_lens: host copy of the query lengths, ``B`` ints.
        seq_lens_host: host copy of ``seq_lens``, ``B`` ints.
        new_token_masks: per request, ``None`` (causal among its new tokens) or a ``[query_len,
            query_len]`` bool tensor: ``mask[i, j]`` is True when new token ``i`` may attend to new token
            ``j`` (a token tree's attention mask). Every new token always sees the whole context.
        draft_lens: per request, how many of its new tokens (the last ones) are drafts being verified, or
            None (no drafts). The CPU and reference backends attend those rows as short queries apart
            from a long prefill chunk before them (when there are at most ``BATCHED_QUERY_MAX`` of them
            and each sees every earlier new token, as a chain's and a tree's do), so a verification
            row's bits do not depend on whether the drafts came with the prompt's last chunk or in a
            decode step.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_lens: list[int]
    seq_lens_host: list[int]
    new_token_masks: list[torch.Tensor | None] | None = None
    draft_lens: list[int] | None = None
    #: Backend-private values derived from the fields above, computed once per forward (not per layer).
    backend_cache: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)
