"""The parts the Lightning callback is composed of, each on its own, without a Trainer.

Expected values are computed here from the documented rules (the random draw
from ``random.Random(seed + dataloader_idx)``, entropy from the float64
reference in tests/reference.py), never read back from the part under test.
"""

from __future__ import annotations

import math
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from attn_monitor.capture.calls import AttentionCall
from attn_monitor.capture.consumers import EntropyUpdate
from attn_monitor.capture.hooks import AttentionCapture
from attn_monitor.metrics.entropy import AttentionEntropy
from attn_monitor.metrics.mass import MassSummary
from attn_monitor.monitor.recording import Recorder, Statistics
from attn_monitor.monitor.schedule import Batches, BatchSchedule
from attn_monitor.report.alerts import CollapseAlert, LeakageAlert
from attn_monitor.shared.checks import WarnOnce
from tests.helpers import reference

# --------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("dataloader_idx", [0, 3])
def test_random_draw_is_the_documented_seeded_sample(dataloader_idx: int) -> None:
    for seed in range(20):
        schedule = BatchSchedule(Batches(3, random_sample=True, seed=seed))
        want = tuple(sorted(random.Random(seed + dataloader_idx).sample(range(40), 3)))
        assert schedule.sampled_indices(40, dataloader_idx) == want
        assert schedule.sampled_indices(7, dataloader_idx) == want  # drawn once, reused


def test_schedule_state_round_trip_keeps_the_draw() -> None:
    schedule = BatchSchedule(Batches(2, random_sample=True, seed=5))
    drawn = schedule.sampled_indices(30, 1)
    other = BatchSchedule(Batches(2, random_sample=True, seed=6))
    other.load_state_dict(schedule.state_dict())
    assert other.sampled_indices(30, 1) == drawn


def test_schedule_batches_epochs_and_steps() -> None:
    assert BatchSchedule(Batches([5, 1, 5])).sampled_indices(10) == (1, 5)
    assert BatchSchedule(Batches(3)).sampled_indices(10) == (0, 1, 2)
    schedule = BatchSchedule(Batches(every_n_epochs=3, skip_sanity_check=False, train_every_n_steps=2))
    # As Lightning's check_val_every_n_epoch and ModelCheckpoint(every_n_epochs) count: (epoch + 1) % n == 0.
    assert [schedule.validation_run(False, epoch) for epoch in range(6)] == [False, False, True, False, False, True]
    assert schedule.validation_run(False, 0, fitting=False)  # Trainer.validate: always
    assert schedule.validation_run(True, 1)
    assert not BatchSchedule().validation_run(True, 0)
    # Gradient accumulation: global_step repeats; one recording per optimizer step.
    assert [schedule.training_step(step) for step in (0, 0, 1, 1, 2, 2, 3, 4)] == [
        True,
        False,
        False,
        False,
        True,
        False,
        False,
        True,
    ]
    assert not any(BatchSchedule().training_step(step) for step in range(5))
    schedule.reset()  # a new run: its step 0 is recorded, although the last run's was too
    assert schedule.training_step(0)
    with pytest.raises(ValueError, match="known length"):
        BatchSchedule(Batches(random_sample=True)).sampled_indices(float("inf"))


# --------------------------------------------------------------------------- layer names


def test_named_layers_drop_exactly_the_wrapper_segments() -> None:
    """Nested wrappers (DataParallel around torch's checkpoint_wrapper) lose their segments; a user's own
    ``module`` attribute keeps its name, and a name that would repeat keeps its full path."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from attn_monitor.shared.names import named_layers

    class Own(nn.Module):  # not a wrapper: its child named `module` is part of the user's names
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    inner = nn.ModuleDict({"attn": checkpoint_wrapper(nn.Linear(2, 2)), "own": Own()})
    wrapped = nn.DataParallel(inner)
    assert "module.attn._checkpoint_wrapped_module" in dict(wrapped.named_modules())
    names = {id(module): name for name, module in named_layers(wrapped)}
    assert names[id(inner["attn"]._checkpoint_wrapped_module)] == "attn"
    assert names[id(inner["own"].module)] == "own.module"
    assert names[id(inner)] == ""

    class PeftModel(nn.Module):  # a wrapper (by class name) with a child of its own besides what it holds
        def __init__(self) -> None:
            super().__init__()
            self.base_model = nn.ModuleDict({"x": nn.Linear(2, 2), "y": nn.Linear(2, 2)})
            self.x = nn.Linear(2, 2)

    clash = PeftModel()
    names = {id(module): name for name, module in named_layers(clash)}
    assert names[id(clash.base_model["x"])] == "base_model.x" and names[id(clash.x)] == "x"  # both full
    assert names[id(clash.base_model["y"])] == "y"


# --------------------------------------------------------------------------- alerts


def _summary(heads: list[float], layer: str = "blocks.0.attn") -> Any:
    metric = AttentionEntropy(num_bins=100)
    values = torch.tensor(heads, dtype=torch.float64)[None, :, None].expand(1, len(heads), 4)
    metric.update(layer, values * math.log(8.0), torch.tensor(8))
    return metric.compute()


def test_collapse_alert_warns_once_per_head_and_key() -> None:
    messages: list[str] = []
    alert = CollapseAlert(threshold=0.3, drop=0.5, warn=lambda message, stacklevel=1: messages.append(message))
    assert alert(_summary([0.8, 0.8, 0.8])) == {"attn_entropy/blocks.0.attn/collapsed_heads": 0.0}
    assert not alert.flagged and messages == []
    # head 1 drops by more than half of its first value; head 2 falls below the threshold
    flags = alert(_summary([0.8, 0.35, 0.25]))
    assert flags == {"attn_entropy/blocks.0.attn/collapsed_heads": 2.0} and alert.flagged
    assert len(messages) == 1 and "heads [1, 2]" in messages[0] and "'blocks.0.attn'" in messages[0]
    alert(_summary([0.1, 0.35, 0.25]))  # heads 1 and 2 again: not repeated; head 0 is new
    assert len(messages) == 2 and "heads [0]" in messages[1]
    # another key (dataloader) has its own baseline and its own warnings
    assert alert(_summary([0.35, 0.35, 0.35]), key=1)["attn_entropy/blocks.0.attn/collapsed_heads"] == 0.0
    assert float(alert.baselines[1][0, 0]) == pytest.approx(0.35, abs=0.01)
    assert CollapseAlert()(_summary([0.0])) == {}
    with pytest.raises(ValueError, match="`drop` of CollapseAlert"):
        CollapseAlert(drop=1.5)


def test_leakage_alert_names_leaky_layers_and_warns_once() -> None:
    messages: list[str] = []
    alert = LeakageAlert(warn=lambda message, stacklevel=1: messages.append(message))
    stats = {"count": torch.ones(2, 1, dtype=torch.float64), "sum": torch.tensor([[0.2], [0.0]], dtype=torch.float64)}
    masses = MassSummary(["leakage/a", "leakage/b"], [1, 1], {**stats, "sum_sq": stats["sum"] ** 2})
    assert alert(masses) == ["a"] and alert(masses) == ["a"]
    assert len(messages) == 1 and "['a']" in messages[0]


def test_warn_once_by_key() -> None:
    seen: list[str] = []
    once = WarnOnce(lambda message, stacklevel=1: seen.append(message))
    assert [once("k", "one"), once("k", "two"), once("j", "three")] == [True, False, True]
    assert once.unseen(["k", "x", "x", "y"]) == ["x", "y"] and once.unseen(["y"]) == []
    assert seen == ["one", "three"]


# --------------------------------------------------------------------------- capture consumers


class TwoHeads(nn.Module):
    """One SDPA attention, causal, 2 heads; ``poison`` puts NaN into chosen query rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attention = nn.Linear(8, 16)  # class name has no "attention": the call is unowned
        self.poison: tuple[int, int] | None = None

    def qk(self, x: Tensor) -> tuple[Tensor, Tensor]:
        q, k = self.attention(x).view(x.shape[0], x.shape[1], 2, 2, 4).permute(2, 0, 3, 1, 4)
        return q * 3.0, k

    def forward(self, x: Tensor) -> Tensor:
        q, k = self.qk(x)
        if self.poison is not None:
            q = q.clone()
            q[self.poison[0], :, self.poison[1]] = math.nan
        return torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)


def _reference_entropy(model: TwoHeads, x: Tensor) -> Tensor:
    q, k = (t.double() for t in model.qk(x))
    support = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()[None, None]
    return reference.entropy_from_qk(q, k, support)


def test_consumers_are_chosen_per_recording() -> None:
    model, x = TwoHeads(), torch.randn(2, 6, 8)
    first, second = AttentionEntropy(), AttentionEntropy()
    seen: list[str] = []
    with AttentionCapture(model) as capture, torch.no_grad():
        with capture.recording(consumers=[EntropyUpdate(first), lambda call, sample: seen.append(call.layer)]):
            model(x)
        with capture.recording(consumers=[EntropyUpdate(second)]):
            model(x)
            model(x)
        with capture.recording():  # the capture's own consumers: its metric
            model(x)
        with pytest.raises(TypeError, match="callable"), capture.recording(consumers=["metric"]):  # type: ignore[list-item]
            pass
    assert seen == ["sdpa_call_0"]
    counts = [int(m.compute().count.sum()) for m in (first, second, capture.metric)]
    assert counts == [2 * 2 * 5, 2 * 2 * 2 * 5, 2 * 2 * 5]  # (batch, heads, queries with 2+ keys) per forward
    want = _reference_entropy(model, x)[:, :, 1:]
    want = (want / torch.arange(2, 7, dtype=torch.float64).log()).mean()
    assert float(first.compute().mean.mean()) == pytest.approx(float(want), abs=1e-5)


def test_entropy_update_skips_counts_and_reports_nonfinite_queries_once() -> None:
    model, x = TwoHeads(), torch.randn(2, 6, 8)
    model.poison = (1, 3)  # sequence 1, query 3: NaN in both heads
    metric = AttentionEntropy(num_bins=1000)
    update = EntropyUpdate(metric)
    with AttentionCapture(model) as capture, torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with capture.recording(consumers=[update]):
                model(x)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "'sdpa_call_0': 2 queries met NaN" in messages[0]
    entropy = _reference_entropy(model, x)
    normalised = entropy / torch.arange(1, 7, dtype=torch.float64).log().clamp(min=1e-300)
    kept = torch.ones(2, 2, 6, dtype=torch.bool)
    kept[:, :, 0] = False  # one visible key: not counted
    kept[1, :, 3] = False
    summary = metric.compute()
    assert summary.nonfinite.tolist() == [[2.0, 2.0]]  # per head: sequence 1's query 3, 2 forward passes
    assert int(summary.count.sum()) == 2 * int(kept.sum())
    assert float(summary.layer_mean[0]) == pytest.approx(float(normalised[kept].mean()), abs=1e-5)


def test_entropy_update_on_nonfinite_probabilities() -> None:
    probs = torch.full((1, 2, 3, 4), 0.25)
    probs[0, 1, 2, 0] = math.inf
    call = AttentionCall(layer="eager", support=_full_support(3, 4), probs=probs)
    metric = AttentionEntropy()
    update = EntropyUpdate(metric)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        update(call, torch.ones(1, 1, 3, dtype=torch.bool))
    assert len(caught) == 1
    summary = metric.compute()
    assert summary.nonfinite.tolist() == [[0.0, 1.0]]
    assert summary.count.tolist() == [[3.0, 2.0]]
    assert summary.mean[0].tolist() == pytest.approx([1.0, 1.0])


def _failing(call: AttentionCall, sample: Tensor) -> None:
    raise RuntimeError("measuring failed")


def test_capture_errors_raise_by_default_and_are_contained_on_request() -> None:
    model, x = TwoHeads(), torch.randn(2, 6, 8)
    want = model(x)
    capture = AttentionCapture(model)
    raises = pytest.raises(RuntimeError, match="measuring failed")
    with capture, torch.no_grad(), raises, capture.recording(consumers=[_failing]):
        model(x)
    metric = AttentionEntropy()
    capture = AttentionCapture(model, errors="warn")
    with capture, torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with capture.recording(consumers=[_failing]):
                assert torch.equal(model(x), want)  # the model's own work is untouched
        with capture.recording(consumers=[EntropyUpdate(metric)]):
            model(x)
    assert capture.skipped == {"sdpa_call_0": 3}
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "'sdpa_call_0' (RuntimeError: measuring failed)" in messages[0]
    assert int(metric.compute().count.sum()) == 2 * 2 * 5  # later calls are recorded as usual
    with pytest.raises(ValueError, match="`errors`"):
        AttentionCapture(model, errors="ignore")


def test_recorder_contains_errors_of_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a training run the monitor never raises out of the model's forward."""
    import attn_monitor.capture.hooks as capture_module

    monkeypatch.setattr(capture_module, "_sdpa_call", lambda layer, bound: _failing(None, None))  # type: ignore[arg-type]
    model, x = TwoHeads(), torch.randn(2, 6, 8)
    recorder = Recorder()
    recorder.attach(model)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught, recorder.recording("validation", x):
        warnings.simplefilter("always")
        model(x)
    assert recorder.capture is not None and recorder.capture.skipped == {"sdpa": 1}
    assert any("could not record" in str(w.message) for w in caught)
    recorder.release()


def _full_support(num_q: int, num_k: int) -> Any:
    from attn_monitor.functional.masks import Support

    return Support(num_q, num_k)


# --------------------------------------------------------------------------- recorder


def test_recorder_streams_are_separate_and_diagnostics_only_where_asked() -> None:
    model, x = TwoHeads(), torch.randn(2, 6, 8)
    recorder = Recorder(Statistics(sink_tokens=1))
    recorder.attach(model)
    with torch.no_grad():
        with recorder.recording(0, x):
            model(x)
        with recorder.recording("train", x, diagnostics=False):
            model(x)
            model(x)
    assert recorder.stream("train").diagnostics is None
    validation, masses = recorder.collect(0)
    training, no_masses = recorder.collect("train")
    assert validation is not None and training is not None and masses is not None and no_masses is None
    assert int(validation.count.sum()) * 2 == int(training.count.sum())
    assert masses.layers == ["sink_mass/sdpa_call_0"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchmetrics: compute before update, on purpose
        again, _ = recorder.collect(0)
    assert again is not None and int(again.count.sum()) == 0  # reset after collecting; the layers stay known
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    recorder.release()
    recorder.release()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) <= hooks
    with pytest.raises(RuntimeError, match="Attach"), recorder.recording(0, x):
        pass


def test_recorder_checks_patterns_at_attach_and_arguments_at_construction() -> None:
    with pytest.raises(ValueError, match=r"decoder\.\*"):
        Recorder(layers=["attention", "decoder.*"]).attach(TwoHeads())
    with pytest.raises(TypeError, match="padding_mask"):
        Recorder(padding_mask="attention_mask")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eviction"):
        Statistics(eviction=[(1,)])  # type: ignore[list-item]


def test_collect_with_nothing_recorded_is_none_and_quiet() -> None:
    """A stream nothing was recorded into computes (a collective under DDP) and gives None, without warnings."""
    recorder = Recorder(Statistics(sink_tokens=1))
    recorder.attach(TwoHeads())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert recorder.collect(0) == (None, None)


# --------------------------------------------------------------------------- dashboards history


def test_dashboards_history_round_trips_through_a_weights_only_checkpoint(tmp_path: Any) -> None:
    """The heads-over-training history survives torch.save / torch.load(weights_only=True), NaN heads included."""
    from attn_monitor.report.dashboards import Dashboards
    from attn_monitor.report.loggers import LogOptions

    dashboards = Dashboards(LogOptions())
    for step, heads in ((3, [0.2, 0.9]), (7, [0.1, 0.8])):
        dashboards.remember(_summary(heads, layer="h.0"), step, prefix="attn_entropy")
        dashboards.remember(_summary(heads[:1], layer="h.1"), step, prefix="attn_entropy", suffix="/dataloader_idx_1")
    torch.save(dashboards.state_dict(), tmp_path / "state.pt")
    restored = Dashboards(LogOptions())
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    for layer, suffix in (("h.0", ""), ("h.1", "/dataloader_idx_1")):
        steps, medians = restored.medians_over_time(layer, prefix="attn_entropy", suffix=suffix)
        want_steps, want = dashboards.medians_over_time(layer, prefix="attn_entropy", suffix=suffix)
        assert steps == want_steps == [3, 7]
        assert np.array_equal(medians, want, equal_nan=True)
    assert abs(float(restored.medians_over_time("h.0", prefix="attn_entropy")[1][0, 1]) - 0.1) <= 0.01
    restored.reset()
    steps, medians = restored.medians_over_time("h.0", prefix="attn_entropy")
    assert steps == [] and medians.size == 0
