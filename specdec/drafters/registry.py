"""The drafter registry: ``@register_drafter(name)`` makes a drafter usable by name everywhere.

A user's script can register its own::

    from specdec.drafters import DrafterBase, DraftProposal, register_drafter

    @register_drafter("repeat_last")
    class RepeatLast(DrafterBase):
        def __init__(self, ctx):
            self.k = ctx.config.num_speculative_tokens

        def propose(self, batch):
            return [DraftProposal([x.request.token_ids[-1]] * min(self.k, x.max_drafts)) for x in batch]

    LLM(model, speculative_config={"method": "repeat_last", "num_speculative_tokens": 3})

The config validation (:class:`specdec.config.SpeculativeConfig`), the engine, the CLI, the Hydra
schemas and the benchmarks take their method lists from :func:`drafter_names`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from specdec.drafters.base import Drafter, DrafterContext
from specdec.errors import ConfigError

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig
    from specdec.models.config import ModelArchConfig

#: What ``SpeculativeConfig.model`` means for a drafter: "none" (it takes none), "model" (a zoo name or
#: an HF-format directory, required), "heads" (a built-in head name or a head directory; None: the
#: target's built-in heads ``<target>-<method>``).
ModelKind = Literal["none", "model", "heads"]

#: The built-in drafters' modules, imported on the first look-up (each registers itself).
_BUILTIN_MODULES = (
    "specdec.drafters.ngram",
    "specdec.drafters.draft_model",
    "specdec.drafters.medusa",
    "specdec.drafters.eagle",
    "specdec.drafters.eagle3",
    "specdec.drafters.grammar_forced",
    "specdec.drafters.suffix",
    "specdec.drafters.hybrid",
)

#: Methods of the Drafter Protocol a registered drafter must have (callable).
_PROTOCOL_METHODS = ("propose", "on_verified", "observe", "reset", "kv_bytes_per_block", "bind_kv")


@dataclass(frozen=True)
class DrafterEntry:
    """One registered drafter.

    Attributes:
        name: the ``method`` it answers to.
        factory: a class or callable, called as ``factory(ctx, **config.drafter_kwargs)``.
        model: what ``SpeculativeConfig.model`` is for it (see :data:`ModelKind`).
        trees: the ``tree`` values it accepts (None = chains).
        fields: the method-specific ``SpeculativeConfig`` fields it reads (others must keep their
            defaults).
        check_config: extra checks of the config (raise ``ConfigError``), run at config construction.
        check_target: checks against the target's config and the resolved model directory, run before
            any weights load (raise a ``SpecdecError``).
        description: one line, for ``--help`` and the README.
        model_of: for a drafter that builds others (the hybrid): the member whose ``model`` kind the
            config's ``model`` follows (a learned member's heads), or None (see :func:`model_method`).
    """

    name: str
    factory: Callable[..., Any]
    model: ModelKind = "none"
    trees: tuple[str | None, ...] = (None,)
    fields: tuple[str, ...] = ()
    check_config: Callable[[SpeculativeConfig], None] | None = None
    check_target: Callable[[ModelArchConfig, SpeculativeConfig, Path | None], None] | None = None
    description: str = ""
    module: str = field(default="", compare=False)
    model_of: Callable[[SpeculativeConfig], str | None] | None = None


_REGISTRY: dict[str, DrafterEntry] = {}
#: Built-in drafter names -> the index of their module in :data:`_BUILTIN_MODULES` (listing order).
_BUILTIN_RANK: dict[str, int] = {}
_builtins_loaded = False


def register_drafter(
    name: str,
    *,
    model: ModelKind = "none",
    trees: tuple[str | None, ...] = (None,),
    fields: tuple[str, ...] = (),
    check_config: Callable[[SpeculativeConfig], None] | None = None,
    check_target: Callable[[ModelArchConfig, SpeculativeConfig, Path | None], None] | None = None,
    description: str = "",
    model_of: Callable[[SpeculativeConfig], str | None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Class (or factory) decorator: register a drafter as ``method=name``.

    Registering a name again replaces the entry (a re-imported script); see :class:`DrafterEntry` for
    the arguments.

    Raises:
        ConfigError: ``name`` is not a non-empty identifier-like string, or ``model``/``trees`` are not
            known kinds.
    """
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"a drafter name must be a non-empty word (letters, digits, _ or -), got {name!r}")
    if model not in ("none", "model", "heads"):
        raise ConfigError(f"model must be 'none', 'model' or 'heads', got {model!r}")
    bad_trees = [t for t in trees if t not in (None, "static", "dynamic")]
    if bad_trees:
        raise ConfigError(f"trees must be among None, 'static', 'dynamic'; got {bad_trees}")

    def decorate(factory: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(factory):
            raise ConfigError(f"register_drafter({name!r}) decorates a class or a callable, got {factory!r}")
        module = getattr(factory, "__module__", "")
        if module in _BUILTIN_MODULES:  # listed in module order, whichever module is imported first
            _BUILTIN_RANK.setdefault(name, _BUILTIN_MODULES.index(module))
        else:
            _load_builtins()  # built-ins first; a user's drafter of a built-in's name replaces it
        _REGISTRY[name] = DrafterEntry(
            name,
            factory,
            model,
            tuple(trees),
            tuple(fields),
            check_config,
            check_target,
            description or (inspect.getdoc(factory) or "").split("\n")[0],
            getattr(factory, "__module__", ""),
            model_of,
        )
        return factory

    return decorate


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)


def drafter_names() -> tuple[str, ...]:
    """The registered methods: the built-ins in the order of their modules (whichever was imported
    first), then the others in registration order."""
    _load_builtins()
    last = len(_BUILTIN_MODULES)
    return tuple(sorted(_REGISTRY, key=lambda name: _BUILTIN_RANK.get(name, last)))  # stable sort


def model_method(config: SpeculativeConfig) -> tuple[ModelKind, str]:
    """``(kind, method)``: what ``config.model`` is for ``config.method`` (its entry's ``model`` kind) and
    which method's default it resolves to; for a drafter with ``model_of`` (the hybrid with a learned
    member), the member's kind and name.

    Raises:
        ConfigError: an unknown method.
    """
    entry = get_drafter(config.method)
    member = entry.model_of(config) if entry.model_of is not None else None
    if member is not None:
        return get_drafter(member).model, member
    return entry.model, config.method


def get_drafter(name: str) -> DrafterEntry:
    """The entry of ``method=name``.

    Raises:
        ConfigError: no drafter of that name is registered (the message names the registered ones).
    """
    _load_builtins()
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ConfigError(f"speculative method must be one of {drafter_names()}, got {name!r}")
    return entry


def unregister_drafter(name: str) -> None:
    """Remove a registered drafter (tests, notebooks); unknown names are ignored."""
    _REGISTRY.pop(name, None)


def build_drafter(ctx: DrafterContext) -> Drafter:
    """Build the drafter of ``ctx.config.method`` and check it follows the :class:`Drafter` Protocol;
    with ``grammar_forced_drafts`` it is wrapped in
    :class:`~specdec.drafters.grammar_forced.GrammarForcedDrafter`.

    Raises:
        ConfigError: unknown method, or the built object lacks a Protocol method or
            ``uses_hidden_states`` (the message names what is missing).
        Whatever the factory raises (e.g. ``CorruptModelError`` for a bad checkpoint).
    """
    entry = get_drafter(ctx.config.method)
    drafter = entry.factory(ctx, **(ctx.config.drafter_kwargs or {}))
    check_protocol(drafter, entry.name)
    if ctx.config.grammar_forced_drafts:
        from specdec.drafters.grammar_forced import GrammarForcedDrafter

        if not isinstance(drafter, GrammarForcedDrafter):
            drafter = GrammarForcedDrafter(drafter, ctx.vocab_size)
    return drafter


def check_protocol(drafter: object, name: str = "drafter") -> None:
    """Raise ``ConfigError`` unless ``drafter`` has every :class:`Drafter` method and a bool
    ``uses_hidden_states`` (subclass :class:`~specdec.drafters.base.DrafterBase` for defaults)."""
    from specdec.drafters.base import DrafterBase

    missing = [m for m in _PROTOCOL_METHODS if not callable(getattr(drafter, m, None))]
    if isinstance(drafter, DrafterBase) and type(drafter).propose is DrafterBase.propose:
        missing.insert(0, "propose")
    if not isinstance(getattr(drafter, "uses_hidden_states", None), bool):
        missing.append("uses_hidden_states (a bool)")
    if missing:
        raise ConfigError(
            f"drafter {name!r} ({type(drafter).__name__}) does not follow the Drafter protocol: missing "
            f"{missing}; subclass specdec.drafters.DrafterBase for defaults"
        )
