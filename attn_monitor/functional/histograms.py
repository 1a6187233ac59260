"""Fixed-bin histograms: quantiles read from bin counts, and coarser bins."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["coarsen", "histogram_quantile"]


def histogram_quantile(counts: Tensor, q: float, *, low: float = 0.0, high: float = 1.0) -> Tensor:
    """Quantile of values binned in equal-width bins over ``[low, high]``.

    Interpolates linearly inside the bin where the cumulative count crosses
    ``q``, so the error is at most one bin width.

    Args:
        counts: (..., bins) non-negative bin counts.
        q: quantile level in [0, 1].
        low: left edge of the first bin.
        high: right edge of the last bin.

    Returns:
        (...) quantiles; NaN where the histogram is empty.

    Raises:
        ValueError: ``q`` outside [0, 1].

    Example:
        >>> histogram_quantile(torch.tensor([0.0, 2.0, 2.0, 0.0]), 0.5)
        tensor(0.5000, dtype=torch.float64)
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"Expected quantile level `q` in [0, 1], got {q!r}.")
    counts = counts.to(torch.float64)
    bins = counts.shape[-1]
    total = counts.sum(-1, keepdim=True)
    cumulative = counts.cumsum(-1)
    target = q * total
    # The first bin whose cumulative count reaches the target holds counts, but at a target of 0
    # (q = 0) that is the first non-empty bin: the first whose cumulative count exceeds 0.
    index = torch.where(
        target > 0,
        torch.searchsorted(cumulative, target, side="left"),
        torch.searchsorted(cumulative, torch.zeros_like(target), side="right"),
    ).clamp(max=bins - 1)
    before = cumulative.gather(-1, index) - counts.gather(-1, index)
    inside = counts.gather(-1, index)
    fraction = ((target - before) / torch.where(inside > 0, inside, torch.ones_like(inside))).clamp(0.0, 1.0)
    width = (high - low) / bins
    value = low + (index.to(torch.float64) + fraction) * width
    return torch.where(total > 0, value, torch.full_like(value, math.nan)).squeeze(-1)


def coarsen(counts: Tensor, bins: int) -> Tensor:
    """Merge adjacent bins of ``counts`` (..., fine) into ``bins`` (fine must be a multiple).

    Example:
        >>> coarsen(torch.tensor([1.0, 2.0, 3.0, 4.0]), 2)
        tensor([3., 7.])
    """
    fine = counts.shape[-1]
    if bins < 1 or fine % bins:
        raise ValueError(f"Expected `bins` to divide the {fine} fine bins, got {bins}.")
    return counts.reshape(*counts.shape[:-1], bins, fine // bins).sum(-1)
