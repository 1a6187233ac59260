"""The consumer that turns each recorded call into per-query entropy in a metric."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from attn_monitor.calls import AttentionCall
from attn_monitor.flex import score_mod_lse_entropy
from attn_monitor.functional import Method, all_finite, attention_entropy, entropy_from_logits, entropy_from_qk
from attn_monitor.metric import AttentionEntropy
from attn_monitor.shared import WarnOnce

__all__ = ["EntropyUpdate", "without_nonfinite"]


class EntropyUpdate:
    """The consumer that adds each call's per-query entropy to one :class:`AttentionEntropy`.

    A diverging model must not stop training: queries that non-finite q, k
    or weights reach (NaN, inf) are left out, counted per layer in
    :attr:`nonfinite` and reported by one warning per layer, while the
    functional API itself raises on such input.

    Args:
        metric: the metric to update.
        method: entropy path for q/k calls (see :func:`entropy_from_qk`).

    Example:
        >>> import torch
        >>> from attn_monitor.capture import AttentionCapture
        >>> attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        >>> validation, training = AttentionEntropy(), AttentionEntropy()
        >>> with AttentionCapture(attn) as capture:
        ...     with capture.recording(consumers=[EntropyUpdate(validation)]):
        ...         _ = attn(*(3 * [torch.randn(1, 4, 8)]), need_weights=False)
        >>> validation.layers, training.layers
        (['MultiheadAttention'], [])
    """

    def __init__(self, metric: AttentionEntropy, *, method: Method = "auto") -> None:
        if not isinstance(metric, AttentionEntropy):
            raise TypeError(f"Expected `metric` to be an AttentionEntropy, got {type(metric).__name__}.")
        self.metric = metric
        self.method = method
        self._warn_once = WarnOnce()

    def __call__(self, call: AttentionCall, sample: Tensor) -> None:
        call, reached = without_nonfinite(call)
        if call.logits is not None:
            entropy = entropy_from_logits(call.logits, call.support.dense())
        elif call.probs is not None:
            entropy = attention_entropy(call.probs, call.support.dense(), no_mass="nan")
            stranded = entropy.isnan() & (call.support.num_valid() > 0)
            if stranded.any():
                # Eager attention in train mode returns weights after dropout: a row can lose
                # its whole support. Those queries are left out; the rest are renormalised.
                self._warn_once(
                    f"dropped-rows:{call.layer}",
                    f"attn_monitor: {call.layer!r} returned attention weights with no mass on the support of "
                    "some queries (dropout in train mode?); they are left out. Monitor in eval mode, or use "
                    "sdpa attention, for the pre-dropout distribution.",
                )
                sample = sample & ~stranded
        elif call.q is not None and call.k is not None and call.score_mod is not None:
            scale = 1.0 / math.sqrt(call.q.shape[-1]) if call.scale is None else call.scale
            _, entropy = score_mod_lse_entropy(call.q, call.k, call.support, scale, call.score_mod)
        elif call.q is not None and call.k is not None:
            entropy = entropy_from_qk(call.q, call.k, mask=call.support, scale=call.scale, method=self.method)
        else:
            raise ValueError(f"An AttentionCall of {call.layer!r} holds neither q and k nor probabilities.")
        if reached is not None:
            entropy = entropy.masked_fill(reached, math.nan)
        self._report_nonfinite(call.layer, entropy, sample)
        # The metric leaves non-finite queries out of its statistics and counts them (``nonfinite``).
        self.metric.update(
            call.layer,
            entropy,
            call.support.num_valid(),
            sample,
            head_offset=call.head_offset,
            num_heads=call.num_heads,
        )

    def _report_nonfinite(self, layer: str, entropy: Tensor, sample: Tensor) -> None:
        """Warn once per layer when sampled queries have non-finite entropy."""
        bad = sample & ~torch.isfinite(entropy)
        if bad.any():
            self._warn_once(
                layer,
                f"attn_monitor: {layer!r}: {int(bad.sum())} queries met NaN or inf in their queries, keys or "
                "attention weights (a diverging model?); they are left out of the entropy statistics, counted "
                "in `nonfinite`, and training goes on.",
            )


def without_nonfinite(call: AttentionCall) -> tuple[AttentionCall, Tensor | None]:
    """``call`` with its non-finite values replaced, and the (batch, heads, query) queries they reached.

    The replacements (0 in q and k, zero logits, a uniform row of weights)
    only keep the entropy functions from raising; those queries' values are
    discarded. None when every value is finite (``-inf`` logits hide keys).
    """
    if call.logits is not None:
        largest = float(call.logits.amax())  # NaN where any logit is NaN
        if not (math.isnan(largest) or largest == math.inf):
            return call, None
        reached = (call.logits.isnan() | (call.logits == math.inf)).any(-1)
        rows = reached[..., None]
        probs = None if call.probs is None else call.probs.masked_fill(rows, 1.0)
        return replace(call, logits=call.logits.masked_fill(rows, 0.0), probs=probs), reached
    if call.probs is not None:
        if all_finite(call.probs):
            return call, None
        bad = ~torch.isfinite(call.probs)
        reached = (bad & call.support.dense()).any(-1) | bad.all(-1)
        probs = torch.where(reached[..., None], 1.0, call.probs.masked_fill(bad, 0.0))
        return replace(call, probs=probs), reached
    if call.q is None or call.k is None:
        return call, None
    if all_finite(call.q) and all_finite(call.k):
        return call, None
    bad_q, bad_k = (~torch.isfinite(t.sum(-1, dtype=torch.float32)) for t in (call.q, call.k))
    if not (bad_q.any() or bad_k.any()):
        return call, None
    reached = bad_q
    if bad_k.any():
        keys = bad_k.repeat_interleave(call.q.shape[1] // call.k.shape[1], dim=1)
        reached = reached | (call.support.dense() & keys[..., None, :]).any(-1)
    q, k = (torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in (call.q, call.k))
    return replace(call, q=q, k=k), reached
