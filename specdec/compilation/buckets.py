"""Token buckets: the few batch widths a compiled forward is specialised to.

A compiled graph is specialised to its input shapes, so a forward of ``T`` new tokens is padded to the
smallest bucket ``>= T`` (vLLM's CUDA-graph capture sizes play the same role). Decode is bound by the
bytes of the weights, not by rows: on this project's 2-core CPU a compiled SmolLM2 step costs about the
same at 1 and at 5 rows, so padding a 5-token verification to 8 rows costs little, while a fresh shape
would cost a compilation. Forwards wider than the largest bucket (long prefill chunks, which are bound
by arithmetic, not overhead) run eagerly.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

#: Default buckets: powers of two up to 64 tokens (a batch of 16 decodes, or 12 chains of k = 4).
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """``buckets`` as a sorted tuple of distinct positive ints.

    Raises:
        ValueError: empty, or an entry that is not a positive int.
    """
    if not buckets:
        raise ValueError("buckets must not be empty")
    for b in buckets:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"buckets must be positive integers, got {b!r}")
    return tuple(sorted(set(buckets)))


def pick_bucket(num_tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket ``>= num_tokens`` of the sorted ``buckets``; None when ``num_tokens`` exceeds
    them all (the forward then runs eagerly)."""
    i = bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None
