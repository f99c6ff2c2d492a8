"""Drafters: propose draft tokens for the target model to verify. One drafter per file."""

from specdec.drafters.base import Drafter, DraftInput, DraftProposal

__all__ = ["DraftInput", "DraftProposal", "Drafter"]
