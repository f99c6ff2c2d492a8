"""The ``"static"`` policy: every request drafts as deep as the scheduler allows (k), every step."""

from __future__ import annotations

from specdec.policies.base import PolicyContext, PolicyInput
from specdec.policies.registry import register_policy


@register_policy("static")
class StaticPolicy:
    """Draft depth k (the scheduler's cap) for every request: the behaviour without a policy, the default."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.k = ctx.num_speculative_tokens

    def decide(self, batch: list[PolicyInput]) -> list[int]:
        return [x.max_drafts for x in batch]
