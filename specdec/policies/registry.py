"""The speculation-policy registry: ``@register_policy(name)`` makes a policy usable by name everywhere.

A user's script can register its own::

    from specdec.policies import register_policy

    @register_policy("short_when_busy")
    class ShortWhenBusy:
        def __init__(self, ctx):
            self.k = ctx.num_speculative_tokens

        def decide(self, batch):
            return [self.k if x.batch_size <= 4 else 1 for x in batch]

    LLM(model, speculative_config={"method": "ngram", "policy": "short_when_busy"})

Constructors take the :class:`~specdec.policies.base.PolicyContext` and the config's ``policy_kwargs``;
a bad parameter is a ``ConfigError`` raised when the config is built (:func:`build_policy` runs there
once to check it, and again in the engine).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from specdec.errors import ConfigError
from specdec.policies.base import PolicyContext, SpeculationPolicy

_BUILTIN_MODULES = (
    "specdec.policies.static",
    "specdec.policies.batch_size",
    "specdec.policies.goodput",
    "specdec.policies.ucb",
)
_REGISTRY: dict[str, Callable[..., Any]] = {}
_loaded = False


def register_policy(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Class decorator: register ``factory(ctx, **policy_kwargs)`` as policy ``name``.

    Raises:
        ConfigError: ``name`` is empty or already registered.
    """

    def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a policy name must be a non-empty string, got {name!r}")
        if name in _REGISTRY:
            raise ConfigError(f"speculation policy {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return wrap


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)


def policy_names() -> list[str]:
    """The registered policies' names, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def build_policy(name: str, ctx: PolicyContext, kwargs: dict | None = None) -> SpeculationPolicy:
    """Build policy ``name`` for ``ctx``.

    Raises:
        ConfigError: unknown name (the message names the registered ones), or parameters the policy
            rejects (its constructor's ``ConfigError``, or a ``TypeError`` for an unknown keyword).
    """
    _load_builtins()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown speculation policy {name!r}; registered: {', '.join(policy_names())}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"policy_kwargs must be a dict, got {kwargs!r}")
    try:
        policy = _REGISTRY[name](ctx, **(kwargs or {}))
    except TypeError as e:
        raise ConfigError(f"policy {name!r}: bad policy_kwargs {kwargs!r}: {e}") from None
    if not callable(getattr(policy, "decide", None)):
        raise ConfigError(f"policy {name!r} built {type(policy).__name__}, which has no decide()")
    return policy
