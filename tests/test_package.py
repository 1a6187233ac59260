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


def test_import_and_cli_help_import_nothing_heavy() -> None:
    loaded = _imported_after(
        "import contextlib, io\n"
        "import attn_monitor\n"
        "from attn_monitor.__main__ import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--help']) == 0"
    )
    assert loaded == set()  # not even torch


def test_core_api_without_lightning_then_the_callback_on_first_use() -> None:
    # torchmetrics itself may pull in matplotlib and transformers; Lightning and wandb must stay out
    # until the callback is asked for. Importing the module that defines `compare` must not
    # replace the function on the package.
    loaded = _imported_after(
        "import inspect\n"
        "import attn_monitor, attn_monitor.report.comparison\n"
        "from attn_monitor import AttentionCapture, AttentionEntropy, MassDiagnostics, compare\n"
        "from attn_monitor import entropy_from_qk, evaluate_attention\n"
        "assert not {'lightning', 'pytorch_lightning', 'wandb'} & {m.split('.')[0] for m in sys.modules}\n"
        "assert inspect.isfunction(compare) and inspect.isfunction(attn_monitor.compare)\n"
        "from attn_monitor import AttentionEntropyMonitor\n"
        "from attn_monitor.lightning.callback import AttentionEntropyMonitor as same\n"
        "assert AttentionEntropyMonitor is same\n"
        "for name in attn_monitor.__all__:\n"
        "    assert getattr(attn_monitor, name).__name__ == name, name\n"
        "assert sorted(attn_monitor.__all__) == attn_monitor.__all__\n"
        "assert set(attn_monitor.__all__) <= set(dir(attn_monitor))"
    )
    assert "lightning" in loaded


def test_unknown_names_raise_attribute_error() -> None:
    import pytest

    import attn_monitor

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        attn_monitor.Nope  # noqa: B018
