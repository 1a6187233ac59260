"""Attention entropy, and the statistics that come from the same q and k, as pure tensor math.

No state, hooks or logging here.

For one query with attention weights ``p`` over its valid keys (its support),
``H(p) = -sum_i p_i ln p_i`` in nats and ``H / ln(n)`` normalised to [0, 1],
where ``n`` is the number of valid keys (docs/design.md §2). Everything here
accumulates in float32 at least, whatever the input dtype.

Rules shared by every function:

* A query with no valid key gets NaN.
* With ``normalize=True`` a query with exactly one valid key gets NaN too:
  its only distribution is [1] and ``0 / ln(1)`` is undefined.
* Nothing else is ever NaN; bad input raises instead (NaN or inf in the
  inputs, a non-finite scale, NaN or ``+inf`` in an additive mask: see
  docs/bad_input.md for every case).

The same rules hold for :func:`attention_max_logit` (the largest logit per
query) and :func:`attention_distance` (the mean ``|i - j|`` per query).
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from attn_monitor.functional.masks import Support, broadcasts_to, log_count

# KeyShardStatistics is public too, as what key_shard_statistics returns (a type, not a function of the
# bad-input table that covers __all__).
__all__ = [
    "attention_distance",
    "attention_entropy",
    "attention_lse",
    "attention_lse_entropy",
    "attention_max_logit",
    "coarsen",
    "entropy_from_logits",
    "entropy_from_qk",
    "histogram_quantile",
    "key_shard_statistics",
    "mass_fraction",
    "merge_key_shards",
    "normalize_entropy",
    "restrict_to_support",
]

Method = Literal["auto", "fused", "chunked"]

#: ``score_mod(score, b, h, q_idx, kv_idx) -> score``: FlexAttention's logit
#: modifier (ALiBi, soft-capping, ...), applied to the scaled logits before
#: the additive mask and the softmax.
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

#: Default working memory for one block of scores in the chunked path.
DEFAULT_MEMORY_BUDGET = 64 * 2**20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def logit_scale(scale: float | None, head_dim: int) -> float:
    """The logit scale a call uses: ``scale``, or attention's default ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


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


def _check_qk(q: object, k: object) -> tuple[Tensor, Tensor]:
    q = _check_4d("q", q, "(batch, heads, seq, head_dim)")
    k = _check_4d("k", k, "(batch, heads, seq, head_dim)")
    if k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"Expected `k` with the batch size and head_dim of `q` {tuple(q.shape)}, got shape {tuple(k.shape)}."
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"Expected the heads of `q` ({q.shape[1]}) to be a multiple of the heads of `k` ({k.shape[1]}) "
            "(grouped-query attention)."
        )
    if k.device != q.device:
        raise ValueError(f"Expected `q` and `k` on one device, got {q.device} and {k.device}.")
    return q, k


def _as_support(mask: Tensor | Support | None, is_causal: bool, num_queries: int, num_keys: int) -> Support:
    if isinstance(mask, Support):
        if is_causal and not mask.causal:
            raise ValueError("Pass causal order inside the `Support` (causal=True), not as `is_causal`.")
        if (mask.num_queries, mask.num_keys) != (num_queries, num_keys):
            raise ValueError(
                f"Expected a `Support` for {num_queries} queries and {num_keys} keys, "
                f"got one for {mask.num_queries} and {mask.num_keys}."
            )
        return mask
    return Support.from_sdpa(num_queries, num_keys, mask, is_causal)


#: Query rows per kernel call when a window or packed documents hide whole key blocks.
QUERY_BLOCK = 256

#: Above this |logsumexp| float32 logits carry more than ~4e-6 of rounding each
#: (6e-8 relative): the identity ``lse - <q, out>`` would subtract two numbers
#: that large, and softmax weights would lose the digits the mean distance
#: reads. Every path redoes such a call or block in float64.
LARGE_LOGIT = 64.0

#: One fused kernel call: query rows, key columns, additive mask (broadcastable
#: to (B, H, rows, columns)) or None, causal flag (top-left aligned).
KernelCall = tuple[int, int, int, int, Tensor | None, bool]


def _kernel_calls(support: Support, dtype: torch.dtype) -> list[KernelCall]:
    """The support as fused kernels take it, never wider than the mask itself.

    Causal order stays a flag and a key mask stays (B, 1, 1, Nk). A window or
    packed documents become one call per block of queries over the keys the
    block may see, each with its own small mask: hidden blocks are skipped
    and no N x N tensor is built. Only an explicit N x N mask is passed whole.
    """
    block = QUERY_BLOCK
    if support.window is None and support.document_ids is None:
        attn_mask, is_causal = support.additive_mask(dtype)
        return [(0, support.num_queries, 0, support.num_keys, attn_mask, is_causal)]
    if support.num_queries <= block:  # one block: nothing to skip
        visible = support.block(0, support.num_queries, 0, support.num_keys)
        return [(0, support.num_queries, 0, support.num_keys, _additive(visible, dtype), False)]
    calls: list[KernelCall] = []
    for q_start, q_stop, k_start, k_stop in support.key_blocks(block):
        if k_stop > k_start:
            visible = support.block(q_start, q_stop, k_start, k_stop)
            calls.append((q_start, q_stop, k_start, k_stop, _additive(visible, dtype), False))
    return calls


def _additive(visible: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if visible is None:
        return None
    while visible.dim() < 4:
        visible = visible.unsqueeze(0)
    hidden = torch.full((), -math.inf, dtype=dtype, device=visible.device)
    return torch.where(visible, torch.zeros((), dtype=dtype, device=visible.device), hidden)


def _cpu_attention(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """(attention output with V = K, logsumexp) from the CPU flash kernel; GQA keys and broadcast masks as they are."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = kernel(q, k, k, is_causal=is_causal, attn_mask=mask, scale=scale)
    return out, lse


#: The efficient-attention kernel wants the bias rows aligned to this many elements.
_BIAS_ALIGNMENT = 16


def _cuda_attention(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """(attention output with V = K, logsumexp) from the efficient-attention kernel.

    The mask goes in as a broadcast view of its own (B|1, H|1, Nq|1, Nk)
    storage, as SDPA itself passes it: never expanded to (B, H, Nq, Nk).
    Grouped-query keys are not copied when every query of a group sees the
    same keys (no causal order, a key mask): the group's queries are folded
    into one longer query sequence. Otherwise keys are repeated (O(B H N D)).
    """
    batch, heads, num_q, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    fold = group > 1 and not is_causal and (mask is None or (mask.shape[1] == 1 and mask.shape[2] == 1))
    if fold:
        q = q.reshape(batch, kv_heads, group * num_q, head_dim)
    elif group > 1:
        k = k.repeat_interleave(group, dim=1)
    bias = None
    if mask is not None:
        width = mask.shape[-1]
        if width % _BIAS_ALIGNMENT:
            padded = torch.nn.functional.pad(mask, (0, _BIAS_ALIGNMENT - width % _BIAS_ALIGNMENT))
            mask = padded[..., :width]
        bias = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, k, bias, True, 0.0, is_causal, scale=scale
    )
    lse = lse[..., : q.shape[2]]
    if fold:
        out, lse = out.reshape(batch, heads, num_q, head_dim), lse.reshape(batch, heads, num_q)
    return out, lse


_KERNELS = {"cpu": _cpu_attention, "cuda": _cuda_attention}
_KERNEL_NAMES = {
    "cpu": "fused CPU flash kernel, aten._scaled_dot_product_flash_attention_for_cpu",
    "cuda": "fused efficient-attention kernel, aten._scaled_dot_product_efficient_attention",
}


def qk_kernel(device: torch.device, support: Support, method: str) -> str:
    """The kernel the q/k path runs on ``device`` for ``support`` with ``method``, in words (for messages)."""
    if method == "chunked" or support.bias is not None or device.type not in _KERNELS:
        return "chunked path, torch matmul and logsumexp"
    return _KERNEL_NAMES[device.type]


def _fused_lse(q: Tensor, k: Tensor, support: Support, scale: float) -> tuple[Tensor, Tensor] | None:
    """(output of attention with V = K, logsumexp) from fused kernels, or None where there is none.

    The CPU kernel returns NaN for causal rows with a mask when its scale is
    <= 0: such a scale is folded into ``q`` instead.
    """
    kernel = _KERNELS.get(q.device.type)
    if kernel is None:
        return None
    if scale <= 0:
        q, scale = q * scale, 1.0
    return _run_kernel(kernel, q, k, support, scale)


def _run_kernel(
    kernel: Callable[..., tuple[Tensor, Tensor]], q: Tensor, k: Tensor, support: Support, scale: float
) -> tuple[Tensor, Tensor]:
    """(output with V = K, logsumexp) of ``kernel`` over the support's kernel calls, assembled."""
    calls = _kernel_calls(support, q.dtype)
    if len(calls) == 1 and calls[0][:4] == (0, q.shape[2], 0, k.shape[2]):
        return kernel(q, k, calls[0][4], calls[0][5], scale)
    out = q.new_zeros(q.shape)
    lse = q.new_zeros(q.shape[:3])
    for q_start, q_stop, k_start, k_stop, mask, is_causal in calls:
        part_out, part_lse = kernel(q[:, :, q_start:q_stop], k[:, :, k_start:k_stop], mask, is_causal, scale)
        out[:, :, q_start:q_stop] = part_out
        lse[:, :, q_start:q_stop] = part_lse
    return out, lse


def _chunked_pass(
    q: Tensor, k: Tensor, support: Support, scale: float, memory_budget: int, score_mod: ScoreMod | None = None
) -> tuple[Tensor, Tensor]:
    """Exact (logsumexp, entropy) over query blocks; ``-inf`` and NaN where no key is visible."""

    def lse_and_entropy(scores: Tensor, _: int, __: int, rescore: Rescore) -> tuple[Tensor, ...]:
        lse = scores.logsumexp(-1)
        if scores.dtype != torch.float64 and _is_large(lse):
            scores = rescore(torch.float64)
            lse = scores.logsumexp(-1)
        return lse, _logits_entropy(scores, None)

    lse, entropy = _over_query_blocks(
        q, k, support, scale, memory_budget, lse_and_entropy, fills=(-math.inf, math.nan), score_mod=score_mod
    )
    return lse, entropy


def _is_large(lse: Tensor) -> bool:
    """Whether any finite logsumexp is beyond ``LARGE_LOGIT`` (one device round trip when it is not)."""
    if not lse.abs().amax().item() > LARGE_LOGIT:  # NaN compares False
        return False
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros((), dtype=lse.dtype, device=lse.device))
    return bool(finite.abs().amax() > LARGE_LOGIT)


_warned_fallback: set[str] = set()


def entropy_from_qk(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | Support | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    normalize: bool = False,
    method: Method = "auto",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Tensor:
    """Entropy of ``softmax(score_mod(scale * q k^T) + mask)`` per query, without the matrix.

    Uses ``H = lse(s) - sum_i p_i s_i`` and ``sum_i p_i s_i = scale * <q,
    Attn(q, K, V=K)>`` (docs/design.md §2): one fused attention call that also
    returns the logsumexp gives every query's entropy in O(B H N D) memory.
    The exact chunked path (query blocks under ``memory_budget`` bytes) takes
    what the fused kernels cannot: additive biases, devices without a kernel.

    Args:
        q: (batch, heads, seq_q, head_dim) queries.
        k: (batch, kv_heads, seq_k, head_dim) keys; ``heads`` must be a
            multiple of ``kv_heads`` (grouped-query attention: query head h
            uses key head ``h // (heads // kv_heads)``).
        mask: as SDPA's ``attn_mask`` (bool True = visible, or additive float,
            broadcastable to (batch, heads, seq_q, seq_k)), or a
            :class:`~attn_monitor.functional.masks.Support`.
        is_causal: causal mask, top-left aligned as in SDPA (query i sees
            keys j <= i, also when seq_q != seq_k).
        scale: logit scale; defaults to ``1 / sqrt(head_dim)``.
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)``
            applied to the scaled logits (vmapped over the indices as flex
            does, so any ``score_mod`` flex accepts works); such calls take
            the exact chunked path.
        normalize: divide by ``ln(number of valid keys)``.
        method: ``"fused"``, ``"chunked"`` or ``"auto"`` (fused when it
            applies, chunked otherwise).
        memory_budget: bytes of working memory per score block (chunked path).

    Returns:
        (batch, heads, seq_q) entropy in nats (or normalised), float32 (float64
        for float64 input).

    Raises:
        TypeError: wrong types or dtypes.
        ValueError: shapes that disagree; NaN or inf in ``q`` or ``k``; a NaN
            or infinite ``scale`` (zero and negative scales are allowed, as in
            SDPA); NaN or ``+inf`` in an additive ``mask``; ``method="fused"``
            where it cannot apply; a non-positive ``memory_budget``.

    Example:
        >>> q = torch.zeros(1, 1, 3, 4)  # equal logits: uniform over visible keys
        >>> entropy_from_qk(q, torch.randn(1, 1, 3, 4), is_causal=True, normalize=True)
        tensor([[[nan, 1., 1.]]])
    """
    _check_qk_values(q, k, mask, scale, score_mod)
    support, q, k, scale = _prepare_qk(q, k, mask, is_causal, scale, method, memory_budget)
    _, entropy = _qk_pass(q, k, support, scale, method, memory_budget, score_mod)
    return _finish(entropy, support.num_valid(), normalize, support.log_num_valid(entropy.dtype, entropy.device))


def attention_lse(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | Support | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    method: Method = "auto",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Tensor:
    """Logsumexp of the logits ``score_mod(scale * q k^T) + mask`` over each query's support, without the matrix.

    The building block of the mass diagnostics (docs/design.md §2): the attention
    mass a query puts on a subset X of its support is
    ``exp(lse_X - lse_all)`` (see :func:`mass_fraction`).

    Args:
        q, k, mask, is_causal, scale, score_mod, method, memory_budget: as
            in :func:`entropy_from_qk`.

    Returns:
        (batch, heads, seq_q) logsumexp, float32 (float64 for float64 input);
        ``-inf`` where a query has no visible key.

    Raises:
        TypeError, ValueError: as :func:`entropy_from_qk`.

    Example:
        >>> q = torch.zeros(1, 1, 2, 4)  # all logits 0: lse = ln(number of visible keys)
        >>> attention_lse(q, torch.randn(1, 1, 2, 4), is_causal=True).exp()
        tensor([[[1., 2.]]])
    """
    lse, _ = attention_lse_entropy(
        q,
        k,
        mask=mask,
        is_causal=is_causal,
        scale=scale,
        score_mod=score_mod,
        method=method,
        memory_budget=memory_budget,
    )
    return lse


def attention_lse_entropy(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | Support | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    method: Method = "auto",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> tuple[Tensor, Tensor]:
    """Logsumexp and entropy in nats of each query's softmax, from one pass without the matrix.

    The pass :func:`entropy_from_qk` makes, both of its results kept. They
    bracket the query's largest logit for free: ``lse - H = E_p[s] <= max_j
    s_j <= lse`` (see :class:`~attn_monitor.metrics.bound.LogitBound`).

    Args:
        q, k, mask, is_causal, scale, score_mod, method, memory_budget: as
            in :func:`entropy_from_qk`.

    Returns:
        (batch, heads, seq_q) logsumexp (``-inf`` where a query has no
        visible key) and entropy in nats (NaN there), float32 (float64 for
        float64 input).

    Raises:
        TypeError, ValueError: as :func:`entropy_from_qk`.

    Example:
        >>> q = torch.zeros(1, 1, 2, 4)  # all logits 0: lse = H = ln(number of visible keys)
        >>> lse, entropy = attention_lse_entropy(q, torch.randn(1, 1, 2, 4), is_causal=True)
        >>> lse.exp(), entropy.exp()
        (tensor([[[1., 2.]]]), tensor([[[1., 2.]]]))
    """
    _check_qk_values(q, k, mask, scale, score_mod)
    support, q, k, scale = _prepare_qk(q, k, mask, is_causal, scale, method, memory_budget)
    lse, entropy = _qk_pass(q, k, support, scale, method, memory_budget, score_mod)
    if support.may_hide_every_key:
        # The fused kernels return lse 0 for rows with no visible key.
        lse = lse.masked_fill(support.num_valid().to(lse.device) == 0, -math.inf)
    return lse, _finish(entropy, support.num_valid(), False, support.log_num_valid(entropy.dtype, entropy.device))


def mass_fraction(lse_part: Tensor, lse_all: Tensor) -> Tensor:
    """Attention mass on a subset of the support: ``exp(lse_part - lse_all)``, in [0, 1].

    Args:
        lse_part: logsumexp over the subset (``-inf`` where it is empty).
        lse_all: logsumexp over the whole support.

    Returns:
        The fraction per query; NaN where the support is empty.

    Raises:
        TypeError: arguments that are not floating point tensors.
        ValueError: shapes that do not broadcast together.

    Example:
        >>> mass_fraction(torch.tensor([math.log(1.0), -math.inf]), torch.tensor([math.log(4.0), 0.0]))
        tensor([0.2500, 0.0000])
    """
    _check_pair("lse_part", lse_part, "lse_all", lse_all)
    if not lse_all.dtype.is_floating_point:
        raise TypeError(f"Expected `lse_all` with a floating point dtype, got {lse_all.dtype}.")
    fraction = (lse_part - lse_all).exp().clamp(0.0, 1.0)
    fraction = torch.where(lse_part == -math.inf, torch.zeros_like(fraction), fraction)
    return torch.where(lse_all == -math.inf, torch.full_like(fraction, math.nan), fraction)


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


def _prepare_qk(
    q: Tensor,
    k: Tensor,
    mask: Tensor | Support | None,
    is_causal: bool,
    scale: float | None,
    method: str,
    memory_budget: int,
) -> tuple[Support, Tensor, Tensor, float]:
    """Validate q/k inputs; return the support, q and k in the compute dtype, and the scale."""
    q, k = _check_qk(q, k)
    if method not in ("auto", "fused", "chunked"):
        raise ValueError(f"Expected `method` in ('auto', 'fused', 'chunked'), got {method!r}.")
    if not isinstance(memory_budget, int) or memory_budget <= 0:
        raise ValueError(f"Expected `memory_budget` to be a positive int (bytes), got {memory_budget!r}.")
    # Checked on the mask as given: a recognised mask (all visible, causal, ...) no longer shows its batch or heads.
    if isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[1] not in (1, q.shape[1]):
        raise ValueError(
            f"Expected `mask` with 1 or {q.shape[1]} heads (the heads of `q`), got shape {tuple(mask.shape)}."
        )
    support = _as_support(mask, is_causal, q.shape[2], k.shape[2])
    # Checked on what stays a bias: a mask recognised as structure (once per forward, see
    # Support.from_sdpa) holds no NaN or +inf, so a dense mask is not scanned again at every call.
    # ``x < inf`` is False exactly for NaN and +inf; -inf (a hidden key) passes.
    if support.bias is not None and not bool((support.bias < math.inf).all()):
        raise ValueError(
            "Expected an additive `mask` without NaN or +inf values; -inf (or the dtype's minimum) hides a key."
        )
    batch_size = mask.shape[0] if isinstance(mask, Tensor) and mask.dim() == 4 else support.batch_size
    if batch_size not in (1, q.shape[0]) or support.batch_size not in (1, q.shape[0]):
        raise ValueError(f"Expected the mask's batch size to be 1 or {q.shape[0]}, got {batch_size}.")
    if support.mask is not None and support.mask.shape[1] not in (1, q.shape[1]):
        raise ValueError(
            f"Expected `mask` with 1 or {q.shape[1]} heads (the heads of `q`), got shape {tuple(support.mask.shape)}."
        )
    scale = logit_scale(scale, q.shape[-1])
    dtype = _compute_dtype(q.dtype)
    return support, q.to(dtype), k.to(dtype), scale


def _qk_pass(
    q: Tensor,
    k: Tensor,
    support: Support,
    scale: float,
    method: str,
    memory_budget: int,
    score_mod: ScoreMod | None = None,
) -> tuple[Tensor, Tensor]:
    """(logsumexp, entropy in nats) per query, by the fused path where it applies.

    Where a query sees no key the logsumexp is -inf from the chunked path and 0 from the fused kernels.
    """
    if method != "chunked":
        if support.bias is not None or score_mod is not None:
            if method == "fused":
                raise ValueError(
                    "`method='fused'` cannot take an additive bias in `mask` or a `score_mod`; use 'chunked' or 'auto'."
                )
        else:
            try:
                fused = _fused_entropy(q, k, support, scale, memory_budget)
            except RuntimeError as error:
                if method == "fused":
                    raise
                fused = None
                key = f"{q.device.type}:{type(error).__name__}"
                if key not in _warned_fallback:
                    _warned_fallback.add(key)
                    warnings.warn(
                        f"Fused entropy kernel failed on {q.device.type} ({error}); using the chunked path.",
                        stacklevel=3,
                    )
            if fused is not None:
                return fused
            if method == "fused":
                raise ValueError(f"`method='fused'` has no kernel on device {q.device.type}; use 'chunked' or 'auto'.")
    return _chunked_pass(q, k, support, scale, memory_budget, score_mod)


def _fused_entropy(
    q: Tensor, k: Tensor, support: Support, scale: float, memory_budget: int
) -> tuple[Tensor, Tensor] | None:
    """(logsumexp, entropy) by the fused kernels, or None where a device has none.

    Large logits (``LARGE_LOGIT``) take the exact route: the CPU kernel again
    in float64, elsewhere the chunked path in float64 (under ``memory_budget``), so the identity never
    cancels two float32 numbers of ~1e4.
    """
    fused = _fused_lse(q, k, support, scale)
    if fused is None:
        return None
    out, lse = fused
    dtype = q.dtype
    if dtype != torch.float64 and _is_large(lse):
        if q.device.type != "cpu":
            lse, entropy = _chunked_pass(q.double(), k.double(), support, scale, memory_budget)
            return lse.to(dtype), entropy.to(dtype)
        q, k = q.double(), k.double()
        out, lse = _fused_lse(q, k, support, scale) or (out, lse)
    entropy = lse.sub(out.mul_(q).sum(-1), alpha=scale)
    return lse.to(dtype), entropy.to(dtype)


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


# --------------------------------------------------------------------------- input values


def all_finite(value: Tensor) -> bool:
    """Whether every element of ``value`` is finite.

    A float32 sum is NaN or inf when any term is (or, harmlessly, when it
    overflows) and costs a tenth of an elementwise ``isfinite`` on CPU; the
    exact check runs only when the sum is not finite.
    """
    if math.isfinite(value.sum(dtype=_compute_dtype(value.dtype)).item()):
        return True
    return bool(torch.isfinite(value).all())


def _check_qk_values(q: object, k: object, mask: object, scale: object, score_mod: object = None) -> None:
    """Reject what would silently turn into NaN inside a kernel: non-finite q, k or scale (the bias: _prepare_qk).

    One reduction per tensor.
    """
    q, k = _check_qk(q, k)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"Expected `score_mod` to be callable or None, got {type(score_mod).__name__}.")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"Expected `scale` to be a real number or None, got {type(scale).__name__}.")
        if not math.isfinite(scale):
            raise ValueError(f"Expected a finite `scale`, got {scale!r}.")
    for name, value in (("q", q), ("k", k)):
        if not all_finite(value):
            raise ValueError(f"Expected `{name}` to hold finite values, got NaN or inf (a diverging model?).")


# --------------------------------------------------------------------------- weights on the support


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


# --------------------------------------------------------------------------- max logit and distance

#: ``rescore(dtype)``: the scores of the block being reduced, computed again in ``dtype``.
Rescore = Callable[[torch.dtype], Tensor]

#: ``reduce(scores, q_start, k_start, rescore)``: per-query values of one block of scores.
BlockReduce = Callable[[Tensor, int, int, Rescore], tuple[Tensor, ...]]


def over_indices(fn: Callable[..., Tensor], with_score: bool, extra: Sequence[Any] = ()) -> Callable[..., Tensor]:
    """``fn`` vmapped over (batch, head, query, key) indices, as FlexAttention evaluates its mods."""
    prefix = (0,) if with_score else ()
    suffix = (None,) * len(extra)
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=prefix + dims + suffix)
    return fn


def _block_scores(
    q: Tensor,
    k: Tensor,
    support: Support,
    scale: float,
    rows: tuple[int, int],
    keys: tuple[int, int],
    dtype: torch.dtype,
    score_mod: ScoreMod | None = None,
) -> Tensor:
    """The logits one block of queries gives its keys, in ``dtype``: what the softmax receives.

    ``scale * q k^T``, then ``score_mod`` (evaluated over the block's indices),
    then the support's additive bias; hidden keys ``-inf``. GQA keys are
    broadcast, not copied.
    """
    (q_start, q_stop), (k_start, k_stop) = rows, keys
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    queries = (q[:, :, q_start:q_stop].to(dtype) * scale).reshape(batch, kv_heads, heads // kv_heads, -1, dim)
    scores = (queries @ k[:, :, None, k_start:k_stop].to(dtype).transpose(-1, -2)).flatten(1, 2)
    if score_mod is not None:
        device = scores.device
        indices = (torch.arange(batch, device=device), torch.arange(heads, device=device))
        positions = (torch.arange(q_start, q_stop, device=device), torch.arange(k_start, k_stop, device=device))
        scores = over_indices(score_mod, True)(scores, *indices, *positions).to(dtype)
    bias = support.bias_block(q_start, q_stop, k_start, k_stop)
    if bias is not None:
        scores = scores + bias.to(scores.device, dtype)
    visible = support.block(q_start, q_stop, k_start, k_stop)
    return scores if visible is None else scores.masked_fill(~visible.to(scores.device), -math.inf)


def _over_query_blocks(
    q: Tensor,
    k: Tensor,
    support: Support,
    scale: float,
    memory_budget: int,
    reduce: BlockReduce,
    *,
    fills: tuple[float, ...] = (math.nan,),
    score_mod: ScoreMod | None = None,
) -> list[Tensor]:
    """Per-query values of every query block: the one loop of the exact paths.

    Blocks hold at most ``memory_budget`` bytes of scores; key ranges the
    structure hides from a whole block are skipped (O(B H N D) memory).
    ``reduce`` gets each block's scores (:func:`_block_scores`) and returns
    one (batch, heads, rows) tensor per entry of ``fills``, the value of
    queries with no visible key.
    """
    batch, heads, num_q, _ = q.shape
    # scores, weights and one more block-sized temporary are alive at once (one more for a score_mod).
    bytes_per_row = (3 if score_mod is None else 4) * batch * heads * k.shape[2] * q.element_size()
    block = max(1, min(num_q, memory_budget // max(1, bytes_per_row)))
    outputs = [q.new_full((batch, heads, num_q), fill) for fill in fills]
    for q_start, q_stop, k_start, k_stop in support.key_blocks(block):
        if k_stop == k_start:
            continue
        rescore = functools.partial(
            _block_scores, q, k, support, scale, (q_start, q_stop), (k_start, k_stop), score_mod=score_mod
        )
        for output, value in zip(outputs, reduce(rescore(q.dtype), q_start, k_start, rescore), strict=True):
            output[:, :, q_start:q_stop] = value
    empty = support.num_valid().to(q.device) == 0
    return [output.masked_fill(empty, fill) for output, fill in zip(outputs, fills, strict=True)]


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
