"""KV cache manager: block tables, slot reservation, prefix-cache lookups, rollback, and the release of
KV a sliding window can no longer reach.

The scheduler talks to the cache only through this class; the model sees only the resulting block
tables and slot mappings.

Sliding windows (``KVCacheManager(sliding_window=W)``, set by the engine only when *every* layer of the
target attends within a window of W positions and no drafter keeps KV of its own on the target's block
tables, see :func:`specdec.engine.build.release_window`): a query at position p reads keys in
``(p - W, p]``, and the queries of a step start at the request's first uncomputed position
``num_computed_tokens`` (chunks, decode tokens, draft chains and token trees alike; rollback never goes
below it). So before each step, :meth:`KVCacheManager.allocate_slots` releases the request's blocks that
lie wholly before ``num_computed_tokens - W + 1``: their table entries become :data:`RELEASED` (the
table keeps its indexing by position, so slot mapping is unchanged) and the pool drops one reference (a
block another request shares, or a prefix-cached block, stays valid: it keeps its hash in the free
queue until reused). The model runner passes released entries to the attention as block 0, which no
backend dereferences outside a mask: the CPU kernel and the reference's prefill and single-row paths
start at the first block inside the window; the reference's padded short batch and the Triton kernel's
first key tile may gather such an entry and mask it (block 0 holds finite values: the caches start
zeroed). Models with some global layer (Gemma 2/3 as released) release nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.kv_cache.block_pool import ROOT_HASH, BlockPool, hash_block_tokens
from specdec.request import Request

#: Block-table entry of a block released because no later query of the request can attend to it (a
#: sliding window passed it). Released entries always form a prefix of ``Request.block_ids``.
RELEASED = -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the block pool and every request's block table.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block (>= 1).
        enable_prefix_caching: reuse full blocks of earlier requests with the same prefix.
        sliding_window: release the blocks wholly before the window of a request's next query (see the
            module docstring); only for a model whose every layer is windowed, with nothing else reading
            the request's earlier KV. None: keep every block until the request ends.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks)
        #: Prompt tokens served from the prefix cache, counted once per admission.
        self.num_prefix_hits = 0
        #: Blocks released behind sliding windows (table entries of running requests, and prefix-cache
        #: hits admitted already outside the window), in total.
        self.num_released_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """Chained hashes of the request's first ``num_full_blocks`` blocks (computed once, then kept)."""
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block_tokens(parent, request.token_ids[i * bs : (i + 1) * bs]))
        return hashes[:num_full_blocks]

    def num_dead_blocks(self, first_query_position: int) -> int:
        """Leading blocks of a table that no query at ``first_query_position`` or later can read: those
        wholly before its window (0 without a sliding window)."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query_position - self.sliding_window + 1) // self.block_size

    def num_live_blocks(self, request: Request) -> int:
        """Blocks the request holds (its table entries not released)."""
        return len(request.block_ids) - request.num_released_blocks

    def release_outside_window(self, request: Request) -> int:
        """Release the request's blocks that lie wholly before the window of its next query (at
        ``num_computed_tokens``): their entries become :data:`RELEASED` and the pool drops one
        reference to each. Returns how many were released now (0 without a sliding window).

        Only safe when no query of the request will ever sit below ``num_computed_tokens``: the
        scheduler's steps (their queries start there; rollback removes only this step's drafts)."""
        dead = min(self.num_dead_blocks(request.num_computed_tokens), len(request.block_ids))
        start = request.num_released_blocks
        if dead <= start:
            return 0
        ids = request.block_ids[start:dead]
        request.block_ids[start:dead] = [RELEASED] * (dead - start)
        request.num_released_blocks = dead
        self.pool.free(ids[::-1])  # the later ones reused first, the (more shareable) earlier kept longer
        self.num_released_blocks += dead - start
        return dead - start

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Longest run of cached blocks matching the request's leading tokens (no references taken).

        At least one token is always left to compute, so the hit covers at most
        ``(num_tokens - 1) // block_size`` blocks and the forward has a row to sample from.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._block_hashes(request, max_blocks):
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        new_computed_blocks: Sequence[int] = (),
    ) -> bool:
        """Make the block table cover the KV this step writes, or change nothing and return False.

        The table must cover ``num_computed_tokens`` (+ the prefix hit ``new_computed_blocks``, which
        becomes computed) + ``num_new_tokens`` + ``num_lookahead_tokens`` (slots reserved for draft
        tokens, see the speculative decoding drafters).

        Under a sliding window, blocks before the window of the step's first query are released first
        (:meth:`release_outside_window`; also when False is returned: they are dead either way), and
        prefix-cache hits already outside it are entered as :data:`RELEASED` without being revived.

        Returns:
            False when the free blocks do not suffice (the scheduler then preempts).
        """
        bs = self.block_size
        self.release_outside_window(request)
        num_hit_tokens = len(new_computed_blocks) * bs
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens + num_lookahead_tokens
        num_needed = cdiv(total, bs) - len(request.block_ids) - len(new_computed_blocks)
        # Hits wholly before the first query's window (admission has no other blocks) are not taken.
        num_dead_hits = 0
        if new_computed_blocks and not request.block_ids:
            num_dead_hits = min(self.num_dead_blocks(num_hit_tokens), len(new_computed_blocks))
        live_hits = list(new_computed_blocks[num_dead_hits:])
        num_revived = sum(1 for b in live_hits if self.pool.blocks[b].ref_count == 0)
        if num_needed + num_revived > self.pool.num_free_blocks:
            return False
        if new_computed_blocks:
            self.pool.touch(live_hits)
            request.block_ids.extend([RELEASED] * num_dead_hits + live_hits)
            request.num_released_blocks = num_dead_hits
            self.num_released_blocks += num_dead_hits
            request.num_computed_tokens += num_hit_tokens
            request.num_cached_blocks = len(request.block_ids)
            request.stats.num_cached_prompt_tokens = num_hit_tokens
            self.num_prefix_hits += num_hit_tokens
        if num_needed > 0:
            request.block_ids.extend(self.pool.allocate(num_needed))
        return True

    def slot(self, request: Request, position: int) -> int:
        """Cache slot of the token at ``position`` of the request's sequence.

        Raises:
            RuntimeError: the position's block was released (behind a sliding window).
        """
        block = request.block_ids[position // self.block_size]
        if block == RELEASED:
            raise RuntimeError(f"position {position} of {request.request_id!r} lies in a released block")
        return block * self.block_size + position % self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full blocks of committed tokens in the prefix cache (released entries,
        which the request no longer holds, are skipped): blocks whose tokens all have their K/V computed
        and are in ``token_ids`` (a request that stops on an accepted draft has K/V past its last token)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(request.num_cached_blocks, num_full):
            if request.block_ids[i] != RELEASED:
                self.pool.cache_block(request.block_ids[i], hashes[i])
        request.num_cached_blocks = num_full

    def rollback(self, request: Request, num_slots: int) -> None:
        """Forget the KV of the request's last ``num_slots`` computed tokens (rejected drafts) and free
        the blocks no longer needed. Cached (hashed) blocks are never rolled back into."""
        if num_slots < 0 or num_slots > request.num_computed_tokens:
            raise ValueError(f"cannot roll back {num_slots} of {request.num_computed_tokens} slots")
        if request.num_computed_tokens - num_slots < request.num_cached_blocks * self.block_size:
            raise RuntimeError("rollback into a prefix-cached block")
        request.num_computed_tokens -= num_slots
        self.trim(request, request.num_computed_tokens)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks beyond those needed for ``num_tokens`` tokens (lookahead release)."""
        keep = max(cdiv(num_tokens, self.block_size), request.num_released_blocks)
        if keep < len(request.block_ids):
            extra = request.block_ids[keep:]
            del request.block_ids[keep:]
            self.pool.free(extra[::-1])

    def free(self, request: Request) -> None:
        """Release every block the request holds (finish, abort or preemption); released entries were
        given back already and are not freed again."""
        self.pool.free(request.block_ids[request.num_released_blocks :][::-1])
        request.block_ids = []
        request.num_released_blocks = 0
        request.num_cached_blocks = 0
        request.num_computed_tokens = 0

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]]:
        """Give ``child`` the KV of ``parent``'s computed tokens (a beam continuing another beam).

        The child's block table references the parent's full blocks (reference counts incremented; full
        blocks are never written again, so sharing them is safe). The partly filled last block, if any, is
        copy-on-write: the child gets a fresh block, and the caller must copy the K/V of the returned
        ``(src_block_id, dst_block_id)`` pair in every layer (``ModelRunner.copy_blocks``) before the next
        forward writes into either block. The child's ``num_computed_tokens`` becomes the parent's; its
        ``token_ids`` are the caller's to set (the parent's committed tokens, then its own).

        Args:
            parent: a sequence whose first ``num_computed_tokens`` tokens have K/V in its block table.
            child: a sequence holding no blocks.

        Returns:
            The blocks to copy: ``[]`` when the parent's computed tokens end on a block boundary, else one
            ``(parent's last block, child's new last block)`` pair.

        Raises:
            ValueError: the child already holds blocks.
            RuntimeError: no free block for the copy (callers reserve capacity first).
        """
        if child.block_ids:
            raise ValueError(f"fork into a sequence that already holds {len(child.block_ids)} blocks")
        bs = self.block_size
        num_computed = parent.num_computed_tokens
        num_full, partial = divmod(num_computed, bs)
        shared = parent.block_ids[:num_full]
        if partial and self.pool.num_free_blocks < 1:
            raise RuntimeError("no free KV block for the copy-on-write of a forked partial block")
        num_released = min(parent.num_released_blocks, num_full)
        self.pool.touch(shared[num_released:])  # released entries stay released in the child
        child.block_ids = list(shared)
        child.num_released_blocks = num_released
        copies: list[tuple[int, int]] = []
        if partial:
            (dst,) = self.pool.allocate(1)
            child.block_ids.append(dst)
            copies.append((parent.block_ids[num_full], dst))
        child.num_computed_tokens = num_computed
        child.block_hashes = parent.block_hashes[:num_full]
        child.num_cached_blocks = min(parent.num_cached_blocks, num_full)
        return copies
