"""The ``"batch_size"`` policy: the draft depth from a schedule over the step's batch size.

As vLLM's ``speculative_disable_by_batch_size`` and its batch-size-dependent k: at a small batch a step
is bound by reading the weights, so verifying k extra tokens per request is nearly free; as the batch
grows the step turns compute-bound and drafts cost what they save, so k shrinks, then speculation stops.
The schedule is a list of ``[max_batch_size, k]`` pairs in increasing batch size: a step of ``b``
scheduled requests drafts the k of the first pair with ``b <= max_batch_size``; past the last pair, 0
(plain decoding). The choice depends on the batch's size alone, which is a function of the requests
and their arrival order, so seeded runs repeat exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.errors import ConfigError
from specdec.policies.base import PolicyContext, PolicyInput
from specdec.policies.registry import register_policy


def default_schedule(k: int) -> list[list[int]]:
    """k up to 4 requests, ceil(k / 2) up to 8, 1 up to 16, then off."""
    return [[4, k], [8, max(1, -(-k // 2))], [16, 1]]


@register_policy("batch_size")
class BatchSizePolicy:
    """k by batch size (see the module docstring).

    Args:
        ctx: the engine's policy context.
        schedule: ``[[max_batch_size, k], ...]`` with increasing batch sizes (>= 1) and k in ``0 .. ctx.k``
            (None: :func:`default_schedule`).

    Raises:
        ConfigError: a schedule that is not such a list.
    """

    def __init__(self, ctx: PolicyContext, schedule: Sequence[Sequence[int]] | None = None) -> None:
        self.k = ctx.num_speculative_tokens
        pairs = default_schedule(self.k) if schedule is None else schedule
        checked: list[tuple[int, int]] = []
        for pair in pairs if isinstance(pairs, (list, tuple)) else [pairs]:
            ok = isinstance(pair, (list, tuple)) and len(pair) == 2
            ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
            if not ok or not pair[0] >= 1 or not 0 <= pair[1] <= self.k:
                raise ConfigError(
                    f"batch_size policy: schedule entries must be [max_batch_size >= 1, k in 0..{self.k}], "
                    f"got {pair!r}"
                )
            if checked and pair[0] <= checked[-1][0]:
                raise ConfigError(f"batch_size policy: batch sizes must increase, got {list(pairs)!r}")
            checked.append((pair[0], pair[1]))
        if not checked:
            raise ConfigError("batch_size policy: the schedule is empty")
        self.schedule = checked

    def depth_for(self, batch_size: int) -> int:
        """The scheduled k for ``batch_size`` requests (0 past the last entry)."""
        for max_batch, k in self.schedule:
            if batch_size <= max_batch:
                return k
        return 0

    def decide(self, batch: list[PolicyInput]) -> list[int]:
        return [min(x.max_drafts, self.depth_for(x.batch_size)) for x in batch]
