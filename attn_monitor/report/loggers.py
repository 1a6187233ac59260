"""Sinks: scalars everywhere, charts, histograms and pictures where they can be shown.

Scalar names follow one rule (:func:`~attn_monitor.shared.names.head_name`): per-layer statistics stay
in their family's group (``attn_entropy/{layer}/q50``), per-head values move
to ``{family}_heads/{layer}/head_{h}/{stat}``, so the main group stays short
however many heads a model has. A summary leaves the monitor by one route,
:meth:`Dashboards.log`, to plain sinks (:func:`sink_kind`), whatever the
training loop; a loop that logs some names itself (Lightning's
``LightningModule.log``) says which, and they are left out here:

* TensorBoard (a ``SummaryWriter``), as one event per step: the scalars, the
  digest (text), one histogram per layer (raw, from the metric's own bins),
  the heatmap image; a Custom Scalars layout with entropy beside the loop's
  own loss, then one margin chart per layer (the median with its quantile
  band); per layer, the heads-over-training picture (drawn on a thread of
  its own, see :class:`_Drawer`);
* Weights & Biases (a :class:`WandbSink` or a run), as one ``log`` call per
  step: the scalars, the digest (a table), ``wandb.Histogram(np_histogram=...)``
  per layer, the heatmap image, per layer the heads-over-training picture and
  one line chart with a line per head and a legend (``wandb.plot.line_series``);
  alerts also go to ``run.alert``;
* anything with ``log_metrics(metrics, step)``: the scalars and one warning.

The pictures themselves are drawn in :mod:`attn_monitor.report.figures`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attn_monitor.functional.entropy import coarsen
from attn_monitor.metrics.entropy import EntropySummary, quantile_name
from attn_monitor.report.digest import Baseline, Digest, digest_markdown, digest_table, validation_digest
from attn_monitor.report.display import short_names
from attn_monitor.report.figures import Picture, heatmap_picture, history_picture, median_grid, png_bytes
from attn_monitor.shared.checks import WarnOnce, check_int

__all__ = [
    "WANDB_MAX_BINS",
    "Dashboards",
    "LogOptions",
    "WandbSink",
    "loss_names",
    "per_layer",
    "send_alert",
    "sink_kind",
    "summary_scalars",
    "tensorboard_layout",
]

#: W&B keeps at most this many histogram bins and silently drops the rest.
WANDB_MAX_BINS = 512

#: ``{family}_heads/{layer}/head_{h}/{stat}{suffix}``, as :func:`~attn_monitor.shared.names.head_name` writes it.
_GROUPED = re.compile(r"^(?P<family>[^/]+)_heads/(?P<layer>.+)/head_(?P<head>\d+)/(?P<stat>[^/]+)(?P<suffix>/.*)?$")


def per_layer(name: str) -> bool:
    """Whether ``name`` is an overall or per-layer statistic, not a per-head one: it reaches ``callback_metrics``.

    Example:
        >>> per_layer("attn_entropy/h.0/q50"), per_layer("attn_entropy_heads/h.0/head_1/q50")
        (True, False)
    """
    return not name.split("/", 1)[0].endswith("_heads")


def summary_scalars(
    summary: EntropySummary,
    *,
    prefix: str = "attn_entropy",
    quantiles: Sequence[float] = (0.05, 0.25, 0.5, 0.75, 0.95),
    per_head: bool = True,
    extra_scalars: Mapping[str, float] | None = None,
    suffix: str = "",
) -> dict[str, float]:
    """The scalar names and values logged for ``summary`` (the naming table in the README).

    :meth:`EntropySummary.to_dict` and ``extra_scalars`` (per-head values named by
    :func:`~attn_monitor.shared.names.head_name`), ``suffix`` appended to every name.

    Example:
        >>> import math, torch
        >>> from attn_monitor import AttentionEntropy
        >>> metric = AttentionEntropy(num_bins=100)
        >>> metric.update("blocks.0.attn", torch.full((1, 2, 4), 0.5 * math.log(8.0)), torch.tensor(8))
        >>> names = sorted(summary_scalars(metric.compute(), quantiles=(0.5,)))
        >>> [name for name in names if "head_" in name]  # doctest: +NORMALIZE_WHITESPACE
        ['attn_entropy_heads/blocks.0.attn/head_0/mean', 'attn_entropy_heads/blocks.0.attn/head_0/q50',
         'attn_entropy_heads/blocks.0.attn/head_1/mean', 'attn_entropy_heads/blocks.0.attn/head_1/q50']
        >>> [name for name in names if "head_" not in name]  # doctest: +NORMALIZE_WHITESPACE
        ['attn_entropy/blocks.0.attn/mean', 'attn_entropy/blocks.0.attn/mean_seq',
         'attn_entropy/blocks.0.attn/nats_mean', 'attn_entropy/blocks.0.attn/q50', 'attn_entropy/mean']
    """
    scalars = summary.to_dict(prefix, quantiles=quantiles, per_head=per_head)
    scalars.update(extra_scalars or {})
    return {name + suffix: value for name, value in scalars.items()}


def _tensorboard_histograms(summary: EntropySummary, prefix: str, bins: int, suffix: str) -> list[Any]:
    """One raw histogram value per layer with counted queries, from the metric's own bins."""
    from torch.utils.tensorboard.summary import histogram_raw

    edges = np.linspace(0.0, 1.0, bins + 1)
    sums, sums_sq = summary.stats("sum").sum(-1).tolist(), summary.stats("sum_sq").sum(-1).tolist()
    values = []
    for index, layer in enumerate(summary.layers):
        counts = coarsen(summary.histogram[index].sum(0), bins).numpy()
        total = float(counts.sum())
        if total == 0:
            continue
        nonzero = np.flatnonzero(counts)
        proto = histogram_raw(
            f"{prefix}/{layer}/hist{suffix}",
            min=float(edges[nonzero[0]]),
            max=float(edges[nonzero[-1] + 1]),
            num=int(total),
            sum=sums[index],
            sum_squares=sums_sq[index],
            bucket_limits=edges[1:].tolist(),
            bucket_counts=counts.tolist(),
        )
        values.extend(proto.value)
    return values


def _tensorboard_scalars(scalars: Mapping[str, float]) -> list[Any]:
    from tensorboard.compat.proto.summary_pb2 import Summary

    return [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]


def _tensorboard_text(tag: str, markdown: str) -> list[Any]:
    from torch.utils.tensorboard.summary import text

    return list(text(tag, markdown).value)


def _tensorboard_image(tag: str, picture: Picture) -> Any:
    from tensorboard.compat.proto.summary_pb2 import Summary

    height, width, _ = picture.pixels.shape
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png_bytes(picture))
    return Summary.Value(tag=tag, image=image)


def _tensorboard_write(writer: Any, values: list[Any], step: int) -> None:
    """Write ``values`` as one event: per-value ``add_scalar`` costs ~0.1 ms each (0.2 s at 32 x 32 heads)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    if values:
        # The writer's own add_* methods go through the same call, which reopens a writer the logger closed.
        writer._get_file_writer().add_summary(Summary(value=values), step)


def _wandb_histograms(summary: EntropySummary, prefix: str, bins: int, suffix: str) -> dict[str, Any]:
    import wandb

    edges = np.linspace(0.0, 1.0, bins + 1)
    out = {}
    for index, layer in enumerate(summary.layers):
        counts = coarsen(summary.histogram[index].sum(0), bins).numpy()
        if counts.sum() > 0:
            out[f"{prefix}/{layer}/hist{suffix}"] = wandb.Histogram(np_histogram=(counts, edges))
    return out


@dataclass(frozen=True)
class WandbSink:
    """A W&B run as a sink: scalars, histograms, pictures and charts through ``log``; alerts through ``run.alert``.

    Args:
        run: the ``wandb`` run (``wandb.init()``, a logger's ``experiment``).
        log: ``log(values, step)`` writing ``values`` at ``step`` on the run's step axis
            (default: ``run.log(values, step=step)``); a training loop that keeps its own
            step metric passes its own (the Lightning monitor passes ``WandbLogger.log_metrics``).
    """

    run: Any
    log: Callable[[dict[str, Any], int], None] | None = None

    def write(self, values: dict[str, Any], step: int) -> None:
        """Log ``values`` at ``step``."""
        if self.log is None:
            self.run.log(values, step=step)
        else:
            self.log(values, step)


def _wandb(sink: Any) -> WandbSink:
    return sink if isinstance(sink, WandbSink) else WandbSink(sink)


def sink_kind(sink: Any) -> str:
    """What a sink can show: ``"tensorboard"``, ``"wandb"`` or ``"scalars"``.

    * a ``torch.utils.tensorboard.SummaryWriter``: everything, as events;
    * a :class:`WandbSink` or a ``wandb`` run: everything, and alerts;
    * any object with ``log_metrics(metrics, step=...)`` (a CSV logger, a
      training loop's own logger): scalars only.

    Raises:
        TypeError: none of these.
    """
    writer = sys.modules.get("torch.utils.tensorboard.writer")  # a writer exists only once its module is loaded
    if writer is not None and isinstance(sink, writer.SummaryWriter):
        return "tensorboard"
    run = sys.modules.get("wandb.sdk.wandb_run")
    if isinstance(sink, WandbSink) or (run is not None and isinstance(sink, run.Run)):
        return "wandb"
    if callable(getattr(sink, "log_metrics", None)):
        return "scalars"
    raise TypeError(
        "Expected each sink to be a SummaryWriter, a WandbSink, a wandb run or an object with "
        f"`log_metrics(metrics, step)`, got {type(sink).__name__}."
    )


#: Loggers told once per process that they get scalars only.
_SCALARS_ONLY = WarnOnce()


def _band(quantiles: Sequence[float]) -> tuple[str, str] | None:
    """The quantile pair drawn as the band around the median: q25-q75, else q05-q95."""
    names = {quantile_name(q) for q in quantiles}
    for pair in (("q25", "q75"), ("q05", "q95")):
        if set(pair) <= names:
            return pair
    return None


def tensorboard_layout(
    names: Iterable[str], *, prefix: str = "attn_entropy", quantiles: Sequence[float] = (0.25, 0.5, 0.75)
) -> dict[str, dict[str, list[Any]]]:
    """TensorBoard Custom Scalars layout for the logged ``names``: entropy beside the loss, then one chart per layer.

    Categories, in order, for each dataloader suffix found in ``names``:

    * ``{prefix}``: the mean over all layers, and beside it the training
      loop's own losses among ``names`` (:func:`loss_names`), so the first
      chart answers "did entropy move when the loss did";
    * ``{prefix} · {layer}`` for each layer (in natural order: ``h.2`` before
      ``h.10``): a margin chart of its median with the q25-q75 band (q05-q95
      when q25/q75 are not logged) and, with per-head values, a multi-line
      chart of its heads' medians.

    No chart puts several layers' lines together: Custom Scalars colours lines
    by run, not by tag, so twelve layers would be twelve lines of one colour
    with no legend. Layers are compared in the heatmap (a row per layer, the
    lowest and highest head named) and in the digest's table.
    * ``{family}_heads`` for every other family with per-head values: per
      layer, a multi-line chart of its heads (``q50`` where logged, else the
      first statistic).

    Returns:
        ``{category: {chart title: ["Margin" | "Multiline", tags]}}`` for
        ``SummaryWriter.add_custom_scalars`` (multi-line tags are regular
        expressions).

    Example:
        >>> layout = tensorboard_layout(
        ...     [
        ...         "attn_entropy/mean",
        ...         "attn_entropy/h.0/q50",
        ...         "attn_entropy/h.0/q25",
        ...         "attn_entropy/h.0/q75",
        ...         "attn_entropy_heads/h.0/head_0/q50",
        ...         "val/loss",
        ...     ]
        ... )
        >>> list(layout)
        ['attn_entropy', 'attn_entropy · h.0']
        >>> layout["attn_entropy"]  # doctest: +NORMALIZE_WHITESPACE
        {'entropy · mean of all layers': ['Multiline', ['^attn_entropy/mean$']],
         'loss': ['Multiline', ['^val/loss$']]}
        >>> layout["attn_entropy · h.0"]["layer h.0 · median, q25-q75 band"]
        ['Margin', ['attn_entropy/h.0/q50', 'attn_entropy/h.0/q25', 'attn_entropy/h.0/q75']]
        >>> kind, (pattern,) = layout["attn_entropy · h.0"]["layer h.0 · median of each head"]
        >>> print(kind, pattern)
        Multiline ^attn_entropy_heads/h\\.0/head_\\d+/q50$
    """
    names = set(names)
    heads = _per_head_statistics(names)
    overall = re.compile(f"^{re.escape(prefix)}/mean(?P<suffix>/dataloader_idx_\\d+)?$")
    suffixes = sorted(
        {suffix for family, suffix in heads if family == prefix}
        | {match["suffix"] or "" for match in map(overall.match, names) if match is not None}
    )
    layout: dict[str, dict[str, list[Any]]] = {}
    losses = loss_names(names, prefix)
    for suffix in suffixes:
        layout.update(_entropy_layout(names, heads.get((prefix, suffix), {}), prefix, suffix, _band(quantiles), losses))
    for (family, suffix), per_layer in sorted(heads.items()):
        if family != prefix:
            charts = dict(
                _heads_chart(family, layer, per_layer[layer], suffix) for layer in sorted(per_layer, key=_natural)
            )
            layout[f"{family}_heads{suffix}"] = charts
    return layout


def _per_head_statistics(names: Iterable[str]) -> dict[tuple[str, str], dict[str, set[str]]]:
    """(family, suffix) -> layer -> the statistics logged per head, read from the grouped names."""
    heads: dict[tuple[str, str], dict[str, set[str]]] = {}
    for name in sorted(names):
        match = _GROUPED.match(name)
        if match is not None:
            key = (match["family"], match["suffix"] or "")
            heads.setdefault(key, {}).setdefault(match["layer"], set()).add(match["stat"])
    return heads


def _entropy_layout(
    names: set[str],
    heads: Mapping[str, set[str]],
    prefix: str,
    suffix: str,
    band: tuple[str, str] | None,
    losses: Sequence[str],
) -> dict[str, dict[str, list[Any]]]:
    """The entropy categories of one dataloader suffix: the overall mean and the losses, then per layer."""
    first: dict[str, list[Any]] = {
        "entropy · mean of all layers": ["Multiline", [f"^{re.escape(f'{prefix}/mean{suffix}')}$"]]
    }
    if losses:
        first["loss"] = ["Multiline", [f"^{re.escape(name)}$" for name in losses]]
    layout = {prefix + suffix: first}
    layers = {
        name[len(prefix) + 1 : -len(f"/q50{suffix}")]
        for name in names
        if name.startswith(prefix + "/") and name.endswith(f"/q50{suffix}")
    }
    ordered = sorted(layers, key=_natural)
    for layer, name in zip(ordered, short_names(ordered), strict=True):
        charts: dict[str, list[Any]] = {}
        if band is not None:
            tags = [f"{prefix}/{layer}/{q}{suffix}" for q in ("q50", *band)]
            if all(tag in names for tag in tags):
                charts[f"layer {name} · median, {band[0]}-{band[1]} band"] = ["Margin", tags]
        if heads.get(layer):
            title, chart = _heads_chart(prefix, layer, heads[layer], suffix, median="median", name=name)
            charts[title] = chart
        layout[f"{prefix}{suffix} · {layer}"] = charts
    return layout


def _heads_chart(
    family: str, layer: str, stats: set[str], suffix: str, median: str = "q50", name: str | None = None
) -> tuple[str, list[Any]]:
    """The multi-line chart of one layer's heads: ``q50`` (titled ``median``) where logged, else the first statistic.

    ``name`` is the layer as the title shows it (default: its full name).
    """
    stat = "q50" if "q50" in stats else sorted(stats)[0]
    pattern = f"^{re.escape(family)}_heads/{re.escape(layer)}/head_\\d+/{stat}{re.escape(suffix)}$"
    title = layer if name is None else f"layer {name}"
    return f"{title} · {median if stat == 'q50' else stat} of each head", ["Multiline", [pattern]]


def _natural(name: str) -> list[Any]:
    """Sort key that puts ``h.2`` before ``h.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def send_alert(sinks: Iterable[Any], title: str, text: str) -> None:
    """Send ``text`` as a W&B alert (``run.alert``, level WARN) to every W&B run among ``sinks``."""
    for sink in sinks:
        if sink_kind(sink) == "wandb":
            _wandb(sink).run.alert(title=title, text=text, level="WARN")


def warn_scalars_only(sinks: Iterable[Any], pictures: bool) -> None:
    """Tell each scalar-only sink kind, once, that it gets scalars only (when there are pictures to miss)."""
    if not pictures:
        return
    for sink in sinks:
        if sink_kind(sink) == "scalars":
            name = type(sink).__name__
            _SCALARS_ONLY(
                name,
                f"attn_monitor: {name} gets the entropy scalars only; histograms, charts and pictures are written "
                "to TensorBoard and W&B loggers.",
            )


@dataclass(frozen=True)
class LogOptions:
    """What the monitor logs of each summary, checked at construction.

    Args:
        prefix: first component of every entropy name; two monitors in one
            run need different prefixes.
        quantiles: quantile levels logged per layer, each in [0, 1].
        per_head: log per-head values as scalars (under ``{family}_heads/``); off by
            default, as each head is in the pictures and the digest (a 12 x 12 model
            logs 97 entropy scalars without them, 385 with them).
        histogram_bins: bins of the logged histograms (None: no histograms);
            at most 512 with a W&B sink.
        heatmap: log, at every monitored validation, the layer x head median heatmap
            and, per layer, the heads-over-training picture (TensorBoard and W&B).

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
    per_head: bool = False
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

    @property
    def pictures(self) -> bool:
        """Whether anything beyond scalars is drawn."""
        return bool(self.histogram_bins) or self.heatmap

    def check(self, sinks: Iterable[Any]) -> None:
        """Refuse a sink that is none of the kinds, or more histogram bins than a W&B sink keeps.

        Raises:
            TypeError: a sink of no known kind (see :func:`sink_kind`).
            ValueError: ``histogram_bins`` > :data:`WANDB_MAX_BINS` with a W&B sink.
        """
        kinds = [sink_kind(sink) for sink in sinks]
        too_many = bool(self.histogram_bins) and self.histogram_bins > WANDB_MAX_BINS  # type: ignore[operator]
        if too_many and "wandb" in kinds:
            raise ValueError(
                f"`histogram_bins`={self.histogram_bins} but W&B keeps at most {WANDB_MAX_BINS} bins "
                "and silently drops the rest; pass histogram_bins <= 512."
            )

    def scalars(
        self,
        summary: EntropySummary,
        *,
        prefix: str | None = None,
        extra_scalars: Mapping[str, float] | None = None,
        suffix: str = "",
    ) -> dict[str, float]:
        """:func:`summary_scalars` with these options (``prefix`` overrides :attr:`prefix`)."""
        return summary_scalars(
            summary,
            prefix=self.prefix if prefix is None else prefix,
            quantiles=self.quantiles,
            per_head=self.per_head,
            extra_scalars=extra_scalars,
            suffix=suffix,
        )


class Dashboards:
    """The one route from a summary to the sinks: scalars, digest, histograms, pictures, layouts, with their history.

    One object per monitor (and prefix): it remembers each head's median at
    every monitored validation, for the heads-over-training views, the first
    validation's medians, which the digest measures changes from, and which
    Custom Scalars layout each TensorBoard writer holds. Write at the step
    the training loop logs its own values at, so every view of one validation
    lines up.

    Args:
        options: what to log (prefix, quantiles, per-head values, histogram bins, heatmap).
    """

    def __init__(self, options: LogOptions | None = None) -> None:
        self.options = LogOptions() if options is None else options
        #: (prefix, suffix) -> steps and, per step, layer -> (heads,) medians.
        self.history: dict[tuple[str, str], list[tuple[int, dict[str, np.ndarray]]]] = {}
        #: (prefix, suffix) -> the first remembered validation: where the digest's changes start.
        self.baselines: dict[tuple[str, str], Baseline] = {}
        self._layouts: dict[int, dict[str, dict[str, list[Any]]]] = {}
        #: Scalar names each writer's layout already covers.
        self._laid_out: dict[int, set[str]] = {}
        self._drawer = _Drawer()

    def log(
        self,
        sinks: Iterable[Any],
        summary: EntropySummary,
        step: int,
        *,
        prefix: str | None = None,
        extra_scalars: Mapping[str, float] | None = None,
        alerts: Mapping[str, float] | None = None,
        suffix: str = "",
        logged_elsewhere: Callable[[str], bool] | None = None,
        loop_names: Iterable[str] = (),
        remember: bool = True,
    ) -> dict[str, float]:
        """Write ``summary`` to every sink at ``step``; returns every scalar it names (the naming table).

        TensorBoard gets scalars, the digest (text), histograms, the heatmap,
        each layer's heads-over-training picture and the Custom Scalars layout
        as one event (one write however many values); W&B one ``log`` call
        with the digest as a table and a line chart of each layer's heads;
        scalar sinks the scalars only, and one warning.

        Args:
            sinks: where to write (see :func:`sink_kind`).
            summary: what to show.
            step: the step to log at.
            prefix: first component of every name (default: the options' prefix).
            extra_scalars: further scalars of the same step (mass diagnostics, alerts).
            alerts: what the alerts returned at this step (also among ``extra_scalars``), for the digest.
            suffix: appended to every name (``"/dataloader_idx_1"``).
            logged_elsewhere: names the training loop logs itself (left out here).
            loop_names: names the training loop logs of its own; its losses get a chart
                beside entropy's (:func:`loss_names`).
            remember: add the medians to the history, and write the digest and the
                heads-over-training views (not for a sanity check).
        """
        prefix = self.options.prefix if prefix is None else prefix
        names = self.options.scalars(summary, prefix=prefix, extra_scalars=extra_scalars, suffix=suffix)
        scalars = names if logged_elsewhere is None else {k: v for k, v in names.items() if not logged_elsewhere(k)}
        sinks = list(sinks)
        warn_scalars_only(sinks, self.options.pictures)
        grid = median_grid(summary)
        if remember:
            self.remember(summary, step, prefix=prefix, suffix=suffix, grid=grid)
        for sink in sinks:
            if sink_kind(sink) == "scalars" and scalars:
                sink.log_metrics(scalars, step=step)
        sinks = [sink for sink in sinks if sink_kind(sink) != "scalars"]
        if not sinks or not summary.layers:
            return names
        where = (prefix, suffix)
        digest = validation_digest(summary, step, baseline=self.baselines[where], alerts=alerts) if remember else None
        pictures = (
            {f"{prefix}/heatmap{suffix}": heatmap_picture(summary, grid=grid, step=step)}
            if self.options.heatmap
            else {}
        )
        history = self._history_views(summary, where) if remember and self.options.heatmap else []
        wandb_sinks = [_wandb(sink) for sink in sinks if sink_kind(sink) == "wandb"]
        tensorboard = [sink for sink in sinks if sink_kind(sink) == "tensorboard"]
        drawn = _draw_history(history) if wandb_sinks else None  # W&B logs each step in one call: drawn here
        views = _Views(digest, {**pictures, **(drawn or {})})
        for writer in tensorboard:
            self._write_tensorboard(writer, summary, step, scalars, views, where)
            self._write_layout(writer, [*names, *loss_names(loop_names, prefix)], prefix)
        if tensorboard and history and drawn is None:
            self._drawer.submit(_write_pictures, tensorboard, history, step)
        for sink in wandb_sinks:
            self._write_wandb(sink, summary, step, scalars, views, where, charts=remember)
        return names

    def _history_views(self, summary: EntropySummary, where: tuple[str, str]) -> list[_HistoryView]:
        """What each layer's heads-over-training picture shows now (a copy: the history moves on)."""
        prefix, suffix = where
        views = []
        for layer, name in zip(summary.layers, short_names(summary.layers), strict=True):
            steps, medians = self.medians_over_time(layer, prefix=prefix, suffix=suffix)
            views.append(_HistoryView(f"{prefix}_heads/{layer}/over_training{suffix}", name, steps, medians))
        return views

    def wait(self) -> None:
        """Wait until every picture handed to the drawing thread is written (at the end of a run)."""
        self._drawer.wait()

    def _write_tensorboard(
        self,
        writer: Any,
        summary: EntropySummary,
        step: int,
        scalars: Mapping[str, float],
        views: _Views,
        where: tuple[str, str],
    ) -> None:
        """One event of scalars, the digest, histograms and pictures (``where``: prefix, suffix)."""
        prefix, suffix = where
        values = _tensorboard_scalars(scalars)
        if views.digest is not None:
            values += _tensorboard_text(f"{prefix}/digest{suffix}", digest_markdown(views.digest))
        if self.options.histogram_bins:
            values += _tensorboard_histograms(summary, prefix, self.options.histogram_bins, suffix)
        values += [_tensorboard_image(tag, picture) for tag, picture in views.pictures.items()]
        _tensorboard_write(writer, values, step)

    def _write_wandb(
        self,
        sink: WandbSink,
        summary: EntropySummary,
        step: int,
        scalars: Mapping[str, float],
        views: _Views,
        where: tuple[str, str],
        *,
        charts: bool,
    ) -> None:
        """One ``log`` call of scalars, the digest, histograms, pictures and (``charts``) each layer's heads."""
        import wandb

        prefix, suffix = where
        payload: dict[str, Any] = dict(scalars)
        if views.digest is not None:
            payload[f"{prefix}/digest{suffix}"] = digest_table(views.digest)
        if self.options.histogram_bins:
            payload.update(_wandb_histograms(summary, prefix, self.options.histogram_bins, suffix))
        payload.update({tag: wandb.Image(picture.pixels) for tag, picture in views.pictures.items()})
        for layer, name in zip(summary.layers, short_names(summary.layers), strict=True) if charts else ():
            payload[f"{prefix}_heads/{layer}/chart{suffix}"] = self._wandb_chart(layer, name, prefix, suffix)
        sink.write(payload, step)

    def remember(
        self, summary: EntropySummary, step: int, *, prefix: str, suffix: str = "", grid: np.ndarray | None = None
    ) -> np.ndarray:
        """Add ``summary``'s per-head medians at ``step`` to the history (a repeated step replaces its entry).

        The first remembered summary of a (prefix, suffix) is also the digest's :class:`Baseline`.

        Returns:
            The (layers, heads) medians (:func:`~attn_monitor.report.figures.median_grid`, or ``grid`` when given).
        """
        grid = median_grid(summary) if grid is None else grid
        entry = {layer: grid[index, : summary.num_heads[index]] for index, layer in enumerate(summary.layers)}
        history = self.history.setdefault((prefix, suffix), [])
        if history and history[-1][0] == step:
            history.pop()
        history.append((step, entry))
        if (prefix, suffix) not in self.baselines or self.baselines[prefix, suffix].step == step:
            self.baselines[prefix, suffix] = Baseline.of(summary, step)
        return grid

    def state_dict(self) -> dict[str, Any]:
        """The history and the digest's baselines: a resumed run shows what an uninterrupted one would.

        Lists, strings, ints, floats and tensors only, so ``torch.load(..., weights_only=True)`` reads it.
        """
        history = [
            [prefix, suffix, step, {layer: torch.tensor(medians) for layer, medians in entry.items()}]
            for (prefix, suffix), entries in self.history.items()
            for step, entry in entries
        ]
        baselines = [
            [prefix, suffix, first.step, {layer: torch.tensor(m) for layer, m in first.head_medians.items()},
             dict(first.layer_medians)]
            for (prefix, suffix), first in self.baselines.items()
        ]  # fmt: skip
        return {"history": history, "digest_baselines": baselines}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the history and the baselines with a checkpoint's (see :meth:`state_dict`)."""
        self.history, self.baselines = {}, {}
        for prefix, suffix, step, entry in state.get("history", []):
            medians = {layer: np.asarray(values, dtype=np.float64) for layer, values in entry.items()}
            self.history.setdefault((prefix, suffix), []).append((int(step), medians))
        for prefix, suffix, step, heads, layers in state.get("digest_baselines", []):
            medians = {layer: np.asarray(values, dtype=np.float64) for layer, values in heads.items()}
            self.baselines[prefix, suffix] = Baseline(int(step), medians, {k: float(v) for k, v in layers.items()})

    def reset(self) -> None:
        """Forget the history, the baselines and the layouts written: a new run starts from zero."""
        self.history = {}
        self.baselines = {}
        self._layouts = {}
        self._laid_out = {}

    def medians_over_time(self, layer: str, *, prefix: str, suffix: str = "") -> tuple[list[int], np.ndarray]:
        """Steps and the (heads, steps) medians of ``layer`` (NaN where it was not seen)."""
        history = [(step, entry) for step, entry in self.history.get((prefix, suffix), []) if layer in entry]
        steps = [step for step, _ in history]
        heads = max((len(entry[layer]) for _, entry in history), default=0)
        medians = np.full((heads, len(history)), np.nan)
        for column, (_, entry) in enumerate(history):
            medians[: len(entry[layer]), column] = entry[layer]
        return steps, medians

    def _write_layout(self, writer: Any, names: list[str], prefix: str) -> None:
        laid_out = self._laid_out.setdefault(id(writer), set())
        if laid_out.issuperset(names):  # every chart is there already (12 ms a validation at 32 x 32 heads)
            return
        laid_out.update(names)
        known = self._layouts.setdefault(id(writer), {})
        layout = tensorboard_layout(sorted(laid_out), prefix=prefix, quantiles=self.options.quantiles)
        merged = {**known, **layout}
        if merged != known:
            self._layouts[id(writer)] = merged
            writer.add_custom_scalars(merged)

    def _wandb_chart(self, layer: str, name: str, prefix: str, suffix: str) -> Any:
        import wandb

        steps, medians = self.medians_over_time(layer, prefix=prefix, suffix=suffix)
        return wandb.plot.line_series(
            xs=steps,
            ys=[[None if np.isnan(v) else float(v) for v in row] for row in medians],
            keys=[f"head {h}" for h in range(len(medians))],
            title=f"{name}{suffix}: median entropy of each head",
            xname="trainer/global_step",
        )


@dataclass(frozen=True)
class _HistoryView:
    """One layer's heads-over-training picture to draw: its tag, display name, steps and (heads, steps) medians."""

    tag: str
    name: str
    steps: list[int]
    medians: np.ndarray


def _draw_history(views: Iterable[_HistoryView]) -> dict[str, Picture]:
    """Each layer's heads-over-training picture, by tag."""
    return {view.tag: history_picture(view.name, view.steps, view.medians) for view in views}


def _write_pictures(writers: list[Any], views: list[_HistoryView], step: int) -> None:
    """Draw the heads-over-training pictures and write them to each TensorBoard writer as one event."""
    values = [_tensorboard_image(tag, picture) for tag, picture in _draw_history(views).items()]
    for writer in writers:
        _tensorboard_write(writer, values, step)


class _Drawer:
    """One thread that draws and writes TensorBoard's heads-over-training pictures, in order, off the loop's path.

    Drawing a picture per layer at every validation costs about 2.5 ms a layer
    (80 ms at 32 layers); TensorBoard's own writer already serialises and
    writes its events in a thread of its own, and this one hands it the
    pictures the same way. A failure warns once and never reaches training.
    """

    def __init__(self) -> None:
        self._pool: Any = None
        self._pending: list[Any] = []
        self._warn = WarnOnce()

    def submit(self, function: Callable[..., None], *args: Any) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attn_monitor-pictures")
        self._pending = [future for future in self._pending if not future.done()]
        self._pending.append(self._pool.submit(self._guarded, function, *args))

    def _guarded(self, function: Callable[..., None], *args: Any) -> None:
        try:
            function(*args)
        except Exception as error:  # a picture is never worth a training run
            self._warn("pictures", f"attn_monitor: writing the heads-over-training pictures failed: {error!r}.")

    def wait(self) -> None:
        for future in self._pending:
            future.result()
        self._pending = []

    def __getstate__(self) -> dict[str, Any]:
        self.wait()  # a copied or pickled monitor (spawned processes) starts with no thread
        return {"_pool": None, "_pending": [], "_warn": self._warn}


@dataclass(frozen=True)
class _Views:
    """What one validation shows beside its scalars: the digest (None: not written) and the pictures by tag."""

    digest: Digest | None
    pictures: Mapping[str, Picture]


def loss_names(names: Iterable[str], prefix: str = "attn_entropy") -> list[str]:
    """The losses among the names a training loop logs itself: its validation losses, else every loss.

    A name is a loss when it holds ``loss`` (any case) and is none of the
    monitor's (``prefix``'s family); a validation loss also holds ``val``.

    Example:
        >>> loss_names(["train_loss", "val/loss", "val_acc", "epoch"])
        ['val/loss']
        >>> loss_names(["loss"])
        ['loss']
    """
    losses = [n for n in names if "loss" in n.lower() and not n.startswith((prefix + "/", prefix + "_"))]
    validation = [n for n in losses if "val" in n.lower()]
    return sorted(validation or losses)
