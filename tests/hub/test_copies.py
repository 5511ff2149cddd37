"""Every shipped copy equals its source (`hub/copies.py`; `make fix-copies` rewrites them)."""

from __future__ import annotations

import shutil
from pathlib import Path

from hf_specformer.hub.copies import fix_copies, shipped_copies, stale_copies

REPO = Path(__file__).resolve().parents[2]


def test_every_shipped_copy_equals_its_source():
    copies = {copy.path.relative_to(REPO).as_posix() for copy in shipped_copies(REPO)}
    drafter = "src/hf_specformer/pretrained/specformer-smollm2-135m-instruct"
    companion = "src/hf_specformer/pretrained/sv-companion-smollm2-135m-instruct"
    assert {f"{drafter}/custom_generate/engine.py", f"{drafter}/custom_generate/requirements.txt",
            f"{drafter}/modeling_specformer.py", f"{companion}/modeling_companion.py",
            "hub_cards/sv-companion-smollm2-135m-instruct.md",
            "src/hf_specformer/models/companion/modeling_companion.py"} <= copies
    assert stale_copies(REPO) == [], "run `make fix-copies`"


def test_an_edited_source_makes_its_copies_stale_and_fix_copies_rewrites_them(tmp_path):
    """A change to a generation module, to a class and a method another model copies, to a shipped card, and a
    bundled module whose source is gone: each is reported, and `fix_copies` rewrites the copies (the copied class
    renamed, then into the companion's folder) and removes the orphan."""
    shutil.copytree(REPO / "src", tmp_path / "src", ignore=shutil.ignore_patterns("*.safetensors", "__pycache__"))
    shutil.copytree(REPO / "hub_cards", tmp_path / "hub_cards")
    package = tmp_path / "src" / "hf_specformer"
    drafter = package / "pretrained" / "specformer-smollm2-135m-instruct"
    companion = package / "pretrained" / "sv-companion-smollm2-135m-instruct"
    engine = package / "generation" / "engine.py"
    engine.write_text(engine.read_text() + "\n# edited\n")
    modeling = package / "models" / "specformer" / "modeling_specformer.py"
    edited_docstring = '"""RMSNorm over the last dimension (edited)."""'
    modeling.write_text(modeling.read_text().replace(
        '"""RMSNorm over the last dimension, computed in float32 (float64 for float64 inputs) and cast back."""',
        edited_docstring, 1).replace("hook(self, save_directory)", "hook(self, save_directory)  # edited", 1))
    card = companion / "README.md"
    card.write_text(card.read_text() + "\nEdited.\n")
    (drafter / "custom_generate" / "removed_module.py").write_text("# its source is gone\n")
    stale = {path.relative_to(tmp_path).as_posix() for path in stale_copies(tmp_path)}
    assert stale == {
        f"{drafter.relative_to(tmp_path).as_posix()}/custom_generate/engine.py",
        f"{drafter.relative_to(tmp_path).as_posix()}/modeling_specformer.py",
        "src/hf_specformer/models/companion/modeling_companion.py",
        "hub_cards/sv-companion-smollm2-135m-instruct.md",
        f"{drafter.relative_to(tmp_path).as_posix()}/custom_generate/removed_module.py",
    }
    fix_copies(tmp_path)
    assert not (drafter / "custom_generate" / "removed_module.py").exists()
    assert stale_copies(tmp_path) == []
    for path in (package / "models" / "companion" / "modeling_companion.py", companion / "modeling_companion.py"):
        text = path.read_text()
        assert f"class CompanionRMSNorm(nn.Module):\n    {edited_docstring}" in text
        assert "SpecFormerRMSNorm(" not in text
        assert "hook(self, save_directory)  # edited" in text
    assert (drafter / "custom_generate" / "engine.py").read_text().endswith("# edited\n")
