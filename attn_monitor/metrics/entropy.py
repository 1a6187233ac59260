"""AttentionEntropy: running distributions of per-query entropy per layer and head, and their summary."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from attn_monitor.functional.masks import broadcasts_to
from attn_monitor.functional.probs import normalize_entropy
from attn_monitor.metrics.base import LayerMetric, _Summary, put_nonfinite, quantile_name
from attn_monitor.shared.checks import check_int
from attn_monitor.shared.names import head_name

__all__ = ["AttentionEntropy", "EntropySummary"]

#: Mean sink mass above which a head counts as a sink head (the sink rate's epsilon, as Gu et al. 2024).
SINK_THRESHOLD = 0.3


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
