"""Alerts on a computed summary: heads whose attention collapsed, documents that leak.

Each alert reads a summary, returns what to log and warns once per finding;
it never touches a trainer (the callback decides whether to stop).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

from attn_monitor.metric import EntropySummary, MassSummary
from attn_monitor.shared import WarnOnce

__all__ = ["LEAKAGE_TOLERANCE", "CollapseAlert", "LeakageAlert"]

#: Mean leakage above this (per layer) means packed documents see each other.
LEAKAGE_TOLERANCE = 1e-4


class CollapseAlert:
    """Flag heads whose median normalised entropy fell below a threshold or dropped by a fraction.

    The first summary a key (e.g. a dataloader) sees is its baseline for
    ``drop``. Each flagged head warns once, naming the layer, the heads and
    their medians; every call returns ``{prefix}/{layer}/collapsed_heads``.

    Args:
        threshold: flag heads whose median is below this (None: off).
        drop: flag heads whose median fell by more than this fraction of its
            baseline (None: off).
        prefix: first component of the returned names.
        warn: ``warn(message, stacklevel=...)``, :func:`warnings.warn` by default.

    Raises:
        ValueError: ``threshold`` or ``drop`` outside [0, 1].

    Example:
        >>> import math, warnings, torch
        >>> from attn_monitor import AttentionEntropy
        >>> def summary(heads):  # every query of head h at normalised entropy heads[h]
        ...     metric = AttentionEntropy(num_bins=100)
        ...     values = torch.tensor(heads, dtype=torch.float64)[None, :, None].expand(1, len(heads), 4)
        ...     metric.update("blocks.0.attn", values * math.log(8.0), torch.tensor(8))
        ...     return metric.compute()
        >>> alert = CollapseAlert(drop=0.5)
        >>> alert(summary([0.8, 0.8]))
        {'attn_entropy/blocks.0.attn/collapsed_heads': 0.0}
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     alert(summary([0.8, 0.2]))
        {'attn_entropy/blocks.0.attn/collapsed_heads': 1.0}
        >>> alert.flagged, len(caught)
        (True, 1)
    """

    def __init__(
        self,
        *,
        threshold: float | None = None,
        drop: float | None = None,
        prefix: str = "attn_entropy",
        warn: Callable[..., object] = warnings.warn,
    ) -> None:
        for name, value in (("collapse_threshold", threshold), ("collapse_drop", drop)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"Expected `{name}` in [0, 1] or None, got {value!r}.")
        self.threshold = threshold
        self.drop = drop
        self.prefix = prefix
        #: Whether the last call flagged any head.
        self.flagged = False
        self.baselines: dict[Hashable, Tensor] = {}
        self._warn = warn
        self._warn_once = WarnOnce(warn)

    @property
    def enabled(self) -> bool:
        return self.threshold is not None or self.drop is not None

    def __call__(self, summary: EntropySummary, key: Hashable = 0) -> dict[str, float]:
        """``{prefix}/{layer}/collapsed_heads`` of ``summary``; warns once per newly flagged head of ``key``."""
        self.flagged = False
        if not self.enabled:
            return {}
        medians = summary.quantile(0.5)
        first = self.baselines.setdefault(key, medians.clone())
        flagged = torch.zeros_like(medians, dtype=torch.bool)
        if self.threshold is not None:
            flagged |= medians < self.threshold
        if self.drop is not None and first.shape == medians.shape:
            flagged |= medians < first * (1.0 - self.drop)
        flags = {}
        for index, layer in enumerate(summary.layers):
            heads = [h for h in range(summary.num_heads[index]) if flagged[index, h]]
            flags[f"{self.prefix}/{layer}/collapsed_heads"] = float(len(heads))
            unseen = set(self._warn_once.unseen((key, layer, h) for h in heads))
            new = [h for h in heads if (key, layer, h) in unseen]
            if new:
                self._warn(
                    f"attn_monitor: attention entropy collapse in {layer!r}, heads {new}: median normalised "
                    f"entropy {[round(float(medians[index, h]), 3) for h in new]} "
                    f"(first monitored epoch: {[round(float(first[index, h]), 3) for h in new]}, "
                    f"threshold {self.threshold}, allowed drop {self.drop}).",
                    stacklevel=2,
                )
        self.flagged = bool(flagged.any())
        return flags


class LeakageAlert:
    """Warn once when queries attend across packed documents (mean leakage above :data:`LEAKAGE_TOLERANCE`).

    Args:
        warn: ``warn(message, stacklevel=...)``, :func:`warnings.warn` by default.
    """

    def __init__(self, warn: Callable[..., object] = warnings.warn) -> None:
        self._warn_once = WarnOnce(warn)

    def __call__(self, masses: MassSummary) -> list[str]:
        """The layers of ``masses`` that leak; warns the first time any does."""
        leaky = [
            key.split("/", 1)[1]
            for index, key in enumerate(masses.layers)
            if key.startswith("leakage/") and masses.layer_mean[index] > LEAKAGE_TOLERANCE
        ]
        if leaky:
            self._warn_once(
                "leakage",
                f"attn_monitor: queries attend across packed documents in layers {leaky}; the attention mask "
                "does not isolate the packed samples.",
            )
        return leaky
