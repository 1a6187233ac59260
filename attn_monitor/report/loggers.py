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

from attn_monitor.functional.histograms import coarsen
from attn_monitor.metrics.entropy import EntropySummary
from attn_monitor.report.figures import Picture, png_bytes
from attn_monitor.shared.checks import WarnOnce, check_int

__all__ = ["WANDB_MAX_BINS", "LogOptions", "WandbSink", "per_layer", "send_alert", "sink_kind", "summary_scalars"]

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
