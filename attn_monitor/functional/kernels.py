"""The fused attention kernels entropy reads: which calls cover a support, and each device's kernel."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from attn_monitor.functional.masks import Support

#: Query rows per kernel call when a window or packed documents hide whole key blocks.
QUERY_BLOCK = 256


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
