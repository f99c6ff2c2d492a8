"""Random inputs for the kernel tests (``tests/kernels``) and the GPU script (:mod:`experiments.bench_gpu`).

Inputs are random (never zeros) and generated on the CPU from a seed, then moved, so a CUDA run and an
interpreter run see the same numbers. Cache slots that no request owns (block tails past a sequence's
end, spare blocks, the padding of block tables) hold ``poison`` so that a kernel reading them shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata


@dataclass
class PagedBatch:
    """A flattened batch over a paged KV cache (see :class:`~kernels.attention_metadata.AttentionMetadata`).

    ``key``/``value`` are the new tokens' K/V; they are in the cache already when the batch was made
    with ``write_new=True``, else their slots hold the poison.
    """

    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KVH, D]
    value: torch.Tensor  # [T, KVH, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [B + 1] int64
    seq_lens: torch.Tensor  # [B] int64
    block_table: torch.Tensor  # [B, max_blocks] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: list[int]
    seq_lens_host: list[int]
    new_token_masks: list[torch.Tensor | None] | None

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            slot_mapping=self.slot_mapping,
            block_table=self.block_table,
            query_lens=list(self.query_lens),
            seq_lens_host=list(self.seq_lens_host),
            new_token_masks=self.new_token_masks,
        )


def random_tree_mask(n: int, generator: torch.Generator) -> torch.Tensor:
    """``[n, n]`` bool attention mask of a random token tree in topological order: node ``i > 0`` hangs
    under a random earlier node and sees itself and its ancestors; node 0 (the root) sees itself."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        parent = int(torch.randint(0, i, (1,), generator=generator))
        mask[i] |= mask[parent]
    return mask


def make_paged_batch(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    new_token_masks: list[torch.Tensor | None] | None = None,
    write_new: bool = True,
    poison: float = float("nan"),
    spare_blocks: int = 2,
) -> PagedBatch:
    """A random batch of ``seqs`` = ``[(query_len, context_len), ...]`` over shuffled cache blocks.

    Args:
        new_token_masks: per request None (causal) or a ``[q, q]`` bool mask, or None for all causal.
        write_new: also store the new tokens' K/V in the cache (for the attention kernel alone).
        poison: value of every slot no request owns, and of the new tokens' slots when not written.
        spare_blocks: unowned blocks; the block tables are padded with the first of them.
    """
    g = torch.Generator().manual_seed(seed)
    query_lens = [q for q, _ in seqs]
    seq_lens = [q + c for q, c in seqs]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    pad_block = int(perm[-1]) if spare_blocks else 0
    max_blocks = max(needed, default=1)
    block_table = torch.full((len(seqs), max_blocks), pad_block, dtype=torch.int64)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, poison, dtype=torch.float32)
    v_cache = torch.full(shape, poison, dtype=torch.float32)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    slot_mapping = torch.empty(num_tokens, dtype=torch.int64)
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    used, row = 0, 0
    for b, ((q_len, ctx), seq_len) in enumerate(zip(seqs, seq_lens)):
        blocks = perm[used : used + needed[b]]
        used += needed[b]
        block_table[b, : needed[b]] = blocks
        pos = torch.arange(seq_len)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        flat_k[slots[:ctx]] = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        flat_v[slots[:ctx]] = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        slot_mapping[row : row + q_len] = slots[ctx:]
        if write_new:
            flat_k[slots[ctx:]] = key[row : row + q_len]
            flat_v[slots[ctx:]] = value[row : row + q_len]
        row += q_len
    qsl = torch.tensor([0, *torch.tensor(query_lens, dtype=torch.int64).cumsum(0).tolist()])

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    return PagedBatch(
        query=to(query),
        key=to(key),
        value=to(value),
        k_cache=to(k_cache),
        v_cache=to(v_cache),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        block_table=block_table.to(device),
        slot_mapping=slot_mapping.to(device),
        query_lens=query_lens,
        seq_lens_host=seq_lens,
        new_token_masks=None
        if new_token_masks is None
        else [None if m is None else m.to(device) for m in new_token_masks],
    )


def random_probs(rows: int, vocab: int, generator: torch.Generator, sharpness: float = 3.0) -> torch.Tensor:
    """``[rows, vocab]`` float32 rows of softmax(sharpness × N(0, 1)): random, peaked, no zeros."""
    return torch.softmax(torch.randn(rows, vocab, generator=generator) * sharpness, dim=-1)


@dataclass
class RejectionBatch:
    """Inputs of :func:`kernels.rejection_sample.rejection_sample`, CPU tensors."""

    draft_token_ids: torch.Tensor
    cu_num_draft_tokens: torch.Tensor
    draft_probs: torch.Tensor | None
    target_probs: torch.Tensor
    uniforms: torch.Tensor
    noise: torch.Tensor
    is_greedy: torch.Tensor
    max_spec_len: int

    def args(self, device: torch.device | str = "cpu") -> tuple:
        dp = None if self.draft_probs is None else self.draft_probs.to(device)
        return (
            self.draft_token_ids.to(device),
            self.cu_num_draft_tokens.to(device),
            dp,
            self.target_probs.to(device),
            self.uniforms.to(device),
            self.noise.to(device),
            self.is_greedy.to(device),
            self.max_spec_len,
        )


def make_rejection_batch(
    counts: list[int],
    vocab: int,
    seed: int = 0,
    with_draft_probs: bool = True,
    greedy: list[bool] | None = None,
    max_spec_len: int | None = None,
) -> RejectionBatch:
    """A batch whose requests cover the interesting cases, by request index ``i % 5``:

    0. draft distribution = target (every draft accepted, then a bonus token);
    1. target = draft mixed with noise (some drafts accepted, then a recovered token);
    2. unrelated random distributions (the first draft usually rejected);
    3. target = draft / 2 (not normalised: the residual is all zero, so a rejection falls back to the
       target row);
    4. target rows with their maximum repeated in several blocks of the vocabulary (argmax ties).

    Greedy requests (``greedy[i]``) get drafts equal to their rows' argmax for the first half.
    """
    g = torch.Generator().manual_seed(seed)
    num_reqs, num_drafts = len(counts), sum(counts)
    greedy = greedy if greedy is not None else [i % 3 == 2 for i in range(num_reqs)]
    draft = random_probs(num_drafts, vocab, g)
    target = random_probs(num_drafts + num_reqs, vocab, g)
    ids = torch.multinomial(draft, 1, generator=g).squeeze(1)
    d = t = 0
    for i, m in enumerate(counts):
        rows = slice(t, t + m)
        case = i % 5
        if case == 0:
            target[rows] = draft[d : d + m]
        elif case == 1:
            target[rows] = 0.7 * draft[d : d + m] + 0.3 * target[rows]
        elif case == 3:
            target[rows] = draft[d : d + m] / 2
        elif case == 4:
            peak = target[t : t + m + 1].max() * 2
            for r in range(t, t + m + 1):
                target[r, [vocab - 1, 3, vocab // 2]] = peak  # ties: index 3 comes first
        if greedy[i]:
            am = target[rows].argmax(-1)
            half = (m + 1) // 2
            ids[d : d + half] = am[:half]
        d += m
        t += m + 1
    cu = torch.tensor([0, *torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist()])
    return RejectionBatch(
        draft_token_ids=ids,
        cu_num_draft_tokens=cu,
        draft_probs=draft if with_draft_probs else None,
        target_probs=target,
        uniforms=torch.rand(num_drafts, generator=g),
        noise=torch.empty(num_reqs, vocab).exponential_(generator=g),
        is_greedy=torch.tensor(greedy, dtype=torch.bool),
        max_spec_len=max_spec_len if max_spec_len is not None else max(counts, default=0),
    )
