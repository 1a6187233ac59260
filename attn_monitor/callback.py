"""AttentionEntropyMonitor: one Lightning callback from attention to dashboards.

    trainer = L.Trainer(callbacks=[AttentionEntropyMonitor()], logger=...)

The callback only wires Lightning's hooks to small parts, each tested on its
own, and the data flows one way through them:

* :class:`~attn_monitor.schedule.BatchSchedule`: which validation runs and
  batches, and which training steps, are recorded;
* :class:`~attn_monitor.recording.Recorder`: what is recorded: one capture on
  the model, one stream of metrics per validation dataloader and one for
  training steps, each stream's consumers chosen when its recording starts;
* :class:`~attn_monitor.alerts.CollapseAlert` and
  :class:`~attn_monitor.alerts.LeakageAlert`: what a summary warns about;
* :class:`~attn_monitor.loggers.LogOptions`: what is logged, and how, to each
  logger, :class:`~attn_monitor.loggers.Dashboards`: the histograms, charts
  and pictures; :class:`~attn_monitor.comparison.SummaryArchive`: what is saved.

At the end of a monitored validation run every rank computes each stream's
summary (a collective) and logs its means with ``LightningModule.log`` (they
reach every logger at the step of the module's own validation metrics), and
puts every per-layer statistic into ``trainer.callback_metrics``
(``EarlyStopping`` and ``ModelCheckpoint`` can monitor them); rank zero
writes the other scalars and the rest at that step, and the streams are
reset. When training ends, each layer's heads-over-training picture is
written once; its history is part of the checkpoint state. Each run (fit,
validate) starts from zero at setup.
Outside recorded batches the capture's hooks pass straight through.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from attn_monitor.alerts import CollapseAlert, LeakageAlert, MaxLogitAlert, OverloadAlert
from attn_monitor.calls import Adapter
from attn_monitor.capture import AttentionCapture, nothing_captured_message
from attn_monitor.comparison import SummaryArchive
from attn_monitor.head_stats import StatisticsSummary
from attn_monitor.loggers import (
    Dashboards,
    LogOptions,
    logged_through_lightning,
    per_layer,
    send_alert,
    warn_scalars_only,
)
from attn_monitor.metric import EntropySummary
from attn_monitor.recording import BatchMask, Recorder
from attn_monitor.schedule import BatchSchedule
from attn_monitor.shared import WarnOnce

__all__ = ["AttentionEntropyMonitor"]

#: The stream of recorded training steps (validation streams are keyed by dataloader index).
TRAIN = "train"


class AttentionEntropyMonitor(Callback):
    """Log per-layer, per-head attention entropy on sampled validation batches.

    Args:
        batches: which validation batches of each dataloader to monitor: an int
            ``n`` (the first ``n``, or ``n`` drawn at random with
            ``random_sample``) or explicit batch indices.
        random_sample: draw ``batches`` indices at random over the epoch, with
            ``seed``; the draw is made once and reused every epoch.
        seed: seed of the random draw.
        every_n_epochs: monitor the validation runs of every n-th epoch (each
            of them): epochs e with ``(e + 1) % n == 0``, as Lightning's
            ``check_val_every_n_epoch`` counts; ``Trainer.validate`` always.
            A fit whose validations were never monitored warns once at its end.
        skip_sanity_check: leave out the sanity-check validation run.
        train_every_n_steps: also record one training step every n steps and
            log it under ``{prefix}_train`` (None: off). The record covers the
            step's forward pass, up to its first backward (gradient
            checkpointing reruns forwards there).
        padding_mask: ``padding_mask(batch) -> (batch, seq)`` mask of real
            tokens; by default a dict batch's ``attention_mask``. Queries
            outside it are not samples.
        module: ``module(pl_module) -> nn.Module`` to watch; by default the
            LightningModule itself (layer names are relative to it).
        layers: layer name patterns (globs) to monitor; each must match a
            module at setup.
        adapters: module name pattern -> adapter, see :class:`AttentionCapture`.
        per_head: log per-head mean and median (under ``{prefix}_heads/``).
        quantiles: quantile levels logged per layer, each in [0, 1].
        histogram_bins: bins of the logged histograms (None: no histograms);
            at most 512 when a W&B logger is attached.
        heatmap: log the layer x head median heatmap and, per layer, the
            heads-over-training picture (TensorBoard and W&B).
        prefix: first component of every logged name; two monitors in one
            Trainer need different prefixes (it also keys the checkpoint state).
        include_single_key: count one-key queries (see :class:`AttentionEntropy`).
        sink_tokens: log the attention-sink mass on the first ``sink_tokens``
            real tokens of each sequence (document) as ``attn_sink_mass/...``.
        eviction: (sink_tokens, window) KV-cache policies whose kept mass is
            logged as ``attn_coverage_s{s}_w{w}/...``.
        leakage: log cross-document leakage (``attn_leakage/...``) and warn
            once, naming the layers, when a packed batch's documents are not
            isolated by the model's mask. Needs ``document_ids``.
        document_ids: ``document_ids(batch) -> (batch, seq)`` document of
            each token; by default a dict batch's ``document_ids``.
        max_logit: log each layer's largest attention logit over heads and
            sampled queries as ``attn_max_logit/{layer}/max`` and, with
            ``per_head``, ``attn_max_logit_heads/{layer}/head_{h}/max``
            (validation runs; not for layers that return probabilities, which
            are named in one warning).
        distance: log the mean attention distance ``E|i - j|`` in positions
            as ``attn_distance/{layer}/mean`` (heads pooled) and, with
            ``per_head``, ``attn_distance_heads/{layer}/head_{h}/mean``
            (validation runs, self-attention layers).
        max_logit_threshold: warn once per head whose max logit exceeds this
            (QK-clip style, e.g. 100) and log
            ``attn_max_logit/{layer}/over_threshold_heads``; needs
            ``max_logit=True``. Warns only.
        overload_threshold: warn once per head whose median normalised
            entropy is above this (near-uniform attention; 0.97 is a
            reasonable start) and log ``{prefix}/{layer}/overloaded_heads``.
            Warns only.
        collapse_threshold: flag heads whose median normalised entropy falls
            below this value.
        collapse_drop: flag heads whose median fell by more than this
            fraction of its value at the first monitored epoch.
        stop_on_collapse: ask the trainer to stop when a head is flagged as
            collapsed (default: warn and log only); overloaded heads and max
            logits over their threshold never stop training.
        save_summaries: save each epoch's summary (see
            :func:`~attn_monitor.comparison.save_summary`) under
            ``{trainer.log_dir}/attn_entropy/epoch{n}.pt``.

    With several validation dataloaders each is summarised apart and every
    logged name ends in ``/dataloader_idx_{i}``, as Lightning's ``self.log``
    does; with one, names carry no suffix.

    Raises:
        TypeError, ValueError: bad configuration, at construction; patterns
            that match nothing and too many bins for W&B, at setup.

    Example:
        >>> monitor = AttentionEntropyMonitor(batches=4, every_n_epochs=2)
        >>> monitor.quantiles
        (0.05, 0.25, 0.5, 0.75, 0.95)
        >>> monitor.state_key
        "AttentionEntropyMonitor{'prefix': 'attn_entropy'}"
    """

    def __init__(
        self,
        *,
        batches: int | Sequence[int] = 2,
        random_sample: bool = False,
        seed: int = 0,
        every_n_epochs: int = 1,
        skip_sanity_check: bool = True,
        train_every_n_steps: int | None = None,
        padding_mask: BatchMask | None = None,
        module: Callable[[pl.LightningModule], nn.Module] | None = None,
        layers: Sequence[str] | None = None,
        adapters: Mapping[str, Adapter] | None = None,
        per_head: bool = True,
        quantiles: Sequence[float] = (0.05, 0.25, 0.5, 0.75, 0.95),
        histogram_bins: int | None = 100,
        heatmap: bool = True,
        prefix: str = "attn_entropy",
        include_single_key: bool = False,
        sink_tokens: int | None = None,
        eviction: Sequence[tuple[int, int]] = (),
        leakage: bool = False,
        document_ids: BatchMask | None = None,
        max_logit: bool = False,
        distance: bool = False,
        max_logit_threshold: float | None = None,
        overload_threshold: float | None = None,
        collapse_threshold: float | None = None,
        collapse_drop: float | None = None,
        stop_on_collapse: bool = False,
        save_summaries: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("max_logit", max_logit), ("distance", distance)):
            if not isinstance(value, bool):
                raise TypeError(f"Expected `{name}` to be a bool, got {type(value).__name__} {value!r}.")
        if max_logit_threshold is not None and not max_logit:
            raise ValueError(
                f"`max_logit_threshold={max_logit_threshold!r}` needs `max_logit=True`: the max logit is only "
                "measured when it is logged."
            )
        self.schedule = BatchSchedule(
            batches=batches,
            random_sample=random_sample,
            seed=seed,
            every_n_epochs=every_n_epochs,
            skip_sanity_check=skip_sanity_check,
            train_every_n_steps=train_every_n_steps,
        )
        self.options = LogOptions(
            prefix=prefix, quantiles=quantiles, per_head=per_head, histogram_bins=histogram_bins, heatmap=heatmap
        )
        self.recorder = Recorder(
            padding_mask=padding_mask,
            document_ids=document_ids,
            module=module,
            layers=layers,
            adapters=adapters,
            num_bins=self.options.metric_bins,
            include_single_key=include_single_key,
            sink_tokens=sink_tokens,
            eviction=eviction,
            leakage=leakage,
            max_logit=max_logit,
            distance=distance,
        )
        self.dashboards = Dashboards(self.options)
        self.collapse = CollapseAlert(threshold=collapse_threshold, drop=collapse_drop, prefix=prefix, warn=self._alert)
        self.overload = OverloadAlert(threshold=overload_threshold, prefix=prefix, warn=self._alert)
        self.max_logit_alert = MaxLogitAlert(threshold=max_logit_threshold, warn=self._alert)
        self.leakage = LeakageAlert(warn=self._alert)
        self.stop_on_collapse = bool(stop_on_collapse)
        self.save_summaries = bool(save_summaries)
        #: Summary of each validation dataloader at the last monitored validation run.
        self.last_summaries: dict[int, EntropySummary] = {}
        #: Max logit and distance of each validation dataloader at the last monitored run (when on).
        self.last_statistics: dict[int, StatisticsSummary] = {}
        self._warn_once = WarnOnce(rank_zero_warn)
        self._loggers: list[Any] = []  # the trainer's, from setup: alerts also go to W&B runs
        self._recording = ExitStack()
        #: While Lightning reduces the epoch's logged values: its sync_dist advice silenced for the monitor's means.
        self._quiet_sync_advice = ExitStack()
        self._monitoring = False
        self._training_step = False
        #: This run's validation runs outside the sanity check: (epochs seen, runs that logged a summary).
        self._validation_epochs: list[int] = []
        self._logged_validations = 0
        #: The state loaded since the last run started (by Lightning from a checkpoint, or by hand).
        self._loaded_state: dict[str, Any] | None = None

    # -- what other code reads ----------------------------------------------
    @property
    def quantiles(self) -> tuple[float, ...]:
        return tuple(self.options.quantiles)

    @property
    def capture(self) -> AttentionCapture | None:
        """The capture on the watched model, between setup and teardown."""
        return self.recorder.capture

    @property
    def last_summary(self) -> EntropySummary | None:
        """The first validation dataloader's summary at the last monitored validation run."""
        return self.last_summaries.get(min(self.last_summaries, default=0))

    @property
    @override
    def state_key(self) -> str:
        # One key per prefix, as ModelCheckpoint keys by its settings: two monitors in one Trainer.
        return f"{type(self).__qualname__}{{'prefix': {self.options.prefix!r}}}"

    def sampled_indices(self, num_batches: int | float, dataloader_idx: int = 0) -> tuple[int, ...]:
        """Batch indices monitored in a validation dataloader of ``num_batches`` batches."""
        return self.schedule.sampled_indices(num_batches, dataloader_idx)

    # -- set-up and clean-up -----------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.recorder.attached:
            return
        self.options.check(trainer.loggers)
        if stage in ("fit", "validate"):  # before Lightning restores a checkpoint's state into the monitor
            self._reset()
            if self._loaded_state is not None:  # a state loaded by hand before this run is where it starts
                self.load_state_dict(self._loaded_state)
        self._loggers = list(trainer.loggers) if trainer.is_global_zero else []
        self.recorder.attach(pl_module, pl_module.device)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loaded_state = None  # restored (or not) for this run; the next run starts from zero

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loaded_state = None

    def _reset(self) -> None:
        """Start a run from zero: a monitor reused after a failed or finished run carries none of its counts."""
        self.recorder.reset()
        self.schedule.reset()
        self.dashboards.reset()
        self.collapse.baselines = {}
        self.last_summaries = {}
        self.last_statistics = {}
        self._monitoring = self._training_step = False
        self._validation_epochs = []
        self._logged_validations = 0

    def _alert(self, message: str, stacklevel: int = 2) -> None:
        """Warn (rank zero) and send the same text to every attached W&B run as ``run.alert``."""
        rank_zero_warn(message, stacklevel=stacklevel + 1)
        title = message.removeprefix("attn_monitor: ").split(" in ", 1)[0].split(":", 1)[0]
        send_alert(self._loggers, f"attn_monitor: {title}", message)

    def _release(self) -> None:
        self._recording.close()
        self._quiet_sync_advice.close()
        self.recorder.release()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release()
        self.recorder.reset()  # the failed run's partial counts

    # -- validation --------------------------------------------------------
    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fitting = trainer.state.fn == "fit"
        if fitting and not trainer.sanity_checking:
            self._validation_epochs.append(trainer.current_epoch)
        self._monitoring = self.recorder.attached and self.schedule.validation_run(
            trainer.sanity_checking, trainer.current_epoch, fitting
        )

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not self._monitoring:
            return
        num_batches = trainer.num_val_batches[dataloader_idx] if trainer.num_val_batches else float("inf")
        if batch_idx in self.schedule.sampled_indices(num_batches, dataloader_idx):
            self._recording.enter_context(self.recorder.recording(dataloader_idx, batch))

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._recording.close()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._monitoring:
            return
        self._monitoring = False
        loaders = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        count = max(len(loaders), 1)
        # Until the validation ends: Lightning reduces the epoch's logged values after this hook.
        self._quiet_sync_advice.enter_context(warnings.catch_warnings())
        logged = False
        for index in range(count):  # the same on every rank: each compute is a collective
            summary, masses = self.recorder.collect(index)
            statistics = self.recorder.collect_statistics(index)
            if summary is None:
                continue
            self.last_summaries[index] = summary
            extra = masses.to_dict("attn") if masses is not None else {}
            # The sanity check is no monitored epoch: it sets no alert baseline and stops nothing.
            alerts = not trainer.sanity_checking
            if alerts:
                extra.update(self.collapse(summary, key=index))
                extra.update(self.overload(summary, key=index))
            if statistics is not None:
                self.last_statistics[index] = statistics
                extra.update(statistics.to_dict("attn", per_head=self.options.per_head))
                if alerts:
                    extra.update(self.max_logit_alert(statistics, key=index))
            if alerts and self.collapse.flagged and self.stop_on_collapse:
                trainer.should_stop = True
            if masses is not None:
                self.leakage(masses)
            suffix = f"/dataloader_idx_{index}" if count > 1 else ""
            if trainer.sanity_checking:  # Lightning writes no metric of the sanity check: write them at step 0
                if trainer.is_global_zero:
                    self.options.write(
                        trainer.loggers, summary, trainer.global_step, extra_scalars=extra, suffix=suffix
                    )
                continue
            logged = True
            scalars = self.options.scalars(summary, extra_scalars=extra, suffix=suffix)
            watched = {name: value for name, value in scalars.items() if logged_through_lightning(name, suffix)}
            # Every rank logs the same (already reduced) values, so every rank's callback_metrics hold them.
            self._silence_sync_advice(watched)
            pl_module.log_dict(watched, on_step=False, on_epoch=True, add_dataloader_idx=False, sync_dist=False)
            # The other per-layer statistics reach what EarlyStopping and ModelCheckpoint read without
            # Lightning's per-name `log` (0.5-0.8 ms a name, 224 more names at 32 layers).
            rest = {name: value for name, value in scalars.items() if name not in watched}
            trainer.callback_metrics.update(
                {name: torch.tensor(value) for name, value in rest.items() if per_layer(name)}
            )
            if not trainer.is_global_zero:
                continue
            warn_scalars_only(trainer.loggers, bool(self.options.histogram_bins) or self.options.heatmap)
            step = lightning_log_step(trainer)
            self.dashboards.write(trainer.loggers, summary, step, scalars=rest, scalar_names=scalars, suffix=suffix)
            if self.save_summaries:
                archive = SummaryArchive(os.path.join(trainer.log_dir or trainer.default_root_dir, "attn_entropy"))
                archive.save(summary, trainer.current_epoch, index if count > 1 else None)
        self._logged_validations += logged
        self._warn_if_blind()

    @staticmethod
    def _silence_sync_advice(names: Mapping[str, float]) -> None:
        """Silence Lightning's ``sync_dist=True`` advice for exactly these names (inside a ``catch_warnings``).

        Lightning gives it under DDP for every value logged without
        ``sync_dist``, when it reduces the epoch's values; the monitor's values
        are already reduced exactly (summed states), so the advice is wrong
        for them, and only for them.
        """
        if names:
            alternatives = "|".join(re.escape(name) for name in names)
            advice = re.escape("It is recommended to use `self.log(")
            end = re.escape(", ..., sync_dist=True)`")
            warnings.filterwarnings("ignore", message=f"{advice}'(?:{alternatives})'{end}")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._quiet_sync_advice.close()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        asked = self.schedule.count > 0  # batches=0: training steps only
        if not asked or not self._validation_epochs or self._logged_validations or self.recorder.saw_nothing:
            return
        epochs = sorted(set(self._validation_epochs))
        n = self.schedule.every_n_epochs
        if not any(self.schedule.validation_run(False, epoch) for epoch in epochs):
            reason = (
                f"`every_n_epochs={n}` monitors the validations of epochs e with (e + 1) % {n} == 0, as Lightning's "
                "check_val_every_n_epoch counts; pass every_n_epochs=1 or a multiple of check_val_every_n_epoch"
            )
        else:
            batches = self.schedule.indices if self.schedule.indices is not None else self.schedule.count
            reason = (
                f"no sampled batch (`batches={batches}`) was reached in a validation dataloader; pass `batches=` "
                "within the validation batches that run (limit_val_batches)"
            )
        self._warn_once(
            "never-monitored",
            f"attn_monitor: {len(self._validation_epochs)} validation runs (epochs {epochs}) ran and none was "
            f"monitored: {reason}.",
        )

    def _warn_if_blind(self) -> None:
        if self.recorder.saw_nothing and self.recorder.capture is not None:
            self._warn_once("blind", nothing_captured_message(self.recorder.capture.model))

    # -- training ----------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.recorder.attached and self.schedule.training_step(trainer.global_step):
            self._recording.enter_context(self.recorder.recording(TRAIN, batch, diagnostics=False))
            self._training_step = True

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # A training record covers the forward pass: gradient checkpointing reruns forwards inside backward().
        if self._training_step:
            self._recording.close()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._finish_training_record(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A module whose on_train_batch_start returns -1 ends the epoch without on_train_batch_end.
        self._finish_training_record(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.dashboards.write_history(trainer.loggers)

    def _finish_training_record(self, trainer: pl.Trainer) -> None:
        if not self._training_step:
            return
        self._training_step = False
        self._recording.close()
        summary, _ = self.recorder.collect(TRAIN)
        if summary is not None and trainer.is_global_zero:
            prefix = f"{self.options.prefix}_train"
            step = lightning_log_step(trainer)  # the step of this batch's own `self.log` values
            self.options.write(trainer.loggers, summary, step, prefix=prefix, dashboards=self.dashboards)
        self._warn_if_blind()

    # -- checkpointing -------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        baselines = {key: value.tolist() for key, value in self.collapse.baselines.items() if isinstance(key, int)}
        return {**self.schedule.state_dict(), **self.dashboards.state_dict(), "first_medians": baselines}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded_state = state_dict
        self.schedule.load_state_dict(state_dict)
        self.dashboards.load_state_dict(state_dict)
        first = state_dict.get("first_medians") or {}
        if isinstance(first, list):  # one validation dataloader, as saved before per-dataloader baselines
            first = {0: first}
        self.collapse.baselines = {int(k): torch.tensor(v, dtype=torch.float64) for k, v in first.items()}


def lightning_log_step(trainer: pl.Trainer) -> int:
    """The step at which Lightning writes values logged with ``self.log`` right now.

    Lightning logs a training batch's values, and a validation run's, at the
    count of training batches that stepped the optimizer *before* the current
    one: one less than ``trainer.global_step`` once the current batch has
    stepped (the validation after 40 steps is logged at step 39). Derived from
    public trainer state: the fit loop's batch index, ``accumulate_grad_batches``
    and the number of training batches; with manual optimisation, every batch
    counts. Outside ``fit`` (``trainer.validate``) it is ``trainer.global_step``.

    Call it from ``on_train_batch_end`` or from a validation hook during fit.
    """
    if trainer.state.fn != "fit" or trainer.sanity_checking:
        return trainer.global_step
    loop = trainer.fit_loop.epoch_loop
    if not trainer.lightning_module.automatic_optimization:
        return int(loop.total_batch_idx)
    batch = loop.batch_idx
    stepped = (batch + 1) % trainer.accumulate_grad_batches == 0 or batch + 1 >= trainer.num_training_batches
    return max(trainer.global_step - int(stepped), 0)
