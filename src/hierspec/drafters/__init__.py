"""Draft sources, one module each, all implementing :class:`~hierspec.drafters.base.Drafter`."""

from hierspec.drafters.base import Drafter, NoDrafter
from hierspec.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter

__all__ = ["Drafter", "NoDrafter", "PromptLookupConfig", "PromptLookupDrafter"]
