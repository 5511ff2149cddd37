"""Publishing: a drafter folder with weights, remote code, `custom_generate/` and a model card."""

from .export import export_drafter

__all__ = ["export_drafter"]
