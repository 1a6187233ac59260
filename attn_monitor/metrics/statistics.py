"""Per-head maximum attention logit and mean attention distance, from the calls entropy sees.

Two screening numbers per (layer, head), computed from the captured q, k and
support (never an N x N matrix) by
:func:`~attn_monitor.functional.statistics.attention_max_logit` and
:func:`~attn_monitor.functional.statistics.attention_distance`:

* **max logit**: the largest ``scale * q.k`` (plus any additive bias) a
  counted query gives a visible key, maximised over every counted query
  seen. QK-clip style recipes watch it because logit growth comes before
  entropy collapse and loss spikes. It depends on ``scale`` and on the key
  norms, so it compares one model with itself over training, not models with
  each other. Modules that return probabilities (Hugging Face eager
  attention) do not return logits: no max logit for them.
* **mean attention distance**: ``E|i - j|`` in positions under each query's
  attention distribution (the ViT paper's local-versus-global picture),
  averaged over counted queries. It grows with sequence length and depends
  on the mask (a causal query ``i`` can reach at most ``i`` back), so
  compare heads at one length and mask. Self-attention only.

Counted queries are the samples entropy uses: real queries of the call's own
sequence with at least one visible key. :class:`AttentionStatistics` holds
the running, DDP-exact state (the max reduces by max, the distance sums by
sum); :class:`StatisticsUpdate` is the capture consumer that fills it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from attn_monitor.metrics.base import LayerMetric, copy_statistics, put_nonfinite
from attn_monitor.metrics.entropy import check_is_sample
from attn_monitor.shared.names import head_name

__all__ = ["AttentionStatistics", "StatisticsSummary", "check_clip_threshold"]

_SUM_FIELDS = ("logit_count", "logit_nonfinite", "distance_sum", "distance_count", "distance_nonfinite")


def check_clip_threshold(threshold: object, name: str = "threshold") -> None:
    """Raise unless ``threshold`` (the QK-Clip dry run's tau, argument ``name``) is a positive finite number.

    Raises:
        ValueError: anything else (a bool, a string, zero, a negative number, inf or NaN).
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf:
        raise ValueError(f"Expected the clip `{name}` to be a positive finite number, got {threshold!r}.")


class StatisticsSummary:
    """What :class:`AttentionStatistics` accumulated, per (layer, head).

    Attributes:
        layers: layer names in registration order.
        num_heads: heads of each layer.
        logit_count, distance_count: (L, H) counted queries of each statistic.
        logit_nonfinite, distance_nonfinite: (L, H) counted queries left out
            because their value was NaN or infinite (a diverging model).
    """

    def __init__(self, layers: Sequence[str], num_heads: Sequence[int], stats: Mapping[str, Tensor]) -> None:
        self.layers = list(layers)
        self.num_heads = list(num_heads)
        self._stats = copy_statistics(stats)

    logit_count = property(lambda self: self._stats["logit_count"])
    logit_nonfinite = property(lambda self: self._stats["logit_nonfinite"])
    distance_count = property(lambda self: self._stats["distance_count"])
    distance_nonfinite = property(lambda self: self._stats["distance_nonfinite"])

    @property
    def max_logit(self) -> Tensor:
        """(L, H) largest logit over every counted query; NaN where none was counted."""
        return self._stats["max_logit"].masked_fill(self.logit_count == 0, math.nan)

    @property
    def layer_max_logit(self) -> Tensor:
        """(L,) largest logit over the layer's heads; NaN where none was counted."""
        peak = self._stats["max_logit"].amax(-1)
        return peak.masked_fill(self.logit_count.sum(-1) == 0, math.nan)

    def clip_factors(self, threshold: float) -> Tensor:
        """(L, H) the factor a QK-Clip at ``threshold`` would scale each head's logits by: ``min(1, tau / max_logit)``.

        A dry run of the clip (Kimi K2's recipe, tau = 100): 1 where the head's
        max logit is at most ``threshold``, NaN where none was counted. A
        function of the max-reduced state, so exact under DDP and tensor
        parallelism (heads are global).

        Raises:
            ValueError: ``threshold`` is not a positive finite number.

        Example:
            >>> metric = AttentionStatistics()
            >>> metric.update("layer.0", max_logit=torch.tensor([[[50.0], [400.0]]]))
            >>> metric.compute().clip_factors(100.0)
            tensor([[1.0000, 0.2500]], dtype=torch.float64)
        """
        check_clip_threshold(threshold)
        peak = self.max_logit
        factor = (threshold / peak.clamp(min=threshold)).to(torch.float64)
        return factor.masked_fill(peak.isnan(), math.nan)

    def clipped_heads(self, threshold: float) -> Tensor:
        """(L,) heads per layer a QK-Clip at ``threshold`` would rescale (max logit above it)."""
        return (self.clip_factors(threshold) < 1).sum(-1).to(torch.float64)

    @property
    def distance(self) -> Tensor:
        """(L, H) token-weighted mean attention distance in positions; NaN where none was counted."""
        count = self.distance_count
        return torch.where(count > 0, self._stats["distance_sum"] / count.clamp(min=1), math.nan)

    @property
    def layer_distance(self) -> Tensor:
        """(L,) token-weighted mean distance, heads pooled."""
        count = self.distance_count.sum(-1)
        return torch.where(count > 0, self._stats["distance_sum"].sum(-1) / count.clamp(min=1), math.nan)

    def to_dict(
        self, prefix: str = "attn", *, per_head: bool = True, clip_threshold: float | None = None
    ) -> dict[str, float]:
        """Flat scalar names for loggers.

        Per layer ``{prefix}_max_logit/{layer}/max`` (over heads and counted
        queries) and ``{prefix}_distance/{layer}/mean`` (heads pooled); per
        head ``{prefix}_max_logit_heads/{layer}/head_{h}/max`` and
        ``{prefix}_distance_heads/{layer}/head_{h}/mean``. Layers and heads with
        no counted query are left out; ``/nonfinite`` counts queries left out
        for a NaN or infinite value, where there were any.

        With ``clip_threshold`` (the QK-Clip dry run, :meth:`clip_factors`):
        ``{prefix}_qk_clip/{layer}/clipped_heads`` and per head
        ``{prefix}_qk_clip_heads/{layer}/head_{h}/factor``.
        """
        out: dict[str, float] = {}
        families = (
            ("max_logit", "max", self.logit_count, self.logit_nonfinite, self.layer_max_logit, self.max_logit),
            ("distance", "mean", self.distance_count, self.distance_nonfinite, self.layer_distance, self.distance),
        )
        for family, statistic, count, nonfinite, layer_value, head_value in families:
            # Each tensor to Python floats once: indexing element by element costs more than the math.
            layer_count, layer_nonfinite = count.sum(-1).tolist(), nonfinite.sum(-1).tolist()
            head_count, layer_values, head_values = count.tolist(), layer_value.tolist(), head_value.tolist()
            for index, layer in enumerate(self.layers):
                base = f"{prefix}_{family}/{layer}"
                put_nonfinite(out, base, layer_nonfinite[index])
                if layer_count[index] == 0:
                    continue
                out[f"{base}/{statistic}"] = layer_values[index]
                if per_head:
                    for head in range(self.num_heads[index]):
                        if head_count[index][head] > 0:
                            out[head_name(f"{prefix}_{family}", layer, head, statistic)] = head_values[index][head]
        if clip_threshold is not None:
            self._put_clip(out, prefix, clip_threshold, per_head)
        return out

    def _put_clip(self, out: dict[str, float], prefix: str, threshold: float, per_head: bool) -> None:
        """Add the QK-Clip dry run's names (see :meth:`to_dict`) for layers with a counted max logit."""
        factors, clipped = self.clip_factors(threshold).tolist(), self.clipped_heads(threshold).tolist()
        head_count, layer_count = self.logit_count.tolist(), self.logit_count.sum(-1).tolist()
        for index, layer in enumerate(self.layers):
            if layer_count[index] == 0:
                continue
            out[f"{prefix}_qk_clip/{layer}/clipped_heads"] = clipped[index]
            if per_head:
                for head in range(self.num_heads[index]):
                    if head_count[index][head] > 0:
                        out[head_name(f"{prefix}_qk_clip", layer, head, "factor")] = factors[index][head]

    def __repr__(self) -> str:
        return f"StatisticsSummary(layers={self.layers}, heads={self.num_heads})"


class AttentionStatistics(LayerMetric):
    """Running per-head maximum logit and mean attention distance, DDP-exact.

    Per (layer, head): the maximum logit (a max field), the distance sum and
    the counts (sum fields), so a sync is exact whatever the sharding.
    Queries that are not samples are ignored; samples whose value is NaN or
    infinite are left out and tallied (``logit_nonfinite``,
    ``distance_nonfinite``).

    Args:
        layers: optional mapping layer name -> number of heads to register now.
        kwargs: passed to :class:`torchmetrics.Metric`.

    Example:
        >>> metric = AttentionStatistics()
        >>> metric.update(
        ...     "layer.0",
        ...     max_logit=torch.tensor([[[1.0, 5.0], [2.0, 3.0]]]),
        ...     distance=torch.tensor([[[0.0, 1.0], [2.0, 2.0]]]),
        ... )
        >>> summary = metric.compute()
        >>> summary.max_logit, summary.distance
        (tensor([[5., 3.]], dtype=torch.float64), tensor([[0.5000, 2.0000]], dtype=torch.float64))
    """

    def __init__(self, layers: Mapping[str, int] | None = None, **kwargs: Any) -> None:
        super().__init__(
            layers, sum_fields=dict.fromkeys(_SUM_FIELDS, ()), max_fields={"max_logit": ()}, config={}, **kwargs
        )

    def update(
        self,
        layer: str,
        *,
        max_logit: Tensor | None = None,
        distance: Tensor | None = None,
        is_sample: Tensor | None = None,
        head_offset: int = 0,
        num_heads: int | None = None,
    ) -> None:
        """Add one call's per-query values (either may be left out).

        Args:
            layer: layer name; registered on first sight.
            max_logit: (batch, heads, query) largest logit of each query.
            distance: (batch, heads, query) mean attention distance, >= 0.
            is_sample: bool, broadcastable to the values; None: every query.
            head_offset, num_heads: as in :meth:`~attn_monitor.metrics.entropy.AttentionEntropy.update`.

        Raises:
            TypeError: wrong types or dtypes.
            ValueError: wrong shapes, two values of different shapes, a
                negative distance on a counted query, a head count that
                differs from the layer's.
        """
        given = {name: value for name, value in (("max_logit", max_logit), ("distance", distance)) if value is not None}
        shape = None
        for name, value in given.items():
            if not isinstance(value, Tensor) or not value.dtype.is_floating_point:
                raise TypeError(f"Expected `{name}` to be a floating point tensor, got {type(value).__name__}.")
            if value.dim() != 3:
                raise ValueError(
                    f"Expected `{name}` with 3 dims (batch, heads, query), got shape {tuple(value.shape)}."
                )
            if shape is not None and tuple(value.shape) != shape:
                raise ValueError(
                    f"Expected `max_logit` and `distance` of one shape, got {shape} and {tuple(value.shape)}."
                )
            shape = tuple(value.shape)
        if shape is None:
            return
        check_is_sample(is_sample, shape)
        sample = torch.ones(shape, dtype=torch.bool, device=self.device)
        if is_sample is not None:
            sample = sample & is_sample.to(self.device)
        fields: dict[str, Tensor] = {}
        for name, value in given.items():
            value = value.detach().to(self.device, torch.float64)
            finite = torch.isfinite(value)
            counted = sample & finite
            if name == "distance" and (counted & (value < -1e-6)).any():
                raise ValueError("Expected `distance` >= 0 on counted queries (positions).")
            prefix = "logit" if name == "max_logit" else "distance"
            fields[f"{prefix}_count"] = counted.sum((0, 2))
            fields[f"{prefix}_nonfinite"] = (sample & ~finite).sum((0, 2))
            if name == "max_logit":
                fields["max_logit"] = value.masked_fill(~counted, -math.inf).amax((0, 2))
            else:
                fields["distance_sum"] = torch.where(counted, value.clamp(min=0.0), 0.0).sum((0, 2))
        self.register_heads(layer, shape[1], head_offset, num_heads)
        self.accumulate(layer, head_offset, **fields)

    def forward(self, layer: str, *args: Any, **kwargs: Any) -> Any:
        """Update with one call and return the summary of that call alone."""
        for value in (*args, kwargs.get("max_logit"), kwargs.get("distance")):
            if isinstance(value, Tensor) and value.dim() == 3:
                self.register_heads(layer, value.shape[1], kwargs.get("head_offset", 0), kwargs.get("num_heads"))
                break
        return super(LayerMetric, self).forward(layer, *args, **kwargs)

    def compute(self) -> StatisticsSummary:
        """Summary of everything accumulated since the last reset (collective under DDP)."""
        return StatisticsSummary(self.layers, self.head_counts, self._field_views())
