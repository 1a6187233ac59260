"""A runtime self-check of the fast entropy path, on the user's own machine and kernels.

The q/k path takes entropy and logsumexp from a fused attention kernel
(:func:`~attn_monitor.functional.entropy.attention_lse_entropy`): the CPU flash
kernel, CUDA's efficient-attention kernel, whatever a backend update puts
behind them. :class:`FastPathCheck` recomputes one sampled block of queries
per layer densely in float64 (``scale * q k^T`` plus the support's bias,
``logsumexp`` and ``entr(softmax)``) on the first recorded batch of a run and,
with ``every_n``, on every n-th, and compares. A layer whose fast path
disagrees is named in one warning (the kernel and the error) and takes the
exact path (chunked, float64) from then on, the disagreeing call included.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attn_monitor.capture.calls import AttentionCall
from attn_monitor.functional.entropy import Method, attention_lse_entropy, logit_scale, qk_kernel
from attn_monitor.shared.checks import WarnOnce

__all__ = ["FastPathCheck", "SelfCheck", "dense_lse_entropy"]


@dataclass(frozen=True)
class SelfCheck:
    """When, and how closely, the fast path is checked against float64.

    Args:
        every_n: besides the first recorded batch of a run, check every n-th
            (None: the first only).
        queries: queries in each layer's sampled block (one batch row).
        tolerance: the largest error allowed, in nats of entropy and in
            logsumexp relative to ``max(1, |lse|)``. A sound float32 kernel
            is about 1e-5 off; a broken one (a base-2 logsumexp, a wrong
            mask) is off by tenths.

    Raises:
        ValueError: a setting that is not a positive number (an int for the counts).

    Example:
        >>> SelfCheck(every_n=100)
        SelfCheck(every_n=100, queries=32, tolerance=0.001)
    """

    every_n: int | None = None
    queries: int = 32
    tolerance: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("every_n", "queries"):
            value = getattr(self, name)
            if (value is not None or name == "queries") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"Expected `{name}` of SelfCheck to be a positive int, got {value!r}.")
        tolerance = self.tolerance
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < math.inf:
            raise ValueError(f"Expected `tolerance` of SelfCheck to be a positive number, got {tolerance!r}.")


def _row(values: Tensor | None, index: int) -> Tensor | None:
    """Batch row ``index`` of a (B|1, H|1, ...) tensor broadcast over the batch."""
    return None if values is None else values[min(index, values.shape[0] - 1)]


def dense_lse_entropy(call: AttentionCall, index: int, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """(heads, stop - start) float64 logsumexp and entropy in nats of queries ``[start, stop)`` of batch row ``index``.

    Dense and direct: every logit ``scale * q.k`` plus the support's bias,
    hidden keys at ``-inf``, then ``logsumexp`` and ``entr`` of the softmax,
    one head at a time (a (rows, keys) float64 block, also at long context).
    ``-inf`` and NaN where a query sees no key.
    """
    assert call.q is not None and call.k is not None
    q = call.q[index, :, start:stop].double()
    group = q.shape[0] // call.k.shape[1]
    scale = logit_scale(call.scale, q.shape[-1])
    support = call.support
    bias = _row(support.bias_block(start, stop, 0, support.num_keys), index)
    visible = support.block(start, stop, 0, support.num_keys)
    while visible is not None and visible.dim() < 4:
        visible = visible.unsqueeze(0)
    visible = _row(visible, index)
    lse, entropy = [], []
    for head in range(q.shape[0]):
        scores = scale * q[head] @ call.k[index, head // group].double().T
        if bias is not None:
            scores = scores + bias[min(head, bias.shape[0] - 1)].double()
        if visible is not None:
            scores = scores.masked_fill(~visible[min(head, visible.shape[0] - 1)], -math.inf)
        lse.append(scores.logsumexp(-1))
        entropy.append(torch.special.entr(scores.softmax(-1)).sum(-1))
    lse_all = torch.stack(lse)
    return lse_all, torch.stack(entropy).masked_fill(lse_all == -math.inf, math.nan)


class FastPathCheck:
    """Check each layer's fast q/k path on sampled batches; send a layer that fails to the exact path.

    One object serves every stream of a model (a layer that failed once is
    exact for every dataloader and for training steps).

    Args:
        options: when and how closely to check.
        warn: ``warn(message, stacklevel=...)``, :func:`warnings.warn` by default.

    Attributes:
        exact_layers: layers that failed a check: they take the exact path.
        checks: sampled blocks compared so far.
    """

    def __init__(self, options: SelfCheck, warn: Callable[..., object] = warnings.warn) -> None:
        self.options = options
        self.exact_layers: set[str] = set()
        self.checks = 0
        self._warn_once = WarnOnce(warn)
        self._generator = torch.Generator().manual_seed(0)
        self._batches = 0
        self._armed = False
        self._checked: set[str] = set()

    def reset(self) -> None:
        """A new run: its first batch is checked again (layers that failed stay exact: the kernel is the same)."""
        self._batches = 0

    def start_batch(self) -> None:
        """A recorded batch starts: it is checked if it is the run's first or an n-th one."""
        every = self.options.every_n
        self._armed = self._batches == 0 or (every is not None and self._batches % every == 0)
        self._batches += 1
        self._checked = set()

    def lse_entropy(self, call: AttentionCall, sample: Tensor, method: Method) -> tuple[Tensor, Tensor]:
        """(logsumexp, entropy in nats) of a q/k call: the fast path, checked when due, or the exact path."""
        assert call.q is not None and call.k is not None
        layer = call.layer
        if layer not in self.exact_layers:
            lse, entropy = attention_lse_entropy(call.q, call.k, mask=call.support, scale=call.scale, method=method)
            if not self._armed or layer in self._checked or self._agrees(call, lse, entropy, sample, method):
                return lse, entropy
        exact = attention_lse_entropy(
            call.q.double(), call.k.double(), mask=call.support, scale=call.scale, method="chunked"
        )
        dtype = torch.promote_types(call.q.dtype, torch.float32)
        return exact[0].to(dtype), exact[1].to(dtype)

    def _agrees(self, call: AttentionCall, lse: Tensor, entropy: Tensor, sample: Tensor, method: Method) -> bool:
        """Compare one sampled block with :func:`dense_lse_entropy`; on a mismatch warn and mark the layer exact."""
        assert call.q is not None
        self._checked.add(call.layer)
        self.checks += 1
        batch, _, num_queries, _ = call.q.shape
        size = min(self.options.queries, num_queries)
        index = int(torch.randint(batch, (1,), generator=self._generator))
        start = int(torch.randint(num_queries - size + 1, (1,), generator=self._generator))
        want_lse, want_entropy = (value.to(lse.device) for value in dense_lse_entropy(call, index, start, start + size))
        counted = sample.expand(lse.shape)[index, :, start : start + size] & torch.isfinite(want_lse)
        got_lse, got_entropy = (value[index, :, start : start + size].double() for value in (lse, entropy))
        entropy_error = (got_entropy - want_entropy).abs().nan_to_num(math.inf)[counted]
        lse_error = ((got_lse - want_lse).abs() / want_lse.abs().clamp(min=1.0)).nan_to_num(math.inf)[counted]
        worst = [float(error.max()) if error.numel() else 0.0 for error in (entropy_error, lse_error)]
        if max(worst) <= self.options.tolerance:
            return True
        self.exact_layers.add(call.layer)
        self._warn_once(
            call.layer,
            f"attn_monitor: the fast entropy path of {call.layer!r} ({qk_kernel(call.q.device, call.support, method)}) "
            f"disagrees with a float64 dense recomputation of {int(counted.sum())} sampled queries: entropy off by "
            f"up to {worst[0]:.3g} nats, logsumexp by {worst[1]:.3g} (relative), above the tolerance "
            f"{self.options.tolerance}; {call.layer!r} takes the exact path (chunked, float64) from now on.",
        )
        return False
