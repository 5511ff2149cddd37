"""Batched, lossless speculative generation (shipped flattened as the drafter folder's `custom_generate/`)."""

from .drafting import PromptLookupProposer, Proposal, Proposer, SpecFormerProposer
from .engine import SpeculativeDecoderOnlyOutput, speculative_decode
from .generate import generate
from .linears import few_row_products
from .oracle import OracleProposer
from .requests import RequestOutput, generate_batch
from .stats import SpecStats
from .suffix import SuffixIndex, SuffixProposer

__all__ = [
    "OracleProposer",
    "PromptLookupProposer",
    "Proposal",
    "Proposer",
    "RequestOutput",
    "SpecFormerProposer",
    "SpecStats",
    "SpeculativeDecoderOnlyOutput",
    "SuffixIndex",
    "SuffixProposer",
    "few_row_products",
    "generate",
    "generate_batch",
    "speculative_decode",
]
