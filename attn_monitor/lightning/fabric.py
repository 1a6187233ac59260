"""The sinks of Lightning's loggers, for Fabric and plain loops as for the Lightning callback.

    fabric = L.Fabric(loggers=[TensorBoardLogger(root), CSVLogger(root)])
    core = MonitorCore(batches=2)
    core.attach(model, sinks=fabric_sinks(fabric))

A :class:`~attn_monitor.monitor.core.MonitorCore` driven by the loop (see its
docstring) then writes everything each logger can hold: TensorBoard (Fabric's
or Lightning's ``TensorBoardLogger``) gets the scalars, histograms, the
digest and pictures in its own event file, W&B (``WandbLogger``) the same in
its run, on its step axis; a CSV logger, or any other with
``log_metrics(metrics, step)``, the scalars.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.fabric.loggers import TensorBoardLogger
from lightning.pytorch.loggers import WandbLogger

from attn_monitor.report.loggers import WandbSink

__all__ = ["fabric_sinks", "lightning_sinks"]


def lightning_sinks(loggers: Iterable[Any]) -> list[Any]:
    """Lightning's loggers as sinks: TensorBoard's writer, W&B's run (on the logger's step axis), others as they are."""
    sinks: list[Any] = []
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):  # Fabric's, and Lightning's (a subclass)
            sinks.append(logger.experiment)
        elif isinstance(logger, WandbLogger):  # Lightning's, which Fabric also takes
            sinks.append(WandbSink(logger.experiment, logger.log_metrics))
        else:
            sinks.append(logger)
    return sinks


def fabric_sinks(fabric: Any) -> list[Any]:
    """The sinks of ``fabric.loggers`` on the global rank zero; none elsewhere (only rank zero logs)."""
    return lightning_sinks(fabric.loggers) if fabric.is_global_zero else []
