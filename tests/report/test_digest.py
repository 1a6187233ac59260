"""The validation digest names what a float64 reference over the raw per-query values says.

Summaries are built through the real :class:`~attn_monitor.metrics.entropy.AttentionEntropy`
from known per-query normalised entropies (entropy in nats = value x ln(keys),
under several key masks); the expected medians are ``numpy.median`` of the
counted values in float64, computed here. Broken variants these tests catch
(each tried, then restored): ``largest_drop`` taken with ``max`` instead of
``min``; ``moved`` ranked by signed instead of absolute change; the layer
line reading ``layer_mean`` instead of the pooled median; the baseline's
heads matched to the wrong layer (``summary.layers[::-1]``); alert findings
of 0 listed.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from attn_monitor.metrics.entropy import AttentionEntropy, EntropySummary
from attn_monitor.report.alerts import CollapseAlert
from attn_monitor.report.dashboards import Dashboards
from attn_monitor.report.digest import (
    COLUMNS,
    Baseline,
    digest_markdown,
    digest_rows,
    digest_table,
    validation_digest,
)
from attn_monitor.report.loggers import LogOptions, WandbSink
from tests.lightning.test_callback import read_tensorboard, read_wandb_history, wandb_settings

LAYERS = ["model.transformer.h.0.attn", "model.transformer.h.1.attn", "model.transformer.h.2.attn"]
HEADS, QUERIES, KEYS = 4, 16, 16
TOLERANCE = 2e-3  # two bins of the 1000-bin histogram the medians are read from


@dataclass
class Validation:
    summary: EntropySummary
    head_medians: np.ndarray  # (layers, heads) float64 reference
    layer_bounds: np.ndarray  # (layers, 2): the two middle order statistics of the pooled heads (an even count)


def keys_of(mask: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries,) valid keys and (queries,) is-sample of each query under ``mask``; 15 or 11 queries count."""
    if mask == "all keys":  # the last query is padding
        return torch.full((QUERIES,), KEYS), torch.arange(QUERIES) < QUERIES - 1
    if mask == "causal":  # query i sees i + 1 keys: query 0 has a single key and is not counted
        return torch.arange(1, QUERIES + 1), torch.ones(QUERIES, dtype=torch.bool)
    # right padding: the last 5 queries are padding, the rest see 11 real keys
    return torch.full((QUERIES,), 11), torch.arange(QUERIES) < QUERIES - 5


def validation(values: np.ndarray, mask: str) -> Validation:
    """Feed ``values`` (layers, heads, queries) of normalised entropy through the metric; the reference beside it."""
    num_valid, is_sample = keys_of(mask)
    metric = AttentionEntropy(num_bins=1000)
    for index, layer in enumerate(LAYERS):
        normalised = torch.tensor(values[index], dtype=torch.float64)[None]  # (1, heads, queries)
        nats = normalised * num_valid.to(torch.float64).clamp(min=2).log()
        metric.update(layer, nats, num_valid[None, None], is_sample[None, None])
    counted = (is_sample & (num_valid > 1)).numpy()
    kept = values[:, :, counted]  # an odd count per head: its median is one of its values
    assert kept.shape[2] % 2 == 1
    pooled = np.sort(kept.reshape(len(LAYERS), -1), axis=1)
    middle = pooled.shape[1] // 2
    return Validation(metric.compute(), np.median(kept, axis=2), pooled[:, middle - 1 : middle + 1])


def spread(values: np.ndarray, top: int | None = None) -> float:
    """Smallest gap between neighbouring sorted values (of the ``top`` first, from either end).

    A ranking is only meaningful where its gaps are well above the bin error.
    """
    ordered = np.sort(values.ravel())
    if top is None:
        return float(np.diff(ordered).min())
    return float(min(np.diff(ordered[: top + 1]).min(), np.diff(ordered[-top - 1 :]).min()))


def around(medians: np.ndarray, mask: str, rng: np.random.Generator) -> np.ndarray:
    """(layers, heads, QUERIES) values whose counted queries under ``mask`` have exactly ``medians``.

    Counted queries scatter symmetrically around the median, in random order;
    the others (padding, one key) hold random values the median must not see.
    """
    num_valid, is_sample = keys_of(mask)
    counted = (is_sample & (num_valid > 1)).numpy()
    half = int(counted.sum()) // 2
    offsets = rng.uniform(0.005, 0.06, size=(*medians.shape, half))
    scattered = np.concatenate([medians[..., None] - offsets, medians[..., None], medians[..., None] + offsets], -1)
    values = rng.uniform(0.0, 1.0, size=(*medians.shape, QUERIES))
    values[..., counted] = rng.permuted(scattered, axis=-1)
    return np.clip(values, 0.0, 1.0)  # monotone: the medians stay


@pytest.fixture(params=["all keys", "causal", "right padding"])
def run(request: pytest.FixtureRequest) -> tuple[Validation, Validation]:
    """A first validation and a later one whose heads moved by distinct amounts, some up, most down."""
    rng = np.random.default_rng(7)
    size = len(LAYERS) * HEADS
    now = rng.permutation(np.linspace(0.2, 0.8, size)).reshape(len(LAYERS), HEADS)
    shifts = rng.permutation(np.linspace(-0.18, 0.15, size)).reshape(len(LAYERS), HEADS)
    mask = request.param
    return validation(around(now - shifts, mask, rng), mask), validation(around(now, mask, rng), mask)


def test_named_heads_are_the_ones_the_float64_reference_names(run: tuple[Validation, Validation]) -> None:
    first, now = run
    change = now.head_medians - first.head_medians
    assert spread(change) > 5 * TOLERANCE and spread(now.head_medians, top=3) > 2 * TOLERANCE  # rankings are clear
    assert change.min() < -0.15 and change.max() > 0.1  # heads moved both ways

    digest = validation_digest(now.summary, 900, baseline=Baseline.of(first.summary, 400), heads=3)

    drop = np.unravel_index(change.argmin(), change.shape)
    assert digest.largest_drop is not None
    assert (digest.largest_drop.layer, digest.largest_drop.head) == (LAYERS[drop[0]], drop[1])
    assert abs(digest.largest_drop.median - now.head_medians[drop]) < TOLERANCE
    assert abs(digest.largest_drop.first - first.head_medians[drop]) < TOLERANCE  # type: ignore[operator]
    assert digest.headline == (
        f"layer {drop[0]} head {drop[1]} fell from {digest.largest_drop.first:.2f} to "
        f"{digest.largest_drop.median:.2f} since step 400"
    )

    def named(heads: tuple) -> list[tuple[str, int]]:
        return [(h.layer, h.head) for h in heads]

    def reference(order: np.ndarray) -> list[tuple[str, int]]:
        return [(LAYERS[i // HEADS], int(i % HEADS)) for i in order[:3]]

    assert named(digest.moved) == reference(np.argsort(-np.abs(change).ravel()))
    assert named(digest.lowest) == reference(np.argsort(now.head_medians.ravel()))
    assert named(digest.highest) == reference(np.argsort(-now.head_medians.ravel()))
    for index, layer in enumerate(digest.layers):
        assert layer.name == str(index) and layer.layer == LAYERS[index]
        low, high = now.layer_bounds[index]
        assert low - TOLERANCE <= layer.median <= high + TOLERANCE
        assert layer.first is not None and layer.change == layer.median - layer.first
        assert first.layer_bounds[index, 0] - TOLERANCE <= layer.first <= first.layer_bounds[index, 1] + TOLERANCE
        assert layer.lowest is not None and layer.highest is not None
        assert layer.lowest.head == int(now.head_medians[index].argmin())
        assert layer.highest.head == int(now.head_medians[index].argmax())


def test_alerts_are_listed_with_their_layer(run: tuple[Validation, Validation]) -> None:
    first, now = run
    alert = CollapseAlert(drop=0.3, warn=lambda *args, **kwargs: None)
    alert(first.summary)
    findings = alert(now.summary)
    assert any(value > 0 for value in findings.values()) and any(value == 0 for value in findings.values())
    findings["attn_entropy/stopped_training"] = 1.0  # a finding that names no layer

    digest = validation_digest(now.summary, 900, baseline=Baseline.of(first.summary, 400), alerts=findings)

    for layer in digest.layers:
        value = findings[f"attn_entropy/{layer.layer}/collapsed_heads"]
        assert layer.alerts == ((f"collapsed_heads: {value:g}",) if value > 0 else ())
    assert digest.alerts == ("attn_entropy/stopped_training: 1",)
    assert "Alerts: attn_entropy/stopped_training: 1" in digest_markdown(digest)


def test_without_a_baseline_the_digest_names_the_lowest_head() -> None:
    values = np.linspace(0.1, 0.9, len(LAYERS) * HEADS).reshape(len(LAYERS), HEADS, 1).repeat(QUERIES, axis=2)
    values[1, 2] = 0.05
    now = validation(values, "all keys")
    digest = validation_digest(now.summary, 3)
    assert digest.first_step is None and digest.moved == () and digest.largest_drop is None
    assert digest.headline == "lowest: layer 1 head 2 at 0.05"
    assert all(layer.change is None for layer in digest.layers)


def test_heads_without_counted_queries_are_left_out() -> None:
    """A layer with fewer heads than another, and a head whose queries are all padding, have no median."""
    metric = AttentionEntropy(num_bins=1000)
    metric.update("a.0.x", torch.full((1, 2, 3), 0.5 * math.log(8.0), dtype=torch.float64), torch.tensor(8))
    padding = torch.tensor([True, True, False])[None, :, None].expand(1, 3, 3)  # head 2 of a.1.x: padding only
    metric.update("a.1.x", torch.full((1, 3, 3), 0.2 * math.log(8.0), dtype=torch.float64), torch.tensor(8), padding)
    digest = validation_digest(metric.compute(), 1, heads=10)
    assert sorted((h.layer, h.head) for h in digest.lowest) == [("a.0.x", 0), ("a.0.x", 1), ("a.1.x", 0), ("a.1.x", 1)]
    assert [h.name for h in digest.lowest[:2]] == ["1", "1"]


def test_bad_heads_argument_is_named() -> None:
    now = validation(np.full((len(LAYERS), HEADS, QUERIES), 0.5), "all keys")
    with pytest.raises(ValueError, match="`heads` a positive int, got 0"):
        validation_digest(now.summary, 1, heads=0)


def test_markdown_and_rows_carry_the_same_numbers(run: tuple[Validation, Validation]) -> None:
    first, now = run
    digest = validation_digest(now.summary, 900, baseline=Baseline.of(first.summary, 400))
    text = digest_markdown(digest)
    assert text.startswith(f"**Step 900**: {digest.headline}")
    assert "model.transformer" not in text  # display names in the text, full names only in the table rows
    rows = digest_rows(digest)
    assert all(len(row) == len(COLUMNS) for row in rows)
    layer_rows = [row for row in rows if row[1] == "layer"]
    assert [row[3] for row in layer_rows] == LAYERS
    for row, layer in zip(layer_rows, digest.layers, strict=True):
        assert f"| {layer.name} | {layer.median:.2f} | {layer.change:+.2f} |" in text
        assert row[5] == pytest.approx(layer.median) and row[7] == pytest.approx(layer.change)
    moved = [row for row in rows if row[1] == "moved"]
    assert [(row[3], row[4]) for row in moved] == [(h.layer, h.head) for h in digest.moved]


# --------------------------------------------------------------------------- written and read back


def test_tensorboard_text_reads_back(tmp_path: Path, run: tuple[Validation, Validation]) -> None:
    """Dashboards writes each validation's digest, changes measured from the first one it remembered."""
    from torch.utils.tensorboard import SummaryWriter

    first, now = run
    digests = [
        validation_digest(first.summary, 400, baseline=Baseline.of(first.summary, 400)),
        validation_digest(now.summary, 900, baseline=Baseline.of(first.summary, 400)),
    ]
    writer = SummaryWriter(str(tmp_path))
    dashboards = Dashboards(LogOptions(histogram_bins=None, heatmap=False))
    dashboards.log([writer], first.summary, 400)
    dashboards.log([writer], now.summary, 900)
    writer.close()
    accumulator = read_tensorboard(str(tmp_path))
    events = accumulator.Tensors("attn_entropy/digest/text_summary")
    assert [event.step for event in events] == [400, 900]
    for event, digest in zip(events, digests, strict=True):
        assert event.tensor_proto.string_val[0].decode() == digest_markdown(digest)


def test_wandb_table_reads_back(tmp_path: Path, run: tuple[Validation, Validation], monkeypatch) -> None:
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    first, now = run
    digest = validation_digest(now.summary, 900, baseline=Baseline.of(first.summary, 400))
    assert digest_table(digest).columns == list(COLUMNS)
    dashboards = Dashboards(LogOptions(histogram_bins=None, heatmap=False))
    with wandb.init(project="digest", dir=str(tmp_path), mode="offline", settings=wandb_settings()) as experiment:
        dashboards.log([WandbSink(experiment)], first.summary, 400)
        dashboards.log([WandbSink(experiment)], now.summary, 900)
        experiment.log({"end": 0.0}, step=1000)  # step 900's row is complete once a later step starts
    (run_file,) = glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*", "run-*.wandb"))
    rows = read_wandb_history(run_file)
    found = [row for row in rows if row.get("_step") == 900 and "attn_entropy/digest" in row]
    assert len(found) == 1, [(row.get("_step"), sorted(row)[:4]) for row in rows]
    (row,) = found
    assert row["_step"] == 900
    table = json.loads((Path(run_file).parent / "files" / row["attn_entropy/digest"]["path"]).read_text())
    assert table["columns"] == list(COLUMNS)
    assert table["data"] == json.loads(json.dumps(digest_rows(digest)))
