"""``build_inputs``' fast path for batches of single decode rows equals the general path field by field
(hypothesis over block sizes, context lengths, block-table widths and batch sizes)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.model_runner import Segment, _batch_inputs, _decode_inputs, build_inputs


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([1, 4, 16]),
    st.lists(st.tuples(st.integers(0, 70), st.integers(0, 3)), min_size=1, max_size=6),
)
def test_decode_rows_fast_path_equals_the_general_path(bs, rows):
    segs, next_block = [], 0
    for start, extra in rows:
        blocks = list(range(next_block, next_block + start // bs + 1 + extra))  # spare blocks: wider tables
        next_block += len(blocks)
        segs.append(Segment(blocks, start, [start % 97], 1))
    fast = _decode_inputs(segs, bs, torch.device("cpu"))
    general = _batch_inputs(segs, bs, torch.device("cpu"))
    assert build_inputs(segs, bs, torch.device("cpu")).input_ids.equal(fast.input_ids)
    for name in ("input_ids", "positions", "logits_indices"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("query_start_loc", "seq_lens", "slot_mapping", "block_table"):
        a, b = getattr(fast.metadata, name), getattr(general.metadata, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.metadata.query_lens == general.metadata.query_lens
    assert fast.metadata.seq_lens_host == general.metadata.seq_lens_host
    assert fast.metadata.new_token_masks is None and general.metadata.new_token_masks is None
