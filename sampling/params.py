"""Per-request sampling parameters.

Names and meanings follow vLLM's offline API (``vllm.SamplingParams``) so researchers feel at home.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from specdec.errors import InvalidRequestError

#: Temperatures below this are treated as greedy decoding (argmax).
GREEDY_EPSILON = 1e-5


@dataclass
class SamplingParams:
    """How one request draws its tokens.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it before softmax. Must be
            a finite number >= 0.
        seed: seed of the request's own ``torch.Generator``; a seeded request draws the same tokens alone
            or in any batch. None: draws from the engine's generator.
        max_tokens: most tokens to generate (>= 1). Generation never exceeds it.
        stop_token_ids: token ids that end generation (the stop token is part of the output, like EOS).
        ignore_eos: keep generating past the tokenizer's EOS token.

    Raises:
        InvalidRequestError (a ``ValueError``): at construction, naming the field and its allowed range.
    """

    temperature: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: Sequence[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (again: the dataclass is mutable, so the engine re-checks on submission).

        Raises:
            InvalidRequestError: naming the first invalid field and its allowed range.
        """
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise InvalidRequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise InvalidRequestError(f"seed must fit in 64 bits, got {self.seed}")
        if isinstance(self.stop_token_ids, (str, bytes, dict)) or not isinstance(
            self.stop_token_ids, Iterable
        ):
            raise InvalidRequestError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        ids = list(self.stop_token_ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {t!r}")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature below ``GREEDY_EPSILON``)."""
        return self.temperature < GREEDY_EPSILON
