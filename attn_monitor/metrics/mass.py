"""Attention mass on a subset of each query's support, per layer and head: sinks, eviction coverage, leakage."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from attn_monitor.functional.masks import broadcasts_to
from attn_monitor.metrics.base import LayerMetric, _Summary, put_nonfinite
from attn_monitor.metrics.entropy import SINK_THRESHOLD, _describe, _head_histogram
from attn_monitor.shared.checks import check_int
from attn_monitor.shared.names import head_name

__all__ = ["AttentionMass", "MassSummary"]


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
