"""Running, DDP-exact distributions of attention statistics, per layer and head.

Every statistic is a fixed-size sufficient statistic per (layer, head) that
reduces by sum or by max (docs/design.md §7): histogram bin counts, exact sums and
counts, per-head maxima. :class:`LayerMetric` keeps all of them in two packed
float64 states with one row per layer, ``sums`` and ``maxes``, named by a
layer list. Memory is constant however many tokens are seen; merging batches,
ranks or checkpoints is addition (or a maximum), matched by layer name. Under
tensor parallelism a layer keeps a row per global head and each rank writes
its slice at its offset (:meth:`LayerMetric.register_heads`), so the same sum
counts every (query, head) once.

A DDP sync costs three collectives whatever the number of layers: one
``all_gather_object`` of every rank's layer list with its (small) max state,
which is itself two all-gathers, then one ``all_reduce`` of the sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

from attn_monitor.functional.entropy import broadcasts_to, histogram_quantile, normalize_entropy
from attn_monitor.shared.checks import check_int
from attn_monitor.shared.names import head_name

__all__ = ["AttentionEntropy", "AttentionMass", "EntropySummary", "LayerMetric", "MassSummary"]

#: Mean sink mass above which a head counts as a sink head (the sink rate's epsilon, as Gu et al. 2024).
SINK_THRESHOLD = 0.3

#: state -> (torchmetrics reduction, value of an empty slot)
_STATES = {"sums": ("sum", 0.0), "maxes": ("max", -math.inf)}


class LayerMetric(Metric):
    """Per-(layer, head) statistics reduced by sum or max, synced in three collectives.

    The base of every statistic family. A family declares its **fields** once,
    each a name and a per-head shape (``()`` for one number per head,
    ``(bins,)`` for a histogram): ``sum_fields`` add up across batches and
    ranks, ``max_fields`` take the maximum. Its ``update`` registers the layer
    (:meth:`register_layer`) and folds per-head values in with
    :meth:`accumulate`; its ``compute`` builds a summary from
    :meth:`statistics`. ``config`` names the settings that give the fields
    their meaning (bins, ranges): a state saved under another configuration
    refuses to load, naming both.

    Layers are rows named by the layer list and are matched **by name**
    wherever states meet: a DDP sync, :meth:`merge_state`, loading a state
    dict. Ranks may register layers in any order or not at all (a rank whose
    shard saw no batch takes part in ``compute()`` and gets the union);
    a layer with different head counts in two states is an error naming it.
    :meth:`reset` zeroes the statistics and keeps the layers.

    Args:
        layers: optional mapping layer name -> number of heads to register now.
        sum_fields: field name -> per-head shape, reduced by sum.
        max_fields: field name -> per-head shape, reduced by max (``-inf``
            until a value arrives).
        config: the settings a saved state must share to be loaded.
        kwargs: passed to :class:`torchmetrics.Metric` (``dist_sync_fn`` is
            not supported: the packed state syncs itself).

    Example:
        A family with one max field (the largest value seen per head) and one
        sum field:

        >>> class Peak(LayerMetric):
        ...     def __init__(self, **kwargs):
        ...         super().__init__(sum_fields={"count": ()}, max_fields={"peak": ()}, **kwargs)
        ...
        ...     def update(self, layer, values):  # (batch, heads, query)
        ...         self.register_layer(layer, values.shape[1])
        ...         queries = torch.full((values.shape[1],), values.shape[0] * values.shape[2])
        ...         self.accumulate(layer, count=queries, peak=values.amax((0, 2)))
        ...
        ...     def compute(self):
        ...         return self.statistics()
        >>> metric = Peak()
        >>> metric.update("layer.0", torch.tensor([[[1.0, 3.0], [2.0, 0.5]]]))
        >>> metric.update("layer.0", torch.tensor([[[4.0, 0.0], [1.0, 1.0]]]))
        >>> stats = metric.compute()
        >>> stats["peak"], stats["count"]
        (tensor([[4., 2.]], dtype=torch.float64), tensor([[4., 4.]], dtype=torch.float64))
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    sums: Tensor
    maxes: Tensor

    def __init__(
        self,
        layers: Mapping[str, int] | None = None,
        *,
        sum_fields: Mapping[str, tuple[int, ...]],
        max_fields: Mapping[str, tuple[int, ...]] | None = None,
        config: Mapping[str, object] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("dist_sync_fn") is not None:
            raise ValueError(f"{type(self).__name__} syncs its packed state itself; `dist_sync_fn` is not supported.")
        super().__init__(**kwargs)
        self._config = dict(config or {})
        #: field name -> (state, columns of the state, per-head shape)
        self._fields: dict[str, tuple[str, slice, tuple[int, ...]]] = {}
        for state, fields in (("sums", sum_fields), ("maxes", max_fields or {})):
            width = 0
            for name, shape in fields.items():
                if name in self._fields:
                    raise ValueError(f"Field {name!r} is declared twice.")
                size = math.prod(shape)
                self._fields[name] = (state, slice(width, width + size), tuple(shape))
                width += size
            reduction, fill = _STATES[state]
            self.add_state(state, torch.full((0, 0, width), fill, dtype=torch.float64), dist_reduce_fx=reduction)
        self._layer_heads: dict[str, int] = {}
        if layers is not None:
            if not isinstance(layers, Mapping):
                raise TypeError(f"Expected `layers` to map layer name -> number of heads, got {type(layers).__name__}.")
            for name, heads in layers.items():
                self.register_layer(name, heads)

    @property
    def layers(self) -> list[str]:
        """Registered layer names, in registration order."""
        return list(self._layer_heads)

    def num_heads(self, layer: str) -> int:
        """Heads of a registered layer."""
        return self._layer_heads[layer]

    @property
    def head_counts(self) -> list[int]:
        """Heads of every registered layer, in the order of :attr:`layers`."""
        return list(self._layer_heads.values())

    def register_layer(self, name: str, num_heads: int) -> None:
        """Add a layer with empty statistics. Registering the same layer again is a no-op.

        Raises:
            TypeError: ``name`` is not a string.
            ValueError: ``num_heads`` is not positive, or differs from an earlier
                registration of ``name``.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"Expected a non-empty layer name (str), got {name!r}.")
        check_int("num_heads", num_heads, 1)
        if name in self._layer_heads:
            if self._layer_heads[name] != num_heads:
                raise ValueError(
                    f"Layer {name!r} was registered with {self._layer_heads[name]} heads, got {num_heads} now."
                )
            return
        self._lay_out(self.layers, {**self._layer_heads, name: num_heads})

    def register_heads(self, layer: str, local_heads: int, head_offset: int = 0, num_heads: int | None = None) -> None:
        """Register ``layer`` for values of heads ``head_offset ... head_offset + local_heads - 1`` of it.

        Under tensor parallelism a rank holds a slice of a layer's heads: the
        layer is registered with all ``num_heads`` of them, and each rank
        writes its slice at its offset, so one sum across ranks counts every
        (query, head) once.

        Args:
            layer: the layer name; registered on first sight.
            local_heads: heads the values hold.
            head_offset: the layer's head of the values' first.
            num_heads: the layer's heads; None: ``local_heads`` (a rank holds them all).

        Raises:
            ValueError: the slice does not fit in the layer's heads, or
                ``num_heads`` differs from an earlier registration.
        """
        check_int("head_offset", head_offset, 0)
        total = local_heads if num_heads is None else num_heads
        if head_offset + local_heads > total:
            raise ValueError(
                f"Layer {layer!r}: heads {head_offset} ... {head_offset + local_heads - 1} do not fit in its "
                f"{total} heads (check `head_offset` and `num_heads`)."
            )
        self.register_layer(layer, total)

    def accumulate(self, layer: str, head_offset: int = 0, /, **values: Tensor) -> None:
        """Fold per-head values of a registered layer into its fields.

        Args:
            layer: a registered layer name.
            head_offset: the layer's head of the values' first row (see :meth:`register_heads`).
            values: field name -> (local heads, *field shape) values; sum
                fields add them, max fields keep the elementwise maximum.
        """
        index = self.layers.index(layer)
        rows = {state: getattr(self, state)[index] for state in _STATES}
        for name, value in values.items():
            state, columns, _ = self._fields[name]
            target = rows[state][head_offset : head_offset + value.shape[0], columns]
            value = value.to(target).reshape(target.shape)
            if state == "sums":
                target.add_(value)
            else:
                target.copy_(torch.maximum(target, value))

    def statistics(self) -> dict[str, Tensor]:
        """Every field as a (layers, max heads, *field shape) float64 copy.

        Head slots a layer lacks hold 0 in sum fields and ``-inf`` in max fields.
        """
        return {name: values.clone() for name, values in self._field_views().items()}

    def _field_views(self) -> dict[str, Tensor]:
        """Every field as a view of the state (summaries copy what they keep: one copy, not two)."""
        out = {}
        for name, (state, columns, shape) in self._fields.items():
            values = getattr(self, state)[:, :, columns]
            out[name] = values.reshape(*values.shape[:2], *shape)
        return out

    def _lay_out(self, rows: Sequence[str], layers: Mapping[str, int]) -> None:
        """Lay both states out as ``layers``, moving the current rows (named ``rows``) by name."""
        for state, (_, fill) in _STATES.items():
            setattr(self, state, _arrange(getattr(self, state), rows, layers, fill))
        self._layer_heads = dict(layers)
        self._computed = None  # torchmetrics caches compute() until the next update or reset

    def reset(self) -> None:
        """Zero every statistic; the registered layers stay."""
        laid_out = {state: getattr(self, state) for state in _STATES}
        super().reset()
        shape = (len(self._layer_heads), max(self._layer_heads.values(), default=0))
        if all(tuple(value.shape[:2]) == shape for value in laid_out.values()):
            # The same layout: clear the states in place (a fresh 16 MB state at 32 x 32 heads is
            # 10 ms of page faults). Summaries hold copies, so nothing still reads these.
            for state, value in laid_out.items():
                setattr(self, state, value.fill_(_STATES[state][1]))
            self._computed = None
        else:
            self._lay_out([], self._layer_heads)

    def forward(self, layer: str, values: Tensor, *args: Any, **kwargs: Any) -> Any:
        """Update with one call and return the summary of that call alone."""
        # torchmetrics adds the batch's state to a snapshot of the global one:
        # both must already have the layer's row.
        if isinstance(values, Tensor) and values.dim() == 3:
            self.register_heads(layer, values.shape[1], kwargs.get("head_offset", 0), kwargs.get("num_heads"))
        return super().forward(layer, values, *args, **kwargs)

    def _sync_dist(self, dist_sync_fn: Callable | None = None, process_group: Any | None = None) -> None:
        """Sum (and max) every layer across ranks in three collectives, layers matched by name."""
        group = process_group or self.process_group
        gathered: list[Any] = [None] * dist.get_world_size(group)
        # numpy, not a tensor: torch pickles tensors ten times slower.
        dist.all_gather_object(gathered, (self._layer_heads, self.maxes.cpu().numpy()), group=group)
        layers = _union({f"rank {rank}": layout for rank, (layout, _) in enumerate(gathered)})
        self._lay_out(self.layers, layers)
        dist.all_reduce(self.sums, group=group)
        maxes = [_arrange(torch.from_numpy(values), list(layout), layers, -math.inf) for layout, values in gathered]
        self.maxes = torch.stack(maxes).amax(0).to(self.device)

    def _copy_state_dict(self) -> dict[str, Any]:
        # sync()/unsync() and forward() restore this snapshot attribute by
        # attribute: the layer list must come back with the rows it names.
        return {**super()._copy_state_dict(), "_layer_heads": dict(self._layer_heads)}

    def merge_state(self, incoming_state: dict[str, Any] | Metric) -> None:
        """Add another metric's statistics to this one, matching layers by name.

        Raises:
            TypeError: ``incoming_state`` is not a metric of this class (a dict
                of states does not say which layer each row belongs to).
            ValueError: another configuration, or a layer with other head counts.
        """
        if not isinstance(incoming_state, type(self)):
            raise TypeError(
                f"Expected a {type(self).__name__} to merge (its layers are matched by name), "
                f"got {type(incoming_state).__name__}."
            )
        self._check_config(incoming_state._config, "merge the incoming metric into")
        layers = _union({"this metric": self._layer_heads, "the incoming metric": incoming_state._layer_heads})
        self._lay_out(self.layers, layers)
        rows = incoming_state.layers
        self.sums = self.sums + _arrange(incoming_state.sums.to(self.device), rows, layers, 0.0)
        self.maxes = torch.maximum(self.maxes, _arrange(incoming_state.maxes.to(self.device), rows, layers, -math.inf))

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "config": dict(self._config),
            "layers": list(self._layer_heads.items()),
            "sums": self.sums.detach().clone(),
            "maxes": self.maxes.detach().clone(),
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        """Load a saved state: the saved layers replace or join this metric's, by name."""
        self._check_config(state.get("config"), "load the saved state into")
        saved = {str(name): int(heads) for name, heads in state["layers"]}
        expected = (len(saved), max(saved.values(), default=0))
        for name in _STATES:
            got = tuple(state[name].shape)
            if got != (*expected, getattr(self, name).shape[-1]):
                raise ValueError(f"The saved `{name}` has shape {got}, which does not fit its layers {saved}.")
        layers = _union({"this metric": self._layer_heads, "the saved state": saved})
        # Layers only this metric had start empty: loading replaces the statistics.
        self.sums, self.maxes = (state[name].to(self.device, torch.float64, copy=True) for name in _STATES)
        self._lay_out(list(saved), layers)

    def _check_config(self, other: object, action: str) -> None:
        if other != self._config:
            raise ValueError(
                f"Cannot {action} this {type(self).__name__}: it was made with {_describe_config(other)}, "
                f"this one has {_describe_config(self._config)}."
            )


def _describe_config(config: object) -> str:
    if not isinstance(config, Mapping):
        return "unknown settings"
    return ", ".join(f"{key}={value!r}" for key, value in config.items()) or "no settings"


def _union(layouts: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Every layer of the layouts (source -> layer -> heads), in order of first appearance.

    Raises:
        ValueError: a layer has other head counts in two sources.
    """
    out: dict[str, int] = {}
    first: dict[str, str] = {}
    for source, layout in layouts.items():
        for name, heads in layout.items():
            first.setdefault(name, source)
            if out.setdefault(name, heads) != heads:
                raise ValueError(f"Layer {name!r} has {out[name]} heads in {first[name]} and {heads} in {source}.")
    return out


def _arrange(rows: Tensor, names: Sequence[str], layers: Mapping[str, int], fill: float) -> Tensor:
    """``rows`` (one per name in ``names``) at their layers' places in ``layers``; every other slot ``fill``.

    Rows already laid out so come back as they are (no copy).
    """
    heads = max(layers.values(), default=0)
    if list(names) == list(layers) and rows.shape[1] == heads:
        return rows
    position = {name: index for index, name in enumerate(layers)}
    out = rows.new_full((len(layers), heads, rows.shape[-1]), fill)
    index = torch.tensor([position[name] for name in names], dtype=torch.long, device=rows.device)
    out[index, : rows.shape[1]] = rows
    return out


def copy_statistics(stats: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """What a summary keeps of a metric's fields: float64 copies on the CPU, detached."""
    return {name: value.detach().to("cpu", torch.float64, copy=True) for name, value in stats.items()}


class _Summary:
    """Statistics shared by every summary: (layer, head) sums, counts and histograms on [0, 1]."""

    def __init__(self, layers: Sequence[str], num_heads: Sequence[int], stats: Mapping[str, Tensor]) -> None:
        self.layers = list(layers)
        self.num_heads = list(num_heads)
        self._stats = copy_statistics(stats)
        self._stats.setdefault("nonfinite", torch.zeros_like(self._stats["count"]))
        self._quantiles: dict[float, Tensor] = {}
        self._layer_quantiles: dict[float, Tensor] = {}

    histogram = property(lambda self: self._stats["hist"])
    count = property(lambda self: self._stats["count"])
    nonfinite = property(lambda self: self._stats["nonfinite"])

    def stats(self, name: str) -> Tensor:
        """A raw accumulated statistic, (L, H, ...), by state name."""
        if name not in self._stats:
            raise ValueError(f"Unknown statistic {name!r}; expected one of {sorted(self._stats)}.")
        return self._stats[name]

    @property
    def max_heads(self) -> int:
        return max(self.num_heads, default=0)

    def _ratio(self, numerator: str, denominator: str, pooled: bool) -> Tensor:
        top, bottom = self._stats[numerator], self._stats[denominator]
        if pooled:
            top, bottom = top.sum(-1), bottom.sum(-1)
        return torch.where(bottom > 0, top / bottom.clamp(min=1), torch.full_like(top, math.nan))

    def _std(self, pooled: bool) -> Tensor:
        mean = self._ratio("sum", "count", pooled)
        mean_sq = self._ratio("sum_sq", "count", pooled)
        return (mean_sq - mean.square()).clamp(min=0.0).sqrt()

    @property
    def mean(self) -> Tensor:
        """(L, H) token-weighted mean: every counted query once."""
        return self._ratio("sum", "count", pooled=False)

    @property
    def std(self) -> Tensor:
        """(L, H) population standard deviation over counted queries."""
        return self._std(pooled=False)

    def quantile(self, q: float) -> Tensor:
        """(L, H) quantile ``q`` from the histogram (error <= one bin width).

        Computed once per level (the logged scalars, the heatmap and the
        alerts all read the medians): a summary is a snapshot.
        """
        if q not in self._quantiles:
            self._quantiles[q] = histogram_quantile(self.histogram, q)
        return self._quantiles[q].clone()

    @property
    def layer_mean(self) -> Tensor:
        """(L,) token-weighted mean, heads pooled."""
        return self._ratio("sum", "count", pooled=True)

    @property
    def layer_std(self) -> Tensor:
        """(L,) standard deviation, heads pooled."""
        return self._std(pooled=True)

    def layer_quantile(self, q: float) -> Tensor:
        """(L,) quantile ``q``, heads pooled (computed once per level, as :meth:`quantile`)."""
        if q not in self._layer_quantiles:
            self._layer_quantiles[q] = histogram_quantile(self.histogram.sum(1), q)
        return self._layer_quantiles[q].clone()

    @property
    def overall_mean(self) -> float:
        """Token-weighted mean over every layer and head."""
        total = float(self._stats["count"].sum())
        return float(self._stats["sum"].sum()) / total if total > 0 else math.nan

    def layer_index(self, layer: str) -> int:
        """Position of ``layer`` in :attr:`layers`; ValueError naming the known layers."""
        try:
            return self.layers.index(layer)
        except ValueError:
            raise ValueError(f"Unknown layer {layer!r}; this summary has {self.layers}.") from None


class EntropySummary(_Summary):
    """What :class:`AttentionEntropy` accumulated, with the statistics derived from it.

    Tensors are indexed (layer, head, ...) in the order of :attr:`layers`.
    Layers with fewer heads than :attr:`max_heads` hold zero counts (and NaN
    statistics) in the missing head slots. All statistics of entropy are
    normalised entropy in [0, 1] unless their name says nats.

    Attributes:
        layers: layer names in registration order.
        num_heads: heads of each layer.
        histogram: (L, H, num_bins) counts of normalised entropy on [0, 1].
        nats_histogram: (L, H, nats_bins) counts of entropy over [0, max_nats].
        max_nats: right edge of the nats histogram, ``ln(max_keys)``.
        count: (L, H) counted queries.
        single_key: (L, H) real queries with one valid key (left out of the
            statistics unless ``include_single_key``).
        no_key: (L, H) real queries left out because they had no valid key.
        nonfinite: (L, H) counted queries left out because their entropy was
            NaN or infinite (a diverging model).
    """

    def __init__(
        self,
        layers: Sequence[str],
        num_heads: Sequence[int],
        stats: Mapping[str, Tensor],
        max_nats: float,
    ) -> None:
        super().__init__(layers, num_heads, stats)
        self.max_nats = float(max_nats)

    nats_histogram = property(lambda self: self._stats["hist_nats"])
    single_key = property(lambda self: self._stats["single_key"])
    no_key = property(lambda self: self._stats["no_key"])

    @property
    def mean_seq(self) -> Tensor:
        """(L, H) sequence-weighted mean: mean within each sequence, then over sequences."""
        return self._ratio("seq_sum", "seq_count", pooled=False)

    @property
    def nats_mean(self) -> Tensor:
        """(L, H) token-weighted mean of entropy in nats."""
        return self._ratio("sum_nats", "count", pooled=False)

    @property
    def layer_mean_seq(self) -> Tensor:
        """(L,) sequence-weighted mean, heads pooled (every (sequence, head) pair once)."""
        return self._ratio("seq_sum", "seq_count", pooled=True)

    @property
    def layer_nats_mean(self) -> Tensor:
        """(L,) token-weighted mean of entropy in nats, heads pooled."""
        return self._ratio("sum_nats", "count", pooled=True)

    def to_dict(
        self,
        prefix: str = "attn_entropy",
        *,
        quantiles: Sequence[float] = (0.05, 0.25, 0.5, 0.75, 0.95),
        per_head: bool = True,
    ) -> dict[str, float]:
        """Flat scalar names for loggers (the naming contract in the README).

        Per layer, heads pooled: ``{prefix}/{layer}/mean``, ``/mean_seq``,
        ``/q05`` ... ``/q95`` (two digits of the level; ``q50`` is the median)
        and ``/nats_mean``; per head ``{prefix}_heads/{layer}/head_{h}/mean`` and
        ``/q50`` (:func:`~attn_monitor.shared.names.head_name`); overall
        ``{prefix}/mean``. Layers and heads with no counted query are left
        out rather than logged as NaN. ``{prefix}/{layer}/nonfinite`` (heads
        pooled) counts queries left out for non-finite entropy, for layers
        that had any.
        """
        names = {q: quantile_name(q) for q in quantiles}
        out: dict[str, float] = {}
        # Every tensor once, to Python floats once: indexing element by element costs more than the math.
        layer_quantiles = {q: self.layer_quantile(q).tolist() for q in quantiles}
        head_median, head_mean, count = self.quantile(0.5).tolist(), self.mean.tolist(), self.count.tolist()
        layer_count, nonfinite = self.count.sum(-1).tolist(), self.nonfinite.sum(-1).tolist()
        layer_mean, layer_mean_seq = self.layer_mean.tolist(), self.layer_mean_seq.tolist()
        layer_nats_mean = self.layer_nats_mean.tolist()
        for index, layer in enumerate(self.layers):
            base = f"{prefix}/{layer}"
            put_nonfinite(out, base, nonfinite[index])
            if layer_count[index] == 0:
                continue
            out[f"{base}/mean"] = layer_mean[index]
            out[f"{base}/mean_seq"] = layer_mean_seq[index]
            for q, name in names.items():
                out[f"{base}/{name}"] = layer_quantiles[q][index]
            out[f"{base}/nats_mean"] = layer_nats_mean[index]
            if per_head:
                for head in range(self.num_heads[index]):
                    if count[index][head] > 0:
                        out[head_name(prefix, layer, head, "mean")] = head_mean[index][head]
                        out[head_name(prefix, layer, head, "q50")] = head_median[index][head]
        if sum(layer_count) > 0:
            out[f"{prefix}/mean"] = self.overall_mean
        return out

    def __repr__(self) -> str:
        return (
            f"EntropySummary(layers={len(self.layers)}, heads={self.num_heads}, "
            f"queries={int(self.count.sum())}, mean={self.overall_mean:.4f})"
        )


def check_is_sample(is_sample: object, shape: tuple[int, ...]) -> None:
    """Raise unless ``is_sample`` is None or a bool tensor broadcastable to the values' ``shape``.

    Raises:
        TypeError: not a bool tensor.
        ValueError: not broadcastable to ``shape``.
    """
    if is_sample is None:
        return
    if not isinstance(is_sample, Tensor) or is_sample.dtype != torch.bool:
        raise TypeError(f"Expected `is_sample` to be a bool tensor or None, got {type(is_sample).__name__}.")
    if not broadcasts_to(tuple(is_sample.shape), shape):
        raise ValueError(f"Expected `is_sample` broadcastable to {shape}, got {tuple(is_sample.shape)}.")


def put_nonfinite(out: dict[str, float], base: str, nonfinite: float) -> None:
    """Add ``{base}/nonfinite``, the count of queries left out as non-finite (heads pooled), when there were any."""
    if nonfinite > 0:
        out[f"{base}/nonfinite"] = nonfinite


def quantile_name(q: float) -> str:
    """Logged name of quantile level ``q``: ``q05``, ``q50``, ``q99_9``."""
    percent = q * 100
    if abs(percent - round(percent)) > 1e-9:
        return "q" + f"{percent:g}".replace(".", "_")
    return f"q{round(percent):02d}"


class AttentionEntropy(LayerMetric):
    """Distribution of per-query attention entropy, per layer and per head.

    Feed it per-query entropy in nats with the number of valid keys of each
    query (from :mod:`attn_monitor.functional.entropy` and
    :class:`~attn_monitor.functional.masks.Support`); it normalises, bins and sums.

    **Layers** are identified by name. Declare them up front with ``layers``
    (name -> number of heads) or let :meth:`update` register each new name on
    first sight, in call order. Under DDP ranks may register layers in any
    order, or none: ``compute()`` (which every rank must call) matches them by
    name and gives every rank the union. :meth:`reset` zeroes the counts and
    keeps the registered layers.

    **Which queries count**: queries marked as samples with at least two valid
    keys. Real queries with one valid key (H = 0, normalised 0/0) and with no
    valid key are tallied in ``single_key`` and ``no_key``. With
    ``include_single_key=True`` one-key queries are also counted in the
    statistics, with normalised entropy 0 (all mass on the only key).
    Counted queries whose entropy is NaN or infinite (a diverging model) are
    left out and tallied in ``nonfinite``.

    Args:
        layers: optional mapping layer name -> number of heads to register now.
        num_bins: bins of the normalised-entropy histogram on [0, 1]; quantile
            error is at most ``1 / num_bins``.
        nats_bins: bins of the raw-entropy histogram on [0, ln(max_keys)].
        max_keys: largest number of valid keys expected; raw entropies above
            ``ln(max_keys)`` land in the last nats bin (means stay exact).
        include_single_key: count one-key queries with normalised entropy 0.
        kwargs: passed to :class:`torchmetrics.Metric`.

    Example:
        >>> import math, torch
        >>> metric = AttentionEntropy()
        >>> entropy = torch.full((1, 2, 3), math.log(4.0))  # (batch, heads, query): uniform over 4 keys
        >>> metric.update("layer.0", entropy, num_valid=torch.tensor(4))
        >>> summary = metric.compute()
        >>> summary.mean
        tensor([[1., 1.]], dtype=torch.float64)
        >>> round(summary.to_dict()["attn_entropy/layer.0/q50"], 3)  # within one bin (0.001)
        1.0
    """

    def __init__(
        self,
        layers: Mapping[str, int] | None = None,
        *,
        num_bins: int = 1000,
        nats_bins: int = 1000,
        max_keys: int = 8192,
        include_single_key: bool = False,
        **kwargs: Any,
    ) -> None:
        self.num_bins = check_int("num_bins", num_bins, 1)
        self.nats_bins = check_int("nats_bins", nats_bins, 1)
        self.max_keys = check_int("max_keys", max_keys, 2)
        self.max_nats = math.log(self.max_keys)
        self.include_single_key = bool(include_single_key)
        per_head = ("count", "sum", "sum_sq", "sum_nats", "seq_sum", "seq_count", "single_key", "no_key", "nonfinite")
        super().__init__(
            layers,
            sum_fields={"hist": (self.num_bins,), "hist_nats": (self.nats_bins,), **dict.fromkeys(per_head, ())},
            config={
                "num_bins": self.num_bins,
                "nats_bins": self.nats_bins,
                "max_keys": self.max_keys,
                "include_single_key": self.include_single_key,
            },
            **kwargs,
        )

    def update(
        self,
        layer: str,
        entropy: Tensor,
        num_valid: Tensor,
        is_sample: Tensor | None = None,
        *,
        head_offset: int = 0,
        num_heads: int | None = None,
    ) -> None:
        """Add one attention call's per-query entropy.

        Args:
            layer: layer name; registered on first sight.
            entropy: (batch, heads, query) entropy in nats; values of queries
                that do not count are ignored, NaN and infinite values of
                counted queries are left out and tallied in ``nonfinite``.
            num_valid: valid keys per query, broadcastable to ``entropy``.
            is_sample: bool, broadcastable to ``entropy``; False for padding
                queries. None: every query is a sample.
            head_offset, num_heads: where ``entropy``'s heads sit among the
                layer's (tensor parallelism, see :meth:`~LayerMetric.register_heads`);
                by default they are all of them.

        Raises:
            TypeError: wrong types or dtypes.
            ValueError: wrong shapes, a head count that differs from the
                layer's, finite entropy out of [0, ln(num_valid)] on a counted
                query.
        """
        if not isinstance(entropy, Tensor) or not entropy.dtype.is_floating_point:
            raise TypeError(f"Expected `entropy` to be a floating point tensor, got {_describe(entropy)}.")
        if entropy.dim() != 3:
            raise ValueError(f"Expected `entropy` with 3 dims (batch, heads, query), got shape {tuple(entropy.shape)}.")
        if not isinstance(num_valid, Tensor) or num_valid.dtype.is_floating_point or num_valid.dtype == torch.bool:
            raise TypeError(f"Expected `num_valid` to be an integer tensor, got {_describe(num_valid)}.")
        if is_sample is not None and (not isinstance(is_sample, Tensor) or is_sample.dtype != torch.bool):
            raise TypeError(f"Expected `is_sample` to be a bool tensor or None, got {_describe(is_sample)}.")
        for name, value in (("num_valid", num_valid), ("is_sample", is_sample)):
            if value is not None and not broadcasts_to(tuple(value.shape), tuple(entropy.shape)):
                raise ValueError(
                    f"Expected `{name}` broadcastable to `entropy` {tuple(entropy.shape)}, got {tuple(value.shape)}."
                )
        if (num_valid < 0).any():
            raise ValueError(f"Expected `num_valid` >= 0, got minimum {int(num_valid.min())}.")
        entropy = entropy.detach().to(self.device, torch.float64)
        num_valid = num_valid.to(self.device)
        limit = num_valid.to(torch.float64).clamp(min=1).log()  # the largest entropy over num_valid keys
        # The masks are built at full size: they set the memory layout of the sums below, and with it the
        # order of their additions (their last bits).
        full = num_valid.expand(entropy.shape)
        real = torch.ones_like(entropy, dtype=torch.bool) if is_sample is None else is_sample.to(self.device)
        real = real.expand(entropy.shape)
        has_choice = full > 1
        single, empty = real & (full == 1), real & (full == 0)
        counted = real & has_choice
        if self.include_single_key:
            counted = counted | single
        finite = torch.isfinite(entropy)
        nonfinite, counted = counted & ~finite, counted & finite
        # Zero outside the counted queries: no NaN or out-of-range value goes any further.
        values = torch.where(counted, entropy, 0.0)
        if (values < -1e-4).any() or (values > limit + 1e-3).any():
            raise ValueError("`entropy` must lie in [0, ln(num_valid)] on counted queries (nats, not normalised).")
        self.register_heads(layer, entropy.shape[1], head_offset, num_heads)

        normalized = torch.where(counted & has_choice, normalize_entropy(values, num_valid), 0.0)
        nats = values.clamp(min=0.0)
        weight = counted.to(torch.float64)

        per_sequence = weight.sum(2)
        has_queries = per_sequence > 0
        sequence_mean = normalized.sum(2) / per_sequence.clamp(min=1)
        self.accumulate(
            layer,
            head_offset,
            hist=_head_histogram(normalized, weight, self.num_bins, 1.0),
            hist_nats=_head_histogram(nats, weight, self.nats_bins, self.max_nats),
            count=per_sequence.sum(0),
            sum=normalized.sum((0, 2)),
            sum_sq=normalized.square().sum((0, 2)),
            sum_nats=nats.sum((0, 2)),
            seq_sum=torch.where(has_queries, sequence_mean, 0.0).sum(0),
            seq_count=has_queries.sum(0),
            single_key=single.sum((0, 2)),
            no_key=empty.sum((0, 2)),
            nonfinite=nonfinite.sum((0, 2)),
        )

    def compute(self) -> EntropySummary:
        """Summary of everything accumulated since the last reset (collective under DDP)."""
        return EntropySummary(self.layers, self.head_counts, self._field_views(), self.max_nats)


def _head_histogram(values: Tensor, weight: Tensor, bins: int, high: float) -> Tensor:
    """(heads, bins) float64 counts of ``values`` in equal bins over [0, high], each value counted ``weight`` times.

    ``values`` and ``weight`` are (batch, heads, query); ``values`` must be
    finite everywhere (hold 0 where ``weight`` is 0): a NaN has no bin.
    """
    heads = values.shape[1]
    # Clamped first, the truncation of `to` is the floor.
    bin_index = (values / high * bins).clamp(0, bins - 1).to(torch.int64)
    first_bin = torch.arange(0, heads * bins, bins, device=values.device)[:, None]
    flat = (bin_index + first_bin).reshape(-1)
    # Weights of 0 and 1 instead of a boolean index, which costs a pass to find the kept entries;
    # float64 sums of ones are exact counts.
    return torch.bincount(flat, weights=weight.reshape(-1), minlength=heads * bins).reshape(heads, bins)


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"tensor of dtype {value.dtype}"
    return type(value).__name__


class MassSummary(_Summary):
    """What :class:`AttentionMass` accumulated: per (key, head) distributions of a mass in [0, 1].

    Keys are ``{diagnostic}/{layer}``, e.g. ``sink_mass/blocks.0.attn``;
    ``nonfinite`` (L, H) counts sample queries whose mass was NaN or infinite.
    """

    def head_share_above(self, threshold: float) -> Tensor:
        """(K,) share of each key's heads whose mean mass exceeds ``threshold``, among heads with a counted query.

        For ``sink_mass/{layer}`` keys at ``threshold=0.3`` this is the sink
        rate of Gu et al., "When Attention Sink Emerges in Language Models"
        (2024): the share of a layer's heads that put more than 0.3 of their
        mean mass on the sink tokens. A function of the summed state: exact
        under DDP. NaN where no head has a counted query.

        Raises:
            ValueError: ``threshold`` outside [0, 1).

        Example:
            >>> metric = AttentionMass()
            >>> metric.update("sink_mass/layer.0", torch.tensor([[[0.9, 0.7], [0.1, 0.2]]]))
            >>> metric.compute().head_share_above(0.3)
            tensor([0.5000], dtype=torch.float64)
        """
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
            raise ValueError(f"Expected the mass `threshold` in [0, 1), got {threshold!r}.")
        counted = self.count > 0
        above = (counted & (self.mean > threshold)).sum(-1).to(torch.float64)
        heads = counted.sum(-1)
        return torch.where(heads > 0, above / heads.clamp(min=1), math.nan)

    def to_dict(
        self, prefix: str = "attn", *, per_head: bool = False, sink_threshold: float | None = SINK_THRESHOLD
    ) -> dict[str, float]:
        """Scalars ``{prefix}_{diagnostic}/{layer}/mean``, ``/q50``, ``/q95``, ``/max_head_mean``
        (and ``{prefix}_{diagnostic}_heads/{layer}/head_{h}/mean`` with ``per_head``); keys with no
        counted query are left out.
        ``/nonfinite`` counts queries left out for a NaN or infinite mass, where there were any.
        Sink-mass keys also give ``{prefix}_sink_mass/{layer}/sink_rate``, the share of heads whose
        mean sink mass exceeds ``sink_threshold`` (:meth:`head_share_above`; None: left out)."""
        out: dict[str, float] = {}
        rates = None if sink_threshold is None else self.head_share_above(sink_threshold).tolist()
        medians, tails = self.layer_quantile(0.5).tolist(), self.layer_quantile(0.95).tolist()
        mean = self.mean
        head_means, peaks, count = mean.tolist(), mean.nan_to_num(nan=-math.inf).tolist(), self.count.tolist()
        layer_count, nonfinite = self.count.sum(-1).tolist(), self.nonfinite.sum(-1).tolist()
        layer_mean = self.layer_mean.tolist()
        for index, key in enumerate(self.layers):
            base = f"{prefix}_{key}"
            put_nonfinite(out, base, nonfinite[index])
            if layer_count[index] == 0:
                continue
            out[f"{base}/mean"] = layer_mean[index]
            out[f"{base}/q50"] = medians[index]
            out[f"{base}/q95"] = tails[index]
            out[f"{base}/max_head_mean"] = max(peaks[index][: self.num_heads[index]])
            if rates is not None and key.startswith("sink_mass/"):
                out[f"{base}/sink_rate"] = rates[index]
            if per_head:
                diagnostic, layer = key.split("/", 1)
                for head in range(self.num_heads[index]):
                    if count[index][head] > 0:
                        out[head_name(f"{prefix}_{diagnostic}", layer, head, "mean")] = head_means[index][head]
        return out

    def __repr__(self) -> str:
        return f"MassSummary(keys={self.layers}, queries={int(self.count.sum())}, mean={self.overall_mean:.4f})"


class AttentionMass(LayerMetric):
    """Distributions of per-query attention mass fractions, per key and head.

    The state behind the mass diagnostics (attention-sink mass, KV-eviction
    coverage, cross-document leakage): each key (``{diagnostic}/{layer}``)
    holds a histogram on [0, 1] and exact sums, all sum-reduced. Sample
    queries whose mass is NaN or infinite are left out and tallied in
    ``nonfinite``.

    Args:
        layers: optional mapping key -> number of heads to register now.
        num_bins: histogram bins on [0, 1].
        kwargs: passed to :class:`torchmetrics.Metric`.

    Example:
        >>> import torch
        >>> metric = AttentionMass()
        >>> metric.update("sink_mass/layer.0", torch.tensor([[[0.2, 0.4]]]))
        >>> metric.compute().mean
        tensor([[0.3000]], dtype=torch.float64)
    """

    def __init__(self, layers: Mapping[str, int] | None = None, *, num_bins: int = 1000, **kwargs: Any) -> None:
        self.num_bins = check_int("num_bins", num_bins, 1)
        per_head = dict.fromkeys(("count", "sum", "sum_sq", "nonfinite"), ())
        super().__init__(
            layers, sum_fields={"hist": (self.num_bins,), **per_head}, config={"num_bins": self.num_bins}, **kwargs
        )

    def update(
        self,
        key: str,
        mass: Tensor,
        is_sample: Tensor | None = None,
        *,
        head_offset: int = 0,
        num_heads: int | None = None,
    ) -> None:
        """Add per-query mass fractions.

        Args:
            key: ``{diagnostic}/{layer}``; registered on first sight.
            mass: (batch, heads, query) fractions in [0, 1]; queries that are
                not samples are ignored, NaN or infinite values of samples are
                left out and tallied in ``nonfinite``.
            is_sample: bool, broadcastable to ``mass``; None: all queries.
            head_offset, num_heads: as in :meth:`AttentionEntropy.update`.

        Raises:
            TypeError, ValueError: wrong types, shapes, or values outside [0, 1].
        """
        if not isinstance(mass, Tensor) or not mass.dtype.is_floating_point:
            raise TypeError(f"Expected `mass` to be a floating point tensor, got {_describe(mass)}.")
        if mass.dim() != 3:
            raise ValueError(f"Expected `mass` with 3 dims (batch, heads, query), got shape {tuple(mass.shape)}.")
        if is_sample is not None and (
            not isinstance(is_sample, Tensor)
            or is_sample.dtype != torch.bool
            or not broadcasts_to(tuple(is_sample.shape), tuple(mass.shape))
        ):
            raise ValueError(f"Expected `is_sample` as a bool tensor broadcastable to {tuple(mass.shape)}.")
        mass = mass.detach().to(self.device, torch.float64)
        sample = torch.ones_like(mass, dtype=torch.bool) if is_sample is None else is_sample.to(self.device)
        finite = torch.isfinite(mass)
        nonfinite, counted = sample & ~finite, sample & finite
        # Zero outside the counted queries: no NaN or out-of-range value goes any further.
        values = torch.where(counted, mass, 0.0)
        if (values < -1e-6).any() or (values > 1 + 1e-6).any():
            raise ValueError("Expected `mass` in [0, 1] on counted queries.")
        self.register_heads(key, mass.shape[1], head_offset, num_heads)
        mass = values.clamp(0.0, 1.0)
        weight = counted.to(torch.float64)
        self.accumulate(
            key,
            head_offset,
            hist=_head_histogram(mass, weight, self.num_bins, 1.0),
            count=counted.sum((0, 2)),
            sum=mass.sum((0, 2)),
            sum_sq=mass.square().sum((0, 2)),
            nonfinite=nonfinite.sum((0, 2)),
        )

    def compute(self) -> MassSummary:
        """Summary of everything accumulated since the last reset (collective under DDP)."""
        return MassSummary(self.layers, self.head_counts, self._field_views())
