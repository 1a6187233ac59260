"""A validation digest that names the answer: which layer, which head, since when.

:func:`validation_digest` reads one monitored validation's
:class:`~attn_monitor.metrics.entropy.EntropySummary` beside the first monitored
validation's medians (a :class:`Baseline`) and any alert findings, and
returns a :class:`Digest`: per layer its median and the change since then,
and the few heads that moved most, sit lowest and sit highest. It renders as
Markdown for TensorBoard's text plugin (:func:`digest_markdown`) and as rows
of a W&B table (:func:`digest_rows`, :func:`digest_table`), so that "layer 7 head 3 fell from 0.81 to 0.12 since
step 400" is read at the top, not hunted for among per-head charts.

Everything here is pure; :class:`~attn_monitor.report.dashboards.Dashboards` writes
the digest at every monitored validation. Layers are shown by their
:func:`~attn_monitor.report.display.short_names` and the W&B rows keep the full name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attn_monitor.metrics.entropy import EntropySummary
from attn_monitor.report.display import short_names
from attn_monitor.report.figures import median_grid

__all__ = [
    "Baseline",
    "Digest",
    "HeadMedian",
    "LayerMedian",
    "digest_markdown",
    "digest_rows",
    "digest_table",
    "validation_digest",
]

#: Columns of :func:`digest_rows`, in order.
COLUMNS = ("step", "kind", "layer", "layer_name", "head", "median", "first", "change", "alerts")


@dataclass(frozen=True)
class Baseline:
    """What the first monitored validation showed: the reference every change is measured from.

    Attributes:
        step: the step of that validation.
        head_medians: layer -> (heads,) median normalised entropy of each head (NaN: no counted query).
        layer_medians: layer -> median normalised entropy of the layer, heads pooled (empty: unknown).
    """

    step: int
    head_medians: Mapping[str, np.ndarray]
    layer_medians: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, summary: EntropySummary, step: int) -> Baseline:
        """The baseline ``summary`` (at ``step``) makes: keep the one of the first monitored validation."""
        grid = median_grid(summary)
        pooled = _layer_medians(summary)
        return cls(
            step=int(step),
            head_medians={layer: grid[i, : summary.num_heads[i]].copy() for i, layer in enumerate(summary.layers)},
            layer_medians={layer: float(pooled[i]) for i, layer in enumerate(summary.layers)},
        )


@dataclass(frozen=True)
class HeadMedian:
    """One head's median now and at the baseline.

    Attributes:
        layer: the layer's full name.
        name: the layer's display name.
        head: the head's index in its layer.
        median: median normalised entropy now.
        first: the baseline's median (None: no baseline, or the head had no counted query then).
    """

    layer: str
    name: str
    head: int
    median: float
    first: float | None = None

    @property
    def change(self) -> float | None:
        """``median - first`` (None without a first)."""
        return None if self.first is None else self.median - self.first


@dataclass(frozen=True)
class LayerMedian:
    """One layer's median (heads pooled) now and at the baseline, with its alerts.

    Attributes:
        layer: the layer's full name.
        name: the layer's display name.
        median: median normalised entropy now, heads pooled (NaN: no counted query).
        first: the baseline's (None: unknown).
        lowest: the layer's lowest head now (None: no head with a counted query).
        highest: the layer's highest head now.
        alerts: ``what: value`` of each alert that fired for this layer, e.g. ``collapsed_heads: 1``.
    """

    layer: str
    name: str
    median: float
    first: float | None
    lowest: HeadMedian | None
    highest: HeadMedian | None
    alerts: tuple[str, ...] = ()

    @property
    def change(self) -> float | None:
        """``median - first`` (None without a first)."""
        return None if self.first is None else self.median - self.first


@dataclass(frozen=True)
class Digest:
    """What one monitored validation says, layer by layer and head by head.

    Attributes:
        step: the step of this validation.
        first_step: the baseline's step (None: no baseline).
        layers: one :class:`LayerMedian` per layer, in the summary's order.
        moved: the heads whose median changed most since the baseline, largest change first.
        largest_drop: the head whose median fell most since the baseline (None: none fell).
        lowest: the heads with the lowest medians now, lowest first.
        highest: the heads with the highest medians now, highest first.
        alerts: ``name: value`` of every alert finding above zero that names no layer of the summary.
    """

    step: int
    first_step: int | None
    layers: tuple[LayerMedian, ...]
    moved: tuple[HeadMedian, ...]
    largest_drop: HeadMedian | None
    lowest: tuple[HeadMedian, ...]
    highest: tuple[HeadMedian, ...]
    alerts: tuple[str, ...] = ()

    @property
    def headline(self) -> str:
        """One sentence with the answer: the largest drop since the baseline, else the lowest head."""
        if self.largest_drop is not None and self.largest_drop.first is not None:
            head = self.largest_drop
            return (
                f"layer {head.name} head {head.head} fell from {head.first:.2f} to {head.median:.2f} "
                f"since step {self.first_step}"
            )
        if self.lowest:
            head = self.lowest[0]
            return f"lowest: layer {head.name} head {head.head} at {head.median:.2f}"
        return "no head had a counted query"


def validation_digest(
    summary: EntropySummary,
    step: int,
    *,
    baseline: Baseline | None = None,
    alerts: Mapping[str, float] | None = None,
    heads: int = 3,
) -> Digest:
    """The digest of ``summary`` at ``step``: per layer and per head, now and since ``baseline``.

    Medians are what the logged ``q50`` scalars and the heatmap show (the
    summary's histogram medians). Heads without a counted query, now or at the
    baseline, are left out of the rankings they cannot take part in.

    Args:
        summary: this validation's entropy summary.
        step: its step.
        baseline: the first monitored validation (:meth:`Baseline.of`); None: no changes.
        alerts: what the alerts returned, ``{prefix}/{layer}/{what}: value``; findings above 0 are listed
            with their layer (or apart, when they name no layer of the summary).
        heads: how many heads each ranking names.

    Returns:
        The :class:`Digest`.

    Raises:
        ValueError: ``heads`` is not positive.

    Example:
        >>> import math, torch
        >>> from attn_monitor import AttentionEntropy
        >>> def summary(heads):  # every query of head h at normalised entropy heads[h]
        ...     metric = AttentionEntropy(num_bins=100)
        ...     values = torch.tensor(heads, dtype=torch.float64)[None, :, None].expand(1, len(heads), 5)
        ...     metric.update("model.h.0.attn", values * math.log(8.0), torch.tensor(8))
        ...     metric.update("model.h.1.attn", values.flip(1) * math.log(8.0), torch.tensor(8))
        ...     return metric.compute()
        >>> first = Baseline.of(summary([0.805, 0.605]), step=400)
        >>> validation_digest(summary([0.805, 0.125]), 900, baseline=first).headline
        'layer 0 head 1 fell from 0.60 to 0.12 since step 400'
    """
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"Expected `heads` a positive int, got {heads!r}.")
    names = short_names(summary.layers)
    grid = median_grid(summary)
    pooled = _layer_medians(summary)
    findings = {name: float(value) for name, value in (alerts or {}).items() if float(value) > 0}
    everyone: list[HeadMedian] = []
    layers = []
    for index, (layer, name) in enumerate(zip(summary.layers, names, strict=True)):
        first = baseline.head_medians.get(layer) if baseline is not None else None
        own = [
            HeadMedian(layer, name, head, float(grid[index, head]), _value(first, head))
            for head in range(summary.num_heads[index])
            if math.isfinite(grid[index, head])
        ]
        everyone += own
        first_layer = baseline.layer_medians.get(layer) if baseline is not None else None
        layers.append(
            LayerMedian(
                layer=layer,
                name=name,
                median=float(pooled[index]),
                first=first_layer if first_layer is not None and math.isfinite(first_layer) else None,
                lowest=min(own, key=lambda h: h.median, default=None),
                highest=max(own, key=lambda h: h.median, default=None),
                alerts=tuple(_layer_alerts(findings, layer)),
            )
        )
    claimed = {name for name in findings if _alert_layer(name) in summary.layers}
    changed = [head for head in everyone if head.change is not None]
    drops = [head for head in changed if head.change is not None and head.change < 0]
    return Digest(
        step=int(step),
        first_step=None if baseline is None else baseline.step,
        layers=tuple(layers),
        moved=tuple(sorted(changed, key=lambda h: -abs(h.change or 0.0))[:heads]),
        largest_drop=min(drops, key=lambda h: h.change or 0.0, default=None),
        lowest=tuple(sorted(everyone, key=lambda h: h.median)[:heads]),
        highest=tuple(sorted(everyone, key=lambda h: -h.median)[:heads]),
        alerts=tuple(f"{name}: {value:g}" for name, value in findings.items() if name not in claimed),
    )


def _layer_medians(summary: EntropySummary) -> np.ndarray:
    """(layers,) median of each layer, heads pooled; NaN where no query was counted."""
    medians: np.ndarray = summary.layer_quantile(0.5).numpy().astype(np.float64)
    return medians


def _value(first: np.ndarray | None, head: int) -> float | None:
    if first is None or head >= len(first) or not math.isfinite(float(first[head])):
        return None
    return float(first[head])


def _alert_layer(name: str) -> str | None:
    """The layer an alert's ``{prefix}/{layer}/{what}`` names (layer names hold dots, never slashes)."""
    parts = name.split("/")
    return parts[1] if len(parts) == 3 else None


def _layer_alerts(findings: Mapping[str, float], layer: str) -> list[str]:
    return [f"{name.split('/')[-1]}: {value:g}" for name, value in findings.items() if _alert_layer(name) == layer]


# --------------------------------------------------------------------------- renderings


def _number(value: float | None, signed: bool = False) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    value = round(value, 2) + 0.0  # no "-0.00"
    return f"{value:+.2f}" if signed else f"{value:.2f}"


def _head_table(title: str, heads: tuple[HeadMedian, ...], first_step: int | None) -> list[str]:
    if not heads:
        return []
    first = f"step {first_step}" if first_step is not None else "first"
    lines = [f"**{title}**", "", f"| layer | head | median | {first} | change |", "|---|---|---|---|---|"]
    lines += [
        f"| {h.name} | {h.head} | {_number(h.median)} | {_number(h.first)} | {_number(h.change, True)} |" for h in heads
    ]
    return [*lines, ""]


def digest_markdown(digest: Digest) -> str:
    """``digest`` as Markdown for TensorBoard's text plugin: the headline, the named heads, then every layer.

    The heads come before the layer table, so the part a text card shows
    without scrolling answers "which head".

    Example:
        >>> digest = Digest(step=5, first_step=None, layers=(), moved=(), largest_drop=None, lowest=(), highest=())
        >>> print(digest_markdown(digest))
        **Step 5**: no head had a counted query
    """
    since = "" if digest.first_step is None else f" (changes since step {digest.first_step})"
    lines = [f"**Step {digest.step}**: {digest.headline}"]
    if digest.alerts:
        lines += ["", "Alerts: " + "; ".join(digest.alerts)]
    lines += ["", *_head_table("Heads that moved most", digest.moved, digest.first_step)]
    lines += _head_table("Lowest heads", digest.lowest, digest.first_step)
    lines += _head_table("Highest heads", digest.highest, digest.first_step)
    if digest.layers:
        lines += [f"**Layers**{since}", "", "| layer | median | change | lowest head | highest head | alerts |"]
        lines.append("|---|---|---|---|---|---|")
        for layer in digest.layers:
            low, high = (
                "—" if head is None else f"{head.head} ({head.median:.2f})" for head in (layer.lowest, layer.highest)
            )
            lines.append(
                f"| {layer.name} | {_number(layer.median)} | {_number(layer.change, True)} | {low} | {high} | "
                f"{', '.join(layer.alerts)} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def _cell(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def digest_rows(digest: Digest) -> list[list[Any]]:
    """``digest`` as rows of :data:`COLUMNS`: one per layer, then one per named head.

    ``kind`` is ``layer``, ``largest_drop`` (at most one row), ``moved``,
    ``lowest`` or ``highest``; ``head`` is None on layer rows; numbers the
    digest does not have are None.
    """
    rows: list[list[Any]] = [
        [
            digest.step,
            "layer",
            layer.name,
            layer.layer,
            None,
            _cell(layer.median),
            _cell(layer.first),
            _cell(layer.change),
            ", ".join(layer.alerts),
        ]
        for layer in digest.layers
    ]
    drop = () if digest.largest_drop is None else (digest.largest_drop,)
    named = (("largest_drop", drop), ("moved", digest.moved), ("lowest", digest.lowest), ("highest", digest.highest))
    for kind, heads in named:
        rows += [
            [digest.step, kind, h.name, h.layer, h.head, _cell(h.median), _cell(h.first), _cell(h.change), ""]
            for h in heads
        ]
    return rows


def digest_table(digest: Digest) -> Any:
    """``digest`` as a ``wandb.Table`` of :data:`COLUMNS` (:func:`digest_rows`).

    Raises:
        ModuleNotFoundError: wandb is not installed.
    """
    try:
        import wandb
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("The W&B digest needs wandb: pip install 'attn-monitor[wandb]'.") from error
    return wandb.Table(columns=list(COLUMNS), data=digest_rows(digest))
