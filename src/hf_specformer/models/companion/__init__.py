"""Speculative Verification companion: configuration, modeling, and registration with the `Auto*` classes.

As for the drafter, `register_for_auto_class` makes `save_pretrained` write `auto_map` and copy the two model files,
so Hub users load it with `AutoModel.from_pretrained(..., trust_remote_code=True)`.
"""

from transformers import AutoConfig, AutoModel

from .configuration_companion import CompanionConfig
from .modeling_companion import CompanionForVerification, CompanionOutput, CompanionPreTrainedModel

AutoConfig.register(CompanionConfig.model_type, CompanionConfig, exist_ok=True)
AutoModel.register(CompanionConfig, CompanionForVerification, exist_ok=True)
CompanionConfig.register_for_auto_class()
CompanionForVerification.register_for_auto_class("AutoModel")

__all__ = ["CompanionConfig", "CompanionForVerification", "CompanionOutput", "CompanionPreTrainedModel"]
