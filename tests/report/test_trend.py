"""Trend alerts: the slope of ln(max logit) and of the median entropy per head over recent validations.

Every expected slope is computed independently with :func:`statistics.linear_regression`
(Python's own least squares over the validation numbers), and "sustained" is
re-derived here from its definition: the slope beyond the rate and no step back
in the window. The real fit compares with the float64 max logits of
tests/test_head_stats.py's reference (TinyGPT's own projections).
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
import warnings
from pathlib import Path

import pytest
import torch

from attn_monitor import LogOptions, MaxLogitAlert, Statistics, TrendAlert
from attn_monitor.lightning.callback import AttentionEntropyMonitor
from attn_monitor.metrics.entropy import AttentionEntropy, EntropySummary
from attn_monitor.metrics.statistics import AttentionStatistics, StatisticsSummary
from tests.helpers import lightning_models as lm
from tests.lightning.test_callback import make_trainer
from tests.metrics.test_statistics import tiny_gpt_reference

LAYER = "blocks.0.attn"

#: Per head (4 heads), the max logit at five validations: steady 20% growth (flagged), a larger overall
#: growth with one step back (sustained once the step back leaves the window), slow 5% growth (below
#: the rate), and one head never positive (no logarithm).
LOGITS = [
    [10.0, 12.0, 14.4, 17.28, 20.736],
    [10.0, 14.0, 13.5, 19.0, 26.0],
    [10.0, 10.5, 11.025, 11.576, 12.155],
    [-3.0, -2.0, -1.0, -0.5, -0.1],
]
#: Per head, the median normalised entropy at five validations, each a bin centre of a 100-bin histogram
#: (what the histogram median returns exactly): a steady drop of 0.05, a drop with one step up, a flat head.
MEDIANS = [
    [0.905, 0.855, 0.805, 0.755, 0.705],
    [0.905, 0.805, 0.825, 0.705, 0.605],
    [0.505, 0.505, 0.505, 0.505, 0.505],
]


def logit_summary(values: list[float]) -> StatisticsSummary:
    metric = AttentionStatistics()
    metric.update(LAYER, max_logit=torch.tensor(values, dtype=torch.float64)[None, :, None])
    return metric.compute()


def entropy_summary(medians: list[float]) -> EntropySummary:
    """Every query of head h at normalised entropy ``medians[h]`` (8 visible keys)."""
    metric = AttentionEntropy(num_bins=100)
    values = torch.tensor(medians, dtype=torch.float64)[None, :, None].expand(1, len(medians), 4) * math.log(8.0)
    metric.update(LAYER, values, torch.tensor(8))
    return metric.compute()


def reference_slope(values: list[float]) -> float:
    return statistics.linear_regression(range(len(values)), values).slope


def reference_sustained(values: list[float], rate: float) -> bool:
    """The definition, written out: slope beyond the rate and every step in the rate's direction."""
    if any(math.isnan(v) for v in values):
        return False
    direction = 1 if rate > 0 else -1
    steps = all((b - a) * direction >= 0 for a, b in itertools.pairwise(values))
    return reference_slope(values) * direction >= abs(rate) and steps


def run_history(alert: TrendAlert, validations: int) -> tuple[list[dict[str, float]], list[str]]:
    logged, messages = [], []
    for index in range(validations):
        entropy = entropy_summary([head[index] for head in MEDIANS])
        logits = logit_summary([head[index] for head in LOGITS])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logged.append(alert.check(entropy, logits))
        messages += [str(w.message) for w in caught]
    return logged, messages


@pytest.mark.parametrize("size", [3, 4])
def test_synthetic_histories_flag_exactly_the_sustained_trends(size: int) -> None:
    """Windows of 3 and 4 over five validations: each window's slopes equal Python's least squares, and
    exactly the heads sustained by the definition are counted; each warns once, naming layer, head, slope
    and window (checked in full for window 3).

    Fails when the slope is not least squares over the window (end minus start: window 4), when the
    no-step-back rule is dropped (head 1 then flags early: its slope is the largest), when the logarithm is
    left out (head 2's raw slope is above the rate), when the window holds more than the last ``size``
    validations, or when a head warns again each validation (checked by breaking each).
    """
    alert = TrendAlert(window=size, logit_growth=0.1, entropy_drop=0.03)
    logged, messages = run_history(alert, 5)
    assert logged[: size - 1] == [{}] * (size - 1)  # the window is not full yet
    for index in range(size - 1, 5):
        window = slice(index - size + 1, index + 1)
        logs = [[math.log(v) if v > 0 else math.nan for v in head[window]] for head in LOGITS]
        medians = [head[window] for head in MEDIANS]
        rising = [reference_sustained(values, 0.1) for values in logs]
        falling = [reference_sustained(values, -0.03) for values in medians]
        names = logged[index]
        assert names[f"attn_trend/{LAYER}/rising_logit_heads"] == sum(rising)
        assert names[f"attn_trend/{LAYER}/falling_entropy_heads"] == sum(falling)
        slopes = [reference_slope(values) for values in logs[:3]]  # head 3 never positive: no slope
        assert names[f"attn_trend/{LAYER}/log_max_logit_slope"] == pytest.approx(max(slopes), rel=1e-9)
        entropy_slopes = [reference_slope(values) for values in medians]
        assert names[f"attn_trend/{LAYER}/median_entropy_slope"] == pytest.approx(min(entropy_slopes), abs=1e-9)
        late = size == 3 and index == 4
        assert rising[:3] == [True, late, False] and falling == [True, late, False], (index, rising, falling)
    assert alert.flagged  # the last validation still flags
    if size == 4:
        assert len(messages) == 2, messages  # head 0, once per quantity
        return
    # Head 0 warns at validation 3 for each quantity, head 1 (its step back gone) at validation 5; no repeats.
    assert len(messages) == 4, messages
    entropy, logit, late_entropy, late_logit = messages
    assert f"ln(max logit) in {LAYER!r}, heads [0]" in logit and "monitored validations 1-3 (the last 3" in logit
    assert f"slope [{round(math.log(1.2), 4)}]" in logit
    assert f"median normalised entropy in {LAYER!r}, heads [0]" in entropy and "slope [-0.05]" in entropy
    for late_message, values in ((late_entropy, MEDIANS[1][2:]), (late_logit, [math.log(v) for v in LOGITS[1][2:]])):
        assert "heads [1]" in late_message and "validations 3-5" in late_message
        assert f"[{round(reference_slope(values), 4)}]" in late_message


def test_a_new_layout_restarts_the_window_and_state_round_trips() -> None:
    """A layer that appears restarts the window (no trend across layouts); a checkpointed window resumes."""
    alert = TrendAlert(window=3, logit_growth=0.1)
    run_history(alert, 2)
    resumed = TrendAlert(window=3, logit_growth=0.1)
    resumed.load_state_dict(alert.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = resumed.check(entropy_summary([0.5]), logit_summary([head[2] for head in LOGITS]))
    assert names[f"attn_trend/{LAYER}/rising_logit_heads"] == 1 and len(caught) == 1
    other = AttentionStatistics()
    other.update("blocks.1.attn", max_logit=torch.ones(1, 4, 1))
    other.update(LAYER, max_logit=torch.tensor([head[2] for head in LOGITS])[None, :, None])
    assert alert.check(entropy_summary([0.5]), other.compute()) == {}  # two layers now: a new window


def test_monitor_checks_trend_alert_options() -> None:
    with pytest.raises(ValueError, match="needs `Statistics\\(max_logit=True\\)`"):
        AttentionEntropyMonitor(alerts=[TrendAlert(logit_growth=0.1)])
    AttentionEntropyMonitor(alerts=[TrendAlert(entropy_drop=0.01)])  # the entropy trend needs no max logit
    for bad in ({"window": 2, "entropy_drop": 0.1}, {"logit_growth": 0.0}, {"entropy_drop": math.inf}):
        with pytest.raises(ValueError, match="of TrendAlert"):
            TrendAlert(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nothing to check"):
        AttentionEntropyMonitor(alerts=[TrendAlert()])


@pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")
def test_a_fit_whose_learning_rate_drives_logits_up_warns_before_the_level(tmp_path: Path) -> None:
    """TinyGPT trained at lr 0.03: its max logits grow; the trend warns for the heads whose float64 reference
    max logits (re-derived per validation from the weights) are sustained, while a MaxLogitAlert at 100 stays
    silent. The logged per-layer slopes are Python's least squares of ln of the reference.

    Fails when the trend is computed from other validations than the last ``window`` (e.g. the whole history),
    or from the max logit instead of its logarithm (checked by breaking each).
    """
    window, rate = 3, 0.05
    monitor = AttentionEntropyMonitor(
        batches=1,
        statistics=Statistics(max_logit=True),
        log=LogOptions(histogram_bins=None, heatmap=False),
        alerts=[TrendAlert(window=window, logit_growth=rate), MaxLogitAlert(100.0)],
    )
    logger, recorder = lm.MemoryLogger(), lm.BatchRecorder()
    trainer = make_trainer(
        tmp_path, loggers=[logger], callbacks=[monitor, recorder], max_epochs=4, limit_train_batches=4
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lm.TinyGPT(lr=0.03), lm.loader(lm.make_batches(4, seed=1)), lm.loader(lm.make_batches(1, seed=2)))
    peaks = [
        {layer: pooled.head_max() for layer, pooled in tiny_gpt_reference(v["state"], v["batches"][:1]).items()}
        for v in recorder.validations
    ]
    assert max(max(p) for validation in peaks for p in validation.values()) < 100.0  # the level is never crossed
    steps = [
        step
        for step, metrics in logger.merged_records()
        if f"attn_trend/{lm.GPT_LAYERS[0]}/rising_logit_heads" in metrics
    ]
    records = dict(logger.merged_records())
    expected_warnings: set[tuple[str, int]] = set()
    for end in range(window - 1, len(peaks)):
        for layer in lm.GPT_LAYERS:
            logs = [[math.log(peaks[i][layer][h]) for i in range(end - window + 1, end + 1)] for h in range(lm.HEADS)]
            flagged = [h for h in range(lm.HEADS) if reference_sustained(logs[h], rate)]
            metrics = records[steps[end - window + 1]]
            assert metrics[f"attn_trend/{layer}/rising_logit_heads"] == len(flagged), (end, layer)
            slope = max(reference_slope(values) for values in logs)
            assert metrics[f"attn_trend/{layer}/log_max_logit_slope"] == pytest.approx(slope, rel=1e-4, abs=1e-5)
            expected_warnings |= {(layer, h) for h in flagged}
    messages = [str(w.message) for w in caught if "sustained growth" in str(w.message)]
    assert not [w for w in caught if "large attention logits" in str(w.message)]
    assert expected_warnings, "the learning rate must drive some head's logits up for this test to mean anything"
    warned = {
        (re.search(r"in '([^']+)'", m)[1], int(h))  # type: ignore[index]
        for m in messages
        for h in re.search(r"heads \[([^\]]+)\]", m)[1].split(", ")  # type: ignore[index]
    }
    assert warned == expected_warnings
    # Once per head: no head is named by two warnings.
    assert len(warned) == sum(len(re.search(r"heads \[([^\]]+)\]", m)[1].split(", ")) for m in messages)  # type: ignore[index]
