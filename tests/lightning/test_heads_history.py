"""The heads-over-training history when two validations share one step.

Two validations land on one Lightning step when ``val_check_interval``
validates between the batches of one gradient accumulation, or when
``Trainer.validate`` runs twice at one ``global_step``. The history keeps one
column per step, and the later validation replaces the earlier: the logged
scalars of that step are the later ones too (what a chart shows last), and
two columns at one step would draw two validations as if training had moved
on between them. Every column is checked against per-head medians recomputed
in float64 from the weights and batches each validation used (tests/test_callback.py's
``gpt_reference``), and the picture written when training ends is read back
from TensorBoard.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from attn_monitor import LogOptions
from attn_monitor.lightning.callback import AttentionEntropyMonitor
from attn_monitor.report.figures import Picture, history_picture, read_cells
from tests.helpers import lightning_models as lm
from tests.lightning.test_callback import gpt_reference, make_trainer, read_tensorboard

PREFIX = "attn_entropy"
BIN = 0.001  # the metric's quantiles are exact within one of its bins
COLOUR_STEP = 2 / 255  # two steps of the picture's 256-colour scale


def reference_medians(state: dict[str, Any], batches: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """layer -> (heads, 2) bounds of each head's exact median (the two middle order statistics)."""
    out = {}
    for layer, samples in gpt_reference(state, batches).items():
        bounds = []
        for head in range(lm.HEADS):
            ordered = samples.normalized[samples.head == head].sort().values
            middle = (len(ordered) - 1) / 2
            bounds.append([float(ordered[int(np.floor(middle))]), float(ordered[int(np.ceil(middle))])])
        out[layer] = np.array(bounds)
    return out


def assert_within(medians: np.ndarray, bounds: np.ndarray, slack: float) -> None:
    assert ((medians >= bounds[:, 0] - slack) & (medians <= bounds[:, 1] + slack)).all(), (medians, bounds)


def test_validations_between_accumulated_batches_keep_one_column_per_step(tmp_path: Path) -> None:
    """4 training batches, accumulation 2, a validation after every batch: Lightning steps 0, 0, 1, 1.

    The two validations of a step see different weights (the second follows
    an optimizer step). Fails when a repeated step is appended to the history
    instead of replacing its entry (``Dashboards.remember``: four columns for
    two steps), and when the earlier validation of a step is kept.
    """
    recorder = lm.BatchRecorder()
    monitor = AttentionEntropyMonitor(batches=2, log=LogOptions(histogram_bins=None))
    memory, tensorboard = lm.MemoryLogger(), TensorBoardLogger(tmp_path, name="tb")
    trainer = make_trainer(
        tmp_path,
        loggers=[memory, tensorboard],
        callbacks=[monitor, recorder],
        max_epochs=1,
        accumulate_grad_batches=2,
        val_check_interval=1,
    )
    trainer.fit(lm.TinyGPT(lr=0.05), lm.loader(lm.make_batches(4, seed=1)), lm.loader(lm.make_batches(2, seed=2)))
    assert memory.steps_of(f"{PREFIX}/mean") == [0, 0, 1, 1]  # two validations at each step
    later = [recorder.validations[1], recorder.validations[3]]  # the last validation of each step
    accumulator = read_tensorboard(tensorboard.log_dir)
    for layer in lm.GPT_LAYERS:
        steps, medians = monitor.core.dashboards.medians_over_time(layer, prefix=PREFIX)
        assert steps == [0, 1]
        bounds = [reference_medians(v["state"], v["batches"])[layer] for v in later]
        for column, want in enumerate(bounds):
            assert_within(medians[:, column], want, BIN)
        assert not np.allclose(bounds[0], bounds[1]), "the model must learn between the steps"
        event = accumulator.Images(f"{PREFIX}_heads/{layer}/over_training")[-1]  # drawn at every validation
        assert event.step == 1
        layout = history_picture(layer, [0, 1], np.stack([b.mean(1) for b in bounds], axis=1))
        shown = read_cells(Picture(_decode(event), layout.grid, layout.cells, layout.limits, layout.colours))
        assert shown.shape == (lm.HEADS, 2)
        for column, want in enumerate(bounds):
            assert_within(shown[:, column], want, BIN + COLOUR_STEP)


def test_validate_twice_at_one_step_keeps_only_the_later_run(tmp_path: Path) -> None:
    """``Trainer.validate`` after ``fit``, twice at one ``global_step`` on two loaders: only the second one stays.

    Every run (a fit, each ``validate``) starts from zero, so the history of
    the last call holds its own validation at its step and nothing of the fit
    or of the first call. Fails when a repeated step is appended across runs
    (two entries at step 2), when a run keeps the columns of the one before
    (step 1 of the fit), or when the earlier validation is kept.
    """
    monitor = AttentionEntropyMonitor(batches=2, log=LogOptions(histogram_bins=None, heatmap=False))
    trainer = make_trainer(tmp_path, loggers=[lm.MemoryLogger()], callbacks=[monitor], max_epochs=1)
    model = lm.TinyGPT(lr=0.05)
    trainer.fit(model, lm.loader(lm.make_batches(2, seed=1)), lm.loader(lm.make_batches(2, seed=2)))
    first, second = (
        lm.make_batches(2, seed=3),
        [
            {"input_ids": (batch["input_ids"] % 3) + 1, "attention_mask": batch["attention_mask"]}
            for batch in lm.make_batches(2, seed=4)
        ],
    )
    trainer.validate(model, lm.loader(first), verbose=False)
    trainer.validate(model, lm.loader(second), verbose=False)
    state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    for layer in lm.GPT_LAYERS:
        steps, medians = monitor.core.dashboards.medians_over_time(layer, prefix=PREFIX)
        assert steps == [2]  # both validate calls at global step 2; the fit's step 1 belongs to the fit
        earlier, later = (reference_medians(state, batches)[layer] for batches in (first, second))
        assert_within(medians[:, -1], later, BIN)
        # Some head's median differs by many bins: keeping the earlier validation fails the line above.
        assert np.abs(earlier.mean(1) - later.mean(1)).max() > 10 * BIN, "the two loaders must differ"


def _decode(image: Any) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"))


pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")
