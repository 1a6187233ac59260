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
    from attn_monitor.capture.evaluate import evaluate_attention
    from attn_monitor.capture.hooks import AttentionCapture
    from attn_monitor.capture.parallel import declare_heads
    from attn_monitor.capture.selfcheck import SelfCheck
    from attn_monitor.functional.entropy import attention_lse, entropy_from_qk, mass_fraction
    from attn_monitor.functional.histograms import histogram_quantile
    from attn_monitor.functional.masks import Support
    from attn_monitor.functional.probs import attention_entropy, entropy_from_logits, normalize_entropy
    from attn_monitor.functional.shards import KeyShardStatistics, key_shard_statistics, merge_key_shards
    from attn_monitor.functional.statistics import attention_distance, attention_max_logit, distance_from_probs
    from attn_monitor.hf.trainer import AttentionEntropyCallback
    from attn_monitor.lightning.callback import AttentionEntropyMonitor
    from attn_monitor.lightning.fabric import fabric_sinks
    from attn_monitor.metrics.entropy import AttentionEntropy, EntropySummary
    from attn_monitor.metrics.mass import AttentionMass, MassSummary
    from attn_monitor.metrics.statistics import AttentionStatistics, StatisticsSummary
    from attn_monitor.monitor.core import MonitorCore
    from attn_monitor.monitor.recording import Statistics
    from attn_monitor.monitor.schedule import Batches
    from attn_monitor.report.alerts import CollapseAlert, MaxLogitAlert, OverloadAlert
    from attn_monitor.report.archive import load_summary, save_summary
    from attn_monitor.report.comparison import Comparison, compare
    from attn_monitor.report.loggers import LogOptions
    from attn_monitor.report.trend import TrendAlert

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
    "AttentionCall": "capture.calls",
    **dict.fromkeys(("MassDiagnostics", "StatisticsUpdate"), "capture.consumers"),
    "probabilities_at": "capture.eager",
    "AttentionCapture": "capture.hooks",
    "evaluate_attention": "capture.evaluate",
    "declare_heads": "capture.parallel",
    "SelfCheck": "capture.selfcheck",
    **dict.fromkeys(("attention_lse", "entropy_from_qk", "mass_fraction"), "functional.entropy"),
    "histogram_quantile": "functional.histograms",
    **dict.fromkeys(("KeyShardStatistics", "key_shard_statistics", "merge_key_shards"), "functional.shards"),
    **dict.fromkeys(("attention_distance", "attention_max_logit", "distance_from_probs"), "functional.statistics"),
    **dict.fromkeys(("attention_entropy", "entropy_from_logits", "normalize_entropy"), "functional.probs"),
    "Support": "functional.masks",
    "AttentionEntropyCallback": "hf.trainer",
    "AttentionEntropyMonitor": "lightning.callback",
    "fabric_sinks": "lightning.fabric",
    **dict.fromkeys(("AttentionEntropy", "EntropySummary"), "metrics.entropy"),
    **dict.fromkeys(("AttentionMass", "MassSummary"), "metrics.mass"),
    **dict.fromkeys(("AttentionStatistics", "StatisticsSummary"), "metrics.statistics"),
    "MonitorCore": "monitor.core",
    "Statistics": "monitor.recording",
    "Batches": "monitor.schedule",
    **dict.fromkeys(("CollapseAlert", "MaxLogitAlert", "OverloadAlert"), "report.alerts"),
    "TrendAlert": "report.trend",
    **dict.fromkeys(("Comparison", "compare"), "report.comparison"),
    **dict.fromkeys(("load_summary", "save_summary"), "report.archive"),
    "LogOptions": "report.loggers",
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
