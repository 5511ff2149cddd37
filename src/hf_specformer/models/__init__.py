"""Models shipped to the Hub as remote code (torch + transformers + sibling imports only)."""

from .companion import CompanionConfig, CompanionForVerification, CompanionOutput
from .specformer import SpecFormerConfig, SpecFormerForDrafting, SpecFormerOutput

__all__ = [
    "CompanionConfig",
    "CompanionForVerification",
    "CompanionOutput",
    "SpecFormerConfig",
    "SpecFormerForDrafting",
    "SpecFormerOutput",
]
