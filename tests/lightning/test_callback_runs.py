"""Real fits checking which validations the alerts see and how a second validation loader is named.

Values are compared with the float64 recomputation of tests/test_callback.py
(``gpt_reference``: TinyGPT's own projections, an explicit softmax, the
support the batch implies); names are read from what reached a logger and
from ``trainer.callback_metrics``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from attn_monitor import Batches, LogOptions, MaxLogitAlert, OverloadAlert, Statistics
from attn_monitor.lightning.callback import AttentionEntropyMonitor
from tests.helpers import lightning_models as lm
from tests.lightning.test_callback import MEAN_TOL, gpt_reference, make_trainer

PREFIX = "attn_entropy"

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")


def test_alerts_skip_a_monitored_sanity_check(tmp_path: Path) -> None:
    """The sanity check is logged (at step 0) but runs no alert: no flagged-head counts there, no warning.

    Every head is flagged by both warn-only alerts (a threshold of 0 for
    overload, a max logit threshold of -1000), so any alert run shows. Fails
    when the alerts run during the sanity check, independently of the
    collapse alert's baseline and ``stop_on_collapse``.
    """
    monitor = AttentionEntropyMonitor(
        batches=Batches(1, skip_sanity_check=False),
        statistics=Statistics(max_logit=True),
        log=LogOptions(histogram_bins=None, heatmap=False),
        alerts=[OverloadAlert(0.0), MaxLogitAlert(-1000.0)],
    )
    logger = lm.MemoryLogger()
    trainer = make_trainer(tmp_path, loggers=[logger], callbacks=[monitor], max_epochs=1, num_sanity_val_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lm.TinyGPT(), lm.loader(lm.make_batches(2, seed=1)), lm.loader(lm.make_batches(2, seed=2)))
    records = logger.merged_records()
    assert [step for step, metrics in records if f"{PREFIX}/mean" in metrics] == [0, 1]  # sanity check, epoch 0
    flagged = {f"{PREFIX}/{layer}/overloaded_heads" for layer in lm.GPT_LAYERS} | {
        f"attn_max_logit/{layer}/over_threshold_heads" for layer in lm.GPT_LAYERS
    }
    by_step = dict(records)
    assert not flagged & set(by_step[0]), sorted(flagged & set(by_step[0]))
    assert flagged <= set(by_step[1])
    assert all(by_step[1][name] == lm.HEADS for name in flagged)
    messages = [str(w.message) for w in caught if str(w.message).startswith("attn_monitor")]
    alerts = [m for m in messages if "overload" in m or "max logit" in m]
    assert len(alerts) == 2 * len(lm.GPT_LAYERS), alerts  # one warning per layer and alert, naming every head
    assert all(f"heads {list(range(lm.HEADS))}" in m for m in alerts), alerts


def test_second_validation_loader_is_suffixed_in_callback_metrics_and_logger(tmp_path: Path) -> None:
    """Both loaders' names end in their own ``/dataloader_idx_{i}``; loader 1's means are its own reference.

    Read from the ``LightningModule.log`` path (``trainer.callback_metrics``)
    and from a plain logger, not TensorBoard. Fails when the suffix is left
    off, or given another index, for either loader.
    """
    first = lm.make_batches(1, seed=11)
    # Few repeated tokens: other attention than the random ids of the first loader.
    repeated = (torch.arange(lm.SEQ) % 3 + 1).repeat(lm.BATCH, 1)
    second = [{"input_ids": repeated, "attention_mask": torch.ones(lm.BATCH, lm.SEQ)}]
    monitor = AttentionEntropyMonitor(batches=1, log=LogOptions(histogram_bins=None, heatmap=False))
    logger = lm.MemoryLogger()
    model = lm.TinyGPT(lr=0.0)
    with torch.no_grad():  # larger logits: attention that depends on the input
        for block in model.blocks:
            block.attn.c_attn.weight.mul_(3.0)
    trainer = make_trainer(tmp_path, loggers=[logger], callbacks=[monitor], max_epochs=1, limit_train_batches=1)
    trainer.fit(model, lm.loader(lm.make_batches(1, seed=10)), [lm.loader(first), lm.loader(second)])

    means = [f"{PREFIX}/mean"] + [f"{PREFIX}/{layer}/mean" for layer in lm.GPT_LAYERS]
    watched = {name for name in trainer.callback_metrics if name.startswith(PREFIX)}
    suffixes = [f"/dataloader_idx_{i}" for i in (0, 1)]
    by_loader = [{name.removesuffix(end) for name in watched if name.endswith(end)} for end in suffixes]
    assert sum(len(names) for names in by_loader) == len(watched)  # every name carries one loader's suffix
    assert by_loader[0] == by_loader[1] >= set(means)  # per-layer statistics besides the means, per loader
    # The means (through LightningModule.log) and every other per-layer statistic, each loader's own.
    assert {f"{name}/dataloader_idx_{i}" for name in means for i in (0, 1)} <= watched
    assert all(name.endswith(("/dataloader_idx_0", "/dataloader_idx_1")) for name in watched)
    assert f"{PREFIX}/{lm.GPT_LAYERS[0]}/q50/dataloader_idx_1" in watched
    logged = {name for _, metrics in logger.merged_records() for name in metrics if name.startswith(PREFIX)}
    for index in (0, 1):
        own = {name for name in logged if name.endswith(f"/dataloader_idx_{index}")}
        assert f"{PREFIX}/{lm.GPT_LAYERS[1]}/q50/dataloader_idx_{index}" in own
        assert len(own) * 2 == len(logged)  # the two loaders log the same names, each with its suffix
    reference_means: list[list[float]] = []
    for index, batches in enumerate((first, second)):
        samples = gpt_reference(model.state_dict(), batches)
        reference_means.append([])
        for layer in lm.GPT_LAYERS:
            want = float(samples[layer].normalized.mean())
            got = float(trainer.callback_metrics[f"{PREFIX}/{layer}/mean/dataloader_idx_{index}"])
            assert got == pytest.approx(want, abs=MEAN_TOL), (index, layer)
            reference_means[-1].append(want)
    gap = max(abs(a - b) for a, b in zip(*reference_means, strict=True))
    assert gap > 0.03, "the loaders must differ in attention for this test to mean anything"
