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

from attn_monitor.metrics.entropy import EntropySummary, MassSummary
from attn_monitor.shared.checks import WarnOnce

if TYPE_CHECKING:
    from attn_monitor.metrics.statistics import StatisticsSummary

__all__ = [
    "LEAKAGE_TOLERANCE",
    "Alert",
    "CollapseAlert",
    "LeakageAlert",
    "MaxLogitAlert",
    "OverloadAlert",
    "TrendAlert",
    "least_squares_slope",
]

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


def least_squares_slope(history: Tensor) -> Tensor:
    """Least-squares slope per step of values at equally spaced steps.

    Args:
        history: (k, ...) values, oldest first, k >= 2.

    Returns:
        (...) slope per step, ``sum_t (t - mean t) y_t / sum_t (t - mean t)^2``;
        NaN where any of the k values is NaN.

    Example:
        >>> least_squares_slope(torch.tensor([[1.0, 5.0], [2.0, 5.0], [3.0, 5.0]]))
        tensor([1., 0.])
    """
    steps = torch.arange(history.shape[0], dtype=history.dtype, device=history.device)
    centred = (steps - steps.mean()).view(-1, *(1,) * (history.dim() - 1))
    return (centred * history).sum(0) / centred.square().sum()


def sustained(history: Tensor, rate: float) -> Tensor:
    """Where the values of ``history`` (k, ...) trend by at least ``rate`` per step (a negative rate: a drop).

    Sustained means both: the least-squares slope is at least ``rate`` (at
    most, for a negative one), and no step of the k goes the other way. NaN
    anywhere in the window is never sustained.
    """
    direction = math.copysign(1.0, rate)
    steps_along = (history.diff(dim=0) * direction >= 0).all(0)
    return (least_squares_slope(history) * direction >= abs(rate)) & steps_along


class TrendAlert(Alert):
    """Flag heads whose max logit grows, or whose median entropy drops, steadily over recent validations.

    Over the last ``window`` monitored validations of a key (a dataloader)
    it fits, per head, the least-squares slope per validation of
    ``ln(max logit)`` and of the median normalised entropy. A trend is
    **sustained** when, over the whole window, both hold:

    * the slope is beyond the rate: ``ln(max logit)`` rises by at least
      ``logit_growth`` per validation (0.1: about 10% growth each
      validation), or the median falls by at least ``entropy_drop`` per
      validation;
    * no validation steps back: each value is at least (for the logit; at
      most, for the entropy) the one before it.

    Level thresholds (:class:`MaxLogitAlert`, :class:`CollapseAlert`) look
    at one validation; the trend warns while the level is still fine. Each
    flagged head warns once per key and quantity, naming the layer, head,
    slope and window. Heads whose max logit is not positive in the window
    (no logarithm), or that have no counted query, are never flagged. Once
    the window is full every call returns, per layer,
    ``{prefix}/{layer}/rising_logit_heads`` and
    ``{prefix}/{layer}/falling_entropy_heads`` (the flagged heads), and
    ``{prefix}/{layer}/log_max_logit_slope`` (largest over heads) and
    ``{prefix}/{layer}/median_entropy_slope`` (smallest over heads).
    It only warns.

    Args:
        window: the k monitored validations a trend is fitted over, at least 3.
        logit_growth: flag heads whose ``ln(max logit)`` rises by at least
            this per validation (None: off; needs ``Statistics(max_logit=True)``).
        entropy_drop: flag heads whose median normalised entropy falls by at
            least this per validation (None: off).
        prefix: first component of the returned names.
        warn: ``warn(message, stacklevel=...)``, :func:`warnings.warn` by default.

    Raises:
        ValueError: a window below 3, a rate that is not a positive finite number.

    Example:
        >>> import math, warnings, torch
        >>> from attn_monitor import AttentionEntropy
        >>> def summary(median):  # every query of the one head at normalised entropy ``median``
        ...     metric = AttentionEntropy(num_bins=100)
        ...     metric.update("blocks.0.attn", torch.full((1, 1, 4), median * math.log(8.0)), torch.tensor(8))
        ...     return metric.compute()
        >>> alert = TrendAlert(window=3, entropy_drop=0.05)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     logged = [alert.check(summary(median), None) for median in (0.9, 0.8, 0.705)]
        >>> logged[-1]["attn_trend/blocks.0.attn/falling_entropy_heads"], len(caught)
        (1.0, 1)
    """

    reads = "both"
    _shown = ("window", "logit_growth", "entropy_drop")

    def __init__(
        self,
        window: int = 5,
        *,
        logit_growth: float | None = None,
        entropy_drop: float | None = None,
        prefix: str = "attn_trend",
        warn: Callable[..., object] = warnings.warn,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 3:
            raise ValueError(f"Expected `window` of TrendAlert to be an int >= 3 (validations), got {window!r}.")
        for name, rate in (("logit_growth", logit_growth), ("entropy_drop", entropy_drop)):
            if rate is not None and (
                isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf
            ):
                raise ValueError(f"Expected `{name}` of TrendAlert to be a positive number or None, got {rate!r}.")
        super().__init__(prefix, warn)
        self.window = window
        self.logit_growth = logit_growth
        self.entropy_drop = entropy_drop
        #: (key, quantity) -> (layers, the last ``window`` (L, H) values, validations seen).
        self.histories: dict[tuple[Hashable, str], tuple[list[str], list[Tensor], int]] = {}

    @property
    def enabled(self) -> bool:
        return self.logit_growth is not None or self.entropy_drop is not None

    @property
    def needs_max_logit(self) -> bool:
        return self.logit_growth is not None

    def reset(self) -> None:
        self.histories = {}

    def state_dict(self) -> dict[str, Any]:
        """The windows of the validation dataloaders, as ``trend_history``."""
        return {
            "trend_history": [
                [key, quantity, layers, [value.tolist() for value in values], seen]
                for (key, quantity), (layers, values, seen) in self.histories.items()
                if isinstance(key, int)
            ]
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, quantity, layers, values, seen in state.get("trend_history") or []:
            tensors = [torch.tensor(value, dtype=torch.float64) for value in values]
            self.histories[(int(key), quantity)] = (list(layers), tensors, int(seen))

    def check(
        self, entropy: EntropySummary, statistics: StatisticsSummary | None, key: Hashable = 0
    ) -> dict[str, float]:
        return self(entropy, statistics, key=key)

    def __call__(
        self, entropy: EntropySummary, statistics: StatisticsSummary | None = None, key: Hashable = 0
    ) -> dict[str, float]:
        """Add one validation's summaries to ``key``'s window; flag and name the sustained trends."""
        out: dict[str, float] = {}
        flagged = False
        if self.entropy_drop is not None:
            out.update(self._trend(entropy, entropy.quantile(0.5), "entropy", -self.entropy_drop, key))
            flagged = self.flagged
        if self.logit_growth is not None and statistics is not None:
            peaks = statistics.max_logit
            logs = torch.where(peaks > 0, peaks.clamp(min=1e-300).log(), math.nan)
            out.update(self._trend(statistics, logs, "logit", self.logit_growth, key))
            flagged |= self.flagged
        self.flagged = flagged
        return out

    def _trend(
        self, summary: EntropySummary | StatisticsSummary, values: Tensor, quantity: str, rate: float, key: Hashable
    ) -> dict[str, float]:
        """Push ``values`` (L, H) into the window of ``(key, quantity)``; its names once the window is full."""
        layers, window, seen = self.histories.get((key, quantity), ([], [], 0))
        if layers != summary.layers or (window and window[-1].shape != values.shape):
            window = []  # another layout (a layer appeared): the old values are no trend of these heads
        window = [*window, values.to(torch.float64).cpu()][-self.window :]
        seen += 1
        self.histories[(key, quantity)] = (list(summary.layers), window, seen)
        self.flagged = False
        if len(window) < self.window:
            return {}
        history = torch.stack(window)
        slopes = least_squares_slope(history)
        what = "ln(max logit)" if quantity == "logit" else "median normalised entropy"
        first = seen - self.window + 1

        def message(layer: str, index: int, new: list[int]) -> str:
            return (
                f"attn_monitor: sustained {'growth' if rate > 0 else 'drop'} of {what} in {layer!r}, heads {new}: "
                f"slope {[round(float(slopes[index, h]), 4) for h in new]} per validation over monitored "
                f"validations {first}-{seen} (the last {self.window}, none a step back; rate {abs(rate)})."
            )

        count = "rising_logit_heads" if quantity == "logit" else "falling_entropy_heads"
        flags = self._flag_heads(summary, sustained(history, rate), count, (key, quantity), message)
        name = "log_max_logit_slope" if quantity == "logit" else "median_entropy_slope"
        extreme = slopes.nan_to_num(-math.inf if rate > 0 else math.inf)
        extreme = extreme.amax(-1) if rate > 0 else extreme.amin(-1)
        out = {}
        for index, layer in enumerate(summary.layers):
            if math.isfinite(float(extreme[index])):  # layers with a slope only (a max logit, counted queries)
                out[f"{self.prefix}/{layer}/{count}"] = flags[f"{self.prefix}/{layer}/{count}"]
                out[f"{self.prefix}/{layer}/{name}"] = float(extreme[index])
        return out


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
