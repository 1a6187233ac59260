"""What users install is what we test: run against the built wheel, from outside the checkout.

Usage: ``python .ci/wheel_smoke.py SOURCE_PACKAGE_DIR`` with the wheel installed in this
interpreter. Checks that every module of the source tree is in the installed package (a
subpackage missing from the wheel fails here), that each imports, and that the package
measures a tiny model and runs its command line.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path


def main(source: Path) -> None:
    import attn_monitor

    installed = Path(attn_monitor.__file__).resolve().parent
    assert source.resolve() not in installed.parents and installed != source.resolve(), (
        f"attn_monitor imported from the checkout ({installed}), not from the wheel"
    )
    wanted = {path.relative_to(source).as_posix() for path in source.rglob("*.py")}
    shipped = {path.relative_to(installed).as_posix() for path in installed.rglob("*.py")}
    missing = sorted(wanted - shipped)
    assert not missing, f"the wheel lacks {missing}"
    assert (installed / "py.typed").exists(), "the wheel lacks py.typed"
    for name in sorted(wanted):
        parts = ["attn_monitor", *Path(name).with_suffix("").parts]
        importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))

    import torch
    from torch import nn

    from attn_monitor import AttentionEntropyMonitor, evaluate_attention

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    summary = evaluate_attention(model, [(torch.randn(2, 5, 16),)])
    assert len(summary.layers) == 2 and 0 < summary.overall_mean < 1, (summary.layers, summary.overall_mean)
    AttentionEntropyMonitor()
    from attn_monitor import AttentionEntropyCallback  # the hf extra: the wheel is installed with it

    AttentionEntropyCallback()
    cli = subprocess.run(["attn-monitor", "--help"], capture_output=True, text=True, check=True)
    assert "compare" in cli.stdout
    print(f"wheel smoke: {len(shipped)} modules from {installed}, {len(summary.layers)} layers measured")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
