"""The CPU attention kernel (``kernels/csrc/cpu_attention.cpp``, through
:class:`~specdec.attention.cpu_backend.CpuAttention`) against its reference, ``ReferenceAttention``.

Random flattened batches mixing decode rows, verification chains, token trees (random tree attention
masks), prefill chunks (which both backends send through SDPA) and requests whose keys cross block
boundaries, under several grouped-query ratios and block sizes (hypothesis draws them). float32 agrees
to rounding; bfloat16 outputs are compared with the reference run in float32 on the same inputs. Then
backend selection, and the checks the kernel makes on its inputs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_attention
from kernels.attention_metadata import AttentionMetadata
from specdec.attention.cpu_backend import CpuAttention
from specdec.attention.reference import ReferenceAttention
from specdec.errors import ConfigError
from specdec.model_runner import select_attention_backend

needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="the CPU kernels do not build here")


def _random_tree_mask(n: int, g: torch.Generator) -> torch.Tensor:
    """A token tree's attention mask: node i's parent is a random earlier node (node 0 is the root)."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        parent = int(torch.randint(0, i, (1,), generator=g))
        mask[i] |= mask[parent]
    return mask


def _batch(specs, heads, kv_heads, head_dim, block_size, dtype, seed):
    """Caches, inputs and a metadata factory for requests ``specs`` = [(query_len, seq_len, tree)]."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for _, s, _ in specs)
    num_blocks = max_blocks * len(specs) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    block_table = perm[: max_blocks * len(specs)].view(len(specs), max_blocks).clone()
    query_lens = [q for q, _, _ in specs]
    seq_lens = [s for _, s, _ in specs]
    slots = [
        int(block_table[b, p // block_size]) * block_size + p % block_size
        for b, (q, s, _) in enumerate(specs)
        for p in range(s - q, s)
    ]
    masks = [_random_tree_mask(q, g) if tree else None for q, _, tree in specs]
    total = sum(query_lens)
    query = torch.randn(total, heads, head_dim, generator=g).to(dtype)
    key = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(query_lens), 0).tolist()])

    def metadata():
        return AttentionMetadata(
            starts, torch.tensor(seq_lens), torch.tensor(slots), block_table, query_lens, seq_lens,
            masks if any(m is not None for m in masks) else None,
        )  # fmt: skip

    return query, key, value, k_cache, v_cache, metadata


def _run(backend, query, key, value, k_cache, v_cache, metadata, dtype=None, **window_softcap):
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    return backend.forward(
        cast(query), cast(key), cast(value), cast(k_cache).clone(), cast(v_cache).clone(), metadata(), 0.125,
        **window_softcap,
    )  # fmt: skip


def _attend_one(keys, values, queries, mask, kv_heads, head_dim, bs=16):
    """The kernel's output for one request whose keys / values are ``keys`` / ``values`` ``[L, KVH, D]``
    (in blocks of ``bs``) and whose new tokens' queries are ``queries`` (``mask``: their tree attention
    mask; None: causal)."""
    L, q = keys.shape[0], queries.shape[0]
    blocks = -(-L // bs)
    k_cache = torch.zeros(blocks, bs, kv_heads, head_dim, dtype=keys.dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache.view(-1, kv_heads, head_dim)[:L] = keys
    v_cache.view(-1, kv_heads, head_dim)[:L] = values
    out = torch.empty_like(queries)
    one = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    masks = mask.to(torch.uint8).flatten() if mask is not None else torch.empty(0, dtype=torch.uint8)
    cpu_attention.paged_attention_short(
        queries, k_cache, v_cache, torch.arange(blocks).view(1, -1), one(0), one(0), one(q), one(L),
        one(0 if mask is not None else -1), masks, out, head_dim**-0.5,
    )  # fmt: skip
    return out


def _assert_tree_rows_equal_their_branches(k_ctx, v_ctx, query, tree, context, kv_heads, head_dim, bs=16):
    """Run the kernel on one request whose keys are ``k_ctx`` / ``v_ctx`` (``context`` of them, then a
    token tree's nodes, ``tree`` its mask; None: a chain) and assert that each node's output equals, bit
    for bit, the kernel's output for plain decoding of its branch (the context, then its ancestors and
    itself, in order)."""
    n = query.shape[0]
    tree_out = _attend_one(k_ctx, v_ctx, query, tree, kv_heads, head_dim, bs)
    for node in range(n):
        seen = tree[node] if tree is not None else torch.arange(n) <= node
        branch = [context + a for a in range(n) if seen[a]]  # ancestors and the node
        keys = torch.cat([k_ctx[:context], k_ctx[branch]])
        values = torch.cat([v_ctx[:context], v_ctx[branch]])
        decode = _attend_one(keys, values, query[node : node + 1], None, kv_heads, head_dim, bs)[0]
        assert torch.equal(tree_out[node], decode), node


_request = st.tuples(
    st.sampled_from(["decode", "chain", "tree", "prefill"]),
    st.integers(min_value=0, max_value=70),  # context tokens
    st.integers(min_value=2, max_value=9),  # chain / tree length
)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(_request, min_size=1, max_size=6),
    group=st.sampled_from([1, 3, 4]),
    block_size=st.sampled_from([1, 4, 16]),
    head_dim=st.sampled_from([8, 12, 64]),
    seed=st.integers(0, 2**16),
    window=st.sampled_from([None, None, 1, 3, 8, 40]),
    softcap=st.sampled_from([None, None, 0.5]),
)
def test_float32_equals_reference(requests, group, block_size, head_dim, seed, window, softcap):
    """Also with a sliding window (positions from tree depths inside trees) and soft-capped scores."""
    specs = []
    for kind, context, n in requests:
        q = {"decode": 1, "chain": n, "tree": n, "prefill": 33 + n}[kind]
        specs.append((q, context + q, kind == "tree"))
    inputs = _batch(specs, 2 * group, 2, head_dim, block_size, torch.float32, seed)
    extra = {k: v for k, v in (("sliding_window", window), ("softcap", softcap)) if v is not None}
    want = _run(ReferenceAttention(), *inputs, **extra)
    got = _run(CpuAttention(), *inputs, **extra)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize(
    "spec", [(16, 90, True), (5, 700, False), (1, 700, False)], ids=["tree", "chain", "decode"]
)
def test_row_chunks_do_not_change_outputs(window, spec):
    """Where the threads would be uneven the kernel splits a request's rows (query x query head) into
    chunks of whole groups of four (a 16-node tree or a chain of 5 of SmolLM2's shape on 2 threads: 2
    chunks per KV head; on 4 threads 4, cutting a query's heads apart); rows are independent, so one to
    four threads give the same bits, also with a sliding window read from tree depths, over more than one
    32-key tile of context."""
    inputs = _batch([spec], 9, 3, 64, 16, torch.bfloat16, seed=3)
    extra = {} if window is None else {"sliding_window": window}
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 4):  # 2 and 4 threads split the rows (4: mid-query, chunks of 4 rows)
            torch.set_num_threads(n)
            outs.append(_run(CpuAttention(), *inputs, **extra))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    want = _run(ReferenceAttention(), *inputs, dtype=torch.float32, **extra)
    torch.testing.assert_close(outs[0].float(), want, rtol=2**-7, atol=2e-3)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context", [0, 37, 300])
def test_a_tree_row_equals_the_decode_row_of_its_branch_bit_for_bit(dtype, context):
    """A token tree's node attends to the context and to its ancestors; plain decoding of that branch
    attends to the same keys, with the ancestors consecutive. Their outputs must be equal to the bit, or a
    tree's greedy output parts from plain decoding's at near-ties (the softmax sums in vector lanes by a
    key's place: the kernel moves a tree row's visible keys to a decode row's places first)."""
    heads, kv_heads, head_dim, bs, n = 9, 3, 64, 16, 16
    g = torch.Generator().manual_seed(context)
    tree = _random_tree_mask(n, g)
    total = context + n
    k_ctx = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    v_ctx = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    query = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    _assert_tree_rows_equal_their_branches(k_ctx, v_ctx, query, tree, context, kv_heads, head_dim, bs)


@needs_kernel
@pytest.mark.parametrize("tiles", [True, False], ids=["amx", "avx512"])
@pytest.mark.parametrize("head_dim,bs", [(64, 16), (128, 32)])
@pytest.mark.parametrize("chain", [False, True], ids=["tree", "chain"])
@pytest.mark.parametrize("seed,context", [(0, 21), (1, 21), (2, 45), (3, 64), (4, 300)])
def test_a_tree_row_sums_its_values_in_the_decode_rows_order(seed, context, chain, head_dim, bs, tiles):
    """The order in which a row's weighted values are summed must not depend on where its visible keys
    sit: zero queries give every visible key the same weight (1 / n), and values of ±2^20 beside ±2^-8
    make the float32 sum depend on the order of additions (2^20 + 2^-8 - 2^20 is 0, 2^20 - 2^20 + 2^-8
    is not). A kernel that adds two keys' products in an order set by their places (AMX's TDPBF16PS
    adds a pair's odd product first) parts tree rows from decode rows here (the tile path with a tree
    row's keys left in place fails 4 of the 5 tree cases); random values rarely show it (0 of 960 rows),
    while a greedy token tree parted from plain decoding on 1 of 16 SmolLM2 prompts. Chains (causal, no
    mask) too; contexts below, across and at a 32-key tile's edge; head_dim 128 (two passes of 64 output
    columns on the tiles); the AMX path where the CPU has it and the AVX-512 path."""
    from kernels.cpu_ext import require_extension

    ext = require_extension()
    if tiles and not ext.has_amx():
        pytest.skip("no AMX here")
    heads, kv_heads, n = 9, 3, 16
    g = torch.Generator().manual_seed(seed)
    tree = None if chain else _random_tree_mask(n, g)
    total = context + n
    big = torch.randint(0, 2, (total, kv_heads, head_dim), generator=g) * 2 - 1
    small = torch.randint(-8, 9, (total, kv_heads, head_dim), generator=g) * 2.0**-8
    pick = torch.rand(total, kv_heads, head_dim, generator=g) < 0.5
    v_ctx = torch.where(pick, big * 2.0**20, small).to(torch.bfloat16)
    k_ctx = torch.randn(total, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    query = torch.zeros(n, heads, head_dim, dtype=torch.bfloat16)
    was = ext.has_amx()
    try:
        ext.set_amx(tiles)
        _assert_tree_rows_equal_their_branches(k_ctx, v_ctx, query, tree, context, kv_heads, head_dim, bs)
    finally:
        ext.set_amx(was)


@needs_kernel
def test_bfloat16_within_one_rounding_of_float32():
    specs = [(1, 37, False), (5, 60, False), (6, 20, True), (40, 55, False), (1, 1, False), (16, 200, True)]
    inputs = _batch(specs, 9, 3, 64, 16, torch.bfloat16, seed=7)
    got = _run(CpuAttention(), *inputs)
    assert got.dtype == torch.bfloat16
    want = _run(ReferenceAttention(), *inputs, dtype=torch.float32)  # the same bf16 values, in float32
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2e-3)


@needs_kernel
@pytest.mark.parametrize("tiles", [True, False], ids=["amx", "avx512"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
def test_bfloat16_tile_path_within_one_rounding_and_blind_past_the_keys(tiles, head_dim, block_size):
    """bfloat16 caches in blocks of a multiple of 16 keys with head_dim 64 or 128 take the AMX path where
    the CPU has it (``csrc/cpu_attention_amx.h``; ``set_amx(False)``: the AVX-512 path): decode rows,
    chains, trees and 20 queries of one request (60 rows, more than one tile of 16), keys across blocks,
    within one bfloat16 rounding of the float32 reference. The tiles read whole runs of 16 keys, also past
    a request's last key: NaN in every slot no request owns changes no bit of the output."""
    from kernels.cpu_ext import require_extension

    ext = require_extension()
    if tiles and not ext.has_amx():
        pytest.skip("no AMX here")
    specs = [(1, 37, False), (5, 60, False), (16, 200, True), (20, 45, False), (1, 1, False), (7, 300, True)]
    inputs = _batch(specs, 12, 4, head_dim, block_size, torch.bfloat16, seed=11)
    query, key, value, k_cache, v_cache, metadata = inputs
    md = metadata()
    owned = torch.zeros(k_cache.shape[0] * block_size, dtype=torch.bool)
    for b, seq_len in enumerate(md.seq_lens_host):
        for p in range(seq_len):
            owned[int(md.block_table[b, p // block_size]) * block_size + p % block_size] = True
    poisoned = [c.clone() for c in (k_cache, v_cache)]
    for c in poisoned:
        c.view(-1, *c.shape[2:])[~owned] = float("nan")
    was = ext.has_amx()
    try:
        ext.set_amx(tiles)
        got = _run(CpuAttention(), query, key, value, k_cache, v_cache, metadata)
        got_poisoned = _run(CpuAttention(), query, key, value, *poisoned, metadata)
    finally:
        ext.set_amx(was)
    assert torch.equal(got, got_poisoned)
    want = _run(ReferenceAttention(), query, key, value, k_cache, v_cache, metadata, dtype=torch.float32)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2e-3)


@needs_kernel
def test_selection():
    cpu = torch.device("cpu")
    assert type(select_attention_backend(cpu)) is CpuAttention  # auto on a CPU where the kernel builds
    assert type(select_attention_backend(cpu, "cpu")) is CpuAttention
    assert type(select_attention_backend(cpu, "reference")) is ReferenceAttention
    assert type(select_attention_backend(cpu, "auto", "int8")) is ReferenceAttention  # int8: the reference
    with pytest.raises(ConfigError, match="int8"):
        select_attention_backend(cpu, "cpu", "int8")


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "0")
    assert not cpu_attention.available()
    assert type(select_attention_backend(torch.device("cpu"))) is ReferenceAttention


@needs_kernel
def test_kernel_checks_its_inputs():
    query, key, value, k_cache, v_cache, metadata = _batch([(3, 10, False)], 4, 2, 8, 4, torch.float32, 0)
    one = torch.zeros(1, dtype=torch.int64)
    args = (metadata().block_table, one, one, one + 3, one + 10, one - 1, torch.empty(0, dtype=torch.uint8))
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_attention.paged_attention_short(query, k_cache.double(), v_cache.double(), *args, out, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_attention.paged_attention_short(query.transpose(0, 1), k_cache, v_cache, *args, out, 1.0)
    cpu_attention.paged_attention_short(query, k_cache, v_cache, *args, out, 1.0)  # well-formed: runs
    # ... and attends as the reference does over the cache as it is (slot -1: nothing written).
    md = metadata()
    md.slot_mapping = torch.full_like(md.slot_mapping, -1)
    want = ReferenceAttention().forward(query, key, value, k_cache, v_cache, md, 1.0)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_read_in_place_from_a_fused_projection(dtype):
    """The layer stack passes the query heads of its fused ``[T, H + 2 KVH, D]`` projection without a
    copy (a token stride of H + 2 KVH heads): the same bits as the contiguous query, for a decode row, a
    chain and a tree in one batch."""
    heads, kv_heads, head_dim = 6, 2, 16
    specs = [(1, 40, False), (5, 70, False), (7, 30, True)]
    query, _, _, k_cache, v_cache, metadata = _batch(specs, heads, kv_heads, head_dim, 4, dtype, seed=5)
    fused = torch.randn(query.shape[0], heads + 2 * kv_heads, head_dim).to(dtype)
    fused[:, :heads] = query
    strided = fused.narrow(1, 0, heads)
    assert not strided.is_contiguous()
    md = metadata()
    tree = md.new_token_masks[2].to(torch.uint8).flatten()
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    reqs, q_start, q_len, seq_len, mask_offset = (
        i64([0, 1, 2]),
        i64([0, 1, 6]),
        i64([1, 5, 7]),
        i64([40, 70, 30]),
        i64([-1, -1, 0]),
    )
    args = (md.block_table, reqs, q_start, q_len, seq_len, mask_offset)
    outs = []
    for q in (query, strided):
        outs.append(torch.zeros_like(query))
        cpu_attention.paged_attention_short(q, k_cache, v_cache, *args, tree, outs[-1], 0.25)
    assert torch.equal(outs[0], outs[1])
    assert outs[0].abs().sum(dim=(1, 2)).gt(0).all()  # every row written
