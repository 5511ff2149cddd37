"""Batched, lossless speculative generation (shipped flattened as the drafter folder's `custom_generate/`)."""

from .drafting import OracleProposer, PromptLookupProposer, Proposer, SpecFormerProposer
from .engine import SpeculativeDecoderOnlyOutput, speculative_decode
from .generate import generate
from .products import FewRowLinears
from .stats import SpecStats

__all__ = [
    "FewRowLinears",
    "OracleProposer",
    "PromptLookupProposer",
    "Proposer",
    "SpecFormerProposer",
    "SpecStats",
    "SpeculativeDecoderOnlyOutput",
    "generate",
    "speculative_decode",
]
