"""Trend alerts: per head, sustained growth of the max logit or drop of the median entropy."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attn_monitor.metrics.entropy import EntropySummary

if TYPE_CHECKING:
    from attn_monitor.metrics.statistics import StatisticsSummary
from attn_monitor.report.alerts import Alert

__all__ = ["TrendAlert", "least_squares_slope"]


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
