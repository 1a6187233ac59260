"""Key shards: per-query statistics of a slice of the keys, merged exactly (context parallelism, ring attention).

Each piece of a query's keys gives its logsumexp, its mean logit under its own
weights, its max and its visible count; they merge as ring attention merges
its outputs (docs/design.md §2)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from attn_monitor.functional.entropy import (
    DEFAULT_MEMORY_BUDGET,
    Method,
    _check_qk_values,
    _prepare_qk,
    _qk_pass,
)
from attn_monitor.functional.masks import Support
from attn_monitor.functional.probs import _compute_dtype
from attn_monitor.functional.statistics import attention_max_logit

__all__ = ["key_shard_statistics", "merge_key_shards"]


class KeyShardStatistics(NamedTuple):
    """What each query's attention over one shard of its keys says, enough to merge shards exactly.

    Attention over the union of disjoint key shards is the softmax of all
    their logits, so per query the shards' logsumexp, mean logit under their
    own weights, maximum and visible count determine it:
    ``lse = logsumexp_r lse_r`` and ``H = lse - sum_r exp(lse_r - lse) E_r[s]``
    (the algebra ring attention uses for its output). Built by
    :func:`key_shard_statistics`, combined by :func:`merge_key_shards`.

    Attributes:
        lse: (batch, heads, seq_q) logsumexp of the visible logits; ``-inf``
            where the shard holds no visible key.
        mean_logit: (batch, heads, seq_q) ``sum_j p_j s_j`` under the shard's
            own softmax; NaN where it holds no visible key.
        max_logit: (batch, heads, seq_q) the largest visible logit; NaN where none.
        num_valid: (batch, heads, seq_q) int64 visible keys.
    """

    lse: Tensor
    mean_logit: Tensor
    max_logit: Tensor
    num_valid: Tensor

    @property
    def entropy(self) -> Tensor:
        """(batch, heads, seq_q) entropy in nats over the keys these statistics cover; NaN where none is visible."""
        return (self.lse - self.mean_logit).clamp(min=0.0).masked_fill(self.num_valid == 0, math.nan)


def key_shard_statistics(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | Support | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    method: Method = "auto",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> KeyShardStatistics:
    """Per-query statistics of attention over the keys ``k`` holds, one shard of the full key set.

    Args:
        q, k, mask, is_causal, scale, method, memory_budget: as in
            :func:`entropy_from_qk`; ``k`` and ``mask`` cover this shard's keys only.

    Returns:
        The shard's :class:`KeyShardStatistics`, float32 (float64 for float64 input).

    Raises:
        TypeError, ValueError: as :func:`entropy_from_qk`.

    Example:
        >>> q = torch.zeros(1, 1, 1, 4)  # equal logits: each shard is uniform over its keys
        >>> halves = [key_shard_statistics(q, k) for k in torch.randn(1, 1, 5, 4).split([2, 3], dim=2)]
        >>> merged = merge_key_shards(halves)
        >>> merged.num_valid, torch.allclose(merged.entropy, torch.tensor(math.log(5.0)))
        (tensor([[[5]]]), True)
    """
    _check_qk_values(q, k, mask, scale)
    support, q, k, scale = _prepare_qk(q, k, mask, is_causal, scale, method, memory_budget)
    lse, entropy = _qk_pass(q, k, support, scale, method, memory_budget)
    num_valid = support.num_valid().to(lse.device).expand(lse.shape)
    empty = num_valid == 0
    max_logit = attention_max_logit(q, k, mask=support, scale=scale, memory_budget=memory_budget)
    return KeyShardStatistics(
        lse.masked_fill(empty, -math.inf), (lse - entropy).masked_fill(empty, math.nan), max_logit, num_valid
    )


def merge_key_shards(shards: Sequence[KeyShardStatistics]) -> KeyShardStatistics:
    """The statistics of attention over the union of disjoint key shards, exactly.

    Merged in float64: ``lse = logsumexp_r lse_r``, ``E[s] = sum_r exp(lse_r -
    lse) E_r[s]``, the maximum of the maxima and the sum of the counts.
    Shards with no visible key for a query add nothing to it; a query no
    shard shows a key gets ``-inf`` lse and NaN elsewhere. Merging is
    associative: merged statistics merge again.

    Args:
        shards: one :class:`KeyShardStatistics` per key shard, shapes broadcastable together.

    Returns:
        The merged :class:`KeyShardStatistics` (its ``entropy`` is the entropy
        over every shard's keys), in the widest dtype of the shards (float32 at least).

    Raises:
        TypeError: ``shards`` is empty or holds something else.

    Example:
        >>> one_key = KeyShardStatistics(
        ...     torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([1])
        ... )
        >>> merge_key_shards([one_key, one_key]).entropy  # two equal logits: ln 2
        tensor([0.6931])
    """
    if not shards or not all(isinstance(shard, KeyShardStatistics) for shard in shards):
        raise TypeError("Expected `shards` to be a non-empty sequence of KeyShardStatistics.")
    if not all(isinstance(value, Tensor) for shard in shards for value in shard):
        raise TypeError("Expected every field of every shard to be a torch.Tensor.")
    shapes = [tuple(value.shape) for shard in shards for value in shard]
    try:
        torch.broadcast_shapes(*shapes)
    except RuntimeError:
        raise ValueError(f"Expected the shards' statistics to broadcast together, got shapes {shapes}.") from None
    dtype = _compute_dtype(functools.reduce(torch.promote_types, (shard.lse.dtype for shard in shards)))
    lse, mean_logit, max_logit = (
        torch.stack(torch.broadcast_tensors(*(shard[field].double() for shard in shards))) for field in range(3)
    )
    num_valid = torch.stack(torch.broadcast_tensors(*(shard.num_valid for shard in shards))).sum(0)
    visible = torch.isfinite(lse)  # a shard with a visible key has a finite lse
    total = lse.logsumexp(0)
    weight = torch.where(visible, (lse - total).exp(), 0.0)
    merged_mean = torch.where(visible, weight * mean_logit.nan_to_num(0.0), 0.0).sum(0)
    peak = torch.where(visible, max_logit, -math.inf).amax(0)
    empty = num_valid == 0
    return KeyShardStatistics(
        total.masked_fill(empty, -math.inf).to(dtype),
        merged_mean.masked_fill(empty, math.nan).to(dtype),
        peak.masked_fill(empty, math.nan).to(dtype),
        num_valid,
    )
