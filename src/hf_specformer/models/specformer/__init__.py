"""SpecFormer drafter: configuration, modeling, and registration with the `Auto*` classes (and `auto_map` on save,
for Hub users with `trust_remote_code=True`)."""

from transformers import AutoConfig, AutoModel

from .configuration_specformer import SpecFormerConfig
from .modeling_specformer import SpecFormerForDrafting, SpecFormerOutput, SpecFormerPreTrainedModel

AutoConfig.register(SpecFormerConfig.model_type, SpecFormerConfig, exist_ok=True)
AutoModel.register(SpecFormerConfig, SpecFormerForDrafting, exist_ok=True)
SpecFormerConfig.register_for_auto_class()
SpecFormerForDrafting.register_for_auto_class("AutoModel")

__all__ = ["SpecFormerConfig", "SpecFormerForDrafting", "SpecFormerOutput", "SpecFormerPreTrainedModel"]
