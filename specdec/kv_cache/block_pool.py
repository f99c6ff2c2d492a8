"""The block pool: fixed-size KV blocks with reference counts, a free queue and a prefix-hash map.

A *block* holds the K/V of ``block_size`` consecutive tokens of one sequence, in every layer. Blocks are
shared between sequences by reference count (prefix caching, later beam search). A block whose count
drops to zero goes to the tail of the free queue but keeps its contents and hash, so a later request with
the same prefix can revive it; blocks are taken for reuse from the head of the queue (least recently
freed first), and only then is their hash forgotten.

The design follows vLLM v1 (``vllm/v1/core/block_pool.py``) and nano-vllm's block manager.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Hash of the (empty) parent of a sequence's first block.
ROOT_HASH = b"specdec-root"


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: sha256 over the parent block's hash and this block's token ids.

    Chaining makes equal token blocks under different prefixes hash differently, so a prefix-cache hit
    means the whole prefix up to and including this block is equal.
    """
    h = hashlib.sha256(parent_hash)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


@dataclass
class KVBlock:
    """One KV block. ``ref_count`` is the number of block tables holding it."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """All KV blocks of the cache, with reference counts, an LRU free queue and the prefix-hash map.

    Args:
        num_blocks: blocks in the pool (>= 1).

    Invariants (tested in ``tests/test_block_pool.py``): a block is in the free queue iff its
    ``ref_count`` is 0; a hash maps to exactly one block and that block carries the hash.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free queue: insertion-ordered set of block ids; head = next to reuse.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count 0 (some may still hold a cached prefix)."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, forgetting any cached hash they held.

        Raises:
            ValueError: fewer than ``n`` free blocks (callers check ``num_free_blocks`` first).
        """
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, only {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._hash_to_block[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def lookup(self, block_hash: bytes) -> int | None:
        """The block caching this chained hash, if any (whether in use or free)."""
        return self._hash_to_block.get(block_hash)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (a prefix-cache hit), reviving free ones."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue's tail.

        Pass a sequence's blocks in reverse order so that its tail blocks are reused first and its
        (more shareable) prefix blocks stay cached longest.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than it was allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full, committed block under its chained hash (first writer wins)."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        if block_hash in self._hash_to_block:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        self._hash_to_block[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        for block in self.blocks:
            block.block_hash = None
        self._hash_to_block.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (for tests and debugging)."""
        for block in self.blocks:
            assert block.ref_count >= 0, block
            assert (block.ref_count == 0) == (block.block_id in self._free), block
            if block.block_hash is not None:
                assert self._hash_to_block.get(block.block_hash) == block.block_id, block
        for h, block_id in self._hash_to_block.items():
            assert self.blocks[block_id].block_hash == h
