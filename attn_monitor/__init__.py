"""attn_monitor: watch how concentrated a Transformer's attention is while it trains.

Every public name loads on first use (PEP 562), so ``import attn_monitor``
costs nothing and never imports torch, Lightning, matplotlib, wandb or
transformers; ``from attn_monitor import AttentionEntropyMonitor`` loads the
Lightning callback, ``from attn_monitor import AttentionEntropyCallback`` the
Hugging Face Trainer's, ``from attn_monitor import entropy_from_qk`` only torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attn_monitor.alerts import CollapseAlert, MaxLogitAlert, OverloadAlert, TrendAlert
    from attn_monitor.callback import AttentionEntropyMonitor
    from attn_monitor.calls import AttentionCall
    from attn_monitor.capture import AttentionCapture, evaluate_attention
    from attn_monitor.comparison import Comparison, compare, load_summary, save_summary
    from attn_monitor.consumers import MassDiagnostics, StatisticsUpdate
    from attn_monitor.core import MonitorCore
    from attn_monitor.eager import probabilities_at
    from attn_monitor.fabric import fabric_sinks
    from attn_monitor.functional import (
        KeyShardStatistics,
        attention_distance,
        attention_entropy,
        attention_lse,
        attention_max_logit,
        entropy_from_logits,
        entropy_from_qk,
        histogram_quantile,
        key_shard_statistics,
        mass_fraction,
        merge_key_shards,
        normalize_entropy,
    )
    from attn_monitor.head_stats import AttentionStatistics, StatisticsSummary, distance_from_probs
    from attn_monitor.hf_trainer import AttentionEntropyCallback
    from attn_monitor.loggers import LogOptions
    from attn_monitor.masks import Support
    from attn_monitor.metric import AttentionEntropy, AttentionMass, EntropySummary, MassSummary
    from attn_monitor.parallel import declare_heads
    from attn_monitor.recording import Statistics
    from attn_monitor.schedule import Batches
    from attn_monitor.selfcheck import SelfCheck

__all__ = [
    "AttentionCall",
    "AttentionCapture",
    "AttentionEntropy",
    "AttentionEntropyCallback",
    "AttentionEntropyMonitor",
    "AttentionMass",
    "AttentionStatistics",
    "Batches",
    "CollapseAlert",
    "Comparison",
    "EntropySummary",
    "KeyShardStatistics",
    "LogOptions",
    "MassDiagnostics",
    "MassSummary",
    "MaxLogitAlert",
    "MonitorCore",
    "OverloadAlert",
    "SelfCheck",
    "Statistics",
    "StatisticsSummary",
    "StatisticsUpdate",
    "Support",
    "TrendAlert",
    "attention_distance",
    "attention_entropy",
    "attention_lse",
    "attention_max_logit",
    "compare",
    "declare_heads",
    "distance_from_probs",
    "entropy_from_logits",
    "entropy_from_qk",
    "evaluate_attention",
    "fabric_sinks",
    "histogram_quantile",
    "key_shard_statistics",
    "load_summary",
    "mass_fraction",
    "merge_key_shards",
    "normalize_entropy",
    "probabilities_at",
    "save_summary",
]

#: Public name -> the module that defines it.
_HOMES = {
    **dict.fromkeys(("CollapseAlert", "MaxLogitAlert", "OverloadAlert", "TrendAlert"), "alerts"),
    "AttentionEntropyMonitor": "callback",
    "AttentionCall": "calls",
    **dict.fromkeys(("AttentionCapture", "evaluate_attention"), "capture"),
    **dict.fromkeys(("Comparison", "compare", "load_summary", "save_summary"), "comparison"),
    "MonitorCore": "core",
    **dict.fromkeys(("MassDiagnostics", "StatisticsUpdate"), "consumers"),
    "probabilities_at": "eager",
    "fabric_sinks": "fabric",
    **dict.fromkeys(
        (
            "KeyShardStatistics",
            "attention_distance",
            "attention_entropy",
            "attention_lse",
            "attention_max_logit",
            "entropy_from_logits",
            "entropy_from_qk",
            "histogram_quantile",
            "key_shard_statistics",
            "mass_fraction",
            "merge_key_shards",
            "normalize_entropy",
        ),
        "functional",
    ),
    **dict.fromkeys(("AttentionStatistics", "StatisticsSummary", "distance_from_probs"), "head_stats"),
    "AttentionEntropyCallback": "hf_trainer",
    "LogOptions": "loggers",
    "Support": "masks",
    **dict.fromkeys(("AttentionEntropy", "AttentionMass", "EntropySummary", "MassSummary"), "metric"),
    "declare_heads": "parallel",
    "Statistics": "recording",
    "Batches": "schedule",
    "SelfCheck": "selfcheck",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'attn_monitor' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"attn_monitor.{home}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
