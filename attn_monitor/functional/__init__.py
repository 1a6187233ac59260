"""Pure tensor math: supports, entropy, logsumexp, mass, max logit, distance, histograms.

No state, hooks or logging. The functions users call are re-exported here
(``from attn_monitor.functional import entropy_from_qk``).
"""

from attn_monitor.functional.entropy import (
    attention_distance,
    attention_entropy,
    attention_lse,
    attention_lse_entropy,
    attention_max_logit,
    coarsen,
    entropy_from_logits,
    entropy_from_qk,
    histogram_quantile,
    key_shard_statistics,
    mass_fraction,
    merge_key_shards,
    normalize_entropy,
    restrict_to_support,
)

__all__ = [
    "attention_distance",
    "attention_entropy",
    "attention_lse",
    "attention_lse_entropy",
    "attention_max_logit",
    "coarsen",
    "entropy_from_logits",
    "entropy_from_qk",
    "histogram_quantile",
    "key_shard_statistics",
    "mass_fraction",
    "merge_key_shards",
    "normalize_entropy",
    "restrict_to_support",
]
