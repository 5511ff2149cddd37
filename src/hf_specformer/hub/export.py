"""Writes the Hub folder of a drafter or companion, and publishes it (`push_folder`, `huggingface_hub`).

    drafter_dir/
      config.json  model.safetensors  configuration_specformer.py  modeling_specformer.py   (save_pretrained)
      custom_generate/generate.py + its sibling modules + requirements.txt                 (this module)
      README.md                                                                            (model card)

With this package installed, `save_pretrained` writes the complete folder; `custom_generate/` is `generation/`
flattened, importing only torch and transformers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard

from .. import generation
from . import cards

CUSTOM_GENERATE_DIR = "custom_generate"

REQUIREMENTS = ("torch>=2.13", "transformers>=5.24")
"""`custom_generate/requirements.txt`: this package's floors (pyproject.toml; a test keeps them equal), never the
exporting machine's versions. Plain `pkg>=X.Y` lines: transformers parses nothing else."""


def generation_sources(folder: str | os.PathLike | None = None) -> list[Path]:
    """The generation modules bundled into `custom_generate/` (the package's `__init__.py` is not), from `folder`
    (default: the installed package's `generation/`)."""
    folder = Path(folder) if folder is not None else Path(generation.__file__).parent
    return sorted(path for path in folder.glob("*.py") if path.name != "__init__.py")


def requirements_text() -> str:
    """`custom_generate/requirements.txt`: one `REQUIREMENTS` line each."""
    return "".join(f"{requirement}\n" for requirement in REQUIREMENTS)


def write_custom_generate(folder: str | os.PathLike) -> Path:
    """Copies the generation modules and a `requirements.txt` into `folder/custom_generate/`."""
    target = Path(folder) / CUSTOM_GENERATE_DIR
    target.mkdir(parents=True, exist_ok=True)
    for source in generation_sources():
        shutil.copyfile(source, target / source.name)
    (target / "requirements.txt").write_text(requirements_text())
    return target


def complete_hub_folder(model, folder: str | os.PathLike) -> None:
    """What both models' `save_pretrained` (and so `push_to_hub`) add when this package is installed: a drafter's
    folder gets `custom_generate/`, and a folder without a `README.md` gets a model card rendered from the model."""
    folder = Path(folder)
    is_drafter = model.config.model_type == "specformer"
    if is_drafter:
        write_custom_generate(folder)
    if not (folder / "README.md").exists():
        render = cards.render_card if is_drafter else cards.render_companion_card
        write_card(folder, render(model, name=card_name(model, folder)))


def card_name(model, folder: Path) -> str:
    """The folder's name, or for a temporary folder (an atomic write's `.name.xyz`), one after the model and its
    target: `specformer-<target>` or `sv-companion-<target>`."""
    if not folder.name.startswith("."):
        return folder.name
    target = Path(str(model.config.target_name_or_path or "target")).name.split(".")[0].lower()
    return f"{'specformer' if model.config.model_type == 'specformer' else 'sv-companion'}-{target}"


def write_card(folder: str | os.PathLike, text: str) -> None:
    """Writes `README.md` once `huggingface_hub.ModelCard` has parsed its YAML metadata (an error if it cannot), as
    written (ModelCard would re-serialise the metadata)."""
    ModelCard(text)
    (Path(folder) / "README.md").write_text(text)


def commit_operations(folder: str | os.PathLike) -> list[CommitOperationAdd]:
    """One `CommitOperationAdd` per file of an exported folder (caches and temporary files left out)."""
    folder = Path(folder)
    return [
        CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=str(path))
        for path in sorted(folder.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts and not path.name.startswith(".")
    ]


def push_folder(folder: str | os.PathLike, repo_id: str, api: HfApi | None = None, private: bool = False,
                commit_message: str = "Upload with hf-specformer"):
    """Publishes an exported folder to the Hub model repo `repo_id` (created if needed) in one commit; returns the
    commit info. Needs network access and a token (`hf auth login` or `HF_TOKEN`)."""
    api = api or HfApi()
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    return api.create_commit(repo_id, operations=commit_operations(folder), commit_message=commit_message,
                             repo_type="model")


def export_drafter(drafter, folder: str | os.PathLike, model_card: str | None = None,
                   dtype: torch.dtype | None = None) -> Path:
    """Saves `drafter` (optionally cast to `dtype`) as a complete Hub folder with `custom_generate/`."""
    return _export(drafter, folder, model_card, dtype)


def export_companion(companion, folder: str | os.PathLike, model_card: str | None = None,
                     dtype: torch.dtype | None = None) -> Path:
    """Saves a `CompanionForVerification` (optionally cast to `dtype`) as a Hub folder: weights, config, code, card."""
    return _export(companion, folder, model_card, dtype)


def _export(model, folder, model_card, dtype) -> Path:
    """Written to a temporary folder first and moved into place, so an interrupted export never leaves a
    half-written folder behind."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.") as staging:
        to_save = model if dtype is None else _cast_copy(model, dtype)
        to_save.save_pretrained(staging)  # with custom_generate/ (drafters) and a default card, see above
        if model_card is not None:
            write_card(staging, model_card)
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
