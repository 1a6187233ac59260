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
import re
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from attn_monitor.functional.entropy import coarsen
from attn_monitor.metrics.entropy import EntropySummary
from attn_monitor.report.figures import layer_head_figure

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "REMINDER",
    "Comparison",
    "SummaryArchive",
    "compare",
    "load_summary",
    "save_summary",
]

#: Value of the ``"format"`` key of a saved summary.
FORMAT_NAME = "attn_monitor.EntropySummary"
#: Version written by :func:`save_summary`; the only one :func:`load_summary` reads.
FORMAT_VERSION = 1
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


def save_summary(summary: EntropySummary, path: str | os.PathLike[str]) -> None:
    """Write ``summary`` to ``path`` in the versioned format of this module.

    The file is written next to its destination and renamed into place, so a
    crash never leaves a half-written summary under ``path``.

    Args:
        summary: what :meth:`AttentionEntropy.compute` returned.
        path: destination file (conventionally ``.pt``).

    Raises:
        TypeError: ``summary`` is not an :class:`EntropySummary`.
        OSError: the file cannot be written.

    Example:
        >>> import math, os, tempfile, torch
        >>> from attn_monitor import AttentionEntropy
        >>> metric = AttentionEntropy()
        >>> metric.update("layer.0", torch.full((1, 2, 3), math.log(4.0)), torch.tensor(4))  # uniform over 4 keys
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = os.path.join(folder, "summary.pt")
        ...     save_summary(metric.compute(), path)
        ...     load_summary(path).mean
        tensor([[1., 1.]], dtype=torch.float64)
    """
    if not isinstance(summary, EntropySummary):
        raise TypeError(f"Expected `summary` to be an EntropySummary, got {type(summary).__name__}.")
    payload = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "layers": [str(layer) for layer in summary.layers],
        "num_heads": [int(heads) for heads in summary.num_heads],
        "max_nats": float(summary.max_nats),
        "stats": {
            name: summary.stats(name).detach().to("cpu", torch.float64).contiguous()
            for name in _STATS_V1 + _OPTIONAL_V1
        },
    }
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=".attn_monitor-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(payload, file)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


class SummaryArchive:
    """One saved summary per monitored epoch in ``directory``: ``epoch{n}.pt``.

    With several validation dataloaders each gets its own file,
    ``epoch{n}_dataloader_idx_{i}.pt``.

    Example:
        >>> import math, os, tempfile, torch
        >>> from attn_monitor import AttentionEntropy
        >>> metric = AttentionEntropy()
        >>> metric.update("layer.0", torch.full((1, 1, 2), math.log(4.0)), torch.tensor(4))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     archive = SummaryArchive(os.path.join(folder, "attn_entropy"))
        ...     path = archive.save(metric.compute(), epoch=3, dataloader_idx=1)
        ...     os.path.basename(path), load_summary(path).layers
        ('epoch3_dataloader_idx_1.pt', ['layer.0'])
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)

    def save(self, summary: EntropySummary, epoch: int, dataloader_idx: int | None = None) -> str:
        """Save ``summary`` as the given epoch's (and dataloader's); returns the path."""
        os.makedirs(self.directory, exist_ok=True)
        suffix = "" if dataloader_idx is None else f"_dataloader_idx_{dataloader_idx}"
        path = os.path.join(self.directory, f"epoch{epoch}{suffix}.pt")
        save_summary(summary, path)
        return path


def load_summary(path: str | os.PathLike[str]) -> EntropySummary:
    """Read a summary written by :func:`save_summary`, checking everything in it.

    Loads with ``torch.load(..., weights_only=True)``: a file cannot run code.

    Args:
        path: a file written by :func:`save_summary`.

    Returns:
        The :class:`EntropySummary`, with every statistic as saved.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        ValueError: the file is not a torch file, is truncated, is another
            format or an unsupported version, lacks a key, or holds tensors
            whose shapes disagree with its layers and heads. The message
            names the path and what is wrong.

    Example:
        >>> import os, tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = os.path.join(folder, "notes.pt")
        ...     with open(path, "w") as file:
        ...         _ = file.write("not a summary")
        ...     load_summary(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Cannot read an attention entropy summary from '.../notes.pt': not a torch file...
    """
    name = os.fspath(path)
    with open(name, "rb") as file:  # FileNotFoundError, IsADirectoryError, PermissionError pass through
        try:
            with warnings.catch_warnings():
                # Garbage read as a pickle makes torch warn about protocols before it fails; the error says enough.
                warnings.simplefilter("ignore")
                payload = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ValueError(
                f"Cannot read an attention entropy summary from {name!r}: {_load_failure(error)}."
            ) from None
    return _summary_from_payload(payload, name)


def _load_failure(error: Exception) -> str:
    """What went wrong in ``torch.load``, in one line (its own messages run to paragraphs)."""
    message = str(error)
    unsafe = re.search(r"GLOBAL ([\w.]+)", message)
    if unsafe:
        return (
            f"it holds a Python object ({unsafe.group(1)}) besides plain data and tensors, which is refused "
            "because loading it could run code"
        )
    detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", message)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    first_line = detail.group(1).strip() if detail else (lines[0] if lines else "no data")
    return f"not a torch file, or a truncated or damaged one ({type(error).__name__}: {first_line[:160]})"


def _summary_from_payload(payload: Any, name: str) -> EntropySummary:
    def fail(reason: str) -> ValueError:
        return ValueError(f"{name!r} is not a valid attention entropy summary: {reason}.")

    if not isinstance(payload, Mapping):
        raise fail(f"expected a dict with format {FORMAT_NAME!r}, found a {type(payload).__name__}")
    if payload.get("format") != FORMAT_NAME:
        raise fail(f"expected format {FORMAT_NAME!r}, found {payload.get('format')!r}")
    version = payload.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version != FORMAT_VERSION:
        hint = " (written by a newer attn_monitor? upgrade to read it)" if _is_newer(version) else ""
        raise fail(
            f"format version {version!r} is not supported{hint}; this attn_monitor reads version {FORMAT_VERSION}"
        )
    missing = [key for key in ("layers", "num_heads", "max_nats", "stats") if key not in payload]
    if missing:
        raise fail(f"missing key(s) {missing}")

    layers, num_heads, max_nats, stats = (payload[key] for key in ("layers", "num_heads", "max_nats", "stats"))
    if not isinstance(layers, list) or not all(isinstance(layer, str) and layer for layer in layers):
        raise fail(f"`layers` must be a list of non-empty names, found {layers!r}")
    if len(set(layers)) != len(layers):
        raise fail(f"`layers` holds a name twice: {layers}")
    if (
        not isinstance(num_heads, list)
        or len(num_heads) != len(layers)
        or not all(isinstance(heads, int) and not isinstance(heads, bool) and heads >= 1 for heads in num_heads)
    ):
        raise fail(f"`num_heads` must list one positive int per layer ({len(layers)}), found {num_heads!r}")
    if (
        not isinstance(max_nats, (int, float))
        or isinstance(max_nats, bool)
        or not math.isfinite(max_nats)
        or max_nats <= 0
    ):
        raise fail(f"`max_nats` must be a positive number, found {max_nats!r}")
    if not isinstance(stats, Mapping):
        raise fail(f"`stats` must be a dict of tensors, found a {type(stats).__name__}")
    missing = [kind for kind in _STATS_V1 if kind not in stats]
    if missing:
        raise fail(f"`stats` lacks {missing}")

    expected = (len(layers), max(num_heads, default=0))
    kinds = _STATS_V1 + tuple(kind for kind in _OPTIONAL_V1 if kind in stats)
    for kind in kinds:
        tensor = stats[kind]
        if not isinstance(tensor, Tensor) or tensor.dtype == torch.bool or tensor.is_complex():
            raise fail(f"stats[{kind!r}] must be a real-valued tensor, found {_describe(tensor)}")
        shape = tuple(tensor.shape)
        if kind in _HISTOGRAMS:
            good = len(shape) == 3 and shape[:2] == expected and shape[2] >= 1
            wanted = f"{(*expected, 'bins')} with bins >= 1"
        else:
            good = shape == expected
            wanted = str(expected)
        if not good:
            raise fail(
                f"stats[{kind!r}] has shape {shape}, expected {wanted} for {len(layers)} layers and "
                f"at most {expected[1]} heads"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise fail(f"stats[{kind!r}] holds NaN or infinite values")
        if kind in _COUNTS and bool((tensor < 0).any()):
            raise fail(f"stats[{kind!r}] holds negative counts")
    return EntropySummary(layers, num_heads, {kind: stats[kind] for kind in kinds}, float(max_nats))


def _is_newer(version: object) -> bool:
    return isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION


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
