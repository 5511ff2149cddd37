"""Models shipped to the Hub as remote code (torch + transformers + sibling imports only)."""

from .specformer import SpecFormerConfig, SpecFormerForDrafting, SpecFormerOutput

__all__ = ["SpecFormerConfig", "SpecFormerForDrafting", "SpecFormerOutput"]
