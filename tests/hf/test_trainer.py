"""AttentionEntropyCallback in a real ``transformers.Trainer.train()``, read back from the Trainer's event directory.

A tiny GPT-2 (sdpa, the spread initialisation of tests/models.py) trains 4
steps at learning rate 0 (the weights stay as built), evaluating every 2
steps on 3 batches; the callback records the first 2 of each evaluation.
Every scalar, histogram and the heatmap is read back with TensorBoard's own
reader from the directory the Trainer's ``TensorBoardCallback`` writes, and
checked against the float64 eager reference of test_callback (an eager twin's
``output_attentions`` over the documented causal and padding masks).

Broken variants these tests caught (each tried, then restored): logging at
``state.global_step - 1`` (steps differ from ``eval/loss``); counting batch
indices across evaluations (the second evaluation records nothing and its
step is missing); recording every forward pass in eval mode without the
batch schedule (3 batches: the reference of 2 does not match); the W&B
values written at ``train/global_step`` one less than the step (leaving the
step out is not caught: ``WandbCallback``'s ``define_metric(step_sync=True)``
fills in the step it logged last, the evaluation's); a training record
written at the step before the Trainer's ``train/loss`` of that step; a
stopping alert that does not set ``control.should_training_stop``.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from attn_monitor import Batches, LogOptions
from tests.helpers import lightning_models as lm
from tests.helpers import models
from tests.lightning.test_callback import (
    PREFIX,
    Samples,
    assert_spread,
    check_against_reference,
    check_histogram,
    expected_names,
    hf_reference,
    in_family,
    read_wandb_history,
    tb_scalars_at,
)
from tests.shared.test_names import per_head_names

transformers = pytest.importorskip("transformers")

LAYERS = ["transformer.h.0.attn", "transformer.h.1.attn"]
EVAL_BATCHES = lm.make_batches(3, seed=4)
STEPS = [2, 4]  # eval_steps=2, max_steps=4


def _examples(batches: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    """One example per row: ids, mask, and labels with the padding left out of the loss."""
    out = []
    for batch in batches:
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
            out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def _reference(model: torch.nn.Module) -> dict[str, Samples]:
    """The float64 eager reference over the first two evaluation batches, named as the Trainer's model names them."""
    samples = hf_reference(model.state_dict(), EVAL_BATCHES[:2])
    return {name.removeprefix("model."): value for name, value in samples.items()}


def _event_directory(output_dir: Path) -> str:
    runs = glob.glob(str(output_dir / "runs" / "*"))
    assert len(runs) == 1, runs
    return runs[0]


def _read(directory: str) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(directory, size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


class _Metrics(transformers.TrainerCallback):  # type: ignore[misc]
    """Keeps a copy of every evaluation's ``metrics`` as the callbacks after the monitor see them."""

    def __init__(self) -> None:
        self.seen: list[dict[str, float]] = []

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float], **kwargs: Any) -> None:
        self.seen.append(dict(metrics))


def _trainer(output_dir: Path, callbacks: list[Any], report_to: list[str], **arguments: Any) -> Any:
    """4 steps at learning rate 0 of the tiny GPT-2, an evaluation (3 batches) every 2 steps.

    ``arguments`` replace or add ``TrainingArguments``.
    """
    args = transformers.TrainingArguments(
        **{
            "output_dir": str(output_dir),
            "eval_strategy": "steps",
            "eval_steps": 2,
            "max_steps": 4,
            "learning_rate": 0.0,
            "per_device_train_batch_size": lm.BATCH,
            "per_device_eval_batch_size": lm.BATCH,
            "logging_steps": 1,
            "save_strategy": "no",
            "report_to": report_to,
            "use_cpu": True,
            "disable_tqdm": True,
            **arguments,
        }
    )
    return transformers.Trainer(
        model=models.hf_model("gpt2", "sdpa").train(),
        args=args,
        train_dataset=_examples(lm.make_batches(4, seed=3)),
        eval_dataset=_examples(EVAL_BATCHES),
        callbacks=callbacks,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from attn_monitor import AttentionEntropyCallback

    output_dir = tmp_path_factory.mktemp("hf_trainer")
    wandb = pytest.importorskip("wandb")
    callback = AttentionEntropyCallback(batches=Batches(2, train_every_n_steps=2), log=LogOptions(per_head=True))
    metrics = _Metrics()
    trainer = _trainer(output_dir, [callback, metrics], report_to=["tensorboard", "wandb"])
    model = trainer.model
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    training_inputs: list[dict[str, Tensor]] = []  # every training forward pass's inputs, in order

    def keep(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training:
            training_inputs.append({name: kwargs[name] for name in ("input_ids", "attention_mask")})

    handle = model.register_forward_pre_hook(keep, with_kwargs=True)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(output_dir), "WANDB_SILENT": "true"}.items():
            patch.setenv(name, value)
        patch.setenv("WANDB_CONSOLE", "off")
        try:
            trainer.train()
            run_dir = Path(wandb.run.dir).parent  # where this process's W&B settings put the run
        finally:
            wandb.finish()
    handle.remove()
    after = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    directory = _event_directory(output_dir)
    return {
        "trainer": trainer,
        "callback": callback,
        "events": _read(directory),
        "reference": _reference(model),
        "hooks": (hooks, after),
        "metrics": metrics.seen,
        "training_inputs": training_inputs,
        "wandb_files": glob.glob(str(run_dir / "run-*.wandb")),
    }


def test_reference_is_spread(run: dict[str, Any]) -> None:
    assert_spread(run["reference"])


def test_scalars_at_the_steps_of_eval_loss(run: dict[str, Any]) -> None:
    events = run["events"]
    assert [e.step for e in events.Scalars("eval/loss")] == STEPS
    tags = {tag for tag in events.Tags()["scalars"] if in_family(tag)}
    assert tags == expected_names(LAYERS, per_head=True)
    assert {tag for tag in tags if "/head_" in tag} == per_head_names(LAYERS, lm.HEADS)
    for tag in tags:
        assert [e.step for e in events.Scalars(tag)] == STEPS, tag


def test_values_equal_the_float64_reference(run: dict[str, Any]) -> None:
    for step in STEPS:
        check_against_reference(tb_scalars_at(run["events"], step), run["reference"])


def test_histograms_and_heatmap_in_the_trainers_event_directory(run: dict[str, Any]) -> None:
    events = run["events"]
    for layer in LAYERS:
        histograms = events.Histograms(f"{PREFIX}/{layer}/hist")
        assert [e.step for e in histograms] == STEPS
        for event in histograms:
            check_histogram(list(event.histogram_value.bucket), run["reference"][layer].normalized)
    images = events.Images(f"{PREFIX}/heatmap")
    assert [e.step for e in images] == STEPS
    assert all(e.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n" for e in images)


def test_evaluation_metrics_hold_the_per_layer_statistics_and_hooks_are_removed(run: dict[str, Any]) -> None:
    """``metric_for_best_model="attn_entropy/mean"`` reads ``metrics["eval_attn_entropy/mean"]``."""
    assert len(run["metrics"]) == len(STEPS)
    for step, metrics in zip(STEPS, run["metrics"], strict=True):
        scalars = tb_scalars_at(run["events"], step)
        per_layer = {name: value for name, value in scalars.items() if "_heads/" not in name}
        assert {name.removeprefix("eval_"): v for name, v in metrics.items() if PREFIX in name} == pytest.approx(
            per_layer, rel=1e-6
        )
    before, after = run["hooks"]
    assert before == after


def test_callback_import_is_lazy() -> None:
    import subprocess
    import sys

    code = "import sys, attn_monitor; attn_monitor.AttentionEntropyCallback; print('lightning' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


def test_wandb_gets_everything_in_the_trainers_run_on_its_step_axis(run: dict[str, Any]) -> None:
    """One W&B run (the one WandbCallback opened) holds ``eval/loss`` and every monitor value, at its steps."""
    assert len(run["wandb_files"]) == 1, run["wandb_files"]
    rows = read_wandb_history(run["wandb_files"][0])
    assert sorted(row["train/global_step"] for row in rows if "eval/loss" in row) == STEPS
    names = expected_names(LAYERS, per_head=True)
    entropy = [row for row in rows if f"{PREFIX}/mean" in row]
    assert [row["train/global_step"] for row in entropy] == STEPS
    for row in entropy:
        check_against_reference({name: row[name] for name in names}, run["reference"])
        for layer in LAYERS:
            check_histogram(row[f"{PREFIX}/{layer}/hist"]["values"], run["reference"][layer].normalized)
        assert row[f"{PREFIX}/heatmap"]["_type"] == "image-file"


def test_training_steps_are_recorded_where_asked(run: dict[str, Any]) -> None:
    """``train_every_n_steps=2``: steps 0 and 2 (the first micro-batch each), at the step their loss is logged."""
    events, inputs = run["events"], run["training_inputs"]
    assert len(inputs) == 4
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars(f"{PREFIX}_train/mean")] == [1, 3]
    state = run["trainer"].model.state_dict()
    for step, batch in ((1, inputs[0]), (3, inputs[2])):
        samples = {name.removeprefix("model."): s for name, s in hf_reference(state, [batch]).items()}
        check_against_reference(
            tb_scalars_at(events, step, prefix=f"{PREFIX}_train"), samples, prefix=f"{PREFIX}_train"
        )


def test_a_stopping_alert_stops_training_after_the_evaluation(tmp_path: Path) -> None:
    """``CollapseAlert(1.0, stop=True)`` flags every head at the first evaluation: training ends at step 2 of 4."""
    from attn_monitor import AttentionEntropyCallback, CollapseAlert

    callback = AttentionEntropyCallback(alerts=[CollapseAlert(1.0, stop=True)])
    trainer = _trainer(tmp_path, [callback], report_to=[])
    with pytest.warns(UserWarning, match="collapse"):
        trainer.train()
    assert trainer.state.global_step == 2


class _Counting(transformers.TrainerCallback):  # type: ignore[misc]
    """Counts the model's forward hooks at every evaluation."""

    def __init__(self, model: torch.nn.Module, counted: list[int]) -> None:
        self.model, self.counted = model, counted

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.counted.append(len(self.model._forward_hooks) + len(self.model._forward_pre_hooks))


class _Boom(transformers.TrainerCallback):  # type: ignore[misc]
    """Raises at the end of step 3, after the first evaluation was recorded."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 3:
            raise RuntimeError("boom")


def test_a_train_that_raised_leaves_nothing_recorded_twice(tmp_path: Path) -> None:
    """The hooks a failed ``train()`` left go at the next one: it holds exactly one pair, and its summary the reference.

    Without the release at ``on_train_begin`` the second run has two pairs of hooks on the model and
    counts every evaluation batch twice (checked by removing it, then restoring).
    """
    from attn_monitor import AttentionEntropyCallback

    callback = AttentionEntropyCallback()
    failing = _trainer(tmp_path / "first", [callback, _Boom()], report_to=[])
    model = failing.model
    base = len(model._forward_hooks) + len(model._forward_pre_hooks)
    with pytest.raises(RuntimeError, match="boom"):
        failing.train()
    again = _trainer(tmp_path / "second", [callback], report_to=[])
    again.model = model
    counted: list[int] = []
    again.add_callback(_Counting(model, counted))
    again.train()
    assert counted and set(counted) == {base + 2}, counted
    assert len(model._forward_hooks) + len(model._forward_pre_hooks) == base
    reference = _reference(model)
    summary = callback.core.last_summaries[0]
    for layer, samples in reference.items():
        index = summary.layer_index(layer)
        assert int(summary.count[index].sum()) == samples.normalized.numel(), layer
        mean = summary.to_dict()[f"attn_entropy/{layer}/mean"]
        assert mean == pytest.approx(float(samples.normalized.mean()), abs=1e-4), layer


SECOND_EVAL_BATCHES = lm.make_batches(3, seed=5)


def _named_datasets() -> dict[str, list[dict[str, Tensor]]]:
    """Two evaluation datasets; the Trainer evaluates them one after the other as ``eval_a_*`` and ``eval_b_*``."""
    return {"a": _examples(EVAL_BATCHES), "b": _examples(SECOND_EVAL_BATCHES)}


def _unsuffixed(scalars: dict[str, float], name: str) -> dict[str, float]:
    return {tag.removesuffix(f"/{name}"): value for tag, value in scalars.items() if tag.endswith(f"/{name}")}


def test_each_evaluation_dataset_is_logged_under_its_own_name(tmp_path: Path) -> None:
    """``eval_dataset={"a": ..., "b": ...}``: names end in ``/a`` and ``/b``, each against its own reference.

    The metrics of dataset ``a``'s evaluation hold ``eval_a_{name}`` (``metric_for_best_model="a_attn_entropy/mean"``).
    Caught (each tried, then restored): every dataset logged under the same names (two values per tag and step),
    the metrics named ``eval_{name}`` for every dataset.
    """
    from attn_monitor import AttentionEntropyCallback

    metrics = _Metrics()
    trainer = _trainer(tmp_path, [AttentionEntropyCallback(), metrics], report_to=["tensorboard"])
    trainer.eval_dataset = _named_datasets()
    trainer.train()
    events = _read(_event_directory(tmp_path))
    state = trainer.model.state_dict()
    for name, batches in (("a", EVAL_BATCHES), ("b", SECOND_EVAL_BATCHES)):
        reference = {layer.removeprefix("model."): s for layer, s in hf_reference(state, batches[:2]).items()}
        assert_spread(reference)
        assert [e.step for e in events.Scalars(f"eval/{name}_loss")] == STEPS
        assert [e.step for e in events.Scalars(f"{PREFIX}/mean/{name}")] == STEPS
        for step in STEPS:
            scalars = _unsuffixed(tb_scalars_at(events, step), name)
            assert set(scalars) == expected_names(LAYERS)
            check_against_reference(scalars, reference)
        assert [e.step for e in events.Histograms(f"{PREFIX}/{LAYERS[0]}/hist/{name}")] == STEPS
    assert f"{PREFIX}/mean" not in events.Tags()["scalars"]
    assert len(metrics.seen) == 2 * len(STEPS)
    for name, seen in zip("abab", metrics.seen, strict=True):
        assert f"eval_{name}_loss" in seen
        assert {key for key in seen if PREFIX in key} == {f"eval_{name}_{n}" for n in expected_names(LAYERS)}


def test_every_n_epochs_counts_evaluations_not_datasets(tmp_path: Path) -> None:
    """``every_n_epochs=2`` with two datasets: the evaluation at step 4 is recorded, for both, and step 2's for neither.

    Caught: counting every dataset's ``evaluate`` as an evaluation (only ``b`` is recorded, at both steps).
    """
    from attn_monitor import AttentionEntropyCallback

    metrics = _Metrics()
    callback = AttentionEntropyCallback(batches=Batches(2, every_n_epochs=2))
    trainer = _trainer(tmp_path, [callback, metrics], report_to=[])
    trainer.eval_dataset = _named_datasets()
    trainer.train()
    recorded = [any(PREFIX in key for key in seen) for seen in metrics.seen]
    assert recorded == [False, False, True, True]


def test_best_model_and_early_stopping_read_the_entropy_of_the_evaluation(tmp_path: Path) -> None:
    """``metric_for_best_model="attn_entropy/mean"``: the Trainer's best metric is the reference's mean entropy.

    At learning rate 0 both evaluations measure the same weights, so the first stays the best (``greater`` is
    strict) and ``EarlyStoppingCallback(patience=1)`` stops after the second. Caught: the statistics left out of
    the evaluation's ``metrics`` (the Trainer raises: the metric is not found).
    """
    from attn_monitor import AttentionEntropyCallback

    stopping = transformers.EarlyStoppingCallback(early_stopping_patience=1)
    trainer = _trainer(
        tmp_path,
        [AttentionEntropyCallback(), stopping],
        report_to=[],
        max_steps=6,
        save_strategy="steps",
        save_steps=2,
        metric_for_best_model="attn_entropy/mean",
        greater_is_better=True,
        load_best_model_at_end=True,
    )
    trainer.train()
    reference = _reference(trainer.model)
    assert_spread(reference)
    want = float(torch.cat([s.normalized for s in reference.values()]).mean())
    assert trainer.state.best_metric == pytest.approx(want, abs=1e-4)
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert trainer.state.global_step == 4  # stopped by the early-stopping callback, 2 steps before max_steps


def test_an_evaluation_outside_train_warns_once_that_it_is_not_monitored(tmp_path: Path) -> None:
    """``trainer.evaluate()`` before and after ``train()`` records nothing and says so, once; train() is monitored.

    Caught: the warning left out (nothing is logged and nothing is said).
    """
    import warnings

    from attn_monitor import AttentionEntropyCallback

    metrics = _Metrics()
    trainer = _trainer(tmp_path, [AttentionEntropyCallback(), metrics], report_to=[])
    with pytest.warns(UserWarning, match="outside it is not monitored"):
        trainer.evaluate()
    trainer.train()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="attn_monitor")  # said once only
        trainer.evaluate()
    assert [any(PREFIX in key for key in seen) for seen in metrics.seen] == [False, True, True, False]


def test_an_evaluation_batch_of_several_forward_passes_records_its_first(tmp_path: Path) -> None:
    """A ``prediction_step`` that runs the model again on a cut batch (as ``generate`` does): the first pass counts.

    The logged values equal the reference of the first two batches; one warning says the others were left out.
    Caught: counting forward passes as batches (batch 1 is then batch 0's second pass: the counts and values
    differ from the reference).
    """
    from attn_monitor import AttentionEntropyCallback

    metrics = _Metrics()
    trainer = _trainer(tmp_path, [AttentionEntropyCallback(), metrics], report_to=[])
    predict = trainer.prediction_step

    def twice(model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        out = predict(model, inputs, *args, **kwargs)
        with torch.no_grad():
            model(input_ids=inputs["input_ids"][:, :3])
        return out

    trainer.prediction_step = twice
    with pytest.warns(UserWarning, match="several forward passes"):
        trainer.train()
    reference = _reference(trainer.model)
    for seen in metrics.seen:
        scalars = {name.removeprefix("eval_"): value for name, value in seen.items() if PREFIX in name}
        check_against_reference(scalars, reference)
