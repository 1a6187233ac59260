"""The metrics under real 2-process CPU gloo DDP equal one process fed the union of the data.

Both ranks run every scenario below in one process group (``compute()`` is
collective) and save what they saw; the parent checks it against one process
fed both shards. Layers are matched by name, so the ranks may register them
in different orders or not at all. While one ``compute()`` runs, every
``torch.distributed`` function is counted: the packed state must sync in at
most three collectives whatever the number of layers.
"""

from __future__ import annotations

import math
import socket
import time
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
import torch.multiprocessing as mp

from attn_monitor import AttentionEntropy, AttentionMass, EntropySummary
from attn_monitor.metric import LayerMetric
from tests.test_metric import Peak

WORLD_SIZE = 2
DEADLINE_S = 120.0
MAX_COLLECTIVES = 3
# fork reuses the imports already paid for (torch + torchmetrics take seconds per process);
# the parent never initialises a process group, so gloo starts clean in each child.
START_METHOD = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank of a real 2-process gloo group saved."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out_dir = tmp_path_factory.mktemp("ddp")
    # Warm lazy imports before forking (torch.broadcast_shapes imports sympy on first use).
    _single("union", rounds=1).compute()
    context = mp.start_processes(
        _worker, args=(_free_port(), str(out_dir)), nprocs=WORLD_SIZE, join=False, start_method=START_METHOD
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"DDP workers did not finish within {DEADLINE_S:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
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


@pytest.mark.parametrize("scenario", ["eight_layers", "order", "idle_rank", "peak"])
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
