"""Dashboards: the one route out of a validation, to every sink: scalars, histograms, pictures, the digest."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attn_monitor.metrics.entropy import EntropySummary
from attn_monitor.report.digest import Baseline, Digest, digest_markdown, digest_table, validation_digest
from attn_monitor.report.display import short_names
from attn_monitor.report.figures import Picture, heatmap_picture, history_picture, median_grid
from attn_monitor.report.layout import loss_names, tensorboard_layout
from attn_monitor.report.loggers import (
    LogOptions,
    WandbSink,
    _tensorboard_histograms,
    _tensorboard_image,
    _tensorboard_scalars,
    _tensorboard_text,
    _tensorboard_write,
    _wandb,
    _wandb_histograms,
    sink_kind,
    warn_scalars_only,
)
from attn_monitor.shared.checks import WarnOnce

__all__ = ["Dashboards"]


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
