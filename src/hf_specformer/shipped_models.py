"""The models shipped inside the package beside the default target, and loading drafters and companions for a
target as a Hub user would (`AutoModel.from_pretrained(folder, trust_remote_code=True)`)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from transformers import AutoModel, PreTrainedModel

from .models import CompanionForVerification, SpecFormerConfig, SpecFormerForDrafting

SHIPPED_DRAFTER = "specformer-smollm2-135m-instruct"
SHIPPED_COMPANION = "sv-companion-smollm2-135m-instruct"


def shipped_drafter_dir() -> Path:
    """Folder of the trained SmolLM2 drafter shipped inside the package (the Hub folder we publish)."""
    return Path(str(resources.files("hf_specformer") / "pretrained" / SHIPPED_DRAFTER))


def shipped_companion_dir() -> Path:
    """Folder of the trained SmolLM2 Speculative Verification companion shipped inside the package."""
    return Path(str(resources.files("hf_specformer") / "pretrained" / SHIPPED_COMPANION))


def _load_bound(folder: Path, target: PreTrainedModel, what: str):
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"No {what} at {folder} (no config.json there).")
    model = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=target.dtype)
    return model.to(target.device).eval().bind_target(target)


def load_drafter(path: str | None, target: PreTrainedModel) -> SpecFormerForDrafting:
    """The drafter folder `path` (default: the shipped one) bound to `target`, in its dtype and on its device; a
    fresh random drafter if `path` is `untrained`."""
    if path == "untrained":
        drafter = SpecFormerForDrafting(SpecFormerConfig.from_target_config(target.config))
        return drafter.to(device=target.device, dtype=target.dtype).eval().bind_target(target)
    return _load_bound(Path(path) if path else shipped_drafter_dir(), target, "drafter")


def load_companion(path: str | None, target: PreTrainedModel) -> CompanionForVerification:
    """The companion folder `path` (default: the shipped one) bound to `target`, in its dtype and on its device."""
    return _load_bound(Path(path) if path else shipped_companion_dir(), target, "companion")
