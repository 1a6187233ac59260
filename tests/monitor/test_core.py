"""MonitorCore driven by a plain loop, no Trainer: what a Fabric or hand-written loop gets.

The numbers are checked against the float64 reference of test_callback
(``gpt_reference``), read back from the sinks themselves: a plain scalar
sink and a TensorBoard ``SummaryWriter``'s event file.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from attn_monitor import Batches, CollapseAlert, LogOptions, MonitorCore
from attn_monitor.report.archive import SummaryArchive, load_summary
from tests.helpers import lightning_models as lm
from tests.helpers import models
from tests.lightning.test_callback import (
    PREFIX,
    check_against_reference,
    gpt_reference,
    read_tensorboard,
    tb_scalars_at,
)


class Scalars:
    """A scalar sink: what ``log_metrics`` received, per step."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.records.append((step, dict(metrics)))

    def at(self, step: int) -> dict[str, float]:
        return {name: value for s, metrics in self.records if s == step for name, value in metrics.items()}


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _validate(core: MonitorCore, model: torch.nn.Module, batches: list[dict[str, Any]], epoch: int, step: int) -> Any:
    """One validation as a plain loop writes it."""
    recorded = core.validation_start(epoch=epoch)
    with torch.no_grad():
        for index, batch in enumerate(batches):
            with core.recording(index, batch, num_batches=len(batches)):
                model(**batch)
    return recorded, core.validation_end(step)


def test_plain_loop_logs_reference_values_to_plain_sinks(tmp_path: Path) -> None:
    """Two validations (first two of three batches each), one training step: every sink holds the reference.

    Fails when the core records a batch it should not (the third), writes
    another step, or leaves the scalars out of a sink.
    """
    from torch.utils.tensorboard import SummaryWriter

    model = lm.TinyGPT(lr=0.0).eval()
    hooks = _hooks(model)
    val = lm.make_batches(3, seed=21)
    scalars, writer = Scalars(), SummaryWriter(str(tmp_path / "tb"))
    core = MonitorCore(batches=Batches(2, train_every_n_steps=5), log=LogOptions(per_head=True))
    core.attach(model, [scalars, writer, SummaryArchive(str(tmp_path / "saved"))])
    samples = gpt_reference(model.state_dict(), val[:2])
    for epoch, step in ((0, 9), (1, 19)):
        recorded, outcome = _validate(core, model, val, epoch, step)
        assert recorded and not outcome.stop
        check_against_reference(outcome.scalars, samples)
        assert scalars.at(step) == outcome.scalars
    assert core.training_step_start(10, val[2])
    model(**val[2])
    core.training_forward_end()
    train = core.training_step_end(10)
    assert train[f"{PREFIX}_train/mean"] == pytest.approx(
        float(torch.cat([s.normalized for s in gpt_reference(model.state_dict(), val[2:]).values()]).mean()), abs=1e-4
    )
    core.training_end()
    core.release()
    writer.close()
    assert _hooks(model) == hooks
    events = read_tensorboard(str(tmp_path / "tb"))
    check_against_reference(tb_scalars_at(events, 19), samples)
    assert f"{PREFIX}/{lm.GPT_LAYERS[0]}/hist" in events.Tags()["histograms"]
    assert {f"{PREFIX}/heatmap", f"{PREFIX}_heads/{lm.GPT_LAYERS[1]}/over_training"} <= set(events.Tags()["images"])
    assert load_summary(str(tmp_path / "saved" / "epoch1.pt")).layers == lm.GPT_LAYERS


def test_names_the_loop_logs_itself_stay_out_of_the_sinks_and_a_stop_is_asked(tmp_path: Path) -> None:
    """``logged_elsewhere`` names reach the outcome, not the sinks; a stopping alert sets ``stop``, once recorded."""
    model = lm.TinyGPT(lr=0.0).eval()
    val = lm.make_batches(2, seed=22)
    scalars = Scalars()
    core = MonitorCore(log=LogOptions(histogram_bins=None, heatmap=False), alerts=[CollapseAlert(1.0, stop=True)])
    core.attach(model, [scalars])
    assert core.validation_start(epoch=0)
    with torch.no_grad():
        for index, batch in enumerate(val):
            with core.recording(index, batch):
                model(**batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the collapse warning
        outcome = core.validation_end(3, logged_elsewhere=lambda name: name.endswith("/mean"))
    assert outcome.stop
    assert f"{PREFIX}/mean" in outcome.scalars and f"{PREFIX}/mean" not in scalars.at(3)
    assert set(scalars.at(3)) == {name for name in outcome.scalars if not name.endswith("/mean")}
    # A validation the schedule leaves out records nothing and writes nothing.
    core.schedule = type(core.schedule)(Batches(every_n_epochs=2))
    assert _validate(core, model, val, 2, 5)[1].scalars == {} and scalars.at(5) == {}
    core.release()


def test_attach_refuses_what_is_no_sink() -> None:
    with pytest.raises(TypeError, match="Expected each sink"):
        MonitorCore().attach(lm.TinyGPT(), ["runs/"])


def test_datasets_validated_one_at_a_time_get_their_own_names_and_alert_baselines() -> None:
    """``validation_end(dataset=(i, suffix))``: names end in the dataset's suffix, each dataset its own baseline.

    The precondition is asserted: dataset ``b`` has a head whose median lies more than 1% below ``a``'s, so a
    baseline shared by both datasets (checked by passing ``key=index`` in place of the dataset's, then restored)
    flags a collapse that is none.
    """
    model = models.hf_model("gpt2", "sdpa").eval()  # spread attention: the datasets' medians differ
    alert = CollapseAlert(drop=0.01)
    core = MonitorCore(log=LogOptions(histogram_bins=None, heatmap=False), alerts=[alert])
    core.attach(model, [])
    for index, (name, seed) in enumerate((("a", 23), ("b", 24))):
        core.validation_start(epoch=0)
        with torch.no_grad():
            for batch_index, batch in enumerate(lm.make_batches(2, seed=seed)):
                with core.recording(batch_index, batch):
                    model(**batch)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a collapse warning fails the test
            outcome = core.validation_end(3, dataset=(index, f"/{name}"))
        assert outcome.scalars and all(key.endswith(f"/{name}") for key in outcome.scalars)
        assert not any("collapsed" in key and value for key, value in outcome.scalars.items())
    core.release()
    assert set(alert.baselines) == {0, 1}
    assert bool((alert.baselines[1] < 0.99 * alert.baselines[0]).any())
