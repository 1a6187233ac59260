"""What one attention call is, as the capture hands it to its consumers.

An :class:`AttentionCall` holds the queries and keys (or the probabilities,
or an eager softmax's logits) of one attention call and the support the
model's own mask implies; readers of each attention path
(:mod:`attn_monitor.capture.hooks` for SDPA and ``nn.MultiheadAttention``,
:mod:`attn_monitor.capture.softmax` for eager softmax inputs,
:mod:`attn_monitor.capture.eager` for probability outputs, :mod:`attn_monitor.functional.flex`,
:mod:`attn_monitor.capture.hf_interface`) make
them, consumers (:mod:`attn_monitor.capture.consumers`, the mass diagnostics, the
per-head statistics) read them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

from torch import Tensor, nn

from attn_monitor.functional.entropy import ScoreMod
from attn_monitor.functional.masks import Support

__all__ = ["Adapter", "AttentionCall", "Consumer"]


@dataclass(frozen=True)
class AttentionCall:
    """One attention call, as much of it as entropy needs.

    Either ``q`` and ``k`` (logits ``scale * q k^T`` over the support), or
    ``probs``, or ``logits`` with ``probs`` is set.

    Attributes:
        layer: the owning module's qualified name in the model.
        support: the keys each query may see, from the model's mask.
        q: (batch, heads, seq_q, head_dim) queries, detached.
        k: (batch, kv_heads, seq_k, head_dim) keys, detached.
        scale: logit scale for ``q`` and ``k``.
        probs: (batch, heads, seq_q, seq_k) attention probabilities, detached.
        padding_mask: (batch, seq_q) real tokens of the sequence this call's
            queries come from, when the recording's padding mask applies to
            the layer; None otherwise. Set by the capture.
        document_ids: (batch, seq) document of each token of the recorded
            batch (packed sequences), if given.
        self_attention: whether the keys are the query tokens themselves.
            None (adapters may leave it): the capture decides (see the
            module docstring).
        logits: (batch, heads, seq_q, seq_k) the input of an eager module's own
            softmax, every mask the module applied included (``probs`` then
            holds that softmax's output), detached; entropy and max logit are
            taken of these.
        score_mod: with ``q`` and ``k``, FlexAttention's
            ``score_mod(score, b, h, q_idx, kv_idx)`` applied to the scaled
            logits before the softmax (a flex ``score_mod``, Gemma-style
            soft-capping); None: the logits are ``scale * q k^T``.
        head_offset: the layer's head this call's first head is (tensor
            parallelism: a rank computes a slice of the heads). Set by the capture.
        num_heads: the layer's heads on every rank together; None: the
            call's own. Set by the capture.
    """

    layer: str
    support: Support
    q: Tensor | None = None
    k: Tensor | None = None
    scale: float | None = None
    probs: Tensor | None = None
    padding_mask: Tensor | None = None
    document_ids: Tensor | None = None
    self_attention: bool | None = None
    score_mod: ScoreMod | None = None
    logits: Tensor | None = None
    head_offset: int = 0
    num_heads: int | None = None

    def logits_of_qk(self, support: Support | None = None) -> QKLogits:
        """How this call's q and k become logits: the keyword arguments every q/k function takes.

        One rule for every statistic: entropy, mass, max logit and distance
        are all of the logits the model's softmax receives, ``score_mod``
        (soft-capping, a flex ``score_mod``) and the support's bias included
        (``docs/design.md`` §3). ``support``: another subset of keys (mass
        diagnostics); the call's own by default.
        """
        mask = self.support if support is None else support
        return QKLogits(mask=mask, scale=self.scale, score_mod=self.score_mod)


class QKLogits(TypedDict):
    """Keyword arguments of the q/k functions of :mod:`attn_monitor.functional.entropy` for one call."""

    mask: Support
    scale: float | None
    score_mod: ScoreMod | None


#: ``adapter(module, args, kwargs, output) -> AttentionCall | None``, called by a
#: forward hook on the module while recording. ``layer`` may be left empty: the
#: capture fills in the module's name.
Adapter = Callable[[nn.Module, tuple, dict, Any], "AttentionCall | None"]


#: ``consumer(call, is_sample)`` with the (batch, heads|1, query) bool samples of the call.
Consumer = Callable[[AttentionCall, Tensor], None]
