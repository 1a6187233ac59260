"""The consumers of recorded calls: each turns an AttentionCall into per-query values in one metric.

* :class:`EntropyUpdate`: entropy, into :class:`~attn_monitor.metrics.entropy.AttentionEntropy`;
* :class:`StatisticsUpdate`: max logit and mean attention distance, into
  :class:`~attn_monitor.metrics.statistics.AttentionStatistics`;
* :class:`MassDiagnostics`: attention mass on subsets of the support, into
  :class:`~attn_monitor.metrics.mass.AttentionMass`.

All read a call's logits one way (:meth:`AttentionCall.logits_of_qk`), leave out
the queries non-finite values reach (:func:`without_nonfinite`), and count them.

**Mass diagnostics** beyond entropy: attention sinks, KV-eviction coverage, cross-document leakage.

Each is the attention mass a query puts on a subset X of its support,
``exp(lse_X - lse_all)`` (docs/design.md §2), computed from the captured q and k
with the same fused logsumexp kernels as entropy (never an N x N matrix), or
summed from the probabilities of modules that return them:

* **sink mass**: mass on the first ``s`` real tokens of the query's sequence
  (of its document, in packed batches), the positions a StreamingLLM-style
  cache keeps as attention sinks.
* **eviction coverage** for a policy "keep ``s`` sink positions and the ``w``
  most recent positions": the mass such a cache would keep (1 = nothing
  lost), ``m(window) + m(sinks) - m(window and sinks)``. A streaming cache
  only holds past keys, so this is meant for causal models.
* **cross-document leakage**: mass on keys of other documents,
  ``1 - m(same document)`` (summed directly over the other documents' keys
  where probabilities are at hand, so an isolating mask reads exactly 0).
  Non-zero means the model's mask does not isolate packed samples.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from attn_monitor.capture.calls import AttentionCall
from attn_monitor.capture.selfcheck import FastPathCheck
from attn_monitor.functional.entropy import Method, attention_lse, attention_lse_entropy, mass_fraction
from attn_monitor.functional.masks import Support, leading_keys
from attn_monitor.functional.probs import all_finite, attention_entropy, entropy_from_logits, restrict_to_support
from attn_monitor.functional.statistics import (
    attention_distance,
    attention_max_logit,
    distance_from_probs,
    max_logit_from_logits,
)
from attn_monitor.metrics.bound import LogitBound
from attn_monitor.metrics.entropy import AttentionEntropy
from attn_monitor.metrics.mass import AttentionMass
from attn_monitor.metrics.statistics import AttentionStatistics
from attn_monitor.shared.checks import WarnOnce

__all__ = ["EntropyUpdate", "MassDiagnostics", "StatisticsUpdate", "without_nonfinite"]


class EntropyUpdate:
    """The consumer that adds each call's per-query entropy to one :class:`AttentionEntropy`.

    A diverging model must not stop training: queries that non-finite q, k
    or weights reach (NaN, inf) are left out, counted per layer in
    :attr:`nonfinite` and reported by one warning per layer, while the
    functional API itself raises on such input.

    With ``bound``, each call's logsumexp and entropy also bracket its
    heads' max logit (:class:`~attn_monitor.metrics.bound.LogitBound`): q/k calls
    (sdpa, flex) hand over the lse of the entropy pass itself, eager calls
    with logits one logsumexp of them; calls with probabilities only have no
    logits and give none.

    Args:
        metric: the metric to update.
        method: entropy path for q/k calls (see :func:`entropy_from_qk`).
        bound: the max-logit bracket to update as well (None: none).
        check: the self-check of the fast q/k path (None: unchecked), see
            :class:`~attn_monitor.capture.selfcheck.FastPathCheck`.

    Example:
        >>> import torch
        >>> from attn_monitor.capture.hooks import AttentionCapture
        >>> attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        >>> validation, training = AttentionEntropy(), AttentionEntropy()
        >>> with AttentionCapture(attn) as capture:
        ...     with capture.recording(consumers=[EntropyUpdate(validation)]):
        ...         _ = attn(*(3 * [torch.randn(1, 4, 8)]), need_weights=False)
        >>> validation.layers, training.layers
        (['MultiheadAttention'], [])
    """

    def __init__(
        self,
        metric: AttentionEntropy,
        *,
        method: Method = "auto",
        bound: LogitBound | None = None,
        check: FastPathCheck | None = None,
    ) -> None:
        if not isinstance(metric, AttentionEntropy):
            raise TypeError(f"Expected `metric` to be an AttentionEntropy, got {type(metric).__name__}.")
        if bound is not None and not isinstance(bound, LogitBound):
            raise TypeError(f"Expected `bound` to be a LogitBound or None, got {type(bound).__name__}.")
        self.metric = metric
        self.method = method
        self.bound = bound
        self.check = check
        self._warn_once = WarnOnce()

    def __call__(self, call: AttentionCall, sample: Tensor) -> None:
        call, reached = without_nonfinite(call)
        lse = None
        if call.logits is not None:
            visible = call.support.dense()
            entropy = entropy_from_logits(call.logits, visible)
            if self.bound is not None:
                lse = call.logits.masked_fill(~visible, -math.inf).logsumexp(-1).to(entropy.dtype)
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
        elif call.q is not None and call.k is not None:
            if self.check is not None and call.score_mod is None:
                lse, entropy = self.check.lse_entropy(call, sample, self.method)
            else:
                lse, entropy = attention_lse_entropy(call.q, call.k, method=self.method, **call.logits_of_qk())
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
        if self.bound is not None and lse is not None:
            # Queries non-finite values reached have NaN entropy: the bound leaves them out.
            self.bound.update(call.layer, lse, entropy, sample, head_offset=call.head_offset, num_heads=call.num_heads)

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


class StatisticsUpdate:
    """The capture consumer that adds each call's max logit and attention distance to one metric.

    Calls with q and k give both (distance for self-attention only). Calls
    with probabilities (Hugging Face eager attention) give the distance but
    no max logit, since the module never returns its logits: such a layer is
    named in one warning and has no max logit. Queries that non-finite q, k
    or weights reach are left out and counted, as for entropy.

    Args:
        metric: the :class:`AttentionStatistics` to update; a new one by default.
        max_logit: measure the maximum logit.
        distance: measure the mean attention distance.
        warn_once: where the layer warnings go; share one :class:`~attn_monitor.shared.checks.WarnOnce`
            between consumers of one model to name each layer once (a new one by default).

    Example:
        >>> from attn_monitor.capture.hooks import AttentionCapture
        >>> attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        >>> update = StatisticsUpdate()
        >>> with AttentionCapture(attn) as capture:
        ...     with capture.recording(consumers=[update]):
        ...         _ = attn(*(3 * [torch.randn(1, 4, 8)]), need_weights=False)
        >>> summary = update.metric.compute()
        >>> summary.layers, summary.distance_count.tolist()
        (['MultiheadAttention'], [[4.0, 4.0]])
    """

    def __init__(
        self,
        metric: AttentionStatistics | None = None,
        *,
        max_logit: bool = True,
        distance: bool = True,
        warn_once: WarnOnce | None = None,
    ) -> None:
        if metric is not None and not isinstance(metric, AttentionStatistics):
            raise TypeError(f"Expected `metric` to be an AttentionStatistics or None, got {type(metric).__name__}.")
        self.metric = metric if metric is not None else AttentionStatistics()
        self.max_logit = bool(max_logit)
        self.distance = bool(distance)
        self._warn_once = warn_once if warn_once is not None else WarnOnce()

    def __call__(self, call: AttentionCall, sample: Tensor) -> None:
        call, reached = without_nonfinite(call)
        layer = call.layer
        support = call.support
        self_attention = call.self_attention is not False and support.num_queries == support.num_keys
        if self.distance and not self_attention:
            self._warn_once(
                f"distance:{layer}",
                f"attn_monitor: {layer!r} is not self-attention (its keys are other tokens than its queries); "
                "attention distance is not measured for it.",
            )
        values: dict[str, Tensor] = {}
        if call.logits is not None and self.max_logit:
            values["max_logit"] = max_logit_from_logits(call.logits, support.dense())
        if call.probs is not None:
            if self.max_logit and call.logits is None:
                self._warn_once(
                    f"max-logit:{layer}",
                    f"attn_monitor: {layer!r} returns attention probabilities, not logits: its max logit cannot be "
                    "measured and is not logged. Run the model with sdpa attention to measure it.",
                )
            if self.distance and self_attention:
                values["distance"] = distance_from_probs(call.probs, support.dense())
                # Weights with no mass on a non-empty support (dropout in train mode): left out, as for entropy.
                sample = sample & ~values["distance"].isnan()
        elif call.q is not None and call.k is not None:
            if self.max_logit:
                values["max_logit"] = attention_max_logit(call.q, call.k, **call.logits_of_qk())
            if self.distance and self_attention:
                values["distance"] = attention_distance(call.q, call.k, **call.logits_of_qk())
        else:
            raise ValueError(f"An AttentionCall of {layer!r} holds neither q and k nor probabilities.")
        if not values:
            return
        if reached is not None:
            values = {name: value.masked_fill(reached, math.nan) for name, value in values.items()}
        self.metric.update(layer, is_sample=sample, head_offset=call.head_offset, num_heads=call.num_heads, **values)


def _check_policies(eviction: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    policies = []
    for policy in eviction:
        if not isinstance(policy, (tuple, list)):
            raise ValueError(
                f"Expected `eviction` as a list of (sink_tokens, window) pairs, e.g. [(4, 64)]; "
                f"got the eviction policy {policy!r} in {eviction!r}."
            )
        if (
            len(policy) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in policy)
            or policy[0] < 0
            or policy[1] < 1
        ):
            raise ValueError(
                f"Expected each eviction policy in `eviction` as (sink_tokens >= 0, window >= 1) ints, "
                f"got {tuple(policy)!r}."
            )
        policies.append((int(policy[0]), int(policy[1])))
    return policies


class MassDiagnostics:
    """A capture consumer that accumulates sink mass, eviction coverage and leakage.

    Append it to :attr:`AttentionCapture.consumers`; its :attr:`metric` holds
    one key per diagnostic and layer: ``sink_mass/{layer}``,
    ``coverage_s{s}_w{w}/{layer}``, ``leakage/{layer}``.

    Args:
        sink_tokens: number of leading positions counted as sinks (None: off).
        eviction: (sink_tokens, window) cache policies to evaluate.
        leakage: measure cross-document leakage (needs the batch's
            ``document_ids``, given to ``capture.recording``).
        metric: the :class:`AttentionMass` to update; a new one by default.
        method: path for the logsumexp (see
            :func:`~attn_monitor.functional.entropy.entropy_from_qk`).

    Example:
        >>> import torch
        >>> from attn_monitor.capture.hooks import AttentionCapture
        >>> attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        >>> diagnostics = MassDiagnostics(sink_tokens=1)
        >>> with AttentionCapture(attn) as capture:
        ...     capture.consumers.append(diagnostics)
        ...     with capture.recording():
        ...         _ = attn(*(3 * [torch.randn(1, 4, 8)]), need_weights=False)
        >>> diagnostics.metric.compute().layers
        ['sink_mass/MultiheadAttention']
    """

    def __init__(
        self,
        *,
        sink_tokens: int | None = None,
        eviction: Iterable[Sequence[int]] = (),
        leakage: bool = False,
        metric: AttentionMass | None = None,
        method: str = "auto",
    ) -> None:
        if sink_tokens is not None and (
            not isinstance(sink_tokens, int) or isinstance(sink_tokens, bool) or sink_tokens < 1
        ):
            raise ValueError(f"Expected `sink_tokens` to be a positive int or None, got {sink_tokens!r}.")
        self.sink_tokens = sink_tokens
        self.eviction = _check_policies(eviction)
        self.leakage = bool(leakage)
        self.metric = metric if metric is not None else AttentionMass()
        self.method = method

    @property
    def enabled(self) -> bool:
        return self.sink_tokens is not None or bool(self.eviction) or self.leakage

    def __call__(self, call: AttentionCall, sample: Tensor) -> None:
        if not self.enabled:
            return
        support = call.support
        length = support.num_keys
        # The padding mask is the queries' sequence: the keys' too only in self-attention.
        padding = call.padding_mask if call.self_attention is not False and _fits(call.padding_mask, length) else None
        documents = call.document_ids if _fits(call.document_ids, length) and support.num_queries == length else None
        mass = _MassOf(call, self.method)

        def update(name: str, value: Tensor) -> None:
            key = f"{name}/{call.layer}"
            self.metric.update(key, value, sample, head_offset=call.head_offset, num_heads=call.num_heads)

        def sinks(base: Support, count: int) -> Support:
            """``base`` restricted to the first ``count`` real tokens of the query's own sequence or document."""
            keys = leading_keys(count, padding, documents, length).to(support._device())
            restricted = base.restrict_keys(keys)
            # Other documents' leading tokens are not this query's sinks, even where the mask leaks.
            return restricted if documents is None else _within_documents(restricted, documents)

        if self.sink_tokens is not None:
            update("sink_mass", mass(sinks(support, self.sink_tokens)))
        for count, window in self.eviction:
            recent = support.with_window(window)
            if count == 0:
                kept = mass(recent)
            else:
                kept = mass(recent) + mass(sinks(support, count)) - mass(sinks(recent, count))
            update(f"coverage_s{count}_w{window}", kept.clamp(0.0, 1.0))
        if self.leakage and documents is not None:
            update("leakage", mass.off_documents(documents))


class _MassOf:
    """``mass(subset)``: each query's attention mass on a subset of its support."""

    def __init__(self, call: AttentionCall, method: str) -> None:
        self.call = call
        self.method = method
        if call.probs is not None:
            visible = call.support.dense()
            self.probs, no_mass = restrict_to_support(call.probs, visible)
            self.empty = no_mass | ~visible.any(-1)
        else:
            self.lse_all = self._lse(call.support)

    def _lse(self, support: Support) -> Tensor:
        call = self.call
        return attention_lse(call.q, call.k, method=self.method, **call.logits_of_qk(support))  # type: ignore[arg-type]

    def __call__(self, subset: Support) -> Tensor:
        if self.call.probs is None:
            # The support itself (documents the mask already isolates): the same lse, exactly.
            lse = self.lse_all if subset is self.call.support else self._lse(subset)
            return mass_fraction(lse, self.lse_all)
        value = (self.probs * subset.dense()).sum(-1)
        return value.masked_fill(self.empty, float("nan"))

    def off_documents(self, documents: Tensor) -> Tensor:
        """Each query's mass on keys of other documents than its own (cross-document leakage)."""
        own = _within_documents(self.call.support, documents)
        if self.call.probs is None:
            return (1.0 - self(own)).clamp(0.0, 1.0)
        # Summed over the other documents' keys, not 1 - own mass: an isolating mask gives exactly 0.
        documents = documents.to(self.probs.device)
        other = documents[:, None, :, None] != documents[:, None, None, :]
        value = (self.probs * other).sum(-1).clamp(0.0, 1.0)
        return value.masked_fill(self.empty, float("nan"))


def _within_documents(support: Support, documents: Tensor) -> Support:
    """``support`` intersected with "same document as the query", also when it already has documents.

    Two partitions into contiguous runs intersect in the runs between the
    positions where either changes; the same documents twice is the same set,
    so ``support`` itself comes back.
    """
    if support.document_ids is None:
        return support.with_documents(documents)
    mine, given = torch.broadcast_tensors(support.document_ids, documents.to(support.document_ids.device))
    change_mine = mine[:, 1:] != mine[:, :-1]
    change = change_mine | (given[:, 1:] != given[:, :-1])
    if torch.equal(change, change_mine):
        return support
    combined = torch.nn.functional.pad(change.long().cumsum(-1), (1, 0))
    derived = copy.copy(support)
    derived.document_ids = None
    return derived.with_documents(combined)


def _fits(value: Tensor | None, length: int) -> bool:
    return value is not None and value.dim() == 2 and value.shape[1] == length
