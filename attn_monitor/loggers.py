"""Logger adapters: scalars everywhere, charts, histograms and pictures where they can be shown.

Scalar names follow one rule (:func:`group_heads`): per-layer statistics stay
in their family's group (``attn_entropy/{layer}/q50``), per-head values move
to ``{family}_heads/{layer}/head_{h}/{stat}``, so the main group stays short
however many heads a model has. Inside Lightning the callback logs the
means with ``LightningModule.log`` (:func:`logged_through_lightning`: they
reach every logger at the step of the module's own validation metrics), puts
every per-layer statistic (:func:`per_layer`) into
``trainer.callback_metrics``, and the other scalars and the rest are written
here by :class:`Dashboards` at that same step:

* TensorBoard, as one event per step: the scalars, one histogram per layer
  (raw, from the metric's own bins), the heatmap image; a Custom Scalars
  layout with one margin chart (the median with its quantile band) and one
  multi-line chart of the heads per layer; when training ends, per layer,
  the heads-over-training picture;
* Weights & Biases, as one ``log`` call per step: the scalars,
  ``wandb.Histogram(np_histogram=...)`` per layer, the heatmap image; when
  training ends, per layer, the heads-over-training picture and one line
  chart with a line per head (``wandb.plot.line_series``); alerts also go
  to ``run.alert``;
* other loggers: the scalars and one warning.

The pictures themselves are drawn in :mod:`attn_monitor.figures`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attn_monitor.figures import Picture, heatmap_picture, history_picture, median_grid, png_bytes
from attn_monitor.functional import coarsen
from attn_monitor.metric import EntropySummary, quantile_name
from attn_monitor.shared import WarnOnce, check_int

__all__ = [
    "WANDB_MAX_BINS",
    "Dashboards",
    "LogOptions",
    "group_heads",
    "head_group",
    "log_summary",
    "logged_through_lightning",
    "logger_kind",
    "per_layer",
    "send_alert",
    "summary_scalars",
    "tensorboard_layout",
]

#: W&B keeps at most this many histogram bins and silently drops the rest.
WANDB_MAX_BINS = 512

#: ``{family}/{layer...}/head_{h}/{stat...}``: a per-head value of a statistic family.
_PER_HEAD = re.compile(r"^(?P<family>[^/]+)/(?P<rest>(?:.+/)?head_\d+/.+)$")
#: ``{family}_heads/{layer}/head_{h}/{stat}{suffix}``, as :func:`head_group` writes it.
_GROUPED = re.compile(r"^(?P<family>[^/]+)_heads/(?P<layer>.+)/head_(?P<head>\d+)/(?P<stat>[^/]+)(?P<suffix>/.*)?$")


@functools.lru_cache(maxsize=1 << 16)  # the same few thousand names at every validation
def head_group(name: str) -> str:
    """The name a scalar is logged under: per-head values go to their family's ``_heads`` group.

    ``{family}/{layer}/head_{h}/{stat}`` becomes
    ``{family}_heads/{layer}/head_{h}/{stat}``, for every family (entropy,
    the mass diagnostics, any statistic with per-head values); names already
    in a ``_heads`` group and names without a ``head_{h}`` component are
    returned unchanged.

    Example:
        >>> head_group("attn_entropy/blocks.0.attn/head_3/q50")
        'attn_entropy_heads/blocks.0.attn/head_3/q50'
        >>> head_group("attn_entropy/blocks.0.attn/q50")
        'attn_entropy/blocks.0.attn/q50'
        >>> head_group("attn_max_logit_heads/blocks.0.attn/head_1/max")
        'attn_max_logit_heads/blocks.0.attn/head_1/max'
    """
    match = _PER_HEAD.match(name)
    if match is None or match["family"].endswith("_heads"):
        return name
    return f"{match['family']}_heads/{match['rest']}"


def group_heads(scalars: Mapping[str, float]) -> dict[str, float]:
    """``scalars`` renamed by :func:`head_group`, in the same order.

    Raises:
        ValueError: two names land on one (a family already logging under a ``_heads`` name twice).
    """
    out: dict[str, float] = {}
    for name, value in scalars.items():
        grouped = head_group(name)
        if grouped in out:
            raise ValueError(f"Two scalars would be logged as {grouped!r}; one of them is {name!r}.")
        out[grouped] = value
    return out


@functools.lru_cache(maxsize=1 << 16)  # the same few thousand names at every validation
def logged_through_lightning(name: str, suffix: str = "") -> bool:
    """Whether the monitor logs ``name`` with ``LightningModule.log``: each family's overall and per-layer means.

    These also reach every logger at the step of the module's own
    validation metrics and ``Trainer.validate``'s results. Lightning's
    ``log`` costs 0.5-0.8 ms per name, more as names pile up (0.4 s for 1000
    names), and a 32-layer, 32-head model logs 2300: every other scalar goes
    to the loggers directly at the same step.

    Example:
        >>> logged_through_lightning("attn_entropy/mean"), logged_through_lightning("attn_sink_mass/h.0/mean")
        (True, True)
        >>> logged_through_lightning("attn_entropy/h.0/q50")
        False
        >>> logged_through_lightning("attn_entropy_heads/h.0/head_1/mean")
        False
        >>> logged_through_lightning("attn_entropy/h.0/mean/dataloader_idx_1", suffix="/dataloader_idx_1")
        True
    """
    return name.removesuffix(suffix).endswith("/mean") and per_layer(name)


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

    :meth:`EntropySummary.to_dict` and ``extra_scalars``, per-head values moved
    by :func:`head_group`, ``suffix`` appended to every name.

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
    return {name + suffix: value for name, value in group_heads(scalars).items()}


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
    """TensorBoard Custom Scalars layout for the logged ``names``: one chart per layer, per-head lines together.

    Categories, in order, for each dataloader suffix found in ``names``:

    * ``{prefix}``: a multi-line chart of every layer's mean;
    * ``{prefix} · {layer}`` for each layer (in natural order: ``h.2`` before
      ``h.10``): a margin chart of its median with the q25-q75 band (q05-q95
      when q25/q75 are not logged) and a multi-line chart of its heads' medians;
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
        ...     ]
        ... )
        >>> list(layout)
        ['attn_entropy', 'attn_entropy · h.0']
        >>> layout["attn_entropy · h.0"]["h.0 · median, q25-q75 band"]
        ['Margin', ['attn_entropy/h.0/q50', 'attn_entropy/h.0/q25', 'attn_entropy/h.0/q75']]
        >>> kind, (pattern,) = layout["attn_entropy · h.0"]["h.0 · median of each head"]
        >>> print(kind, pattern)
        Multiline ^attn_entropy_heads/h\\.0/head_\\d+/q50$
    """
    names = set(names)
    band = _band(quantiles)
    # (family, suffix) -> layer -> statistics logged per head
    heads: dict[tuple[str, str], dict[str, set[str]]] = {}
    for name in sorted(names):
        match = _GROUPED.match(name)
        if match is not None:
            key = (match["family"], match["suffix"] or "")
            heads.setdefault(key, {}).setdefault(match["layer"], set()).add(match["stat"])
    overall = re.compile(f"^{re.escape(prefix)}/mean(?P<suffix>/dataloader_idx_\\d+)?$")
    suffixes = sorted(
        {suffix for family, suffix in heads if family == prefix}
        | {match["suffix"] or "" for match in map(overall.match, names) if match is not None}
    )
    layout: dict[str, dict[str, list[Any]]] = {}
    for suffix in suffixes:
        end = re.escape(suffix) + "$"
        layout[prefix + suffix] = {"all layers · mean": ["Multiline", [f"^{re.escape(prefix)}/[^/]+/mean{end}"]]}
        layers = sorted(
            {
                name[len(prefix) + 1 : -len(f"/q50{suffix}")]
                for name in names
                if name.startswith(prefix + "/") and name.endswith(f"/q50{suffix}")
            },
            key=_natural,
        )
        for layer in layers:
            charts: dict[str, list[Any]] = {}
            if band is not None:
                tags = [f"{prefix}/{layer}/{q}{suffix}" for q in ("q50", *band)]
                if all(tag in names for tag in tags):
                    charts[f"{layer} · median, {band[0]}-{band[1]} band"] = ["Margin", tags]
            stats = heads.get((prefix, suffix), {}).get(layer)
            if stats:
                stat = "q50" if "q50" in stats else sorted(stats)[0]
                label = "median" if stat == "q50" else stat
                pattern = f"^{re.escape(prefix)}_heads/{re.escape(layer)}/head_\\d+/{stat}{end}"
                charts[f"{layer} · {label} of each head"] = ["Multiline", [pattern]]
            layout[f"{prefix}{suffix} · {layer}"] = charts
    for (family, suffix), per_layer in sorted(heads.items()):
        if family == prefix:
            continue
        end = re.escape(suffix) + "$"
        charts = {}
        for layer in sorted(per_layer, key=_natural):
            stats = per_layer[layer]
            stat = "q50" if "q50" in stats else sorted(stats)[0]
            pattern = f"^{re.escape(family)}_heads/{re.escape(layer)}/head_\\d+/{stat}{end}"
            charts[f"{layer} · {stat} of each head"] = ["Multiline", [pattern]]
        layout[f"{family}_heads{suffix}"] = charts
    return layout


def _natural(name: str) -> list[Any]:
    """Sort key that puts ``h.2`` before ``h.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def send_alert(loggers: Iterable[Any], title: str, text: str) -> None:
    """Send ``text`` as a W&B alert (``run.alert``, level WARN) to every attached W&B logger."""
    for logger in loggers:
        if logger_kind(logger) == "wandb":
            logger.experiment.alert(title=title, text=text, level="WARN")


class Dashboards:
    """What Lightning does not log: histograms, pictures, chart layouts, with the history they need.

    One object per monitor (and prefix): it remembers each head's median at
    every monitored validation, for the heads-over-training pictures and the
    W&B per-head charts, and which Custom Scalars layout each TensorBoard
    writer holds. Write at the step Lightning logs the scalars at, so every
    view of one validation lines up.

    Args:
        options: what to draw (histogram bins, heatmap, quantiles).
    """

    def __init__(self, options: LogOptions) -> None:
        self.options = options
        #: (prefix, suffix) -> steps and, per step, layer -> (heads,) medians.
        self.history: dict[tuple[str, str], list[tuple[int, dict[str, np.ndarray]]]] = {}
        self._layouts: dict[int, dict[str, dict[str, list[Any]]]] = {}
        #: Scalar names each writer's layout already covers.
        self._laid_out: dict[int, set[str]] = {}

    def remember(
        self, summary: EntropySummary, step: int, *, prefix: str, suffix: str = "", grid: np.ndarray | None = None
    ) -> np.ndarray:
        """Add ``summary``'s per-head medians at ``step`` to the history (a repeated step replaces its entry).

        Returns:
            The (layers, heads) medians (:func:`~attn_monitor.figures.median_grid`, or ``grid`` when given).
        """
        grid = median_grid(summary) if grid is None else grid
        entry = {layer: grid[index, : summary.num_heads[index]] for index, layer in enumerate(summary.layers)}
        history = self.history.setdefault((prefix, suffix), [])
        if history and history[-1][0] == step:
            history.pop()
        history.append((step, entry))
        return grid

    def state_dict(self) -> dict[str, Any]:
        """The history, for a checkpoint: a resumed run draws what an uninterrupted one would.

        Lists, strings, ints and tensors only, so ``torch.load(..., weights_only=True)`` reads it.
        """
        history = [
            [prefix, suffix, step, {layer: torch.tensor(medians) for layer, medians in entry.items()}]
            for (prefix, suffix), entries in self.history.items()
            for step, entry in entries
        ]
        return {"history": history}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the history with a checkpoint's (see :meth:`state_dict`)."""
        self.history = {}
        for prefix, suffix, step, entry in state.get("history", []):
            medians = {layer: np.asarray(values, dtype=np.float64) for layer, values in entry.items()}
            self.history.setdefault((prefix, suffix), []).append((int(step), medians))

    def reset(self) -> None:
        """Forget the history and the layouts written: a new run starts from zero."""
        self.history = {}
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

    def write(
        self,
        loggers: Iterable[Any],
        summary: EntropySummary,
        step: int,
        *,
        scalars: Mapping[str, float] | None = None,
        scalar_names: Iterable[str] = (),
        prefix: str | None = None,
        suffix: str = "",
    ) -> None:
        """Write ``scalars``, the histograms, the heatmap and the TensorBoard layout of ``summary`` at ``step``.

        TensorBoard gets all of it as one event (one write however many
        values); W&B as one ``log`` call; other loggers the scalars only.

        Args:
            loggers: Lightning loggers (``trainer.loggers``).
            summary: what to show.
            step: the step the scalars of this summary are logged at.
            scalars: scalars to write here (the monitor logs the others through Lightning).
            scalar_names: every scalar name logged with it (for the Custom Scalars layout).
            prefix: first component of every name (default: the options' prefix).
            suffix: appended to every name (``"/dataloader_idx_1"``).
        """
        options = self.options
        prefix = options.prefix if prefix is None else prefix
        scalars = dict(scalars or {})
        grid = self.remember(summary, step, prefix=prefix, suffix=suffix)
        loggers = list(loggers)
        for logger in loggers:
            if logger_kind(logger) == "other" and scalars:
                logger.log_metrics(scalars, step=step)
        loggers = [logger for logger in loggers if logger_kind(logger) != "other"]
        if not loggers or not summary.layers:
            return
        pictures: dict[str, Picture] = {}
        if options.heatmap:
            pictures[f"{prefix}/heatmap{suffix}"] = heatmap_picture(summary, grid=grid)
        names = list(scalar_names)
        for logger in loggers:
            if logger_kind(logger) == "tensorboard":
                writer = logger.experiment
                values = _tensorboard_scalars(scalars)
                if options.histogram_bins:
                    values += _tensorboard_histograms(summary, prefix, options.histogram_bins, suffix)
                values += [_tensorboard_image(tag, picture) for tag, picture in pictures.items()]
                _tensorboard_write(writer, values, step)
                self._write_layout(writer, names, prefix)
            else:
                payload: dict[str, Any] = dict(scalars)
                if options.histogram_bins:
                    payload.update(_wandb_histograms(summary, prefix, options.histogram_bins, suffix))
                import wandb

                for tag, picture in pictures.items():
                    payload[tag] = wandb.Image(picture.pixels)
                logger.log_metrics(payload, step=step)

    def write_history(self, loggers: Iterable[Any]) -> None:
        """Write, per layer, the views of its heads over every remembered step, at the last one.

        TensorBoard gets the heads-over-training picture, W&B the picture
        and a line chart with a line per head. Each holds the whole history,
        so it is written once, when training ends, rather than redrawn at
        every validation (a second per validation at 32 layers); the heatmap,
        the histograms and the per-head scalars show each validation as it
        comes.
        """
        loggers = [logger for logger in loggers if logger_kind(logger) != "other"]
        for (prefix, suffix), history in self.history.items():
            if not loggers or not history:
                continue
            step = history[-1][0]
            layers = list(dict.fromkeys(layer for _, entry in history for layer in entry))
            pictures = {}
            if self.options.heatmap:
                for layer in layers:
                    steps, medians = self.medians_over_time(layer, prefix=prefix, suffix=suffix)
                    pictures[f"{prefix}_heads/{layer}/over_training{suffix}"] = history_picture(layer, steps, medians)
            for logger in loggers:
                if logger_kind(logger) == "tensorboard":
                    values = [_tensorboard_image(tag, picture) for tag, picture in pictures.items()]
                    _tensorboard_write(logger.experiment, values, step)
                    continue
                import wandb

                payload = {tag: wandb.Image(picture.pixels) for tag, picture in pictures.items()}
                for layer in layers:
                    payload[f"{prefix}_heads/{layer}/chart{suffix}"] = self._wandb_chart(layer, prefix, suffix)
                logger.log_metrics(payload, step=step)

    def _write_layout(self, writer: Any, names: list[str], prefix: str) -> None:
        laid_out = self._laid_out.setdefault(id(writer), set())
        if laid_out.issuperset(names):  # every chart is there already (12 ms a validation at 32 x 32 heads)
            return
        laid_out.update(names)
        known = self._layouts.setdefault(id(writer), {})
        layout = tensorboard_layout(names, prefix=prefix, quantiles=self.options.quantiles)
        merged = {**known, **layout}
        if merged != known:
            self._layouts[id(writer)] = merged
            writer.add_custom_scalars(merged)

    def _wandb_chart(self, layer: str, prefix: str, suffix: str) -> Any:
        import wandb

        steps, medians = self.medians_over_time(layer, prefix=prefix, suffix=suffix)
        return wandb.plot.line_series(
            xs=steps,
            ys=[[None if np.isnan(v) else float(v) for v in row] for row in medians],
            keys=[f"head {h}" for h in range(len(medians))],
            title=f"{layer}{suffix}: median normalised entropy of each head",
            xname="trainer/global_step",
        )


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
    dashboards: Dashboards | None = None,
) -> dict[str, float]:
    """Write ``summary`` to every logger, scalars included; returns the scalars written.

    For use outside a Lightning validation (the monitor logs its validation
    scalars through ``LightningModule.log`` instead).

    Args:
        loggers: Lightning loggers (``trainer.loggers``).
        summary: what to log.
        step: the step to log at.
        prefix: first component of every name.
        quantiles: quantile levels logged per layer.
        per_head: also log per-head mean and median (under ``{prefix}_heads/``).
        histogram_bins: bins of the logged histograms (None: no histograms);
            must divide the metric's bins.
        heatmap: log the layer x head median heatmap and the heads-over-training pictures.
        extra_scalars: further scalars to log with the same step.
        suffix: appended to every name, histograms and pictures included
            (``"/dataloader_idx_1"`` keeps validation dataloaders apart, as
            Lightning's ``self.log`` does).
        dashboards: keeps the history across calls for the W&B per-head charts
            and :meth:`Dashboards.write_history` (default: a new one, no history).
    """
    loggers = list(loggers)
    scalars = summary_scalars(
        summary, prefix=prefix, quantiles=quantiles, per_head=per_head, extra_scalars=extra_scalars, suffix=suffix
    )
    warn_scalars_only(loggers, histogram_bins is not None or heatmap)
    if dashboards is None:
        options = LogOptions(
            prefix=prefix, quantiles=quantiles, per_head=per_head, histogram_bins=histogram_bins, heatmap=heatmap
        )
        dashboards = Dashboards(options)
    dashboards.write(loggers, summary, step, scalars=scalars, scalar_names=scalars, prefix=prefix, suffix=suffix)
    return scalars


def warn_scalars_only(loggers: Iterable[Any], pictures: bool) -> None:
    """Tell each logger kind that is neither TensorBoard nor W&B, once, that it gets scalars only."""
    if not pictures:
        return
    for logger in loggers:
        if logger_kind(logger) == "other":
            name = type(logger).__name__
            _SCALARS_ONLY(
                name,
                f"attn_monitor: {name} gets the entropy scalars only; histograms, charts and pictures are written "
                "to TensorBoard and W&B loggers.",
            )


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
        dashboards: Dashboards | None = None,
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
            dashboards=dashboards,
        )

    def scalars(
        self, summary: EntropySummary, *, extra_scalars: Mapping[str, float] | None = None, suffix: str = ""
    ) -> dict[str, float]:
        """:func:`summary_scalars` with these options."""
        return summary_scalars(
            summary,
            prefix=self.prefix,
            quantiles=self.quantiles,
            per_head=self.per_head,
            extra_scalars=extra_scalars,
            suffix=suffix,
        )
