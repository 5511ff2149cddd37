"""hf-specformer: SpecFormer drafters and batched, lossless speculative decoding for Hugging Face transformers."""

from .attention import GQA_SDPA
from .cpu import cpu_products
from .generation import (OracleProposer, PromptLookupProposer, Proposal, Proposer, RequestOutput, SpecFormerProposer,
                         SpeculationConfig, SpecStats, StepCosts, SuffixIndex, SuffixProposer, TargetStep, generate,
                         generate_batch)
from .hub.export import complete_hub_folder
from .models import (CompanionConfig, CompanionForVerification, SpecFormerConfig, SpecFormerForDrafting,
                     SpecFormerOutput)

# With the package installed, saving a model writes a complete Hub folder (the models do not import `hub`).
SpecFormerForDrafting.save_hooks.append(complete_hub_folder)
CompanionForVerification.save_hooks.append(complete_hub_folder)

__version__ = "0.1.0"

__all__ = [
    "CompanionConfig",
    "CompanionForVerification",
    "GQA_SDPA",
    "OracleProposer",
    "PromptLookupProposer",
    "Proposal",
    "Proposer",
    "RequestOutput",
    "SpecFormerConfig",
    "SpecFormerForDrafting",
    "SpecFormerOutput",
    "SpecFormerProposer",
    "SpecStats",
    "SpeculationConfig",
    "StepCosts",
    "SuffixIndex",
    "SuffixProposer",
    "TargetStep",
    "__version__",
    "cpu_products",
    "generate",
    "generate_batch",
]
