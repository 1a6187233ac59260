"""Pictures of entropy summaries: layer x head heatmaps, drawn without pyplot.

matplotlib is imported inside the functions, so importing this module (and
the callback that uses it) costs nothing until a picture is drawn.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from attn_monitor.metric import EntropySummary

__all__ = ["figure_to_array", "heatmap_figure", "layer_head_figure", "save_heatmap"]


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


def figure_to_array(figure: Any) -> np.ndarray:
    """The (height, width, 3) uint8 RGB pixels of a figure made by :func:`layer_head_figure`."""
    figure.canvas.draw()
    pixels: np.ndarray = np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()
    return pixels


def save_heatmap(summary: EntropySummary, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """Write :func:`heatmap_figure` to ``path`` (PNG by extension)."""
    heatmap_figure(summary, **kwargs).savefig(os.fspath(path), dpi=120)
