"""What a batch says besides the model's inputs: which tokens are real, which document each belongs to.

The defaults :func:`~attn_monitor.capture.evaluate.evaluate_attention` and the
Lightning callback use for dict batches (Hugging Face style).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

__all__ = ["default_document_ids", "default_forward", "default_padding_mask"]


#: Batch keys that describe the batch for attn_monitor, not arguments of the model.
_BATCH_ONLY_KEYS = ("document_ids",)


def default_forward(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for dicts (without the keys only attn_monitor reads), ``model(*batch)`` for tuples."""
    if isinstance(batch, Mapping):
        return model(**{key: value for key, value in batch.items() if key not in _BATCH_ONLY_KEYS})
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _batch_tensor(batch: Any, key: str) -> Tensor | None:
    if isinstance(batch, Mapping):
        value = batch.get(key)
        if isinstance(value, Tensor) and value.dim() == 2:
            return value
    return None


def default_padding_mask(batch: Any) -> Tensor | dict[str, Tensor] | None:
    """The padding mask of a dict batch (Hugging Face style), else None.

    Its (batch, seq) ``attention_mask`` (the encoder's, or a decoder-only
    model's); with a ``decoder_attention_mask`` as well, the mapping
    ``{"*decoder.*": decoder_attention_mask, "*": attention_mask}``: decoder
    layers (self- and cross-attention) count the decoder's real tokens.

    Example:
        >>> import torch
        >>> mask = torch.ones(2, 5, dtype=torch.long)
        >>> sorted(default_padding_mask({"attention_mask": mask, "decoder_attention_mask": mask[:, :3]}))
        ['*', '*decoder.*']
    """
    source = _batch_tensor(batch, "attention_mask")
    target = _batch_tensor(batch, "decoder_attention_mask")
    if target is None:
        return source
    masks = {"*decoder.*": target}
    if source is not None:
        masks["*"] = source
    return masks


def default_document_ids(batch: Any) -> Tensor | None:
    """The (batch, seq) ``document_ids`` of a dict batch (packed sequences), else None."""
    return _batch_tensor(batch, "document_ids")
