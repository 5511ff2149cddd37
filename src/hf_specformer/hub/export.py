"""Writes the Hub folder of a drafter: weights, config with `auto_map`, model code, `custom_generate/`, card.

    drafter_dir/
      config.json  model.safetensors  configuration_specformer.py  modeling_specformer.py   (save_pretrained)
      custom_generate/generate.py + its sibling modules + requirements.txt                 (this module)
      README.md                                                                            (model card, optional)

`custom_generate/` is `hf_specformer/generation/` flattened: those files import only torch, transformers (and numpy,
which transformers requires) and each other, so
`target.generate(..., custom_generate=drafter_dir, trust_remote_code=True)` runs without this package.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

from .. import generation, models

CUSTOM_GENERATE_DIR = "custom_generate"


def generation_sources() -> list[Path]:
    """The generation modules bundled into `custom_generate/` (the package's `__init__.py` is not)."""
    folder = Path(generation.__file__).parent
    return sorted(path for path in folder.glob("*.py") if path.name != "__init__.py")


def write_custom_generate(folder: str | os.PathLike) -> Path:
    """Copies the generation modules and a `requirements.txt` into `folder/custom_generate/`."""
    target = Path(folder) / CUSTOM_GENERATE_DIR
    target.mkdir(parents=True, exist_ok=True)
    for source in generation_sources():
        shutil.copyfile(source, target / source.name)
    requirements = f"torch>={torch.__version__.split('+')[0]}\ntransformers>={transformers.__version__}\n"
    (target / "requirements.txt").write_text(requirements)
    return target


def refresh_code(folder: str | os.PathLike) -> None:
    """Rewrites the remote code of an exported folder from the package (a drafter's model files and
    `custom_generate/` modules, or a companion's model files), keeping its weights, config, card and
    `custom_generate/requirements.txt`. `make shipped-code` runs it on the folders shipped in the package."""
    folder = Path(folder)
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    package = Path(models.__file__).parent / {"specformer": "specformer", "sv_companion": "companion"}[model_type]
    for source in [*package.glob("configuration_*.py"), *package.glob("modeling_*.py")]:
        shutil.copyfile(source, folder / source.name)
    if (folder / CUSTOM_GENERATE_DIR).is_dir():
        for source in generation_sources():
            shutil.copyfile(source, folder / CUSTOM_GENERATE_DIR / source.name)


def export_drafter(
    drafter, folder: str | os.PathLike, model_card: str | None = None, dtype: torch.dtype | None = None
) -> Path:
    """Saves `drafter` (optionally cast to `dtype`) as a complete Hub folder with `custom_generate/`."""
    return _export(drafter, folder, model_card, dtype, with_custom_generate=True)


def export_companion(
    companion, folder: str | os.PathLike, model_card: str | None = None, dtype: torch.dtype | None = None
) -> Path:
    """Saves a `CompanionForVerification` (optionally cast to `dtype`) as a Hub folder: weights, config (with its
    calibrated table and `auto_map`), code and card. It is used through a drafter's `custom_generate`
    (`companion_model=`), so it carries none of its own."""
    return _export(companion, folder, model_card, dtype, with_custom_generate=False)


def _export(model, folder, model_card, dtype, with_custom_generate: bool) -> Path:
    """Written to a temporary folder first and moved into place, so an interrupted export never leaves a
    half-written folder behind."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.") as staging:
        to_save = model if dtype is None else _cast_copy(model, dtype)
        to_save.save_pretrained(staging)
        if with_custom_generate:
            write_custom_generate(staging)
        if model_card is not None:
            Path(staging, "README.md").write_text(model_card)
        _make_readable(Path(staging))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
        os.makedirs(staging)  # TemporaryDirectory cleans up the (now empty) staging path
    return folder


def _make_readable(folder: Path) -> None:
    """`tempfile` stages with mode 0700; a published folder is world-readable like any `save_pretrained` output."""
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _cast_copy(model, dtype: torch.dtype):
    """A copy of the model in `dtype`, leaving the original (and its target binding, which is not part of its
    state) untouched."""
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    return copy.to(dtype)
