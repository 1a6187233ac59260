"""The offline evaluator: a model's attention statistics over a list of batches, no training loop needed."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attn_monitor.capture.batches import default_document_ids, default_forward, default_padding_mask
from attn_monitor.capture.calls import Adapter, Consumer
from attn_monitor.capture.hooks import AttentionCapture, nothing_captured_message
from attn_monitor.metrics.entropy import AttentionEntropy, EntropySummary

__all__ = ["evaluate_attention"]


def evaluate_attention(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    padding_mask: Callable[[Any], Tensor | Mapping[str, Tensor] | None] | None = None,
    metric: AttentionEntropy | None = None,
    layers: Iterable[str] | None = None,
    adapters: Mapping[str, Adapter] | None = None,
    document_ids: Callable[[Any], Tensor | None] | None = None,
    consumers: Iterable[Consumer] = (),
) -> EntropySummary:
    """Attention entropy of ``model`` over ``batches``, without Lightning.

    Runs the model in eval mode without gradients, capture on, and returns the
    summary; the model's train/eval mode is restored afterwards. Compare two
    checkpoints by calling it on both with the same batches.

    Args:
        model: the model.
        batches: an iterable of batches: dicts of keyword arguments by default
            (their ``attention_mask`` and ``decoder_attention_mask`` decide
            which queries are samples).
        forward: ``forward(model, batch)`` for anything else; the default calls
            ``model(**batch)`` for dicts, ``model(*batch)`` for tuples.
        padding_mask: ``padding_mask(batch)`` -> a (batch, seq) mask of real
            tokens, or a mapping from layer pattern to such a mask (see
            :meth:`AttentionCapture.recording`); defaults to
            :func:`default_padding_mask`.
        metric: metric to fill (a fresh :class:`AttentionEntropy` by default).
        layers: layer patterns to record (all attention by default).
        adapters: see :class:`AttentionCapture`.
        document_ids: ``document_ids(batch) -> (batch, seq)`` for packed
            batches; defaults to ``batch["document_ids"]`` when present.
        consumers: further consumers of every call, e.g. a
            :class:`~attn_monitor.capture.consumers.MassDiagnostics` whose metric
            then holds sink mass, eviction coverage and leakage.

    Returns:
        The :class:`EntropySummary` of every batch.

    Raises:
        RuntimeError: no attention call was captured (the error says what was
            searched and what to do).

    Example:
        >>> import torch
        >>> layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        >>> summary = evaluate_attention(layer, [torch.randn(2, 6, 8)])
        >>> summary.layers
        ['self_attn']
    """
    forward = forward or default_forward
    padding_mask = padding_mask or default_padding_mask
    document_ids = document_ids or default_document_ids
    capture = AttentionCapture(model, metric, layers=layers, adapters=adapters)
    capture.consumers.extend(consumers)
    was_training = model.training
    model.eval()
    try:
        with capture, torch.no_grad():
            for batch in batches:
                with capture.recording(padding_mask(batch), document_ids(batch)):
                    forward(model, batch)
    finally:
        model.train(was_training)
    if capture.num_calls == 0:
        raise RuntimeError(nothing_captured_message(model))
    return capture.metric.compute()
