"""The import rule of docs/design.md §5: a module imports only from its own layer or a lower one.

Read from the source with ``ast`` (nothing is imported), so a forbidden
import fails here even when it sits inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attn_monitor"

#: Layer of every module, lowest first (docs/design.md §5).
LAYERS = {
    **dict.fromkeys(("shared", "names"), 0),
    **dict.fromkeys(("masks", "functional", "flex"), 1),
    **dict.fromkeys(("metric", "bound"), 2),
    **dict.fromkeys(
        (
            "calls",
            "batches",
            "eager",
            "softmax",
            "mha",
            "hf_interface",
            "parallel",
            "capture",
            "consumers",
            "head_stats",
            "selfcheck",
        ),
        3,
    ),
    **dict.fromkeys(("loggers", "figures", "alerts", "comparison", "display", "digest"), 4),
    **dict.fromkeys(("schedule", "recording", "core", "callback", "hf_trainer", "fabric"), 5),
    **dict.fromkeys(("__init__", "__main__"), 6),
}

#: The only modules that may import a training framework.
FRAMEWORK_IMPORTS = {
    "lightning": {"callback", "fabric"},
    "pytorch_lightning": set(),
    "transformers": {"hf_trainer"},
}


def _imports(path: Path) -> set[str]:
    """Top-level packages and ``attn_monitor`` modules that ``path`` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                found.add(parts[1] if parts[0] == "attn_monitor" and len(parts) > 1 else parts[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "attn_monitor":
                found.add(parts[0])
            elif len(parts) > 1:
                found.add(parts[1])
            else:
                found.update(alias.name for alias in node.names)
    return found


MODULES = sorted(path.stem for path in PACKAGE.glob("*.py"))


def test_every_module_has_a_layer() -> None:
    assert set(MODULES) == set(LAYERS), "add new modules to LAYERS (and to docs/design.md §5)"


@pytest.mark.parametrize("module", MODULES)
def test_imports_point_down(module: str) -> None:
    upward = {
        other
        for other in _imports(PACKAGE / f"{module}.py")
        if other in LAYERS and other != module and LAYERS[other] > LAYERS[module]
    }
    assert not upward, f"attn_monitor.{module} (layer {LAYERS[module]}) imports higher layers: {sorted(upward)}"


@pytest.mark.parametrize("module", MODULES)
def test_only_adapters_import_a_framework(module: str) -> None:
    imported = _imports(PACKAGE / f"{module}.py")
    offending = {framework for framework, allowed in FRAMEWORK_IMPORTS.items() if framework in imported}
    offending = {framework for framework in offending if module not in FRAMEWORK_IMPORTS[framework]}
    assert not offending, f"attn_monitor.{module} imports {sorted(offending)}"


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    source = tmp_path / "metric.py"
    source.write_text("def f():\n    from attn_monitor.callback import AttentionEntropyMonitor\n")
    assert "callback" in _imports(source)
