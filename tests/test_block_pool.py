"""The block pool and KV cache manager: unit tests, a stateful model check, and a scheduler property test.

The stateful test drives :class:`KVCacheManager` directly with a simulated KV cache (one token id per
slot), so beyond the pool's own bookkeeping it checks that every computed token of every live request
sits in its block table's slot, i.e. that prefix hits, sharing, eviction and rollback never hand a
request a block with the wrong contents or let one request overwrite another's KV.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sampling.params import SamplingParams
from specdec import LLM
from specdec.errors import InvalidRequestError
from specdec.kv_cache.block_pool import ROOT_HASH, BlockPool, hash_block_tokens
from specdec.kv_cache.manager import RELEASED, KVCacheManager, cdiv
from specdec.request import Request, RequestStatus

GREEDY = SamplingParams(temperature=0.0)


def make_request(rid: str, tokens: list[int], arrival: int = 0) -> Request:
    return Request(rid, tokens, GREEDY, arrival)


def compute(mgr: KVCacheManager, req: Request, n: int) -> None:
    """Pretend a forward wrote the KV of the next ``n`` tokens (slots must be allocated)."""
    req.num_computed_tokens += n
    mgr.cache_full_blocks(req)


def chain_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    hashes, parent = [], ROOT_HASH
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def pool_state(pool: BlockPool) -> tuple:
    return (
        [(b.ref_count, b.block_hash) for b in pool.blocks],
        list(pool._free),
        dict(pool._hash_to_block),
    )


# ------------------------------------------------------------------------------------------- unit tests
def test_chained_hash_depends_on_prefix():
    block = [7, 8, 9, 10]
    under_a = hash_block_tokens(hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]), block)
    under_b = hash_block_tokens(hash_block_tokens(ROOT_HASH, [5, 6, 7, 8]), block)
    assert under_a != under_b
    assert under_a == hash_block_tokens(hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]), list(block))
    assert hash_block_tokens(ROOT_HASH, block) not in (under_a, under_b)

    # Through the manager: b's first block is d's and its second equals a's second token for token, but
    # under a different prefix, so b hits d's block only; c shares a's first two blocks and hits both.
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 7, 8, 9, 10, 11])
    d = make_request("d", [5, 6, 7, 8, 0])
    for r in (a, d):
        assert mgr.allocate_slots(r, r.num_tokens)
        compute(mgr, r, r.num_tokens)
    assert (a.num_cached_blocks, d.num_cached_blocks) == (2, 1)
    b = make_request("b", [5, 6, 7, 8, 7, 8, 9, 10, 11])
    assert mgr.get_computed_blocks(b) == d.block_ids[:1]
    assert b.block_hashes[1] != a.block_hashes[1]
    c = make_request("c", [1, 2, 3, 4, 7, 8, 9, 10, 12])
    assert mgr.get_computed_blocks(c) == a.block_ids[:2]


def test_prefix_hit_revives_a_freed_block():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    pool = mgr.pool
    a = make_request("a", list(range(10, 19)))  # 9 tokens: 2 full blocks + 1
    assert mgr.get_computed_blocks(a) == []
    assert mgr.allocate_slots(a, 9)
    compute(mgr, a, 9)
    a_blocks = list(a.block_ids)
    assert len(a_blocks) == 3 and mgr.num_free_blocks == 5
    mgr.free(a)
    assert a.block_ids == [] and a.num_computed_tokens == 0
    assert mgr.num_free_blocks == 8
    assert all(pool.blocks[b].ref_count == 0 for b in a_blocks)
    # The freed full blocks keep their hashes; the partial third block has none.
    assert [pool.blocks[b].block_hash is not None for b in a_blocks] == [True, True, False]

    b = make_request("b", [*range(10, 18), 99, 98])
    hits = mgr.get_computed_blocks(b)
    assert hits == a_blocks[:2]
    assert mgr.allocate_slots(b, b.num_tokens - 8, new_computed_blocks=hits)
    assert b.block_ids[:2] == a_blocks[:2] and len(b.block_ids) == 3
    assert b.num_computed_tokens == 8 and b.num_cached_blocks == 2
    assert b.stats.num_cached_prompt_tokens == 8
    assert [pool.blocks[x].ref_count for x in b.block_ids] == [1, 1, 1]
    assert not set(b.block_ids) & set(pool._free)
    assert mgr.num_free_blocks == 5
    pool.check_invariants()

    # A second live sharer takes another reference instead of reviving.
    c = make_request("c", [*range(10, 18), 50])
    hits = mgr.get_computed_blocks(c)
    assert hits == a_blocks[:2]
    assert mgr.allocate_slots(c, 1, new_computed_blocks=hits)
    assert [pool.blocks[x].ref_count for x in a_blocks[:2]] == [2, 2]
    assert mgr.num_free_blocks == 4
    mgr.free(b)
    assert [pool.blocks[x].ref_count for x in a_blocks[:2]] == [1, 1]
    mgr.free(c)
    assert mgr.num_free_blocks == 8
    pool.check_invariants()


def test_allocation_takes_least_recently_freed_and_forgets_its_hash():
    pool = BlockPool(4)
    ids = pool.allocate(4)
    assert ids == [0, 1, 2, 3] and pool.num_free_blocks == 0
    hashes = {b: hash_block_tokens(ROOT_HASH, [b]) for b in ids}
    for b in ids:
        pool.cache_block(b, hashes[b])
    pool.free([2])
    pool.free([0])
    pool.free([3])
    assert list(pool._free) == [2, 0, 3]
    assert all(pool.lookup(hashes[b]) == b for b in ids)  # freed blocks stay cached

    assert pool.allocate(2) == [2, 0]
    assert pool.lookup(hashes[2]) is None and pool.lookup(hashes[0]) is None
    assert pool.blocks[2].block_hash is None and pool.blocks[0].block_hash is None
    assert pool.lookup(hashes[3]) == 3 and pool.lookup(hashes[1]) == 1
    assert [pool.blocks[b].ref_count for b in range(4)] == [1, 1, 1, 0]
    pool.check_invariants()

    with pytest.raises(ValueError, match="asked for 2 blocks, only 1 free"):
        pool.allocate(2)


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([b])


def test_manager_sequence_free_order_keeps_prefix_longest():
    """A request's blocks are freed tail first, so its prefix blocks are evicted last."""
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    assert mgr.allocate_slots(a, 7)
    compute(mgr, a, 7)
    blocks = list(a.block_ids)
    mgr.free(a)
    assert list(mgr.pool._free) == blocks[::-1]
    b = make_request("b", [9, 9, 9])
    assert mgr.allocate_slots(b, 3)
    assert b.block_ids == [blocks[3], blocks[2]]
    c = make_request("c", [1, 2, 3, 4, 8])
    assert mgr.get_computed_blocks(c) == blocks[:2]


def test_get_computed_blocks_leaves_one_token_to_compute():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(20, 28)))  # exactly 2 blocks
    assert mgr.allocate_slots(a, 8)
    compute(mgr, a, 8)
    a.token_ids.append(3)
    assert a.num_cached_blocks == 2

    same = make_request("same", list(range(20, 28)))
    hits = mgr.get_computed_blocks(same)
    assert hits == a.block_ids[:1]  # not both: the last token must run to give logits
    assert mgr.allocate_slots(same, same.num_tokens - 4, new_computed_blocks=hits)
    assert same.num_computed_tokens == 4 and same.num_computed_tokens < same.num_tokens

    longer = make_request("longer", [*range(20, 28), 3])
    assert mgr.get_computed_blocks(longer) == a.block_ids[:2]

    mgr1 = KVCacheManager(num_blocks=8, block_size=1)
    x = make_request("x", [5, 6, 7])
    assert mgr1.allocate_slots(x, 3)
    compute(mgr1, x, 3)
    assert mgr1.get_computed_blocks(make_request("y", [5, 6, 7])) == x.block_ids[:2]
    assert mgr1.get_computed_blocks(make_request("z", [5])) == []

    # A request that already has computed tokens (running) never looks up the cache.
    assert mgr.get_computed_blocks(a) == []
    off = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    p = make_request("p", list(range(20, 29)))
    assert off.allocate_slots(p, 9)
    compute(off, p, 9)
    assert p.num_cached_blocks == 0
    assert off.get_computed_blocks(make_request("q", list(range(20, 29)))) == []


def test_rollback_frees_trailing_blocks():
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    pool = mgr.pool
    r = make_request("r", [1, 2, 3, 4, 5])
    assert mgr.allocate_slots(r, 5, num_lookahead_tokens=6)  # 11 slots: 3 blocks
    assert len(r.block_ids) == 3 and mgr.num_free_blocks == 3
    blocks = list(r.block_ids)
    r.token_ids.extend([6, 7, 8, 9, 10, 11])
    r.num_computed_tokens = 11
    mgr.rollback(r, 6)
    assert r.num_computed_tokens == 5
    assert r.block_ids == blocks[:2]
    assert pool.blocks[blocks[2]].ref_count == 0 and list(pool._free)[-1] == blocks[2]
    assert mgr.num_free_blocks == 4
    mgr.rollback(r, 1)  # down to 4 tokens: one block
    assert r.block_ids == blocks[:1] and mgr.num_free_blocks == 5
    mgr.rollback(r, 0)
    assert r.block_ids == blocks[:1] and r.num_computed_tokens == 4
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="cannot roll back"):
            mgr.rollback(r, bad)
    assert r.num_computed_tokens == 4
    pool.check_invariants()

    # trim releases unused lookahead without touching computed tokens.
    assert mgr.allocate_slots(r, 1, num_lookahead_tokens=7)  # 12 slots
    assert len(r.block_ids) == 3
    mgr.trim(r, 5)
    assert len(r.block_ids) == 2 and r.num_computed_tokens == 4
    pool.check_invariants()


def test_rollback_into_a_cached_block_raises_and_changes_nothing():
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    r = make_request("r", list(range(30, 39)))  # 9 tokens
    assert mgr.allocate_slots(r, 9)
    compute(mgr, r, 9)
    assert r.num_cached_blocks == 2
    mgr.rollback(r, 1)  # 8 computed: exactly the cached blocks, allowed
    assert r.num_computed_tokens == 8 and len(r.block_ids) == 2
    before = (r.num_computed_tokens, list(r.block_ids), pool_state(mgr.pool))
    with pytest.raises(RuntimeError, match="prefix-cached block"):
        mgr.rollback(r, 1)
    assert (r.num_computed_tokens, list(r.block_ids), pool_state(mgr.pool)) == before


def test_allocate_slots_failure_changes_nothing():
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert mgr.allocate_slots(a, 4)
    compute(mgr, a, 4)
    mgr.free(a)
    b = make_request("b", [1, 2, 3, 4, 9, 9, 9, 9])
    hits = mgr.get_computed_blocks(b)
    assert len(hits) == 2
    before = pool_state(mgr.pool)
    # 2 revived + 2 new blocks > 3 free blocks.
    assert not mgr.allocate_slots(b, 4, new_computed_blocks=hits)
    assert pool_state(mgr.pool) == before
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.num_cached_blocks == 0
    assert mgr.allocate_slots(b, 1, new_computed_blocks=hits)
    assert b.num_computed_tokens == 4 and len(b.block_ids) == 3


def test_sliding_window_releases_blocks_behind_it():
    """Window 5, blocks of 2: a query at position p reads keys p - 4 .. p, so the blocks wholly before
    p - 4 are released (entries RELEASED, one reference dropped, the hash kept for prefix hits); a later
    request with the same prefix takes only the hits inside its window; fork, rollback and free never
    free a released block twice."""
    mgr = KVCacheManager(num_blocks=8, block_size=2, sliding_window=5)
    a = make_request("a", list(range(10, 22)))  # 12 tokens, 6 blocks
    assert mgr.allocate_slots(a, 12)
    compute(mgr, a, 12)
    held = list(a.block_ids)
    a.token_ids.append(99)
    assert mgr.allocate_slots(a, 1)  # query at 12 reads 8..12: blocks 0-3 (positions 0-7) released
    assert a.block_ids[:4] == [RELEASED] * 4 and a.block_ids[4:6] == held[4:]
    assert mgr.num_live_blocks(a) == 3 and mgr.num_released_blocks == 4 and mgr.num_free_blocks == 5
    assert all(mgr.pool.blocks[b].ref_count == 0 and mgr.pool.blocks[b].block_hash for b in held[:4])
    with pytest.raises(RuntimeError, match="released"):
        mgr.slot(a, 7)
    mgr.pool.check_invariants()
    compute(mgr, a, 1)
    mgr.cache_full_blocks(a)
    # Same 8-token prefix: 4 cached hits, of which the 2 before position 8's window stay released.
    b = make_request("b", list(range(10, 18)) + [50, 51])
    hits = mgr.get_computed_blocks(b)
    assert hits == held[:4]
    assert mgr.allocate_slots(b, 2, new_computed_blocks=hits)
    assert b.block_ids[:4] == [RELEASED, RELEASED, *held[2:4]] and b.num_released_blocks == 2
    assert [mgr.pool.blocks[x].ref_count for x in held[:4]] == [0, 0, 1, 1]
    assert b.num_computed_tokens == 8 and b.stats.num_cached_prompt_tokens == 8
    compute(mgr, b, 2)
    c = make_request("c", [])
    assert mgr.fork(b, c) == [] and c.num_released_blocks == 2 and c.block_ids == b.block_ids
    mgr.rollback(c, 0)
    mgr.pool.check_invariants()
    for r in (c, b, a):
        mgr.free(r)
        mgr.pool.check_invariants()
    assert mgr.num_free_blocks == 8


# ------------------------------------------------------------------------------ stateful model check
#: What the stateful runs exercised, summed over all examples (checked after the run).
COVERAGE: Counter[str] = Counter()
ALPHABET = st.integers(0, 2)


class KVCacheMachine(RuleBasedStateMachine):
    """Random arrivals, chunked steps, speculative rollbacks, preemptions, finishes and aborts; with or
    without a sliding window (blocks behind it released, see ``KVCacheManager.release_outside_window``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr: KVCacheManager | None = None
        self.live: dict[str, Request] = {}
        self.preempted: dict[str, Request] = {}  # freed, waiting to be recomputed
        self.history: list[list[int]] = []
        self.slots: dict[tuple[int, int], int] = {}  # simulated KV: (block, offset) -> token id
        self.next_id = 0

    # ------------------------------------------------------------------ helpers
    @property
    def bs(self) -> int:
        assert self.mgr is not None
        return self.mgr.block_size

    def _pick(self, data) -> Request:
        return self.live[data.draw(st.sampled_from(sorted(self.live)), label="request")]

    def _write(self, req: Request, start: int, stop: int) -> None:
        """The forward writes the KV of positions [start, stop) into the request's slots."""
        assert self.mgr is not None
        bs = self.bs
        for p in range(start, stop):
            assert req.block_ids[p // bs] != RELEASED, (req, p)
            block = self.mgr.pool.blocks[req.block_ids[p // bs]]
            # Writes go only to private, unhashed blocks: never into KV another request may read.
            assert block.ref_count == 1, (req, p, block)
            assert block.block_hash is None, (req, p, block)
            self.slots[(block.block_id, p % bs)] = req.token_ids[p]

    def _advance(self, req: Request, n: int, token: int) -> None:
        assert self.mgr is not None
        self._write(req, req.num_computed_tokens, req.num_computed_tokens + n)
        req.num_computed_tokens += n
        self.mgr.cache_full_blocks(req)
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(token)  # "sampled"

    def _admit(self, req: Request, chunk: int, token: int) -> bool:
        """Prefix lookup + allocation of a waiting request, as the scheduler does it."""
        mgr = self.mgr
        assert mgr is not None
        assert req.num_computed_tokens == 0 and req.block_ids == []
        hits = mgr.get_computed_blocks(req)
        assert len(hits) * self.bs < req.num_tokens
        assert hits == [mgr.pool.lookup(h) for h in chain_hashes(req.token_ids, self.bs)[: len(hits)]]
        n = min(chunk, req.num_tokens - len(hits) * self.bs)
        revived = sum(1 for b in hits if mgr.pool.blocks[b].ref_count == 0)
        cached_before = len(mgr.pool._hash_to_block)
        before = pool_state(mgr.pool)
        if not mgr.allocate_slots(req, n, new_computed_blocks=hits):
            assert pool_state(mgr.pool) == before
            assert req.block_ids == [] and req.num_computed_tokens == 0
            COVERAGE["admission refused"] += 1
            return False
        if len(mgr.pool._hash_to_block) < cached_before:
            COVERAGE["cached block evicted"] += 1
        if hits:
            COVERAGE["prefix hit"] += 1
            if req.num_released_blocks:
                COVERAGE["hit outside the window not taken"] += 1
            if revived:
                COVERAGE["freed block revived"] += 1
            if any(mgr.pool.blocks[b].ref_count > 1 for b in hits):
                COVERAGE["block shared by live requests"] += 1
        assert req.num_computed_tokens == len(hits) * self.bs
        self._advance(req, n, token)
        self.live[req.request_id] = req
        return True

    def _release(self, req: Request) -> None:
        assert self.mgr is not None
        self.mgr.free(req)
        assert req.block_ids == [] and req.num_computed_tokens == 0
        del self.live[req.request_id]
        self.history.append(list(req.token_ids))

    # -------------------------------------------------------------------- rules
    @initialize(
        num_blocks=st.integers(2, 12), block_size=st.integers(1, 4), window=st.none() | st.integers(1, 6)
    )
    def setup(self, num_blocks: int, block_size: int, window: int | None) -> None:
        self.mgr = KVCacheManager(num_blocks, block_size, sliding_window=window)

    def _release_behind_window(self, req: Request) -> None:
        """What ``allocate_slots`` does first (also when it then refuses): release the blocks behind the
        window of the request's next query."""
        assert self.mgr is not None
        if self.mgr.release_outside_window(req):
            COVERAGE["released behind the window"] += 1

    @rule(
        data=st.data(),
        extra=st.lists(ALPHABET, max_size=6),
        chunk=st.integers(1, 12),
        token=ALPHABET,
    )
    def arrive(self, data, extra: list[int], chunk: int, token: int) -> None:
        prefix: list[int] = []
        if self.history and data.draw(st.booleans(), label="share a prefix"):
            src = data.draw(st.sampled_from(self.history), label="source")
            prefix = src[: data.draw(st.integers(0, len(src)), label="cut")]
        prompt = prefix + extra or [token]
        req = Request(f"r{self.next_id}", prompt, GREEDY, self.next_id)
        self.next_id += 1
        self.history.append(list(prompt))
        self._admit(req, chunk, token)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 12), token=ALPHABET)
    def step(self, data, chunk: int, token: int) -> None:
        assert self.mgr is not None
        req = self._pick(data)
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert n >= 1
        self._release_behind_window(req)
        before = (pool_state(self.mgr.pool), list(req.block_ids))
        if not self.mgr.allocate_slots(req, n):
            assert (pool_state(self.mgr.pool), list(req.block_ids)) == before
            COVERAGE["step refused"] += 1
            return
        self._advance(req, n, token)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), drafts=st.lists(ALPHABET, max_size=6), bonus=ALPHABET)
    def speculate(self, data, drafts: list[int], bonus: int) -> None:
        """Reserve lookahead slots, write the KV of the pending tokens and drafts, accept a prefix of the
        drafts and roll back the rest."""
        assert self.mgr is not None
        req = self._pick(data)
        start, end, k = req.num_computed_tokens, req.num_tokens, len(drafts)
        self._release_behind_window(req)
        before = (pool_state(self.mgr.pool), list(req.block_ids))
        if not self.mgr.allocate_slots(req, end - start, num_lookahead_tokens=k):
            assert (pool_state(self.mgr.pool), list(req.block_ids)) == before
            COVERAGE["step refused"] += 1
            return
        num_allocated = len(req.block_ids)
        assert num_allocated == cdiv(end + k, self.bs)
        req.token_ids.extend(drafts)
        self._write(req, start, end + k)
        req.num_computed_tokens = end + k
        accepted = data.draw(st.integers(0, k), label="accepted")
        self.mgr.rollback(req, k - accepted)
        assert req.num_computed_tokens == end + accepted
        assert len(req.block_ids) == cdiv(end + accepted, self.bs)
        del req.token_ids[end + accepted :]
        req.token_ids.append(bonus)
        self.mgr.cache_full_blocks(req)
        if k - accepted:
            COVERAGE["rollback"] += 1
            if len(req.block_ids) < num_allocated:
                COVERAGE["rollback freed a block"] += 1

    @precondition(lambda self: any(r.num_cached_blocks and r.num_computed_tokens for r in self.live.values()))
    @rule(data=st.data())
    def rollback_into_cache(self, data) -> None:
        assert self.mgr is not None
        cached = sorted(rid for rid, r in self.live.items() if r.num_cached_blocks and r.num_computed_tokens)
        req = self.live[data.draw(st.sampled_from(cached), label="request")]
        n = req.num_computed_tokens - req.num_cached_blocks * self.bs + 1
        before = (pool_state(self.mgr.pool), list(req.block_ids), req.num_computed_tokens)
        with pytest.raises(RuntimeError, match="prefix-cached block"):
            self.mgr.rollback(req, n)
        assert (pool_state(self.mgr.pool), list(req.block_ids), req.num_computed_tokens) == before
        COVERAGE["rollback into cache refused"] += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        """Free a running request; it waits to recompute its prompt + output (see ``readmit``)."""
        req = self._pick(data)
        self._release(req)
        self.preempted[req.request_id] = req
        COVERAGE["preempted"] += 1

    @precondition(lambda self: self.preempted)
    @rule(data=st.data(), chunk=st.integers(1, 12), token=ALPHABET)
    def readmit(self, data, chunk: int, token: int) -> None:
        req = self.preempted[data.draw(st.sampled_from(sorted(self.preempted)), label="preempted")]
        if self._admit(req, chunk, token):
            del self.preempted[req.request_id]
            COVERAGE["preempted and readmitted"] += 1

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens - 1 for r in self.live.values()))
    @rule(data=st.data())
    def finish(self, data) -> None:
        decoding = sorted(rid for rid, r in self.live.items() if r.num_computed_tokens == r.num_tokens - 1)
        self._release(self.live[data.draw(st.sampled_from(decoding), label="request")])
        COVERAGE["finished"] += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self._release(self._pick(data))
        COVERAGE["aborted"] += 1

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def abort_preempted(self, data) -> None:
        del self.preempted[data.draw(st.sampled_from(sorted(self.preempted)), label="preempted")]

    # --------------------------------------------------------------- invariants
    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        mgr = self.mgr
        if mgr is None:
            return
        pool, bs = mgr.pool, self.bs
        pool.check_invariants()
        refs = Counter(b for r in self.live.values() for b in r.block_ids if b != RELEASED)
        assert [b.ref_count for b in pool.blocks] == [refs.get(i, 0) for i in range(pool.num_blocks)]
        assert mgr.num_free_blocks == pool.num_blocks - len(refs)
        for req in self.preempted.values():
            assert req.block_ids == [] and req.num_computed_tokens == 0 and req.num_cached_blocks == 0, req
        for req in self.live.values():
            table = req.block_ids
            released = req.num_released_blocks
            assert table[:released] == [RELEASED] * released and RELEASED not in table[released:], req
            # Nothing the next query can read is released: it sits at num_computed_tokens (or later) and
            # reads the keys after num_computed_tokens - window.
            if released:
                assert mgr.sliding_window is not None
                assert released * bs <= req.num_computed_tokens - mgr.sliding_window + 1, req
            assert len(set(table[released:])) == len(table) - released, req
            assert len(table) * bs >= req.num_computed_tokens, req
            assert len(table) == cdiv(req.num_computed_tokens, bs), req  # no leaked lookahead
            assert req.num_computed_tokens < req.num_tokens, req
            assert req.num_cached_blocks <= req.num_computed_tokens // bs
            # Every computed token's KV still held is in its slot (shared and revived blocks included).
            for p in range(released * bs, req.num_computed_tokens):
                assert self.slots.get((table[p // bs], p % bs)) == req.token_ids[p], (req, p)
            # A hashed block carries the chained hash of exactly this request's prefix.
            hashes = chain_hashes(req.token_ids[: req.num_computed_tokens], bs)
            for i, block_id in enumerate(table):
                if block_id == RELEASED:
                    continue
                h = pool.blocks[block_id].block_hash
                if i >= req.num_cached_blocks:
                    assert h is None, (req, i)
                elif h is not None:
                    assert h == hashes[i], (req, i)

    def teardown(self) -> None:
        mgr = self.mgr
        if mgr is None:
            return
        for req in list(self.live.values()):
            self._release(req)
        assert mgr.num_free_blocks == mgr.pool.num_blocks
        assert all(b.ref_count == 0 for b in mgr.pool.blocks)
        mgr.pool.check_invariants()


def test_kv_cache_manager_state_machine():
    COVERAGE.clear()
    run_state_machine_as_test(
        KVCacheMachine, settings=settings(max_examples=150, stateful_step_count=40, deadline=None)
    )
    # The generators really reach the interesting paths.
    for what in (
        "prefix hit",
        "freed block revived",
        "block shared by live requests",
        "cached block evicted",
        "admission refused",
        "step refused",
        "rollback",
        "rollback freed a block",
        "rollback into cache refused",
        "preempted and readmitted",
        "finished",
        "aborted",
        "released behind the window",
        "hit outside the window not taken",
    ):
        assert COVERAGE[what] > 0, (what, dict(COVERAGE))


# --------------------------------------------------------------------- scheduler property (real engine)
BASES = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
    [5, 6, 7, 8, 9, 10, 40, 41, 42, 43, 44, 45],
    [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71],
]
prompts = st.builds(
    lambda base, cut, extra: (BASES[base][:cut] + extra) or [3],
    st.integers(0, len(BASES) - 1),
    st.integers(0, 12),
    st.lists(st.integers(3, 100), max_size=3),
)
ops = st.lists(
    st.one_of(
        # (add, prompt, max_tokens, seed): seed None is greedy, else seeded sampling at temperature 0.8
        st.tuples(st.just("add"), prompts, st.integers(1, 6), st.none() | st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 20)),
    ),
    min_size=3,
    max_size=12,
)
_REFERENCE: dict[tuple, tuple[list[int], str | None]] = {}
SCHED_COVERAGE: Counter[str] = Counter()


def sampling_params(max_tokens: int, seed: int | None) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens)


def reference_output(
    model_dir, prompt: list[int], max_tokens: int, seed: int | None, max_model_len: int | None
) -> tuple[list[int], str | None]:
    """The request alone in a fresh engine with an ample pool."""
    key = (str(model_dir), tuple(prompt), max_tokens, seed, max_model_len)
    if key not in _REFERENCE:
        llm = LLM(
            model_dir, skip_tokenizer_init=True, block_size=4, num_kv_blocks=64, max_model_len=max_model_len
        )
        (out,) = llm.generate({"prompt_token_ids": prompt}, sampling_params(max_tokens, seed))
        _REFERENCE[key] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
    return _REFERENCE[key]


def check_engine(engine) -> None:
    sched, pool = engine.scheduler, engine.kv.pool
    pool.check_invariants()
    live = sched.running + list(sched.waiting)
    assert len({id(r) for r in live}) == len(live)
    refs = Counter(b for r in live for b in r.block_ids)
    assert [b.ref_count for b in pool.blocks] == [refs.get(i, 0) for i in range(pool.num_blocks)]
    for r in live:
        assert len(set(r.block_ids)) == len(r.block_ids), r
        assert len(r.block_ids) * engine.kv.block_size >= r.num_computed_tokens, r
        assert r.num_computed_tokens < r.num_tokens < engine.max_model_len, r
        assert not r.status.finished
    for r in sched.waiting:
        assert r.block_ids == [] and r.num_computed_tokens == 0, r
    assert [r.arrival_index for r in sched.running] == sorted(r.arrival_index for r in sched.running)
    assert len(sched.running) <= sched.config.max_num_seqs
    assert set(sched.requests) == {r.request_id for r in live}


def test_scheduler_preserves_outputs_and_frees_everything(tiny_model_dirs):
    """Random arrivals, steps and aborts on a small pool: every request that was not aborted gets exactly
    what it gets alone with an ample pool (greedy, and seeded sampling), and everything is freed."""
    model_dir = tiny_model_dirs["llama-mha-untied"]
    SCHED_COVERAGE.clear()

    @settings(max_examples=40, deadline=None)
    @given(
        num_kv_blocks=st.integers(6, 12),
        budget=st.integers(2, 16),
        max_num_seqs=st.integers(1, 4),
        prefix_caching=st.booleans(),
        max_model_len=st.sampled_from([None, 10, 16]),
        script=ops,
    )
    @example(  # long requests in a 6-block pool: preemption, recompute and prefix hits
        num_kv_blocks=6,
        budget=16,
        max_num_seqs=4,
        prefix_caching=True,
        max_model_len=None,
        script=[
            ("add", BASES[0], 8, None),
            ("step", 1),
            ("add", [*BASES[0], 17], 8, None),
            ("add", [*BASES[1][:8], 3], 6, 1),
            ("step", 2),
            ("add", BASES[2][:5], 4, None),
            ("abort", 3),
            ("step", 3),
            ("add", BASES[1], 5, 2),
        ],
    )
    def run(num_kv_blocks, budget, max_num_seqs, prefix_caching, max_model_len, script):
        llm = LLM(
            model_dir,
            skip_tokenizer_init=True,
            block_size=4,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=prefix_caching,
            max_model_len=max_model_len,
        )
        engine = llm.engine
        added: dict[str, tuple[Request, list[int], int, int | None]] = {}
        aborted: set[str] = set()
        for op in script:
            if op[0] == "add":
                _, prompt, max_tokens, seed = op
                rid = f"q{len(added)}"
                if max_model_len is not None and len(prompt) >= max_model_len:
                    with pytest.raises(InvalidRequestError, match="max_model_len"):
                        engine.add_request(rid, prompt, sampling_params(max_tokens, seed))
                    SCHED_COVERAGE["too long rejected"] += 1
                else:
                    req = engine.add_request(rid, prompt, sampling_params(max_tokens, seed))
                    added[rid] = (req, prompt, max_tokens, seed)
            elif op[0] == "step":
                for _ in range(op[1]):
                    if engine.has_unfinished_requests():
                        engine.step()
                        check_engine(engine)
            elif added:
                rid = sorted(added)[op[1] % len(added)]
                req = added[rid][0]
                was_finished = req.status.finished
                engine.abort_request(rid)
                if not was_finished:
                    aborted.add(rid)
                    assert req.status is RequestStatus.FINISHED_ABORTED
                    assert req.block_ids == []
                    SCHED_COVERAGE["aborted"] += 1
            check_engine(engine)
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            engine.step()
            check_engine(engine)
        assert not engine.has_unfinished_requests()

        pool = engine.kv.pool
        assert engine.kv.num_free_blocks == num_kv_blocks == pool.num_blocks
        assert all(b.ref_count == 0 for b in pool.blocks)
        pool.check_invariants()
        assert engine.scheduler.requests == {}
        SCHED_COVERAGE["preemptions"] += engine.scheduler.num_preemptions
        SCHED_COVERAGE["prefix hit tokens"] += engine.kv.num_prefix_hits

        for rid, (req, prompt, max_tokens, seed) in added.items():
            assert req.status.finished
            want, want_reason = reference_output(model_dir, prompt, max_tokens, seed, max_model_len)
            got = req.output_token_ids
            if rid in aborted:
                assert req.finish_reason == "abort"
                assert got == want[: len(got)], rid  # what it produced before the abort was right
            else:
                assert (got, req.finish_reason) == (want, want_reason), (rid, prompt, max_tokens, seed)
                assert 1 <= len(got) <= max_tokens
                assert req.num_tokens <= engine.max_model_len
                SCHED_COVERAGE["compared"] += 1
                if seed is not None:
                    SCHED_COVERAGE["seeded request compared"] += 1
                if req.stats.num_preemptions:
                    SCHED_COVERAGE["preempted request compared"] += 1
                if req.stats.num_cached_prompt_tokens:
                    SCHED_COVERAGE["prefix-hit request compared"] += 1

    run()
    for what in (
        "preemptions",
        "prefix hit tokens",
        "aborted",
        "preempted request compared",
        "prefix-hit request compared",
        "seeded request compared",
    ):
        assert SCHED_COVERAGE[what] > 0, (what, dict(SCHED_COVERAGE))
