"""AttentionEntropy: a running, DDP-exact distribution of attention entropy.

State per (layer, head) is a fixed-size set of sufficient statistics that
reduce by sum (STYLE.md §2): histograms of normalised entropy on [0, 1] and of
raw entropy in nats, exact sums for means and standard deviations, per-sequence
sums for sequence-weighted means, and counts of excluded queries. Memory is
constant however many tokens are seen; merging batches or ranks is addition.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from attn_monitor.functional import broadcasts_to, histogram_quantile, normalize_entropy

__all__ = ["AttentionEntropy", "AttentionMass", "EntropySummary", "MassSummary"]

#: Per-layer state name suffix -> what it holds, shape (heads, ...) per layer.
_STATE_KINDS = (
    "hist",  # (H, num_bins) counts of normalised entropy
    "hist_nats",  # (H, nats_bins) counts of entropy in nats over [0, ln(max_keys)]
    "count",  # (H,) counted queries
    "sum",  # (H,) sum of normalised entropy
    "sum_sq",  # (H,) sum of squared normalised entropy
    "sum_nats",  # (H,) sum of entropy in nats
    "seq_sum",  # (H,) sum over sequences of each sequence's mean normalised entropy
    "seq_count",  # (H,) sequences with at least one counted query
    "single_key",  # (H,) real queries with exactly one valid key
    "no_key",  # (H,) real queries with no valid key
)


def _check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"Expected `{name}` to be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"Expected `{name}` to be an int >= {minimum}, got {value!r}.")
    return value


class _Summary:
    """Statistics shared by every summary: (layer, head) sums, counts and histograms on [0, 1]."""

    def __init__(self, layers: Sequence[str], num_heads: Sequence[int], stats: Mapping[str, Tensor]) -> None:
        self.layers = list(layers)
        self.num_heads = list(num_heads)
        self._stats = {name: value.detach().to("cpu", torch.float64) for name, value in stats.items()}

    histogram = property(lambda self: self._stats["hist"])
    count = property(lambda self: self._stats["count"])

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
        """(L, H) quantile ``q`` from the histogram (error <= one bin width)."""
        return histogram_quantile(self.histogram, q)

    @property
    def layer_mean(self) -> Tensor:
        """(L,) token-weighted mean, heads pooled."""
        return self._ratio("sum", "count", pooled=True)

    @property
    def layer_std(self) -> Tensor:
        """(L,) standard deviation, heads pooled."""
        return self._std(pooled=True)

    def layer_quantile(self, q: float) -> Tensor:
        """(L,) quantile ``q``, heads pooled."""
        return histogram_quantile(self.histogram.sum(1), q)

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
    """

    def __init__(
        self,
        layers: Sequence[str],
        num_heads: Sequence[int],
        stats: Mapping[str, Tensor],
        max_nats: float,
    ) -> None:
        super().__init__(layers, num_heads, {name: stats[name] for name in _STATE_KINDS})
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
        and ``/nats_mean``; per head ``{prefix}/{layer}/head_{h}/mean`` and
        ``/q50``; overall ``{prefix}/mean``. Layers and heads with no counted
        query are left out rather than logged as NaN.
        """
        names = {q: _quantile_name(q) for q in quantiles}
        out: dict[str, float] = {}
        layer_quantiles = {q: self.layer_quantile(q) for q in quantiles}
        head_median = self.quantile(0.5)
        head_mean = self.mean
        layer_count = self.count.sum(-1)
        for index, layer in enumerate(self.layers):
            if layer_count[index] == 0:
                continue
            base = f"{prefix}/{layer}"
            out[f"{base}/mean"] = float(self.layer_mean[index])
            out[f"{base}/mean_seq"] = float(self.layer_mean_seq[index])
            for q, name in names.items():
                out[f"{base}/{name}"] = float(layer_quantiles[q][index])
            out[f"{base}/nats_mean"] = float(self.layer_nats_mean[index])
            if per_head:
                for head in range(self.num_heads[index]):
                    if self.count[index, head] > 0:
                        out[f"{base}/head_{head}/mean"] = float(head_mean[index, head])
                        out[f"{base}/head_{head}/q50"] = float(head_median[index, head])
        if self.count.sum() > 0:
            out[f"{prefix}/mean"] = self.overall_mean
        return out

    def __repr__(self) -> str:
        return (
            f"EntropySummary(layers={len(self.layers)}, heads={self.num_heads}, "
            f"queries={int(self.count.sum())}, mean={self.overall_mean:.4f})"
        )


def _quantile_name(q: float) -> str:
    percent = q * 100
    if abs(percent - round(percent)) > 1e-9:
        return "q" + f"{percent:g}".replace(".", "_")
    return f"q{round(percent):02d}"


class _LayerMetric(Metric):
    """Per-layer, sum-reduced states registered by name (shared by the metrics below).

    Subclasses name their state kinds and trailing shapes in
    :meth:`_state_kinds`; each registered layer gets one (heads, *trailing)
    float64 state per kind, named ``layer{index}_{kind}``.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, layers: Mapping[str, int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._layer_heads: dict[str, int] = {}
        if layers is not None:
            if not isinstance(layers, Mapping):
                raise TypeError(f"Expected `layers` to map layer name -> number of heads, got {type(layers).__name__}.")
            for name, heads in layers.items():
                self.register_layer(name, heads)

    def _state_kinds(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    @property
    def layers(self) -> list[str]:
        """Registered layer names, in registration order."""
        return list(self._layer_heads)

    def num_heads(self, layer: str) -> int:
        """Heads of a registered layer."""
        return self._layer_heads[layer]

    def register_layer(self, name: str, num_heads: int) -> None:
        """Add a layer's states (zeros). Registering the same layer again is a no-op.

        Raises:
            TypeError: ``name`` is not a string.
            ValueError: ``num_heads`` is not positive, or differs from an earlier
                registration of ``name``.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"Expected a non-empty layer name (str), got {name!r}.")
        _check_positive_int("num_heads", num_heads)
        if name in self._layer_heads:
            if self._layer_heads[name] != num_heads:
                raise ValueError(
                    f"Layer {name!r} was registered with {self._layer_heads[name]} heads, got {num_heads} now."
                )
            return
        index = len(self._layer_heads)
        self._layer_heads[name] = num_heads
        for kind, trailing in self._state_kinds().items():
            default = torch.zeros((num_heads, *trailing), dtype=torch.float64, device=self.device)
            self.add_state(f"layer{index}_{kind}", default=default, dist_reduce_fx="sum", persistent=True)

    def _state(self, index: int, kind: str) -> Tensor:
        state: Tensor = getattr(self, f"layer{index}_{kind}")
        return state

    def forward(self, layer: str, values: Tensor, *args: Any, **kwargs: Any) -> Any:
        """Update with one call and return the summary of that call alone."""
        # torchmetrics merges the batch state into the global one by name:
        # the layer must exist in both before it swaps them.
        if isinstance(values, Tensor) and values.dim() == 3:
            self.register_layer(layer, values.shape[1])
        return super().forward(layer, values, *args, **kwargs)

    def _add(self, index: int, kind: str, value: Tensor) -> None:
        name = f"layer{index}_{kind}"
        setattr(self, name, getattr(self, name) + value)

    def _stacked(self) -> tuple[list[int], dict[str, Tensor]]:
        """Every state as (L, H_max, ...), missing heads zero-padded."""
        heads = list(self._layer_heads.values())
        width = max(heads, default=0)
        stats = {}
        for kind, trailing in self._state_kinds().items():
            parts = []
            for index, count in enumerate(heads):
                state = self._state(index, kind)
                pad = [0] * (2 * (state.dim() - 1)) + [0, width - count]
                parts.append(torch.nn.functional.pad(state, pad))
            stats[kind] = torch.stack(parts) if parts else torch.zeros((0, 0, *trailing), dtype=torch.float64)
        return heads, stats

    def get_extra_state(self) -> dict[str, Any]:
        return {"layers": list(self._layer_heads.items())}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        saved = [(str(name), int(heads)) for name, heads in state["layers"]]
        current = list(self._layer_heads.items())
        # States are stored by registration index: the orders must agree.
        if current != saved[: len(current)]:
            raise ValueError(f"The state holds layers {saved}, in this order; this metric has {current}.")
        for name, heads in saved:
            self.register_layer(name, heads)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        # Layer states must exist before torchmetrics copies them in.
        extra = state_dict.get(prefix + "_extra_state")
        if extra is not None:
            self.set_extra_state(extra)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class AttentionEntropy(_LayerMetric):
    """Distribution of per-query attention entropy, per layer and per head.

    Feed it per-query entropy in nats with the number of valid keys of each
    query (from :mod:`attn_monitor.functional` and
    :class:`~attn_monitor.masks.Support`); it normalises, bins and sums.

    **Layers** are identified by name. Declare them up front with ``layers``
    (name -> number of heads) or let :meth:`update` register each new name on
    first sight, in call order. Under DDP every rank must register the same
    layers in the same order, because states are synchronised by name: pass
    ``layers``, or make sure every rank runs the same model over its
    monitored batches before the first ``compute()`` (what
    :mod:`attn_monitor.capture` does). :meth:`reset` zeroes the counts and
    keeps the registered layers.

    **Which queries count**: queries marked as samples with at least two valid
    keys. Real queries with one valid key (H = 0, normalised 0/0) and with no
    valid key are tallied in ``single_key`` and ``no_key``. With
    ``include_single_key=True`` one-key queries are also counted in the
    statistics, with normalised entropy 0 (all mass on the only key).

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
        self.num_bins = _check_positive_int("num_bins", num_bins)
        self.nats_bins = _check_positive_int("nats_bins", nats_bins)
        self.max_keys = _check_positive_int("max_keys", max_keys, minimum=2)
        self.max_nats = math.log(self.max_keys)
        self.include_single_key = bool(include_single_key)
        super().__init__(layers, **kwargs)

    def _state_kinds(self) -> dict[str, tuple[int, ...]]:
        trailing = {"hist": (self.num_bins,), "hist_nats": (self.nats_bins,)}
        return {kind: trailing.get(kind, ()) for kind in _STATE_KINDS}

    def update(
        self,
        layer: str,
        entropy: Tensor,
        num_valid: Tensor,
        is_sample: Tensor | None = None,
    ) -> None:
        """Add one attention call's per-query entropy.

        Args:
            layer: layer name; registered on first sight.
            entropy: (batch, heads, query) entropy in nats; values of queries
                that do not count (NaN included) are ignored.
            num_valid: valid keys per query, broadcastable to ``entropy``.
            is_sample: bool, broadcastable to ``entropy``; False for padding
                queries. None: every query is a sample.

        Raises:
            TypeError: wrong types or dtypes.
            ValueError: wrong shapes, a head count that differs from the
                layer's, NaN or out-of-range entropy on a counted query.
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
        num_valid = num_valid.to(self.device).expand(entropy.shape)
        real = torch.ones_like(entropy, dtype=torch.bool) if is_sample is None else is_sample.to(self.device)
        real = real.expand(entropy.shape)
        single, empty = real & (num_valid == 1), real & (num_valid == 0)
        counted = real & (num_valid > 1)
        if self.include_single_key:
            counted = counted | single
        values = entropy[counted]
        if torch.isnan(values).any():
            raise ValueError("`entropy` is NaN on queries that have valid keys and are samples.")
        limit = num_valid[counted].to(torch.float64).clamp(min=1).log()
        if (values < -1e-4).any() or (values > limit + 1e-3).any():
            raise ValueError("`entropy` must lie in [0, ln(num_valid)] on counted queries (nats, not normalised).")
        self.register_layer(layer, entropy.shape[1])
        index = self.layers.index(layer)

        normalized = torch.where(
            counted & (num_valid > 1), normalize_entropy(entropy, num_valid), torch.zeros_like(entropy)
        )
        nats = torch.where(counted, entropy.clamp(min=0.0), torch.zeros_like(entropy))
        weight = counted.to(torch.float64)

        self._add(index, "hist", _head_histogram(normalized, counted, self.num_bins, 1.0))
        self._add(index, "hist_nats", _head_histogram(nats, counted, self.nats_bins, self.max_nats))
        self._add(index, "count", weight.sum((0, 2)))
        self._add(index, "sum", (normalized * weight).sum((0, 2)))
        self._add(index, "sum_sq", (normalized.square() * weight).sum((0, 2)))
        self._add(index, "sum_nats", (nats * weight).sum((0, 2)))
        per_sequence = weight.sum(2)
        has_queries = per_sequence > 0
        sequence_mean = (normalized * weight).sum(2) / per_sequence.clamp(min=1)
        self._add(index, "seq_sum", torch.where(has_queries, sequence_mean, 0.0).sum(0))
        self._add(index, "seq_count", has_queries.to(torch.float64).sum(0))
        self._add(index, "single_key", single.to(torch.float64).sum((0, 2)))
        self._add(index, "no_key", empty.to(torch.float64).sum((0, 2)))

    def compute(self) -> EntropySummary:
        """Summary of everything accumulated since the last reset (collective under DDP)."""
        heads, stats = self._stacked()
        return EntropySummary(self.layers, heads, stats, self.max_nats)


def _head_histogram(values: Tensor, counted: Tensor, bins: int, high: float) -> Tensor:
    """(heads, bins) counts of ``values[counted]`` in equal bins over [0, high]."""
    heads = values.shape[1]
    bin_index = (values / high * bins).floor().clamp(0, bins - 1).to(torch.int64)
    head_index = torch.arange(heads, device=values.device)[None, :, None].expand_as(bin_index)
    flat = (head_index * bins + bin_index)[counted]
    return torch.bincount(flat, minlength=heads * bins).reshape(heads, bins).to(torch.float64)


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"tensor of dtype {value.dtype}"
    return type(value).__name__


_MASS_KINDS = ("hist", "count", "sum", "sum_sq")


class MassSummary(_Summary):
    """What :class:`AttentionMass` accumulated: per (key, head) distributions of a mass in [0, 1].

    Keys are ``{diagnostic}/{layer}``, e.g. ``sink_mass/blocks.0.attn``.
    """

    def to_dict(self, prefix: str = "attn", *, per_head: bool = False) -> dict[str, float]:
        """Scalars ``{prefix}_{diagnostic}/{layer}/mean``, ``/q50``, ``/q95``, ``/max_head_mean``
        (and ``/head_{h}/mean`` with ``per_head``); keys with no counted query are left out."""
        out: dict[str, float] = {}
        medians, tails, head_means = self.layer_quantile(0.5), self.layer_quantile(0.95), self.mean
        for index, key in enumerate(self.layers):
            if self.count[index].sum() == 0:
                continue
            base = f"{prefix}_{key}"
            out[f"{base}/mean"] = float(self.layer_mean[index])
            out[f"{base}/q50"] = float(medians[index])
            out[f"{base}/q95"] = float(tails[index])
            heads = head_means[index, : self.num_heads[index]]
            out[f"{base}/max_head_mean"] = float(heads.nan_to_num(nan=-math.inf).max())
            if per_head:
                for head in range(self.num_heads[index]):
                    if self.count[index, head] > 0:
                        out[f"{base}/head_{head}/mean"] = float(head_means[index, head])
        return out

    def __repr__(self) -> str:
        return f"MassSummary(keys={self.layers}, queries={int(self.count.sum())}, mean={self.overall_mean:.4f})"


class AttentionMass(_LayerMetric):
    """Distributions of per-query attention mass fractions, per key and head.

    The state behind the mass diagnostics (attention-sink mass, KV-eviction
    coverage, cross-document leakage): each key (``{diagnostic}/{layer}``)
    holds a histogram on [0, 1] and exact sums, all sum-reduced.

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
        self.num_bins = _check_positive_int("num_bins", num_bins)
        super().__init__(layers, **kwargs)

    def _state_kinds(self) -> dict[str, tuple[int, ...]]:
        return {kind: (self.num_bins,) if kind == "hist" else () for kind in _MASS_KINDS}

    def update(self, key: str, mass: Tensor, is_sample: Tensor | None = None) -> None:
        """Add per-query mass fractions.

        Args:
            key: ``{diagnostic}/{layer}``; registered on first sight.
            mass: (batch, heads, query) fractions in [0, 1]; NaN and queries
                that are not samples are ignored.
            is_sample: bool, broadcastable to ``mass``; None: all queries.

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
        counted = ~torch.isnan(mass)
        if is_sample is not None:
            counted = counted & is_sample.to(self.device).expand(mass.shape)
        values = mass[counted]
        if (values < -1e-6).any() or (values > 1 + 1e-6).any():
            raise ValueError("Expected `mass` in [0, 1] on counted queries.")
        self.register_layer(key, mass.shape[1])
        index = self.layers.index(key)
        mass = torch.where(counted, mass.clamp(0.0, 1.0), torch.zeros_like(mass))
        weight = counted.to(torch.float64)
        self._add(index, "hist", _head_histogram(mass, counted, self.num_bins, 1.0))
        self._add(index, "count", weight.sum((0, 2)))
        self._add(index, "sum", (mass * weight).sum((0, 2)))
        self._add(index, "sum_sq", (mass.square() * weight).sum((0, 2)))

    def compute(self) -> MassSummary:
        """Summary of everything accumulated since the last reset (collective under DDP)."""
        heads, stats = self._stacked()
        return MassSummary(self.layers, heads, stats)
