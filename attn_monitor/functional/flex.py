"""FlexAttention: the support of a block mask, and its ``score_mod``.

``torch.nn.attention.flex_attention.flex_attention`` runs as a higher-order
operator that a ``TorchFunctionMode`` sees with its real arguments: q, k, v,
the ``score_mod`` callable, the block mask as a tuple (its block structure
and ``mask_mod``), the scale and the kernel options. This module turns those
into what entropy needs:

* :func:`block_mask_support`: the exact support the kernel uses: keys of the
  block mask's full blocks, and keys of its partial blocks where ``mask_mod``
  says True, evaluated over query blocks (no score is computed). Valid-key
  counts come from it exactly.
* :func:`read_flex_call`: q, k, scale, that support and the ``score_mod``
  of one call, which every q/k function of :mod:`attn_monitor.functional.entropy`
  takes (its exact path evaluates a ``score_mod`` as flex does: vmapped
  over (batch, head, query, key) indices; ``mask_mod`` is evaluated so here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from attn_monitor.functional.entropy import DEFAULT_MEMORY_BUDGET, ScoreMod, logit_scale, over_indices
from attn_monitor.functional.masks import Support

__all__ = ["ScoreMod", "block_mask_support", "is_flex_attention", "read_flex_call", "softcap"]


def is_flex_attention(func: object) -> bool:
    """Whether a function seen by a ``TorchFunctionMode`` is FlexAttention's operator."""
    return isinstance(func, torch._ops.HigherOrderOperator) and getattr(func, "__name__", None) == "flex_attention"


def _is_identity(score_mod: object) -> bool:
    """flex's stand-in for "no score_mod": its ``_identity``, or that function traced into a graph."""
    if isinstance(score_mod, torch.fx.GraphModule):
        nodes = list(score_mod.graph.nodes)
        inputs = [node for node in nodes if node.op == "placeholder"]
        outputs = [node for node in nodes if node.op == "output"]
        return len(nodes) == len(inputs) + 1 and len(outputs) == 1 and outputs[0].args[0] is inputs[0]
    return getattr(score_mod, "__name__", None) == "_identity" and getattr(score_mod, "__module__", "").startswith(
        "torch.nn.attention"
    )


def _block_grid(num_blocks: Tensor, indices: Tensor, num_key_blocks: int) -> Tensor:
    """(B, H, q blocks, key blocks) bool: the blocks listed in ``indices[..., :num_blocks]``."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
    grid = torch.zeros(*indices.shape[:-1], max(num_key_blocks, int(indices.max()) + 1), dtype=torch.bool)
    grid = grid.to(indices.device)
    grid.scatter_(-1, indices.long(), listed)
    return grid[..., :num_key_blocks]


def block_mask_support(
    block_mask: tuple,
    batch: int,
    heads: int,
    num_queries: int,
    num_keys: int,
    mask_mod_buffers: Sequence[Any] = (),
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Support:
    """The support a FlexAttention kernel uses, from its block mask.

    Args:
        block_mask: ``BlockMask.as_tuple()``, the form the operator receives:
            ``(q_len, kv_len, kv_num_blocks, kv_indices, full_kv_num_blocks,
            full_kv_indices, ..., Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod)``.
        batch, heads: of the queries; ``mask_mod`` is evaluated at every
            batch and query head index (a block mask built with ``B=None``
            or ``H=None`` is broadcast, as the kernel does).
        num_queries, num_keys: the call's lengths.
        mask_mod_buffers: extra arguments of ``mask_mod`` (traced calls).
        memory_budget: bytes of one query block of mask evaluation.

    Returns:
        A :class:`~attn_monitor.functional.masks.Support` with an explicit (batch, heads
        or 1, num_queries, num_keys) bool mask: keys of full blocks, and keys
        of partial blocks where ``mask_mod`` is True.

    Raises:
        TypeError: ``block_mask`` is not a block mask tuple.

    Example:
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 4, 4, device="cpu")
        >>> block_mask_support(causal.as_tuple(), 1, 2, 4, 4).num_valid().tolist()
        [[[1, 2, 3, 4]]]
    """
    if not isinstance(block_mask, tuple) or len(block_mask) < 9 or not callable(block_mask[-1]):
        raise TypeError(f"Expected `block_mask` to be a BlockMask tuple ending in its mask_mod, got {block_mask!r}.")
    kv_num_blocks, kv_indices, full_num_blocks, full_indices = block_mask[2:6]
    q_block, kv_block, mask_mod = int(block_mask[-3]), int(block_mask[-2]), block_mask[-1]
    num_key_blocks = -(-num_keys // kv_block)
    partial = _block_grid(kv_num_blocks, kv_indices, num_key_blocks)
    full = None if full_num_blocks is None else _block_grid(full_num_blocks, full_indices, num_key_blocks)
    device = kv_indices.device
    evaluate = over_indices(mask_mod, False, mask_mod_buffers)
    b_idx, h_idx = torch.arange(batch, device=device), torch.arange(heads, device=device)
    kv_idx = torch.arange(num_keys, device=device)
    key_blocks = (kv_idx // kv_block).clamp(max=num_key_blocks - 1)
    rows = max(1, min(num_queries, memory_budget // max(1, 2 * batch * heads * num_keys)))
    # Kept with one batch or head entry while every block so far agrees across them: a mask that
    # depends on neither (the usual case) costs num_queries x num_keys bytes, not batch x heads times that.
    visible: Tensor | None = None
    for start in range(0, num_queries, rows):
        stop = min(num_queries, start + rows)
        q_idx = torch.arange(start, stop, device=device)
        blocks = (q_idx // q_block).clamp(max=partial.shape[-2] - 1)

        def spread(grid: Tensor, blocks: Tensor = blocks) -> Tensor:
            per_key = grid[..., blocks, :].index_select(-1, key_blocks)
            return per_key.expand(batch, heads, -1, -1)

        chunk = spread(partial) & evaluate(b_idx, h_idx, q_idx, kv_idx, *mask_mod_buffers).bool()
        if full is not None:
            chunk = chunk | spread(full)
        if visible is None:
            visible = torch.empty(1, 1, num_queries, num_keys, dtype=torch.bool, device=device)
        shape = list(visible.shape[:2])
        for dim in (0, 1):
            if shape[dim] == 1 and chunk.shape[dim] > 1 and not bool((chunk == chunk.narrow(dim, 0, 1)).all()):
                shape[dim] = chunk.shape[dim]
        if shape != list(visible.shape[:2]):
            visible = visible.expand(*shape, -1, -1).clone()
        visible[:, :, start:stop] = chunk[: shape[0], : shape[1]]
    assert visible is not None  # num_queries >= 1
    return Support(num_queries, num_keys, mask=visible)


def softcap(cap: float) -> ScoreMod:
    """The ``score_mod`` of logit soft-capping (Gemma 2): ``cap * tanh(score / cap)``.

    Example:
        >>> softcap(2.0)(torch.tensor([0.0, 100.0]), *4 * [None])
        tensor([0., 2.])
    """

    def capped(score: Tensor, batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    return capped


def read_flex_call(args: tuple, kwargs: dict) -> tuple[Tensor, Tensor, float, Support, ScoreMod | None]:
    """q, k, scale, support and score_mod (None when absent) of one FlexAttention operator call.

    Args:
        args, kwargs: the operator's arguments: ``(query, key, value,
            score_mod, block_mask_tuple, scale, kernel_options,
            score_mod_buffers, mask_mod_buffers)``.

    Raises:
        ValueError: arguments that are not a FlexAttention call's.
    """
    names = ("query", "key", "value", "score_mod", "block_mask", "scale", "kernel_options", "score_buf", "mask_buf")
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    q, k = bound.get("query"), bound.get("key")
    if not isinstance(q, Tensor) or not isinstance(k, Tensor) or q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"Expected a flex_attention call with 4-dim query and key, got {tuple(bound)}.")
    q, k = q.detach(), k.detach()
    scale = bound.get("scale")
    scale = logit_scale(scale, q.shape[-1])
    support = block_mask_support(
        bound["block_mask"], q.shape[0], q.shape[1], q.shape[2], k.shape[2], tuple(bound.get("mask_buf") or ())
    )
    score_mod = bound.get("score_mod")
    if score_mod is None or _is_identity(score_mod):
        return q, k, scale, support, None
    buffers = tuple(bound.get("score_buf") or ())
    if buffers:
        inner = score_mod

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            modified: Tensor = inner(score, b, h, q_idx, kv_idx, *buffers)
            return modified

    return q, k, scale, support, score_mod
