"""What people see: logged names, steps, TensorBoard layout, W&B charts and alerts, and the pictures.

Pictures are checked for what they show: each cell's colour is read back from
the pixels (:func:`~attn_monitor.report.figures.read_cells`) and compared with an
independent float64 median of the raw values, or with the per-head scalars
the same run logged. Logged files are read back after a real ``Trainer.fit``
(TensorBoard's ``EventAccumulator``; the W&B offline transaction log with the
reader in tests/test_callback.py).
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from attn_monitor import CollapseAlert, LogOptions
from attn_monitor.lightning.callback import AttentionEntropyMonitor
from attn_monitor.metrics.entropy import AttentionEntropy, EntropySummary
from attn_monitor.report.display import short_names
from attn_monitor.report.figures import (
    CARD_WIDTH,
    Picture,
    grid_picture,
    heatmap_picture,
    history_picture,
    median_grid,
    png_bytes,
    read_cells,
)
from attn_monitor.report.layout import tensorboard_layout
from tests.helpers import lightning_models as lm
from tests.lightning.test_callback import (
    make_trainer,
    read_tensorboard,
    read_wandb_history,
    read_wandb_records,
    wandb_settings,
)

PREFIX = "attn_entropy"
STEPS = [1, 2, 4, 5]  # Lightning's steps of the four validations of `fit_run`
COLOUR_STEP = 2 / 255  # two steps of the 256-colour scale: neighbouring colours are close, rounding too
BIN = 0.001


# --------------------------------------------------------------------------- pictures


def summary_of(values: dict[str, list[list[float]]], keys: int = 16) -> EntropySummary:
    """A summary whose layer's head h holds the normalised entropies ``values[layer][h]`` (keys visible each)."""
    metric = AttentionEntropy(num_bins=1000)
    for layer, heads in values.items():
        entropy = torch.tensor(heads, dtype=torch.float64)[None] * math.log(keys)  # (1, heads, queries)
        metric.update(layer, entropy, torch.tensor(keys))
    return metric.compute()


def test_heatmap_cells_hold_each_heads_median_not_its_mean() -> None:
    # Skewed heads: median and mean far apart (head 0: median 0.1, mean 0.3).
    values = {
        "blocks.0.attn": [[0.1, 0.1, 0.1, 0.9], [0.7, 0.8, 0.8, 0.0], [0.5, 0.5, 0.5, 0.5]],
        "blocks.1.attn": [[0.2, 0.3, 0.3, 1.0], [0.05, 0.95, 0.95, 0.95], [0.6, 0.0, 0.6, 0.6]],
    }
    picture = heatmap_picture(summary_of(values))
    shown = read_cells(picture)
    # The exact median lies between the two middle order statistics (float64, from the raw values).
    ordered = [[sorted(h) for h in heads] for heads in values.values()]
    low = np.array([[h[(len(h) - 1) // 2] for h in heads] for heads in ordered])
    high = np.array([[h[len(h) // 2] for h in heads] for heads in ordered])
    means = np.array([[np.mean(h) for h in heads] for heads in values.values()])
    assert (shown >= low - COLOUR_STEP - BIN).all() and (shown <= high + COLOUR_STEP + BIN).all()
    assert np.abs(shown - means).max() > 0.15  # a heatmap of means would fail the line above
    assert np.array_equal(picture.grid, median_grid(summary_of(values)))


def test_heatmap_leaves_missing_heads_blank_and_writes_values_where_they_fit() -> None:
    """Values are written in cells of at least 30 x 16 pixels: 3 heads in the card's width, not 17."""
    values = {"a": [[0.2, 0.2]] * 3, "b": [[0.9, 0.9]] * 2}  # layer b has 2 heads of 3
    picture = heatmap_picture(summary_of(values))
    assert np.isnan(read_cells(picture)[1, 2])
    assert picture.size[0] == CARD_WIDTH

    def ink_in_middle(picture: Picture, row: int, column: int) -> bool:
        left, top, right, bottom = picture.cells[row, column]
        middle = picture.pixels[top + 3 : bottom - 3, left + 3 : right - 3].reshape(-1, 3)
        return len(np.unique(middle, axis=0)) > 1  # more than the cell's own colour: a written value

    assert ink_in_middle(picture, 0, 0)
    rng = np.random.default_rng(0)
    wide = grid_picture(
        rng.random((2, 17)),
        ["a", "b"],
        [str(h) for h in range(17)],
        title="t",
        label="l",
        row_title="",
        column_title="",
    )
    assert not ink_in_middle(wide, 0, 0)


@pytest.mark.parametrize("layers", [32, 48])
def test_layer_names_of_many_layers_do_not_touch(layers: int) -> None:
    """Every labelled layer's name is its own run of inked pixel rows (no two overlap), in the card's width.

    Rows of 32 and 48 layers are thinner than a line of text: the labels are
    thinned to every k-th. Fails when every row is labelled (runs merge).
    """
    names = [f"model.transformer.h.{i}.attn" for i in range(layers)]
    picture = grid_picture(
        np.random.default_rng(1).random((layers, 32)),
        names,
        [str(h) for h in range(32)],
        title="Median normalised attention entropy per head",
        label="median",
        row_title="",
        column_title="head",
    )
    top, left = picture.cells[0, 0, 1], picture.cells[0, 0, 0]
    bottom = picture.cells[-1, 0, 3]
    labels = picture.pixels[top:bottom, : left - 2]
    inked = (labels < 200).any(axis=(1, 2))
    runs = int(inked[0]) + int(np.count_nonzero(inked[1:] & ~inked[:-1]))
    centres = (picture.cells[:, 0, 1] + picture.cells[:, 0, 3]) // 2 - top
    labelled = int(inked[centres].sum())  # a label is centred on its row
    assert runs == labelled >= layers // 4
    assert picture.size[0] == CARD_WIDTH


def test_grid_picture_rejects_labels_that_do_not_match() -> None:
    with pytest.raises(ValueError, match=r"2 row labels and 3 column labels"):
        grid_picture(np.zeros((2, 3)), ["a"], ["0", "1", "2"], title="", label="", row_title="", column_title="")


def test_png_bytes_decode_to_the_pixels() -> None:
    """Every pixel survives, at an odd size (no row padding) and with values that would wrap a filter."""
    pixels = np.random.default_rng(0).integers(0, 256, size=(37, 53, 3), dtype=np.uint8)
    pixels[:, :10] = 255  # a flat band beside the noise
    picture = Picture(pixels, np.zeros((1, 1)), np.zeros((1, 1, 4), dtype=np.int64), (0.0, 1.0), "viridis")
    from PIL import Image

    decoded = Image.open(io.BytesIO(png_bytes(picture)))
    assert decoded.mode == "RGB" and decoded.size == (53, 37)
    assert np.array_equal(np.asarray(decoded), pixels)


# --------------------------------------------------------------------------- a real fit: every view of one validation


@dataclass
class Fit:
    tensorboard_dir: str
    wandb_file: str | None
    monitor: AttentionEntropyMonitor
    warnings: list[str]


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory: pytest.TempPathFactory) -> Fit:
    """TinyGPT learning for 2 epochs of 6 batches, gradient accumulation 2, validation every 3 batches.

    Validations fall after an accumulating batch (the 3rd of an epoch) and
    after a stepping one (the 6th), so Lightning's step is neither
    ``global_step`` nor ``global_step - 1`` at every validation. A
    collapse threshold of 0.99 flags every head: one alert per head. Per-head
    scalars are on (``LogOptions(per_head=True)``): the pictures are checked against them.
    """
    root = tmp_path_factory.mktemp("dash")
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    with pytest.MonkeyPatch.context() as patch, pytest.warns(UserWarning) as caught:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        tensorboard = TensorBoardLogger(root, name="tb")
        loggers = [
            tensorboard,
            WandbLogger(save_dir=str(root), offline=True, project="attn-monitor-tests", settings=wandb_settings()),
        ]
        monitor = AttentionEntropyMonitor(alerts=[CollapseAlert(threshold=0.99)], log=LogOptions(per_head=True))
        trainer = make_trainer(
            root, loggers=loggers, callbacks=[monitor], accumulate_grad_batches=2, val_check_interval=3
        )
        try:
            trainer.fit(
                lm.TinyGPT(lr=0.05), lm.loader(lm.make_batches(6, seed=1)), lm.loader(lm.make_batches(3, seed=2))
            )
        finally:
            wandb.finish()
    files = glob.glob(str(root / "wandb" / "*run-*" / "run-*.wandb"))
    return Fit(tensorboard.log_dir, files[0] if files else None, monitor, [str(w.message) for w in caught])


def test_scalars_histograms_and_pictures_share_val_loss_steps(fit_run: Fit) -> None:
    accumulator = read_tensorboard(fit_run.tensorboard_dir)
    steps = [e.step for e in accumulator.Scalars("val_loss")]
    # Optimizer steps after batches 2, 4, 6 of each epoch; a validation is logged at the count before its batch.
    assert steps == STEPS
    tags = accumulator.Tags()
    entropy = [t for t in tags["scalars"] if t.startswith((PREFIX + "/", PREFIX + "_heads/"))]
    assert entropy
    for tag in entropy:
        assert [e.step for e in accumulator.Scalars(tag)] == steps, tag
    for tag in tags["histograms"]:
        assert [e.step for e in accumulator.Histograms(tag)] == steps, tag
    for tag in tags["images"]:  # the heads-over-training pictures too: a live or crashed run has them
        assert [e.step for e in accumulator.Images(tag)] == steps, tag
    assert {t for t in tags["images"] if t.endswith("/over_training")}, "no heads-over-training picture"
    assert [e.step for e in accumulator.Tensors(f"{PREFIX}/digest/text_summary")] == steps


def test_main_group_has_per_layer_statistics_only(fit_run: Fit) -> None:
    scalars = read_tensorboard(fit_run.tensorboard_dir).Tags()["scalars"]
    main = {t for t in scalars if t.startswith(PREFIX + "/")}
    heads = {t for t in scalars if t.startswith(PREFIX + "_heads/")}
    assert not any("/head_" in t for t in main)
    per_layer = ("mean", "mean_seq", "nats_mean", "q05", "q25", "q50", "q75", "q95", "collapsed_heads")
    assert main == {f"{PREFIX}/mean"} | {f"{PREFIX}/{la}/{s}" for la in lm.GPT_LAYERS for s in per_layer}
    assert heads == {
        f"{PREFIX}_heads/{la}/head_{h}/{s}" for la in lm.GPT_LAYERS for h in range(4) for s in ("mean", "q50")
    }


def test_custom_scalars_layout_one_chart_per_layer(fit_run: Fit) -> None:
    from tensorboard.plugins.custom_scalar import layout_pb2

    accumulator = read_tensorboard(fit_run.tensorboard_dir)
    events = accumulator.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(events[-1].tensor_proto.string_val[0])
    scalars = set(accumulator.Tags()["scalars"])
    titles = [c.title for c in layout.category]
    assert titles == [PREFIX, *(f"{PREFIX} · {layer}" for layer in lm.GPT_LAYERS)]  # one category per layer
    # The first category: entropy over all layers beside the module's own validation loss.
    first = {chart.title: list(chart.multiline.tag) for chart in layout.category[0].chart}
    assert list(first) == ["entropy · mean of all layers", "loss"]
    assert {t for t in scalars if re.search(first["entropy · mean of all layers"][0], t)} == {f"{PREFIX}/mean"}
    assert {t for t in scalars if any(re.search(p, t) for p in first["loss"])} == {"val_loss"}
    charts = [chart for category in layout.category for chart in category.chart]
    margins = [c for c in charts if c.HasField("margin")]
    multilines = [c for c in charts if c.HasField("multiline")]
    assert len(margins) == len(lm.GPT_LAYERS)
    shown = dict(zip(lm.GPT_LAYERS, short_names(lm.GPT_LAYERS), strict=True))  # titles: short, categories: full
    for chart, layer in zip(margins, lm.GPT_LAYERS, strict=True):
        (series,) = chart.margin.series
        assert (series.value, series.lower, series.upper) == tuple(
            f"{PREFIX}/{layer}/{q}" for q in ("q50", "q25", "q75")
        )
        assert chart.title.startswith(f"layer {shown[layer]} · ")
    # One line per head for each layer (per-head values on); no chart of several layers' lines.
    for layer in lm.GPT_LAYERS:
        (chart,) = [c for c in multilines if c.title.startswith(f"layer {shown[layer]} · ")]
        (pattern,) = chart.multiline.tag
        assert {t for t in scalars if re.search(pattern, t)} == {
            f"{PREFIX}_heads/{layer}/head_{h}/q50" for h in range(4)
        }
    assert len(multilines) == len(lm.GPT_LAYERS) + 2


def test_other_families_get_their_own_heads_category() -> None:
    names = ["attn_entropy/mean", "attn_max_logit/h.0/max", "attn_max_logit_heads/h.0/head_0/max"]
    layout = tensorboard_layout([*names, "attn_max_logit_heads/h.0/head_1/max"])
    (chart,) = layout["attn_max_logit_heads"].values()
    assert chart[0] == "Multiline" and re.search(chart[1][0], "attn_max_logit_heads/h.0/head_1/max")


def _decode(image: Any) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"))


def _logged_medians(accumulator: Any, layer: str, step: int) -> np.ndarray:
    return np.array(
        [
            next(e.value for e in accumulator.Scalars(f"{PREFIX}_heads/{layer}/head_{h}/q50") if e.step == step)
            for h in range(4)
        ]
    )


def test_logged_heatmap_shows_the_logged_head_medians(fit_run: Fit) -> None:
    accumulator = read_tensorboard(fit_run.tensorboard_dir)
    (event,) = [e for e in accumulator.Images(f"{PREFIX}/heatmap") if e.step == STEPS[-1]]
    pixels = _decode(event)
    assert pixels.shape[1] == CARD_WIDTH
    assert fit_run.monitor.last_summary is not None
    layout = heatmap_picture(fit_run.monitor.last_summary)  # where the cells are
    shown = read_cells(Picture(pixels, layout.grid, layout.cells, layout.limits, layout.colours))
    logged = np.stack([_logged_medians(accumulator, layer, STEPS[-1]) for layer in lm.GPT_LAYERS])
    assert np.abs(shown - logged).max() <= COLOUR_STEP


def test_heads_over_training_picture_holds_each_validations_medians(fit_run: Fit) -> None:
    accumulator = read_tensorboard(fit_run.tensorboard_dir)
    monitor = fit_run.monitor
    for layer in lm.GPT_LAYERS:
        events = accumulator.Images(f"{PREFIX}_heads/{layer}/over_training")
        steps, medians = monitor.core.dashboards.medians_over_time(layer, prefix=PREFIX)
        assert steps == STEPS
        logged = np.stack([_logged_medians(accumulator, layer, step) for step in steps], axis=1)  # (heads, steps)
        assert np.abs(medians - logged).max() < 1e-6
        assert [e.step for e in events] == STEPS  # drawn at every validation, each with the history so far
        for seen, event in enumerate(events, start=1):
            layout = history_picture(layer, steps[:seen], medians[:, :seen])
            shown = read_cells(Picture(_decode(event), layout.grid, layout.cells, layout.limits, layout.colours))
            assert np.abs(shown - logged[:, :seen]).max() <= COLOUR_STEP
        assert not np.allclose(logged[:, 0], logged[:, -1]), "the model must learn for this test to mean anything"


def test_wandb_per_head_chart_and_alerts(fit_run: Fit) -> None:
    assert fit_run.wandb_file is not None
    run_dir = Path(fit_run.wandb_file).parent
    rows = read_wandb_history(fit_run.wandb_file)
    accumulator = read_tensorboard(fit_run.tensorboard_dir)
    for layer in lm.GPT_LAYERS:
        key = f"{PREFIX}_heads/{layer}/chart_table"
        charts = [row for row in rows if key in row]
        assert [row["trainer/global_step"] for row in charts] == STEPS  # at every validation, the history so far
        table = json.loads((run_dir / "files" / charts[-1][key]["path"]).read_text())
        assert table["columns"] == ["step", "lineKey", "lineVal"]
        lines: dict[str, dict[int, float]] = {}
        for step, head, value in table["data"]:
            lines.setdefault(head, {})[step] = value
        assert sorted(lines) == [f"head {h}" for h in range(4)]  # one chart, one line per head
        for step in STEPS:
            want = _logged_medians(accumulator, layer, step)
            assert [lines[f"head {h}"][step] for h in range(4)] == pytest.approx(want, abs=1e-6)
    alerts = [r.alert for r in read_wandb_records(fit_run.wandb_file) if r.WhichOneof("record_type") == "alert"]
    collapse = [a for a in alerts if "collapse" in a.title]
    assert {layer for layer in lm.GPT_LAYERS if any(layer in a.text for a in collapse)} == set(lm.GPT_LAYERS)
    assert all(a.level == "WARN" for a in collapse)
    assert sum("collapse" in w for w in fit_run.warnings) == len(collapse)


# --------------------------------------------------------------------------- Lightning callbacks monitor entropy


def test_early_stopping_and_checkpoint_monitor_entropy(tmp_path: Path) -> None:
    """lr 0: entropy never improves, so EarlyStopping(patience=1) stops after the second epoch of ten."""
    monitor = AttentionEntropyMonitor(log=LogOptions(histogram_bins=None, heatmap=False))
    stopper = EarlyStopping(monitor=f"{PREFIX}/mean", mode="min", patience=1, min_delta=1e-3)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor=f"{PREFIX}/mean", mode="min", save_top_k=1)
    logger = lm.MemoryLogger()
    trainer = make_trainer(
        tmp_path,
        loggers=[logger],
        callbacks=[monitor, stopper, checkpoint],
        max_epochs=10,
        limit_train_batches=2,
        enable_checkpointing=True,
    )
    trainer.fit(lm.TinyGPT(lr=0.0), lm.loader(lm.make_batches(2, seed=1)), lm.loader(lm.make_batches(2, seed=2)))
    assert trainer.current_epoch == 2 and stopper.stopped_epoch == 1
    logged = logger.values_of(f"{PREFIX}/mean")
    assert len(logged) == 2
    assert float(trainer.callback_metrics[f"{PREFIX}/mean"]) == pytest.approx(logged[-1])
    assert checkpoint.best_model_score is not None
    assert float(checkpoint.best_model_score) == pytest.approx(logged[0])
    assert os.path.isfile(checkpoint.best_model_path)
    # The monitor's values are logged together with the module's own validation loss, in one record.
    assert all("val_loss" in m for _, m in logger.records if f"{PREFIX}/mean" in m)
    # callback_metrics hold every per-layer statistic (what a callback would watch), no per-head value.
    watched = {name for name in trainer.callback_metrics if name.startswith(PREFIX)}
    per_layer = ("mean", "mean_seq", "nats_mean", "q05", "q25", "q50", "q75", "q95")
    assert watched == {f"{PREFIX}/mean"} | {f"{PREFIX}/{layer}/{stat}" for layer in lm.GPT_LAYERS for stat in per_layer}
    for step, metrics in logger.merged_records():
        if f"{PREFIX}/mean" in metrics:
            assert {f"{PREFIX}/{layer}/q50" for layer in lm.GPT_LAYERS} <= set(metrics), step


def test_layout_keeps_validation_dataloaders_apart() -> None:
    names = [
        f"{name}/dataloader_idx_{i}"
        for i in (0, 1)
        for name in [
            "attn_entropy/mean",
            *(f"attn_entropy/h.0/{q}" for q in ("q25", "q50", "q75", "mean")),
            *(f"attn_entropy_heads/h.0/head_{h}/q50" for h in range(2)),
        ]
    ]
    layout = tensorboard_layout(names)
    assert list(layout) == [f"attn_entropy/dataloader_idx_{i}{part}" for i in (0, 1) for part in ("", " · h.0")]
    for i in (0, 1):
        charts = layout[f"attn_entropy/dataloader_idx_{i} · h.0"]
        margin = next(tags for kind, tags in charts.values() if kind == "Margin")
        assert margin == [f"attn_entropy/h.0/{q}/dataloader_idx_{i}" for q in ("q50", "q25", "q75")]
        (pattern,) = next(tags for kind, tags in charts.values() if kind == "Multiline")
        assert [n for n in names if re.search(pattern, n)] == [
            f"attn_entropy_heads/h.0/head_{h}/q50/dataloader_idx_{i}" for h in range(2)
        ]


class _TwoStepsPerBatch(lm.TinyGPT):
    """Manual optimisation with two optimizer steps per batch: ``global_step`` runs twice as fast as batches."""

    def __init__(self) -> None:
        super().__init__(lr=0.01)
        self.automatic_optimization = False

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:  # type: ignore[override]
        first, second = self.optimizers()  # type: ignore[misc]
        for optimizer in (first, second):
            loss = lm.lm_loss(self(**batch), batch)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        self.log("train_loss", loss)

    def configure_optimizers(self) -> Any:  # type: ignore[override]
        blocks = list(self.blocks.parameters())
        rest = [p for p in self.parameters() if all(p is not b for b in blocks)]
        return torch.optim.SGD(blocks, lr=self.lr), torch.optim.SGD(rest, lr=self.lr)


def test_pictures_follow_val_loss_with_manual_optimization(tmp_path: Path) -> None:
    monitor = AttentionEntropyMonitor(log=LogOptions(histogram_bins=10))
    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    trainer = make_trainer(tmp_path, loggers=[tensorboard], callbacks=[monitor], limit_train_batches=3)
    trainer.fit(_TwoStepsPerBatch(), lm.loader(lm.make_batches(3, seed=1)), lm.loader(lm.make_batches(2, seed=2)))
    assert trainer.global_step == 12  # 2 epochs x 3 batches x 2 optimizers
    accumulator = read_tensorboard(tensorboard.log_dir)
    steps = [e.step for e in accumulator.Scalars("val_loss")]
    assert steps == [2, 5]  # batches before the last one of each epoch
    assert [e.step for e in accumulator.Scalars(f"{PREFIX}/mean")] == steps
    assert [e.step for e in accumulator.Histograms(f"{PREFIX}/blocks.0.attn/hist")] == steps
    assert [e.step for e in accumulator.Images(f"{PREFIX}/heatmap")] == steps
