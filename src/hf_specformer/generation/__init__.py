"""Batched, lossless speculative generation (shipped flattened as the drafter folder's `custom_generate/`)."""

from .drafting import OracleProposer, PromptLookupProposer, Proposal, Proposer, SpecFormerProposer
from .engine import SpeculativeDecoderOnlyOutput, speculative_decode
from .generate import generate
from .linears import few_row_products
from .stats import SpecStats
from .suffix import SuffixIndex, SuffixProposer

__all__ = [
    "OracleProposer",
    "PromptLookupProposer",
    "Proposal",
    "Proposer",
    "SpecFormerProposer",
    "SpecStats",
    "SpeculativeDecoderOnlyOutput",
    "SuffixIndex",
    "SuffixProposer",
    "few_row_products",
    "generate",
    "speculative_decode",
]
