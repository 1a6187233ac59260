"""Logger adapters: scalars everywhere, histograms and the heatmap where they can be shown.

Every logger gets the scalars of :meth:`EntropySummary.to_dict` through
``log_metrics``. TensorBoard also gets one histogram per layer, written with
``add_histogram_raw`` from the metric's own bins, and the heatmap figure;
Weights & Biases gets ``wandb.Histogram(np_histogram=...)`` per layer and the
heatmap as an image, through the Lightning logger so its step axis is the
trainer's. Other loggers get the scalars and one warning. The pictures
themselves are drawn in :mod:`attn_monitor.figures`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attn_monitor.figures import figure_to_array, heatmap_figure
from attn_monitor.functional import coarsen
from attn_monitor.metric import EntropySummary
from attn_monitor.shared import WarnOnce, check_int

__all__ = ["WANDB_MAX_BINS", "LogOptions", "log_summary", "logger_kind"]

#: W&B keeps at most this many histogram bins and silently drops the rest.
WANDB_MAX_BINS = 512


def _tensorboard_histograms(
    writer: Any, summary: EntropySummary, prefix: str, bins: int, step: int, suffix: str
) -> None:
    edges = np.linspace(0.0, 1.0, bins + 1)
    for index, layer in enumerate(summary.layers):
        counts = coarsen(summary.histogram[index].sum(0), bins).numpy()
        total = float(counts.sum())
        if total == 0:
            continue
        nonzero = np.flatnonzero(counts)
        sums = summary.stats("sum")[index].sum().item(), summary.stats("sum_sq")[index].sum().item()
        writer.add_histogram_raw(
            f"{prefix}/{layer}/hist{suffix}",
            min=float(edges[nonzero[0]]),
            max=float(edges[nonzero[-1] + 1]),
            num=int(total),
            sum=sums[0],
            sum_squares=sums[1],
            bucket_limits=edges[1:].tolist(),
            bucket_counts=counts.tolist(),
            global_step=step,
        )


def _wandb_histograms(summary: EntropySummary, prefix: str, bins: int, suffix: str) -> dict[str, Any]:
    import wandb

    edges = np.linspace(0.0, 1.0, bins + 1)
    out = {}
    for index, layer in enumerate(summary.layers):
        counts = coarsen(summary.histogram[index].sum(0), bins).numpy()
        if counts.sum() > 0:
            out[f"{prefix}/{layer}/hist{suffix}"] = wandb.Histogram(np_histogram=(counts, edges))
    return out


def logger_kind(logger: Any) -> str:
    """``"tensorboard"``, ``"wandb"`` or ``"other"`` for a Lightning logger."""
    from lightning.pytorch.loggers import TensorBoardLogger

    if isinstance(logger, TensorBoardLogger):
        return "tensorboard"
    try:
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:  # pragma: no cover - lightning always ships the class
        return "other"
    return "wandb" if isinstance(logger, WandbLogger) else "other"


#: Loggers told once per process that they get scalars only.
_SCALARS_ONLY = WarnOnce()


def log_summary(
    loggers: Iterable[Any],
    summary: EntropySummary,
    step: int,
    *,
    prefix: str = "attn_entropy",
    quantiles: Sequence[float] = (0.05, 0.25, 0.5, 0.75, 0.95),
    per_head: bool = True,
    histogram_bins: int | None = 100,
    heatmap: bool = True,
    extra_scalars: dict[str, float] | None = None,
    suffix: str = "",
) -> dict[str, float]:
    """Write ``summary`` to every logger; returns the scalars written.

    Args:
        loggers: Lightning loggers (``trainer.loggers``).
        summary: what to log.
        step: the step to log at (``trainer.global_step``).
        prefix: first component of every name.
        quantiles: quantile levels logged per layer.
        per_head: also log per-head mean and median.
        histogram_bins: bins of the logged histograms (None: no histograms);
            must divide the metric's bins.
        heatmap: log the layer x head median heatmap.
        extra_scalars: further scalars to log with the same step.
        suffix: appended to every name, histograms and heatmap included
            (``"/dataloader_idx_1"`` keeps validation dataloaders apart, as
            Lightning's ``self.log`` does).
    """
    scalars = summary.to_dict(prefix, quantiles=quantiles, per_head=per_head)
    scalars.update(extra_scalars or {})
    scalars = {name + suffix: value for name, value in scalars.items()}
    figure = None
    for logger in loggers:
        logger.log_metrics(scalars, step=step)
        kind = logger_kind(logger)
        if kind == "other":
            name = type(logger).__name__
            if histogram_bins or heatmap:
                _SCALARS_ONLY(
                    name,
                    f"attn_monitor: {name} gets the entropy scalars only; histograms and the heatmap are written "
                    "to TensorBoard and W&B loggers.",
                )
            continue
        if heatmap and figure is None and summary.layers:
            figure = heatmap_figure(summary)
        if kind == "tensorboard":
            writer = logger.experiment
            if histogram_bins:
                _tensorboard_histograms(writer, summary, prefix, histogram_bins, step, suffix)
            if figure is not None:
                writer.add_figure(f"{prefix}/heatmap{suffix}", figure, global_step=step, close=False)
        else:
            payload = _wandb_histograms(summary, prefix, histogram_bins, suffix) if histogram_bins else {}
            if figure is not None:
                import wandb

                payload[f"{prefix}/heatmap{suffix}"] = wandb.Image(figure_to_array(figure))
            if payload:
                logger.log_metrics(payload, step=step)
    return scalars


@dataclass(frozen=True)
class LogOptions:
    """What the monitor logs of each summary (see :func:`log_summary`), checked at construction.

    Raises:
        TypeError, ValueError: a bad option, named.

    Example:
        >>> LogOptions(quantiles=(0.5,), histogram_bins=None).metric_bins
        1000
        >>> LogOptions(prefix="attn/")
        Traceback (most recent call last):
        ...
        ValueError: Expected `prefix` to be a non-empty name without a trailing '/', got 'attn/'.
    """

    prefix: str = "attn_entropy"
    quantiles: Sequence[float] = (0.05, 0.25, 0.5, 0.75, 0.95)
    per_head: bool = True
    histogram_bins: int | None = 100
    heatmap: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix or self.prefix.endswith("/"):
            raise ValueError(f"Expected `prefix` to be a non-empty name without a trailing '/', got {self.prefix!r}.")
        object.__setattr__(self, "quantiles", tuple(float(q) for q in self.quantiles))
        for q in self.quantiles:
            if not 0.0 <= q <= 1.0:
                raise ValueError(f"Expected every quantile level in [0, 1], got {q}.")
        if self.histogram_bins is not None:
            check_int("histogram_bins", self.histogram_bins, 1)

    @property
    def metric_bins(self) -> int:
        """Bins of the metric: a multiple of the logged bins, fine enough for quantiles to 0.001."""
        bins = self.histogram_bins or 1000
        return bins * -(-1000 // bins)

    def check(self, loggers: Iterable[Any]) -> None:
        """Refuse more histogram bins than an attached W&B logger keeps.

        Raises:
            ValueError: ``histogram_bins`` > :data:`WANDB_MAX_BINS` with a W&B logger.
        """
        too_many = bool(self.histogram_bins) and self.histogram_bins > WANDB_MAX_BINS  # type: ignore[operator]
        if too_many and any(logger_kind(logger) == "wandb" for logger in loggers):
            raise ValueError(
                f"`histogram_bins`={self.histogram_bins} but W&B keeps at most {WANDB_MAX_BINS} bins "
                "and silently drops the rest; pass histogram_bins <= 512."
            )

    def write(
        self,
        loggers: Iterable[Any],
        summary: EntropySummary,
        step: int,
        *,
        prefix: str | None = None,
        extra_scalars: dict[str, float] | None = None,
        suffix: str = "",
    ) -> dict[str, float]:
        """:func:`log_summary` with these options (``prefix`` overrides :attr:`prefix`)."""
        return log_summary(
            loggers,
            summary,
            step,
            prefix=self.prefix if prefix is None else prefix,
            quantiles=self.quantiles,
            per_head=self.per_head,
            histogram_bins=self.histogram_bins,
            heatmap=self.heatmap,
            extra_scalars=extra_scalars,
            suffix=suffix,
        )
