"""Paged attention kernel against its reference, and the Triton backend against ReferenceAttention.

Each case is one launch over a mixed batch: a prefill from scratch (ending mid-block), a chunked prefill
over context, single-token decodes (one of them the sequence's first token), a verification segment of
k + 1 tokens, and, in the tree cases, token-tree masks including rows that see only themselves (plus
the context). Unowned cache slots hold NaN and the output is poisoned with NaN, so reading a slot no
request owns, or leaving a row unwritten, fails the comparison.

Tolerances, against the float32 reference computed from the same (rounded) inputs: float32 1e-5
(absolute and relative: float32 accumulation, exp2), bfloat16 2e-2 (the output rounds to bfloat16, ~4e-3,
and on a GPU the probabilities are rounded to bfloat16 for the P·V product).
"""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import (
    pack_new_token_masks,
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
)
from kernels.testing import make_paged_batch, random_tree_mask
from specdec.attention.reference import ReferenceAttention
from specdec.attention.triton_backend import TritonAttention

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# (query_len, context_len): prefill, chunked prefill, decode, verification, tree segment, first token.
SEQS = [(17, 0), (9, 23), (1, 40), (4, 29), (6, 3), (1, 0)]


def _masks(tree: bool, seed: int) -> list[torch.Tensor | None] | None:
    if not tree:
        return None
    g = torch.Generator().manual_seed(seed)
    return [
        None,  # causal prefill beside trees
        random_tree_mask(9, g),
        torch.ones(1, 1, dtype=torch.bool),
        torch.eye(4, dtype=torch.bool),  # every new token sees only itself (and the context)
        random_tree_mask(6, g),
        torch.ones(1, 1, dtype=torch.bool),
    ]


CASES = [
    # id: (heads, kv_heads, head_dim, block_size, dtype, tree, num_splits, block_m)
    pytest.param(4, 4, 64, 16, torch.float32, False, 1, None, id="gqa1-d64-bs16-fp32"),
    pytest.param(6, 2, 128, 32, torch.bfloat16, False, 1, None, id="gqa3-d128-bs32-bf16"),
    pytest.param(6, 1, 64, 32, torch.float32, False, 3, None, id="gqa6-d64-bs32-fp32-split3"),
    pytest.param(7, 1, 128, 16, torch.bfloat16, True, 1, 16, id="gqa7-d128-bs16-bf16-tree-m16"),
    pytest.param(6, 2, 64, 16, torch.float32, True, 2, 64, id="gqa3-d64-bs16-fp32-tree-split2-m64"),
    pytest.param(12, 2, 128, 16, torch.float32, True, 1, None, id="gqa6-d128-bs16-fp32-tree"),
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "dtype", "tree", "splits", "block_m"), CASES
)
def test_kernel_matches_reference(
    device, heads, kv_heads, head_dim, block_size, dtype, tree, splits, block_m
):
    masks = _masks(tree, seed=heads + head_dim)
    b = make_paged_batch(
        SEQS, heads, kv_heads, head_dim, block_size, dtype, device, seed=heads, new_token_masks=masks
    )
    scale = head_dim**-0.5
    ref = paged_attention_ref(
        b.query, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, scale, b.new_token_masks
    )
    assert not ref.isnan().any()
    out = torch.full_like(b.query, float("nan"))
    paged_attention_triton(
        b.query,
        b.k_cache,
        b.v_cache,
        b.query_start_loc,
        b.seq_lens,
        b.block_table,
        scale,
        pack_new_token_masks(b.new_token_masks, b.query_lens, b.query.device),
        max_query_len=max(b.query_lens),
        num_splits=splits,
        block_m=block_m,
        out=out,
    )
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_tree_mask_changes_the_output(device):
    """The mask is read: a chain (causal) and a tree over the same tokens give different rows."""
    g = torch.Generator().manual_seed(3)
    tree = random_tree_mask(6, g)
    while torch.equal(tree, torch.ones(6, 6, dtype=torch.bool).tril()):
        tree = random_tree_mask(6, g)
    outs = []
    for masks in (None, [tree]):
        b = make_paged_batch([(6, 5)], 3, 1, 64, 16, torch.float32, device, seed=1, new_token_masks=masks)
        packed = pack_new_token_masks(b.new_token_masks, b.query_lens, b.query.device)
        outs.append(
            paged_attention_triton(
                b.query, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, 0.125, packed
            )
        )
    differs = (outs[0] - outs[1]).abs().amax(dim=(1, 2)) > 1e-4
    rows_differ = (tree != torch.ones(6, 6, dtype=torch.bool).tril()).any(dim=1)
    assert torch.equal(differs.cpu(), rows_differ)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_matches_reference_backend(device, dtype):
    """Both backends write the new K/V (from strided views of a fused QKV tensor, as the model passes
    them) and attend; caches must be equal and outputs within tolerance."""
    heads, kv_heads, head_dim = 6, 2, 64
    masks = _masks(True, seed=5)
    # ReferenceAttention multiplies probabilities by every cache row it gathers: finite poison only.
    b = make_paged_batch(
        SEQS,
        heads,
        kv_heads,
        head_dim,
        16,
        dtype,
        device,
        seed=7,
        new_token_masks=masks,
        write_new=False,
        poison=3e3,
    )
    qkv = torch.cat([b.query, b.key, b.value], dim=1)  # [T, H + 2 KVH, D]
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    assert not k.is_contiguous()
    outs, caches = [], []
    for backend in (ReferenceAttention(), TritonAttention()):
        kc, vc = b.k_cache.clone(), b.v_cache.clone()
        outs.append(backend.forward(q, k, v, kc, vc, b.metadata(), head_dim**-0.5))
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    tol = TOL[dtype]
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol, rtol=tol)


def test_dispatcher_uses_the_reference_off_cuda(monkeypatch):
    b = make_paged_batch([(3, 5), (1, 9)], 4, 2, 64, 16, seed=2)
    args = (b.query, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table)
    ref = paged_attention_ref(*args, 0.125)
    assert torch.equal(paged_attention(*args), ref)  # CPU tensors: the reference (default scale D^-0.5)
    monkeypatch.setenv("SPECDEC_FORCE_REFERENCE", "1")
    if torch.cuda.is_available():
        cuda_args = [t.cuda() for t in args]
        torch.testing.assert_close(paged_attention(*cuda_args).cpu(), ref)


@pytest.mark.parametrize(("window", "softcap", "splits"), [(5, 0.0, 1), (20, 1.5, 2), (0, 1.5, 1)])
def test_window_and_softcap_match_the_references(device, window, softcap, splits):
    """A sliding window (shorter than most sequences: key tiles before it are skipped) and soft-capped
    scores: the kernel, its reference and the torch backend agree; the window and the cap change the
    output. With token-tree masks too (positions ``context_len + depth`` inside a tree)."""
    heads, kv_heads, head_dim = 6, 2, 64
    # Finite poison: the torch backend multiplies zero probabilities by every cache row it gathers.
    b = make_paged_batch(SEQS, heads, kv_heads, head_dim, 16, torch.float32, device, seed=11, poison=3e3)
    scale = head_dim**-0.5
    args = (b.query, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, scale)
    ref = paged_attention_ref(*args, None, sliding_window=window, softcap=softcap)
    assert not ref.isnan().any()
    assert (ref - paged_attention_ref(*args)).abs().max() > 1e-3  # the window / cap matter here
    out = torch.full_like(b.query, float("nan"))
    paged_attention_triton(
        *args, None, sliding_window=window, softcap=softcap, max_query_len=17, num_splits=splits, out=out
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # The torch backend (writing the new K/V into the cache, then attending) agrees with the reference.
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    got = ReferenceAttention().forward(
        b.query, b.key, b.value, kc, vc, b.metadata(), scale,
        sliding_window=window or None, softcap=softcap or None,
    )  # fmt: skip
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if not window:
        return
    # Trees under the window: a query's position is context + depth, so a deep node of a wide tree sees
    # keys a slot-order rule would cut (and the other way round).
    masks = _masks(True, seed=1)
    tb = make_paged_batch(
        SEQS, heads, kv_heads, head_dim, 16, torch.float32, device, seed=12, poison=3e3, new_token_masks=masks
    )
    targs = (tb.query, tb.k_cache, tb.v_cache, tb.query_start_loc, tb.seq_lens, tb.block_table, scale)
    tref = paged_attention_ref(*targs, tb.new_token_masks, sliding_window=window, softcap=softcap)
    slot_order = paged_attention_ref(*targs, None, sliding_window=window, softcap=softcap)
    assert not tref.isnan().any()
    tree_rows = torch.cat([torch.full((q,), m is not None and q > 1) for (q, _), m in zip(SEQS, masks)])
    assert (tref[tree_rows] - slot_order[tree_rows]).abs().max() > 1e-3
    packed = pack_new_token_masks(tb.new_token_masks, tb.query_lens, tb.query.device)
    out = torch.full_like(tb.query, float("nan"))
    paged_attention_triton(
        *targs, packed, sliding_window=window, softcap=softcap, max_query_len=17, num_splits=splits, out=out
    )
    torch.testing.assert_close(out, tref, atol=1e-5, rtol=1e-5)
    kc, vc = tb.k_cache.clone(), tb.v_cache.clone()
    got = ReferenceAttention().forward(
        tb.query, tb.key, tb.value, kc, vc, tb.metadata(), scale,
        sliding_window=window, softcap=softcap or None,
    )  # fmt: skip
    torch.testing.assert_close(got, tref, atol=1e-5, rtol=1e-5)
