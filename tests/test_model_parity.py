"""Logits parity: our decoder on the paged cache vs transformers, fp32, max abs difference <= 1e-4 (2e-4 on
the real SmolLM2, see SMOL_TOL)."""

from __future__ import annotations

import pytest
import torch

from specdec.attention.base import AttentionMetadata
from specdec.attention.reference import ReferenceAttention
from specdec.models.loader import load_model

TOL = 1e-4
#: SmolLM2's real logits (magnitudes ~20, 30 layers) differ from transformers' by float32 rounding that
#: depends on the host's BLAS: up to 0.6e-4 on the AMD EPYC hosts, 1.4e-4 on an Intel Xeon (MKL), with the
#: same code before and after this bound was set.
SMOL_TOL = 2e-4


class PagedRun:
    """Drives our model directly through a paged cache, one sequence per row of the batch."""

    def __init__(self, model, block_size: int, num_blocks: int = 64) -> None:
        cfg = model.cfg
        self.model, self.bs = model, block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
        # Scatter each sequence's blocks over the pool, in a non-trivial order.
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(block_size)).tolist()
        self.free = perm
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def add_seq(self) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.tables) - 1

    def forward(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """Feed ``chunks[seq] = new token ids`` for several sequences in one flattened forward; returns
        each sequence's logits over its new tokens."""
        ids, pos, slots, qlens, slens = [], [], [], [], []
        seqs = list(chunks)
        for s in seqs:
            new = chunks[s]
            start = self.lens[s]
            while len(self.tables[s]) * self.bs < start + len(new):
                self.tables[s].append(self.free.pop())
            ids += new
            pos += list(range(start, start + len(new)))
            slots += [
                self.tables[s][p // self.bs] * self.bs + p % self.bs for p in range(start, start + len(new))
            ]
            qlens.append(len(new))
            slens.append(start + len(new))
            self.lens[s] += len(new)
        width = max(len(self.tables[s]) for s in seqs)
        table = torch.zeros(len(seqs), width, dtype=torch.int64)
        for i, s in enumerate(seqs):
            table[i, : len(self.tables[s])] = torch.tensor(self.tables[s])
        qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()])
        meta = AttentionMetadata(qsl, torch.tensor(slens), torch.tensor(slots), table, qlens, slens)
        with torch.no_grad():
            logits, _ = self.model(
                torch.tensor(ids), torch.tensor(pos), self.caches, meta, ReferenceAttention()
            )
        return list(logits.split(qlens))


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _check_model(model_dir, hf_model, block_size: int) -> None:
    ours = load_model(model_dir, dtype=torch.float32)
    prompts = _prompts(ours.cfg.vocab_size, [1, 7, 23, 40])
    refs = [hf_logits(hf_model, p) for p in prompts]

    # 1. One-shot prefill of all prompts in one flattened batch.
    run = PagedRun(ours, block_size)
    seqs = {run.add_seq(): p for p in prompts}
    for out, ref in zip(run.forward(seqs), refs):
        assert (out - ref).abs().max().item() <= TOL

    # 2. Chunked prefill: chunks of 5 tokens, sequences advancing together, then decode.
    run = PagedRun(ours, block_size)
    ids = [run.add_seq() for _ in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    offset = 0
    while offset < max(len(p) for p in prompts):
        chunk = {s: p[offset : offset + 5] for s, p in zip(ids, prompts) if offset < len(p)}
        for s, out in zip(chunk, run.forward(chunk)):
            got[s].append(out)
        offset += 5
    for s, ref in zip(ids, refs):
        assert (torch.cat(got[s]) - ref).abs().max().item() <= TOL

    # 3. Decode through the paged cache: one token per step for every sequence at once.
    extra = _prompts(ours.cfg.vocab_size, [6] * len(prompts), seed=1)
    for step in range(6):
        outs = run.forward({s: [extra[s][step]] for s in ids})
        for s, out in zip(ids, outs):
            full = prompts[s] + extra[s][: step + 1]
            ref = hf_logits(hf_model, full)[-1]
            assert (out[-1] - ref).abs().max().item() <= TOL, (s, step)


@pytest.mark.parametrize("block_size", [4, 16])
def test_tiny_models_logits_parity(tiny_model_dirs, block_size):
    from transformers import AutoModelForCausalLM

    for d in tiny_model_dirs.values():
        hf_model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        _check_model(d, hf_model, block_size)


def test_tree_mask_equals_separate_sequences(tiny_model_dirs):
    """A tree mask over new tokens gives each branch the logits it has as its own sequence."""
    model = load_model(tiny_model_dirs["qwen2-gqa2-untied"], dtype=torch.float32)
    prompt = _prompts(model.cfg.vocab_size, [9])[0]
    # Tree after the prompt: a -> b, a -> c (positions 9, 10, 10).
    a, b, c = 5, 17, 33
    run = PagedRun(model, 4)
    s = run.add_seq()
    run.forward({s: prompt})
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    ids = torch.tensor([a, b, c])
    pos = torch.tensor([9, 10, 10])
    start = run.lens[s]
    while len(run.tables[s]) * 4 < start + 3:
        run.tables[s].append(run.free.pop())
    slots = torch.tensor([run.tables[s][p // 4] * 4 + p % 4 for p in range(start, start + 3)])
    table = torch.tensor([run.tables[s]])
    meta = AttentionMetadata(
        torch.tensor([0, 3]), torch.tensor([start + 3]), slots, table, [3], [start + 3], [mask]
    )
    with torch.no_grad():
        tree_logits, _ = model(ids, pos, run.caches, meta, ReferenceAttention())
    for branch, row in (([a, b], 1), ([a, c], 2)):
        ref = PagedRun(model, 4)
        r = ref.add_seq()
        want = ref.forward({r: prompt + branch})[0][-1]
        assert (tree_logits[row] - want).abs().max().item() <= TOL


@pytest.mark.real_model
def test_smollm2_logits_parity(smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ours = load_model(smollm2_dir, dtype=torch.float32)
    prompts = _prompts(ours.cfg.vocab_size, [5, 45], seed=3)
    refs = [hf_logits(hf_model, p) for p in prompts]
    run = PagedRun(ours, 16, num_blocks=16)
    ids = [run.add_seq() for _ in prompts]
    # Chunked prefill of 13 tokens (splits blocks mid-way), then the rest.
    first = run.forward({s: p[:13] for s, p in zip(ids, prompts)})
    rest = run.forward({s: p[13:] for s, p in zip(ids, prompts) if len(p) > 13})
    assert (first[0] - refs[0]).abs().max().item() <= SMOL_TOL
    assert (torch.cat([first[1], rest[0]]) - refs[1]).abs().max().item() <= SMOL_TOL
    # Decode through the paged cache, both sequences in one batch; the second crosses a block boundary (48).
    for step, (a, b) in enumerate([(11, 12), (13, 14), (15, 16), (17, 18)]):
        outs = run.forward({ids[0]: [a], ids[1]: [b]})
        prompts[0].append(a)
        prompts[1].append(b)
        for out, p in zip(outs, prompts):
            ref = hf_logits(hf_model, p)[-1]
            assert (out[-1] - ref).abs().max().item() <= SMOL_TOL, step
