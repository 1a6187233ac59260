"""AttentionEntropyMonitor: one Lightning callback from attention to dashboards.

    trainer = L.Trainer(callbacks=[AttentionEntropyMonitor()], logger=...)

A thin adapter over :class:`~attn_monitor.monitor.core.MonitorCore` (which batches,
what to record, what to log, alerts): it maps Lightning's hooks to the
core's calls and ``trainer.loggers`` to sinks (rank zero only), and does
what only Lightning can. At the end of a monitored validation run every
rank computes each stream's summary (a collective) and logs its means with
``LightningModule.log`` (they reach every logger at the step of the module's
own validation metrics), and puts every per-layer statistic into
``trainer.callback_metrics`` (``EarlyStopping`` and ``ModelCheckpoint`` can
monitor them); the core writes the other scalars and the rest at that step
on rank zero. A :class:`~attn_monitor.report.alerts.CollapseAlert` with
``stop=True`` sets ``trainer.should_stop``. The heads-over-training history
(drawn at every monitored validation) and the digest's first validation are
part of the checkpoint state. Each run (fit, validate) starts from zero at setup.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from attn_monitor.capture.calls import Adapter
from attn_monitor.capture.hooks import AttentionCapture
from attn_monitor.lightning.fabric import lightning_sinks
from attn_monitor.metrics.entropy import EntropySummary
from attn_monitor.metrics.statistics import StatisticsSummary
from attn_monitor.monitor.core import MonitorCore
from attn_monitor.monitor.recording import BatchMask, Statistics
from attn_monitor.monitor.schedule import Batches
from attn_monitor.report.alerts import Alert
from attn_monitor.report.archive import SummaryArchive
from attn_monitor.report.loggers import LogOptions, per_layer

__all__ = ["AttentionEntropyMonitor", "lightning_log_step", "logged_through_lightning"]


class AttentionEntropyMonitor(Callback):
    """Log per-layer, per-head attention entropy on sampled validation batches.

    Args:
        batches: which validation batches of each dataloader, which epochs and
            which training steps to record: an int ``n`` (the first ``n``),
            batch indices, or a :class:`~attn_monitor.monitor.schedule.Batches`
            (random draws, ``every_n_epochs``, the sanity check,
            ``train_every_n_steps``: a training step's record is logged under
            ``{prefix}_train``). A fit whose validations were never recorded
            warns once at its end.
        statistics: what is measured beside entropy
            (:class:`~attn_monitor.monitor.recording.Statistics`: one-key queries,
            sink mass, eviction coverage, leakage, max logit, distance).
        log: what is logged (:class:`~attn_monitor.report.loggers.LogOptions`:
            prefix, quantiles, per-head values, histogram bins, heatmap). Two
            monitors in one Trainer need different prefixes (it also keys the
            checkpoint state).
        alerts: a list of :class:`~attn_monitor.report.alerts.CollapseAlert`
            (``stop=True`` stops training), :class:`~attn_monitor.report.alerts.OverloadAlert`,
            :class:`~attn_monitor.report.alerts.MaxLogitAlert` (needs
            ``Statistics(max_logit=True)``), :class:`~attn_monitor.report.trend.TrendAlert`;
            at most one of each.
        layers: layer name patterns (globs) to monitor; each must match a module at setup.
        module: ``module(pl_module) -> nn.Module`` to watch; by default the
            LightningModule itself (layer names are relative to it).
        padding_mask: ``padding_mask(batch) -> (batch, seq)`` mask of real
            tokens; by default a dict batch's ``attention_mask``. Queries
            outside it are not samples.
        document_ids: ``document_ids(batch) -> (batch, seq)`` document of
            each token; by default a dict batch's ``document_ids``.
        adapters: module name pattern -> adapter, see :class:`AttentionCapture`.
        save_summaries: save each epoch's summary (see
            :func:`~attn_monitor.report.archive.save_summary`) under
            ``{trainer.log_dir}/attn_entropy/epoch{n}.pt``.

    With several validation dataloaders each is summarised apart and every
    logged name ends in ``/dataloader_idx_{i}``, as Lightning's ``self.log``
    does; with one, names carry no suffix.

    Raises:
        TypeError, ValueError: bad configuration, at construction; patterns
            that match nothing and too many bins for W&B, at setup.

    Example:
        >>> monitor = AttentionEntropyMonitor(batches=Batches(4, every_n_epochs=2))
        >>> monitor.quantiles
        (0.05, 0.25, 0.5, 0.75, 0.95)
        >>> monitor.state_key
        "AttentionEntropyMonitor{'prefix': 'attn_entropy'}"
    """

    def __init__(
        self,
        *,
        batches: Batches | int | Sequence[int] = 2,
        statistics: Statistics | None = None,
        log: LogOptions | None = None,
        alerts: Sequence[Alert] = (),
        layers: Sequence[str] | None = None,
        module: Callable[[pl.LightningModule], nn.Module] | None = None,
        padding_mask: BatchMask | None = None,
        document_ids: BatchMask | None = None,
        adapters: Mapping[str, Adapter] | None = None,
        save_summaries: bool = False,
    ) -> None:
        super().__init__()
        self.core = MonitorCore(
            batches=batches,
            statistics=statistics,
            log=log,
            alerts=alerts,
            layers=layers,
            module=module,
            padding_mask=padding_mask,
            document_ids=document_ids,
            adapters=adapters,
            warn=rank_zero_warn,
            say=rank_zero_info,
        )
        self.save_summaries = bool(save_summaries)
        self._batch = ExitStack()
        #: While Lightning reduces the epoch's logged values: its sync_dist advice silenced for the monitor's means.
        self._quiet_sync_advice = ExitStack()

    # -- what other code reads ----------------------------------------------
    @property
    def quantiles(self) -> tuple[float, ...]:
        return tuple(self.core.options.quantiles)

    @property
    def capture(self) -> AttentionCapture | None:
        """The capture on the watched model, between setup and teardown."""
        return self.core.recorder.capture

    @property
    def last_summaries(self) -> dict[int, EntropySummary]:
        """Summary of each validation dataloader at the last monitored validation run."""
        return self.core.last_summaries

    @property
    def last_statistics(self) -> dict[int, StatisticsSummary]:
        """Max logit and distance of each validation dataloader at the last monitored run (when on)."""
        return self.core.last_statistics

    @property
    def last_summary(self) -> EntropySummary | None:
        """The first validation dataloader's summary at the last monitored validation run."""
        return self.last_summaries.get(min(self.last_summaries, default=0))

    @property
    @override
    def state_key(self) -> str:
        # One key per prefix, as ModelCheckpoint keys by its settings: two monitors in one Trainer.
        return f"{type(self).__qualname__}{{'prefix': {self.core.options.prefix!r}}}"

    def sampled_indices(self, num_batches: int | float, dataloader_idx: int = 0) -> tuple[int, ...]:
        """Batch indices monitored in a validation dataloader of ``num_batches`` batches."""
        return self.core.schedule.sampled_indices(num_batches, dataloader_idx)

    # -- set-up and clean-up -----------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        sinks = lightning_sinks(trainer.loggers) if trainer.is_global_zero else []
        if self.save_summaries:
            # ``trainer.log_dir`` broadcasts rank zero's directory: every rank asks, rank zero saves.
            log_dir = trainer.log_dir or trainer.default_root_dir
            if trainer.is_global_zero:
                sinks.append(SummaryArchive(os.path.join(log_dir, "attn_entropy")))
        self.core.attach(pl_module, sinks, device=pl_module.device, new_run=stage in ("fit", "validate"))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release(failed=True)

    def _release(self, failed: bool = False) -> None:
        self._batch.close()
        self._quiet_sync_advice.close()
        self.core.release(failed=failed)

    # -- validation --------------------------------------------------------
    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fitting = trainer.state.fn == "fit"
        self.core.validation_start(epoch=trainer.current_epoch, sanity_check=trainer.sanity_checking, fitting=fitting)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        num_batches = trainer.num_val_batches[dataloader_idx] if trainer.num_val_batches else float("inf")
        self._batch.enter_context(self.core.recording(batch_idx, batch, dataloader_idx, num_batches))

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._batch.close()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        # Lightning writes no metric of the sanity check: the core writes all of them, at step 0.
        elsewhere = None if trainer.sanity_checking else logged_through_lightning
        outcome = self.core.validation_end(
            lightning_log_step(trainer),
            num_dataloaders=len(loaders),
            logged_elsewhere=elsewhere,
            loop_names=list(trainer.callback_metrics),  # the module's own `self.log` names, its loss among them
        )
        trainer.should_stop |= outcome.stop
        if elsewhere is None or not outcome.scalars:
            return
        watched = {name: value for name, value in outcome.scalars.items() if logged_through_lightning(name)}
        # Until the validation ends: Lightning reduces the epoch's logged values after this hook.
        self._quiet_sync_advice.enter_context(warnings.catch_warnings())
        _silence_sync_advice(watched)
        # Every rank logs the same (already reduced) values, so every rank's callback_metrics hold them.
        pl_module.log_dict(watched, on_step=False, on_epoch=True, add_dataloader_idx=False, sync_dist=False)
        # The other per-layer statistics reach what EarlyStopping and ModelCheckpoint read without
        # Lightning's per-name `log` (0.5-0.8 ms a name, 224 more names at 32 layers).
        trainer.callback_metrics.update(
            {
                name: torch.tensor(value)
                for name, value in outcome.scalars.items()
                if name not in watched and per_layer(name)
            }
        )

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._quiet_sync_advice.close()

    # -- training ----------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.core.training_step_start(trainer.global_step, batch)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.core.training_forward_end()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.core.training_step_end(lightning_log_step(trainer))  # the step of this batch's own `self.log` values

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A module whose on_train_batch_start returns -1 ends the epoch without on_train_batch_end.
        self.core.training_step_end(lightning_log_step(trainer))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.core.training_end()

    # -- checkpointing -------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return self.core.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.core.load_state_dict(state_dict)


#: ``/dataloader_idx_{i}`` at the end of a name: several validation dataloaders.
_DATALOADER_SUFFIX = re.compile(r"/dataloader_idx_\d+$")


@functools.lru_cache(maxsize=1 << 16)  # the same few thousand names at every validation
def logged_through_lightning(name: str) -> bool:
    """Whether the monitor logs ``name`` with ``LightningModule.log``: each family's overall and per-layer means.

    These also reach every logger at the step of the module's own
    validation metrics and ``Trainer.validate``'s results. Lightning's
    ``log`` costs 0.5-0.8 ms per name, more as names pile up (0.4 s for 1000
    names), and a 32-layer, 32-head model logs 257 (2300 with per-head values): every other scalar goes
    to the loggers directly at the same step.

    Example:
        >>> logged_through_lightning("attn_entropy/mean"), logged_through_lightning("attn_sink_mass/h.0/mean")
        (True, True)
        >>> logged_through_lightning("attn_entropy/h.0/q50")
        False
        >>> logged_through_lightning("attn_entropy_heads/h.0/head_1/mean")
        False
        >>> logged_through_lightning("attn_entropy/h.0/mean/dataloader_idx_1")
        True
    """
    return _DATALOADER_SUFFIX.sub("", name).endswith("/mean") and per_layer(name)


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
