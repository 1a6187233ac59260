"""Pure tensor math: supports, entropy, logsumexp, mass, max logit, distance, histograms.

No state, hooks or logging. The functions users call are re-exported here
(``from attn_monitor.functional import entropy_from_qk``).
"""

from attn_monitor.functional.entropy import attention_lse, attention_lse_entropy, entropy_from_qk, mass_fraction
from attn_monitor.functional.histograms import coarsen, histogram_quantile
from attn_monitor.functional.probs import attention_entropy, entropy_from_logits, normalize_entropy, restrict_to_support
from attn_monitor.functional.shards import key_shard_statistics, merge_key_shards
from attn_monitor.functional.statistics import attention_distance, attention_max_logit

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
