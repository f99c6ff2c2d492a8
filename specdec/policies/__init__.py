"""Speculation policies: per request and step, how many tokens to draft (see :mod:`.base`)."""

from specdec.policies.base import PolicyBase, PolicyContext, PolicyInput, SpeculationPolicy, StepObservation
from specdec.policies.registry import build_policy, policy_names, register_policy

__all__ = [
    "PolicyBase",
    "PolicyContext",
    "PolicyInput",
    "SpeculationPolicy",
    "StepObservation",
    "build_policy",
    "policy_names",
    "register_policy",
]
