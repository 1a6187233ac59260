"""The metrics under real 2-process CPU gloo DDP equal one process fed the union of the data.

Both ranks run every scenario below in one process group (``compute()`` is
collective) and save what they saw; the parent checks it against one process
fed both shards (for max logit and attention distance: a float64 reference
recomputed from both ranks' q and k). Layers are matched by name, so the ranks may register them
in different orders or not at all. While one ``compute()`` runs, every
``torch.distributed`` function is counted: the packed state must sync in at
most three collectives whatever the number of layers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from attn_monitor import AttentionEntropy, AttentionMass, EntropySummary
from attn_monitor.functional.entropy import attention_lse_entropy
from attn_monitor.functional.masks import Support
from attn_monitor.functional.statistics import attention_distance, attention_max_logit
from attn_monitor.metrics.base import LayerMetric
from attn_monitor.metrics.bound import LogitBound
from attn_monitor.metrics.statistics import AttentionStatistics
from tests.helpers import reference
from tests.helpers.processes import launch
from tests.metrics.test_entropy import Peak

WORLD_SIZE = 2
#: The QK-Clip dry run's tau in the statistics shards: between the heads' maxima of the union.
CLIP_TAU = 4.0
MAX_COLLECTIVES = 3
CONFIG = {"num_bins": 50, "nats_bins": 40, "max_keys": 16}
DECLARED = {"declared": 3}
EXACT = ("histogram", "nats_histogram", "count", "single_key", "no_key", "nonfinite")
CLOSE = ("mean", "mean_seq", "std", "nats_mean", "layer_mean", "layer_mean_seq", "layer_std", "layer_nats_mean")
#: Every collective torch.distributed offers; the metric may call any of them.
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
)

SCENARIOS = ("union", "eight_layers", "order", "idle_rank")

Update = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]


# --------------------------------------------------------------------------- data


def _batch(rng: np.random.Generator, layer: str, heads: int, batch: int, queries: int) -> Update:
    """Entropy in [0, ln n] with num_valid 0..9 per (sequence, query), some padding and a few NaN/inf samples."""
    num_valid = rng.integers(0, 10, size=(batch, 1, queries))
    entropy = rng.random((batch, heads, queries)) * np.log(np.maximum(num_valid, 1))
    entropy = np.where(num_valid > 1, entropy, np.nan)  # ignored queries may hold NaN
    entropy = np.where(rng.random(entropy.shape) < 0.05, rng.choice([np.nan, np.inf]), entropy)  # diverged
    is_sample = rng.random((batch, heads, queries)) < 0.85
    return (
        layer,
        torch.from_numpy(entropy.astype(np.float32)),
        torch.from_numpy(num_valid),
        torch.from_numpy(is_sample),
    )


def _shard(scenario: str, rank: int, round_index: int = 0) -> list[Update]:
    """What ``rank`` feeds in a scenario (different sizes and batch shapes per rank)."""
    rng = np.random.default_rng(1000 * round_index + 100 * SCENARIOS.index(scenario) + rank)
    if scenario == "union" and round_index == 1:
        return [_batch(rng, "enc.0", 4, 1 + rank, 3)]
    if scenario == "union" and rank == 0:
        shapes = [(2, 5), (3, 7), (1, 4)]
        return [_batch(rng, layer, heads, b, q) for b, q in shapes for layer, heads in (("enc.0", 4), ("enc.1", 2))]
    if scenario == "union":
        return [_batch(rng, "enc.0", 4, 6, 9), _batch(rng, "enc.1", 2, 5, 11), _batch(rng, "declared", 3, 4, 6)]
    if scenario == "eight_layers":
        return [_batch(rng, f"blocks.{i}", 8, 2 + rank, 5) for i in range(8)]
    if scenario == "order":  # same head counts: mixing two layers up would go unnoticed
        names = ["a", "b", "c"] if rank == 0 else ["c", "a"]
        return [_batch(rng, name, 2, 3, 6) for name in names]
    if scenario == "idle_rank":
        return [] if rank == 1 else [_batch(rng, name, 3, 2, 5) for name in ("x", "y")]
    raise ValueError(scenario)


def _feed(metric: AttentionEntropy, updates: list[Update]) -> None:
    for layer, entropy, num_valid, is_sample in updates:
        metric.update(layer, entropy, num_valid, is_sample)


def _peak_shard(rank: int) -> list[tuple[str, torch.Tensor]]:
    """Negative values (a max filled with 0 would be wrong); "z" only on rank 1, "x" only on rank 0."""
    generator = torch.Generator().manual_seed(7 + rank)
    layers = [("x", 2), ("y", 3)] if rank == 0 else [("y", 3), ("z", 1)]
    return [(name, -5.0 + torch.rand((2, heads, 3), generator=generator)) for name, heads in layers]


def _mass_shard(rank: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11 + rank)
    out = []
    for name in ["sink_mass/a", "leakage/a"] if rank == 0 else ["leakage/a"]:
        mass = torch.rand((2 + rank, 2, 4), generator=generator)
        mass[0, 0, rank] = math.nan  # a diverged sample: counted in `nonfinite`
        out.append((name, mass, torch.rand((2 + rank, 1, 4), generator=generator) < 0.9))
    return out


#: (layer, q, k, (batch, seq) key padding): one causal self-attention call.
StatisticsCall = tuple[str, torch.Tensor, torch.Tensor, list[list[bool]]]


def _statistics_shard(rank: int) -> list[StatisticsCall]:
    """Attention calls of one rank: layer "both" on each rank, "only0" on rank 0 and "only1" on rank 1.

    Other batch sizes per rank, left padding in some rows, and logits whose
    per-rank maxima differ (a sum of them, or of a -inf fill, is no maximum).
    """
    generator = torch.Generator().manual_seed(21 + rank)
    heads, length, dim = 3, 6, 4
    layers = ["both", "only0"] if rank == 0 else ["only1", "both"]
    out = []
    for index, layer in enumerate(layers):
        batch = 2 + rank + index
        q = torch.randn(batch, heads, length, dim, generator=generator) * (1.5 + rank)
        k = torch.randn(batch, heads, length, dim, generator=generator) * 1.5 - 0.5 * rank
        padding = [[position >= row for position in range(length)] for row in range(batch)]  # row r: r pads left
        out.append((layer, q, k, padding))
    return out


def _feed_statistics(metric: AttentionStatistics, calls: list[StatisticsCall]) -> None:
    """What the monitor's consumer does with each call: per-query values of the counted queries."""
    for layer, q, k, padding in calls:
        support = Support(q.shape[2], k.shape[2], padding_mask=torch.tensor(padding), causal=True)
        metric.update(
            layer,
            max_logit=attention_max_logit(q, k, mask=support),
            distance=attention_distance(q, k, mask=support),
            is_sample=support.is_sample(),
        )


# --------------------------------------------------------------------------- counting collectives


class CollectiveCounter:
    """Counts calls of torch.distributed functions: outermost calls, and the collectives on the wire.

    ``all_gather_object`` is one call and two wire collectives (sizes, then bytes).
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.wire: list[str] = []
        self._depth = 0

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            outermost, inner_before = self._depth == 0, len(self.wire)
            self._depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1
                if outermost:
                    self.calls.append(name)
                if len(self.wire) == inner_before:  # called no other collective: it is one
                    self.wire.append(name)

        return counted

    @contextmanager
    def counting(self) -> Iterator[CollectiveCounter]:
        with ExitStack() as stack:
            # Both namespaces: callers use torch.distributed.*, c10d calls its own globals.
            for namespace in (dist, c10d):
                for name in COLLECTIVES:
                    if hasattr(namespace, name):
                        wrapped = self.wrap(name, getattr(namespace, name))
                        stack.enter_context(mock.patch.object(namespace, name, wrapped))
            yield self


def _counted_compute(metric: Any) -> tuple[Any, dict[str, list[str]]]:
    with CollectiveCounter().counting() as counter:
        value = metric.compute()
    return value, {"calls": counter.calls, "wire": counter.wire}


# --------------------------------------------------------------------------- workers


def _summary_arrays(summary: EntropySummary) -> dict[str, object]:
    out: dict[str, object] = {"layers": summary.layers, "num_heads": summary.num_heads}
    for name in EXACT + CLOSE:
        out[name] = getattr(summary, name).clone()
    out["q50"] = summary.quantile(0.5)
    out["layer_q95"] = summary.layer_quantile(0.95)
    out["overall_mean"] = summary.overall_mean
    out["to_dict"] = summary.to_dict()
    return out


def _local(metric: LayerMetric) -> dict[str, object]:
    """The rank's own state, read without a collective."""
    return {"layers": metric.layers, **metric.statistics()}


def _run_scenarios(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    metric = AttentionEntropy(DECLARED, **CONFIG)
    _feed(metric, _shard("union", rank))
    out["union_first"] = _summary_arrays(metric.compute())
    out["union_local"] = _local(metric)  # compute() must hand the rank back its own state
    _feed(metric, _shard("union", rank, round_index=1))
    out["union_second"] = _summary_arrays(metric.compute())

    for scenario in ("eight_layers", "order", "idle_rank"):
        metric = AttentionEntropy(**CONFIG)
        _feed(metric, _shard(scenario, rank))
        summary, out[f"{scenario}_collectives"] = _counted_compute(metric)
        out[scenario] = _summary_arrays(summary)
        out[f"{scenario}_local"] = _local(metric)

    peak = Peak()
    for layer, values in _peak_shard(rank):
        peak.update(layer, values)
    out["peak"], out["peak_collectives"] = _counted_compute(peak)
    out["peak_layers"] = peak.layers

    statistics = AttentionStatistics()
    _feed_statistics(statistics, _statistics_shard(rank))
    summary, out["statistics_collectives"] = _counted_compute(statistics)
    out["statistics"] = {
        "layers": summary.layers,
        **{
            name: getattr(summary, name).clone()
            for name in ("max_logit", "layer_max_logit", "logit_count", "distance", "distance_count")
        },
        "clip_factors": summary.clip_factors(CLIP_TAU),
        "clipped_heads": summary.clipped_heads(CLIP_TAU),
    }

    bound = LogitBound()
    for layer, q, k, padding in _statistics_shard(rank):
        support = Support(q.shape[2], k.shape[2], padding_mask=torch.tensor(padding), causal=True)
        bound.update(layer, *attention_lse_entropy(q, k, mask=support), support.is_sample())
    bounds = bound.compute()
    out["bound"] = {"layers": bounds.layers, "lower": bounds.lower, "upper": bounds.upper, "count": bounds.count}

    mass = AttentionMass(num_bins=20)
    for key, values, is_sample in _mass_shard(rank):
        mass.update(key, values, is_sample)
    summary = mass.compute()
    out["mass"] = {"layers": summary.layers, **{name: summary.stats(name) for name in ("hist", "count", "nonfinite")}}

    conflict = AttentionEntropy(**CONFIG)
    conflict.register_layer("clash", 2 + rank)
    try:
        conflict.compute()
    except ValueError as error:  # every rank sees the same layer lists, so every rank raises
        out["conflict"] = str(error)
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # torchmetrics: compute() before update() on the idle rank
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    try:
        torch.save(_run_scenarios(rank), Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank of a real 2-process gloo group saved."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out_dir = tmp_path_factory.mktemp("ddp")
    # Warm lazy imports before forking (torch.broadcast_shapes imports sympy on first use).
    _single("union", rounds=1).compute()
    launch(_worker, out_dir, WORLD_SIZE)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


# --------------------------------------------------------------------------- single-process references


def _single(scenario: str, rounds: int = 1, declared: dict[str, int] | None = None) -> AttentionEntropy:
    metric = AttentionEntropy(declared, **CONFIG)
    for round_index in range(rounds):
        for rank in range(WORLD_SIZE):
            _feed(metric, _shard(scenario, rank, round_index))
    return metric


def _alone(scenario: str, rank: int, declared: dict[str, int] | None = None) -> dict[str, object]:
    metric = AttentionEntropy(declared, **CONFIG)
    _feed(metric, _shard(scenario, rank))
    return _local(metric)


def _assert_summary_equal(got: dict[str, object], expected: dict[str, object]) -> None:
    assert got["layers"] == expected["layers"]
    assert got["num_heads"] == expected["num_heads"]
    for name in EXACT:
        assert torch.equal(got[name], expected[name]), name  # type: ignore[arg-type]
    for name in (*CLOSE, "q50", "layer_q95"):
        torch.testing.assert_close(got[name], expected[name], rtol=1e-12, atol=1e-12, equal_nan=True, msg=name)
    assert math.isclose(got["overall_mean"], expected["overall_mean"], rel_tol=1e-12)  # type: ignore[arg-type]
    assert got["to_dict"].keys() == expected["to_dict"].keys()  # type: ignore[attr-defined]


def _assert_same_local(got: dict[str, object], expected: dict[str, object]) -> None:
    assert got.keys() == expected.keys() and got["layers"] == expected["layers"]
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=name)


# --------------------------------------------------------------------------- tests


def test_synced_compute_equals_single_process_union(ranks: list[dict[str, Any]]) -> None:
    expected = _summary_arrays(_single("union", declared=DECLARED).compute())
    # Every head of every layer saw data, the ranks' data really differ, and some entropies diverged.
    assert (expected["count"][:, :2] > 0).all()  # type: ignore[index]
    assert expected["nonfinite"].sum() > 0  # type: ignore[attr-defined]
    assert expected["layers"] == ["declared", "enc.0", "enc.1"]
    for rank in ranks:
        _assert_summary_equal(rank["union_first"], expected)
        _assert_summary_equal(rank["union_second"], _summary_arrays(_single("union", 2, DECLARED).compute()))


def test_compute_leaves_each_rank_its_own_state(ranks: list[dict[str, Any]]) -> None:
    """compute() syncs into a copy: a second compute must not count the other rank twice."""
    for index, rank in enumerate(ranks):
        _assert_same_local(rank["union_local"], _alone("union", index, DECLARED))
        for scenario in ("eight_layers", "order", "idle_rank"):
            _assert_same_local(rank[f"{scenario}_local"], _alone(scenario, index))
    assert ranks[1]["idle_rank_local"]["layers"] == []


@pytest.mark.parametrize("scenario", ["eight_layers", "order", "idle_rank"])
def test_layers_matched_by_name(ranks: list[dict[str, Any]], scenario: str) -> None:
    """Any registration order, or none at all on one rank: every rank gets the union, layer by layer."""
    expected = _summary_arrays(_single(scenario).compute())
    for rank in ranks:
        _assert_summary_equal(rank[scenario], expected)
    assert ranks[0]["order"]["layers"] == ["a", "b", "c"]
    assert ranks[1]["idle_rank"]["layers"] == ["x", "y"]


@pytest.mark.parametrize("scenario", ["eight_layers", "order", "idle_rank", "peak", "statistics"])
def test_one_compute_takes_at_most_three_collectives(ranks: list[dict[str, Any]], scenario: str) -> None:
    for rank in ranks:
        counted = rank[f"{scenario}_collectives"]
        assert 0 < len(counted["calls"]) <= MAX_COLLECTIVES, counted
        assert 0 < len(counted["wire"]) <= MAX_COLLECTIVES, counted


def test_max_fields_reduce_by_max(ranks: list[dict[str, Any]]) -> None:
    single = Peak()
    for rank in range(WORLD_SIZE):
        for layer, values in _peak_shard(rank):
            single.update(layer, values)
    expected = single.compute()
    assert single.layers == ["x", "y", "z"] and (expected["peak"][:, :1] < 0).all()
    for index, rank in enumerate(ranks):
        assert rank["peak_layers"] == [layer for layer, _ in _peak_shard(index)]  # local layout restored
        assert rank["peak"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(rank["peak"][name], value), name


def test_max_logit_and_distance_equal_the_float64_reference_on_the_union(ranks: list[dict[str, Any]]) -> None:
    """Max logit is maxed across ranks, the distance sums and counts are summed: every rank gets the union.

    The reference recomputes every query's max logit and mean distance in
    float64 over its support (tests/reference.py), from both ranks' calls,
    and pools them per (layer, head) in plain Python. Fails when the max
    fields are summed instead of maxed across ranks (the per-rank maxima of
    layer "both" differ, and the layers one rank lacks hold -inf there), and the QK-Clip dry run with them.
    """
    # layer -> head -> rank -> the counted queries' values
    logits: dict[str, list[list[list[float]]]] = {}
    distances: dict[str, list[list[list[float]]]] = {}
    for rank in range(WORLD_SIZE):
        for layer, q, k, padding in _statistics_shard(rank):
            batch, heads, length, _ = q.shape
            spec = reference.MaskSpec(batch, heads, length, length, padding=padding, causal=True)
            dense, counted = reference.dense_support(spec), reference.is_sample(spec)
            values = reference.max_logit_from_qk(q, k, dense), reference.distance_from_qk(q, k, dense)
            for pooled, value in zip((logits, distances), values, strict=True):
                per_head = pooled.setdefault(layer, [[[] for _ in range(WORLD_SIZE)] for _ in range(heads)])
                for head in range(heads):
                    per_head[head][rank] += value[:, head][counted[:, head]].tolist()
    both = [[max(per_rank) for per_rank in head] for head in logits["both"]]
    assert all(abs(max(peaks) - sum(peaks)) > 0.1 for peaks in both)  # a sum of the ranks' maxima is no maximum
    for rank in ranks:
        got = rank["statistics"]
        assert got["layers"] == ["both", "only0", "only1"]
        for index, layer in enumerate(got["layers"]):
            union_logits = [[v for per_rank in head for v in per_rank] for head in logits[layer]]
            union_distances = [[v for per_rank in head for v in per_rank] for head in distances[layer]]
            want_max = [max(values) for values in union_logits]
            want_distance = [math.fsum(values) / len(values) for values in union_distances]
            assert got["logit_count"][index].tolist() == [len(values) for values in union_logits], layer
            assert got["distance_count"][index].tolist() == [len(values) for values in union_distances], layer
            assert got["max_logit"][index].tolist() == pytest.approx(want_max, rel=1e-5, abs=1e-5), layer
            assert float(got["layer_max_logit"][index]) == pytest.approx(max(want_max), rel=1e-5, abs=1e-5)
            assert got["distance"][index].tolist() == pytest.approx(want_distance, rel=1e-4, abs=1e-4), layer
            # The QK-Clip dry run of the union: some heads clip, some do not.
            factors = [min(1.0, CLIP_TAU / value) for value in want_max]
            assert got["clip_factors"][index].tolist() == pytest.approx(factors, rel=1e-5), layer
            assert float(got["clipped_heads"][index]) == sum(value > CLIP_TAU for value in want_max), layer
    union_maxima = [max(v for per_rank in head for v in per_rank) for layer in logits.values() for head in layer]
    assert min(union_maxima) < CLIP_TAU < max(union_maxima), union_maxima


def test_max_logit_bound_is_the_reference_bracket_of_the_union(ranks: list[dict[str, Any]]) -> None:
    """The bound's ends are maxed across ranks: every rank gets max (lse - H) and max lse over the union's
    counted queries (float64 reference), and the union's max logit lies between them. Fails when the ends
    are summed across ranks, or when a layer one rank lacks (-inf there) leaks into the other's ends."""
    ends: dict[str, list[tuple[list[float], list[float], list[float]]]] = {}
    for rank in range(WORLD_SIZE):
        for layer, q, k, padding in _statistics_shard(rank):
            batch, heads, length, _ = q.shape
            spec = reference.MaskSpec(batch, heads, length, length, padding=padding, causal=True)
            dense, counted = reference.dense_support(spec), reference.is_sample(spec)
            lse, entropy = reference.lse_from_qk(q, k, dense), reference.entropy_from_qk(q, k, dense)
            peak = reference.max_logit_from_qk(q, k, dense)
            per_head = ends.setdefault(layer, [([], [], []) for _ in range(heads)])
            for head in range(heads):
                rows = counted[:, head]
                per_head[head][0].extend((lse - entropy)[:, head][rows].tolist())
                per_head[head][1].extend(lse[:, head][rows].tolist())
                per_head[head][2].extend(peak[:, head][rows].tolist())
    for rank in ranks:
        got = rank["bound"]
        assert got["layers"] == ["both", "only0", "only1"]
        for index, layer in enumerate(got["layers"]):
            lower, upper, peaks = ([max(values) for values in column] for column in zip(*ends[layer], strict=True))
            assert got["lower"][index].tolist() == pytest.approx(lower, rel=1e-5, abs=1e-5), layer
            assert got["upper"][index].tolist() == pytest.approx(upper, rel=1e-5, abs=1e-5), layer
            assert all(lo - 1e-5 <= p <= up + 1e-5 for lo, p, up in zip(lower, peaks, upper, strict=True)), layer
            assert got["count"][index].tolist() == [len(values[0]) for values in ends[layer]], layer


def test_attention_mass_syncs_by_name_with_nonfinite(ranks: list[dict[str, Any]]) -> None:
    single = AttentionMass(num_bins=20)
    for rank in range(WORLD_SIZE):
        for key, values, is_sample in _mass_shard(rank):
            single.update(key, values, is_sample)
    summary = single.compute()
    assert summary.nonfinite.sum() > 0
    for rank in ranks:
        assert rank["mass"]["layers"] == summary.layers == ["sink_mass/a", "leakage/a"]
        for name in ("hist", "count", "nonfinite"):
            assert torch.equal(rank["mass"][name], summary.stats(name)), name


def test_conflicting_head_counts_raise_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["conflict"] == "Layer 'clash' has 2 heads in rank 0 and 3 in rank 1."


def test_shards_differ_between_ranks() -> None:
    """The DDP test is only meaningful if the ranks hold different amounts of data."""
    for scenario in ("union", "eight_layers", "order"):
        sizes = [sum(entropy.numel() for _, entropy, _, _ in _shard(scenario, rank)) for rank in range(WORLD_SIZE)]
        assert sizes[0] != sizes[1] and min(sizes) > 0
