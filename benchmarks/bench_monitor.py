"""Monitor cost in Lightning: a validation epoch, idle training steps, and the metric's DDP sync.

Three measurements on the demo model of ``examples/train_tiny_gpt.py`` (a
2-layer, 4-head, d=64 TinyGPT on the copy task, batch 64, sequence 30):

* **(a) validation epoch**: ``Trainer.validate`` over a fixed dataloader of
  ``--val-batches`` batches, unmonitored vs monitored by an
  :class:`~attn_monitor.AttentionEntropyMonitor` sampling 2 batches and every
  batch. Each run is a fresh Trainer with a fresh TensorBoardLogger (in a
  temporary directory) and a fresh monitor, on the same model and dataloader;
  the monitor logs scalars, histograms and the heatmap, as in the demo. Only
  ``validate`` is timed (Trainer construction is not). Peak memory is the
  resident growth of one ``validate`` in a fresh child process.
* **(b) training steps**: ``Trainer.fit`` for ``--train-steps`` steps with no
  validation, without a callback vs with the monitor attached but idle (no
  ``train_every_n_steps``): the hooks are installed and pass through.
* **(c) metric sync**: a real 2-process gloo group; each rank updates an
  ``AttentionEntropy`` (4 to 32 layers x 8 heads), then ``compute()`` (a
  collective: the layer lists and one packed buffer of every layer's sums) is
  timed against ``compute()`` on an unsynced copy of the same state, and the
  ``torch.distributed`` calls it makes are counted: three collectives
  whatever the number of layers.
* **(d) fixed cost at 32 layers x 32 heads**: ``Trainer.validate`` of a model
  with 32 attention layers of 32 heads and next to no compute, unmonitored
  vs monitored (one recorded batch) with default logging and scalars only:
  what the epoch-end work (compute, alerts, 257 scalars, the digest,
  histograms, the heatmap, the heads-over-training pictures) costs however
  big the model.

Times are from interleaved repeats (the order changes every repeat); ratios
and differences are medians of per-repeat pairs measured side by side, so
slow drifts in the machine's load cancel; absolute milliseconds are for scale
only (shared, noisy CPUs). Torch runs ``--threads`` threads (default 1: the
demo's setting; tiny matrices only lose from more).

    python benchmarks/bench_monitor.py [--repeats 11] [--threads 1] [--val-batches 8] [--train-steps 30]
                                       [--sync-layers 4 8 16 32] [--sync-tokens 1e4] [--sync-repeats 7]
                                       [--no-memory]
"""

from __future__ import annotations

import argparse
import copy
import logging
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import lightning.pytorch as pl
from common import cpu_model, put_peak_growth, run_children
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader
from train_tiny_gpt import MAX_LEN, CopyDataset, CopyModel  # type: ignore[import-not-found]

from attn_monitor import AttentionEntropy, AttentionEntropyMonitor, LogOptions
from attn_monitor.lightning import callback as callback_module
from attn_monitor.lightning.callback import logged_through_lightning
from attn_monitor.report.loggers import per_layer

BATCH_SIZE = 64
NUM_LAYERS = 2  # the demo's TinyGPT
SYNC_HEADS, WORLD_SIZE = 8, 2
#: Queries per sequence in the sync benchmark's updates (N tokens = N / QUERIES sequences).
QUERIES = 1000
#: Sequences per update call in the sync benchmark (bounds the update's temporary memory).
SEQUENCES_PER_UPDATE = 100


def _quiet() -> None:
    """Silence Lightning's per-Trainer banners and its dataloader-worker advice."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*but have no `val_dataloader`.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated.*")


def _trainer(**kwargs: object) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,  # type: ignore[arg-type]
    )


def _gpt(module: pl.LightningModule) -> torch.nn.Module:
    """The module the monitor watches, as in the demo: the GPT itself (layers ``blocks.0.attn``, ...)."""
    gpt = module.gpt
    assert isinstance(gpt, torch.nn.Module)
    return gpt


def _monitor(batches: int, figures: bool = True) -> AttentionEntropyMonitor:
    """The demo's monitor; histograms (100 bins) and the heatmap on (``figures``) or off."""
    if figures:
        return AttentionEntropyMonitor(batches=batches, module=_gpt)
    return AttentionEntropyMonitor(batches=batches, log=LogOptions(histogram_bins=None, heatmap=False), module=_gpt)


def _paired(first: list[float], second: list[float], fn: Callable[[float, float], float]) -> list[float]:
    """``fn`` of the two samples of every repeat (taken side by side, so slow drifts in load cancel)."""
    return [fn(a, b) for a, b in zip(first, second, strict=True)]


def _spread(values: list[float], digits: int = 2) -> str:
    """Median and inter-quartile range, e.g. ``1.02 [0.97, 1.08]``."""
    median = statistics.median(values)
    if len(values) < 2:
        return f"{median:.{digits}f}"
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return f"{median:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


# ------------------------------------------------------------ (a) validation
def validation_setup(val_batches: int, seed: int = 0) -> tuple[CopyModel, DataLoader]:
    pl.seed_everything(seed, verbose=False)
    model = CopyModel(num_layers=NUM_LAYERS, lr=2e-3, total_steps=1)
    loader = DataLoader(CopyDataset(val_batches * BATCH_SIZE, seed=seed + 2), batch_size=BATCH_SIZE)
    return model, loader


def run_validation(model: CopyModel, loader: DataLoader, sampled: int, logdir: str, figures: bool = True) -> float:
    """Seconds of one ``Trainer.validate`` (fresh Trainer, logger and monitor); ``sampled`` 0: no monitor."""
    callbacks = [_monitor(sampled, figures)] if sampled else []
    trainer = _trainer(logger=TensorBoardLogger(logdir, name="bench", version=None), callbacks=callbacks)
    start = time.perf_counter()
    trainer.validate(model, loader, verbose=False)
    elapsed = time.perf_counter() - start
    if sampled and callbacks[0].last_summary is None:
        raise RuntimeError("The monitor recorded nothing: the benchmark would time an idle callback.")
    return elapsed


def _validation_peak_child(sampled: int, val_batches: int, threads: int, queue: multiprocessing.Queue) -> None:
    _quiet()
    torch.set_num_threads(threads)
    # What the monitored run imports lazily (figures, the event writer) is loaded first, so the growth is the run's.
    import matplotlib.backends.backend_agg
    import matplotlib.figure  # noqa: F401
    from torch.utils import tensorboard  # noqa: F401

    model, loader = validation_setup(val_batches)
    with tempfile.TemporaryDirectory() as logdir:
        put_peak_growth(queue, lambda: run_validation(model, loader, sampled, logdir))


_PRELOAD = ["torch", "lightning.pytorch", "attn_monitor"]


def validation_peak(sampled: int, val_batches: int, threads: int) -> int:
    """Resident-set growth (bytes) of one validate in a fresh child process."""
    (value,) = run_children(_validation_peak_child, [(sampled, val_batches, threads)], 1, _PRELOAD)
    return int(value)


def time_forward(model: CopyModel, batch: dict[str, torch.Tensor], calls: int = 10) -> float:
    """Median seconds of one plain forward of ``batch`` (eval, no_grad): the unit a sampled batch is compared to."""
    was_training = model.training
    model.eval()
    samples = []
    with torch.no_grad():
        for _ in range(calls):
            start = time.perf_counter()
            model(batch["input_ids"], batch["attention_mask"])
            samples.append(time.perf_counter() - start)
    model.train(was_training)
    return statistics.median(samples)


def bench_validation(val_batches: int, repeats: int, threads: int, memory: bool) -> str:
    model, loader = validation_setup(val_batches)
    batch = next(iter(loader))
    # (monitored batches, histograms + heatmap logged)
    configs = [(0, True), (2, True), (val_batches, True), (2, False)]
    samples: dict[tuple[int, bool], list[float]] = {config: [] for config in configs}
    forward: list[float] = []
    with tempfile.TemporaryDirectory() as logdir:
        for config in configs:  # warm-up: imports, font cache, first TensorBoard writer
            run_validation(model, loader, config[0], logdir, config[1])
        for repeat in range(repeats):
            shift = repeat % len(configs)
            for sampled, figures in configs[shift:] + configs[:shift]:
                samples[sampled, figures].append(run_validation(model, loader, sampled, logdir, figures))
            forward.append(time_forward(model, batch))
    times = {config: statistics.median(values) for config, values in samples.items()}
    one_forward = statistics.median(forward)
    peaks = {k: validation_peak(k, val_batches, threads) / 2**20 for k in (0, 2, val_batches)} if memory else {}
    base_samples = samples[0, True]
    base = times[0, True]
    lines = [
        f"### (a) Validation epoch: `Trainer.validate`, {val_batches} batches of {BATCH_SIZE} x {MAX_LEN} tokens",
        "",
        f"Demo TinyGPT ({NUM_LAYERS} layers x 4 heads, d=64), {threads} torch thread(s). "
        f"{repeats} interleaved repeats (order rotated), each a fresh Trainer + TensorBoardLogger (temporary "
        "directory) + monitor on the same model and dataloader; monitored = `AttentionEntropyMonitor(batches=k)` "
        "logging scalars, per-head stats, 100-bin histograms and the heatmap figure at the epoch end (last row: "
        "scalars only, `log=LogOptions(histogram_bins=None, heatmap=False)`). Only `validate` is timed. "
        "validate ms: median; "
        "ratio and extra: median [inter-quartile range] over repeats of the paired (same repeat) ratio to the "
        "unmonitored run and of (monitored - unmonitored) / k, epoch-end work included.",
        "",
        "| monitored batches k | logged | validate ms | x unmonitored | extra ms per sampled batch |"
        + (" peak MiB |" if memory else ""),
        "|---|---|---|---|---|" + ("---|" if memory else ""),
    ]
    for sampled, figures in configs:
        label = "0 (no monitor)" if sampled == 0 else f"{sampled}" + (" (all)" if sampled == val_batches else "")
        logged = "—" if sampled == 0 else ("scalars, histograms, heatmap" if figures else "scalars only")
        own = samples[sampled, figures]
        ratio = "1.00" if sampled == 0 else _spread(_paired(own, base_samples, lambda a, b: a / b))
        extras = [(a - b) / max(sampled, 1) * 1e3 for a, b in zip(own, base_samples, strict=True)]
        extra = "—" if sampled == 0 else _spread(extras, 1)
        row = f"| {label} | {logged} | {times[sampled, figures] * 1e3:.0f} | {ratio} | {extra} |"
        if memory:
            row += f" {peaks[sampled]:.0f} |" if figures else " — |"
        lines.append(row)
    lines += [
        "",
        f"For scale: one plain forward of a batch (eval, no_grad, median of 10 per repeat, in the same run) takes "
        f"{one_forward * 1e3:.2f} ms; the unmonitored validate spends {base / val_batches * 1e3:.1f} ms per batch "
        "(Lightning's loop, the loss and logging included).",
    ]
    if val_batches > 2:
        two, every, scalars = samples[2, True], samples[val_batches, True], samples[2, False]
        marginal = statistics.median(_paired(every, two, lambda a, b: (a - b) / (val_batches - 2)))
        fixed = statistics.median(_paired(two, base_samples, lambda a, b: a - b)) - 2 * marginal
        figures_cost = statistics.median(_paired(two, scalars, lambda a, b: a - b))
        lines.append(
            f"Split by the monitored rows (paired medians): each further sampled batch costs {marginal * 1e3:.1f} ms "
            f"({marginal / one_forward:.1f} x a plain forward); the fixed part (set-up and hooks, compute, logging) "
            f"is {fixed * 1e3:.0f} ms ({fixed / base:.2f} x the unmonitored epoch); histograms + heatmap account "
            f"for {figures_cost * 1e3:.0f} ms of it (k=2 rows, with minus without)."
        )
    if memory:
        lines += ["", "Peak MiB: resident growth of one validate in a fresh child (lazy imports loaded first)."]
    return "\n".join(lines)


# ------------------------------------------------------------ (b) training
def run_fit(template: CopyModel, loader: DataLoader, steps: int, with_monitor: bool) -> float:
    """Seconds of one ``Trainer.fit`` of ``steps`` steps on a copy of ``template``, no validation."""
    model = copy.deepcopy(template)
    callbacks = [_monitor(2)] if with_monitor else []
    trainer = _trainer(logger=False, callbacks=callbacks, max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0)
    start = time.perf_counter()
    trainer.fit(model, loader)
    elapsed = time.perf_counter() - start
    if trainer.global_step != steps:
        raise RuntimeError(f"Expected {steps} steps, ran {trainer.global_step}.")
    return elapsed


def bench_training(steps: int, repeats: int, threads: int) -> str:
    pl.seed_everything(0, verbose=False)
    template = CopyModel(num_layers=NUM_LAYERS, lr=2e-3, total_steps=steps)
    loader = DataLoader(CopyDataset(steps * BATCH_SIZE, seed=1), batch_size=BATCH_SIZE)
    configs = (False, True)
    samples: dict[bool, list[float]] = {config: [] for config in configs}
    for config in configs:  # warm-up
        run_fit(template, loader, steps, config)
    for repeat in range(repeats):
        order = configs if repeat % 2 == 0 else configs[::-1]
        for config in order:
            samples[config].append(run_fit(template, loader, steps, config))
    times = {config: statistics.median(values) for config, values in samples.items()}
    base = times[False]
    ratios = _paired(samples[True], samples[False], lambda a, b: a / b)
    return "\n".join(
        [
            f"### (b) Training: `Trainer.fit`, {steps} steps of {BATCH_SIZE} x {MAX_LEN} tokens, no validation",
            "",
            f"Demo TinyGPT, AdamW, {threads} torch thread(s), `logger=False`. {repeats} interleaved repeats "
            "(order alternated), each a fresh Trainer on a fresh copy of the same initial model and the same "
            "dataloader; idle = `AttentionEntropyMonitor(batches=2)` attached without `train_every_n_steps` "
            "(capture hooks installed, never recording). Only `fit` is timed. fit ms: median; ratio: median "
            "[inter-quartile range] of the paired (same repeat) ratios.",
            "",
            "| callback | fit ms | ms per step | x no callback |",
            "|---|---|---|---|",
            f"| none | {base * 1e3:.0f} | {base / steps * 1e3:.1f} | 1.00 |",
            f"| monitor, idle | {times[True] * 1e3:.0f} | {times[True] / steps * 1e3:.1f} | {_spread(ratios, 3)} |",
            "",
            f"Paired ratios, sorted: {', '.join(f'{r:.3f}' for r in sorted(ratios))}.",
        ]
    )


# ------------------------------------------------------------ (c) DDP sync
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _feed(metric: AttentionEntropy, tokens: int, rank: int) -> None:
    """``tokens`` queries per layer (sequences of QUERIES causal queries), entropy uniform in [0, ln keys]."""
    generator = torch.Generator().manual_seed(1000 + rank)
    queries = min(tokens, QUERIES)
    num_valid = torch.arange(1, queries + 1)[None, None, :]
    sequences = -(-tokens // queries)
    for layer in metric.layers:
        for first in range(0, sequences, SEQUENCES_PER_UPDATE):
            count = min(SEQUENCES_PER_UPDATE, sequences - first)
            entropy = torch.rand(count, SYNC_HEADS, queries, generator=generator) * num_valid.log()
            metric.update(layer, entropy, num_valid)


def _state_bytes(metric: AttentionEntropy) -> int:
    states = [state for state in metric.metric_state.values() if isinstance(state, torch.Tensor)]
    return sum(state.numel() * state.element_size() for state in states)


@contextmanager
def _collectives_called() -> Iterator[list[str]]:
    """The names of the ``torch.distributed`` collectives called inside the block (outermost calls)."""
    import torch.distributed as dist

    names: list[str] = []
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counting(name: str, function: Callable) -> Callable:
        def counted(*args: object, **kwargs: object) -> object:
            names.append(name)
            return function(*args, **kwargs)

        return counted

    try:
        for name, function in originals.items():
            setattr(dist, name, counting(name, function))
        yield names
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


_COLLECTIVES = ("all_gather", "all_gather_object", "all_reduce", "barrier", "broadcast", "broadcast_object_list")


def _sync_worker(
    rank: int,
    port: int,
    layer_counts: list[int],
    tokens: int,
    repeats: int,
    threads: int,
    queue: multiprocessing.Queue,
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=300))
    try:
        rows = []
        for num_layers in layer_counts:
            layers = {f"blocks.{index}.attn": SYNC_HEADS for index in range(num_layers)}
            synced = AttentionEntropy(layers)
            _feed(synced, tokens, rank)
            local = AttentionEntropy(layers, sync_on_compute=False)
            local.load_state_dict(synced.state_dict())
            poke = (torch.zeros(1, SYNC_HEADS, 1), torch.tensor(1))  # one-key query: tallied, not counted
            synced_s, local_s = [], []
            for _ in range(repeats):
                # An update clears compute()'s cache, so every compute syncs and recomputes.
                synced.update("blocks.0.attn", *poke)
                local.update("blocks.0.attn", *poke)
                dist.barrier()
                with _collectives_called() as calls:
                    start = time.perf_counter()
                    summary = synced.compute()
                    synced_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                local.compute()
                local_s.append(time.perf_counter() - start)
            # Sanity: the synced summary holds both ranks' tokens.
            counted = float(summary.count.sum())
            queries = min(tokens, QUERIES)  # every query but the first of a sequence has >= 2 keys
            expected = WORLD_SIZE * num_layers * SYNC_HEADS * -(-tokens // queries) * (queries - 1)
            per_rank = torch.tensor([statistics.median(synced_s), statistics.median(local_s)])
            dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
            rows.append((num_layers, *per_rank.tolist(), _state_bytes(synced), calls, counted, expected))
        # Reference, same group: one barrier.
        barrier_s = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.barrier()
            barrier_s.append(time.perf_counter() - start)
        reference = torch.tensor([statistics.median(barrier_s)])
        dist.all_reduce(reference, op=dist.ReduceOp.MAX)
        if rank == 0:
            queue.put((rows, float(reference)))
    finally:
        dist.destroy_process_group()


def _calls_text(calls: list[str]) -> str:
    """``2: all_gather_object, all_reduce``, or a count per name when there are many."""
    if len(calls) <= 4:
        return f"{len(calls)}: {', '.join(calls)}"
    return f"{len(calls)}: " + ", ".join(f"{calls.count(name)} {name}" for name in sorted(set(calls)))


def bench_sync(layer_counts: list[int], tokens: int, repeats: int, threads: int) -> str:
    port = _free_port()
    args = [(rank, port, layer_counts, tokens, repeats, threads) for rank in range(WORLD_SIZE)]
    ((rows, barrier_s),) = run_children(_sync_worker, args, 1, _PRELOAD)
    lines = [
        f"### (c) Metric sync: `AttentionEntropy.compute()` in a {WORLD_SIZE}-process gloo group",
        "",
        f"L layers x {SYNC_HEADS} heads, default 1000 + 1000 histogram bins, float64 state; each rank first updates "
        f"every layer with {tokens} tokens (sequences of up to {QUERIES} causal queries). Processes from a fork "
        f"server, MASTER_ADDR 127.0.0.1, {threads} torch thread(s) each. compute() ms: median of {repeats} "
        "(barrier before each; slower rank); local = compute() of an unsynced copy of the same state "
        "(`sync_on_compute=False`), in the same run. Collectives: calls into `torch.distributed` during one "
        "synced compute().",
        "",
        "| layers | state KiB per rank | torch.distributed calls per compute | synced compute ms | local compute ms "
        "| sync ms | synced / local |",
        "|---|---|---|---|---|---|---|",
    ]
    for num_layers, synced_s, local_s, state_bytes, calls, counted, expected in rows:
        if counted != expected:
            raise RuntimeError(f"The synced summary counted {counted:.0f} queries, expected {expected}.")
        lines.append(
            f"| {num_layers} | {state_bytes / 1024:.0f} | {_calls_text(calls)} | {synced_s * 1e3:.2f} | "
            f"{local_s * 1e3:.2f} | {(synced_s - local_s) * 1e3:.2f} | {synced_s / local_s:.1f} |"
        )
    lines += [
        "",
        "Every layer's sums travel in one packed all_reduce, after one all_gather_object of the ranks' layer "
        "lists (two all_gathers on the wire): three collectives whatever the number of layers; the sync time "
        f"grows only with the bytes summed. Reference in the same group: one barrier takes {barrier_s * 1e3:.2f} ms.",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------ report
def machine(threads: int) -> str:
    return f"{cpu_model()}, {os.cpu_count()} logical CPUs, {threads} torch thread(s), torch {torch.__version__}"


# ------------------------------------------------------------ (d) fixed cost at 32 x 32
class WideModel(pl.LightningModule):
    """``layers`` causal self-attention blocks of ``heads`` heads of dimension 2: many heads, little compute."""

    def __init__(self, layers: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(2 * heads, 6 * heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        for block in self.blocks:
            q, k, v = block(x).view(batch, length, 3, self.heads, 2).permute(2, 0, 3, 1, 4)
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + attended.transpose(1, 2).reshape(batch, length, -1)
        return x

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(batch[0]).square().mean())


class _TimedMonitor(AttentionEntropyMonitor):
    """The monitor, timing its validation-end hook (where every per-validation fixed cost is paid)
    and, inside it, Lightning's ``LightningModule.log_dict`` of the means.

    ``everything_through_log``: every per-layer statistic goes through ``log_dict``, not only the
    means: the other way to reach ``trainer.callback_metrics``, timed for comparison.
    """

    def __init__(self, everything_through_log: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.everything_through_log = everything_through_log
        self.epoch_end_seconds: list[float] = []
        self.log_dict_seconds: list[float] = []

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_dict: Callable[..., None] = pl_module.log_dict
        logged: list[float] = []

        def timed_log_dict(*args: Any, **kwargs: Any) -> None:
            begin = time.perf_counter()
            log_dict(*args, **kwargs)
            logged.append(time.perf_counter() - begin)

        pl_module.log_dict = timed_log_dict  # type: ignore[method-assign]
        if self.everything_through_log:
            callback_module.logged_through_lightning = per_layer  # type: ignore[assignment]
        start = time.perf_counter()
        try:
            super().on_validation_epoch_end(trainer, pl_module)
        finally:
            del pl_module.log_dict  # the instance attribute: the method shows through again
            callback_module.logged_through_lightning = logged_through_lightning
        self.epoch_end_seconds.append(time.perf_counter() - start)
        self.log_dict_seconds.append(sum(logged))


def bench_fixed_cost(layers: int, heads: int, repeats: int, threads: int) -> str:
    """Per-validation fixed cost of the monitor on a model of ``layers`` x ``heads`` with next to no compute."""
    pl.seed_everything(0, verbose=False)
    model = WideModel(layers, heads)
    with torch.no_grad():
        for block in model.blocks:  # spread attention: some heads sharp, some flat
            block.weight.mul_(4.0)
    loader = DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 16, 2 * heads)), batch_size=4)
    #: row -> monitor options; None: no monitor
    configs: dict[str, dict[str, Any] | None] = {
        "no monitor": None,
        "default logging": {},
        "scalars only": {"log": LogOptions(histogram_bins=None, heatmap=False)},
        "scalars only, every per-layer statistic through `log_dict`": {
            "log": LogOptions(histogram_bins=None, heatmap=False),
            "everything_through_log": True,
        },
    }
    monitors = {name: _TimedMonitor(batches=1, **options) for name, options in configs.items() if options is not None}
    with tempfile.TemporaryDirectory() as logdir:
        trainers = {
            name: _trainer(
                logger=TensorBoardLogger(logdir, name=f"row{index}"),
                callbacks=[monitors[name]] if name in monitors else [],
            )
            for index, name in enumerate(configs)
        }
        samples: dict[str, list[float]] = {name: [] for name in configs}
        for repeat in range(repeats + 1):  # the first round warms up (the monitor's set-up, first writes)
            names = list(configs)[repeat % len(configs) :] + list(configs)[: repeat % len(configs)]
            for name in names:
                start = time.perf_counter()
                trainers[name].validate(model, loader, verbose=False)
                if repeat:
                    samples[name].append(time.perf_counter() - start)
        for trainer in trainers.values():
            trainer.loggers[0].finalize("success")
    base = samples["no monitor"]
    rows = [
        f"### (d) Fixed cost per validation: {layers} layers x {heads} heads",
        "",
        f"A model of {layers} causal self-attention blocks of {heads} heads of dimension 2 (next to no compute), "
        f"`Trainer.validate` over two batches of 4 x 16 tokens, one of them recorded, {threads} torch thread(s), "
        f"one Trainer + TensorBoardLogger per row kept across {repeats} interleaved repeats (as the validations "
        "of one fit). At the validation end the monitor computes its summary, runs the alerts and logs "
        f"{layers * 8 + 1} per-layer and overall scalars ({layers + 1} means through `LightningModule.log`, "
        "all of them in `trainer.callback_metrics`; per-head scalars are off by default) and, with default "
        f"logging, the digest, {layers} histograms, the heatmap and {layers} heads-over-training pictures (drawn "
        "and written to TensorBoard on a thread of their own): "
        "the fixed cost of a validation, timed inside the monitor's `on_validation_epoch_end` (TensorBoard "
        "serialises and writes the event in its own thread afterwards); of it, Lightning's `log_dict` of the "
        "means, and the monitor's own part (the rest). extra ms: the whole validate minus "
        "the unmonitored one, recording the batch included. Medians [inter-quartile range] over repeats, "
        "differences paired by repeat.",
        "",
        "| monitor | validate ms | extra ms | validation end ms | of it: Lightning `log_dict` ms | monitor's own ms |",
        "|---|---|---|---|---|---|",
    ]
    for name, values in samples.items():
        if name not in monitors:
            rows.append(f"| {name} | {statistics.median(values) * 1e3:.0f} | — | — | — | — |")
            continue
        monitor = monitors[name]
        extra = _spread(_paired(values, base, lambda a, b: (a - b) * 1e3), 1)
        ends, logs = monitor.epoch_end_seconds[1:], monitor.log_dict_seconds[1:]
        epoch_end = _spread([seconds * 1e3 for seconds in ends], 1)
        log_dict = _spread([seconds * 1e3 for seconds in logs], 1)
        own = _spread([(end - log) * 1e3 for end, log in zip(ends, logs, strict=True)], 1)
        rows.append(f"| {name} | {statistics.median(values) * 1e3:.0f} | {extra} | {epoch_end} | {log_dict} | {own} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11, help="timed repeats of (a) and (b) (default 11)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, here and in children (default 1)")
    parser.add_argument("--val-batches", type=int, default=8, help="validation batches (default 8)")
    parser.add_argument("--train-steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument(
        "--sync-layers", type=int, nargs="+", default=[4, 8, 16, 32], help="layers of the synced metric in (c)"
    )
    parser.add_argument("--sync-tokens", type=float, default=1e4, help="tokens per rank per layer in (c)")
    parser.add_argument("--sync-repeats", type=int, default=7, help="timed compute() calls per row (default 7)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory children of (a)")
    parser.add_argument("--sections", default="abcd", help="which of (a)-(d) to run (default abcd)")
    args = parser.parse_args(argv)
    if args.val_batches < 2:
        parser.error("--val-batches must be at least 2")
    _quiet()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        start = time.perf_counter()
        sections = [
            f"Monitor overhead ({machine(args.threads)}; load average {os.getloadavg()[0]:.1f} at start).",
        ]
        timings = []
        for name, run in (
            ("a", lambda: bench_validation(args.val_batches, args.repeats, args.threads, not args.no_memory)),
            ("b", lambda: bench_training(args.train_steps, args.repeats, args.threads)),
            ("c", lambda: bench_sync(args.sync_layers, int(args.sync_tokens), args.sync_repeats, args.threads)),
            ("d", lambda: bench_fixed_cost(32, 32, args.repeats, args.threads)),
        ):
            if name not in args.sections:
                continue
            section_start = time.perf_counter()
            sections.append(run())
            timings.append(f"({name}) {time.perf_counter() - section_start:.0f} s")
        sections.append(f"Total {time.perf_counter() - start:.0f} s: {', '.join(timings)}.")
    finally:
        torch.set_num_threads(previous_threads)
    table = "\n\n".join(sections)
    print(table)
    return table


if __name__ == "__main__":
    main()
