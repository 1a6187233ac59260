"""attn_monitor: watch how concentrated a Transformer's attention is while it trains."""

from attn_monitor.callback import AttentionEntropyMonitor
from attn_monitor.capture import AttentionCall, AttentionCapture, evaluate_attention, probabilities_at
from attn_monitor.compare import Comparison, compare, load_summary, save_summary
from attn_monitor.diagnostics import MassDiagnostics
from attn_monitor.functional import (
    attention_distance,
    attention_entropy,
    attention_lse,
    attention_max_logit,
    entropy_from_logits,
    entropy_from_qk,
    histogram_quantile,
    mass_fraction,
    normalize_entropy,
)
from attn_monitor.masks import Support
from attn_monitor.metric import AttentionEntropy, AttentionMass, EntropySummary, MassSummary

__all__ = [
    "AttentionCall",
    "AttentionCapture",
    "AttentionEntropy",
    "AttentionEntropyMonitor",
    "AttentionMass",
    "Comparison",
    "EntropySummary",
    "MassDiagnostics",
    "MassSummary",
    "Support",
    "attention_distance",
    "attention_entropy",
    "attention_lse",
    "attention_max_logit",
    "compare",
    "entropy_from_logits",
    "entropy_from_qk",
    "evaluate_attention",
    "histogram_quantile",
    "load_summary",
    "mass_fraction",
    "normalize_entropy",
    "probabilities_at",
    "save_summary",
]
