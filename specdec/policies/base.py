"""The speculation-policy plug-in point: how many tokens each request drafts this step.

A policy is registered by name (:func:`specdec.policies.registry.register_policy`) and built once per
engine. Each step, after scheduling and before drafting, the engine calls :meth:`SpeculationPolicy.decide`
with one :class:`PolicyInput` per request that may draft; the answer caps that request's draft depth
(``DraftInput.max_drafts``) for the step: 0 switches speculation off for it, the scheduler's cap
(``num_speculative_tokens``, or less near ``max_tokens``) is the most it may ask. The KV slots were
reserved by the scheduler already; drafts a policy does not ask for leave them unused, as a drafter that
finds nothing does.

Exactness: a policy decides from what is already committed (the request's tokens and acceptance
history, the batch's composition), before the step's drafts exist, so the number of drafts is
independent of whether they will be accepted and the verifier keeps the output distribution the
target's (Leviathan et al. 2023: any draft length is exact). ``tests/test_policies.py`` proves it
with greedy equality and a chi-square test (with a negative control) under k varying step to step and
request to request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from specdec.request import Request


@dataclass(frozen=True)
class PolicyContext:
    """What a policy is built from (one per engine).

    Attributes:
        num_speculative_tokens: k, the configured most drafts per step (a tree's depth).
        tree: whether the drafter proposes token trees (the depth caps a tree's levels).
    """

    num_speculative_tokens: int
    tree: bool = False


@dataclass(frozen=True)
class PolicyInput:
    """One request that may draft this step.

    Attributes:
        request: the request (``request.token_ids`` committed; ``request.spec_stats`` its acceptance
            history: draft steps, accepted tokens per draft position).
        max_drafts: the scheduler's cap on the draft depth this step (``1 .. k``).
        batch_size: requests scheduled this step (drafting or not).
        num_drafting: requests of this step that may draft (this one included).
        num_scheduled_tokens: the step's batched tokens before any drafts (prefill chunks included; 0:
            unknown, taken as one per request).
        draft_backlog: tokens the drafter must read before it can draft for this request (a draft model
            that has not drafted for it lately: its prompt, the tokens since; 0 for drafters that keep
            up every step), a one-off cost of drafting now.
    """

    request: Request
    max_drafts: int
    batch_size: int
    num_drafting: int
    num_scheduled_tokens: int = 0
    draft_backlog: int = 0


@dataclass(frozen=True)
class StepObservation:
    """What one speculative step cost and yielded, for policies that learn (``observe_step``).

    Attributes:
        num_tokens: batched tokens of the target forward (new tokens plus drafts).
        target_s: seconds of the forward, sampling / verification and commit.
        draft_s: seconds of drafting (the policy's own decision included), catch-up forwards excluded.
        max_depth: the deepest draft of the step (0: none).
        per_request: ``(drafted, accepted)`` per request that verified drafts (a tree: its depth and the
            accepted path's length).
        num_committed: tokens the step committed over all its requests (accepted drafts plus one bonus or
            recovered token per sampling request).
        prefill: the step held prompt chunks (a request computing more than its last committed token, or
            not sampling).
        catch_up_s, catch_up_tokens: seconds and tokens of the drafter's catch-up forwards this step
            (a draft model reading backlogs before drafting; see ``PolicyInput.draft_backlog``).
    """

    num_tokens: int
    target_s: float
    draft_s: float
    max_depth: int
    per_request: tuple[tuple[int, int], ...] = ()
    num_committed: int = 0
    prefill: bool = False
    catch_up_s: float = 0.0
    catch_up_tokens: int = 0


@runtime_checkable
class SpeculationPolicy(Protocol):
    """Chooses each request's draft depth per step (one class per file in ``specdec/policies/``)."""

    def decide(self, batch: list[PolicyInput]) -> list[int]:
        """One draft depth per input, in order, each in ``[0, input.max_drafts]`` (larger answers are
        cut to ``max_drafts``; a negative or non-integer answer is the policy's fault for that request)."""
        ...


class PolicyBase:
    """Optional hooks of a policy, as no-ops: subclass it for :meth:`observe_step` and the step costs.

    Attributes:
        wants_step_costs: when True, the engine calls :meth:`set_step_costs` with the target's profiled
            (or cached) step costs before the policy's first decision (:mod:`specdec.engine.cost_profile`),
            and, where the policy has it, ``set_draft_costs(per_position, catch_up_s_per_token=...)``
            with a draft model's profile (``{drafting rows: seconds per draft position}``, and the
            seconds per token of reading a backlog, ``PolicyInput.draft_backlog``).
    """

    wants_step_costs: bool = False

    def set_step_costs(self, step_s: dict[int, float]) -> None:
        """Receive ``{num_tokens: seconds}`` of one target forward (profiled at start-up or cached)."""
        return None

    def observe_step(self, step: StepObservation) -> None:
        """Called after every step that verified drafts or could have (learning policies update here)."""
        return None
