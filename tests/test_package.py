"""The package imports light: no Lightning, matplotlib, wandb or transformers until they are used.

Each check runs in a fresh interpreter, so nothing this test session already
imported can hide an import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("lightning", "pytorch_lightning", "matplotlib", "wandb", "transformers")


def _imported_after(code: str) -> set[str]:
    """Top-level names in ``sys.modules`` (of the heavy ones) after running ``code`` in a new interpreter."""
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
        check=True,
    )
    return set(json.loads(result.stdout.splitlines()[-1])) & {*HEAVY, "torch"}


def test_import_attn_monitor_imports_nothing_heavy() -> None:
    assert _imported_after("import attn_monitor") == set()


def test_the_core_api_imports_without_lightning() -> None:
    loaded = _imported_after(
        "from attn_monitor import AttentionCapture, AttentionEntropy, MassDiagnostics, entropy_from_qk, "
        "evaluate_attention, compare"
    )
    assert "torch" in loaded  # the names did load
    # torchmetrics itself may pull in matplotlib and transformers; Lightning and wandb must stay out.
    assert not loaded & {"lightning", "pytorch_lightning", "wandb"}


def test_the_callback_loads_on_first_use() -> None:
    loaded = _imported_after(
        "import attn_monitor\n"
        "assert 'lightning' not in sys.modules\n"
        "from attn_monitor import AttentionEntropyMonitor\n"
        "from attn_monitor.callback import AttentionEntropyMonitor as same\n"
        "assert AttentionEntropyMonitor is same"
    )
    assert "lightning" in loaded


def test_every_public_name_resolves_and_compare_stays_the_function() -> None:
    # Importing the module that defines `compare` must not replace the function on the package.
    _imported_after(
        "import attn_monitor, attn_monitor.comparison, inspect\n"
        "for name in attn_monitor.__all__:\n"
        "    assert getattr(attn_monitor, name).__name__ == name, name\n"
        "assert inspect.isfunction(attn_monitor.compare)\n"
        "assert sorted(attn_monitor.__all__) == attn_monitor.__all__\n"
        "assert set(attn_monitor.__all__) <= set(dir(attn_monitor))"
    )


def test_unknown_names_raise_attribute_error() -> None:
    import pytest

    import attn_monitor

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        attn_monitor.Nope  # noqa: B018


def test_cli_help_does_not_import_torch() -> None:
    loaded = _imported_after(
        "import contextlib, io\n"
        "from attn_monitor.__main__ import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--help']) == 0"
    )
    assert loaded == set()
