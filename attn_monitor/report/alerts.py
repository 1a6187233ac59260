"""Alerts on a computed summary: heads whose attention collapsed or stays near uniform, logits
that grow past a threshold or steadily over recent validations, documents that leak.

Each alert reads a summary, returns what to log and warns once per finding;
it never touches a trainer: a :class:`CollapseAlert` with ``stop=True``
asks the monitor to stop, and the training loop's adapter does.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from attn_monitor.metrics.entropy import EntropySummary
from attn_monitor.metrics.mass import MassSummary
from attn_monitor.shared.checks import WarnOnce

if TYPE_CHECKING:
    from attn_monitor.metrics.statistics import StatisticsSummary

__all__ = ["LEAKAGE_TOLERANCE", "Alert", "CollapseAlert", "LeakageAlert", "MaxLogitAlert", "OverloadAlert"]

#: Mean leakage above this (per layer) means packed documents see each other.
LEAKAGE_TOLERANCE = 1e-4


class Alert:
    """What the head alerts share: the summary they read, how they warn, whether a finding stops training.

    Args:
        prefix: first component of the returned names.
        warn: ``warn(message, stacklevel=...)``, :func:`warnings.warn` by default.
    """

    #: The summary an alert reads: ``"entropy"`` (:class:`EntropySummary`) or ``"statistics"``.
    reads: ClassVar[str] = "entropy"
    #: Whether a finding asks the monitor to stop training.
    stop: bool = False
    #: The settings :meth:`__repr__` shows.
    _shown: ClassVar[tuple[str, ...]] = ("threshold",)

    def __init__(self, prefix: str, warn: Callable[..., object]) -> None:
        self.prefix = prefix
        #: Whether the last call flagged any head.
        self.flagged = False
        self.bind(warn)

    @property
    def enabled(self) -> bool:
        """Whether the alert checks anything."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{name}={getattr(self, name)!r}' for name in self._shown)})"

    def bind(self, warn: Callable[..., object], prefix: str | None = None) -> None:
        """Warn through ``warn`` from now on (the monitor's: rank zero, and W&B alerts), and name with ``prefix``."""
        self._warn = warn
        self._warn_once = WarnOnce(warn)
        if prefix is not None:
            self.prefix = prefix

    @property
    def needs_max_logit(self) -> bool:
        """Whether the alert reads the max logit (``Statistics(max_logit=True)``)."""
        return self.reads == "statistics"

    def check(
        self, entropy: EntropySummary, statistics: StatisticsSummary | None, key: Hashable = 0
    ) -> dict[str, float]:
        """Run the alert on the summary it reads (none: nothing to check); what it logs."""
        read = entropy if self.reads == "entropy" else statistics
        return {} if read is None else self(read, key=key)  # type: ignore[operator]

    def reset(self) -> None:
        """Forget what a run learnt (baselines): a new run starts from zero."""

    def state_dict(self) -> dict[str, Any]:
        """What a run learnt, for a checkpoint (lists, so ``torch.load(weights_only=True)`` reads it)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (keys it does not hold are left alone)."""

    def _flag_heads(
        self,
        summary: EntropySummary | StatisticsSummary,
        flagged: Tensor,
        count: str,
        key: Hashable,
        message: Callable[[str, int, list[int]], str],
    ) -> dict[str, float]:
        """``{prefix}/{layer}/{count}`` -> flagged heads of each layer; one warning per newly flagged layer.

        ``message(layer, layer index, new heads)`` says what was found; a head
        warns once per ``key`` (e.g. a dataloader), however often it is flagged.
        """
        self.flagged = bool(flagged.any())
        flags = {}
        for index, layer in enumerate(summary.layers):
            heads = [h for h in range(summary.num_heads[index]) if flagged[index, h]]
            flags[f"{self.prefix}/{layer}/{count}"] = float(len(heads))
            unseen = set(self._warn_once.unseen((key, layer, h) for h in heads))
            new = [h for h in heads if (key, layer, h) in unseen]
            if new:
                self._warn(message(layer, index, new), stacklevel=3)
        return flags


def _check_level(alert: str, name: str, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1):
        raise ValueError(f"Expected `{name}` of {alert} in [0, 1] or None, got {value!r}.")


class CollapseAlert(Alert):
    """Flag heads whose median normalised entropy fell below a threshold or dropped by a fraction.

    The first summary a key (e.g. a dataloader) sees is its baseline for
    ``drop``. Each flagged head warns once, naming the layer, the heads and
    their medians; every call returns ``{prefix}/{layer}/collapsed_heads``.

    Args:
        threshold: flag heads whose median is below this (None: off).
        drop: flag heads whose median fell by more than this fraction of its
            baseline (None: off).
        stop: ask the monitor to stop training when a head is flagged
            (default: warn and log only).
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

    _shown = ("threshold", "drop", "stop")

    def __init__(
        self,
        threshold: float | None = None,
        drop: float | None = None,
        *,
        stop: bool = False,
        prefix: str = "attn_entropy",
        warn: Callable[..., object] = warnings.warn,
    ) -> None:
        _check_level("CollapseAlert", "threshold", threshold)
        _check_level("CollapseAlert", "drop", drop)
        super().__init__(prefix, warn)
        self.threshold = threshold
        self.drop = drop
        self.stop = bool(stop)
        #: The first summary of each key: the reference for ``drop``.
        self.baselines: dict[Hashable, Tensor] = {}

    @property
    def enabled(self) -> bool:
        return self.threshold is not None or self.drop is not None

    def reset(self) -> None:
        self.baselines = {}

    def state_dict(self) -> dict[str, Any]:
        """The baselines of the validation dataloaders, as ``first_medians``."""
        return {"first_medians": {key: value.tolist() for key, value in self.baselines.items() if isinstance(key, int)}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        first = state.get("first_medians") or {}
        if isinstance(first, list):  # one validation dataloader, as saved before per-dataloader baselines
            first = {0: first}
        self.baselines = {int(k): torch.tensor(v, dtype=torch.float64) for k, v in first.items()}

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

        return self._flag_heads(summary, flagged, "collapsed_heads", key, message)


class OverloadAlert(Alert):
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
        threshold: float | None = None,
        *,
        prefix: str = "attn_entropy",
        warn: Callable[..., object] = warnings.warn,
    ) -> None:
        _check_level("OverloadAlert", "threshold", threshold)
        super().__init__(prefix, warn)
        self.threshold = threshold

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

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

        return self._flag_heads(summary, flagged, "overloaded_heads", key, message)


class MaxLogitAlert(Alert):
    """Flag heads whose maximum attention logit exceeds a threshold (QK-clip style).

    Reads a :class:`~attn_monitor.metrics.statistics.StatisticsSummary`. Each flagged
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
        >>> from attn_monitor.metrics.statistics import AttentionStatistics
        >>> metric = AttentionStatistics()
        >>> metric.update("blocks.0.attn", max_logit=torch.tensor([[[12.0], [250.0]]]))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     MaxLogitAlert(threshold=100)(metric.compute())
        {'attn_max_logit/blocks.0.attn/over_threshold_heads': 1.0}
        >>> len(caught)
        1
    """

    reads = "statistics"

    def __init__(
        self,
        threshold: float | None = None,
        *,
        prefix: str = "attn_max_logit",
        warn: Callable[..., object] = warnings.warn,
    ) -> None:
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
            raise TypeError(f"Expected `threshold` of MaxLogitAlert to be a number or None, got {threshold!r}.")
        if threshold is not None and math.isnan(threshold):
            raise ValueError("Expected `threshold` of MaxLogitAlert to be a number or None, got nan.")
        super().__init__(prefix, warn)
        self.threshold = threshold

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

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

        flags = self._flag_heads(summary, flagged, "over_threshold_heads", key, message)
        # Layers that returned probabilities have no max logit: no count either.
        measured = summary.logit_count.sum(-1) > 0
        return {
            name: flags[name]
            for index, name in enumerate(f"{self.prefix}/{layer}/over_threshold_heads" for layer in summary.layers)
            if measured[index]
        }


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
