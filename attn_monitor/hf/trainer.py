"""AttentionEntropyCallback: the monitor in a Hugging Face ``transformers.Trainer``, in one line.

    trainer = Trainer(model, args, ..., callbacks=[AttentionEntropyCallback()])

A thin adapter over :class:`~attn_monitor.monitor.core.MonitorCore`, as the Lightning
callback is. A ``TrainerCallback`` is never handed the Trainer, so the
callback finds what it needs in what it is handed:

* batches: from ``on_train_begin`` to ``on_train_end`` a forward pre-hook on
  the model (with its keyword arguments: the Trainer calls ``model(**inputs)``)
  and a forward hook around every forward pass. The first forward pass in
  eval mode starts an evaluation, ``on_evaluate`` ends it; its batches are
  counted from 0 by ``on_prediction_step`` (the end of each), and the first
  forward pass of a sampled batch is recorded (``generate`` inside
  ``evaluate`` runs more: they are left out, with one warning).
* sinks, on the world process zero only: TensorBoard, when ``report_to``
  holds it, gets a ``SummaryWriter`` of its own in the directory the
  Trainer's ``TensorBoardCallback`` writes to (``$TENSORBOARD_LOGGING_DIR``,
  else the newest ``{output_dir}/runs/*``: that callback opens it before any
  user callback's ``on_train_begin``); TensorBoard shows the event files of
  one directory as one run. W&B, when ``report_to`` holds it, gets the run
  ``WandbCallback`` opened, on its ``train/global_step`` axis.
* the step: ``state.global_step``, the step of the Trainer's ``eval_loss``;
  a training step's record (``Batches(train_every_n_steps=n)``: the first
  forward pass in train mode after ``on_step_begin``) is written at
  ``on_step_end``, the step of that step's ``loss``.

At ``on_evaluate`` every process summarises (a collective) and the world
process zero writes; every overall and per-layer statistic is also put into
the evaluation's ``metrics`` as ``eval_{name}`` (after the Trainer has logged
them, before it picks the best model: ``metric_for_best_model=
"attn_entropy/mean"`` works). An alert with ``stop=True`` sets
``control.should_training_stop``. A ``trainer.evaluate()`` outside ``train()`` is
not recorded (the hooks are not on the model); it warns once.
"""

from __future__ import annotations

import glob
import os
import warnings
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from attn_monitor.capture.calls import Adapter
from attn_monitor.monitor.core import MonitorCore
from attn_monitor.monitor.recording import BatchMask, Statistics
from attn_monitor.monitor.schedule import Batches
from attn_monitor.report.alerts import Alert
from attn_monitor.report.loggers import LogOptions, WandbSink, per_layer
from attn_monitor.shared.checks import WarnOnce

__all__ = ["AttentionEntropyCallback", "tensorboard_dir", "trainer_sinks"]

SEVERAL_FORWARDS = (
    "attn_monitor: an evaluation batch ran several forward passes (`generate`, `predict_with_generate`); "
    "AttentionEntropyCallback records the first of each sampled batch (the prompt) and leaves the others out."
)
OUTSIDE_TRAIN = (
    "attn_monitor: AttentionEntropyCallback records the evaluations inside `trainer.train()` only; this "
    "`trainer.evaluate()` outside it is not monitored (for one, use `evaluate_attention(trainer.model, batches)`)."
)


class AttentionEntropyCallback(TrainerCallback):
    """Log per-layer, per-head attention entropy on sampled evaluation batches of a ``transformers.Trainer``.

    Args:
        batches: which evaluation batches and evaluations to record: an int
            ``n`` (the first ``n``), batch indices, or a :class:`~attn_monitor.monitor.schedule.Batches`
            (``every_n_epochs`` counts evaluations; ``train_every_n_steps``: a training
            step's record, logged under ``{prefix}_train``).
        statistics: what is measured beside entropy (:class:`~attn_monitor.monitor.recording.Statistics`).
        log: what is logged (:class:`~attn_monitor.report.loggers.LogOptions`).
        alerts: :class:`~attn_monitor.report.alerts.CollapseAlert` (``stop=True`` stops training) and the
            other alerts, at most one of each.
        layers: layer name patterns (globs) to monitor; each must match a module at ``on_train_begin``.
        padding_mask: ``padding_mask(inputs) -> (batch, seq)`` real tokens; default: ``attention_mask``.
        document_ids: ``document_ids(inputs) -> (batch, seq)``; default: ``document_ids``.
        adapters: module name pattern -> adapter, see :class:`~attn_monitor.capture.hooks.AttentionCapture`.

    Raises:
        TypeError, ValueError: bad configuration, at construction; patterns that match nothing,
            at ``on_train_begin``.
    """

    def __init__(
        self,
        *,
        batches: Batches | int | Sequence[int] = 2,
        statistics: Statistics | None = None,
        log: LogOptions | None = None,
        alerts: Sequence[Alert] = (),
        layers: Sequence[str] | None = None,
        padding_mask: BatchMask | None = None,
        document_ids: BatchMask | None = None,
        adapters: Mapping[str, Adapter] | None = None,
    ) -> None:
        self._zero = True
        self.core = MonitorCore(
            batches=batches,
            statistics=statistics,
            log=log,
            alerts=alerts,
            layers=layers,
            padding_mask=padding_mask,
            document_ids=document_ids,
            adapters=adapters,
            warn=self._warn,
            say=self._say,
        )
        self._hooks = ExitStack()  # the forward hooks, from on_train_begin to on_train_end
        self._batch = ExitStack()  # the recording of the current forward pass
        self._writers: list[Any] = []  # the SummaryWriters this callback opened
        self._now = 0  # the Trainer's optimizer step, from on_step_end
        self._evaluation_steps: set[int] = set()  # one evaluation per step, however many datasets it evaluates
        self._datasets: dict[str, int] = {}  # name -> index of each named evaluation dataset, in the order seen
        self._batch_index: int | None = None  # the running evaluation's batch (None: no evaluation runs)
        self._batch_started = False  # whether that batch's first forward pass has run
        self._step: int | None = None  # the optimizer step whose first forward pass is still to come
        self._warn_once = WarnOnce(self._warn)

    def _warn(self, message: str, stacklevel: int = 2) -> None:
        if self._zero:
            warnings.warn(message, stacklevel=stacklevel + 1)

    def _say(self, line: str) -> None:
        if self._zero:
            print(line)

    # -- a run -------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model: nn.Module = kwargs["model"]
        # A TrainerCallback hears of no exception: a train() that raised left its hooks and part of a
        # recording behind. They go now, before this run's are added, so nothing is recorded twice.
        self._release()
        self._zero = state.is_world_process_zero
        sinks = trainer_sinks(args) if self._zero else []
        self._writers = [sink for sink in sinks if not isinstance(sink, WandbSink)]
        device = next(model.parameters()).device
        self.core.attach(model, sinks, device=device)
        self._now, self._batch_index = state.global_step, None
        self._evaluation_steps, self._datasets = set(), {}
        self._hooks.callback(model.register_forward_pre_hook(self._forward_start, with_kwargs=True).remove)
        self._hooks.callback(model.register_forward_hook(self._forward_end, always_call=True).remove)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.core.training_end()
        self._release()

    def _release(self) -> None:
        self._batch.close()
        self._hooks.close()
        self.core.release()
        for writer in self._writers:
            writer.close()
        self._writers = []

    # -- evaluation ----------------------------------------------------------
    def _forward_start(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if module.training:
            if self._step is not None:  # the first micro-batch of the step: recorded if the schedule asks
                self.core.training_step_start(self._step, kwargs)
                self._step = None
            return
        if self._batch_index is None:  # the first forward pass of an evaluation (of one dataset)
            self.core.validation_start(epoch=len(self._evaluation_steps | {self._now}) - 1)
            self._batch_index, self._batch_started = 0, False
        if self._batch_started:  # a further forward pass of the batch (generate's next tokens)
            self._warn_once("several-forwards", SEVERAL_FORWARDS)
            return
        self._batch_started = True
        self._batch.enter_context(self.core.recording(self._batch_index, kwargs))

    def _forward_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if module.training:
            self.core.training_forward_end()  # before backward: gradient checkpointing reruns forwards
        self._batch.close()

    # -- training ----------------------------------------------------------
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._step = state.global_step

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._now = state.global_step
        self.core.training_step_end(state.global_step)  # the step the Trainer logs this step's loss at

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._batch_index is not None:  # the batch is over: the next forward pass is the next batch's
            self._batch_index += 1
            self._batch_started = False

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if not self.core.recorder.attached:  # Trainer.evaluate() outside train(): no hooks on the model
            self._zero = state.is_world_process_zero
            self._warn_once("outside-train", OUTSIDE_TRAIN)
            return
        self._evaluation_steps.add(state.global_step)
        if self._batch_index is None:  # no forward pass in eval mode: nothing was evaluated
            return
        self._batch_index = None
        metrics = {} if metrics is None else metrics
        prefix = evaluation_prefix(metrics)
        dataset = None
        if prefix != "eval":  # one of several datasets (or a metric_key_prefix of the user's): names of its own
            name = prefix.removeprefix("eval_")
            dataset = (self._datasets.setdefault(name, len(self._datasets)), f"/{name}")
        outcome = self.core.validation_end(state.global_step, dataset=dataset)  # every process: a collective
        suffix = "" if dataset is None else dataset[1]
        metrics.update(
            {f"{prefix}_{name.removesuffix(suffix)}": v for name, v in outcome.scalars.items() if per_layer(name)}
        )
        if outcome.stop:
            control.should_training_stop = True

    # -- checkpointing -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The random draws, the history and the collapse baselines (see :meth:`MonitorCore.state_dict`)."""
        return self.core.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the next run starts from it."""
        self.core.load_state_dict(state_dict)


def evaluation_prefix(metrics: Mapping[str, float]) -> str:
    """The ``metric_key_prefix`` of an evaluation's ``metrics``: ``eval``, or ``eval_{name}`` for a named dataset.

    Read from ``{prefix}_runtime``, which ``Trainer.evaluate`` puts into every evaluation's metrics.

    Example:
        >>> evaluation_prefix({"eval_a_loss": 1.0, "eval_a_runtime": 0.1})
        'eval_a'
    """
    return next((key.removesuffix("_runtime") for key in metrics if key.endswith("_runtime")), "eval")


def trainer_sinks(args: TrainingArguments) -> list[Any]:
    """The sinks of the loggers in ``args.report_to``: TensorBoard's directory, the W&B run.

    Raises:
        RuntimeError: ``report_to`` holds TensorBoard and no event directory of this run exists yet.
    """
    sinks: list[Any] = []
    report_to = list(args.report_to or ())  # a list of integrations after TrainingArguments.__post_init__
    if "tensorboard" in report_to:
        from torch.utils.tensorboard import SummaryWriter

        sinks.append(SummaryWriter(log_dir=tensorboard_dir(args)))
    if "wandb" in report_to:
        import wandb

        run = wandb.run
        if run is not None:
            sinks.append(WandbSink(run, lambda values, step: run.log({**values, "train/global_step": step})))
    return sinks


def tensorboard_dir(args: TrainingArguments) -> str:
    """The directory the Trainer's ``TensorBoardCallback`` writes this run to.

    ``$TENSORBOARD_LOGGING_DIR`` when set, else the newest ``{output_dir}/runs/*``
    (that callback names it by the time of its ``on_train_begin``, which runs
    before any callback the user adds).

    Raises:
        RuntimeError: no such directory.
    """
    configured = os.getenv("TENSORBOARD_LOGGING_DIR")
    if configured is not None:
        return os.path.expanduser(configured)
    runs = glob.glob(os.path.join(str(args.output_dir), "runs", "*", ""))
    if not runs:
        raise RuntimeError(
            f"attn_monitor: `report_to` holds tensorboard but {args.output_dir}/runs/ holds no run directory; "
            "pass AttentionEntropyCallback in `callbacks=` of the Trainer (after its TensorBoardCallback)."
        )
    return max(runs, key=os.path.getmtime)
