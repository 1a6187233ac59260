"""Eager softmax inputs: attention read from the logits a module's own softmax receives.

While an eager attention module runs, the capture's ``TorchFunctionMode``
sees every softmax call made inside it (``F.softmax``, ``torch.softmax``,
``Tensor.softmax``, ``torch.special.softmax``, also inside custom autograd
functions). The input of a softmax over the last dim of a (batch, heads,
query, key) tensor holds the logits with every mask the module applied,
wherever it came from: its arguments, its own buffers (GPT-Neo's local
windows), window partitions (Swin's shifted windows). A key is hidden where
its logit is ``-inf`` or at most :data:`HIDDEN_LOGIT` (the dtype's minimum, or
any sum with it); a finite bias (Swin's -100, ALiBi) keeps the key visible,
with that bias.

A :class:`SoftmaxFrame` collects the softmax calls of one running module; the
call is tied to the module when exactly one such softmax ran inside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attn_monitor.capture.calls import AttentionCall
from attn_monitor.functional.masks import Support
from attn_monitor.shared.checks import WarnOnce

__all__ = ["HIDDEN_LOGIT", "SoftmaxFrame", "SoftmaxReader", "logits_call", "softmax_logits"]

#: Functions whose call the capture's mode sees as a softmax.
_SOFTMAX = (F.softmax, torch.softmax, Tensor.softmax, torch.special.softmax)
#: A logit at or below this hides its key: half of float16's minimum, above every dtype's minimum (the
#: value Hugging Face models write into masks, in the model's dtype) and far below any logit a visible
#: key could have (its weight would be exactly 0 in every float type).
HIDDEN_LOGIT = torch.finfo(torch.float16).min / 2


def softmax_logits(func: Any, args: tuple, kwargs: dict) -> Tensor | None:
    """The input of ``func(*args, **kwargs)`` if it is a softmax over the last dim of a 4-dim float tensor."""
    if not any(func is softmax for softmax in _SOFTMAX):
        return None
    logits = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(logits, Tensor) or logits.dim() != 4 or not logits.is_floating_point():
        return None
    return logits if dim in (-1, 3) else None


@dataclass
class SoftmaxFrame:
    """One eager attention module running now, and the (logits, probabilities) of its softmax calls."""

    name: str
    module: nn.Module
    seen: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    def tied(self) -> tuple[Tensor, Tensor] | None:
        """The one softmax that ran inside the module, else None (none, or several to choose from)."""
        return self.seen[0] if len(self.seen) == 1 else None


def logits_call(logits: Tensor, probs: Tensor) -> AttentionCall:
    """The call of a softmax with input ``logits`` and output ``probs``, both (batch, heads, query, key).

    The support is the keys whose logit is above :data:`HIDDEN_LOGIT` (NaN and
    ``+inf`` stay visible, to be counted as non-finite), kept once for all heads
    when they agree and left out when every key is visible.

    Example:
        >>> logits = torch.tensor([[[[0.0, 1.0, -100.0, float("-inf")]]]])
        >>> call = logits_call(logits, logits.softmax(-1))
        >>> call.support.num_valid().tolist()  # -100 is a bias, -inf hides the key
        [[[3]]]
    """
    logits, probs = logits.detach(), probs.detach()
    hidden = logits <= HIDDEN_LOGIT
    mask: Tensor | None = None
    if bool(hidden.any()):
        mask = ~(hidden[:, :1] if bool((hidden == hidden[:, :1]).all()) else hidden)
    support = Support(logits.shape[-2], logits.shape[-1], mask=mask)
    return AttentionCall(layer="", support=support, probs=probs, logits=logits)


class SoftmaxReader:
    """Ties the softmax calls made while eager attention modules run to the innermost of them.

    The capture enters a module in its forward pre-hook and leaves it in its
    forward hook; :meth:`read` then turns the module's one softmax into an
    :class:`AttentionCall`, and cross-checks it against the probabilities the
    module returned (eval mode: dropout changes them in train mode).

    Args:
        indices: module name -> position of the probabilities in its output.
        warn_once: where the cross-check's warnings go.
    """

    def __init__(self, indices: Mapping[str, int], warn_once: WarnOnce) -> None:
        self.indices = dict(indices)
        self._frames: list[SoftmaxFrame] = []
        self._warn_once = warn_once

    @property
    def active(self) -> bool:
        """Whether an eager attention module is running now."""
        return bool(self._frames)

    def enter(self, name: str, module: nn.Module) -> None:
        self._frames.append(SoftmaxFrame(name, module))

    def leave(self, module: nn.Module) -> SoftmaxFrame | None:
        """The frame of ``module``, removed with any left open inside it (a forward that raised)."""
        for depth in range(len(self._frames) - 1, -1, -1):
            if self._frames[depth].module is module:
                frame = self._frames[depth]
                del self._frames[depth:]
                return frame
        return None

    def clear(self) -> None:
        self._frames.clear()

    def on_softmax(self, logits: Tensor, probs: object) -> None:
        if self._frames and isinstance(probs, Tensor) and probs.shape == logits.shape:
            self._frames[-1].seen.append((logits.detach(), probs.detach()))

    def read(self, frame: SoftmaxFrame, output: Any) -> AttentionCall | None:
        """The call of the one softmax tied to ``frame``'s module, else None (keep the probabilities reader)."""
        tied = frame.tied()
        if tied is None:
            return None
        logits, probs = tied
        module = frame.module
        index = self.indices.get(frame.name, 1)
        returned = output[index] if isinstance(output, (tuple, list)) and -len(output) <= index < len(output) else None
        gap = None if module.training else _disagreement(returned, probs)
        tolerance = 1e-3 if probs.dtype in (torch.float32, torch.float64) else 3e-2
        if gap is not None and gap > tolerance:
            self._warn_once(
                f"softmax-disagrees:{frame.name}",
                f"attn_monitor: {frame.name!r} ({type(module).__name__}) returned attention weights at "
                f"output[{index}] that differ from what its softmax produced by up to {gap:.3g} (a head mask, or "
                "weights changed after the softmax?); the softmax's input logits are measured.",
            )
        return logits_call(logits, probs)


def _disagreement(returned: object, produced: Tensor) -> float | None:
    """Largest difference between weights a module returned and its softmax output; None if not comparable."""
    if not isinstance(returned, Tensor) or returned.shape != produced.shape or not returned.is_floating_point():
        return None
    with torch.no_grad():
        return float((returned.detach().float() - produced.float()).abs().amax()) if returned.numel() else 0.0
