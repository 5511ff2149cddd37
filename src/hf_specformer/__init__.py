"""hf-specformer: SpecFormer drafters and batched, lossless speculative decoding for Hugging Face transformers."""

from .generation import (
    OracleProposer,
    PromptLookupProposer,
    Proposal,
    Proposer,
    SpecFormerProposer,
    SpecStats,
    generate,
)
from .models import (
    CompanionConfig,
    CompanionForVerification,
    SpecFormerConfig,
    SpecFormerForDrafting,
    SpecFormerOutput,
)

__version__ = "0.1.0"

__all__ = [
    "CompanionConfig",
    "CompanionForVerification",
    "OracleProposer",
    "PromptLookupProposer",
    "Proposal",
    "Proposer",
    "SpecFormerConfig",
    "SpecFormerForDrafting",
    "SpecFormerOutput",
    "SpecFormerProposer",
    "SpecStats",
    "__version__",
    "generate",
]
