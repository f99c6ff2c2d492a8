"""Rejection sampling of a flattened batch of draft chains (greedy and random requests mixed).

Semantics (those of :class:`sampling.rejection_sampler.RejectionSampler`, which calls this op): request
``b`` has ``m_b = cu_num_draft_tokens[b + 1] - cu_num_draft_tokens[b]`` drafts, flattened in
``draft_token_ids``; its ``m_b + 1`` target rows are ``target_probs[cu[b] + b : cu[b + 1] + b + 1]``.

- Greedy request: draft ``j`` is accepted while it equals the argmax of its target row; then the argmax
  of the next row is emitted (recovered or bonus).
- Random request: draft ``j`` (token ``d``) is accepted iff ``uniforms[j] * q < p`` with ``p`` the
  target's and ``q`` the drafter's probability of ``d`` (``q = 1`` without draft probabilities: a
  deterministic drafter), the product and comparison in float64 (as Python floats compare). At the
  first rejection the recovered token is ``argmax(residual / noise[b])``, ``residual = max(0, target -
  draft)`` (the target row with ``d`` zeroed for a deterministic drafter), or the target row itself when
  the residual's sum is not in ``(tiny, inf)``; after all ``m_b`` accepted, the bonus token is
  ``argmax(target[last] / noise[b])``. ``noise`` is Exp(1), clamped below at float32's tiny: the
  exponential race of :mod:`sampling.sampler`.

The caller supplies every random number (``uniforms`` per draft, one ``noise`` row per request), so the
kernel and the reference are fed identical draws and must agree exactly. Output: ``[B, max_spec_len +
1]`` int64, the accepted drafts then the recovered/bonus token, then :data:`PLACEHOLDER` (-1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels._triton import lazy_jit, next_power_of_2, use_triton

if TYPE_CHECKING:  # at run time lazy_jit binds `tl` when it first jits a kernel of this module
    import triton.language as tl

PLACEHOLDER = -1
_TINY = torch.finfo(torch.float32).tiny
#: Vocabulary entries per step of the kernel's loops over a row.
BLOCK_V = 1024


def _check(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    is_greedy: torch.Tensor,
) -> None:
    num_drafts, num_reqs = draft_token_ids.shape[0], cu_num_draft_tokens.shape[0] - 1
    vocab = target_probs.shape[1]
    if target_probs.shape[0] != num_drafts + num_reqs:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, expected {num_drafts + num_reqs}")
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts, vocab):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)}, expected {(num_drafts, vocab)}")
    if uniforms.shape != (num_drafts,) or tuple(noise.shape) != (num_reqs, vocab):
        raise ValueError(
            f"uniforms {tuple(uniforms.shape)} / noise {tuple(noise.shape)} do not fit the batch"
        )
    if is_greedy.shape != (num_reqs,):
        raise ValueError(f"is_greedy {tuple(is_greedy.shape)}, expected {(num_reqs,)}")


# ----------------------------------------------------------------------------------------- reference
def rejection_sample_ref(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    is_greedy: torch.Tensor,
    max_spec_len: int,
) -> torch.Tensor:
    """The reference, vectorised over the batch in torch (see the module docstring).

    Args:
        draft_token_ids: ``[N]`` int64, every request's drafts in order.
        cu_num_draft_tokens: ``[B + 1]`` int64, 0 then cumulative draft counts.
        draft_probs: ``[N, V]`` float32 or None (every drafter deterministic).
        target_probs: ``[N + B, V]`` float32 (greedy requests' rows: any scores, only argmax is read).
        uniforms: ``[N]`` float32 in [0, 1) (greedy requests' entries unused).
        noise: ``[B, V]`` float32 Exp(1) (greedy requests' rows unused).
        is_greedy: ``[B]`` bool.
        max_spec_len: ``>= max m_b``; the output has ``max_spec_len + 1`` columns.

    Returns:
        ``[B, max_spec_len + 1]`` int64.
    """
    _check(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, uniforms, noise, is_greedy)
    device = target_probs.device
    num_drafts, num_reqs = draft_token_ids.shape[0], cu_num_draft_tokens.shape[0] - 1
    cu = cu_num_draft_tokens.to(device=device, dtype=torch.int64)
    counts = cu[1:] - cu[:-1]
    out = torch.full((num_reqs, max_spec_len + 1), PLACEHOLDER, dtype=torch.int64, device=device)
    if num_reqs == 0:
        return out
    greedy = is_greedy.to(device=device, dtype=torch.bool)
    req = torch.repeat_interleave(torch.arange(num_reqs, device=device), counts, output_size=num_drafts)
    pos = torch.arange(num_drafts, device=device) - cu[:-1][req]  # index of each draft in its request
    drafts = draft_token_ids.to(device=device, dtype=torch.int64)
    target_rows = torch.arange(num_drafts, device=device) + req

    # Acceptance of every draft as if no earlier one had been rejected.
    t_d = target_probs[target_rows, drafts].double()
    if draft_probs is None:
        q_d = torch.ones_like(t_d)
    else:
        q_d = draft_probs[torch.arange(num_drafts, device=device), drafts].double()
    accept = uniforms.to(device).double() * q_d < t_d
    row_argmax = None
    if bool(greedy.any()):
        row_argmax = target_probs.max(dim=-1).indices  # argmax's first maximum, every row once
        accept = torch.where(greedy[req], drafts == row_argmax[target_rows], accept)
    # Accepted = drafts before the request's first rejection.
    first_reject = torch.where(~accept, pos, torch.full_like(pos, max_spec_len + 1))
    num_accepted = counts.clone().scatter_reduce_(0, req, first_reject, reduce="amin")
    kept = pos < num_accepted[req]
    out[req[kept], pos[kept]] = drafts[kept]

    # The recovered (rejection) or bonus (all accepted) token.
    final_row = cu[:-1] + torch.arange(num_reqs, device=device) + num_accepted  # [B] rows of target_probs
    token = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    if row_argmax is not None:
        token = row_argmax[final_row]
    sampled = (~greedy).nonzero().squeeze(1)  # random requests
    if sampled.numel():
        weights = target_probs[final_row[sampled]]  # [S, V], a copy
        rejected = num_accepted[sampled] < counts[sampled]
        if bool(rejected.any()):
            rej = rejected.nonzero().squeeze(1)  # index into `sampled`
            draft_at = cu[:-1][sampled[rej]] + num_accepted[sampled[rej]]  # flat index of the rejected draft
            if draft_probs is None:
                weights[rej, drafts[draft_at]] = 0.0
            else:
                weights[rej] = (weights[rej] - draft_probs[draft_at]).clamp_(min=0.0)
            total = weights[rej].sum(dim=-1)
            fallback = rej[~((total > _TINY) & (total < float("inf")))]
            weights[fallback] = target_probs[final_row[sampled[fallback]]]
        race = weights.div_(noise.to(device)[sampled].clamp_(min=_TINY))
        token[sampled] = race.max(dim=-1).indices  # argmax's first maximum, 2-5x faster on the CPU
    out[torch.arange(num_reqs, device=device), num_accepted] = token
    return out


# ----------------------------------------------------------------------------------------- kernel
@lazy_jit
def _rejection_sample_kernel(
    out_ptr,
    draft_ids_ptr,
    cu_ptr,
    draft_probs_ptr,
    target_ptr,
    uniforms_ptr,
    noise_ptr,
    greedy_ptr,
    vocab_size,
    stride_out,
    stride_dp,
    stride_tp,
    stride_noise,
    tiny,
    HAS_DRAFT_PROBS: tl.constexpr,
    OUT_COLS: tl.constexpr,
    OUT_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Scalar conditions join block masks through tl.where, never & or |: the interpreter turns a
    # scalar & block of booleans into int32.
    b = tl.program_id(0)
    d0 = tl.load(cu_ptr + b).to(tl.int32)
    m = tl.load(cu_ptr + b + 1).to(tl.int32) - d0
    row0 = d0 + b  # first target row of the request
    greedy = tl.load(greedy_ptr + b) != 0
    out_row = out_ptr + b.to(tl.int64) * stride_out

    n_blocks = tl.cdiv(vocab_size, BLOCK)
    num_accepted = m
    done = m < 0  # false
    for j in range(0, m):
        tok = tl.load(draft_ids_ptr + d0 + j)
        t_row = target_ptr + (row0 + j).to(tl.int64) * stride_tp
        # Greedy: the draft must be the argmax of its row (first index on ties); rows are read only
        # while a greedy request is still accepting.
        best = tl.full([], float("-inf"), dtype=tl.float32)
        am = tl.full([], 0, dtype=tl.int32)
        for i in range(0, tl.where(greedy & ~done, n_blocks, 0)):
            v = i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(t_row + v, mask=v < vocab_size, other=float("-inf")).to(tl.float32)
            mx = tl.max(x, axis=0)
            better = mx > best
            am = tl.where(better, tl.argmax(x, axis=0, tie_break_left=True).to(tl.int32) + i * BLOCK, am)
            best = tl.where(better, mx, best)
        # Random: u * q < p in float64.
        p = tl.load(t_row + tok).to(tl.float64)
        q = tl.full([], 1.0, dtype=tl.float64)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + (d0 + j).to(tl.int64) * stride_dp + tok).to(tl.float64)
        u = tl.load(uniforms_ptr + d0 + j).to(tl.float64)
        accept = tl.where(greedy, tok == am, u * q < p)
        rejected_here = ~done & ~accept
        num_accepted = tl.where(rejected_here, j, num_accepted)
        done = done | rejected_here
        tl.store(out_row + j, tok, mask=~done)

    rejected = num_accepted < m
    f_row = target_ptr + (row0 + num_accepted).to(tl.int64) * stride_tp
    d_row = draft_probs_ptr + (d0 + num_accepted).to(tl.int64) * stride_dp
    rej_tok = tl.load(draft_ids_ptr + d0 + num_accepted, mask=rejected, other=-1)
    n_row = noise_ptr + b.to(tl.int64) * stride_noise

    # Pass 1 (random request, rejected): the residual's mass decides the fallback to the target row.
    total = tl.zeros([BLOCK], dtype=tl.float32)
    n_pass1 = tl.where(rejected & ~greedy, n_blocks, 0)
    for i in range(0, n_pass1):
        v = i * BLOCK + tl.arange(0, BLOCK)
        ok = v < vocab_size
        t = tl.load(f_row + v, mask=ok, other=0.0).to(tl.float32)
        if HAS_DRAFT_PROBS:
            qv = tl.load(d_row + v, mask=ok, other=0.0).to(tl.float32)
            total += tl.maximum(t - qv, 0.0)
        else:
            total += tl.where(v == rej_tok, 0.0, t)
    mass = tl.sum(total, axis=0)
    use_residual = rejected & ~greedy & (mass > tiny) & (mass < float("inf"))

    # Pass 2: argmax of the target row (greedy) or of weights / noise (random).
    best = tl.full([], float("-inf"), dtype=tl.float32)
    best_idx = tl.full([], 0, dtype=tl.int32)
    for i in range(0, n_blocks):
        v = i * BLOCK + tl.arange(0, BLOCK)
        ok = v < vocab_size
        t = tl.load(f_row + v, mask=ok, other=0.0).to(tl.float32)
        w = t
        if HAS_DRAFT_PROBS:
            qv = tl.load(d_row + v, mask=tl.where(use_residual, ok, False), other=0.0).to(tl.float32)
            w = tl.where(use_residual, tl.maximum(t - qv, 0.0), t)
        else:
            w = tl.where(use_residual, tl.where(v == rej_tok, 0.0, t), t)
        e = tl.load(n_row + v, mask=tl.where(greedy, False, ok), other=1.0).to(tl.float32)
        race = tl.math.div_rn(w, tl.maximum(e, tiny))
        x = tl.where(greedy, t, race)
        x = tl.where(ok, x, float("-inf"))
        mx = tl.max(x, axis=0)
        idx = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int32) + i * BLOCK
        better = mx > best
        best_idx = tl.where(better, idx, best_idx)
        best = tl.where(better, mx, best)

    tl.store(out_row + num_accepted, best_idx.to(tl.int64))
    cols = tl.arange(0, OUT_PAD)
    tl.store(
        out_row + cols,
        tl.full([OUT_PAD], -1, dtype=tl.int64),
        mask=(cols > num_accepted) & (cols < OUT_COLS),
    )


def rejection_sample_triton(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    is_greedy: torch.Tensor,
    max_spec_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the Triton kernel (one program per request); arguments and result as
    :func:`rejection_sample_ref`. Rows of the probability tensors must be contiguous."""
    _check(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, uniforms, noise, is_greedy)
    num_reqs = cu_num_draft_tokens.shape[0] - 1
    vocab = target_probs.shape[1]
    if out is None:
        out = torch.empty(num_reqs, max_spec_len + 1, dtype=torch.int64, device=target_probs.device)
    if num_reqs == 0:
        return out
    for t in (target_probs, noise, *(() if draft_probs is None else (draft_probs,))):
        if t.stride(1) != 1:
            raise ValueError("probability and noise rows must be contiguous")
    _rejection_sample_kernel[(num_reqs,)](
        out,
        draft_token_ids,
        cu_num_draft_tokens,
        draft_probs if draft_probs is not None else target_probs,
        target_probs,
        uniforms,
        noise,
        is_greedy,
        vocab,
        out.stride(0),
        draft_probs.stride(0) if draft_probs is not None else 0,
        target_probs.stride(0),
        noise.stride(0),
        _TINY,
        HAS_DRAFT_PROBS=draft_probs is not None,
        OUT_COLS=max_spec_len + 1,
        OUT_PAD=next_power_of_2(max_spec_len + 1),
        BLOCK=min(BLOCK_V, max(16, next_power_of_2(vocab))),
    )
    return out


def rejection_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    is_greedy: torch.Tensor,
    max_spec_len: int,
) -> torch.Tensor:
    """Rejection sampling: Triton on CUDA, :func:`rejection_sample_ref` elsewhere."""
    args = (draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, uniforms, noise, is_greedy)
    rows_contiguous = all(t.stride(1) == 1 for t in (target_probs, noise) + args[2:3] if t is not None)
    if use_triton(target_probs, noise) and rows_contiguous:
        return rejection_sample_triton(*args, max_spec_len)
    return rejection_sample_ref(*args, max_spec_len)
