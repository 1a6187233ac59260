"""AttentionEntropy and EntropySummary against an independent float64 numpy reference.

The reference (``_reference`` below) walks every (sequence, head, query) with
plain loops and numpy float64 and shares no code with attn_monitor: it applies
the counting rules of docs/design.md §2-§3 directly. Streaming updates must agree
with it on the concatenated data; quantiles must lie within one bin width of
the exact empirical quantile (``inverted_cdf``: the smallest value whose
empirical CDF reaches ``q``, the quantity a cumulative histogram bounds).
"""

from __future__ import annotations

import copy
import math
import pickle
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_monitor import AttentionEntropy, AttentionMass, EntropySummary, histogram_quantile
from attn_monitor.metrics.base import LayerMetric

QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
STATE_KINDS = (
    "hist",
    "hist_nats",
    "count",
    "sum",
    "sum_sq",
    "sum_nats",
    "seq_sum",
    "seq_count",
    "single_key",
    "no_key",
    "nonfinite",
)
EXACT_KINDS = ("hist", "hist_nats", "count", "seq_count", "single_key", "no_key", "nonfinite")


# --------------------------------------------------------------------------- data


@dataclass
class Batch:
    """One update's arguments: entropy (B, H, Q) float32 in nats, broadcastable num_valid / is_sample."""

    entropy: torch.Tensor
    num_valid: torch.Tensor
    is_sample: torch.Tensor | None


def make_batch(
    rng: np.random.Generator,
    heads: int,
    *,
    batch: int | None = None,
    queries: int | None = None,
    max_valid: int = 12,
    valid_shape: str | None = None,
    sample_shape: str | None = None,
    include_single_key: bool = False,
    nonfinite: float = 0.05,
) -> Batch:
    """Random entropies in [0, ln n] with mixed num_valid (0, 1, 2..max_valid) and sample masks.

    Queries that must not count (padding, no key, one key unless included) hold NaN or
    garbage, which the metric must ignore. A fraction ``nonfinite`` of the counted
    queries hold NaN or +-inf (a diverged model), which it must skip and count.
    """
    batch = int(rng.integers(1, 5)) if batch is None else batch
    queries = int(rng.integers(1, 9)) if queries is None else queries
    valid_shape = valid_shape or str(rng.choice(["b1q", "bhq", "q", "scalar"]))
    sample_shape = sample_shape or str(rng.choice(["none", "b1q", "bhq"]))
    full = (batch, heads, queries)

    valid_dims = {"b1q": (batch, 1, queries), "bhq": full, "q": (queries,), "scalar": ()}[valid_shape]
    # Half the queries get 0 or 1 keys often enough to exercise the excluded counters.
    num_valid = rng.choice([0, 1, *range(2, max_valid + 1)], size=valid_dims)
    num_valid = np.where(rng.random(valid_dims) < 0.25, rng.integers(0, 2, size=valid_dims), num_valid)
    if valid_shape == "scalar":
        num_valid = np.asarray(rng.integers(2, max_valid + 1))

    if sample_shape == "none":
        is_sample = None
        real = np.ones(full, dtype=bool)
    else:
        dims = {"b1q": (batch, 1, queries), "bhq": full}[sample_shape]
        is_sample = rng.random(dims) < 0.8
        real = np.broadcast_to(is_sample, full)

    n = np.broadcast_to(num_valid, full)
    fraction = rng.random(full)
    # Exact extremes: one-hot (0) and uniform (1).
    fraction = np.where(rng.random(full) < 0.1, np.round(fraction), fraction)
    entropy = fraction * np.log(np.maximum(n, 1))
    counted = real & ((n > 1) | (include_single_key & (n == 1)))
    entropy = np.where(counted, entropy, np.where(rng.random(full) < 0.5, np.nan, 123.0))
    diverged = counted & (rng.random(full) < nonfinite)
    entropy = np.where(diverged, rng.choice([np.nan, np.inf, -np.inf], size=full), entropy)
    return Batch(
        torch.from_numpy(entropy.astype(np.float32)),
        torch.from_numpy(np.asarray(num_valid, dtype=np.int64)),
        None if is_sample is None else torch.from_numpy(is_sample),
    )


def make_batches(seed: int, heads: int, count: int, **kwargs: object) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [make_batch(rng, heads, **kwargs) for _ in range(count)]  # type: ignore[arg-type]


def feed(metric: AttentionEntropy, layer: str, batches: list[Batch]) -> None:
    for item in batches:
        metric.update(layer, item.entropy, item.num_valid, item.is_sample)


def concat(batches: list[Batch]) -> Batch:
    """Batches of one query length joined along the batch dim, masks expanded to full shape."""
    entropy = torch.cat([item.entropy for item in batches])
    num_valid = torch.cat([item.num_valid.expand(item.entropy.shape) for item in batches])
    is_sample = torch.cat(
        [
            torch.ones(item.entropy.shape, dtype=torch.bool)
            if item.is_sample is None
            else item.is_sample.expand(item.entropy.shape)
            for item in batches
        ]
    )
    return Batch(entropy, num_valid, is_sample)


# --------------------------------------------------------------------------- reference


@dataclass
class Reference:
    """Per-head lists of what a correct metric has seen, in float64."""

    heads: int
    values: list[list[float]] = field(default_factory=list)  # normalised entropy of counted queries
    nats: list[list[float]] = field(default_factory=list)  # entropy in nats of counted queries
    seq_means: list[list[float]] = field(default_factory=list)  # per (sequence, head) mean, if any counted
    single_key: list[int] = field(default_factory=list)
    no_key: list[int] = field(default_factory=list)
    nonfinite: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.values = [[] for _ in range(self.heads)]
        self.nats = [[] for _ in range(self.heads)]
        self.seq_means = [[] for _ in range(self.heads)]
        self.single_key = [0] * self.heads
        self.no_key = [0] * self.heads
        self.nonfinite = [0] * self.heads

    def pooled(self, name: str) -> list[float]:
        return [value for head in getattr(self, name) for value in head]


def _reference(batches: list[Batch], heads: int, include_single_key: bool = False) -> Reference:
    ref = Reference(heads)
    for item in batches:
        entropy = item.entropy.numpy().astype(np.float64)
        full = entropy.shape
        num_valid = np.broadcast_to(item.num_valid.numpy(), full)
        real = np.ones(full, bool) if item.is_sample is None else np.broadcast_to(item.is_sample.numpy(), full)
        for b in range(full[0]):
            for h in range(full[1]):
                row: list[float] = []
                for i in range(full[2]):
                    n, value = int(num_valid[b, h, i]), float(entropy[b, h, i])
                    if not real[b, h, i]:
                        continue
                    if n == 0:
                        ref.no_key[h] += 1
                        continue
                    if n == 1:
                        ref.single_key[h] += 1
                    if n == 1 and not include_single_key:
                        continue
                    if not math.isfinite(value):
                        ref.nonfinite[h] += 1
                        continue
                    if n == 1:
                        row.append(0.0)
                        ref.nats[h].append(max(value, 0.0))
                        continue
                    row.append(min(max(value / math.log(n), 0.0), 1.0))
                    ref.nats[h].append(max(value, 0.0))
                ref.values[h].extend(row)
                if row:
                    ref.seq_means[h].append(float(np.mean(row)))
    return ref


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def _std(values: list[float]) -> float:
    return float(np.std(values)) if values else math.nan


def _quantile(values: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(values), q, method="inverted_cdf")) if values else math.nan


def _bins(values: list[float], bins: int, high: float) -> np.ndarray:
    index = np.clip(np.floor(np.asarray(values, dtype=np.float64) / high * bins), 0, bins - 1).astype(np.int64)
    return np.bincount(index, minlength=bins).astype(np.float64)


def _close(got: object, expected: object, atol: float = 1e-9) -> None:
    np.testing.assert_allclose(
        np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64), rtol=1e-9, atol=atol
    )


def assert_layer_matches(summary: EntropySummary, layer: str, ref: Reference, num_bins: int) -> None:
    """Every statistic of ``layer`` in ``summary`` against the reference."""
    index = summary.layer_index(layer)
    heads = ref.heads
    assert summary.num_heads[index] == heads
    counts = [len(values) for values in ref.values]
    np.testing.assert_array_equal(summary.count[index, :heads].numpy(), counts)
    np.testing.assert_array_equal(summary.single_key[index, :heads].numpy(), ref.single_key)
    np.testing.assert_array_equal(summary.no_key[index, :heads].numpy(), ref.no_key)
    np.testing.assert_array_equal(summary.nonfinite[index, :heads].numpy(), ref.nonfinite)
    np.testing.assert_array_equal(summary.histogram[index, :heads].sum(-1).numpy(), counts)
    np.testing.assert_array_equal(summary.nats_histogram[index, :heads].sum(-1).numpy(), counts)
    for head in range(heads):
        np.testing.assert_array_equal(summary.histogram[index, head].numpy(), _bins(ref.values[head], num_bins, 1.0))

    _close(summary.mean[index, :heads], [_mean(v) for v in ref.values])
    _close(summary.mean_seq[index, :heads], [_mean(v) for v in ref.seq_means])
    _close(summary.std[index, :heads], [_std(v) for v in ref.values], atol=1e-6)
    _close(summary.nats_mean[index, :heads], [_mean(v) for v in ref.nats], atol=1e-6)

    # Heads pooled: token-weighted over every counted query, sequence-weighted over (sequence, head) pairs.
    _close(summary.layer_mean[index], _mean(ref.pooled("values")))
    _close(summary.layer_mean_seq[index], _mean(ref.pooled("seq_means")))
    _close(summary.layer_std[index], _std(ref.pooled("values")), atol=1e-6)
    _close(summary.layer_nats_mean[index], _mean(ref.pooled("nats")), atol=1e-6)

    width = 1.0 / num_bins + 1e-9
    for q in QUANTILES:
        head_quantile = summary.quantile(q)[index, :heads].numpy()
        for head in range(heads):
            expected = _quantile(ref.values[head], q)
            if math.isnan(expected):
                assert math.isnan(head_quantile[head])
            else:
                assert abs(head_quantile[head] - expected) <= width, (q, head, head_quantile[head], expected)
        pooled = _quantile(ref.pooled("values"), q)
        got = float(summary.layer_quantile(q)[index])
        assert (math.isnan(got) and math.isnan(pooled)) or abs(got - pooled) <= width, (q, got, pooled)


def _states(metric: AttentionEntropy) -> dict[str, torch.Tensor]:
    states = metric.statistics()
    assert tuple(states) == STATE_KINDS
    return states


def assert_same_states(left: AttentionEntropy, right: AttentionEntropy) -> None:
    """Same layers; counts and histograms bit-identical; float sums equal up to summation order."""
    assert left.layers == right.layers
    a, b = _states(left), _states(right)
    for name in a:
        if name in EXACT_KINDS:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-12, atol=1e-12, msg=name)


# --------------------------------------------------------------------------- streaming vs reference


@pytest.mark.parametrize("include_single_key", [False, True], ids=["exclude_single", "include_single"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_matches_reference(seed: int, include_single_key: bool) -> None:
    heads = 3
    batches = make_batches(seed, heads, 6, include_single_key=include_single_key)
    metric = AttentionEntropy(num_bins=50, max_keys=16, include_single_key=include_single_key)
    feed(metric, "enc.0", batches)
    summary = metric.compute()
    ref = _reference(batches, heads, include_single_key)
    assert sum(ref.single_key) > 0 and sum(ref.no_key) > 0 and sum(ref.nonfinite) > 0  # every counter is used
    assert_layer_matches(summary, "enc.0", ref, num_bins=50)
    _close(summary.overall_mean, _mean(ref.pooled("values")))


@pytest.mark.parametrize(
    ("valid_shape", "sample_shape"),
    [("b1q", "b1q"), ("bhq", "bhq"), ("b1q", "bhq"), ("bhq", "none"), ("q", "b1q"), ("scalar", "bhq")],
    ids=[
        "valid_b1q-sample_b1q",
        "valid_bhq-sample_bhq",
        "valid_b1q-sample_bhq",
        "valid_bhq-no_sample",
        "valid_q-sample_b1q",
        "valid_scalar-sample_bhq",
    ],
)
def test_broadcast_shapes_match_reference(valid_shape: str, sample_shape: str) -> None:
    heads = 4
    batches = make_batches(7, heads, 4, valid_shape=valid_shape, sample_shape=sample_shape)
    metric = AttentionEntropy(num_bins=20, max_keys=16)
    feed(metric, "layer", batches)
    assert_layer_matches(metric.compute(), "layer", _reference(batches, heads), num_bins=20)


@pytest.mark.parametrize("num_bins", [1, 7, 100, 1000])
def test_quantiles_within_one_bin(num_bins: int) -> None:
    heads = 2
    batches = make_batches(11, heads, 8, batch=4, queries=16, max_valid=64)
    metric = AttentionEntropy(num_bins=num_bins, nats_bins=num_bins, max_keys=64)
    feed(metric, "layer", batches)
    summary = metric.compute()
    ref = _reference(batches, heads)
    assert_layer_matches(summary, "layer", ref, num_bins=num_bins)
    # Raw entropy histogram over [0, ln(max_keys)]: same bound with its own bin width.
    nats_width = math.log(64) / num_bins + 1e-9
    for q in QUANTILES:
        got = histogram_quantile(summary.nats_histogram[0], q, high=summary.max_nats).numpy()
        for head in range(heads):
            assert abs(got[head] - _quantile(ref.nats[head], q)) <= nats_width
    np.testing.assert_array_equal(summary.nats_histogram[0, 0].numpy(), _bins(ref.nats[0], num_bins, math.log(64)))


def test_uniform_and_one_hot_extremes() -> None:
    metric = AttentionEntropy(num_bins=10)
    n = torch.tensor([[[2, 5, 100]]])
    metric.update("uniform", torch.log(n.double()).float().expand(2, 2, 3), n)
    metric.update("one_hot", torch.zeros(2, 2, 3), n)
    summary = metric.compute()
    _close(summary.mean, [[1.0, 1.0], [0.0, 0.0]])
    _close(summary.std, [[0.0, 0.0], [0.0, 0.0]], atol=1e-6)
    _close(summary.quantile(0.5), [[1.0, 1.0], [0.0, 0.0]], atol=0.1)
    np.testing.assert_array_equal(summary.histogram[0, :, -1].numpy(), [6, 6])  # 1.0 lands in the last bin
    np.testing.assert_array_equal(summary.histogram[1, :, 0].numpy(), [6, 6])
    _close(summary.nats_mean[0], [np.mean(np.log([2, 5, 100]))] * 2, atol=1e-6)


def test_sequence_weighted_differs_from_token_weighted() -> None:
    """One long low-entropy sequence and one short high-entropy one: the two means answer different questions."""
    metric = AttentionEntropy()
    entropy = torch.zeros(2, 1, 4)
    entropy[1, 0, 0] = math.log(4)
    is_sample = torch.tensor([[[True, True, True, True]], [[True, False, False, False]]])
    metric.update("layer", entropy, torch.tensor(4), is_sample)
    summary = metric.compute()
    _close(summary.mean, [[1 / 5]])  # (0 + 0 + 0 + 0 + 1) / 5 queries
    _close(summary.mean_seq, [[1 / 2]])  # (0 + 1) / 2 sequences


def test_pooled_sequence_mean_weights_sequence_head_pairs() -> None:
    """Head 1 sees fewer counted sequences than head 0; pooling weights every (sequence, head) pair once."""
    metric = AttentionEntropy()
    entropy = torch.tensor([[[math.log(2)], [0.0]], [[0.0], [0.0]], [[0.0], [math.log(2)]]])  # (3, 2, 1)
    is_sample = torch.tensor([[[True], [True]], [[True], [False]], [[True], [False]]])
    metric.update("layer", entropy, torch.tensor(2), is_sample)
    summary = metric.compute()
    _close(summary.mean_seq, [[1 / 3, 0.0]])
    _close(summary.layer_mean_seq, [1 / 4])
    np.testing.assert_array_equal(summary.count.numpy(), [[3, 1]])


def test_ignored_queries_never_produce_nan() -> None:
    """NaN or garbage on padding, no-key and one-key queries is ignored; a fully ignored batch adds nothing."""
    metric = AttentionEntropy()
    entropy = torch.full((2, 2, 3), math.nan)
    num_valid = torch.tensor([[[0, 1, 5]]]).expand(2, 2, 3)
    is_sample = torch.tensor([[[True, True, False]]])
    metric.update("layer", entropy, num_valid, is_sample)
    summary = metric.compute()
    np.testing.assert_array_equal(summary.count.numpy(), [[0, 0]])
    np.testing.assert_array_equal(summary.no_key.numpy(), [[2, 2]])
    np.testing.assert_array_equal(summary.single_key.numpy(), [[2, 2]])
    assert torch.isnan(summary.mean).all() and torch.isnan(summary.quantile(0.5)).all()
    assert math.isnan(summary.overall_mean)
    assert summary.to_dict() == {}


@pytest.mark.parametrize("include_single_key", [False, True], ids=["single_key_excluded", "single_key_included"])
def test_ignored_queries_leave_the_state_bit_for_bit_untouched(include_single_key: bool) -> None:
    """Whatever ignored queries hold (NaN, inf, values no bin could take) the state is that of zeros there."""
    entropy = torch.tensor([[[0.5, 0.0, 0.3, 0.1, 1.0, 0.2], [1.2, 0.0, 0.0, 0.7, 0.4, 0.0]]], dtype=torch.float64)
    num_valid = torch.tensor([4, 1, 0, 5, 3, 8])
    is_sample = torch.tensor([True, True, True, True, True, False])
    ignored = torch.tensor([[[False, not include_single_key, True, False, False, True]]]).expand(1, 2, 6)
    states = []
    for garbage in (0.0, math.nan, math.inf, -math.inf, 1e300, -1e300):
        metric = AttentionEntropy(num_bins=10, nats_bins=10, max_keys=8, include_single_key=include_single_key)
        metric.update("layer", entropy.masked_fill(ignored, garbage), num_valid, is_sample)
        states.append(metric.sums)
    assert all(torch.equal(state, states[0]) for state in states)
    summary = metric.compute()
    assert summary.count.tolist() == [[3 + include_single_key] * 2]
    assert summary.histogram.sum().item() == summary.count.sum().item()


def test_mass_of_non_samples_leaves_the_state_bit_for_bit_untouched() -> None:
    mass = torch.tensor([[[0.5, 0.0, 1.0, 0.25]]], dtype=torch.float64)
    is_sample = torch.tensor([True, False, True, False])
    states = []
    for garbage in (0.0, math.nan, math.inf, -1e300, 7.0):
        metric = AttentionMass(num_bins=8)
        metric.update("sink_mass/x", mass.masked_fill(~is_sample, garbage), is_sample)
        states.append(metric.sums)
    assert all(torch.equal(state, states[0]) for state in states)
    assert metric.compute().histogram.tolist() == [[[0, 0, 0, 0, 1, 0, 0, 1]]]


def test_empty_batch_is_a_no_op() -> None:
    metric = AttentionEntropy()
    metric.update("layer", torch.zeros(0, 2, 5), torch.tensor(3))
    summary = metric.compute()
    assert summary.layers == ["layer"] and summary.num_heads == [2]
    assert summary.count.sum() == 0


def test_compute_without_layers_is_empty() -> None:
    with pytest.warns(UserWarning, match="before the ``update``"):
        summary = AttentionEntropy().compute()
    assert summary.layers == [] and summary.max_heads == 0
    assert summary.histogram.shape == (0, 0, 1000)
    assert math.isnan(summary.overall_mean)
    assert summary.to_dict() == {}


# --------------------------------------------------------------------------- batch splits


@pytest.mark.parametrize("splits", [[1] * 12, [5, 7], [3, 1, 8], [12]], ids=["ones", "5+7", "3+1+8", "whole"])
def test_batch_split_invariance(splits: list[int]) -> None:
    heads = 3
    whole = concat(make_batches(21, heads, 4, batch=3, queries=6))
    one = AttentionEntropy(num_bins=64, max_keys=16)
    one.update("layer", whole.entropy, whole.num_valid, whole.is_sample)
    many = AttentionEntropy(num_bins=64, max_keys=16)
    start = 0
    for size in splits:
        part = slice(start, start + size)
        many.update("layer", whole.entropy[part], whole.num_valid[part], whole.is_sample[part])
        start += size
    assert start == whole.entropy.shape[0]
    assert_same_states(one, many)
    assert_layer_matches(many.compute(), "layer", _reference([whole], heads), num_bins=64)


# --------------------------------------------------------------------------- layers


LAYERS = {"enc.0": 4, "enc.1": 2, "dec.attn": 3}


def _layer_data(include_single_key: bool = False) -> dict[str, list[Batch]]:
    return {
        name: make_batches(31 + i, heads, 3, include_single_key=include_single_key)
        for i, (name, heads) in enumerate(LAYERS.items())
    }


def test_layers_with_different_head_counts() -> None:
    data = _layer_data()
    metric = AttentionEntropy(num_bins=40, max_keys=16)
    for name, batches in data.items():
        feed(metric, name, batches)
    summary = metric.compute()
    assert summary.layers == list(LAYERS) and metric.layers == list(LAYERS)
    assert summary.num_heads == list(LAYERS.values()) and summary.max_heads == 4
    assert [metric.num_heads(name) for name in LAYERS] == list(LAYERS.values())
    assert summary.mean.shape == (3, 4) and summary.histogram.shape == (3, 4, 40)
    for name, batches in data.items():
        assert_layer_matches(summary, name, _reference(batches, LAYERS[name]), num_bins=40)
    # Missing head slots: zero counts, NaN statistics.
    for index, heads in enumerate(LAYERS.values()):
        missing = slice(heads, None)
        assert summary.count[index, missing].eq(0).all()
        assert summary.histogram[index, missing].eq(0).all()
        for stat in (summary.mean, summary.mean_seq, summary.std, summary.nats_mean, summary.quantile(0.5)):
            assert torch.isnan(stat[index, missing]).all()
    expected_overall = _mean([v for name, b in data.items() for v in _reference(b, LAYERS[name]).pooled("values")])
    _close(summary.overall_mean, expected_overall)


def test_declared_layers_equal_registered_on_update() -> None:
    data = _layer_data()
    declared = AttentionEntropy(LAYERS, num_bins=40, max_keys=16)
    assert declared.layers == list(LAYERS)
    registered = AttentionEntropy(num_bins=40, max_keys=16)
    for name, batches in data.items():
        feed(registered, name, batches)
    for name, batches in reversed(list(data.items())):  # update order does not change the declared order
        feed(declared, name, batches)
    assert declared.compute().layers == list(LAYERS)
    assert_same_states(declared, registered)


def test_declared_layer_without_updates() -> None:
    metric = AttentionEntropy({"seen": 2, "unseen": 3})
    feed(metric, "seen", make_batches(3, 2, 2))
    summary = metric.compute()
    assert summary.layers == ["seen", "unseen"]
    index = summary.layer_index("unseen")
    assert summary.count[index].eq(0).all()
    assert torch.isnan(summary.layer_mean[index]) and torch.isnan(summary.layer_quantile(0.5)[index])
    assert not any("/unseen/" in key for key in summary.to_dict())


def test_layer_index_unknown_layer() -> None:
    metric = AttentionEntropy({"a": 1})
    with pytest.warns(UserWarning):
        summary = metric.compute()
    assert summary.layer_index("a") == 0
    with pytest.raises(ValueError, match="'missing'"):
        summary.layer_index("missing")


def test_register_again_with_other_head_count() -> None:
    metric = AttentionEntropy({"a": 2})
    metric.register_layer("a", 2)  # same count: no-op
    assert metric.layers == ["a"]
    with pytest.raises(ValueError, match="'a' was registered with 2 heads, got 3"):
        metric.register_layer("a", 3)
    with pytest.raises(ValueError, match="'a' was registered with 2 heads, got 4"):
        metric.update("a", torch.zeros(1, 4, 2), torch.tensor(2))
    metric.update("b", torch.zeros(1, 1, 2), torch.tensor(2))
    with pytest.raises(ValueError, match="'b' was registered with 1 heads, got 2"):
        metric.update("b", torch.zeros(1, 2, 2), torch.tensor(2))
    assert metric.layers == ["a", "b"] and metric.num_heads("b") == 1


# --------------------------------------------------------------------------- reset, state_dict, pickling


def _filled_metric(**kwargs: object) -> tuple[AttentionEntropy, dict[str, list[Batch]]]:
    data = _layer_data(bool(kwargs.get("include_single_key", False)))
    metric = AttentionEntropy(**kwargs)  # type: ignore[arg-type]
    for name, batches in data.items():
        feed(metric, name, batches)
    return metric, data


def assert_same_summary(left: EntropySummary, right: EntropySummary) -> None:
    assert left.layers == right.layers and left.num_heads == right.num_heads
    for name in (
        "histogram",
        "nats_histogram",
        "count",
        "single_key",
        "no_key",
        "mean",
        "mean_seq",
        "std",
        "nats_mean",
    ):
        torch.testing.assert_close(getattr(left, name), getattr(right, name), rtol=0, atol=0, equal_nan=True, msg=name)
    torch.testing.assert_close(left.quantile(0.3), right.quantile(0.3), rtol=0, atol=0, equal_nan=True)
    assert left.to_dict() == right.to_dict()


def test_reset_zeroes_counts_and_keeps_layers() -> None:
    metric, data = _filled_metric(num_bins=40, max_keys=16)
    metric.reset()
    assert metric.layers == list(LAYERS)
    for name, value in _states(metric).items():
        assert value.eq(0).all(), name
    # The layers still have their head counts; refilling equals a fresh metric fed the same.
    fresh = AttentionEntropy(num_bins=40, max_keys=16)
    for name, batches in data.items():
        feed(metric, name, batches[:1])
        feed(fresh, name, batches[:1])
    assert_same_states(metric, fresh)
    with pytest.raises(ValueError, match="registered with 4 heads"):
        metric.update("enc.0", torch.zeros(1, 2, 2), torch.tensor(2))


@pytest.mark.filterwarnings("ignore:The ``compute`` method:UserWarning")  # torchmetrics: no update() since load
def test_state_dict_round_trip_into_fresh_metric() -> None:
    metric, _ = _filled_metric()
    state = metric.state_dict()
    assert set(state) == {"_extra_state"}  # layer list, configuration and the packed statistics together
    saved = copy.deepcopy(state)
    fresh = AttentionEntropy()
    fresh.load_state_dict(state)  # strict: every key must find its state
    assert fresh.layers == list(LAYERS) and [fresh.num_heads(n) for n in LAYERS] == list(LAYERS.values())
    assert_same_summary(fresh.compute(), metric.compute())
    # It keeps accumulating like the original, and leaves the loaded dict alone.
    extra = make_batches(99, 2, 2)
    feed(fresh, "enc.1", extra)
    feed(metric, "enc.1", extra)
    assert_same_states(fresh, metric)
    assert torch.equal(state["_extra_state"]["sums"], saved["_extra_state"]["sums"])


@pytest.mark.filterwarnings("ignore:The ``compute`` method:UserWarning")
def test_state_dict_round_trip_keeps_custom_bins() -> None:
    metric, _ = _filled_metric(num_bins=17, nats_bins=9, max_keys=16, include_single_key=True)
    fresh = AttentionEntropy(num_bins=17, nats_bins=9, max_keys=16, include_single_key=True)
    fresh.load_state_dict(metric.state_dict())
    assert_same_summary(fresh.compute(), metric.compute())


def test_pickle_round_trip() -> None:
    metric, _ = _filled_metric(num_bins=40, max_keys=16)
    restored = pickle.loads(pickle.dumps(metric))
    assert restored.layers == metric.layers
    assert_same_summary(restored.compute(), metric.compute())
    extra = make_batches(5, 4, 2)
    feed(restored, "enc.0", extra)
    feed(metric, "enc.0", extra)
    assert_same_summary(restored.compute(), metric.compute())
    summary = metric.compute()
    assert_same_summary(pickle.loads(pickle.dumps(summary)), summary)


def test_deepcopy_is_independent() -> None:
    metric, _ = _filled_metric(num_bins=40, max_keys=16)
    before = metric.compute()
    clone = copy.deepcopy(metric)
    assert_same_summary(clone.compute(), before)
    feed(clone, "enc.0", make_batches(6, 4, 2))
    clone.update("new", torch.zeros(1, 1, 3), torch.tensor(2))
    assert metric.layers == list(LAYERS)
    assert_same_summary(metric.compute(), before)
    assert clone.compute().count.sum() > before.count.sum()


def test_forward_on_declared_layer_returns_batch_and_accumulates() -> None:
    metric = AttentionEntropy({"layer": 2}, num_bins=20, max_keys=16)
    first, second = make_batches(8, 2, 2)
    feed(metric, "layer", [first])
    batch_summary = metric("layer", second.entropy, second.num_valid, second.is_sample)
    assert_layer_matches(batch_summary, "layer", _reference([second], 2), num_bins=20)
    assert_layer_matches(metric.compute(), "layer", _reference([first, second], 2), num_bins=20)


def test_forward_registers_new_layer_without_losing_state() -> None:
    """BUG (metric.py:353, layers registered inside update): forward() on a not-yet-registered layer.

    torchmetrics' forward snapshots the global state, resets, calls update (which adds
    the new layer's states) and then merges the snapshot back; the snapshot lacks the new
    layer, so it raises "Expected state variable layer1_hist to be present in incoming
    state" -- after the reset, so everything accumulated for earlier layers is lost.
    """
    first, second = make_batches(9, 2, 2)
    metric = AttentionEntropy(num_bins=20, max_keys=16)
    feed(metric, "a", [first])
    batch_summary = metric("b", second.entropy, second.num_valid, second.is_sample)
    assert_layer_matches(batch_summary, "b", _reference([second], 2), num_bins=20)
    summary = metric.compute()
    assert_layer_matches(summary, "a", _reference([first], 2), num_bins=20)
    assert_layer_matches(summary, "b", _reference([second], 2), num_bins=20)


@pytest.mark.filterwarnings("ignore:The ``compute`` method:UserWarning")
def test_load_state_dict_matches_layers_by_name() -> None:
    """Loading into a metric whose layers were declared in another order (same head counts,
    so a mix-up would go unnoticed) maps the rows by name; a layer only the target has starts
    empty, and loading replaces what the target had accumulated."""
    source = AttentionEntropy()
    source.update("a", torch.full((1, 2, 4), math.log(4)), torch.tensor(4))  # mean 1
    source.update("b", torch.zeros(1, 2, 4), torch.tensor(4))  # mean 0
    target = AttentionEntropy({"b": 2, "only_here": 3, "a": 2})
    feed(target, "only_here", make_batches(3, 3, 1))
    target.load_state_dict(source.state_dict())
    summary = target.compute()
    assert summary.layers == ["b", "only_here", "a"]
    _close(summary.layer_mean[summary.layer_index("a")], 1.0)
    _close(summary.layer_mean[summary.layer_index("b")], 0.0)
    assert summary.count.tolist() == [[4, 4, 0], [0, 0, 0], [4, 4, 0]]


def test_load_state_dict_with_other_head_count_names_the_layer() -> None:
    source = AttentionEntropy({"a": 2})
    with pytest.raises(ValueError, match="Layer 'a' has 3 heads in this metric and 2 in the saved state"):
        AttentionEntropy({"a": 3}).load_state_dict(source.state_dict())


@pytest.mark.parametrize(
    ("saved", "loading", "names"),
    [
        ({"num_bins": 17}, {}, ("num_bins=17", "num_bins=1000")),
        ({"nats_bins": 9}, {}, ("nats_bins=9", "nats_bins=1000")),
        ({"max_keys": 64}, {}, ("max_keys=64", "max_keys=8192")),
        ({}, {"include_single_key": True}, ("include_single_key=False", "include_single_key=True")),
    ],
    ids=["num_bins", "nats_bins", "max_keys", "include_single_key"],
)
def test_load_with_another_configuration_raises_naming_both(
    saved: dict[str, object], loading: dict[str, object], names: tuple[str, str]
) -> None:
    source, _ = _filled_metric(**saved)
    target = AttentionEntropy(**loading)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="saved state") as error:
        target.load_state_dict(source.state_dict())
    assert all(name in str(error.value) for name in names), str(error.value)
    assert target.layers == []  # nothing half-loaded
    mass = AttentionMass(num_bins=10)
    with pytest.raises(ValueError, match=r"num_bins=10.*num_bins=1000"):
        AttentionMass().load_state_dict(mass.state_dict())


def test_merge_state_matches_layers_by_name() -> None:
    data = _layer_data()
    left, right, union = (AttentionEntropy(num_bins=40, max_keys=16) for _ in range(3))
    for name in ("enc.0", "enc.1"):
        feed(left, name, data[name])
    for name in ("dec.attn", "enc.0"):  # another order, one layer in common
        feed(right, name, data[name][:1])
    for metric, name, batches in ((union, "enc.0", data["enc.0"] + data["enc.0"][:1]), (union, "enc.1", None)):
        feed(metric, name, batches if batches is not None else data[name])
    feed(union, "dec.attn", data["dec.attn"][:1])
    left.merge_state(right)
    assert_same_states(left, union)
    assert right.layers == ["dec.attn", "enc.0"]  # the incoming metric is left alone
    with pytest.raises(TypeError, match="matched by name"):
        left.merge_state({"sums": left.sums})
    with pytest.raises(ValueError, match="num_bins=1000"):
        left.merge_state(AttentionEntropy(max_keys=16))


def test_torchmetrics_gather_function_is_refused() -> None:
    with pytest.raises(ValueError, match="`dist_sync_fn` is not supported"):
        AttentionEntropy(dist_sync_fn=lambda tensor, group=None: [tensor])


# --------------------------------------------------------------------------- non-finite values


def test_nonfinite_entropy_is_skipped_and_counted_per_head() -> None:
    """A diverged model's NaN/inf entropy is left out of every statistic and tallied per (layer, head)."""
    nan, inf = math.nan, math.inf
    entropy = torch.tensor([[[nan, inf, math.log(4), nan], [-inf, 0.0, 0.0, nan]]])  # (1, 2, 4)
    num_valid = torch.tensor([4, 4, 4, 0])  # the last query has no key: its NaN is not a divergence
    metric = AttentionEntropy()
    metric.update("a", entropy, num_valid)
    metric.update("diverged", torch.full((2, 3, 2), nan), torch.tensor(5))
    summary = metric.compute()
    assert summary.nonfinite.tolist() == [[2, 1, 0], [4, 4, 4]]
    assert summary.count.tolist() == [[1, 2, 0], [0, 0, 0]]
    assert summary.no_key.tolist() == [[1, 1, 0], [0, 0, 0]]
    assert summary.mean[0, :2].tolist() == [1.0, 0.0]
    out = summary.to_dict()
    assert out["attn_entropy/a/nonfinite"] == 3.0
    assert out["attn_entropy/diverged/nonfinite"] == 12.0  # logged although nothing else is
    assert not any(key.startswith("attn_entropy/diverged/") and not key.endswith("nonfinite") for key in out)
    # Finite values out of range still raise, whatever else the batch holds.
    with pytest.raises(ValueError, match="must lie in"):
        metric.update("a", torch.tensor([[[nan, -0.5]]]).expand(1, 2, 2), torch.tensor(4))


def test_to_dict_values_are_python_floats() -> None:
    entropy_metric, mass_metric = AttentionEntropy(), AttentionMass()
    entropy_metric.update("a", torch.tensor([[[0.5, math.nan], [1.0, 0.2]]]), torch.tensor(4))
    mass_metric.update("sink_mass/a", torch.tensor([[[0.5, math.nan], [1.0, 0.2]]]))
    for out in (entropy_metric.compute().to_dict(), mass_metric.compute().to_dict(per_head=True)):
        assert out and all(type(value) is float for value in out.values())
        assert any(name.endswith("/nonfinite") for name in out)


def test_nonfinite_mass_is_skipped_and_counted_per_head() -> None:
    metric = AttentionMass()
    mass = torch.tensor([[[0.5, math.nan, math.inf], [0.25, 0.75, math.nan]]])
    is_sample = torch.tensor([True, True, False])  # the last query is padding: its NaN is not counted
    metric.update("sink_mass/x", mass, is_sample)
    summary = metric.compute()
    assert summary.nonfinite.tolist() == [[1, 0]]
    assert summary.count.tolist() == [[1, 2]]
    assert summary.mean.tolist() == [[0.5, 0.5]]
    assert summary.to_dict()["attn_sink_mass/x/nonfinite"] == 1.0
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        metric.update("sink_mass/x", torch.tensor([[[math.nan, 1.5]]]))


# --------------------------------------------------------------------------- a max-reduced family


class Peak(LayerMetric):
    """A family with max-reduced fields: the largest value each head saw (and minus the smallest), and a count."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(sum_fields={"count": ()}, max_fields={"peak": (), "peak_pair": (2,)}, **kwargs)  # type: ignore[arg-type]

    def update(self, layer: str, values: torch.Tensor) -> None:
        self.register_layer(layer, values.shape[1])
        peak = values.amax((0, 2))
        count = torch.full((values.shape[1],), float(values.shape[0] * values.shape[2]))
        self.accumulate(layer, count=count, peak=peak, peak_pair=torch.stack([peak, -values.amin((0, 2))], -1))

    def compute(self) -> dict[str, torch.Tensor]:
        return self.statistics()


def _peak_reference(batches: list[tuple[str, torch.Tensor]]) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for layer, values in batches:
        seen = out.setdefault(layer, {"max": [-math.inf] * values.shape[1], "min": [math.inf] * values.shape[1]})
        for head in range(values.shape[1]):
            seen["max"][head] = max(seen["max"][head], *values[:, head].flatten().tolist())
            seen["min"][head] = min(seen["min"][head], *values[:, head].flatten().tolist())
    return out


def test_max_fields_keep_the_maximum() -> None:
    generator = torch.Generator().manual_seed(0)
    batches = [
        (name, -3.0 + torch.randn((2, heads, 5), generator=generator)) for name, heads in [("x", 2), ("y", 3)] * 3
    ]
    metric = Peak()
    for layer, values in batches:
        metric.update(layer, values)
    stats = metric.compute()
    ref = _peak_reference(batches)
    assert metric.layers == ["x", "y"] and stats["peak"].shape == (2, 3) and stats["peak_pair"].shape == (2, 3, 2)
    for index, layer in enumerate(metric.layers):
        heads = len(ref[layer]["max"])
        assert stats["peak"][index, :heads].tolist() == pytest.approx(ref[layer]["max"], abs=0)
        assert stats["peak_pair"][index, :heads, 1].tolist() == pytest.approx([-v for v in ref[layer]["min"]], abs=0)
    assert stats["peak"][0, 2] == -math.inf  # a head slot "x" does not have
    assert stats["count"].tolist() == [[30, 30, 0], [30, 30, 30]]


@pytest.mark.filterwarnings("ignore:The ``compute`` method:UserWarning")
def test_max_fields_through_reset_forward_merge_and_state_dict() -> None:
    first, second = torch.tensor([[[-2.0, -1.0]]]), torch.tensor([[[-4.0, -3.0]]])
    metric = Peak()
    metric.update("x", first)
    # (torchmetrics squeezes one-element results)
    assert float(metric("x", second)["peak"]) == -3.0  # forward: the batch alone
    assert float(metric.compute()["peak"]) == -1.0  # ... and the running maximum
    other = Peak()
    other.update("y", second)
    other.update("x", torch.tensor([[[5.0]]]))
    metric.merge_state(other)
    assert metric.layers == ["x", "y"] and metric.compute()["peak"].tolist() == [[5.0], [-3.0]]
    restored = Peak()
    restored.load_state_dict(metric.state_dict())
    assert torch.equal(restored.compute()["peak"], metric.compute()["peak"])
    assert torch.equal(pickle.loads(pickle.dumps(metric)).compute()["peak"], metric.compute()["peak"])
    metric.reset()
    assert metric.layers == ["x", "y"] and metric.compute()["peak"].tolist() == [[-math.inf], [-math.inf]]


# --------------------------------------------------------------------------- to_dict


def _to_dict_metric() -> tuple[AttentionEntropy, dict[str, Reference]]:
    metric = AttentionEntropy({"enc.0": 2, "enc.1": 3, "idle": 1}, num_bins=50, max_keys=16)
    batches0 = make_batches(41, 2, 3, sample_shape="none", valid_shape="scalar")
    batches1 = make_batches(42, 3, 3, sample_shape="none", valid_shape="scalar")
    for item in batches1:
        item.entropy[:, 2] = math.nan  # head 2 of enc.1 never counts
        item.is_sample = torch.tensor([True, True, False]).reshape(1, 3, 1)
    feed(metric, "enc.0", batches0)
    feed(metric, "enc.1", batches1)
    return metric, {"enc.0": _reference(batches0, 2), "enc.1": _reference(batches1, 3)}


def test_to_dict_names_and_values() -> None:
    metric, refs = _to_dict_metric()
    summary = metric.compute()
    out = summary.to_dict()
    expected_keys = {"attn_entropy/mean"}
    for layer, heads in (("enc.0", 2), ("enc.1", 2)):  # enc.1 head 2 and layer "idle" counted nothing
        base = f"attn_entropy/{layer}"
        expected_keys |= {f"{base}/{s}" for s in ("mean", "mean_seq", "q05", "q25", "q50", "q75", "q95", "nats_mean")}
        expected_keys |= {f"attn_entropy_heads/{layer}/head_{h}/{s}" for h in range(heads) for s in ("mean", "q50")}
        expected_keys |= {f"{base}/nonfinite"} if sum(refs[layer].nonfinite) else set()
    assert set(out) == expected_keys
    assert sum(refs["enc.0"].nonfinite) > 0
    assert all(isinstance(value, float) and math.isfinite(value) for value in out.values())

    for layer, ref in refs.items():
        index = summary.layer_index(layer)
        base = f"attn_entropy/{layer}"
        assert out[f"{base}/mean"] == float(summary.layer_mean[index])
        assert out[f"{base}/mean_seq"] == float(summary.layer_mean_seq[index])
        assert out[f"{base}/nats_mean"] == float(summary.layer_nats_mean[index])
        for q, name in ((0.05, "q05"), (0.25, "q25"), (0.5, "q50"), (0.75, "q75"), (0.95, "q95")):
            assert out[f"{base}/{name}"] == float(summary.layer_quantile(q)[index])
            assert abs(out[f"{base}/{name}"] - _quantile(ref.pooled("values"), q)) <= 1 / 50 + 1e-9
        _close(out[f"{base}/mean"], _mean(ref.pooled("values")))
        _close(out[f"{base}/mean_seq"], _mean(ref.pooled("seq_means")))
        assert out.get(f"{base}/nonfinite", 0.0) == sum(ref.nonfinite)
        for head in range(2):
            heads = f"attn_entropy_heads/{layer}/head_{head}"
            assert out[f"{heads}/mean"] == float(summary.mean[index, head])
            assert out[f"{heads}/q50"] == float(summary.quantile(0.5)[index, head])
            _close(out[f"{heads}/mean"], _mean(ref.values[head]))
    assert out["attn_entropy/mean"] == summary.overall_mean
    _close(out["attn_entropy/mean"], _mean(refs["enc.0"].pooled("values") + refs["enc.1"].pooled("values")))


def test_to_dict_prefix_per_head_and_quantile_names() -> None:
    summary = _to_dict_metric()[0].compute()
    full = summary.to_dict()
    custom = summary.to_dict("val/entropy")
    assert custom == {key.replace("attn_entropy", "val/entropy", 1): value for key, value in full.items()}
    no_heads = summary.to_dict(per_head=False)
    assert no_heads == {key: value for key, value in full.items() if "/head_" not in key}
    assert "attn_entropy/enc.0/q50" in no_heads
    levels = summary.to_dict(quantiles=(0.1, 0.125, 0.5, 0.99))
    layer_keys = {key.rsplit("/", 1)[1] for key in levels if key.startswith("attn_entropy/enc.0/q")}
    assert layer_keys == {"q10", "q12_5", "q50", "q99"}
    assert levels["attn_entropy/enc.0/q12_5"] == float(summary.layer_quantile(0.125)[0])


# --------------------------------------------------------------------------- bad input


def _update(entropy: object = None, num_valid: object = None, is_sample: object = None) -> None:
    metric = AttentionEntropy({"layer": 2})
    entropy = torch.zeros(2, 2, 3) if entropy is None else entropy
    num_valid = torch.tensor(4) if num_valid is None else num_valid
    metric.update("layer", entropy, num_valid, is_sample)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: _update(entropy=torch.zeros(2, 3)), ValueError, r"`entropy` with 3 dims .* got shape \(2, 3\)"),
        (lambda: _update(entropy=torch.zeros(1, 2, 3, 4)), ValueError, "`entropy` with 3 dims"),
        (lambda: _update(entropy=torch.zeros(2, 2, 3, dtype=torch.int64)), TypeError, "`entropy`.*int64"),
        (lambda: _update(entropy=[[[0.0]]]), TypeError, "`entropy`.*list"),
        (lambda: _update(num_valid=torch.tensor(4.0)), TypeError, "`num_valid`.*float32"),
        (lambda: _update(num_valid=torch.tensor(True)), TypeError, "`num_valid`.*bool"),
        (lambda: _update(num_valid=4), TypeError, "`num_valid`.*int"),
        (lambda: _update(is_sample=torch.ones(2, 2, 3, dtype=torch.int64)), TypeError, "`is_sample`.*int64"),
        (lambda: _update(is_sample=torch.ones(2, 2, 3)), TypeError, "`is_sample`.*float32"),
        (
            lambda: _update(num_valid=torch.ones(2, 2, 4, dtype=torch.int64)),
            ValueError,
            r"`num_valid` broadcastable .*\(2, 2, 4\)",
        ),
        (lambda: _update(num_valid=torch.ones(3, 2, 3, dtype=torch.int64)), ValueError, "`num_valid` broadcastable"),
        (lambda: _update(num_valid=torch.ones(1, 2, 2, 3, dtype=torch.int64)), ValueError, "`num_valid` broadcastable"),
        (
            lambda: _update(is_sample=torch.ones(2, 3, 3, dtype=torch.bool)),
            ValueError,
            r"`is_sample` broadcastable .*\(2, 3, 3\)",
        ),
        (
            lambda: _update(entropy=torch.full((2, 2, 3), math.log(4) + 0.01)),
            ValueError,
            r"`entropy` must lie in \[0, ln\(num_valid\)\]",
        ),
        (lambda: _update(entropy=torch.full((2, 2, 3), -0.01)), ValueError, "`entropy` must lie"),
        (
            lambda: _update(entropy=torch.full((2, 2, 3), 0.9), num_valid=torch.tensor([2, 2, 3])),
            ValueError,
            "`entropy` must lie",
        ),
        (lambda: AttentionEntropy(num_bins=0), ValueError, "`num_bins` to be an int >= 1, got 0"),
        (lambda: AttentionEntropy(num_bins=-3), ValueError, "`num_bins`.*-3"),
        (lambda: AttentionEntropy(num_bins=2.5), TypeError, "`num_bins` to be an int, got float"),
        (lambda: AttentionEntropy(nats_bins=0), ValueError, "`nats_bins`"),
        (lambda: AttentionEntropy(max_keys=1), ValueError, "`max_keys` to be an int >= 2, got 1"),
        (
            lambda: AttentionEntropy(layers=[("a", 2)]),
            TypeError,
            "`layers` to map layer name -> number of heads, got list",
        ),
        (lambda: AttentionEntropy(layers={"a": 0}), ValueError, "`num_heads`"),
        (lambda: AttentionEntropy(layers={1: 2}), TypeError, "layer name"),
        (lambda: AttentionEntropy().update("", torch.zeros(1, 1, 1), torch.tensor(2)), TypeError, "layer name"),
        (lambda: histogram_quantile(torch.ones(4), -0.1), ValueError, r"`q` in \[0, 1\], got -0.1"),
        (lambda: histogram_quantile(torch.ones(4), 1.5), ValueError, "`q` in"),
        (lambda: histogram_quantile(torch.ones(4), math.nan), ValueError, "`q` in"),
    ],
    ids=[
        "entropy_2d",
        "entropy_4d",
        "entropy_int",
        "entropy_list",
        "num_valid_float",
        "num_valid_bool",
        "num_valid_python_int",
        "is_sample_int",
        "is_sample_float",
        "num_valid_wrong_query_len",
        "num_valid_wrong_batch",
        "num_valid_4d",
        "is_sample_wrong_heads",
        "above_ln_n",
        "negative",
        "above_ln_n_per_query",
        "num_bins_0",
        "num_bins_negative",
        "num_bins_float",
        "nats_bins_0",
        "max_keys_1",
        "layers_list",
        "layers_zero_heads",
        "layer_name_int",
        "layer_name_empty",
        "quantile_below_0",
        "quantile_above_1",
        "quantile_nan",
    ],
)
def test_bad_input_raises_naming_the_argument(call: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()  # type: ignore[operator]


def test_summary_quantile_rejects_bad_level() -> None:
    metric = AttentionEntropy()
    metric.update("layer", torch.zeros(1, 1, 2), torch.tensor(2))
    summary = metric.compute()
    with pytest.raises(ValueError, match="`q` in"):
        summary.quantile(1.01)
    with pytest.raises(ValueError, match="`q` in"):
        summary.layer_quantile(-1)
    with pytest.raises(ValueError, match="`q` in"):
        summary.to_dict(quantiles=(2.0,))


def test_tolerance_on_range_check() -> None:
    """Float32 rounding just above ln(n) is accepted and clamps to normalised entropy 1."""
    metric = AttentionEntropy()
    metric.update("layer", torch.full((1, 1, 2), math.log(3) + 5e-4), torch.tensor(3))
    metric.update("layer", torch.full((1, 1, 2), -5e-5), torch.tensor(3))
    _close(metric.compute().mean, [[0.5]])


# --------------------------------------------------------------------------- properties


_entropy_batches = st.tuples(
    st.integers(0, 2**32 - 1),  # data seed
    st.integers(1, 3),  # heads
    st.integers(1, 4),  # batches
    st.sampled_from([1, 3, 10, 1000]),  # num_bins
    st.booleans(),  # include_single_key
)


@settings(max_examples=40, deadline=None)
@given(_entropy_batches)
def test_property_summary_is_consistent(params: tuple[int, int, int, int, bool]) -> None:
    seed, heads, count, num_bins, include = params
    batches = make_batches(seed, heads, count, max_valid=6, include_single_key=include)
    metric = AttentionEntropy(num_bins=num_bins, nats_bins=num_bins, max_keys=8, include_single_key=include)
    feed(metric, "layer", batches)
    summary = metric.compute()
    ref = _reference(batches, heads, include)
    np.testing.assert_array_equal(summary.count[0].numpy(), [len(v) for v in ref.values])
    np.testing.assert_array_equal(summary.histogram.sum(-1).numpy(), summary.count.numpy())
    np.testing.assert_array_equal(summary.nats_histogram.sum(-1).numpy(), summary.count.numpy())
    _close(summary.mean[0], [_mean(v) for v in ref.values])
    _close(summary.mean_seq[0], [_mean(v) for v in ref.seq_means])

    counted = summary.count > 0
    for stat in (summary.mean, summary.mean_seq, summary.std):
        assert torch.isnan(stat[~counted]).all()
        assert ((stat[counted] >= 0) & (stat[counted] <= 1)).all()
    assert (summary.std[counted] <= 0.5 + 1e-12).all()  # a [0, 1] variable's std is at most 1/2
    previous = summary.quantile(0.0)
    assert ((previous[counted] >= 0) & (previous[counted] <= 1)).all()
    for q in (0.01, 0.2, 0.5, 0.5, 0.77, 0.99, 1.0):
        current = summary.quantile(q)
        assert (current[counted] >= previous[counted]).all()
        assert (current[counted] <= 1).all()
        previous = current
    assert not math.isnan(summary.overall_mean) or summary.count.sum() == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=12).filter(lambda counts: sum(counts) > 0),
    st.lists(st.floats(0.0, 1.0), min_size=2, max_size=6),
)
def test_property_histogram_quantile(counts: list[int], levels: list[float]) -> None:
    """Monotone in q, and inside the bin that holds the ceil(q * total)-th smallest value."""
    bins = len(counts)
    tensor = torch.tensor(counts, dtype=torch.float64)
    values = sorted(levels)
    results = [float(histogram_quantile(tensor, q, low=-1.0, high=2.0)) for q in values]
    assert results == sorted(results)
    width = 3.0 / bins
    edges = np.repeat(np.arange(bins), counts)  # bin of each value, in sorted order
    for q, got in zip(values, results, strict=True):
        rank = max(math.ceil(q * sum(counts)), 1)
        holding = edges[rank - 1]
        assert -1.0 + holding * width - 1e-12 <= got <= -1.0 + (holding + 1) * width + 1e-12, (q, got, holding)


def test_histogram_quantile_batched_and_empty() -> None:
    counts = torch.tensor([[0.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    got = histogram_quantile(counts, 0.5)
    assert got.shape == (3,) and got.dtype == torch.float64
    _close(got[[0, 2]], [0.5, 0.125])
    assert torch.isnan(got[1])


def test_compute_after_loading_or_registering_is_not_the_cached_summary() -> None:
    """compute() caches its result; a loaded state or a new layer must not be hidden behind that cache."""
    first, other = AttentionEntropy(), AttentionEntropy()
    first.update("layer.0", torch.full((1, 2, 3), math.log(4.0)), torch.tensor(4))
    other.update("layer.0", torch.zeros(1, 2, 3), torch.tensor(4))
    assert first.compute().mean.tolist() == [[1.0, 1.0]]
    first.load_state_dict(other.state_dict())
    assert first.compute().mean.tolist() == [[0.0, 0.0]]
    first.register_layer("layer.1", 3)
    assert first.compute().layers == ["layer.0", "layer.1"]
