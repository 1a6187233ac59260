"""MonitorCore: the monitor, whatever the training loop, driven through a few plain calls.

    core = MonitorCore(batches=Batches(4), alerts=[CollapseAlert(0.1, stop=True)])
    core.attach(model, sinks=[SummaryWriter(log_dir)])     # at the start of a run
    if core.validation_start(epoch=epoch):
        for index, batch in enumerate(loader):
            with core.recording(index, batch):
                model(**batch)
        outcome = core.validation_end(step)                 # every rank: a collective
    core.release()                                          # at the end of the run

The core composes the parts, each tested on its own, and the data flows one
way through them:

* :class:`~attn_monitor.monitor.schedule.BatchSchedule`: which validation runs and
  batches, and which training steps, are recorded (:class:`Batches`);
* :class:`~attn_monitor.monitor.recording.Recorder`: what is recorded: one capture on
  the model, one stream of metrics per validation dataloader and one for
  training steps (:class:`Statistics`);
* the alerts: what a summary warns about, and whether it stops training;
* :class:`~attn_monitor.report.dashboards.Dashboards`: what is logged (:class:`LogOptions`)
  to the sinks, the one route out; :class:`~attn_monitor.report.archive.SummaryArchive`
  sinks save each summary.

Nothing here knows a training framework: the loop's adapter maps its loggers
to sinks (given only to the process that logs), its hooks to these calls, and
reads back what the framework needs (the names it logs itself, whether to stop).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from attn_monitor.capture.calls import Adapter
from attn_monitor.capture.hooks import nothing_captured_message
from attn_monitor.metrics.bound import BOUND_FAMILY
from attn_monitor.metrics.entropy import EntropySummary
from attn_monitor.metrics.statistics import StatisticsSummary
from attn_monitor.monitor.recording import BatchMask, Recorder, Statistics
from attn_monitor.monitor.schedule import Batches, BatchSchedule
from attn_monitor.report.alerts import Alert, LeakageAlert
from attn_monitor.report.archive import SummaryArchive
from attn_monitor.report.dashboards import Dashboards
from attn_monitor.report.loggers import LogOptions, send_alert
from attn_monitor.shared.checks import WarnOnce

__all__ = ["MonitorCore", "ValidationOutcome", "never_monitored_message", "setup_line"]

#: The stream of recorded training steps (validation streams are keyed by dataloader index).
TRAIN = "train"


@dataclass(frozen=True)
class ValidationOutcome:
    """What a validation produced, for the training loop.

    Attributes:
        scalars: every scalar of the validation (all dataloaders, suffixed),
            those written to the sinks and those the loop logs itself.
        stop: an alert with ``stop=True`` flagged a head: the loop should stop.
    """

    scalars: dict[str, float]
    stop: bool = False


class MonitorCore:
    """Which batches, what to record, what to log, and alerts: the monitor without a training loop.

    Args:
        batches: which validation batches and runs, and which training steps
            (an int or indices: :class:`Batches` of that ``sample``).
        statistics: what is measured beside entropy.
        log: what is logged, and the prefix of every entropy name.
        alerts: :class:`~attn_monitor.report.alerts.CollapseAlert`,
            :class:`~attn_monitor.report.alerts.OverloadAlert`,
            :class:`~attn_monitor.report.alerts.MaxLogitAlert`, :class:`~attn_monitor.report.trend.TrendAlert`,
            at most one of each.
        layers: layer name patterns (globs) to watch; each must match a module at :meth:`attach`.
        module: ``module(root) -> nn.Module`` to watch (default: what :meth:`attach` gets).
        padding_mask: ``padding_mask(batch) -> (batch, seq)`` real tokens; default: a dict batch's ``attention_mask``.
        document_ids: ``document_ids(batch) -> (batch, seq)``; default: a dict batch's ``document_ids``.
        adapters: module name pattern -> adapter, see :class:`~attn_monitor.capture.hooks.AttentionCapture`.
        warn: ``warn(message, stacklevel=...)`` for every warning (the loop's rank-zero warning).
        say: ``say(line)`` for the one set-up line of each run (the loop's rank-zero print).

    Raises:
        TypeError, ValueError: a bad option, named.
    """

    def __init__(
        self,
        *,
        batches: Batches | int | Sequence[int] = 2,
        statistics: Statistics | None = None,
        log: LogOptions | None = None,
        alerts: Iterable[Alert] = (),
        layers: Sequence[str] | None = None,
        module: Callable[[Any], nn.Module] | None = None,
        padding_mask: BatchMask | None = None,
        document_ids: BatchMask | None = None,
        adapters: Mapping[str, Adapter] | None = None,
        warn: Callable[..., object] = warnings.warn,
        say: Callable[[str], object] = print,
    ) -> None:
        self.schedule = BatchSchedule(batches if isinstance(batches, Batches) else Batches(batches))
        self.options = LogOptions() if log is None else log
        if not isinstance(self.options, LogOptions):
            raise TypeError(f"Expected `log` to be a LogOptions, got {type(self.options).__name__}.")
        self.recorder = Recorder(
            statistics,
            padding_mask=padding_mask,
            document_ids=document_ids,
            module=module,
            layers=layers,
            adapters=adapters,
            num_bins=self.options.metric_bins,
        )
        self.alerts = _check_alerts(alerts, self.recorder.statistics)
        for alert in self.alerts:
            alert.bind(self._alert, prefix=self.options.prefix if alert.reads == "entropy" else None)
        self.leakage = LeakageAlert(warn=self._alert)
        self.dashboards = Dashboards(self.options)
        #: Where the logging process writes (none elsewhere), and where it saves each summary.
        self.sinks: list[Any] = []
        self.archives: list[SummaryArchive] = []
        #: Summary of each validation dataloader at the last monitored validation run.
        self.last_summaries: dict[int, EntropySummary] = {}
        #: Max logit and distance of each validation dataloader at the last monitored run (when on).
        self.last_statistics: dict[int, StatisticsSummary] = {}
        self._warn = warn
        self._say = say
        self._told = False  # the set-up line of this run was said
        self._warn_once = WarnOnce(warn)
        self._recording = ExitStack()
        self._validation: tuple[bool, int] | None = None  # (sanity check, epoch) of the recorded validation
        self._training_step = False
        #: This run's validations outside a sanity check (epochs seen) and those that logged a summary.
        self._validation_epochs: list[int] = []
        self._logged_validations = 0
        #: A state loaded while no run was attached: where the next run starts.
        self._loaded_state: dict[str, Any] | None = None

    # -- a run -------------------------------------------------------------
    def attach(self, model: nn.Module, sinks: Iterable[Any] = (), *, device: Any = "cpu", new_run: bool = True) -> None:
        """Put the capture on ``model`` and write to ``sinks`` (none on a process that does not log).

        Args:
            model: what :meth:`recording` watches (``module(model)`` when given).
            sinks: ``SummaryWriter``, :class:`~attn_monitor.report.loggers.WandbSink`, objects with
                ``log_metrics(metrics, step)``, :class:`~attn_monitor.report.archive.SummaryArchive`.
            device: where the metrics live.
            new_run: start from zero (a state loaded before the run is where it starts).

        Raises:
            TypeError, ValueError: a sink of no known kind, too many bins for W&B,
                a layer pattern that matches nothing.
        """
        if self.recorder.attached:
            return
        sinks = list(sinks)
        self.archives = [sink for sink in sinks if isinstance(sink, SummaryArchive)]
        self.sinks = [sink for sink in sinks if not isinstance(sink, SummaryArchive)]
        self.options.check(self.sinks)
        if new_run:
            self._reset()
            if self._loaded_state is not None:
                self.load_state_dict(self._loaded_state)
        self._loaded_state = None
        self.recorder.attach(model, device)

    def release(self, *, failed: bool = False) -> None:
        """End any recording and remove the capture's hooks; ``failed`` also drops the run's partial counts.

        Pictures still being drawn are written first (a failed run keeps what it showed).
        """
        self.dashboards.wait()
        self._recording.close()
        self.recorder.release()
        if failed:
            self.recorder.reset()

    def _reset(self) -> None:
        """Start a run from zero: a monitor reused after a failed or finished run carries none of its counts."""
        self.recorder.reset()
        self.schedule.reset()
        self.dashboards.reset()
        for alert in self.alerts:
            alert.reset()
        self.last_summaries = {}
        self.last_statistics = {}
        self._validation, self._training_step = None, False
        self._validation_epochs = []
        self._logged_validations = 0
        self._told = False

    def _alert(self, message: str, stacklevel: int = 2) -> None:
        """Warn and send the same text to every W&B sink as ``run.alert``."""
        self._warn(message, stacklevel=stacklevel + 1)
        title = message.removeprefix("attn_monitor: ").split(" in ", 1)[0].split(":", 1)[0]
        send_alert(self.sinks, f"attn_monitor: {title}", message)

    # -- validation --------------------------------------------------------
    def validation_start(self, *, epoch: int = 0, sanity_check: bool = False, fitting: bool = True) -> bool:
        """A validation starts (``fitting``: inside a training run, in ``epoch``); whether it is recorded."""
        if fitting and not sanity_check:
            self._validation_epochs.append(epoch)
        recorded = self.recorder.attached and self.schedule.validation_run(sanity_check, epoch, fitting)
        self._validation = (sanity_check, epoch) if recorded else None
        return recorded

    @contextmanager
    def recording(
        self, batch_index: int, batch: Any, dataloader_idx: int = 0, num_batches: float = math.inf
    ) -> Iterator[bool]:
        """Record the block into ``dataloader_idx``'s stream if this batch is sampled; yields whether it is."""
        sampled = self._validation is not None and batch_index in self.schedule.sampled_indices(
            num_batches, dataloader_idx
        )
        if not sampled:
            yield False
            return
        with self.recorder.recording(dataloader_idx, batch):
            yield True

    def validation_end(
        self,
        step: int,
        *,
        num_dataloaders: int = 1,
        dataset: tuple[int, str] | None = None,
        logged_elsewhere: Callable[[str], bool] | None = None,
        loop_names: Iterable[str] = (),
    ) -> ValidationOutcome:
        """Summarise, alert and write a recorded validation at ``step``; nothing when it was not recorded.

        Every process calls it (each summary is a collective). The sanity check sets
        no alert baseline, stops nothing and enters no history.

        Args:
            step: the step the loop logs this validation's own values at.
            num_dataloaders: validation dataloaders (names get ``/dataloader_idx_{i}`` when more than one).
            dataset: a loop that validates its datasets one at a time, each a validation of its own
                (recorded into dataloader 0): this dataset's index (its alert baselines) and its names' suffix.
            logged_elsewhere: names the loop logs itself; the sinks do not get them from here.
            loop_names: names the loop logs of its own (its validation loss gets a chart beside entropy's).
        """
        if self._validation is None:
            return ValidationOutcome({})
        (sanity_check, epoch), self._validation = self._validation, None
        scalars: dict[str, float] = {}
        stop = recorded = False
        for index in range(max(num_dataloaders, 1)):
            key, suffix = dataset or (index, f"/dataloader_idx_{index}" if num_dataloaders > 1 else "")
            logged = self._end_stream(
                index, step, suffix, key=key, alerts=not sanity_check, logged_elsewhere=logged_elsewhere,
                loop_names=loop_names,
            )  # fmt: skip
            if logged is None:
                continue
            scalars.update(logged)
            recorded = True
            self._tell(self.last_summaries[index])
            stop |= any(alert.stop and alert.flagged for alert in self.alerts) and not sanity_check
            for archive in self.archives if not sanity_check else ():
                archive.save(self.last_summaries[index], epoch, index if num_dataloaders > 1 else None)
        self._logged_validations += recorded and not sanity_check
        self._warn_if_blind()
        return ValidationOutcome(scalars, stop)

    def _end_stream(
        self,
        index: int,
        step: int,
        suffix: str,
        *,
        key: int,
        alerts: bool,
        logged_elsewhere: Callable[[str], bool] | None,
        loop_names: Iterable[str],
    ) -> dict[str, float] | None:
        """Compute, alert (with the baselines of ``key``) and write one dataloader's stream.

        Returns:
            Its scalars; None when nothing was recorded.
        """
        summary, masses = self.recorder.collect(index)
        statistics = self.recorder.collect_statistics(index)
        extra = self._bound_names(index, BOUND_FAMILY)
        if summary is None:
            return None
        self.last_summaries[index] = summary
        extra.update(masses.to_dict("attn") if masses is not None else {})
        if statistics is not None:
            self.last_statistics[index] = statistics
            clip = self.recorder.statistics.clip_threshold
            extra.update(statistics.to_dict("attn", per_head=self.options.per_head, clip_threshold=clip))
        findings: dict[str, float] = {}
        for alert in self.alerts if alerts else ():
            findings.update(alert.check(summary, statistics, key=key))
        extra.update(findings)
        if masses is not None:
            self.leakage(masses)
        return self.dashboards.log(
            self.sinks, summary, step, extra_scalars=extra, alerts=findings, suffix=suffix,
            logged_elsewhere=logged_elsewhere if alerts else None, loop_names=loop_names, remember=alerts,
        )  # fmt: skip

    def _bound_names(self, key: Any, family: str) -> dict[str, float]:
        """The max-logit bound of stream ``key`` under ``family`` (every rank: a collective); none when off."""
        bound = self.recorder.collect_bound(key)
        return {} if bound is None else bound.to_dict(family, per_head=self.options.per_head)

    def _tell(self, summary: EntropySummary) -> None:
        """Say the set-up line once per run, at its first recorded validation: what was found and is recorded."""
        capture = self.recorder.capture
        if not self._told and capture is not None:
            self._told = True
            self._say(setup_line(summary, capture.paths, self.schedule.batches))

    def _warn_if_blind(self) -> None:
        if self.recorder.saw_nothing and self.recorder.capture is not None:
            self._warn_once("blind", nothing_captured_message(self.recorder.capture.model))

    # -- training ----------------------------------------------------------
    def training_step_start(self, step: int, batch: Any) -> bool:
        """A training batch starts at optimizer step ``step``; records its forward pass if scheduled."""
        if not (self.recorder.attached and self.schedule.training_step(step)):
            return False
        self._recording.enter_context(self.recorder.recording(TRAIN, batch, diagnostics=False))
        self._training_step = True
        return True

    def training_forward_end(self) -> None:
        """The forward pass of the training batch is over (before backward: checkpointing reruns forwards)."""
        if self._training_step:
            self._recording.close()

    def training_step_end(self, step: int) -> dict[str, float]:
        """The training batch is over: write its record at ``step`` as ``{prefix}_train``; the scalars (or none)."""
        if not self._training_step:
            return {}
        self._training_step = False
        self._recording.close()
        summary, _ = self.recorder.collect(TRAIN)
        extra = self._bound_names(TRAIN, f"{BOUND_FAMILY}_train")
        scalars = {}
        if summary is not None:
            prefix = f"{self.options.prefix}_train"
            scalars = self.dashboards.log(self.sinks, summary, step, prefix=prefix, extra_scalars=extra)
        self._warn_if_blind()
        return scalars

    def training_end(self) -> None:
        """Training is over: the last pictures are written; say so if no validation was recorded."""
        self.dashboards.wait()
        asked = self.schedule.batches.count > 0  # batches=0: training steps only
        if asked and self._validation_epochs and not self._logged_validations and not self.recorder.saw_nothing:
            self._warn_once("never-monitored", never_monitored_message(self.schedule, self._validation_epochs))

    # -- checkpointing -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The random draws, the history and the collapse baselines (``torch.load(weights_only=True)`` reads it)."""
        state = {**self.schedule.state_dict(), **self.dashboards.state_dict(), "first_medians": {}}
        for alert in self.alerts:
            state.update(alert.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; loaded while no run is attached, it is where the next run starts."""
        if not self.recorder.attached:
            self._loaded_state = state_dict
        self.schedule.load_state_dict(state_dict)
        self.dashboards.load_state_dict(state_dict)
        for alert in self.alerts:
            alert.load_state_dict(state_dict)


def setup_line(summary: EntropySummary, paths: Mapping[str, Iterable[str]], batches: Batches) -> str:
    """One line: the layers found, the attention paths that read them, the batches recorded.

    Example:
        >>> import torch
        >>> from attn_monitor import AttentionEntropy
        >>> metric = AttentionEntropy(num_bins=10)
        >>> for layer in ("h.0.attn", "h.1.attn"):
        ...     metric.update(layer, torch.ones(1, 4, 3), torch.tensor(8))
        >>> print(setup_line(metric.compute(), {"h.0.attn": {"sdpa"}}, Batches(2)))  # doctest: +NORMALIZE_WHITESPACE
        attn_monitor: 2 attention layers found (h.0.attn, h.1.attn), 4 heads each, read by sdpa;
        recording the first 2 batches of each validation dataloader, every epoch.
    """
    layers = list(summary.layers)
    shown = ", ".join(layers) if len(layers) <= 2 else f"{layers[0]} ... {layers[-1]}"
    low, high = min(summary.num_heads, default=0), max(summary.num_heads, default=0)
    heads = f"{high} heads each" if low == high else f"{low}-{high} heads"
    read_by = ", ".join(sorted({path for layer in layers for path in paths.get(layer, ())})) or "no path"
    if batches.indices is not None:
        which = f"batches {list(batches.indices)}"
    elif batches.random_sample:
        which = f"{batches.count} random batches (seed {batches.seed})"
    else:
        which = f"the first {batches.count} batches"
    every = "every epoch" if batches.every_n_epochs == 1 else f"every {batches.every_n_epochs} epochs"
    steps = batches.train_every_n_steps
    train = "" if steps is None else f"; a training batch every {steps} steps"
    return (
        f"attn_monitor: {len(layers)} attention layers found ({shown}), {heads}, read by {read_by}; "
        f"recording {which} of each validation dataloader, {every}{train}."
    )


def never_monitored_message(schedule: BatchSchedule, epochs_seen: Sequence[int]) -> str:
    """The warning of a run whose validations (in ``epochs_seen``) ran and none was recorded: which setting, why."""
    epochs = sorted(set(epochs_seen))
    batches = schedule.batches
    n = batches.every_n_epochs
    if not any(schedule.validation_run(False, epoch) for epoch in epochs):
        reason = (
            f"`every_n_epochs={n}` monitors the validations of epochs e with (e + 1) % {n} == 0, as Lightning's "
            "check_val_every_n_epoch counts; pass every_n_epochs=1 or a multiple of check_val_every_n_epoch"
        )
    else:
        sample = batches.indices if batches.indices is not None else batches.count
        reason = (
            f"no sampled batch (`batches={sample}`) was reached in a validation dataloader; pass `batches=` "
            "within the validation batches that run (limit_val_batches)"
        )
    return f"attn_monitor: {len(epochs_seen)} validation runs (epochs {epochs}) ran and none was monitored: {reason}."


def _check_alerts(alerts: Iterable[Alert], statistics: Statistics) -> list[Alert]:
    """The alerts as a list: each an enabled :class:`Alert`, one per kind, its statistic measured.

    Raises:
        TypeError: an entry that is no alert.
        ValueError: an alert with nothing to check, two of a kind, a max-logit alert without the max logit.
    """
    if isinstance(alerts, Alert):
        raise TypeError(f"Expected `alerts` to be a list of alerts, got one {type(alerts).__name__}; pass [alert].")
    checked: list[Alert] = list(alerts)
    kinds: set[type] = set()
    for alert in checked:
        kind = type(alert)
        if not isinstance(alert, Alert):
            raise TypeError(f"Expected every entry of `alerts` to be an alert (CollapseAlert...), got {kind.__name__}.")
        if not alert.enabled:
            raise ValueError(f"`alerts` holds a {kind.__name__} with nothing to check; give it a threshold.")
        if kind in kinds:
            raise ValueError(f"`alerts` holds two {kind.__name__}s; they would log the same names.")
        if alert.needs_max_logit and not statistics.max_logit:
            raise ValueError(
                f"`alerts` holds a {kind.__name__}, which needs `Statistics(max_logit=True)`: the max logit is only "
                "measured when it is logged."
            )
        kinds.add(kind)
    return checked
