"""Exact verification of draft tokens: speculative (rejection) sampling for chains of drafts.

Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative Decoding", ICML 2023
(Algorithm 1); Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling",
2023 (Algorithm 2). Their theorem: whatever the drafter, every emitted token is distributed exactly as
the target model's (processed) distribution given the tokens before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from sampling.sampler import argmax_rows, exponential_noise

if TYPE_CHECKING:
    from sampling.verifier import VerifyInput

_TINY = torch.finfo(torch.float32).tiny


#: On a CPU the flat op pays for batches of at least this many requests over vocabularies of at most
#: ``FLAT_MAX_VOCAB`` tokens (measured on this project's 2-core CPU, one thread, k = 4: 3x faster at 3,000
#: requests over 8 tokens, 2.8x at 64 over 128, level at 16 over 4,096; per request is faster at 16
#: over 49,152, 28 vs 36 ms, and for one request at any vocabulary size).
FLAT_MIN_REQUESTS, FLAT_MAX_VOCAB = 8, 16384


def flat_pays_on_cpu(num_requests: int, vocab_size: int) -> bool:
    """Whether ``path="auto"`` takes the flat op on a CPU for this batch."""
    return num_requests >= FLAT_MIN_REQUESTS and vocab_size <= FLAT_MAX_VOCAB


@dataclass
class VerifyResult:
    """Outcome for one request: ``token_ids`` = the accepted drafts + one recovered or bonus token."""

    token_ids: list[int]
    num_accepted: int


class RejectionSampler:
    """Verifies each request's draft tokens against the target model and emits the tokens to keep.

    Vocabulary (as in vLLM's ``rejection_sampler.py``):

    - **draft tokens** ``d_1..d_m``: proposed by a drafter; ``draft_probs[j]`` is the distribution
      ``d_{j+1}`` was drawn from (None for a deterministic drafter such as n-gram lookup: then
      ``draft_probs`` is the one-hot of the draft token).
    - **target_probs**: ``m + 1`` rows per request: row j is the target's processed distribution for
      the position of draft ``j + 1``, and row m the one after the last draft.
    - **accepted tokens**: draft ``d_j`` is accepted with probability
      ``min(1, target_probs[j-1][d_j] / draft_probs[j-1][d_j])``, in order, until the first rejection.
    - **recovered token**: at the first rejection (position j), a token drawn from the *residual*
      ``normalise(max(0, target_probs[j] - draft_probs[j]))``; nothing after it is kept.
    - **bonus token**: when all m drafts are accepted, a token drawn from ``target_probs[m]``.

    Every step therefore emits between 1 and m + 1 tokens. Greedy requests take the greedy path: accept
    drafts while they equal the target's argmax, then emit the argmax (recovered or bonus), which
    reproduces greedy decoding token for token.

    Randomness: per request, first ``m`` uniforms (acceptance tests), then one exponential race (see
    :mod:`sampling.sampler`) for the recovered or bonus token, all from the request's own
    ``torch.Generator`` when it has one, so a seeded request draws the same tokens in any batch.

    Residual fallback: when the residual's mass is zero or not finite, which in exact arithmetic happens
    only if ``target_probs[j] == draft_probs[j]`` (then rejection has probability zero and only float
    rounding can reach this branch), the recovered token is drawn from ``target_probs[j]`` instead.
    This keeps the output free of NaN and of zero-probability tokens and changes the output
    distribution only on an event of probability zero in exact arithmetic.

    Execution, chosen by ``path``: ``"flat"`` sends the whole batch through one flattened op,
    :func:`kernels.rejection_sample.rejection_sample` (a Triton kernel on CUDA; its torch reference with
    ``SPECDEC_FORCE_REFERENCE=1`` or on a CPU), fed the random numbers drawn above in the same order, so the
    tokens are those of the per-request definition (:meth:`_verify_greedy`, :meth:`_verify_random`), which
    ``tests/kernels/test_rejection_sample.py`` checks exactly. ``"per_request"`` runs that definition
    (faster on a CPU at real vocabulary sizes: the flattened op needs the draft distributions copied
    into one ``[num_drafts, vocab]`` tensor). ``"auto"`` (default): flat on CUDA, and on a CPU for batches
    where it measured faster (:func:`flat_pays_on_cpu`), per request otherwise.
    A subclass that overrides :meth:`accept` or :meth:`residual` (the tests' broken verifiers) must use
    ``"per_request"``: the flat op does not call them.

    Implements :class:`sampling.verifier.Verifier` for chains (:meth:`verify_batch`).

    Raises:
        ValueError: an unknown ``path``.
    """

    def __init__(self, path: Literal["auto", "flat", "per_request"] = "auto") -> None:
        if path not in ("auto", "flat", "per_request"):
            raise ValueError(f"path must be 'auto', 'flat' or 'per_request', got {path!r}")
        self.path = path

    def verify_batch(
        self,
        target_probs: torch.Tensor,
        batch: Sequence[VerifyInput],
        default_generator: torch.Generator | None = None,
    ) -> list[VerifyResult]:
        """:class:`~sampling.verifier.Verifier` for chains: :meth:`verify` on the batch's fields.

        Raises:
            ValueError: a token tree in the batch, or rows that do not match the drafts.
        """
        if any(x.tree is not None for x in batch):
            raise ValueError("RejectionSampler verifies chains; token trees go to a TreeVerifier")
        return self.verify(
            target_probs,
            [x.draft_token_ids for x in batch],
            [x.draft_probs for x in batch],
            [x.greedy for x in batch],
            [x.generator for x in batch],
            default_generator,
        )

    def verify(
        self,
        target_probs: torch.Tensor,
        draft_token_ids: Sequence[Sequence[int]],
        draft_probs: Sequence[torch.Tensor | None],
        greedy: Sequence[bool],
        generators: Sequence[torch.Generator | None],
        default_generator: torch.Generator | None = None,
    ) -> list[VerifyResult]:
        """Verify a flattened batch of draft chains.

        Args:
            target_probs: ``[sum_i (m_i + 1), vocab_size]`` float32, request i's ``m_i + 1`` rows in
                order (for greedy requests any scores whose argmax is the target's greedy token).
            draft_token_ids: per request, its ``m_i >= 0`` draft tokens.
            draft_probs: per request, ``[m_i, vocab_size]`` float32 or None (deterministic drafter).
            greedy: per request, use the greedy path.
            generators: per request, its generator or None (then ``default_generator`` is used).

        Returns:
            Per request, the tokens to append and the number of accepted drafts.

        Raises:
            ValueError: row counts or shapes that do not match the drafts.
        """
        expected_rows = sum(len(d) + 1 for d in draft_token_ids)
        if target_probs.shape[0] != expected_rows:
            raise ValueError(f"target_probs has {target_probs.shape[0]} rows, drafts need {expected_rows}")
        flat = self.path == "flat" or (
            self.path == "auto"
            and (target_probs.is_cuda or flat_pays_on_cpu(len(draft_token_ids), target_probs.shape[1]))
        )
        if flat:
            return self._verify_flat(
                target_probs, draft_token_ids, draft_probs, greedy, generators, default_generator
            )
        return self._verify_per_request(
            target_probs, draft_token_ids, draft_probs, greedy, generators, default_generator
        )

    @staticmethod
    def _check_draft_probs(i: int, dp: torch.Tensor | None, m: int, vocab_size: int) -> None:
        if dp is not None and tuple(dp.shape) != (m, vocab_size):
            raise ValueError(f"draft_probs of request {i} has shape {tuple(dp.shape)}, expected {m} rows")

    def _verify_flat(
        self,
        target_probs: torch.Tensor,
        draft_token_ids: Sequence[Sequence[int]],
        draft_probs: Sequence[torch.Tensor | None],
        greedy: Sequence[bool],
        generators: Sequence[torch.Generator | None],
        default_generator: torch.Generator | None,
    ) -> list[VerifyResult]:
        """The batch as one :func:`kernels.rejection_sample.rejection_sample` call. Random numbers are
        drawn per random request in the order of :meth:`_verify_random`: ``m`` uniforms, then one
        exponential row (for its recovered or bonus token)."""
        from kernels.rejection_sample import PLACEHOLDER, rejection_sample

        device, vocab = target_probs.device, target_probs.shape[1]
        counts = [len(d) for d in draft_token_ids]
        num_reqs, num_drafts = len(counts), sum(counts)
        cu = [0]
        for m in counts:
            cu.append(cu[-1] + m)
        uniforms = torch.zeros(num_drafts, dtype=torch.float32, device=device)
        noise = torch.ones(num_reqs, vocab, dtype=torch.float32, device=device)
        dp_rows: list[torch.Tensor | None] = [None] * num_reqs
        for i, m in enumerate(counts):
            if greedy[i]:
                continue
            self._check_draft_probs(i, draft_probs[i], m, vocab)
            dp_rows[i] = draft_probs[i]
            gen = generators[i] if generators[i] is not None else default_generator
            if m:
                uniforms[cu[i] : cu[i + 1]] = torch.rand(m, generator=gen, device=device)
            noise[i] = exponential_noise((1, vocab), [gen], gen, device)[0]
        flat_dp: torch.Tensor | None = None
        if any(dp is not None and dp.shape[0] for dp in dp_rows):
            # Deterministic drafts as one-hot rows: max(0, p - onehot) is p with the draft zeroed and
            # q = 1, exactly, for probabilities p <= 1. Greedy requests' rows are never read.
            flat_dp = torch.zeros(num_drafts, vocab, dtype=torch.float32, device=device)
            for i, dp in enumerate(dp_rows):
                if dp is not None:
                    flat_dp[cu[i] : cu[i + 1]] = dp
                elif not greedy[i] and counts[i]:
                    rows = torch.arange(cu[i], cu[i + 1], device=device)
                    flat_dp[rows, torch.tensor(list(draft_token_ids[i]), device=device)] = 1.0
        out = rejection_sample(
            torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.int64, device=device),
            torch.tensor(cu, dtype=torch.int64, device=device),
            flat_dp,
            target_probs,
            uniforms,
            noise,
            torch.tensor(list(greedy), dtype=torch.bool, device=device),
            max(counts, default=0),
        )
        results = []
        for row in out.tolist():
            tokens = [t for t in row if t != PLACEHOLDER]
            results.append(VerifyResult(tokens, len(tokens) - 1))
        return results

    def _verify_per_request(
        self,
        target_probs: torch.Tensor,
        draft_token_ids: Sequence[Sequence[int]],
        draft_probs: Sequence[torch.Tensor | None],
        greedy: Sequence[bool],
        generators: Sequence[torch.Generator | None],
        default_generator: torch.Generator | None,
    ) -> list[VerifyResult]:
        """The definition, one request at a time, through :meth:`accept`, :meth:`residual` and
        :meth:`_race`."""
        results: list[VerifyResult] = []
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        argmax = argmax_rows(target_probs).tolist() if greedy_rows else []
        start = 0
        for i, drafts in enumerate(draft_token_ids):
            m = len(drafts)
            if greedy[i]:
                results.append(self._verify_greedy(list(drafts), argmax[start : start + m + 1]))
            else:
                dp = draft_probs[i]
                self._check_draft_probs(i, dp, m, target_probs.shape[1])
                gen = generators[i] if generators[i] is not None else default_generator
                results.append(
                    self._verify_random(target_probs[start : start + m + 1], list(drafts), dp, gen)
                )
            start += m + 1
        return results

    @staticmethod
    def _verify_greedy(drafts: list[int], argmax: list[int]) -> VerifyResult:
        for j, d in enumerate(drafts):
            if d != argmax[j]:
                return VerifyResult(drafts[:j] + [argmax[j]], j)
        return VerifyResult(drafts + [argmax[len(drafts)]], len(drafts))

    def _verify_random(
        self,
        target_probs: torch.Tensor,
        drafts: list[int],
        draft_probs: torch.Tensor | None,
        generator: torch.Generator | None,
    ) -> VerifyResult:
        m = len(drafts)
        if m:
            uniforms = torch.rand(m, generator=generator, device=target_probs.device).tolist()
            idx = torch.arange(m, device=target_probs.device)
            d = torch.tensor(drafts, device=target_probs.device)
            t_d = target_probs[idx, d].tolist()
            q_d = draft_probs[idx, d].tolist() if draft_probs is not None else [1.0] * m
            for j in range(m):
                if not self.accept(uniforms[j], t_d[j], q_d[j]):
                    residual = self.residual(
                        target_probs[j], None if draft_probs is None else draft_probs[j], drafts[j]
                    )
                    return VerifyResult(drafts[:j] + [self._race(residual, target_probs[j], generator)], j)
        return VerifyResult(drafts + [self._race(target_probs[m], target_probs[m], generator)], m)

    @staticmethod
    def accept(uniform: float, target_prob: float, draft_prob: float) -> bool:
        """Accept with probability ``min(1, target_prob / draft_prob)``: ``uniform < t / q``."""
        return uniform * draft_prob < target_prob

    @staticmethod
    def residual(target_row: torch.Tensor, draft_row: torch.Tensor | None, draft_token: int) -> torch.Tensor:
        """Unnormalised ``max(0, target_probs - draft_probs)`` (one-hot draft when ``draft_row`` is None)."""
        if draft_row is None:
            res = target_row.clone()
            res[draft_token] = 0.0
            return res
        return (target_row - draft_row).clamp_(min=0.0)

    @staticmethod
    def _race(weights: torch.Tensor, fallback: torch.Tensor, generator: torch.Generator | None) -> int:
        """One token with probability proportional to ``weights`` (exponential race)."""
        total = float(weights.sum())
        if not (total > _TINY and total < float("inf")):
            weights = fallback
        noise = exponential_noise((1, weights.shape[0]), [generator], generator, weights.device)[0]
        return int(argmax_rows(weights.div(noise.clamp_(min=_TINY))))
