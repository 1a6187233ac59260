"""A free bracket on each head's maximum attention logit, from what the entropy pass already has.

Per query, with ``p = softmax(s)`` over its visible keys, ``lse`` their
logsumexp and ``H`` the entropy of ``p`` in nats:

* ``H = sum_j p_j (lse - s_j) = lse - E_p[s]``, so ``lse - H = E_p[s]``, a
  mean of the logits, is at most their maximum;
* ``lse = log sum_j exp(s_j) >= log exp(max_j s_j)``.

So ``max_j s_j`` lies in ``[lse - H, lse]``, a bracket ``H`` nats wide that
closes as the head collapses (a query with one visible key: ``H = 0``, the
bracket is that key's logit). Over queries ``i`` with maxima ``m_i`` in
``[a_i, b_i]``: each ``a_i <= m_i <= max m``, and ``max m = m_{i*} <=
b_{i*} <= max b``, so the head's max logit lies in ``[max_i a_i, max_i b_i]``,
no wider than the widest query bracket (the largest ``H``, at most
``ln n``). Both ends are maxima: DDP-exact by max reduction.

Computed in the entropy pass's precision (float32 outside float64 models):
each end is as exact as that pass's ``lse`` and ``H``, about 1e-6 relative.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from attn_monitor.metrics.base import LayerMetric, copy_statistics
from attn_monitor.metrics.entropy import check_is_sample
from attn_monitor.shared.names import head_name

__all__ = ["BOUND_FAMILY", "LogitBound", "LogitBoundSummary"]

#: The family of the bound's names (training-step records add ``_train``).
BOUND_FAMILY = "attn_max_logit_bound"


class LogitBoundSummary:
    """What :class:`LogitBound` accumulated: per (layer, head) a bracket on the max logit.

    Attributes:
        layers: layer names in registration order.
        num_heads: heads of each layer.
        count: (L, H) counted queries.
    """

    def __init__(self, layers: Sequence[str], num_heads: Sequence[int], stats: Mapping[str, Tensor]) -> None:
        self.layers = list(layers)
        self.num_heads = list(num_heads)
        self._stats = copy_statistics(stats)

    count = property(lambda self: self._stats["count"])

    @property
    def lower(self) -> Tensor:
        """(L, H) ``max_i (lse_i - H_i)``: the head's max logit is at least this; NaN where none was counted."""
        return self._stats["lower"].masked_fill(self.count == 0, math.nan)

    @property
    def upper(self) -> Tensor:
        """(L, H) ``max_i lse_i``: the head's max logit is at most this; NaN where none was counted."""
        return self._stats["upper"].masked_fill(self.count == 0, math.nan)

    def to_dict(self, family: str = BOUND_FAMILY, *, per_head: bool = True) -> dict[str, float]:
        """``{family}/{layer}/lower|upper`` (the layer's max over heads) and
        ``{family}_heads/{layer}/head_{h}/lower|upper``; layers and heads with no counted query left out."""
        out: dict[str, float] = {}
        ends = {"lower": self._stats["lower"], "upper": self._stats["upper"]}
        head_count, layer_count = self.count.tolist(), self.count.sum(-1).tolist()
        values = {end: value.tolist() for end, value in ends.items()}
        layer_values = {end: value.amax(-1).tolist() for end, value in ends.items()}
        for index, layer in enumerate(self.layers):
            if layer_count[index] == 0:
                continue
            for end in ends:
                out[f"{family}/{layer}/{end}"] = layer_values[end][index]
                for head in range(self.num_heads[index]) if per_head else ():
                    if head_count[index][head] > 0:
                        out[head_name(family, layer, head, end)] = values[end][index][head]
        return out

    def __repr__(self) -> str:
        return f"LogitBoundSummary(layers={self.layers}, heads={self.num_heads})"


class LogitBound(LayerMetric):
    """Running per-head bracket ``[max(lse - H), max(lse)]`` on the max attention logit, DDP-exact.

    Both ends are max fields, the count a sum field. Queries that are not
    samples, or whose ``lse`` or ``H`` is not finite (no visible key, a
    diverging model), are left out.

    Args:
        layers: optional mapping layer name -> number of heads to register now.
        kwargs: passed to :class:`torchmetrics.Metric`.

    Example:
        >>> metric = LogitBound()
        >>> lse = torch.tensor([[[2.0, 5.0]]])  # one head, two queries
        >>> metric.update("layer.0", lse, entropy=torch.tensor([[[0.5, 1.0]]]))
        >>> summary = metric.compute()
        >>> summary.lower, summary.upper
        (tensor([[4.]], dtype=torch.float64), tensor([[5.]], dtype=torch.float64))
    """

    def __init__(self, layers: Mapping[str, int] | None = None, **kwargs: Any) -> None:
        super().__init__(layers, sum_fields={"count": ()}, max_fields={"lower": (), "upper": ()}, config={}, **kwargs)

    def update(
        self,
        layer: str,
        lse: Tensor,
        entropy: Tensor,
        is_sample: Tensor | None = None,
        *,
        head_offset: int = 0,
        num_heads: int | None = None,
    ) -> None:
        """Add one call's per-query logsumexp and entropy in nats.

        Args:
            layer: layer name; registered on first sight.
            lse: (batch, heads, query) logsumexp of the visible logits.
            entropy: (batch, heads, query) entropy in nats of the same softmax.
            is_sample: bool, broadcastable to ``lse``; None: every query.
            head_offset, num_heads: as in :meth:`~attn_monitor.metrics.entropy.AttentionEntropy.update`.

        Raises:
            TypeError: non-float values, a non-bool ``is_sample``.
            ValueError: shapes that disagree or are not (batch, heads, query).
        """
        for name, value in (("lse", lse), ("entropy", entropy)):
            if not isinstance(value, Tensor) or not value.dtype.is_floating_point:
                raise TypeError(f"Expected `{name}` to be a floating point tensor, got {type(value).__name__}.")
        if lse.dim() != 3 or lse.shape != entropy.shape:
            raise ValueError(
                f"Expected `lse` and `entropy` of one (batch, heads, query) shape, got {tuple(lse.shape)} and "
                f"{tuple(entropy.shape)}."
            )
        check_is_sample(is_sample, tuple(lse.shape))
        upper = lse.detach().to(self.device, torch.float64)
        lower = upper - entropy.detach().to(self.device, torch.float64)
        counted = torch.isfinite(lower) & torch.isfinite(upper)
        if is_sample is not None:
            counted = counted & is_sample.to(self.device)
        hidden = torch.full((), -math.inf, dtype=torch.float64, device=self.device)
        self.register_heads(layer, lse.shape[1], head_offset, num_heads)
        self.accumulate(
            layer,
            head_offset,
            count=counted.sum((0, 2)),
            lower=torch.where(counted, lower, hidden).amax((0, 2)),
            upper=torch.where(counted, upper, hidden).amax((0, 2)),
        )

    def compute(self) -> LogitBoundSummary:
        """Summary of everything accumulated since the last reset (collective under DDP)."""
        return LogitBoundSummary(self.layers, self.head_counts, self._field_views())
