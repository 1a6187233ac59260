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
    from attn_monitor.capture.calls import AttentionCall
    from attn_monitor.capture.consumers import MassDiagnostics, StatisticsUpdate
    from attn_monitor.capture.eager import probabilities_at
    from attn_monitor.capture.hooks import AttentionCapture, evaluate_attention
    from attn_monitor.capture.parallel import declare_heads
    from attn_monitor.capture.selfcheck import SelfCheck
    from attn_monitor.functional.entropy import (
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
    from attn_monitor.functional.masks import Support
    from attn_monitor.hf.trainer import AttentionEntropyCallback
    from attn_monitor.lightning.callback import AttentionEntropyMonitor
    from attn_monitor.lightning.fabric import fabric_sinks
    from attn_monitor.metrics.entropy import AttentionEntropy, AttentionMass, EntropySummary, MassSummary
    from attn_monitor.metrics.statistics import AttentionStatistics, StatisticsSummary, distance_from_probs
    from attn_monitor.monitor.core import MonitorCore
    from attn_monitor.monitor.recording import Statistics
    from attn_monitor.monitor.schedule import Batches
    from attn_monitor.report.alerts import CollapseAlert, MaxLogitAlert, OverloadAlert, TrendAlert
    from attn_monitor.report.comparison import Comparison, compare, load_summary, save_summary
    from attn_monitor.report.loggers import LogOptions

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
    **dict.fromkeys(("CollapseAlert", "MaxLogitAlert", "OverloadAlert", "TrendAlert"), "report.alerts"),
    "AttentionEntropyMonitor": "lightning.callback",
    "AttentionCall": "capture.calls",
    **dict.fromkeys(("AttentionCapture", "evaluate_attention"), "capture.hooks"),
    **dict.fromkeys(("Comparison", "compare", "load_summary", "save_summary"), "report.comparison"),
    "MonitorCore": "monitor.core",
    **dict.fromkeys(("MassDiagnostics", "StatisticsUpdate"), "capture.consumers"),
    "probabilities_at": "capture.eager",
    "fabric_sinks": "lightning.fabric",
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
        "functional.entropy",
    ),
    **dict.fromkeys(("AttentionStatistics", "StatisticsSummary", "distance_from_probs"), "metrics.statistics"),
    "AttentionEntropyCallback": "hf.trainer",
    "LogOptions": "report.loggers",
    "Support": "functional.masks",
    **dict.fromkeys(("AttentionEntropy", "AttentionMass", "EntropySummary", "MassSummary"), "metrics.entropy"),
    "declare_heads": "capture.parallel",
    "Statistics": "monitor.recording",
    "Batches": "monitor.schedule",
    "SelfCheck": "capture.selfcheck",
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
