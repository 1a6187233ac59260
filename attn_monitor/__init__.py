"""attn_monitor: watch how concentrated a Transformer's attention is while it trains."""

from attn_monitor.functional import (
    attention_entropy,
    entropy_from_logits,
    entropy_from_qk,
    histogram_quantile,
    normalize_entropy,
)
from attn_monitor.masks import Support
from attn_monitor.metric import AttentionEntropy, EntropySummary

__all__ = [
    "AttentionEntropy",
    "EntropySummary",
    "Support",
    "attention_entropy",
    "entropy_from_logits",
    "entropy_from_qk",
    "histogram_quantile",
    "normalize_entropy",
]
