"""TensorBoard's Custom Scalars layout: the first charts a person sees, entropy beside the loop's own loss."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from attn_monitor.metrics.base import quantile_name
from attn_monitor.report.display import short_names
from attn_monitor.report.loggers import _GROUPED

__all__ = ["loss_names", "tensorboard_layout"]


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
