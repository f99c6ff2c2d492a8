"""The EAGLE-3 objective (Li et al. 2025): the training-time test, on packed whole sequences.

The head is unrolled for ``J`` drafting steps on its own outputs, as when it drafts a chain. Rows are
aligned on the *root* t (the last position with true target features):

- step 1, row t: reads ``(embed(x_{t+1}), fc(aux_t))`` at position t and predicts ``x_{t+2}``;
- step j > 1, row t: reads ``(embed(x_{t+j}), h^{(j-1)}_t)`` (its own previous output) at position
  ``t + j - 1`` and predicts ``x_{t+j+1}``; it attends to the step-1 keys of rows ``<= t`` of its
  sequence (true context) and to its own keys of steps 2..j (the chain so far): the diagonal masks of
  the paper's code, computed here by :class:`TTTAttention` without repeating the step-1 rows.

The loss of step j is the cross-entropy of the head's draft-vocabulary distribution against the
target's, ``softmax(W_d f_{t+j})`` over the draft vocabulary (``W_d``: the target's LM-head rows of the
draft tokens), on rows whose predicted token is a response token and whose target top token lies in the
draft vocabulary (as the paper's code masks); steps are weighted ``decay ** (j - 1)``. Steps j > 1 run
only on rows that can reach the response (``t >= start - J - 1``).

The draft vocabulary (:func:`select_draft_vocab`): the ``V_d`` target tokens most often the target's
top token at response positions of the training data (then the most frequent response tokens), EOS
always included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from experiments.train.data import DistilData
from experiments.train.target import FrozenTarget


@dataclass
class Eagle3Batch:
    """Packed sequences; row t of a sequence is the root of a chain (see the module docstring).

    ``starts`` are the response starts; ``top`` the target's top token after each position."""

    lens: list[int]
    starts: list[int]
    tokens: torch.Tensor  # [T] x_t
    aux: torch.Tensor  # [T, 3H] bfloat16: the fused layers' streams at t
    final: torch.Tensor  # [T, H] bfloat16: f_t (the target's final-norm hidden state)
    top: torch.Tensor  # [T] int64: argmax of the target's logits at t

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])


def split_features(features: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, (n + 1) H]`` data features -> (the fused layers ``[L, n H]``, ``f_t`` ``[L, H]``)."""
    return features[:, :-hidden_size], features[:, -hidden_size:]


def eagle3_batches(
    data: DistilData, batch_tokens: int, hidden_size: int, order: Sequence[int] | None = None
) -> Iterator[Eagle3Batch]:
    """Sequences (in ``order``) packed into batches of at most ``batch_tokens`` rows (longer ones alone).

    Raises:
        ValueError: data without the target's top tokens (not made with ``data.feature_layers``).
    """
    if data.top_tokens is None:
        raise ValueError("EAGLE-3 data needs data.feature_layers (the fused layers and the top tokens)")
    order = range(len(data)) if order is None else order
    pending: list[int] = []
    total = 0
    for i in order:
        n = len(data.tokens[i])
        if n < 3:
            continue
        if pending and total + n > batch_tokens:
            yield _batch(data, pending, hidden_size)
            pending, total = [], 0
        pending.append(i)
        total += n
    if pending:
        yield _batch(data, pending, hidden_size)


def _batch(data: DistilData, seqs: Sequence[int], hidden_size: int) -> Eagle3Batch:
    assert data.top_tokens is not None
    aux, final = zip(*(split_features(data.features[i], hidden_size) for i in seqs))
    return Eagle3Batch(
        [len(data.tokens[i]) for i in seqs],
        [data.starts[i] for i in seqs],
        torch.cat([data.tokens[i] for i in seqs]),
        torch.cat(aux),
        torch.cat(final),
        torch.cat([data.top_tokens[i] for i in seqs]).long(),
    )


class TTTAttention:
    """Attention of the training-time test (an :class:`~specdec.attention.base.AttentionBackend` for the
    head's layer): step 1 is causal within each packed sequence; a step j > 1 query (row t, a subset
    ``rows`` of the step-1 rows) sees the step-1 keys of rows ``<= t`` of its sequence and its own keys
    of steps 2..j. Call :meth:`next_step` before each step after the first."""

    def __init__(self, lens: Sequence[int], device: torch.device) -> None:
        seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(list(lens))).to(device)
        n = seq.shape[0]
        self.allowed = (seq[:, None] == seq[None, :]) & torch.ones(
            n, n, dtype=torch.bool, device=device
        ).tril_()
        self.rows: torch.Tensor | None = None  # the queries' step-1 rows (None: all)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def next_step(self, rows: torch.Tensor) -> None:
        """The next step's queries are the step-1 rows ``rows`` (the same for every step after the first)."""
        if self.rows is not None and not torch.equal(self.rows, rows):
            raise ValueError("every step after the first runs on the same rows")
        self.rows = rows

    def forward(self, query, key, value, k_cache, v_cache, metadata, scale, **kwargs):
        """``query`` ``[q, heads, D]``, ``key``/``value`` ``[q, kv_heads, D]`` -> ``[q, heads, D]``."""
        rep = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        if not self.keys:  # step 1: causal over the packed sequences
            self.keys.append(k)
            self.values.append(v)
            q = query.transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=self.allowed, scale=scale
            )
            return out.transpose(0, 1)
        assert self.rows is not None, "next_step sets the rows of the steps after the first"
        self.keys.append(k)
        self.values.append(v)
        q = query.transpose(0, 1)  # [heads, q, D]
        ctx = torch.matmul(q, self.keys[0].transpose(0, 1).transpose(1, 2)) * scale  # [heads, q, T]
        ctx = ctx.masked_fill(~self.allowed[self.rows], float("-inf"))
        diag = [
            (query * kj).sum(-1).transpose(0, 1)[..., None] * scale for kj in self.keys[1:]
        ]  # [heads, q, 1]
        probs = torch.softmax(torch.cat([ctx, *diag], dim=-1).float(), dim=-1).to(query.dtype)
        n = ctx.shape[-1]
        out = torch.matmul(probs[..., :n], self.values[0].transpose(0, 1))  # [heads, q, D]
        for i, vj in enumerate(self.values[1:]):
            out = out + probs[..., n + i : n + i + 1] * vj.transpose(0, 1)
        return out.transpose(0, 1)


@dataclass
class StepLoss:
    """One TTT step: the loss over its trained rows, the rows, and the top-1 hits (the head's top draft
    token is the target's top token)."""

    loss: torch.Tensor
    rows: int
    hits: float


def target_draft_probs(target: FrozenTarget, final: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """``[T, V_d]`` float32: the target's distribution restricted to the draft vocabulary and
    renormalised, ``softmax(W_d f_t)``, from its final-norm states ``final`` ``[T, H]``."""
    w = target.lm_head[draft_ids].float()  # [V_d, H]
    logits = final.float() @ w.T
    cap = getattr(target.arch, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return torch.softmax(logits, dim=-1)


@dataclass
class TTTStep:
    """One training-time-test step: its rows (indices into the batch's step-1 rows, i.e. the roots t),
    the head's hidden states ``[rows, H]``, the batch rows of ``x_{t+j}`` (whose target distribution,
    at that position, is the label), and which rows are trained."""

    rows: torch.Tensor
    hidden: torch.Tensor
    src: torch.Tensor
    trained: torch.Tensor


def ttt_unroll(head: nn.Module, target: FrozenTarget, batch: Eagle3Batch, steps: int) -> list[TTTStep]:
    """Run the head ``steps`` drafting steps as the training-time test does (module docstring)."""
    device = target.embed.device
    lens, starts = batch.lens, batch.starts
    offsets = torch.tensor([0, *lens]).cumsum(0)[:-1]
    local = torch.cat([torch.arange(n) for n in lens])  # t within its sequence
    length = torch.cat([torch.full((n,), n) for n in lens])
    start = torch.cat([torch.full((n,), s) for n, s in zip(lens, starts)])
    base = torch.cat([torch.full((n,), int(o)) for n, o in zip(lens, offsets)])
    tokens = batch.tokens.to(device)
    attention = TTTAttention(lens, device)
    # Steps after the first: only rows whose chain can reach the response.
    later = torch.nonzero(local >= start - steps - 1).flatten()
    out: list[TTTStep] = []
    hidden = batch.aux.to(device).float()
    rows = torch.arange(batch.num_rows)
    for j in range(1, steps + 1):
        if j == 2:
            rows = later
            attention.next_step(rows.to(device))
            hidden = hidden[rows.to(device)]
        t = local[rows]
        src = (base[rows] + torch.clamp(t + j, max=length[rows] - 1)).to(device)  # x_{t+j} (clamped)
        embeds = target.embed[tokens[src]]
        positions = (t + j - 1).to(device)
        hidden = head(embeds, hidden, positions, (None, None), None, attention)  # type: ignore[arg-type]
        q = t + j  # the position whose target distribution is the label (of x_{t+j+1})
        trained = ((q + 1 <= length[rows] - 1) & (q + 1 >= start[rows])).to(device)
        out.append(TTTStep(rows, hidden, src, trained))
    return out


def eagle3_forward(head: nn.Module, target: FrozenTarget, batch: Eagle3Batch, steps: int) -> list[StepLoss]:
    """The training-time test over ``steps`` drafting steps; one :class:`StepLoss` per step."""
    device = target.embed.device
    draft_ids = head.target_ids().to(device)  # type: ignore[operator]
    top = batch.top.to(device)  # -1 where not computed (prompt rows)
    in_vocab = (top >= 0) & head.t2d.to(device)[top.clamp(min=0)]  # type: ignore[index]
    with torch.no_grad():
        probs_all = target_draft_probs(target, batch.final.to(device), draft_ids)  # [T, V_d]
        draft_top = probs_all.argmax(-1)
    out: list[StepLoss] = []
    for step in ttt_unroll(head, target, batch, steps):
        ok = step.trained & in_vocab[step.src]
        if not bool(ok.any()):
            out.append(StepLoss(step.hidden.sum() * 0.0, 0, 0.0))
            continue
        logp = torch.log_softmax(head.logits(step.hidden[ok]), dim=-1)  # type: ignore[operator]
        wanted = probs_all[step.src[ok]]
        loss = -(wanted * logp).sum(-1).mean()
        hits = float((logp.argmax(-1) == draft_top[step.src[ok]]).sum())
        out.append(StepLoss(loss, int(ok.sum()), hits))
    return out


def eagle3_step(
    head: nn.Module, target: FrozenTarget, batch: Eagle3Batch, steps: int, decay: float
) -> tuple[float, dict[str, Any], int]:
    """One optimisation step's gradients (accumulated into ``head``): the ``decay``-weighted mean of the
    steps' losses. Returns the loss, per-step losses and top-1 accuracies, and the step-1 rows trained."""
    losses = eagle3_forward(head, target, batch, steps)
    weights = [decay**j for j in range(len(losses))]
    total = sum(w * s.loss for w, s in zip(weights, losses)) / sum(weights)
    assert isinstance(total, torch.Tensor)
    total.backward()
    parts: dict[str, Any] = {f"loss_step{j + 1}": float(s.loss.detach()) for j, s in enumerate(losses)}
    parts.update({f"top1_step{j + 1}": s.hits / max(s.rows, 1) for j, s in enumerate(losses)})
    return float(total.detach()), parts, losses[0].rows


def select_draft_vocab(
    data: DistilData, size: int, eos_token_ids: Sequence[int], vocab_size: int
) -> list[int]:
    """The draft vocabulary: ``size`` target ids, the EOS tokens first, then by how often each is the
    target's top token at a response position of ``data``, then by how often it occurs in the
    responses, then the lowest unused ids (deterministic; ties broken by id).

    Raises:
        ValueError: ``size`` outside ``[len(eos_token_ids), vocab_size]``, or data without top tokens.
    """
    if data.top_tokens is None:
        raise ValueError("the draft vocabulary is chosen from data made with data.feature_layers")
    eos = list(dict.fromkeys(int(e) for e in eos_token_ids if 0 <= int(e) < vocab_size))
    if not len(eos) <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be in [{len(eos)}, {vocab_size}]")
    top: Counter[int] = Counter()
    seen: Counter[int] = Counter()
    for toks, tops, s in zip(data.tokens, data.top_tokens, data.starts):
        top.update(tops[max(s - 1, 0) : len(toks) - 1].tolist())
        seen.update(toks[s:].tolist())
    chosen = dict.fromkeys(eos)
    for counter in (top, seen):
        for tok, _ in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(chosen) >= size:
                break
            chosen.setdefault(int(tok))
    tok = 0
    while len(chosen) < size:
        chosen.setdefault(tok)
        tok += 1
    return list(chosen)[:size]


def vocab_coverage(data: DistilData, draft_ids: Sequence[int]) -> float:
    """Share of response positions whose target top token is in the draft vocabulary."""
    assert data.top_tokens is not None
    ids = torch.tensor(sorted(set(int(i) for i in draft_ids)))
    hit = total = 0
    for toks, tops, s in zip(data.tokens, data.top_tokens, data.starts):
        t = tops[max(s - 1, 0) : len(toks) - 1].long()
        hit += int(torch.isin(t, ids).sum())
        total += len(t)
    return hit / max(total, 1)
