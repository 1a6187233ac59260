"""Pictures of entropy summaries: layer x head heatmaps and heads over training.

The pictures logged during training (:func:`heatmap_picture`,
:func:`history_picture`) are drawn straight into pixel arrays by
:func:`grid_picture`; :func:`layer_head_figure` makes a matplotlib figure
(without pyplot) for reports saved to files. matplotlib and Pillow are
imported inside the functions, so importing this module (and the callback
that uses it) costs nothing until a picture is drawn.
"""

from __future__ import annotations

import functools
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attn_monitor.metrics.entropy import EntropySummary
from attn_monitor.report.display import short_names

__all__ = [
    "Picture",
    "grid_picture",
    "heatmap_picture",
    "history_picture",
    "layer_head_figure",
    "median_grid",
    "png_bytes",
    "read_cells",
    "save_heatmap",
]


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


def save_heatmap(summary: EntropySummary, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """Write :func:`heatmap_picture` to ``path`` (PNG by extension)."""
    from PIL import Image

    Image.fromarray(heatmap_picture(summary, **kwargs).pixels).save(os.fspath(path))


# --------------------------------------------------------------------------- pictures drawn as pixel arrays
#
# The validation path draws its pictures straight into a numpy array: cells
# are filled with numpy, text is set with Pillow (matplotlib's own
# dependency) in the DejaVu font matplotlib ships. No Figure, no layout
# engine: a 32 x 32 heatmap takes a few milliseconds, and what each cell holds
# is the returned ``grid``, which tests read back from the pixels.

_BACKGROUND = (255, 255, 255)
_EMPTY = (217, 217, 217)
_INK = (33, 33, 33)


@dataclass(frozen=True)
class Picture:
    """A picture drawn from a grid of values, and where each value went.

    Attributes:
        pixels: (height, width, 3) uint8 RGB.
        grid: (rows, columns) float64, the value each cell shows (NaN: an empty cell).
        cells: (rows, columns, 4) int, each cell's pixel box ``left, top, right, bottom``
            (right and bottom exclusive).
        limits: the values at the two ends of the colour scale.
        colours: name of the matplotlib colour map.
    """

    pixels: np.ndarray
    grid: np.ndarray
    cells: np.ndarray
    limits: tuple[float, float]
    colours: str

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)`` in pixels."""
        return int(self.pixels.shape[1]), int(self.pixels.shape[0])


def png_bytes(picture: Picture) -> bytes:
    """``picture`` as PNG: 8-bit RGB, rows unfiltered, one zlib stream at level 1.

    Flat cells compress well without row filters; written here, a 32 x 32
    heatmap (~900 x 660 pixels) encodes in ~7 ms, against ~24 ms through
    Pillow's encoder at the same level, and about as small.
    """
    height, width, channels = picture.pixels.shape
    rows = np.zeros((height, 1 + width * channels), dtype=np.uint8)  # a leading 0 per row: no filter
    rows[:, 1:] = picture.pixels.reshape(height, width * channels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, deflate, no interlace
    return b"".join(
        (
            b"\x89PNG\r\n\x1a\n",
            _png_chunk(b"IHDR", header),
            _png_chunk(b"IDAT", zlib.compress(rows.tobytes(), 1)),
            _png_chunk(b"IEND", b""),
        )
    )


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@functools.lru_cache(maxsize=8)
def _font(size: int) -> Any:
    import matplotlib
    from PIL import ImageFont

    return ImageFont.truetype(os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf"), size)


@functools.lru_cache(maxsize=8)
def _palette(colours: str) -> np.ndarray:
    """(256, 3) uint8 colours of a matplotlib colour map."""
    import matplotlib

    table = matplotlib.colormaps[colours](np.linspace(0.0, 1.0, 256))[:, :3]
    palette: np.ndarray = np.round(table * 255).astype(np.uint8)
    return palette


def _colour_index(values: np.ndarray, limits: tuple[float, float]) -> np.ndarray:
    low, high = limits
    span = high - low if high > low else 1.0
    index: np.ndarray = np.clip(np.round((np.nan_to_num(values, nan=low) - low) / span * 255), 0, 255)
    return index.astype(np.intp)


@functools.lru_cache(maxsize=4096)
def _stamp(text: str, size: int) -> np.ndarray:
    """(height, width) uint8 coverage of ``text`` set in DejaVu at ``size`` pixels, cropped to its ink."""
    from PIL import Image, ImageDraw

    left, top, right, bottom = _font(size).getbbox(text)
    canvas = Image.new("L", (max(1, int(right - left)), max(1, int(bottom - top))), 0)
    ImageDraw.Draw(canvas).text((-left, -top), text, fill=255, font=_font(size))
    stamp: np.ndarray = np.asarray(canvas)
    stamp.flags.writeable = False
    return stamp


def _text_size(text: str, size: int) -> tuple[int, int]:
    height, width = _stamp(text, size).shape
    return width, height


def _put(pixels: np.ndarray, text: str, size: int, x: int, y: int, anchor: str, ink: tuple[int, int, int]) -> None:
    """Blend ``text`` into ``pixels``; ``anchor`` is horizontal (l, m, r) then vertical (t, m, b), as in Pillow."""
    if not text:
        return
    stamp = _stamp(text, size)
    height, width = stamp.shape
    x0 = x - {"l": 0, "m": width // 2, "r": width}[anchor[0]]
    y0 = y - {"t": 0, "m": height // 2, "b": height}[anchor[1]]
    top, left = max(y0, 0), max(x0, 0)
    bottom, right = min(y0 + height, pixels.shape[0]), min(x0 + width, pixels.shape[1])
    if bottom <= top or right <= left:
        return
    alpha = stamp[top - y0 : bottom - y0, left - x0 : right - x0, None].astype(np.float32) / 255.0
    region = pixels[top:bottom, left:right]
    region[:] = (region * (1.0 - alpha) + np.asarray(ink, dtype=np.float32) * alpha).astype(np.uint8)


def read_cells(picture: Picture) -> np.ndarray:
    """The values a picture's cells show, read back from its pixels (NaN: empty cell).

    Each cell's colour is sampled next to its top-left corner (clear of any
    written value) and matched to the nearest colour of the scale, so the
    result is exact to one step of the 256-colour scale.
    """
    palette = _palette(picture.colours).astype(np.int64)
    rows, columns = picture.grid.shape
    out = np.full((rows, columns), np.nan)
    low, high = picture.limits
    for row in range(rows):
        for column in range(columns):
            left, top, _, _ = picture.cells[row, column]
            colour = picture.pixels[top + 1, left + 1].astype(np.int64)
            if tuple(colour) == _EMPTY:
                continue
            nearest = int(((palette - colour) ** 2).sum(1).argmin())
            out[row, column] = low + (high - low) * nearest / 255
    return out


#: Width of the logged pictures: TensorBoard's default image card (about 350 pixels) and a W&B media panel
#: show them at their own size, neither scaled down nor scrolled.
CARD_WIDTH = 340


def _fit(text: str, size: int, room: int) -> str:
    """``text``, cut with an ellipsis where it would be wider than ``room`` pixels."""
    font = _font(size)
    if font.getlength(text) <= room:
        return text
    while text and font.getlength(text + "…") > room:
        text = text[:-1]
    return text + "…"


def _stride(extent: int, cell: int) -> int:
    """Label every k-th cell, so that labels ``extent`` pixels long keep a gap of at least 3 pixels."""
    return max(1, -(-(extent + 3) // max(cell, 1)))


def grid_picture(
    grid: np.ndarray,
    row_labels: Sequence[str],
    column_labels: Sequence[str],
    *,
    title: str,
    label: str,
    row_title: str,
    column_title: str,
    limits: tuple[float, float] = (0.0, 1.0),
    colours: str = "viridis",
    values: bool | None = None,
    notes: Sequence[str] = (),
    width: int = CARD_WIDTH,
) -> Picture:
    """Draw ``grid`` (rows, columns) as coloured cells with labels, a title, notes and a colour bar.

    Sized for the card it is shown in: ``width`` pixels wide (wider only when
    the columns would get under 3 pixels each), the cells as wide as fits and
    about square. The title and each line of ``notes`` take one line each,
    cut with an ellipsis when too long, so where the cells go depends on the
    grid, the row labels and the number of notes only. Row and column labels
    are thinned to every k-th where neighbours would touch. ``values`` writes
    each cell's value in it (default: where a cell is at least 30 x 16
    pixels). Empty (NaN) cells are light grey.

    Raises:
        ValueError: ``grid`` is not 2-D or the labels do not match it.

    Example:
        >>> picture = grid_picture(
        ...     np.array([[0.0, 1.0]]),
        ...     ["layer"],
        ...     ["0", "1"],
        ...     title="t",
        ...     label="v",
        ...     row_title="layer",
        ...     column_title="head",
        ... )
        >>> picture.size[0] == CARD_WIDTH
        True
        >>> read_cells(picture).tolist()
        [[0.0, 1.0]]
    """
    grid = np.asarray(grid, dtype=np.float64)
    if grid.ndim != 2:
        raise ValueError(f"Expected `grid` with 2 dims (rows, columns), got shape {tuple(grid.shape)}.")
    rows, columns = grid.shape
    if len(row_labels) != rows or len(column_labels) != columns:
        raise ValueError(
            f"Expected {rows} row labels and {columns} column labels for a grid of shape {(rows, columns)}, "
            f"got {len(row_labels)} and {len(column_labels)}."
        )
    frame = _frame(
        tuple(row_labels), tuple(column_labels), label, row_title, column_title, limits, colours, len(notes), width
    )
    pixels = frame.pixels.copy()
    left, top, cell_width, cell_height = frame.left, frame.top, frame.cell_width, frame.cell_height
    if values is None:
        values = cell_width >= 30 and cell_height >= 16
    grid_width, grid_height = cell_width * columns, cell_height * rows
    palette = _palette(colours)
    cells = np.empty((rows, columns, 4), dtype=np.int64)
    if rows and columns:
        colour = palette[_colour_index(grid, limits)]
        colour[~np.isfinite(grid)] = _EMPTY
        area = pixels[top : top + grid_height, left : left + grid_width]
        area.reshape(rows, cell_height, columns, cell_width, 3)[:] = colour[:, None, :, None, :]
        # One-pixel white lines between cells keep neighbouring equal colours apart.
        pixels[top : top + grid_height, left : left + grid_width : cell_width] = _BACKGROUND
        pixels[top : top + grid_height : cell_height, left : left + grid_width] = _BACKGROUND
        xs = left + np.arange(columns) * cell_width
        ys = top + np.arange(rows) * cell_height
        cells[..., 0], cells[..., 1] = xs[None, :], ys[:, None]
        cells[..., 2], cells[..., 3] = xs[None, :] + cell_width, ys[:, None] + cell_height
    room = pixels.shape[1] - 2 * _MARGIN
    _put(pixels, _fit(title, _BIG, room), _BIG, _MARGIN, _MARGIN, "lt", _INK)
    for number, note in enumerate(notes):
        _put(pixels, _fit(note, _TEXT, room), _TEXT, _MARGIN, _notes_top() + number * _line(), "lt", _INK)
    if values:
        shade = palette.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
        index = _colour_index(grid, limits)
        for row in range(rows):
            for column in range(columns):
                value = grid[row, column]
                if not np.isfinite(value):
                    continue
                ink = (0, 0, 0) if shade[index[row, column]] > 140 else (255, 255, 255)
                x = left + column * cell_width + cell_width // 2
                _put(pixels, f"{value:.2f}", _SMALL, x, top + row * cell_height + cell_height // 2, "mm", ink)
    pixels.flags.writeable = False
    low, high = limits
    return Picture(pixels=pixels, grid=grid, cells=cells, limits=(float(low), float(high)), colours=colours)


#: Text sizes in pixels (cell values and ticks, labels, the title) and the margin around a picture.
_SMALL, _TEXT, _BIG, _MARGIN = 10, 11, 13, 8


def _line() -> int:
    """The height of one line of label text, descenders included."""
    return _text_size("Ag", _TEXT)[1] + 4


def _notes_top() -> int:
    return _MARGIN + _text_size("Ag", _BIG)[1] + 6


@dataclass(frozen=True)
class _Frame:
    """What a grid picture holds besides its cells, title and notes, and where the cells go."""

    pixels: np.ndarray
    left: int
    top: int
    cell_width: int
    cell_height: int


@functools.lru_cache(maxsize=16)  # a validation draws every layer's heads over training in one frame
def _frame(
    row_labels: tuple[str, ...],
    column_labels: tuple[str, ...],
    label: str,
    row_title: str,
    column_title: str,
    limits: tuple[float, float],
    colours: str,
    notes: int,
    width: int,
) -> _Frame:
    """The labels, axis titles and colour bar of a grid picture with ``notes`` lines of notes (read-only)."""
    rows, columns = len(row_labels), len(column_labels)
    line, margin = _line(), _MARGIN
    label_width = max((_text_size(name, _TEXT)[0] for name in row_labels), default=0)
    left = margin + max(label_width, _text_size(row_title, _TEXT)[0]) + 6
    cell_width = max(3, (width - left - margin) // max(columns, 1))
    cell_height = int(np.clip(min(cell_width, 360 // max(rows, 1)), 4, 28))
    grid_width, grid_height = cell_width * columns, cell_height * rows
    width = max(width, left + grid_width + margin)
    top = _notes_top() + line * notes + line
    row_stride = _stride(_text_size("0", _TEXT)[1], cell_height)
    widest = max((_text_size(name, _SMALL)[0] for name in column_labels), default=0)
    column_stride = _stride(widest + 3, cell_width)
    bar_top = top + grid_height + 4 + line + line + 6
    bar_height = 10
    height = bar_top + bar_height + 4 + line + line + margin

    pixels = np.full((height, width, 3), 255, dtype=np.uint8)  # _BACKGROUND
    palette = _palette(colours)
    bar_left, bar_right = left, max(left + grid_width, width - margin)
    ramp = palette[np.linspace(0, 255, bar_right - bar_left).round().astype(np.intp)]
    pixels[bar_top : bar_top + bar_height, bar_left:bar_right] = ramp[None, :, :]
    _put(pixels, row_title, _TEXT, left - 6, top - 4, "rb", _INK)
    for row in range(0, rows, row_stride):
        _put(pixels, row_labels[row], _TEXT, left - 6, top + row * cell_height + cell_height // 2, "rm", _INK)
    for column in range(0, columns, column_stride):
        x = left + column * cell_width + cell_width // 2
        _put(pixels, column_labels[column], _SMALL, x, top + grid_height + 4, "mt", _INK)
    column_room = width - left - margin
    _put(pixels, _fit(column_title, _TEXT, column_room), _TEXT, left, top + grid_height + 4 + line, "lt", _INK)
    low, high = limits
    fractions = (0.0, 0.25, 0.5, 0.75, 1.0) if bar_right - bar_left >= 200 else (0.0, 0.5, 1.0)
    for fraction in fractions:
        x = bar_left + round(fraction * (bar_right - bar_left - 1))
        pixels[bar_top + bar_height : bar_top + bar_height + 3, x] = _INK
        anchor = "lt" if fraction == 0.0 else "rt" if fraction == 1.0 else "mt"
        _put(pixels, f"{low + fraction * (high - low):g}", _SMALL, x, bar_top + bar_height + 4, anchor, _INK)
    _put(pixels, _fit(label, _TEXT, width - 2 * margin), _TEXT, margin, bar_top + bar_height + 4 + line, "lt", _INK)
    pixels.flags.writeable = False
    return _Frame(pixels, left, top, cell_width, cell_height)


def median_grid(summary: EntropySummary) -> np.ndarray:
    """(layers, heads) median normalised entropy of each head: what :func:`heatmap_picture` shows.

    Heads a layer does not have, or with no counted query, are NaN.
    """
    grid: np.ndarray = summary.quantile(0.5).numpy().astype(np.float64)
    counted = summary.count.numpy() > 0
    grid[~counted] = np.nan
    return grid


def _extreme(grid: np.ndarray, names: Sequence[str], pick: str) -> str:
    """``name head h = value`` of the lowest (``pick="min"``) or highest cell of ``grid``; ``—`` when all are empty."""
    if not np.isfinite(grid).any():
        return "—"
    flat = np.nanargmin(grid) if pick == "min" else np.nanargmax(grid)
    row, column = np.unravel_index(flat, grid.shape)
    return f"{names[int(row)]} head {column} = {grid[row, column]:.2f}"


def heatmap_picture(
    summary: EntropySummary, *, title: str | None = None, grid: np.ndarray | None = None, step: int | None = None
) -> Picture:
    """Layer x head picture of each head's median normalised entropy, the lowest and highest head named.

    ``grid`` is :func:`median_grid` of ``summary``, computed here unless given;
    layers are labelled by their :func:`~attn_monitor.report.display.short_names`.
    """
    grid = median_grid(summary) if grid is None else grid
    names = short_names(summary.layers)
    at = "" if step is None else f" · step {step}"
    return grid_picture(
        grid,
        names,
        [str(h) for h in range(grid.shape[1])],
        title=(title or "Median entropy of each head") + at,
        label="median normalised entropy: 0 = one key, 1 = uniform",
        row_title="layer",
        column_title="head",
        notes=(f"lowest: layer {_extreme(grid, names, 'min')}", f"highest: layer {_extreme(grid, names, 'max')}"),
    )


#: The most validations a heads-over-training picture shows (evenly spaced, the first and last kept).
HISTORY_COLUMNS = 48


def history_picture(layer: str, steps: Sequence[int], medians: np.ndarray) -> Picture:
    """Head x validation picture of one layer: how each head's median moved over training.

    Notes name the step shown last, the lowest head then and the head whose
    median fell most since the first validation. More than
    :data:`HISTORY_COLUMNS` validations are thinned to that many.

    Args:
        layer: the layer's name as shown (in the title).
        steps: the step of each monitored validation (column labels).
        medians: (heads, validations) medians, NaN where a head had no counted query.
    """
    steps = list(steps)
    if len(steps) > HISTORY_COLUMNS:
        keep = np.unique(np.linspace(0, len(steps) - 1, HISTORY_COLUMNS).round().astype(np.intp))
        steps, medians = [steps[i] for i in keep], medians[:, keep]
    heads = [f"head {h}" for h in range(medians.shape[0])]
    notes = ["—", "—"]
    last = medians[:, -1] if steps else np.empty(0)
    if np.isfinite(last).any():
        low, high = int(np.nanargmin(last)), int(np.nanargmax(last))
        notes[0] = f"step {steps[-1]}: lowest head {low} = {last[low]:.2f}, highest head {high} = {last[high]:.2f}"
        change = medians[:, -1:] - medians[:, :1]
        if len(steps) > 1 and np.isfinite(change).any() and np.nanmin(change) < 0:
            h = int(np.nanargmin(change))
            notes[1] = f"largest drop: head {h}, {medians[h, 0]:.2f} → {medians[h, -1]:.2f} since step {steps[0]}"
        else:
            notes[1] = "no head fell since the first validation"
    return grid_picture(
        medians,
        heads,
        [str(step) for step in steps],
        title=f"layer {layer}: median entropy of each head",
        label="median normalised entropy: 0 = one key, 1 = uniform",
        row_title="",
        column_title="step of the monitored validation",
        notes=notes,
    )
