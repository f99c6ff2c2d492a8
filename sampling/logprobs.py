"""Log-probabilities of generated tokens under the processed distribution (``SamplingParams.logprobs``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under its row's processed distribution.

    Attributes:
        logprob: natural log of the probability (``-inf`` for a token the processors removed).
        rank: 1 + the number of tokens with a strictly larger probability.
    """

    logprob: float
    rank: int


def token_logprobs(
    processed_logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[dict[int, Logprob]]:
    """Per row: the chosen token's and the ``num_top[i]`` most likely tokens' log-probabilities.

    Args:
        processed_logits: ``[rows, vocab]`` float32 (``log_softmax`` of a row = its processed log-probs).
        token_ids: ``[rows]`` the token chosen at each row.
        num_top: per row, N (0: the chosen token only).

    Returns:
        Per row, a dict token id -> :class:`Logprob`, the chosen token first, then the top N in order.
    """
    if processed_logits.shape[0] != len(token_ids):
        raise ValueError(f"{processed_logits.shape[0]} rows but {len(token_ids)} chosen tokens")
    logp = torch.log_softmax(processed_logits.float(), dim=-1)
    chosen = torch.tensor(list(token_ids), dtype=torch.int64, device=logp.device)
    chosen_logp = logp.gather(1, chosen[:, None])
    ranks = (logp > chosen_logp).sum(dim=-1) + 1
    k = max(num_top, default=0)
    top_vals, top_ids = logp.topk(k, dim=-1) if k else (None, None)
    out: list[dict[int, Logprob]] = []
    chosen_list = chosen_logp[:, 0].tolist()
    ranks_list = ranks.tolist()
    for i, t in enumerate(token_ids):
        d = {int(t): Logprob(chosen_list[i], ranks_list[i])}
        if num_top[i] and top_vals is not None and top_ids is not None:
            vals = top_vals[i, : num_top[i]].tolist()
            for r, (v, tok) in enumerate(zip(vals, top_ids[i, : num_top[i]].tolist())):
                rank = 1 + sum(1 for u in vals[:r] if u > v)  # ties share a rank
                d.setdefault(int(tok), Logprob(v, rank))
        out.append(d)
    return out
