"""Alerts on a computed summary: heads whose attention collapsed or stays near uniform, logits
that grow past a threshold, documents that leak.

Each alert reads a summary, returns what to log and warns once per finding;
it never touches a trainer (the callback decides whether to stop).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attn_monitor.metric import EntropySummary, MassSummary
from attn_monitor.shared import WarnOnce

if TYPE_CHECKING:
    from attn_monitor.head_stats import StatisticsSummary

__all__ = ["LEAKAGE_TOLERANCE", "CollapseAlert", "LeakageAlert", "MaxLogitAlert", "OverloadAlert"]

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

        def message(layer: str, index: int, new: list[int]) -> str:
            return (
                f"attn_monitor: attention entropy collapse in {layer!r}, heads {new}: median normalised "
                f"entropy {[round(float(medians[index, h]), 3) for h in new]} "
                f"(first monitored epoch: {[round(float(first[index, h]), 3) for h in new]}, "
                f"threshold {self.threshold}, allowed drop {self.drop})."
            )

        self.flagged = bool(flagged.any())
        return _flag_heads(
            summary, flagged, (self.prefix, "collapsed_heads"), key, self._warn, self._warn_once, message
        )


class OverloadAlert:
    """Flag heads whose median normalised entropy stays above a threshold (near-uniform attention).

    The mirror of :class:`CollapseAlert`: a head that spreads its attention
    almost evenly over every visible key ("entropic overload", seen in early
    layers) attends to nothing in particular. Each flagged head warns once,
    naming the layer, the heads and their medians; every call returns
    ``{prefix}/{layer}/overloaded_heads``. It only warns: a head may be
    meant to average (the callback never stops training for it).

    Args:
        threshold: flag heads whose median is above this (None: off); 0.97 is
            a reasonable start.
        prefix: first component of the returned names.
        warn: ``warn(message, stacklevel=...)``, :func:`warnings.warn` by default.

    Raises:
        ValueError: ``threshold`` outside [0, 1].

    Example:
        >>> import math, warnings, torch
        >>> from attn_monitor import AttentionEntropy
        >>> metric = AttentionEntropy(num_bins=100)
        >>> medians = torch.tensor([0.5, 0.995], dtype=torch.float64)  # head 1 near uniform
        >>> metric.update("blocks.0.attn", medians[None, :, None].expand(1, 2, 4) * math.log(8.0), torch.tensor(8))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     OverloadAlert(threshold=0.97)(metric.compute())
        {'attn_entropy/blocks.0.attn/overloaded_heads': 1.0}
        >>> len(caught)
        1
    """

    def __init__(
        self,
        *,
        threshold: float | None = None,
        prefix: str = "attn_entropy",
        warn: Callable[..., object] = warnings.warn,
    ) -> None:
        if threshold is not None and (isinstance(threshold, bool) or not 0.0 <= threshold <= 1.0):
            raise ValueError(f"Expected `overload_threshold` in [0, 1] or None, got {threshold!r}.")
        self.threshold = threshold
        self.prefix = prefix
        self._warn = warn
        self._warn_once = WarnOnce(warn)

    def __call__(self, summary: EntropySummary, key: Hashable = 0) -> dict[str, float]:
        """``{prefix}/{layer}/overloaded_heads`` of ``summary``; warns once per newly flagged head of ``key``."""
        if self.threshold is None:
            return {}
        medians = summary.quantile(0.5)
        flagged = medians > self.threshold  # NaN (no counted query) is never flagged

        def message(layer: str, index: int, new: list[int]) -> str:
            return (
                f"attn_monitor: near-uniform attention in {layer!r}, heads {new}: median normalised entropy "
                f"{[round(float(medians[index, h]), 3) for h in new]} above the overload threshold {self.threshold}."
            )

        return _flag_heads(
            summary, flagged, (self.prefix, "overloaded_heads"), key, self._warn, self._warn_once, message
        )


class MaxLogitAlert:
    """Flag heads whose maximum attention logit exceeds a threshold (QK-clip style).

    Reads a :class:`~attn_monitor.head_stats.StatisticsSummary`. Each flagged
    head warns once, naming the layer, the heads and their max logits; every
    call returns ``{prefix}/{layer}/over_threshold_heads`` for the layers
    with a max logit. It only warns (the callback never stops training for it).

    Args:
        threshold: flag heads whose max logit is above this (None: off), e.g.
            100; max logits depend on the model's scale and key norms.
        prefix: first component of the returned names.
        warn: ``warn(message, stacklevel=...)``, :func:`warnings.warn` by default.

    Raises:
        TypeError: ``threshold`` is not a number.

    Example:
        >>> import warnings, torch
        >>> from attn_monitor.head_stats import AttentionStatistics
        >>> metric = AttentionStatistics()
        >>> metric.update("blocks.0.attn", max_logit=torch.tensor([[[12.0], [250.0]]]))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     MaxLogitAlert(threshold=100)(metric.compute())
        {'attn_max_logit/blocks.0.attn/over_threshold_heads': 1.0}
        >>> len(caught)
        1
    """

    def __init__(
        self,
        *,
        threshold: float | None = None,
        prefix: str = "attn_max_logit",
        warn: Callable[..., object] = warnings.warn,
    ) -> None:
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
            raise TypeError(f"Expected `max_logit_threshold` to be a number or None, got {threshold!r}.")
        if threshold is not None and math.isnan(threshold):
            raise ValueError("Expected `max_logit_threshold` to be a number or None, got nan.")
        self.threshold = threshold
        self.prefix = prefix
        self._warn = warn
        self._warn_once = WarnOnce(warn)

    def __call__(self, summary: StatisticsSummary, key: Hashable = 0) -> dict[str, float]:
        """``{prefix}/{layer}/over_threshold_heads`` of ``summary``; warns once per newly flagged head of ``key``."""
        if self.threshold is None:
            return {}
        peaks = summary.max_logit
        flagged = peaks > self.threshold  # NaN (no max logit) is never flagged

        def message(layer: str, index: int, new: list[int]) -> str:
            return (
                f"attn_monitor: large attention logits in {layer!r}, heads {new}: max logit "
                f"{[round(float(peaks[index, h]), 2) for h in new]} above the threshold {self.threshold}."
            )

        name = (self.prefix, "over_threshold_heads")
        flags = _flag_heads(summary, flagged, name, key, self._warn, self._warn_once, message)
        # Layers that returned probabilities have no max logit: no count either.
        measured = summary.logit_count.sum(-1) > 0
        return {
            f"{self.prefix}/{layer}/{name[1]}": flags[f"{self.prefix}/{layer}/{name[1]}"]
            for index, layer in enumerate(summary.layers)
            if measured[index]
        }


def _flag_heads(
    summary: EntropySummary | StatisticsSummary,
    flagged: Tensor,
    name: tuple[str, str],
    key: Hashable,
    warn: Callable[..., object],
    warn_once: WarnOnce,
    message: Callable[[str, int, list[int]], str],
) -> dict[str, float]:
    """``{family}/{layer}/{count}`` (``name``) -> flagged heads of each layer; one warning per newly flagged layer.

    ``message(layer, layer index, new heads)`` says what was found; a head
    warns once per ``key`` (e.g. a dataloader), however often it is flagged.
    """
    flags = {}
    for index, layer in enumerate(summary.layers):
        heads = [h for h in range(summary.num_heads[index]) if flagged[index, h]]
        flags[f"{name[0]}/{layer}/{name[1]}"] = float(len(heads))
        unseen = set(warn_once.unseen((key, layer, h) for h in heads))
        new = [h for h in heads if (key, layer, h) in unseen]
        if new:
            warn(message(layer, index, new), stacklevel=3)
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
