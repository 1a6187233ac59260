"""The import rule of docs/design.md §5: a module imports only from its own layer or a lower one.

The layer of a module is its folder. Imports are read from the source with
``ast`` (nothing is imported), so a forbidden import fails here even when it
sits inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attn_monitor"

#: Rank of each layer, lowest first (docs/design.md §5); a top-level module is its own layer.
#: Layers of one rank (the training frameworks' adapters) never import each other.
LAYERS = {
    "shared": 0,
    "functional": 1,
    "metrics": 2,
    "capture": 3,
    "report": 4,
    "monitor": 5,
    "lightning": 6,
    "hf": 6,
    "__init__": 7,
    "__main__": 7,
}

#: The only layers that may import a training framework.
FRAMEWORKS = {"lightning": {"lightning"}, "pytorch_lightning": set(), "transformers": {"hf"}}


def _layer(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    """Top-level packages and ``attn_monitor`` layers that ``path`` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "attn_monitor" else [f"attn_monitor.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found.add(f"attn_monitor.{parts[1]}" if parts[0] == "attn_monitor" and len(parts) > 1 else parts[0])
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))
IDS = [path.relative_to(PACKAGE).as_posix() for path in MODULES]


def test_every_module_has_a_layer() -> None:
    assert {_layer(path) for path in MODULES} <= set(LAYERS), "add new layers to LAYERS and docs/design.md §5"


@pytest.mark.parametrize("path", MODULES, ids=IDS)
def test_imports_point_down(path: Path) -> None:
    layer = _layer(path)
    imported = {name.removeprefix("attn_monitor.") for name in _imports(path) if name.startswith("attn_monitor.")}
    upward = {other for other in imported if other in LAYERS and other != layer and LAYERS[other] >= LAYERS[layer]}
    assert not upward, f"{path.relative_to(PACKAGE)} ({layer}) imports layers not below it: {sorted(upward)}"


@pytest.mark.parametrize("path", MODULES, ids=IDS)
def test_only_adapters_import_a_framework(path: Path) -> None:
    imported = _imports(path)
    offending = {name for name, allowed in FRAMEWORKS.items() if name in imported and _layer(path) not in allowed}
    assert not offending, f"{path.relative_to(PACKAGE)} imports {sorted(offending)}"


def test_the_rule_reads_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "entropy.py"
    source.write_text("def f():\n    from attn_monitor.lightning.callback import AttentionEntropyMonitor\n")
    assert _imports(source) == {"attn_monitor.lightning"}


def test_every_layer_is_in_the_design_note() -> None:
    note = (PACKAGE.parent / "docs" / "design.md").read_text()
    missing = [layer for layer in LAYERS if not layer.startswith("__") and f"`{layer}/`" not in note]
    assert not missing, f"docs/design.md §5 does not describe {missing}"
