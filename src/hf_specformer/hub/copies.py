"""Every copy the repository ships, checked against its source and rewritten from it (`make fix-copies`).

Copies exist because the Hub serves remote code as flat, self-contained folders:
- each shipped folder `src/hf_specformer/pretrained/<name>/` carries its model's `configuration_*.py` and
  `modeling_*.py`, and a drafter's folder `custom_generate/` (the generation modules and `requirements.txt`,
  `export.write_custom_generate`);
- `hub_cards/<name>.md` is the card of the shipped folder `<name>` (its `README.md`), kept beside the code for review;
- a class or method under a `# Copied from <module>.<Class>[.<method>]` comment is that definition with its class
  name prefix replaced (as in transformers' `utils/check_copies.py`), so one model file need not import another.
"""

from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .export import CUSTOM_GENERATE_DIR, generation_sources, requirements_text

COPIED_FROM = re.compile(r"^[ \t]*# Copied from (\w+)\.([\w.]+)", re.MULTILINE)
MODEL_FOLDERS = {"specformer": "specformer", "sv_companion": "companion"}
"""`model_type` of a shipped folder's config -> its package folder under `models/`."""


@dataclass
class Copy:
    """One copy: `path` must read `text` (what its source makes of it)."""

    path: Path
    text: str

    @property
    def stale(self) -> bool:
        return not self.path.is_file() or self.path.read_text() != self.text


def _package(root: Path) -> Path:
    return root / "src" / "hf_specformer"


def _folder_copies(root: Path, folder: Path) -> list[Copy]:
    """The remote code and card of one shipped folder."""
    package = _package(root)
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    models = package / "models" / MODEL_FOLDERS[model_type]
    sources = [*models.glob("configuration_*.py"), *models.glob("modeling_*.py")]
    copies = [Copy(folder / source.name, source.read_text()) for source in sorted(sources)]
    if model_type == "specformer":
        generation = generation_sources(package / "generation")
        copies += [Copy(folder / CUSTOM_GENERATE_DIR / path.name, path.read_text()) for path in generation]
        copies.append(Copy(folder / CUSTOM_GENERATE_DIR / "requirements.txt", requirements_text()))
    if (folder / "README.md").is_file():
        copies.append(Copy(root / "hub_cards" / f"{folder.name}.md", (folder / "README.md").read_text()))
    return copies


def _definitions(tree: ast.Module) -> dict[int, tuple[list[str], ast.AST]]:
    """Every class and function of a module by its first line: (the dotted path of names down to it, the node)."""
    found = {}

    def visit(body: list[ast.stmt], path: list[str]) -> None:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                found[node.lineno] = ([*path, node.name], node)
                visit(node.body, [*path, node.name])

    visit(tree.body, [])
    return found


def _copied_from(root: Path, path: Path) -> Copy | None:
    """`path` with every definition under a `# Copied from <module>.<Class>[.<method>]` comment rewritten from its
    source, the source's leading class-name prefix replaced by the copy's; None without such a comment."""
    text = path.read_text()
    matches = list(COPIED_FROM.finditer(text))
    if not matches:
        return None
    lines = text.splitlines(keepends=True)
    copies = _definitions(ast.parse(text))
    for match in reversed(matches):  # bottom up: the line numbers above stay valid
        module, dotted = match.groups()
        comment_line = text.count("\n", 0, match.start()) + 1
        if comment_line + 1 not in copies:
            raise ValueError(f"{path}:{comment_line}: `# Copied from` must sit right above a class or function")
        names, copy = copies[comment_line + 1]
        sources = list((_package(root) / "models").glob(f"*/{module}.py"))
        if len(sources) != 1:
            raise ValueError(f"{path}:{comment_line}: no single source module {module}.py")
        source_text = sources[0].read_text()
        source = next((node for found, node in _definitions(ast.parse(source_text)).values()
                       if found == dotted.split(".")), None)
        if source is None:
            raise ValueError(f"{path}:{comment_line}: {sources[0].name} has no {dotted}")
        source_lines = source_text.splitlines(keepends=True)[source.lineno - 1 : source.end_lineno]
        old, new = dotted.split(".")[0], names[0]
        suffix = os.path.commonprefix([old[::-1], new[::-1]])[::-1]
        replaced = "".join(source_lines).replace(old[: len(old) - len(suffix)], new[: len(new) - len(suffix)])
        lines[copy.lineno - 1 : copy.end_lineno] = [replaced]
    return Copy(path, "".join(lines))


def shipped_copies(root: str | os.PathLike) -> list[Copy]:
    """Every copy under the repository `root`: shipped folders, cards and `# Copied from` classes."""
    root = Path(root)
    package = _package(root)
    copies = []
    for folder in sorted(path for path in (package / "pretrained").iterdir() if (path / "config.json").is_file()):
        copies += _folder_copies(root, folder)
    for path in sorted((package / "models").glob("*/*.py")):
        copied = _copied_from(root, path)
        if copied is not None:
            copies.append(copied)
    return copies


def orphans(root: str | os.PathLike) -> list[Path]:
    """Files in a shipped `custom_generate/` that no longer have a source (a module removed or renamed)."""
    copies = {copy.path for copy in shipped_copies(root)}
    folders = (_package(Path(root)) / "pretrained").glob(f"*/{CUSTOM_GENERATE_DIR}")
    return sorted(path for folder in folders for path in folder.iterdir() if path.is_file() and path not in copies)


def stale_copies(root: str | os.PathLike) -> list[Path]:
    """The copies under `root` that differ from their source, and orphaned files (`make fix-copies` fixes both)."""
    return sorted([copy.path for copy in shipped_copies(root) if copy.stale] + orphans(root))


def fix_copies(root: str | os.PathLike) -> list[Path]:
    """Rewrites every stale copy under `root` from its source and removes orphans; returns their paths. `# Copied
    from` classes are rewritten before the shipped folders copy the files that hold them."""
    fixed = orphans(root)
    for path in fixed:
        path.unlink()
    for _ in range(2):
        for copy in shipped_copies(root):
            if copy.stale:
                copy.path.parent.mkdir(parents=True, exist_ok=True)
                copy.path.write_text(copy.text)
                fixed.append(copy.path)
    return sorted(set(fixed))
