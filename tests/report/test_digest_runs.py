"""The digest and the default dashboards of real Lightning fits, read back from TensorBoard and W&B offline.

A TinyGPT learns for four epochs; at every monitored validation the digest
is written as TensorBoard text and as a W&B table, and the head it names as
the largest drop since the first monitored validation is checked against
per-head medians recomputed in float64 from the weights and batches each
validation used (tests/test_callback.py's ``gpt_reference``). The reference
must single the head out: its largest possible change is below every other
head's smallest possible one (exact medians lie between two order
statistics, the metric's within a bin of them).

A 12-layer, 12-head GPT-2 with default options shows how much a user gets
to look at: scalar tags, charts per layer, picture widths, the first chart.

Broken variants these tests catch (each tried, then restored): the baseline
replaced at every validation (``Dashboards.remember`` without the
first-step check: no head "fell"); ``LogOptions.per_head`` on by default (385 tags); the loss chart
left out of the first layout category; the set-up line said at every
validation.
"""

from __future__ import annotations

import glob
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from attn_monitor.lightning.callback import AttentionEntropyMonitor
from attn_monitor.report.digest import COLUMNS
from attn_monitor.report.display import short_names
from attn_monitor.report.figures import CARD_WIDTH
from tests.helpers import lightning_models as lm
from tests.helpers import models
from tests.lightning.test_callback import make_trainer, read_tensorboard, read_wandb_history, wandb_settings
from tests.lightning.test_heads_history import BIN, reference_medians

PREFIX = "attn_entropy"
EPOCHS = 4
ROUNDING = 0.005  # the digest prints two decimals
HEADLINE = r"\*\*Step (\d+)\*\*: layer (\S+) head (\d+) fell from ([\d.]+) to ([\d.]+) since step (\d+)"


@dataclass
class Fit:
    tensorboard_dir: str
    wandb_file: str
    validations: list[dict[str, Any]]
    setup_lines: list[str]


@pytest.fixture(scope="module")
def digest_fit(tmp_path_factory: pytest.TempPathFactory) -> Fit:
    """TinyGPT, 4 epochs of 4 training batches at a high learning rate, TensorBoard and W&B offline."""
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    root = tmp_path_factory.mktemp("digest_fit")
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero.addHandler(handler)
    level = rank_zero.level
    rank_zero.setLevel(logging.INFO)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        tensorboard = TensorBoardLogger(root, name="tb")
        loggers = [
            tensorboard,
            WandbLogger(save_dir=str(root), offline=True, project="attn-monitor-tests", settings=wandb_settings()),
        ]
        recorder = lm.BatchRecorder()
        trainer = make_trainer(
            root, loggers=loggers, callbacks=[AttentionEntropyMonitor(), recorder], max_epochs=EPOCHS
        )
        try:
            trainer.fit(
                lm.TinyGPT(lr=0.05), lm.loader(lm.make_batches(4, seed=1)), lm.loader(lm.make_batches(2, seed=2))
            )
        finally:
            wandb.finish()
            rank_zero.removeHandler(handler)
            rank_zero.setLevel(level)
    (wandb_file,) = glob.glob(str(root / "wandb" / "*run-*" / "run-*.wandb"))
    return Fit(tensorboard.log_dir, wandb_file, recorder.validations, [s for s in said if "attn_monitor:" in s])


def reference_drops(fit: Fit) -> list[tuple[tuple[str, int], np.ndarray, np.ndarray]]:
    """Per later validation: the (layer, head) the reference says fell most, and (layers, heads, 2) bounds now, first.

    Asserts the reference singles that head out whatever the metric's binning.
    """
    bounds = [reference_medians(v["state"], v["batches"][:2]) for v in fit.validations]
    first = np.stack([bounds[0][layer] for layer in lm.GPT_LAYERS])
    out = []
    for later in bounds[1:]:
        now = np.stack([later[layer] for layer in lm.GPT_LAYERS])
        most = now[..., 1] - first[..., 0] + 2 * BIN  # largest change each head can show
        least = now[..., 0] - first[..., 1] - 2 * BIN  # smallest
        layer, head = np.unravel_index(np.argmin(least), least.shape)
        others = np.delete(least.reshape(-1), layer * lm.HEADS + head)
        assert most[layer, head] < min(0.0, others.min()), "the reference is not spread"
        out.append(((lm.GPT_LAYERS[layer], int(head)), now[layer, head], first[layer, head]))
    return out


def within(value: float, bounds: np.ndarray, slack: float) -> bool:
    return bool(bounds[0] - slack <= value <= bounds[1] + slack)


def test_tensorboard_digest_names_the_head_the_reference_says_fell_most(digest_fit: Fit) -> None:
    accumulator = read_tensorboard(digest_fit.tensorboard_dir)
    steps = [e.step for e in accumulator.Scalars("val_loss")]
    events = accumulator.Tensors(f"{PREFIX}/digest/text_summary")
    assert [e.step for e in events] == steps and len(steps) == EPOCHS  # at every monitored validation
    names = dict(zip(lm.GPT_LAYERS, short_names(lm.GPT_LAYERS), strict=True))
    for event, ((layer, head), now, first) in zip(events[1:], reference_drops(digest_fit), strict=True):
        text = event.tensor_proto.string_val[0].decode()
        headline = re.match(HEADLINE, text)
        assert headline is not None, text
        assert (int(headline[1]), headline[6]) == (event.step, str(steps[0]))
        assert (headline[2], int(headline[3])) == (names[layer], head), text
        assert within(float(headline[4]), first, BIN + ROUNDING) and within(float(headline[5]), now, BIN + ROUNDING)


def test_wandb_digest_table_names_the_same_head(digest_fit: Fit) -> None:
    rows = [row for row in read_wandb_history(digest_fit.wandb_file) if f"{PREFIX}/digest" in row]
    assert len(rows) == EPOCHS
    files = Path(digest_fit.wandb_file).parent / "files"
    for row, ((layer, head), now, first) in zip(rows[1:], reference_drops(digest_fit), strict=True):
        table = json.loads((files / row[f"{PREFIX}/digest"]["path"]).read_text())
        assert table["columns"] == list(COLUMNS)
        (drop,) = [dict(zip(COLUMNS, r, strict=True)) for r in table["data"] if r[1] == "largest_drop"]
        assert (drop["layer_name"], drop["head"], drop["step"]) == (layer, head, row["trainer/global_step"])
        assert within(drop["median"], now, BIN) and within(drop["first"], first, BIN)


def test_setup_line_is_said_once_per_fit(digest_fit: Fit) -> None:
    (line,) = digest_fit.setup_lines
    assert line == (
        "attn_monitor: 2 attention layers found (blocks.0.attn, blocks.1.attn), 4 heads each, read by sdpa; "
        "recording the first 2 batches of each validation dataloader, every epoch."
    )


# --------------------------------------------------------------------------- 12 layers x 12 heads, defaults


class WideGPT2(lm.HFLM):
    """GPT-2 of 12 layers x 12 heads (head size 4), as a new user's first model with default options."""

    def __init__(self) -> None:
        import transformers

        lm._LMSteps.__init__(self)
        self.lr = 1e-2
        config = transformers.GPT2Config(
            n_embd=48, n_layer=12, n_head=12, n_inner=96, vocab_size=models.VOCAB, n_positions=models.MAX_LEN,
            bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=models.INIT_RANGE,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def test_defaults_at_12_by_12_are_sized_for_people(tmp_path: Path) -> None:
    """At most 120 scalar tags from the monitor, at most 10 per layer, pictures as wide as the card, loss first."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    pytest.importorskip("transformers")
    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    trainer = make_trainer(tmp_path, loggers=[tensorboard], callbacks=[AttentionEntropyMonitor()], max_epochs=1)
    trainer.fit(WideGPT2(), lm.loader(lm.make_batches(1, seed=1)), lm.loader(lm.make_batches(2, seed=2)))
    accumulator = read_tensorboard(tensorboard.log_dir)
    tags = accumulator.Tags()
    layers = [f"model.transformer.h.{i}.attn" for i in range(12)]
    ours = [t for t in tags["scalars"] if t.startswith(PREFIX)]
    assert len(ours) <= 120
    for layer in layers:
        assert 0 < len([t for t in ours if t.startswith(f"{PREFIX}/{layer}/")]) <= 10
    assert not [t for t in ours if "/head_" in t]
    pictures = [f"{PREFIX}/heatmap", *(f"{PREFIX}_heads/{layer}/over_training" for layer in layers)]
    assert set(tags["images"]) == set(pictures)
    for tag in pictures:
        (image,) = accumulator.Images(tag)
        assert image.width == CARD_WIDTH, tag
    (config,) = accumulator.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    first = {chart.title: list(chart.multiline.tag) for chart in layout.category[0].chart}
    assert first == {"entropy · mean of all layers": [f"^{PREFIX}/mean$"], "loss": ["^val_loss$"]}
    assert all(len(category.chart) <= 10 for category in layout.category)
