"""Drafters: propose draft tokens for the target model to verify. One drafter per file, each registered
by name (:func:`register_drafter`); :func:`drafter_names` lists them."""

from specdec.drafters.base import (
    Drafter,
    DrafterBase,
    DrafterContext,
    DraftInput,
    DraftProposal,
    RequestStates,
)
from specdec.drafters.registry import (
    DrafterEntry,
    build_drafter,
    drafter_names,
    get_drafter,
    register_drafter,
    unregister_drafter,
)

__all__ = [
    "DraftInput",
    "DraftProposal",
    "Drafter",
    "DrafterBase",
    "DrafterContext",
    "DrafterEntry",
    "RequestStates",
    "build_drafter",
    "drafter_names",
    "get_drafter",
    "register_drafter",
    "unregister_drafter",
]
