"""``nn.MultiheadAttention``: q, k and support recomputed from an ``F.multi_head_attention_forward`` call.

The capture's mode sees the functional call inside the module (the module's
own call is not changed) and hands its bound arguments here.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attn_monitor.capture.calls import AttentionCall
from attn_monitor.functional.entropy import logit_scale
from attn_monitor.functional.masks import Support

__all__ = ["MHA_ARGS", "mha_call"]

#: Parameter names of ``F.multi_head_attention_forward``, in order.
MHA_ARGS = tuple(inspect.signature(F.multi_head_attention_forward).parameters)


def mha_call(layer: str, bound: dict[str, Any]) -> AttentionCall | None:
    """q, k and support of an ``F.multi_head_attention_forward`` call (sequence-first inputs)."""
    if bound.get("bias_k") is not None or bound.get("add_zero_attn") or bound.get("static_k") is not None:
        return None  # extra keys the inputs do not show; the caller warns
    query, key = bound["query"].detach(), bound["key"].detach()
    if query.dim() == 2:  # unbatched (seq, embed)
        query, key = query.unsqueeze(1), key.unsqueeze(1)
    num_heads = int(bound["num_heads"])
    embed = query.shape[-1]
    if bound.get("use_separate_proj_weight"):
        w_q, w_k = bound["q_proj_weight"], bound["k_proj_weight"]
    else:
        w_q, w_k, _ = bound["in_proj_weight"].chunk(3)
    b_q = b_k = None
    if bound.get("in_proj_bias") is not None:
        b_q, b_k, _ = bound["in_proj_bias"].chunk(3)
    with torch.no_grad():
        q = F.linear(query, w_q.detach(), None if b_q is None else b_q.detach())
        k = F.linear(key, w_k.detach(), None if b_k is None else b_k.detach())
    num_q, batch, num_k = q.shape[0], q.shape[1], k.shape[0]
    head_dim = embed // num_heads
    q = q.reshape(num_q, batch, num_heads, head_dim).permute(1, 2, 0, 3)
    k = k.reshape(num_k, batch, num_heads, head_dim).permute(1, 2, 0, 3)

    # MHA masks: bool True = *hidden*, or additive float. Merge into one additive mask.
    additive = torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=q.device)
    attn_mask = bound.get("attn_mask")
    if attn_mask is not None:
        attn_mask = _additive(attn_mask.detach())
        attn_mask = attn_mask.reshape(batch, num_heads, num_q, num_k) if attn_mask.dim() == 3 else attn_mask
        additive = additive + attn_mask
    padding = bound.get("key_padding_mask")
    if padding is not None:
        padding = padding.detach().reshape(batch, num_k)
        additive = additive + _additive(padding)[:, None, None, :]
    causal = bool(bound.get("is_causal")) and attn_mask is None
    mask = None if additive.numel() == 1 and not additive.any() else additive
    support = Support(num_q, num_k, causal=causal, mask=mask)
    return AttentionCall(layer=layer, support=support, q=q, k=k, scale=logit_scale(None, head_dim))


def _additive(mask: Tensor) -> Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill(mask, -math.inf)
    return mask.to(torch.float32)
