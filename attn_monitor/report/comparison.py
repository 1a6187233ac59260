"""Save entropy summaries to disk and compare two of them, per layer and head.

A typical use is "before / after": the same evaluation batches run through a
model before and after a change (a fine-tune, a new prompt format), each
summarised by :class:`~attn_monitor.metrics.entropy.AttentionEntropy`, saved with
:func:`save_summary`, and compared with :func:`compare` or the command line::

    attn-monitor compare before.pt after.pt --top 20 --heatmap shift.png

**File format** (version 1). A file is ``torch.save`` of a plain dict that
:func:`torch.load` reads with ``weights_only=True`` (no code runs on load)::

    {
        "format": "attn_monitor.EntropySummary",
        "version": 1,
        "layers": [str, ...],  # L layer names, in order
        "num_heads": [int, ...],  # heads of each layer
        "max_nats": float,  # right edge of the nats histogram
        "stats": {name: Tensor},  # float64, see below
    }

``stats`` holds every raw statistic of :meth:`EntropySummary.stats`:
``hist`` (L, H, num_bins), ``hist_nats`` (L, H, nats_bins), and ``count``,
``sum``, ``sum_sq``, ``sum_nats``, ``seq_sum``, ``seq_count``,
``single_key``, ``no_key``, each (L, H), where H is the largest head count
(slots past a layer's own heads are zero). Readers ignore keys they do not
know; a change that old readers cannot ignore gets a new version number.

**What a comparison means** (docs/design.md §4). Entropy describes the shape of
attention weights only: a shift tells you which layers and heads changed
how concentrated they are, not whether the model got better, and equal
entropy can hide mass moving between positions. Compare like with like: the
same evaluation batches, masks and layers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from attn_monitor.functional.histograms import coarsen
from attn_monitor.metrics.entropy import EntropySummary
from attn_monitor.report.figures import layer_head_figure

__all__ = ["REMINDER", "Comparison", "compare"]

#: The statistics a version-1 file holds: ``hist`` and ``hist_nats`` are (L, H, bins), the rest (L, H).
_STATS_V1 = ("hist", "hist_nats", "count", "sum", "sum_sq", "sum_nats", "seq_sum", "seq_count", "single_key", "no_key")
#: Statistics a version-1 file may hold (readers that do not know them skip them); absent means zero.
_OPTIONAL_V1 = ("nonfinite",)
_HISTOGRAMS = ("hist", "hist_nats")
_COUNTS = ("hist", "hist_nats", "count", "seq_count", "single_key", "no_key", "nonfinite")

#: Last line of every comparison table.
REMINDER = (
    "Entropy describes the shape of attention weights only; a shift says where to look, "
    "not whether the model got better."
)

Value = Literal["w1", "mean_shift", "median_shift"]
_VALUE_LABELS = {
    "w1": "W1 distance",
    "mean_shift": "mean shift (B - A)",
    "median_shift": "median shift (B - A)",
}


# --------------------------------------------------------------------------- file format


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of dtype {value.dtype}"
    return f"a {type(value).__name__}"


# --------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class Comparison:
    """How the normalised-entropy distribution of each (layer, head) moved from A to B.

    Tensors are (L, H), indexed like the summaries' layers and heads; slots
    past a layer's own heads, and heads with no counted query in A or in B,
    hold NaN (``mean_a`` / ``mean_b`` are NaN only where that side is empty).

    Attributes:
        layers: layer names, shared by both summaries.
        num_heads: heads of each layer.
        mean_a: token-weighted mean normalised entropy of A.
        mean_b: the same for B.
        mean_shift: ``mean_b - mean_a``.
        median_shift: median of B minus median of A (each within one bin).
        w1: Wasserstein-1 distance between the two normalised-entropy
            histograms, in units of normalised entropy (0 = same distribution,
            1 = all mass moved from one-hot to uniform).
        bin_width: width of the bins ``w1`` was computed on; ``w1`` is
            within one bin width of the distance between the exact samples.

    Example:
        >>> import math, torch
        >>> from attn_monitor import AttentionEntropy
        >>> def summary(head_0, head_1):  # every query of each head at one normalised entropy
        ...     metric = AttentionEntropy(num_bins=10)
        ...     values = torch.tensor([head_0, head_1], dtype=torch.float64)[None, :, None].expand(1, 2, 4)
        ...     metric.update("blocks.0.attn", values * math.log(8.0), num_valid=torch.tensor(8))
        ...     return metric.compute()
        >>> comparison = compare(summary(0.25, 0.75), summary(0.55, 0.65))
        >>> [(row["head"], round(row["w1"], 3)) for row in comparison.rows()]  # largest change first
        [(0, 0.3), (1, 0.1)]
        >>> print(comparison.table())  # doctest: +NORMALIZE_WHITESPACE +ELLIPSIS
        Normalised attention entropy per head (0 = one key, 1 = uniform), B vs A.
        Sorted by W1, the Wasserstein-1 distance between the distributions (+/- 0.1), largest first.
        layer          head    mean A    mean B   mean shift   median shift        W1
        blocks.0.attn     0    0.2500    0.5500      +0.3000        +0.3000    0.3000
        blocks.0.attn     1    0.7500    0.6500      -0.1000        -0.1000    0.1000
        Entropy describes the shape of attention weights only; a shift says where to look, ...
    """

    layers: tuple[str, ...]
    num_heads: tuple[int, ...]
    mean_a: Tensor
    mean_b: Tensor
    mean_shift: Tensor
    median_shift: Tensor
    w1: Tensor
    bin_width: float

    def rows(self) -> list[dict[str, Any]]:
        """One dict per real (layer, head), largest ``w1`` first, heads without data (NaN) last.

        Keys: ``layer`` (str), ``head`` (int), ``mean_a``, ``mean_b``,
        ``mean_shift``, ``median_shift``, ``w1`` (floats, NaN where undefined).
        Ties keep layer and head order.
        """
        out = []
        for index, layer in enumerate(self.layers):
            for head in range(self.num_heads[index]):
                out.append(
                    {
                        "layer": layer,
                        "head": head,
                        "mean_a": float(self.mean_a[index, head]),
                        "mean_b": float(self.mean_b[index, head]),
                        "mean_shift": float(self.mean_shift[index, head]),
                        "median_shift": float(self.median_shift[index, head]),
                        "w1": float(self.w1[index, head]),
                    }
                )
        # sorted() is stable: equal distances stay in layer, head order.
        return sorted(out, key=lambda row: (math.isnan(row["w1"]), -row["w1"] if not math.isnan(row["w1"]) else 0.0))

    def table(self, top: int | None = None) -> str:
        """A fixed-width text table of :meth:`rows`, largest change first.

        Args:
            top: show only this many rows (None: all).

        Returns:
            Two header lines, column names, one line per head, a line counting the rows
            left out (if any), and a closing line on what entropy does and
            does not mean (:data:`REMINDER`).

        Raises:
            ValueError: ``top`` is not a positive int.
        """
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 1):
            raise ValueError(f"Expected `top` to be a positive int or None, got {top!r}.")
        rows = self.rows()
        shown = rows if top is None else rows[:top]
        layer_width = max([len("layer"), *(len(row["layer"]) for row in shown)])
        columns = ("mean A", "mean B", "mean shift", "median shift", "W1")
        widths = (8, 8, 11, 13, 8)
        lines = [
            "Normalised attention entropy per head (0 = one key, 1 = uniform), B vs A.",
            f"Sorted by W1, the Wasserstein-1 distance between the distributions (+/- {self.bin_width:.4g}), "
            "largest first.",
            f"{'layer':<{layer_width}}  {'head':>4}"
            + "".join(f"  {name:>{width}}" for name, width in zip(columns, widths, strict=True)),
        ]
        for row in shown:
            cells = (
                _number(row["mean_a"]),
                _number(row["mean_b"]),
                _number(row["mean_shift"], signed=True),
                _number(row["median_shift"], signed=True),
                _number(row["w1"]),
            )
            lines.append(
                f"{row['layer']:<{layer_width}}  {row['head']:>4}"
                + "".join(f"  {cell:>{width}}" for cell, width in zip(cells, widths, strict=True))
            )
        if not rows:
            lines.append("(no layers to compare)")
        if len(shown) < len(rows):
            lines.append(f"... {len(rows) - len(shown)} more head(s) with smaller W1 not shown.")
        if any(math.isnan(row["w1"]) for row in shown):
            lines.append("n/a: the head has no counted query in A or in B.")
        lines.append(REMINDER)
        return "\n".join(lines)

    def heatmap(self, path: str | os.PathLike[str], *, value: Value = "w1", title: str | None = None) -> None:
        """Write a layer x head heatmap of ``value`` to ``path`` (PNG by extension).

        ``w1`` uses a sequential colour scale from 0; the shifts use a diverging
        scale centred at 0, symmetric and shared by every cell (so red and
        blue of equal depth mean equal and opposite shifts). Cells with no
        value (missing heads, no data) are grey.

        Args:
            path: destination image file.
            value: ``"w1"``, ``"mean_shift"`` or ``"median_shift"``.
            title: figure title (default: says what is plotted).

        Raises:
            ValueError: unknown ``value``, or nothing to plot (no layers).
            OSError: the file cannot be written.
        """
        if value not in _VALUE_LABELS:
            raise ValueError(f"Expected `value` to be one of {sorted(_VALUE_LABELS)}, got {value!r}.")
        if not self.layers:
            raise ValueError("Nothing to plot: the compared summaries have no layers.")
        import matplotlib

        grid = getattr(self, value).numpy()
        finite = grid[np.isfinite(grid)]
        largest = float(np.abs(finite).max()) if finite.size else 0.0
        # A flat (all-zero) map still needs a non-empty colour range.
        largest = largest if largest > 0 else self.bin_width
        if value == "w1":
            limits, colours = (0.0, largest), "viridis"
        else:
            limits, colours = (-largest, largest), "RdBu_r"
        figure = layer_head_figure(
            grid,
            self.layers,
            limits=limits,
            # Grey, not white: white is "no shift" on the diverging scale.
            colours=matplotlib.colormaps[colours].with_extremes(bad="#c8c8c8"),
            title=title or f"Normalised attention entropy, B vs A:\n{_VALUE_LABELS[value]}",
            label=_VALUE_LABELS[value],
            xlabel="head (grey: no such head, or no data in A or B)",
        )
        figure.savefig(os.fspath(path), dpi=120)


def _number(value: float, signed: bool = False) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def compare(a: EntropySummary, b: EntropySummary) -> Comparison:
    """Compare two summaries of the same layers and heads (A = before, B = after).

    Per (layer, head): the shift in mean and in median normalised entropy
    (B - A) and the Wasserstein-1 distance between the two normalised-entropy
    histograms. Each histogram is normalised to a probability distribution
    (so different numbers of queries compare fairly) and

        W1 = sum over bins |CDF_A - CDF_B| * bin_width,

    the exact distance between the distributions with each bin's mass at its
    centre, hence within one bin width of the distance between the exact
    samples. Summaries with different bin counts are compared on the coarser
    bins when one count is a multiple of the other. W1 sees changes a mean
    hides: a head that splits into one-hot and uniform queries keeps its mean
    but moves far.

    Args:
        a: the reference summary.
        b: the summary compared with it.

    Returns:
        A :class:`Comparison`.

    Raises:
        TypeError: ``a`` or ``b`` is not an :class:`EntropySummary`.
        ValueError: the layers (names or order) or head counts differ, or the
            bin counts are not multiples of one another.

    Example:
        >>> import math, torch
        >>> from attn_monitor import AttentionEntropy
        >>> def summary(normalised):  # every query of both heads at one normalised entropy
        ...     metric = AttentionEntropy(num_bins=10)
        ...     entropy = torch.full((1, 2, 4), normalised * math.log(8.0), dtype=torch.float64)
        ...     metric.update("layer.0", entropy, num_valid=torch.tensor(8))
        ...     return metric.compute()
        >>> before = summary(0.25)
        >>> compare(before, before).w1  # identical distributions
        tensor([[0., 0.]], dtype=torch.float64)
        >>> result = compare(before, summary(0.55))  # bin [0.2, 0.3) -> bin [0.5, 0.6): moved 3 bins of 0.1
        >>> result.w1.round(decimals=6), result.mean_shift.round(decimals=6)
        (tensor([[0.3000, 0.3000]], dtype=torch.float64), tensor([[0.3000, 0.3000]], dtype=torch.float64))
        >>> result.rows()[0]["w1"] == result.w1.max().item()
        True
    """
    for label, summary in (("a", a), ("b", b)):
        if not isinstance(summary, EntropySummary):
            raise TypeError(f"Expected `{label}` to be an EntropySummary, got {type(summary).__name__}.")
    _check_same_structure(a, b)
    hist_a, hist_b = _common_bins(a.histogram, b.histogram)
    bins = hist_a.shape[-1]
    bin_width = 1.0 / bins

    total_a, total_b = hist_a.sum(-1, keepdim=True), hist_b.sum(-1, keepdim=True)
    cdf_a = (hist_a / total_a.clamp(min=1)).cumsum(-1)
    cdf_b = (hist_b / total_b.clamp(min=1)).cumsum(-1)
    w1 = (cdf_a - cdf_b).abs().sum(-1) * bin_width
    both = ((total_a > 0) & (total_b > 0)).squeeze(-1)
    nan = torch.full_like(w1, math.nan)

    mean_a, mean_b = a.mean, b.mean
    return Comparison(
        layers=tuple(a.layers),
        num_heads=tuple(a.num_heads),
        mean_a=mean_a,
        mean_b=mean_b,
        mean_shift=torch.where(both, mean_b - mean_a, nan),
        median_shift=torch.where(both, b.quantile(0.5) - a.quantile(0.5), nan),
        w1=torch.where(both, w1, nan),
        bin_width=bin_width,
    )


def _check_same_structure(a: EntropySummary, b: EntropySummary) -> None:
    if a.layers != b.layers:
        only_a = [layer for layer in a.layers if layer not in b.layers]
        only_b = [layer for layer in b.layers if layer not in a.layers]
        if only_a or only_b:
            detail = f"only in A: {only_a}; only in B: {only_b}"
        else:
            detail = f"same layers in another order: A has {a.layers}, B has {b.layers}"
        raise ValueError(f"Cannot compare summaries of different layers ({detail}).")
    differing = [
        f"{layer!r} has {heads_a} in A, {heads_b} in B"
        for layer, heads_a, heads_b in zip(a.layers, a.num_heads, b.num_heads, strict=True)
        if heads_a != heads_b
    ]
    if differing:
        raise ValueError(f"Cannot compare summaries with different head counts: {'; '.join(differing)}.")


def _common_bins(hist_a: Tensor, hist_b: Tensor) -> tuple[Tensor, Tensor]:
    """Both histograms on the coarser of the two binnings (one count must divide the other)."""
    bins_a, bins_b = hist_a.shape[-1], hist_b.shape[-1]
    if bins_a == bins_b:
        return hist_a, hist_b
    if bins_a % bins_b == 0:
        return coarsen(hist_a, bins_b), hist_b
    if bins_b % bins_a == 0:
        return hist_a, coarsen(hist_b, bins_a)
    raise ValueError(
        f"Cannot compare histograms of {bins_a} and {bins_b} bins: neither count is a multiple of the other, "
        "so no common binning exists. Use bin counts that divide one another (e.g. 1000 and 100)."
    )
