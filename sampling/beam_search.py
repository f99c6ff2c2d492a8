"""Beam search parameters and the model-free bookkeeping of one prompt's beams.

Standard beam search (Graves 2012; Sutskever et al. 2014) keeps the ``beam_width`` best partial
sequences by cumulative log-probability and extends each by every token; finished hypotheses are ranked
by a length-normalised score (length normalisation as in Wu et al. 2016, "Google's Neural Machine
Translation System", §7, in transformers' simpler form ``sum_logprobs / length ** length_penalty``).

:class:`BeamSearchState` reproduces the decisions of transformers' vectorised beam search
(``GenerationMixin._beam_search`` and its helpers ``_get_top_k_continuations``,
``_get_running_beams_for_next_iteration``, ``_update_finished_beams``, ``_check_early_stop_heuristic``
and ``_beam_search_has_unfinished_sequences`` in ``transformers/generation/utils.py``, 4.50+), written
here per prompt with lists instead of padded ``[batch, beams, max_length]`` tensors. The float32
arithmetic on scores is the same as transformers' (the same tensor ops in the same order), so equal
logits give equal decisions.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from grammars.errors import InvalidRequestError
from sampling.params import coerce_scalars

#: Accepted values of :attr:`BeamSearchParams.early_stopping` (as in transformers' ``GenerationConfig``).
EARLY_STOPPING_MODES = (True, False, "never")


def _is_int(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, int)


@dataclass
class BeamSearchParams:
    """Deterministic beam search, with transformers' ``generate(num_beams=...)`` semantics.

    Attributes:
        beam_width: beams kept per prompt (transformers' ``num_beams``); an integer >= 1.
        max_tokens: most tokens generated per hypothesis (``max_new_tokens``); an integer >= 1. Also capped
            by the engine's ``max_model_len``.
        length_penalty: finished hypotheses score ``sum_logprobs / generated_length ** length_penalty``;
            > 0 favours longer, < 0 shorter sequences. A finite number.
        early_stopping: when a prompt's search ends (transformers' ``early_stopping``): True, as soon as
            ``beam_width`` hypotheses have finished; False, once ``beam_width`` have finished and the best
            running beam, scored at its current length, cannot beat the worst of them (a heuristic when
            ``length_penalty > 0``); "never", once ``beam_width`` have finished and no running beam can
            beat the worst at any length up to ``max_tokens`` (exact, the canonical stopping rule). Every
            mode also ends at ``max_tokens``.
        num_return_sequences: best finished hypotheses returned per prompt; 1 <= it <= ``beam_width``.
        ignore_eos: EOS is an ordinary token (transformers with ``eos_token_id=None``); every hypothesis
            then runs to ``max_tokens``.

    Raises:
        InvalidRequestError (a ``ValueError``): at construction (and from :meth:`validate`), naming the
            first invalid field and its allowed range.
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (again: the dataclass is mutable, so the driver re-checks before running).

        Raises:
            InvalidRequestError: naming the first invalid field and its allowed range.
        """
        coerce_scalars(self, ("length_penalty",), ("beam_width", "max_tokens", "num_return_sequences"))
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise InvalidRequestError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise InvalidRequestError(f"length_penalty must be a finite number, got {lp!r}")
        es = self.early_stopping
        if not (isinstance(es, bool) or (isinstance(es, str) and es == "never")):
            raise InvalidRequestError(f"early_stopping must be True, False or 'never', got {es!r}")
        n = self.num_return_sequences
        if not _is_int(n) or not 1 <= n <= self.beam_width:
            raise InvalidRequestError(
                f"num_return_sequences must be an integer in [1, beam_width={self.beam_width}], got {n!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


def beams_to_keep(beam_width: int, num_eos_tokens: int) -> int:
    """Candidates kept per step: ``max(2, 1 + num_eos_tokens) * beam_width`` (transformers' K).

    At most ``num_eos_tokens`` candidates per beam end in EOS, so K candidates always hold at least
    ``beam_width`` that can keep running.
    """
    return max(2, 1 + num_eos_tokens) * beam_width


@dataclass
class Hypothesis:
    """A finished beam.

    Attributes:
        token_ids: generated tokens (prompt excluded), EOS included when it ended the hypothesis.
        cum_logprob: float32 sum of the tokens' log-probabilities.
        score: ``cum_logprob / len(token_ids) ** length_penalty`` in float32 (transformers'
            ``sequences_scores``).
        finished_by_eos: True when the last token is EOS, False when ``max_tokens`` ended it.
    """

    token_ids: list[int]
    cum_logprob: float
    score: float
    finished_by_eos: bool


class BeamSearchState:
    """The beams of one prompt: running beams, finished hypotheses, and when the search is done.

    Usage: feed :meth:`step` the next-token log-probabilities of every running beam (rows in the order of
    :attr:`running`) until :attr:`done`; it returns which running beam each new beam continues, so that
    the caller can fork the KV (block tables) accordingly; then read :meth:`best`.

    Args:
        params: the search parameters.
        max_new_tokens: tokens at which a hypothesis ends (``params.max_tokens`` capped by the model
            length); transformers' ``max_length - prompt_length``.
        eos_token_ids: tokens that finish a hypothesis (ignored when ``params.ignore_eos``).

    Semantics (transformers' vectorised beam search, per prompt; "rank" counts from 0):

    1. The search starts from a single running beam (the prompt) with score 0 (transformers' other
       initial beams are copies of it with score -1e9, which never win while the vocabulary holds K
       tokens; see :func:`beams_to_keep`).
    2. Each step takes the top K candidates over running beams × vocabulary by running score +
       log_softmax (float32), best first.
    3. A candidate *hits* when its token is EOS or it reaches ``max_new_tokens``. Hitting candidates of
       rank < ``beam_width`` become finished hypotheses scored ``cum_logprob / generated_length **
       length_penalty`` (generated_length counts the new token, EOS included), unless the search can no
       longer improve or (``early_stopping is True``) ``beam_width`` hypotheses have already finished. The
       best ``beam_width`` finished hypotheses are kept, best first.
    4. The best ``beam_width`` candidates that do not hit become the running beams.
    5. Once ``beam_width`` hypotheses have finished, improvement is judged impossible (for good) when the
       best running score divided by ``L ** length_penalty`` is not above the worst finished score, where
       ``L`` is ``max_new_tokens`` for ``early_stopping="never"`` with ``length_penalty > 0`` and the
       running beams' current length otherwise.
    6. The search is done when improvement is impossible, or ``beam_width`` hypotheses have finished and
       ``early_stopping is True``, or every candidate of the step hit (``max_new_tokens`` reached).
    """

    def __init__(self, params: BeamSearchParams, max_new_tokens: int, eos_token_ids: Collection[int]) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.num_candidates = beams_to_keep(params.beam_width, len(self.eos_token_ids))
        #: Generated tokens of each running beam, best first.
        self.running: list[list[int]] = [[]]
        #: ``[len(running)]`` float32 cumulative log-probabilities of the running beams.
        self.running_scores = torch.zeros(1, dtype=torch.float32)
        #: Finished hypotheses, best first, at most ``beam_width``.
        self.finished: list[Hypothesis] = []
        self.improvement_possible = True
        self.done = False
        #: Tokens generated so far by every running beam.
        self.num_generated = 0

    @property
    def _finished_full(self) -> bool:
        return len(self.finished) >= self.params.beam_width

    def step(self, log_probs: torch.Tensor) -> list[tuple[int, int]]:
        """Advance every running beam by one token.

        Args:
            log_probs: ``[len(running), vocab_size]`` float32 log_softmax of each running beam's
                next-token logits, rows in the order of :attr:`running`.

        Returns:
            ``(parent_row, token_id)`` of each new running beam, best first (empty once :attr:`done`).

        Raises:
            RuntimeError: called after the search is done.
            ValueError: ``log_probs`` has the wrong number of rows.
        """
        if self.done:
            raise RuntimeError("the beam search of this prompt is already done")
        if log_probs.dim() != 2 or log_probs.shape[0] != len(self.running):
            raise ValueError(
                f"log_probs must be [{len(self.running)}, vocab_size], got {tuple(log_probs.shape)}"
            )
        width, lp = self.params.beam_width, self.params.length_penalty
        vocab_size = log_probs.shape[1]
        totals = (log_probs.float() + self.running_scores[:, None]).reshape(-1)
        cand_scores, flat = torch.topk(totals, min(self.num_candidates, totals.numel()))
        parents = (flat // vocab_size).tolist()
        tokens = (flat % vocab_size).tolist()
        length = self.num_generated + 1
        at_limit = length >= self.max_new_tokens
        hits = [at_limit or t in self.eos_token_ids for t in tokens]

        # Finished hypotheses: hitting candidates among the first beam_width ranks (step 3).
        if self.improvement_possible and not (self._finished_full and self.params.early_stopping is True):
            ranks = [r for r in range(min(width, len(tokens))) if hits[r]]
            if ranks:
                scores = cand_scores[ranks] / (length**lp)
                for r, score in zip(ranks, scores.tolist()):
                    hyp = Hypothesis(
                        self.running[parents[r]] + [tokens[r]],
                        float(cand_scores[r]),
                        score,
                        tokens[r] in self.eos_token_ids,
                    )
                    self.finished.append(hyp)
                # Stable: on equal scores earlier hypotheses stay ahead.
                self.finished.sort(key=lambda h: h.score, reverse=True)
                del self.finished[width:]

        # Running beams: the best beam_width candidates that do not hit (step 4).
        rows = [r for r in range(len(tokens)) if not hits[r]][:width]
        self.running = [self.running[parents[r]] + [tokens[r]] for r in rows]
        self.running_scores = cand_scores[rows]
        self.num_generated = length

        # Can the running beams still beat the worst finished hypothesis? (step 5)
        if rows and self._finished_full and self.improvement_possible:
            never = self.params.early_stopping == "never" and lp > 0
            best_length = self.max_new_tokens if never else self.num_generated
            bound = self.running_scores[:1] / (best_length**lp)
            self.improvement_possible = bool(bound[0] > self.finished[-1].score)
        self.done = (
            not rows
            or not self.improvement_possible
            or (self._finished_full and self.params.early_stopping is True)
        )
        return [] if self.done else [(parents[r], tokens[r]) for r in rows]

    def best(self, n: int | None = None) -> list[Hypothesis]:
        """The ``n`` (default ``num_return_sequences``) best finished hypotheses, best first.

        Raises:
            RuntimeError: the search is not done yet.
        """
        if not self.done:
            raise RuntimeError("the beam search of this prompt is not done yet")
        return self.finished[: self.params.num_return_sequences if n is None else n]
