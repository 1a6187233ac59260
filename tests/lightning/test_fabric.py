"""MonitorCore in a real Lightning Fabric loop, written through Fabric's own loggers.

A TinyGPT (q and k scaled up, so attention is spread) at learning rate 0 (weights as built) trains 4 steps with Fabric
(cpu, one device), validating after steps 2 and 4 on 3 batches, the first 2
recorded; Fabric's TensorBoardLogger event file, CSVLogger file and an offline W&B run are read
back and checked against the float64 reference of test_callback.

Broken variants these tests caught (each tried, then restored):
``fabric_sinks`` giving the TensorBoardLogger itself (scalars only: no
histogram or heatmap in the event file), giving no sinks on rank zero, and
giving the ``WandbLogger`` itself (no histogram in the W&B run).
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

from attn_monitor import Batches, LogOptions, MonitorCore, fabric_sinks
from tests.helpers import lightning_models as lm
from tests.helpers import models
from tests.lightning.test_callback import (
    PREFIX,
    assert_spread,
    check_against_reference,
    check_histogram,
    expected_names,
    gpt_reference,
    read_csv,
    read_tensorboard,
    read_wandb_history,
    tb_scalars_at,
    wandb_settings,
)
from tests.shared.test_names import per_head_names

STEPS = [2, 4]


def _fabric_loop(loggers: list[Any]) -> dict[str, Any]:
    """4 steps of a Fabric loop writing through ``loggers``, validating after steps 2 and 4; the reference."""
    fabric = Fabric(accelerator="cpu", devices=1, loggers=loggers)
    model = lm.TinyGPT(lr=0.0)
    with torch.no_grad():  # q and k (the first two thirds of c_attn) scaled up: attention far from uniform
        for block in model.blocks:
            block.attn.c_attn.weight[: 2 * lm.HIDDEN] *= models.SHARPEN
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    train, val = lm.make_batches(4, seed=31), lm.make_batches(3, seed=32)
    core = MonitorCore(batches=Batches(2), log=LogOptions(per_head=True), say=fabric.print)
    core.attach(model, fabric_sinks(fabric), device=fabric.device)
    for step, batch in enumerate(train, start=1):
        model.train()
        loss = model.training_step(batch, step)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step in STEPS:
            model.eval()
            core.validation_start(epoch=step // 2 - 1)
            with torch.no_grad():
                for index, val_batch in enumerate(val):
                    with core.recording(index, val_batch, num_batches=len(val)):
                        model(**val_batch)
            core.validation_end(step)
            fabric.log("val_marker", float(step), step=step)
    core.training_end()
    core.release()
    for logger in loggers:
        logger.finalize("success")
    return gpt_reference(model.state_dict(), val[:2])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fabric")
    loggers = [TensorBoardLogger(root / "tb"), CSVLogger(root / "csv")]
    return {
        "reference": _fabric_loop(loggers),
        "events": read_tensorboard(loggers[0].log_dir),
        "csv": read_csv(str(Path(loggers[1].log_dir) / "metrics.csv")),
    }


def test_reference_is_spread(run: dict[str, Any]) -> None:
    assert_spread(run["reference"])


def test_tensorboard_logger_gets_scalars_histograms_and_heatmap(run: dict[str, Any]) -> None:
    events = run["events"]
    tags = {tag for tag in events.Tags()["scalars"] if tag.startswith(PREFIX)}
    assert tags == expected_names(lm.GPT_LAYERS, per_head=True)
    assert {tag for tag in tags if "/head_" in tag} == per_head_names(lm.GPT_LAYERS, lm.HEADS)
    for step in STEPS:
        check_against_reference(tb_scalars_at(events, step), run["reference"])
    for layer in lm.GPT_LAYERS:
        histograms = events.Histograms(f"{PREFIX}/{layer}/hist")
        assert [e.step for e in histograms] == STEPS
        check_histogram(list(histograms[-1].histogram_value.bucket), run["reference"][layer].normalized)
    assert [e.step for e in events.Images(f"{PREFIX}/heatmap")] == STEPS
    assert [e.step for e in events.Scalars("val_marker")] == STEPS  # the loop's own value, same steps


def test_csv_logger_gets_the_scalars(run: dict[str, Any]) -> None:
    columns, rows = run["csv"]
    assert expected_names(lm.GPT_LAYERS, per_head=True) <= set(columns)
    logged = [row for row in rows if row.get(f"{PREFIX}/mean")]
    assert [int(row["step"]) for row in logged] == STEPS
    for row in logged:
        scalars = {name: float(row[name]) for name in expected_names(lm.GPT_LAYERS, per_head=True)}
        check_against_reference(scalars, run["reference"])


def test_wandb_logger_gets_everything_in_its_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``WandbLogger`` (offline) in ``fabric.loggers``: one run holds every scalar, the histograms and the heatmap.

    Caught: ``fabric_sinks`` giving the ``WandbLogger`` itself (scalars only: no histogram, no heatmap).
    """
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="attn-monitor-tests", settings=wandb_settings())
    try:
        reference = _fabric_loop([logger])
    finally:
        wandb.finish()
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "*run-*" / "run-*.wandb"))
    rows = [row for row in read_wandb_history(run_file) if f"{PREFIX}/mean" in row]
    assert [row["trainer/global_step"] for row in rows] == STEPS
    names = expected_names(lm.GPT_LAYERS, per_head=True)
    for row in rows:
        check_against_reference({name: row[name] for name in names}, reference)
        for layer in lm.GPT_LAYERS:
            check_histogram(row[f"{PREFIX}/{layer}/hist"]["values"], reference[layer].normalized)
        assert row[f"{PREFIX}/heatmap"]["_type"] == "image-file"
