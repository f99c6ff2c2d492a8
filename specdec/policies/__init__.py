"""Speculation policies: per request and step, how many tokens to draft (see :mod:`.base`)."""

from specdec.policies.base import PolicyContext, PolicyInput, SpeculationPolicy
from specdec.policies.registry import build_policy, policy_names, register_policy

__all__ = ["PolicyContext", "PolicyInput", "SpeculationPolicy", "build_policy", "policy_names", "register_policy"]
