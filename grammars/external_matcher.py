"""What the llguidance and xgrammar matchers share: an external matcher that never sees EOS.

Both backends wrap a parser object with its own history (``rollback`` of any depth) and keep EOS to
themselves (see :mod:`grammars.base`): an EOS id is accepted when the external matcher is in an
accepting state and never fed to it; after it only EOS is allowed, so the count of accepted tokens is
the external matcher's plus the EOS run after them. A subclass provides :meth:`_accepting` and
:meth:`_consume` and fills mask rows itself (:meth:`_check_row` first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class ExternalMatcherGrammar:
    """Base of :class:`~grammars.llguidance_backend.LLGuidanceGrammar` and
    :class:`~grammars.xgrammar_backend.XGrammarGrammar` (implements the EOS side of
    :class:`grammars.base.Grammar`).

    Attributes:
        compiled: the compiled grammar (``vocab_size``, ``width``, ``eos_set``, ``eos_row``,
            ``ordinary`` per-id bool array).
    """

    def __init__(self, compiled: Any, matcher: Any) -> None:
        self.compiled = compiled
        self._matcher = matcher
        self._num_grammar_tokens = 0  # tokens fed to the external matcher (never EOS)
        self._num_eos = 0  # EOS ids accepted after them

    def _accepting(self) -> bool:
        """Whether the external matcher's text is a complete match."""
        raise NotImplementedError

    def _consume(self, token_id: int) -> bool:
        """Feed an ordinary token of the model vocabulary to the external matcher; False (state
        unchanged) when it is not allowed."""
        raise NotImplementedError

    def _check_row(self, bitmask: torch.Tensor, row: int) -> bool:
        """Check ``bitmask`` / ``row`` and, once EOS was accepted, write the EOS-only row; True when the
        row is written.

        Raises:
            ValueError: ``bitmask`` is not int32 ``[rows, W]``, ``W = ceil(vocab_size / 32)``.
            IndexError: ``row`` is outside the bitmask.
        """
        c = self.compiled
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[1] != c.width:
            raise ValueError(
                f"bitmask must be int32 [rows, {c.width}], got {bitmask.dtype} {list(bitmask.shape)}"
            )
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"row {row} is outside a bitmask of {bitmask.shape[0]} rows")
        if self._num_eos:
            bitmask[row].copy_(c.eos_row)
            return True
        return False

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        c = self.compiled
        if token_id in c.eos_set:
            if not (self._num_eos or self._accepting()):
                return False
            self._num_eos += 1
            return True
        if self._num_eos or not 0 <= token_id < c.vocab_size or not c.ordinary[token_id]:
            return False
        if not self._consume(token_id):
            return False
        self._num_grammar_tokens += 1
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        n = 0
        for t in token_ids:
            if not self.accept_token(t):
                break
            n += 1
        self.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted_tokens} accepted")
        eos = min(num_tokens, self._num_eos)
        self._num_eos -= eos
        grammar_tokens = num_tokens - eos
        if grammar_tokens:
            self._matcher.rollback(grammar_tokens)
            self._num_grammar_tokens -= grammar_tokens

    def reset(self) -> None:
        """Back to the initial state (everything rolled back)."""
        self.rollback(self.num_accepted_tokens)

    def is_terminated(self) -> bool:
        return self._num_eos > 0

    def is_final(self) -> bool:
        return self._num_eos > 0 or self._accepting()

    @property
    def num_accepted_tokens(self) -> int:
        return self._num_grammar_tokens + self._num_eos
