"""Batched, lossless speculative generation (shipped flattened as the drafter folder's `custom_generate/`)."""

from .drafting import OracleProposer, PromptLookupProposer, Proposal, Proposer, SpecFormerProposer
from .engine import SpeculativeDecoderOnlyOutput, speculative_decode
from .generate import generate
from .products import FewRowLinears
from .stats import SpecStats

__all__ = [
    "FewRowLinears",
    "OracleProposer",
    "PromptLookupProposer",
    "Proposal",
    "Proposer",
    "SpecFormerProposer",
    "SpecStats",
    "SpeculativeDecoderOnlyOutput",
    "generate",
    "speculative_decode",
]
