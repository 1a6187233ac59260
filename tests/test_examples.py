"""The framework examples run as a user runs them and leave what they print: entropy beside the loop's loss.

Each runs in a subprocess (seconds on CPU, nothing downloaded) into a temporary
directory; its TensorBoard event files are read back. The numbers themselves
are checked against the float64 reference in tests/hf and tests/lightning.
Caught: the Fabric example attaching the core without ``fabric_sinks`` (no entropy in its event file).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf.test_trainer import _read
from tests.lightning.test_callback import PREFIX

ROOT = Path(__file__).resolve().parents[1]


def _run(example: str, out: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), str(out)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize(
    ("example", "event_dir", "loss"),
    [("hf_trainer.py", "runs/*", "eval/loss"), ("fabric_loop.py", "tb/version_*", "val_loss")],
)
def test_example_logs_entropy_at_the_steps_of_its_loss(tmp_path: Path, example: str, event_dir: str, loss: str) -> None:
    stdout = _run(example, tmp_path)
    (directory,) = glob.glob(str(tmp_path / event_dir))
    assert f"--logdir {directory}" in stdout or f"--logdir {Path(directory).parent} " in stdout  # where the logs are
    events = _read(directory)  # every event file of the directory: one TensorBoard run
    steps = [e.step for e in events.Scalars(loss)]
    assert len(steps) >= 2
    assert [e.step for e in events.Scalars(f"{PREFIX}/mean")] == steps
    assert events.Images(f"{PREFIX}/heatmap")
