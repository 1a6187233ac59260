"""Entropy of attention given as weights or logits, and the shared input checks.

For one query with attention weights ``p`` over its valid keys (its support),
``H(p) = -sum_i p_i ln p_i`` in nats and ``H / ln(n)`` normalised to [0, 1],
where ``n`` is the number of valid keys (docs/design.md §2)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from attn_monitor.functional.masks import broadcasts_to, log_count

__all__ = ["attention_entropy", "entropy_from_logits", "normalize_entropy", "restrict_to_support"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_4d(name: str, value: object, layout: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"Expected `{name}` to be a torch.Tensor, got {type(value).__name__}.")
    if value.dim() != 4:
        raise ValueError(f"Expected `{name}` with 4 dims {layout}, got shape {tuple(value.shape)}.")
    if not value.dtype.is_floating_point:
        raise TypeError(f"Expected `{name}` with a floating point dtype, got {value.dtype}.")
    if value.numel() == 0:
        raise ValueError(f"Expected `{name}` without empty dims {layout}, got shape {tuple(value.shape)}.")
    return value


def _check_bool_mask(mask: object, shape: torch.Size) -> Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"Expected `mask` to be a bool torch.Tensor or None, got {type(mask).__name__}.")
    if mask.dtype != torch.bool:
        raise TypeError(f"Expected `mask` with dtype torch.bool (True = visible key), got {mask.dtype}.")
    if not broadcasts_to(tuple(mask.shape), tuple(shape)):
        raise ValueError(
            f"Expected `mask` broadcastable to {tuple(shape)} (batch, heads, query, key), "
            f"got shape {tuple(mask.shape)}."
        )
    return mask


def normalize_entropy(entropy: Tensor, num_valid: Tensor) -> Tensor:
    """Divide entropy in nats by ``ln(num_valid)``, giving values in [0, 1].

    Args:
        entropy: per-query entropy in nats, any shape.
        num_valid: number of valid keys per query, broadcastable to ``entropy``.

    Returns:
        Normalised entropy with ``entropy``'s broadcast shape, float32 or
        float64; NaN where ``num_valid <= 1`` (never divides by ``ln 1``).

    Raises:
        TypeError: arguments that are not tensors, or ``entropy`` not floating point.
        ValueError: shapes that do not broadcast together.

    Example:
        >>> normalize_entropy(torch.tensor([math.log(4.0), 0.0, 0.0]), torch.tensor([4, 1, 0]))
        tensor([1., nan, nan])
    """
    _check_pair("entropy", entropy, "num_valid", num_valid)
    entropy = entropy.to(_compute_dtype(entropy.dtype))
    count = num_valid.to(entropy.dtype)
    has_choice = count > 1
    denominator = torch.where(has_choice, count, torch.full_like(count, 2.0)).log()
    return torch.where(
        has_choice, (entropy / denominator).clamp(0.0, 1.0), torch.full_like(entropy * denominator, math.nan)
    )


def _finish(entropy: Tensor, num_valid: Tensor, normalize: bool, log_bound: Tensor | None = None) -> Tensor:
    """Apply the shared NaN rules and bounds to raw per-query entropy.

    ``log_bound``: :func:`~attn_monitor.functional.masks.log_count` of ``num_valid`` in
    ``entropy``'s dtype, when the caller has it (:meth:`Support.log_num_valid`).
    """
    if log_bound is None:
        log_bound = log_count(num_valid, entropy.dtype)
    # ln(count) bounds the entropy; NaN (no visible key) propagates through the clamp.
    # ``add_(0.0)`` turns the -0.0 of a one-hot row into 0.0.
    zero = torch.zeros((), dtype=entropy.dtype, device=entropy.device)
    entropy = torch.clamp(entropy, min=zero, max=log_bound).add_(0.0)
    return normalize_entropy(entropy, num_valid.to(entropy.device)) if normalize else entropy


def attention_entropy(
    attn: Tensor,
    mask: Tensor | None = None,
    *,
    normalize: bool = False,
    no_mass: Literal["raise", "nan"] = "raise",
) -> Tensor:
    """Entropy of each query's attention distribution, from probabilities.

    The weights are restricted to the support given by ``mask`` and
    renormalised there (:func:`restrict_to_support`), so masked slots may hold
    zeros or small leftovers.

    Args:
        attn: (batch, heads, query, key) attention probabilities.
        mask: bool, broadcastable to ``attn``; True = the key is visible to the
            query (the SDPA convention). None means every key is valid.
        normalize: divide by ``ln(number of valid keys)``.
        no_mass: what a query whose weights put no mass on its non-empty
            support gets: ``"raise"`` (the mask does not match the weights) or
            ``"nan"`` (for callers that expect it, e.g. weights after dropout,
            and leave those queries out).

    Returns:
        (batch, heads, query) entropy in nats, or normalised to [0, 1].

    Raises:
        TypeError: ``attn`` or ``mask`` of the wrong type or dtype.
        ValueError: wrong shapes; NaN, inf or negative weights; a query whose
            weights put no mass on its (non-empty) support, with
            ``no_mass="raise"``.

    Example:
        >>> uniform = torch.full((1, 1, 1, 4), 0.25)
        >>> attention_entropy(uniform, normalize=True)
        tensor([[[1.]]])
        >>> one_hot = torch.tensor([[[[0.0, 1.0, 0.0, 0.0]]]])
        >>> attention_entropy(one_hot, normalize=True)
        tensor([[[0.]]])
    """
    if no_mass not in ("raise", "nan"):
        raise ValueError(f"Expected `no_mass` in ('raise', 'nan'), got {no_mass!r}.")
    probs, stranded = restrict_to_support(attn, mask)
    if no_mass == "raise" and stranded.any():
        raise ValueError(
            f"`attn` puts zero mass on the support of {int(stranded.sum())} queries that have valid keys; "
            "the mask does not match the weights."
        )
    if mask is None:
        num_valid = torch.full(probs.shape[:-1], probs.shape[-1], device=probs.device)
    else:
        num_valid = mask.expand(probs.shape).sum(-1)
    entropy = _finish(-torch.special.xlogy(probs, probs).sum(-1), num_valid, normalize)
    return entropy.masked_fill(stranded, math.nan)


def _logits_entropy(scores: Tensor, visible: Tensor | None) -> Tensor:
    """Entropy of softmax(scores) over visible keys; NaN where none is visible.

    One fused softmax and ``entr(p) = -p ln p`` (0 at p = 0), so hidden keys
    add nothing; a row with no visible key comes out NaN from the softmax.
    """
    if visible is not None:
        scores = scores.masked_fill(~visible, -math.inf)
    entropy: Tensor = torch.special.entr(scores.softmax(-1)).sum(-1)
    return entropy


def entropy_from_logits(scores: Tensor, mask: Tensor | None = None, *, normalize: bool = False) -> Tensor:
    """Entropy of ``softmax(scores)`` per query, for callers that hold scores.

    Args:
        scores: (batch, heads, query, key) attention logits, before softmax.
            Without ``mask``, keys whose logit is ``-inf`` are taken as masked
            (the additive-mask convention).
        mask: bool, broadcastable to ``scores``; True = visible. When given,
            it alone decides the support.
        normalize: divide by ``ln(number of valid keys)``.

    Returns:
        (batch, heads, query) entropy in nats, or normalised to [0, 1].

    Raises:
        TypeError: wrong types or dtypes.
        ValueError: wrong shapes, NaN or ``+inf`` logits, a visible key with a
            ``-inf`` logit.

    Example:
        >>> entropy_from_logits(torch.zeros(1, 1, 1, 8), normalize=True).round(decimals=4)
        tensor([[[1.]]])
        >>> entropy_from_logits(torch.tensor([[[[0.0, -math.inf]]]]))
        tensor([[[0.]]])
    """
    scores = _check_4d("scores", scores, "(batch, heads, query, key)")
    mask = _check_bool_mask(mask, scores.shape)
    if torch.isnan(scores).any() or (scores == math.inf).any():
        raise ValueError("Expected `scores` without NaN or +inf values.")
    scores = scores.to(_compute_dtype(scores.dtype))
    finite = scores > -math.inf
    if mask is None:
        visible = finite
    else:
        if (mask & ~finite).any():
            raise ValueError("`mask` marks keys visible whose logit is -inf; their weight would be 0, not a choice.")
        visible = mask
    num_valid = visible.expand(scores.shape).sum(-1)
    return _finish(_logits_entropy(scores, visible), num_valid, normalize)


def all_finite(value: Tensor) -> bool:
    """Whether every element of ``value`` is finite.

    A float32 sum is NaN or inf when any term is (or, harmlessly, when it
    overflows) and costs a tenth of an elementwise ``isfinite`` on CPU; the
    exact check runs only when the sum is not finite.
    """
    if math.isfinite(value.sum(dtype=_compute_dtype(value.dtype)).item()):
        return True
    return bool(torch.isfinite(value).all())


def restrict_to_support(attn: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention weights restricted to each query's support and renormalised there.

    The one place where probabilities a model returned become a distribution
    over the valid keys (docs/design.md §2): masked slots are zeroed, whatever they
    held, and each row is divided by its mass on the support.

    Args:
        attn: (batch, heads, query, key) attention probabilities.
        mask: bool, broadcastable to ``attn``; True = visible. None: every key.

    Returns:
        ``(weights, no_mass)``: (batch, heads, query, key) weights, float32
        (float64 for float64 input), zero off the support, summing to 1 on it;
        and (batch, heads, query) bool, True for queries whose non-empty
        support holds no mass (all their weights are 0), e.g. after dropout.

    Raises:
        TypeError: ``attn`` or ``mask`` of the wrong type or dtype.
        ValueError: wrong shapes; NaN, inf or negative weights.

    Example:
        >>> weights, no_mass = restrict_to_support(
        ...     torch.tensor([[[[0.5, 0.3, 0.2], [0.0, 0.0, 1.0]]]]), torch.tensor([True, True, False])
        ... )
        >>> weights
        tensor([[[[0.6250, 0.3750, 0.0000],
                  [0.0000, 0.0000, 0.0000]]]])
        >>> no_mass
        tensor([[[False,  True]]])
    """
    attn = _check_4d("attn", attn, "(batch, heads, query, key)")
    mask = _check_bool_mask(mask, attn.shape)
    if not all_finite(attn):
        raise ValueError("Expected `attn` to hold finite probabilities, got NaN or inf values.")
    if (attn < 0).any():
        raise ValueError(f"Expected `attn` to hold non-negative probabilities, got minimum {attn.min().item():.3g}.")
    weights = attn.to(_compute_dtype(attn.dtype))
    if mask is not None:
        weights = torch.where(mask, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    mass = weights.sum(-1, keepdim=True)
    weights = weights / torch.where(mass > 0, mass, torch.ones_like(mass))
    no_mass = mass.squeeze(-1) == 0
    if mask is not None:
        no_mass = no_mass & mask.any(-1)
    return weights, no_mass.expand(attn.shape[:-1])


def _check_pair(name: str, value: object, other_name: str, other: object) -> None:
    """Two tensors that broadcast together, the first floating point."""
    if not isinstance(value, Tensor):
        raise TypeError(f"Expected `{name}` to be a torch.Tensor, got {type(value).__name__}.")
    if not isinstance(other, Tensor):
        raise TypeError(f"Expected `{other_name}` to be a torch.Tensor, got {type(other).__name__}.")
    if not value.dtype.is_floating_point:
        raise TypeError(f"Expected `{name}` with a floating point dtype, got {value.dtype}.")
    if not all(a == b or 1 in (a, b) for a, b in zip(reversed(value.shape), reversed(other.shape), strict=False)):
        raise ValueError(
            f"Expected `{name}` and `{other_name}` to broadcast together, "
            f"got shapes {tuple(value.shape)} and {tuple(other.shape)}."
        )
