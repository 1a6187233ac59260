"""Mass diagnostics beyond entropy: attention sinks, KV-eviction coverage, cross-document leakage.

Each is the attention mass a query puts on a subset X of its support,
``exp(lse_X - lse_all)`` (DESIGN.md §2), computed from the captured q and k
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

import torch
from torch import Tensor

from attn_monitor.calls import AttentionCall
from attn_monitor.flex import score_mod_lse_entropy
from attn_monitor.functional import attention_lse, mass_fraction, restrict_to_support
from attn_monitor.masks import Support, leading_keys
from attn_monitor.metric import AttentionMass

__all__ = ["MassDiagnostics"]


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
            :func:`~attn_monitor.functional.entropy_from_qk`).

    Example:
        >>> import torch
        >>> from attn_monitor.capture import AttentionCapture
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
        if call.score_mod is not None:  # a flex score_mod or soft-capping: the exact chunked pass
            scale = 1.0 / math.sqrt(call.q.shape[-1]) if call.scale is None else call.scale  # type: ignore[union-attr]
            return score_mod_lse_entropy(call.q, call.k, support, scale, call.score_mod)[0]  # type: ignore[arg-type]
        return attention_lse(call.q, call.k, mask=support, scale=call.scale, method=self.method)  # type: ignore[arg-type]

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
