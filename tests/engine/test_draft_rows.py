"""A verification row's logits do not depend on whether its drafts came with the prompt's last prefill
chunk (drafters with their own prefill, like a draft model or the quantized self-drafter, propose at that
step) or in a decode step: the CPU backend attends the drafts as short queries apart from the chunk
(``AttentionMetadata.draft_lens``), so the rows equal decode rows bit for bit in bfloat16, where one
rounding apart flips a greedy choice at a near-tie. On the real SmolLM2 (the tiny random models' rows
happen to agree either way); the negative control (the drafts left in the chunk's SDPA call) must differ
(by up to 0.375 in a logit here)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention
from specdec.llm import LLM
from specdec.model_runner import Segment, build_inputs, select_attention_backend


@pytest.fixture(scope="module")
def runner(smollm2_dir):
    llm = LLM(smollm2_dir, skip_tokenizer_init=True, dtype="bfloat16", device="cpu")
    return llm.engine.runner


def _rows(runner, prompt: int, drafts: int, num_drafts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the chunk's last row and its drafts in one forward, and of the same rows decoded one by
    one after the chunk alone (in other blocks of the same cache)."""
    bs = runner.block_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 49152, (prompt + drafts,), generator=g).tolist()
    per = -(-(prompt + drafts) // bs)
    with_drafts, alone = list(range(per)), list(range(per, 2 * per))
    with torch.inference_mode():
        seg = Segment(with_drafts, 0, ids, drafts + 1, num_drafts=num_drafts)
        together = runner.execute(build_inputs([seg], bs, runner.device)).clone()
        chunk = Segment(alone, 0, ids[:prompt], 1)
        rows = [runner.execute(build_inputs([chunk], bs, runner.device))[0].clone()]
        for j in range(drafts):
            seg = Segment(alone, prompt + j, ids[prompt + j : prompt + j + 1], 1)
            rows.append(runner.execute(build_inputs([seg], bs, runner.device))[0].clone())
    return together, torch.stack(rows)


needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="the CPU kernels do not build here")


@needs_kernel
@pytest.mark.parametrize("prompt", [30, 40, 77])
def test_drafts_after_a_prefill_chunk_equal_decode_rows(runner, prompt):
    together, decoded = _rows(runner, prompt, 4, 4, seed=prompt)
    assert torch.equal(together, decoded)


@needs_kernel
def test_negative_control_drafts_inside_the_chunk_differ(runner):
    together, decoded = _rows(runner, 77, 4, 0, seed=77)
    assert not torch.equal(together[1:], decoded[1:])


@pytest.mark.parametrize("attention", ["cpu", "reference"])
@pytest.mark.parametrize("prompt", [30, 40])
@pytest.mark.parametrize("others", [False, True], ids=["alone", "batched"])
def test_split_drafts_agree_with_the_unsplit_forward_for_chains_and_trees(
    tiny_model_dirs, attention, prompt, others
):
    """The split itself changes no mathematics: float32 logits of a chunk followed by a chain or a token
    tree (its mask's tree block after the chunk's causal block) agree with the unsplit forward to float32
    rounding, on both CPU backends, also where the chunk left behind is short (30 tokens) and beside
    another request's decode row and chain (their rows and the split request's start in the batch)."""
    from sampling.token_tree import TokenTree

    llm = LLM(tiny_model_dirs["llama-gqa3-tied"], skip_tokenizer_init=True, dtype="float32", device="cpu")
    llm.engine.runner.attention = select_attention_backend(torch.device("cpu"), attention)
    runner, bs = llm.engine.runner, llm.engine.runner.block_size
    g = torch.Generator().manual_seed(prompt)
    tree = TokenTree([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 2])
    for drafts, mask in ((4, None), (6, tree.attention_mask(num_prefix=prompt))):
        ids = torch.randint(3, 128, (prompt + drafts,), generator=g).tolist()
        blocks = list(range(-(-(prompt + drafts) // bs)))
        positions = None
        if mask is not None:
            positions = list(range(prompt)) + [prompt - 1 + d for d in tree.position_offsets()]
        out = []
        with torch.inference_mode():
            other_blocks = list(range(len(blocks), len(blocks) + 4))
            if others:  # another request's context, then a decode row of it before and a chain after
                runner.execute(build_inputs([Segment(other_blocks, 0, ids[:20], 1)], bs, runner.device))
            for num_drafts in (drafts, 0):
                seg = Segment(
                    blocks, 0, ids, drafts + 1, positions=positions, mask=mask, num_drafts=num_drafts
                )
                batch = [seg]
                if others:
                    batch = [Segment(other_blocks, 20, ids[20:21], 1), seg]
                    batch.append(Segment(other_blocks + [len(blocks) + 4], 21, ids[21:25], 4, num_drafts=3))
                    batch = batch[:2] if num_drafts == 0 else batch  # the chain: only beside the split
                out.append(runner.execute(build_inputs(batch, bs, runner.device)).clone())
        n = out[1].shape[0]
        torch.testing.assert_close(out[0][:n], out[1], rtol=1e-5, atol=1e-5)
