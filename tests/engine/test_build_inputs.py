"""``build_inputs``' list path for small batches equals the vectorised path field by field (hypothesis over
block sizes, decode rows, verification chains, token trees with positions by depth and tree attention
masks, prefill chunks with and without logits, block-table widths and blocks released behind a sliding
window), and both refuse a new token in a released block."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.kv_cache.manager import RELEASED
from specdec.model_runner import LIST_INPUTS_MAX_TOKENS, Segment, _batch_inputs, _list_inputs, build_inputs

CPU = torch.device("cpu")

_segment = st.tuples(
    st.sampled_from(["decode", "chain", "tree", "prefill", "silent_prefill"]),
    st.integers(0, 70),  # start
    st.integers(2, 9),  # tokens of a chain / tree / prefill chunk
    st.integers(0, 3),  # spare blocks (wider tables)
    st.integers(0, 2),  # leading blocks released behind a window
    st.integers(0, 3),  # drafts among the tokens (chains and trees)
)


def _segments(bs: int, specs) -> list[Segment]:
    segs, next_block = [], 0
    for kind, start, n, extra, released, drafts in specs:
        n = 1 if kind == "decode" else n
        released = min(released, start // bs)  # only blocks wholly before the new tokens
        end = start + n
        blocks = list(range(next_block, next_block + (end - 1) // bs + 1 + extra))
        next_block += len(blocks)
        blocks[:released] = [RELEASED] * released
        logits = {"decode": 1, "chain": n, "tree": n, "prefill": 1, "silent_prefill": 0}[kind]
        seg = Segment(blocks, start, [(start + i) % 97 for i in range(n)], logits)
        if kind in ("chain", "tree"):
            seg.num_drafts = min(drafts, n - 1)
        if kind == "tree":
            parents = [-1] + [i // 2 for i in range(1, n)]
            depth, mask = [0] * n, torch.eye(n, dtype=torch.bool)
            for i in range(1, n):
                depth[i], mask[i] = depth[parents[i]] + 1, mask[i] | mask[parents[i]]
            seg.positions, seg.mask = [start + d for d in depth], mask
        segs.append(seg)
    return segs


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 4, 16]), st.lists(_segment, min_size=1, max_size=6))
def test_list_path_equals_the_vectorised_path(bs, specs):
    segs = _segments(bs, specs)
    fast, general = _list_inputs(segs, bs, CPU), _batch_inputs(segs, bs, CPU)
    for name in ("input_ids", "positions", "logits_indices"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("query_start_loc", "seq_lens", "slot_mapping", "block_table"):
        a, b = getattr(fast.metadata, name), getattr(general.metadata, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.metadata.query_lens == general.metadata.query_lens
    assert fast.metadata.seq_lens_host == general.metadata.seq_lens_host
    assert fast.metadata.draft_lens == general.metadata.draft_lens
    want = [s.num_drafts for s in segs]
    assert fast.metadata.draft_lens == (want if any(want) else None)
    masks_a, masks_b = fast.metadata.new_token_masks, general.metadata.new_token_masks
    assert (masks_a is None) == (masks_b is None)
    if masks_a is not None:
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(masks_a, masks_b))


def test_build_inputs_takes_the_list_path_up_to_its_limit(monkeypatch):
    import specdec.model_runner as mr

    taken = []
    for name in ("_list_inputs", "_batch_inputs"):
        real = getattr(mr, name)
        monkeypatch.setattr(mr, name, lambda *a, real=real, name=name: taken.append(name) or real(*a))
    at_limit = [Segment(list(range(40)), 0, [5] * LIST_INPUTS_MAX_TOKENS, 1)]
    past = [Segment(list(range(40)), 0, [5] * (LIST_INPUTS_MAX_TOKENS + 1), 1)]
    build_inputs(at_limit, 16, CPU)
    build_inputs(past, 16, CPU)
    assert taken == ["_list_inputs", "_batch_inputs"]


@pytest.mark.parametrize("build", [_list_inputs, _batch_inputs])
def test_a_new_token_in_a_released_block_is_refused(build):
    segs = [Segment([RELEASED, 7], 2, [1, 2, 3], 1)]  # positions 2..4 with block size 4: block 0 released
    with pytest.raises(RuntimeError, match="released behind the sliding window"):
        build(segs, 4, CPU)
