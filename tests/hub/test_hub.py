"""Hub folders: `save_pretrained` writes a complete one, its requirements are the package's floors, cards parse as
`huggingface_hub.ModelCard`s, and publishing builds one commit of every file (everything up to the network call)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from conftest import make_companion, make_drafter, make_target
from huggingface_hub import ModelCard

from hf_specformer.hub.export import REQUIREMENTS, commit_operations, push_folder

ROOT = Path(__file__).resolve().parents[2]


def test_requirements_are_the_packages_floors():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {re.split(r"[><=;\s]", dep)[0]: dep.split(",")[0] for dep in dependencies}
    assert list(REQUIREMENTS) == [floors["torch"], floors["transformers"]]
    assert all(re.fullmatch(r"[a-z_-]+>=\d+\.\d+", line) for line in REQUIREMENTS)
    shipped = ROOT / "src/hf_specformer/pretrained/specformer-smollm2-135m-instruct/custom_generate/requirements.txt"
    assert shipped.read_text().splitlines() == list(REQUIREMENTS)


def test_save_pretrained_writes_complete_folders(tmp_path):
    target = make_target("llama")
    drafter, companion = make_drafter(target), make_companion(target)
    drafter.save_pretrained(tmp_path / "drafter")
    companion.save_pretrained(tmp_path / "companion")
    for name in ("config.json", "model.safetensors", "configuration_specformer.py", "modeling_specformer.py",
                 "custom_generate/generate.py", "custom_generate/engine.py", "custom_generate/requirements.txt"):
        assert (tmp_path / "drafter" / name).is_file(), name
    assert not (tmp_path / "companion" / "custom_generate").exists()
    for folder, model_type in (("drafter", "specformer"), ("companion", "sv_companion")):
        card = ModelCard.load(tmp_path / folder / "README.md")
        assert "speculative-decoding" in card.data.tags, card.data.tags
        assert model_type in (tmp_path / folder / "config.json").read_text()


class RecordingHubApi:
    """Stands in for `huggingface_hub.HfApi` where the network would start: records what would be sent."""

    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, operations, kwargs))
        return "commit"


def test_push_builds_one_commit_of_every_file(tmp_path):
    drafter = make_drafter(make_target("llama"))
    drafter.save_pretrained(tmp_path / "drafter")
    (tmp_path / "drafter" / "custom_generate" / "__pycache__").mkdir()
    (tmp_path / "drafter" / "custom_generate" / "__pycache__" / "x.pyc").write_bytes(b"")
    api = RecordingHubApi()
    assert push_folder(tmp_path / "drafter", "me/drafter", api=api, private=True) == "commit"
    (_, repo, repo_kwargs), (_, commit_repo, operations, commit_kwargs) = api.calls
    assert repo == commit_repo == "me/drafter" and repo_kwargs["private"] and repo_kwargs["exist_ok"]
    paths = [operation.path_in_repo for operation in operations]
    expected = sorted(p.relative_to(tmp_path / "drafter").as_posix() for p in (tmp_path / "drafter").rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts)
    assert paths == expected and "custom_generate/generate.py" in paths and "README.md" in paths
    assert commit_operations(tmp_path / "drafter")[0].path_or_fileobj.startswith(str(tmp_path))


def test_cards_name_the_target_they_were_trained_for(tmp_path):
    """`base_model` is the target's Hub id when it has one: the embedded GGUF maps to SmolLM2's id and the card says
    the weights were that GGUF's; a local folder or an unrecorded target gives no `base_model` (a path is no Hub id)
    and a card that names the folder; the name is the folder's."""
    from hf_specformer.hub.cards import render_card, render_companion_card
    from hf_specformer.targets import SMOLLM2_NAME

    target = make_target("llama")
    drafter, companion = make_drafter(target), make_companion(target)
    local = tmp_path / "my-target"
    local.mkdir()
    cases = {"Qwen/Qwen3-0.6B": "Qwen/Qwen3-0.6B", SMOLLM2_NAME: "HuggingFaceTB/SmolLM2-135M-Instruct",
             str(local): None, None: None}
    for recorded, base_model in cases.items():
        drafter.config.target_name_or_path = companion.config.target_name_or_path = recorded
        for text in (render_card(drafter, name="my-drafter"), render_companion_card(companion, name="my-drafter")):
            card = ModelCard(text)
            assert card.data.base_model == base_model, (recorded, card.data.base_model)
            assert "# my-drafter" in text
            assert ("Q4_1 GGUF" in text) == (recorded == SMOLLM2_NAME)
            if recorded == str(local):
                assert "a local target (`my-target`" in text and str(tmp_path) not in text
