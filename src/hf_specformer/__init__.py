"""hf-specformer: SpecFormer drafters and batched, lossless speculative decoding for Hugging Face transformers."""

from .generation import OracleProposer, Proposer, SpecFormerProposer, SpecStats, generate
from .models import SpecFormerConfig, SpecFormerForDrafting, SpecFormerOutput

__version__ = "0.1.0"

__all__ = [
    "OracleProposer",
    "Proposer",
    "SpecFormerConfig",
    "SpecFormerForDrafting",
    "SpecFormerOutput",
    "SpecFormerProposer",
    "SpecStats",
    "__version__",
    "generate",
]
