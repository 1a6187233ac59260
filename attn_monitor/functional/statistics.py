"""Max logit and mean attention distance per query, from q and k or from weights: the statistics beside entropy."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attn_monitor.functional.entropy import (
    DEFAULT_MEMORY_BUDGET,
    LARGE_LOGIT,
    Rescore,
    ScoreMod,
    _check_qk_values,
    _is_large,
    _over_query_blocks,
    _prepare_qk,
)
from attn_monitor.functional.masks import Support
from attn_monitor.functional.probs import (
    restrict_to_support,
)

__all__ = ["attention_distance", "attention_max_logit", "distance_from_probs", "max_logit_from_logits"]


def attention_max_logit(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | Support | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Tensor:
    """Largest attention logit each query gives a visible key, without the matrix.

    The per-head maximum logit ``max_j (scale * q.k_j + bias_j)`` over the
    query's support is what QK-clip style recipes watch: logit growth comes
    before entropy collapse and loss spikes. It depends on ``scale`` and on
    the keys' norms, so compare it across runs of one model only.

    Computed over query blocks of at most ``memory_budget`` bytes of scores,
    skipping key ranges the structure hides (O(B H N D) memory); the peak
    key's logit is then recomputed in float64, so even a maximum near zero
    keeps float32's relative precision.

    Args:
        q, k, mask, is_causal, scale, score_mod, memory_budget: as in
            :func:`entropy_from_qk` (GQA keys allowed; an additive float
            ``mask`` adds its bias to the logits; with a ``score_mod`` the
            logit is the modified one, what the softmax receives).

    Returns:
        (batch, heads, seq_q) maximum logits, float32 (float64 for float64
        input); NaN where a query has no visible key.

    Raises:
        TypeError, ValueError: as :func:`entropy_from_qk`.

    Example:
        >>> q = torch.ones(1, 1, 3, 4)
        >>> k = torch.arange(3.0)[None, None, :, None].expand(1, 1, 3, 4)  # logit of key j: 2 j
        >>> attention_max_logit(q, k, is_causal=True)
        tensor([[[0., 2., 4.]]])
        >>> attention_max_logit(q, k, mask=torch.zeros(3, 3, dtype=torch.bool))
        tensor([[[nan, nan, nan]]])
    """
    _check_qk_values(q, k, mask, scale, score_mod)
    support, q, k, scale = _prepare_qk(q, k, mask, is_causal, scale, "chunked", memory_budget)

    def exact_max(scores: Tensor, q_start: int, k_start: int, rescore: Rescore) -> tuple[Tensor, ...]:
        if score_mod is not None:  # the modified logits, all of the block's in float64
            return (rescore(torch.float64).amax(-1),)
        return (_logit_at_argmax(q, k, support, scale, scores, q_start, k_start),)

    return _over_query_blocks(q, k, support, scale, memory_budget, exact_max, score_mod=score_mod)[0]


def _logit_at_argmax(
    q: Tensor, k: Tensor, support: Support, scale: float, scores: Tensor, q_start: int, k_start: int
) -> Tensor:
    """Each row's largest logit, recomputed in float64 at the key where the block's scores peak.

    The float32 block finds the key; one float64 dot product per query gives
    its logit, so a maximum near zero keeps its relative precision.
    """
    batch, heads, rows, _ = scores.shape
    index = scores.argmax(-1)
    batch_index = torch.arange(batch, device=q.device)[:, None, None]
    key_heads = (torch.arange(heads, device=q.device) // (heads // k.shape[1]))[None, :, None]
    keys = k[batch_index, key_heads, index + k_start].double()
    logit = (q[:, :, q_start : q_start + rows].double() * keys).sum(-1) * scale
    bias = support.bias_block(q_start, q_start + rows, k_start, k_start + scores.shape[-1])
    if bias is not None:
        bias = bias.to(q.device).expand(batch, heads, rows, scores.shape[-1])
        logit = logit + bias.gather(-1, index[..., None]).squeeze(-1).double()
    # Rows with no visible key peak at -inf; the caller turns them into NaN.
    return torch.where(scores.amax(-1) == -math.inf, -math.inf, logit)


def _block_distance(scores: Tensor, q_start: int, k_start: int, rescore: Rescore) -> tuple[Tensor, ...]:
    """E|i - j| under softmax(scores) for one query block; exact float64 scores where logits are large."""
    if scores.dtype != torch.float64 and _is_large(scores.logsumexp(-1)):
        # Large logits: float32 scores lose the digits softmax weights depend on.
        scores = rescore(torch.float64)
    rows = torch.arange(q_start, q_start + scores.shape[-2], device=scores.device, dtype=scores.dtype)
    cols = torch.arange(k_start, k_start + scores.shape[-1], device=scores.device, dtype=scores.dtype)
    distance = (rows[:, None] - cols[None, :]).abs()
    weights = scores.softmax(-1)
    return ((weights * distance).sum(-1),)


def attention_distance(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | Support | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Tensor:
    """Mean attention distance of each query: ``E|i - j|`` under its attention distribution.

    Query ``i`` puts weight ``p_j`` on key ``j`` of its support; the result is
    ``sum_j p_j |i - j|`` in positions (the ViT paper's "attention distance":
    small for local heads, large for global ones). It grows with sequence
    length, so compare heads at one length. Self-attention only: query ``i``
    and key ``i`` are the same token.

    Causal supports without an N x N mask (causal order, key padding) take
    one fused attention call with V = key positions (``E|i - j| = i - E[j]``)
    when logits are bounded by 64; everything else is computed exactly over
    query blocks of at most ``memory_budget`` bytes of scores, skipping key
    ranges the structure hides (O(B H N D) memory either way), and blocks
    with logits above 64 in magnitude are scored in float64, where float32
    would lose the weights' digits.

    Args:
        q: (batch, heads, seq, head_dim) queries.
        k: (batch, kv_heads, seq, head_dim) keys, as many positions as ``q``.
        mask, is_causal, scale, score_mod, memory_budget: as in
            :func:`entropy_from_qk`.

    Returns:
        (batch, heads, seq) mean distance in positions, float32 (float64 for
        float64 input); NaN where a query has no visible key.

    Raises:
        TypeError, ValueError: as :func:`entropy_from_qk`; ``q`` and ``k``
            with different sequence lengths.

    Example:
        >>> q = torch.zeros(1, 1, 4, 2)  # equal logits: uniform over the visible keys
        >>> attention_distance(q, torch.randn(1, 1, 4, 2), is_causal=True)  # i / 2
        tensor([[[0.0000, 0.5000, 1.0000, 1.5000]]])
        >>> attention_distance(q, torch.randn(1, 1, 4, 2))  # uniform over all 4 keys
        tensor([[[1.5000, 1.0000, 1.0000, 1.5000]]])
    """
    _check_qk_values(q, k, mask, scale, score_mod)
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"Expected `q` and `k` with one sequence length (self-attention), got {q.shape[2]} queries "
            f"and {k.shape[2]} keys."
        )
    support, q, k, scale = _prepare_qk(q, k, mask, is_causal, scale, "chunked", memory_budget)
    fused = None if score_mod is not None else _causal_distance(q, k, support, scale)
    if fused is not None:
        return fused
    return _over_query_blocks(q, k, support, scale, memory_budget, _block_distance, score_mod=score_mod)[0]


def _causal_distance(q: Tensor, k: Tensor, support: Support, scale: float) -> Tensor | None:
    """``E|i - j| = i - E[j]`` from one fused attention call with V = key positions, or None.

    Applies where every visible key precedes its query (causal order, key
    padding: no N x N mask) and logits are small enough for float32 weights
    (``|scale| |q| |k| <= 64``); only the CPU kernel is used here. Column c of
    V holds ``j - c * spacing``: each query reads the column whose offset
    sits just below its own position, so the subtraction loses no digits.
    """
    if (
        q.device.type != "cpu"
        or not support.causal
        or support.window is not None
        or support.document_ids is not None
        or support.mask is not None
    ):
        return None
    bound = abs(scale) * float(q.norm(dim=-1).amax()) * float(k.norm(dim=-1).amax())
    if bound > LARGE_LOGIT:
        return None
    batch, heads, length, dim = q.shape
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
    spacing = -(-length // dim)
    positions = torch.arange(length, dtype=q.dtype, device=q.device)
    offsets = torch.arange(dim, dtype=q.dtype, device=q.device) * spacing
    # A contiguous V: the kernel misreads a broadcast (stride 0) one.
    value = (positions[:, None] - offsets[None, :]).expand(batch, heads, length, dim).contiguous()
    attn_mask, is_causal = support.additive_mask(q.dtype)
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, _ = kernel(q * scale, k, value, is_causal=is_causal, attn_mask=attn_mask, scale=1.0)
    column = torch.div(positions, spacing, rounding_mode="floor").long()
    mean_offset = out.gather(-1, column[None, None, :, None].expand(batch, heads, length, 1)).squeeze(-1)
    distance: Tensor = (positions - offsets[column] - mean_offset).clamp(min=0.0)
    return distance.masked_fill(support.num_valid().to(distance.device) == 0, math.nan)


def max_logit_from_logits(scores: Tensor, mask: Tensor) -> Tensor:
    """Largest logit each query gives a visible key, from the logits an eager softmax received.

    Args:
        scores: (batch, heads, query, key) logits, masks and biases included.
        mask: bool, broadcastable to ``scores``; True = visible.

    Returns:
        (batch, heads, query) maximum logits, float32 at least; NaN where a
        query has no visible key.

    Example:
        >>> scores = torch.tensor([[[[1.0, 3.0, -100.0], [2.0, 5.0, 0.0]]]])
        >>> max_logit_from_logits(scores, torch.tensor([[True, False, True], [False, False, False]]))
        tensor([[[1., nan]]])
    """
    hidden = torch.full((), -math.inf, dtype=scores.dtype, device=scores.device)
    largest = torch.where(mask, scores, hidden).amax(-1).to(torch.promote_types(scores.dtype, torch.float32))
    return largest.masked_fill(largest == -math.inf, math.nan)


def distance_from_probs(attn: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean attention distance ``E|i - j|`` of each query from attention probabilities.

    The weights are restricted to the support and renormalised there (as for
    entropy, :func:`~attn_monitor.functional.probs.restrict_to_support`); query ``i``
    and key ``i`` are the same token (self-attention).

    Args:
        attn: (batch, heads, seq, seq) attention probabilities.
        mask: bool, broadcastable to ``attn``; True = visible. None: every key.

    Returns:
        (batch, heads, seq) mean distance in positions, float32 (float64 for
        float64 input); NaN where a query has no visible key or no mass on it.

    Raises:
        TypeError, ValueError: as :func:`~attn_monitor.functional.probs.restrict_to_support`;
            a non-square ``attn``.

    Example:
        >>> uniform = torch.full((1, 1, 3, 3), 1 / 3)
        >>> distance_from_probs(uniform, torch.ones(3, 3, dtype=torch.bool).tril())  # causal: i / 2
        tensor([[[0.0000, 0.5000, 1.0000]]])
    """
    weights, no_mass = restrict_to_support(attn, mask)
    num_q, num_k = weights.shape[-2:]
    if num_q != num_k:
        raise ValueError(
            f"Expected square `attn` (self-attention: query i and key i are one token), got {num_q} queries "
            f"and {num_k} keys."
        )
    positions = torch.arange(num_q, device=weights.device, dtype=weights.dtype)
    offsets = (positions[:, None] - positions[None, :]).abs()
    distance = (weights * offsets).sum(-1)
    empty = weights.sum(-1) == 0
    return distance.masked_fill(empty | no_mass, math.nan)
