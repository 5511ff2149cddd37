"""One-way imports (see STYLE.md): models know nothing of generation; Hub-bundled files import only siblings."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "hf_specformer"
ALLOWED = {
    "models": {"models", "kernels"},  # kernels optional (try/except ImportError), for remote code
    "generation": {"generation", "kernels"},
    "kernels": {"kernels"},
    "hub": {"hub", "models", "generation"},
    "data": {"data", "generation"},
    "training": {"training", "models", "generation", "hub", "targets", "data"},
}
"""Library subpackage -> what it may import. The applications (`apps/`) may import anything; nothing imports them."""
BUNDLED_EXTERNAL = {"torch", "transformers", "numpy"} | set(sys.stdlib_module_names)
"""What Hub remote code may import: torch, transformers, numpy (which transformers requires), the standard library."""


def internal_imports(path: Path) -> tuple[set[str], set[str]]:
    """(top-level hf_specformer subpackages imported, external top-level modules imported) of one file."""
    tree = ast.parse(path.read_text())
    module_parts = path.relative_to(PACKAGE).parts[:-1]
    internal, external = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(module_parts[: len(module_parts) - node.level + 1])
            names = [node.module.split(".")] if node.module else [[alias.name] for alias in node.names]
            internal.update((base + name)[0] for name in names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")
            (internal.add(root[1]) if root[0] == "hf_specformer" else external.add(root[0]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")
                (internal.add(root[1]) if root[0] == "hf_specformer" and len(root) > 1 else external.add(root[0]))
    return internal, external


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_one_way_imports(package):
    for path in (PACKAGE / package).rglob("*.py"):
        internal, _ = internal_imports(path)
        assert internal <= ALLOWED[package], f"{path.relative_to(PACKAGE)} imports {internal - ALLOWED[package]}"


def test_the_library_never_imports_the_applications():
    for path in PACKAGE.rglob("*.py"):
        if "apps" not in path.relative_to(PACKAGE).parts and "pretrained" not in path.parts:
            assert "apps" not in internal_imports(path)[0], f"{path.relative_to(PACKAGE)} imports the applications"


def test_the_cpu_backend_attention_and_the_targets_import_no_generation():
    assert internal_imports(PACKAGE / "attention.py")[0] == set()
    assert internal_imports(PACKAGE / "cpu.py")[0] == {"attention"}
    assert internal_imports(PACKAGE / "targets.py")[0] <= {"models"}


@pytest.mark.parametrize("folder", ["models/specformer", "models/companion", "generation"])
def test_hub_bundled_files_import_only_torch_transformers_and_siblings(folder):
    for path in (PACKAGE / folder).glob("*.py"):
        if path.name == "__init__.py":
            continue  # registration lives there and is never copied to the Hub
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, f"{path.name}: only `from .sibling import` is allowed ({node.module})"
        internal, external = internal_imports(path)
        assert external <= BUNDLED_EXTERNAL, f"{path.name} imports {external - BUNDLED_EXTERNAL}"
        assert internal - {"kernels"} <= {path.parent.name, *path.relative_to(PACKAGE).parts[:1]}
        assert optional_package_imports(tree) == package_imports(tree), \
            f"{path.name}: hf_specformer may only be imported inside `try: ... except ImportError`"


def package_imports(tree: ast.AST) -> list[ast.AST]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import)
            and any(alias.name.startswith("hf_specformer") for alias in node.names)]


def optional_package_imports(tree: ast.AST) -> list[ast.AST]:
    """Imports of hf_specformer inside a `try` whose handlers catch ImportError (remote code falls back)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(handler.type, ast.Name) and handler.type.id == "ImportError" for handler in node.handlers
        ):
            found.extend(child for statement in node.body for child in ast.walk(statement)
                         if isinstance(child, ast.Import) and any(a.name.startswith("hf_specformer")
                                                                  for a in child.names))
    return found
