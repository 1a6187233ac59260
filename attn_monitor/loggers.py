"""Logger adapters: scalars everywhere, histograms and the heatmap where they can be shown.

Every logger gets the scalars of :meth:`EntropySummary.to_dict` through
``log_metrics``. TensorBoard also gets one histogram per layer, written with
``add_histogram_raw`` from the metric's own bins, and the heatmap figure;
Weights & Biases gets ``wandb.Histogram(np_histogram=...)`` per layer and the
heatmap as an image, through the Lightning logger so its step axis is the
trainer's. Other loggers get the scalars and one warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from torch import Tensor

from attn_monitor.metric import EntropySummary

__all__ = [
    "WANDB_MAX_BINS",
    "coarsen",
    "heatmap_figure",
    "layer_head_figure",
    "log_summary",
    "logger_kind",
    "save_heatmap",
]

#: W&B keeps at most this many histogram bins and silently drops the rest.
WANDB_MAX_BINS = 512


def coarsen(counts: Tensor, bins: int) -> Tensor:
    """Merge adjacent bins of ``counts`` (..., fine) into ``bins`` (fine must be a multiple).

    Example:
        >>> import torch
        >>> coarsen(torch.tensor([1.0, 2.0, 3.0, 4.0]), 2)
        tensor([3., 7.])
    """
    fine = counts.shape[-1]
    if bins < 1 or fine % bins:
        raise ValueError(f"Expected `bins` to divide the {fine} fine bins, got {bins}.")
    return counts.reshape(*counts.shape[:-1], bins, fine // bins).sum(-1)


def layer_head_figure(
    grid: np.ndarray,
    layers: Sequence[str],
    *,
    limits: tuple[float, float],
    colours: Any,
    title: str,
    label: str,
    xlabel: str = "head",
) -> Any:
    """Layer x head heatmap of ``grid`` (L, H) with a shared colour scale.

    NaN cells are drawn in the colour map's "bad" colour. Sized so that 32
    layers x 32 heads stay readable. Made without pyplot (an Agg canvas), so
    the caller's backend and open figures are left alone.

    Returns:
        A matplotlib ``Figure``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    num_layers, num_heads = grid.shape if grid.size else (0, 0)
    width = min(16.0, 3.0 + 0.32 * max(num_heads, 1) + 0.06 * max((len(name) for name in layers), default=0))
    height = min(14.0, 1.8 + 0.3 * max(num_layers, 1))
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    image = axes.imshow(
        np.ma.masked_invalid(grid), vmin=limits[0], vmax=limits[1], cmap=colours, aspect="auto", interpolation="nearest"
    )
    axes.set_xlabel(xlabel)
    axes.set_ylabel("layer")
    axes.set_xticks(range(0, num_heads, max(1, num_heads // 16)))
    axes.set_yticks(range(num_layers))
    axes.set_yticklabels(list(layers), fontsize=7 if num_layers > 16 else 9)
    axes.set_title(title, fontsize=10)
    figure.colorbar(image, ax=axes, fraction=0.05).set_label(label)
    return figure


def heatmap_figure(summary: EntropySummary, *, title: str | None = None) -> Any:
    """Layer x head heatmap of the median normalised entropy (shared 0..1 colour scale).

    Empty cells (heads a layer does not have, or with no counted query) stay blank.

    Returns:
        A matplotlib ``Figure`` (see :func:`layer_head_figure`).
    """
    return layer_head_figure(
        summary.quantile(0.5).numpy(),
        summary.layers,
        limits=(0.0, 1.0),
        colours="viridis",
        title=title or "Median normalised attention entropy (0 = one key, 1 = uniform)",
        label="median normalised entropy",
    )


def _tensorboard_histograms(writer: Any, summary: EntropySummary, prefix: str, bins: int, step: int) -> None:
    edges = np.linspace(0.0, 1.0, bins + 1)
    for index, layer in enumerate(summary.layers):
        counts = coarsen(summary.histogram[index].sum(0), bins).numpy()
        total = float(counts.sum())
        if total == 0:
            continue
        nonzero = np.flatnonzero(counts)
        sums = summary.stats("sum")[index].sum().item(), summary.stats("sum_sq")[index].sum().item()
        writer.add_histogram_raw(
            f"{prefix}/{layer}/hist",
            min=float(edges[nonzero[0]]),
            max=float(edges[nonzero[-1] + 1]),
            num=int(total),
            sum=sums[0],
            sum_squares=sums[1],
            bucket_limits=edges[1:].tolist(),
            bucket_counts=counts.tolist(),
            global_step=step,
        )


def _wandb_histograms(summary: EntropySummary, prefix: str, bins: int) -> dict[str, Any]:
    import wandb

    edges = np.linspace(0.0, 1.0, bins + 1)
    out = {}
    for index, layer in enumerate(summary.layers):
        counts = coarsen(summary.histogram[index].sum(0), bins).numpy()
        if counts.sum() > 0:
            out[f"{prefix}/{layer}/hist"] = wandb.Histogram(np_histogram=(counts, edges))
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


_warned_loggers: set[str] = set()


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
    """
    scalars = summary.to_dict(prefix, quantiles=quantiles, per_head=per_head)
    scalars.update(extra_scalars or {})
    figure = None
    for logger in loggers:
        logger.log_metrics(scalars, step=step)
        kind = logger_kind(logger)
        if kind == "other":
            name = type(logger).__name__
            if name not in _warned_loggers and (histogram_bins or heatmap):
                _warned_loggers.add(name)
                warnings.warn(
                    f"attn_monitor: {name} gets the entropy scalars only; histograms and the heatmap are written "
                    "to TensorBoard and W&B loggers.",
                    stacklevel=2,
                )
            continue
        if heatmap and figure is None and summary.layers:
            figure = heatmap_figure(summary)
        if kind == "tensorboard":
            writer = logger.experiment
            if histogram_bins:
                _tensorboard_histograms(writer, summary, prefix, histogram_bins, step)
            if figure is not None:
                writer.add_figure(f"{prefix}/heatmap", figure, global_step=step, close=False)
        else:
            payload = _wandb_histograms(summary, prefix, histogram_bins) if histogram_bins else {}
            if figure is not None:
                import wandb

                payload[f"{prefix}/heatmap"] = wandb.Image(_figure_to_array(figure))
            if payload:
                logger.log_metrics(payload, step=step)
    return scalars


def _figure_to_array(figure: Any) -> np.ndarray:
    figure.canvas.draw()
    pixels: np.ndarray = np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()
    return pixels


def save_heatmap(summary: EntropySummary, path: str, **kwargs: Any) -> None:
    """Write :func:`heatmap_figure` to ``path`` (PNG by extension)."""
    heatmap_figure(summary, **kwargs).savefig(path, dpi=120)
