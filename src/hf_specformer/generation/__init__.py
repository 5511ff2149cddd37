"""Batched, lossless speculative generation (shipped flattened as the drafter folder's `custom_generate/`)."""

from .engine import SpeculativeDecoderOnlyOutput, speculative_decode
from .generate import generate
from .proposers import OracleProposer, PromptLookupProposer, Proposal, Proposer, SpecFormerProposer, TargetStep
from .requests import RequestOutput, generate_batch
from .scheduler import StepCosts
from .speculation import SpeculationConfig
from .stats import FinishedRow, SpecStats
from .suffix import SuffixIndex, SuffixProposer

__all__ = [
    "FinishedRow", "OracleProposer", "PromptLookupProposer", "Proposal", "Proposer", "RequestOutput",
    "SpecFormerProposer", "SpecStats", "SpeculationConfig", "SpeculativeDecoderOnlyOutput", "StepCosts",
    "SuffixIndex", "SuffixProposer", "TargetStep", "generate", "generate_batch", "speculative_decode",
]
