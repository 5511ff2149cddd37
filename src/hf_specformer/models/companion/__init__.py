"""Speculative Verification companion: configuration, modeling, and registration with the `Auto*` classes."""

from transformers import AutoConfig, AutoModel

from .configuration_companion import CompanionConfig
from .modeling_companion import CompanionForVerification, CompanionOutput, CompanionPreTrainedModel

AutoConfig.register(CompanionConfig.model_type, CompanionConfig, exist_ok=True)
AutoModel.register(CompanionConfig, CompanionForVerification, exist_ok=True)
CompanionConfig.register_for_auto_class()
CompanionForVerification.register_for_auto_class("AutoModel")

__all__ = ["CompanionConfig", "CompanionForVerification", "CompanionOutput", "CompanionPreTrainedModel"]
