"""AttentionEntropy under real 2-process CPU gloo DDP equals one process fed the union of the data.

Each rank updates with its own shard (different sizes and batch shapes per rank)
and calls ``compute()``, which is collective: torchmetrics all-gathers every
state and reduces it by sum (STYLE.md §2). Rank 0 saves the synced summary, its
local state after ``compute()`` (which must be unsynced again) and a second
summary after one more update per rank.
"""

from __future__ import annotations

import math
import socket
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attn_monitor import AttentionEntropy, EntropySummary

WORLD_SIZE = 2
DEADLINE_S = 120.0
# fork reuses the imports already paid for (torch + torchmetrics take seconds per process);
# the parent never initialises a process group, so gloo starts clean in each child.
START_METHOD = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
DECLARED = {"declared": 3}
EXACT = ("histogram", "nats_histogram", "count", "single_key", "no_key")
CLOSE = ("mean", "mean_seq", "std", "nats_mean", "layer_mean", "layer_mean_seq", "layer_std", "layer_nats_mean")

Update = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]


def _batch(rng: np.random.Generator, layer: str, heads: int, batch: int, queries: int) -> Update:
    """Entropy in [0, ln n] with num_valid 0..9 per (sequence, query), some padding queries."""
    num_valid = rng.integers(0, 10, size=(batch, 1, queries))
    entropy = rng.random((batch, heads, queries)) * np.log(np.maximum(num_valid, 1))
    entropy = np.where(num_valid > 1, entropy, np.nan)  # ignored queries may hold NaN
    is_sample = rng.random((batch, heads, queries)) < 0.85
    return (
        layer,
        torch.from_numpy(entropy.astype(np.float32)),
        torch.from_numpy(num_valid),
        torch.from_numpy(is_sample),
    )


def _shard(rank: int, round_index: int = 0) -> list[Update]:
    """Rank 0: three small batches per layer; rank 1: one large batch and the declared layer."""
    rng = np.random.default_rng(1000 * round_index + rank)
    if round_index == 1:
        return [_batch(rng, "enc.0", 4, 1 + rank, 3)]
    if rank == 0:
        shapes = [(2, 5), (3, 7), (1, 4)]
        return [_batch(rng, layer, heads, b, q) for b, q in shapes for layer, heads in (("enc.0", 4), ("enc.1", 2))]
    return [
        _batch(rng, "enc.0", 4, 6, 9),
        _batch(rng, "enc.1", 2, 5, 11),
        _batch(rng, "declared", 3, 4, 6),
    ]


def _summary_arrays(summary: EntropySummary) -> dict[str, object]:
    out: dict[str, object] = {"layers": summary.layers, "num_heads": summary.num_heads}
    for name in EXACT + CLOSE:
        out[name] = getattr(summary, name).clone()
    out["q50"] = summary.quantile(0.5)
    out["layer_q95"] = summary.layer_quantile(0.95)
    out["overall_mean"] = summary.overall_mean
    return out


def _local_counts(metric: AttentionEntropy) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in metric.state_dict().items() if isinstance(value, torch.Tensor)}


def _worker(rank: int, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    try:
        metric = AttentionEntropy(DECLARED, num_bins=50, nats_bins=40, max_keys=16)
        for layer, entropy, num_valid, is_sample in _shard(rank):
            metric.update(layer, entropy, num_valid, is_sample)
        first = _summary_arrays(metric.compute())  # collective: both ranks call it
        local = _local_counts(metric)
        for layer, entropy, num_valid, is_sample in _shard(rank, round_index=1):
            metric.update(layer, entropy, num_valid, is_sample)
        second = _summary_arrays(metric.compute())
        if rank == 0:
            torch.save({"first": first, "second": second, "local": local}, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _single_process(rounds: int) -> AttentionEntropy:
    metric = AttentionEntropy(DECLARED, num_bins=50, nats_bins=40, max_keys=16)
    for round_index in range(rounds):
        for rank in range(WORLD_SIZE):
            for layer, entropy, num_valid, is_sample in _shard(rank, round_index):
                metric.update(layer, entropy, num_valid, is_sample)
    return metric


def _assert_summary_equal(got: dict[str, object], expected: dict[str, object]) -> None:
    assert got["layers"] == expected["layers"]
    assert got["num_heads"] == expected["num_heads"]
    for name in EXACT:
        assert torch.equal(got[name], expected[name]), name  # type: ignore[arg-type]
    for name in (*CLOSE, "q50", "layer_q95"):
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-12, equal_nan=True, msg=name)
    assert math.isclose(got["overall_mean"], expected["overall_mean"], rel_tol=1e-10)  # type: ignore[arg-type]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_process_gloo_equals_single_process_union(tmp_path: Path) -> None:
    out_path = tmp_path / "rank0.pt"
    # Computed before forking: the children inherit every lazy import it triggers (torch.broadcast_shapes
    # imports sympy on first use, seconds per process).
    union = _single_process(rounds=1)
    context = mp.start_processes(
        _worker, args=(_free_port(), str(out_path)), nprocs=WORLD_SIZE, join=False, start_method=START_METHOD
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

    saved = torch.load(out_path, weights_only=False)
    expected_first = _summary_arrays(union.compute())
    # Every head of every layer saw data, and the ranks' data really differ.
    assert (expected_first["count"][:, :2] > 0).all()  # type: ignore[index]
    assert expected_first["layers"] == ["declared", "enc.0", "enc.1"]
    _assert_summary_equal(saved["first"], expected_first)

    # compute() must leave rank 0's own (unsynced) state behind, or a second compute double counts.
    rank0 = AttentionEntropy(DECLARED, num_bins=50, nats_bins=40, max_keys=16)
    for layer, entropy, num_valid, is_sample in _shard(0):
        rank0.update(layer, entropy, num_valid, is_sample)
    local = saved["local"]
    assert local.keys() == _local_counts(rank0).keys()
    for name, value in _local_counts(rank0).items():
        torch.testing.assert_close(local[name], value, rtol=1e-12, atol=1e-12, msg=name)

    _assert_summary_equal(saved["second"], _summary_arrays(_single_process(rounds=2).compute()))


def test_shards_differ_between_ranks() -> None:
    """The DDP test is only meaningful if the ranks hold different amounts of data."""
    sizes = [sum(entropy.numel() for _, entropy, _, _ in _shard(rank)) for rank in range(WORLD_SIZE)]
    assert sizes[0] != sizes[1] and min(sizes) > 0
