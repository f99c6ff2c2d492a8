"""The ``"static"`` policy: every request drafts as deep as the scheduler allows (k), every step, or a
fixed shallower depth (``depth``)."""

from __future__ import annotations

from specdec.errors import ConfigError
from specdec.policies.base import PolicyContext, PolicyInput
from specdec.policies.registry import register_policy


@register_policy("static")
class StaticPolicy:
    """Draft depth k (the scheduler's cap) for every request: the behaviour without a policy, the default.

    Args:
        ctx: the engine's policy context.
        depth: a fixed depth ``0 .. k`` instead of k (0: no drafts, plain decoding through the speculative
            engine); lets one engine run every static k of a sweep (the oracle of the concurrency
            evaluation) by swapping ``engine.policy``.

    Raises:
        ConfigError: ``depth`` not an integer in ``[0, k]``.
    """

    def __init__(self, ctx: PolicyContext, depth: int | None = None) -> None:
        self.k = ctx.num_speculative_tokens
        if depth is not None and (type(depth) is not int or not 0 <= depth <= self.k):
            raise ConfigError(f"static policy: depth must be an integer in [0, {self.k}], got {depth!r}")
        self.depth = self.k if depth is None else int(depth)

    def decide(self, batch: list[PolicyInput]) -> list[int]:
        return [min(self.depth, x.max_drafts) for x in batch]
