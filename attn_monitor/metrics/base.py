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

from attn_monitor.functional.histograms import histogram_quantile
from attn_monitor.shared.checks import check_int

__all__ = ["LayerMetric"]


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
