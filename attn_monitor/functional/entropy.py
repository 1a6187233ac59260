"""The q/k engine: entropy and logsumexp of every query from q and k, without the N x N matrix.

One query-block loop and one block scorer serve every exact path of the package (entropy, lse,
max logit, distance); where they apply, the fused kernels (:mod:`attn_monitor.functional.kernels`)
give the same values from one attention call.

For one query with attention weights ``p`` over its valid keys (its support),
``H(p) = -sum_i p_i ln p_i`` in nats and ``H / ln(n)`` normalised to [0, 1],
where ``n`` is the number of valid keys (docs/design.md §2). Everything here
accumulates in float32 at least, whatever the input dtype.

Rules shared by every function of :mod:`attn_monitor.functional`:

* A query with no valid key gets NaN.
* With ``normalize=True`` a query with exactly one valid key gets NaN too:
  its only distribution is [1] and ``0 / ln(1)`` is undefined.
* Nothing else is ever NaN; bad input raises instead (NaN or inf in the
  inputs, a non-finite scale, NaN or ``+inf`` in an additive mask: see
  docs/bad_input.md for every case).
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from attn_monitor.functional.kernels import _KERNELS, _fused_lse
from attn_monitor.functional.masks import Support
from attn_monitor.functional.probs import _check_4d, _check_pair, _compute_dtype, _finish, _logits_entropy, all_finite

# KeyShardStatistics is public too, as what key_shard_statistics returns (a type, not a function of the
# bad-input table that covers __all__).
__all__ = ["attention_lse", "attention_lse_entropy", "entropy_from_qk", "mass_fraction"]

Method = Literal["auto", "fused", "chunked"]

#: ``score_mod(score, b, h, q_idx, kv_idx) -> score``: FlexAttention's logit
#: modifier (ALiBi, soft-capping, ...), applied to the scaled logits before
#: the additive mask and the softmax.
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

#: Default working memory for one block of scores in the chunked path.
DEFAULT_MEMORY_BUDGET = 64 * 2**20


def logit_scale(scale: float | None, head_dim: int) -> float:
    """The logit scale a call uses: ``scale``, or attention's default ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


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


#: Above this |logsumexp| float32 logits carry more than ~4e-6 of rounding each
#: (6e-8 relative): the identity ``lse - <q, out>`` would subtract two numbers
#: that large, and softmax weights would lose the digits the mean distance
#: reads. Every path redoes such a call or block in float64.
LARGE_LOGIT = 64.0


_KERNEL_NAMES = {
    "cpu": "fused CPU flash kernel, aten._scaled_dot_product_flash_attention_for_cpu",
    "cuda": "fused efficient-attention kernel, aten._scaled_dot_product_efficient_attention",
}


def qk_kernel(device: torch.device, support: Support, method: str) -> str:
    """The kernel the q/k path runs on ``device`` for ``support`` with ``method``, in words (for messages)."""
    if method == "chunked" or support.bias is not None or device.type not in _KERNELS:
        return "chunked path, torch matmul and logsumexp"
    return _KERNEL_NAMES[device.type]


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


# --------------------------------------------------------------------------- input values


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
    modify: Callable[..., Tensor] | None = None,
) -> Tensor:
    """The logits one block of queries gives its keys, in ``dtype``: what the softmax receives.

    ``scale * q k^T``, then ``modify`` (a ``score_mod`` already vmapped by
    :func:`over_indices`) over the block's indices, then the support's
    additive bias; hidden keys ``-inf``. GQA keys are broadcast, not copied.
    """
    (q_start, q_stop), (k_start, k_stop) = rows, keys
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    queries = (q[:, :, q_start:q_stop].to(dtype) * scale).reshape(batch, kv_heads, heads // kv_heads, -1, dim)
    scores = (queries @ k[:, :, None, k_start:k_stop].to(dtype).transpose(-1, -2)).flatten(1, 2)
    if modify is not None:
        device = scores.device
        indices = (torch.arange(batch, device=device), torch.arange(heads, device=device))
        positions = (torch.arange(q_start, q_stop, device=device), torch.arange(k_start, k_stop, device=device))
        scores = modify(scores, *indices, *positions).to(dtype)
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
    modify = None if score_mod is None else over_indices(score_mod, True)  # vmapped once, for every block
    for q_start, q_stop, k_start, k_stop in support.key_blocks(block):
        if k_stop == k_start:
            continue
        rescore = functools.partial(
            _block_scores, q, k, support, scale, (q_start, q_stop), (k_start, k_stop), modify=modify
        )
        for output, value in zip(outputs, reduce(rescore(q.dtype), q_start, k_start, rescore), strict=True):
            output[:, :, q_start:q_stop] = value
    empty = support.num_valid().to(q.device) == 0
    return [output.masked_fill(empty, fill) for output, fill in zip(outputs, fills, strict=True)]
