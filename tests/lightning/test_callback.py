"""AttentionEntropyMonitor in real ``Trainer.fit`` runs, checked on what real loggers wrote.

Every run is a real ``lightning.Trainer(...).fit`` on CPU with tiny models
(tests/lightning_models.py): a nanoGPT-style module whose attention calls SDPA
with a bool mask (causal AND key padding), and a tiny random Hugging Face GPT-2
(``attn_implementation="sdpa"``) inside a LightningModule; dict batches with
right padding.

The independent reference (tests/reference.py, float64, dense, nothing from
attn_monitor): a :class:`~tests.helpers.lightning_models.BatchRecorder` keeps the
weights and batches of every validation run; after ``fit`` a fresh model gets
those weights and the entropy of every counted query (a real query with at
least two visible keys) is recomputed: for the nanoGPT module from q and k of
its own projections with a float64 softmax over the true support, for the HF
model from an eager twin run with ``output_attentions=True``. Token-weighted
means must agree to 1e-4; histogram quantiles must lie within one bin (0.001)
of the exact order statistic.

What the loggers wrote is read back after ``fit``: TensorBoard event files with
tensorboard's ``EventAccumulator``; the CSV file; and the W&B offline run's
``.wandb`` transaction log, decoded with a small reader of its documented
leveldb-log framing (7-byte file header ``:W&B`` 0xBEE1 v0, 32 KiB blocks,
7-byte chunk headers with a CRC-32 that is checked) into
``wandb.proto.wandb_internal_pb2.Record`` messages (see :func:`read_wandb_history`).
"""

from __future__ import annotations

import copy
import csv
import glob
import io
import json
import math
import os
import random
import socket
import struct
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import Tensor, nn

from attn_monitor import Batches, CollapseAlert, LogOptions
from attn_monitor.lightning.callback import AttentionEntropyMonitor
from attn_monitor.report.archive import load_summary
from tests.helpers import lightning_models as lm
from tests.helpers import models, reference

MEAN_TOL = 1e-4
BIN = 0.001  # width of the metric's bins (quantile error bound)
QUANTILE_TOL = BIN + 1e-5
QUANTILES = {"q05": 0.05, "q25": 0.25, "q50": 0.5, "q75": 0.75, "q95": 0.95}
PREFIX = "attn_entropy"
TRAIN_PREFIX = "attn_entropy_train"
TRAIN_BATCHES = 4  # per epoch: validation runs at global steps 4 and 8
TRAIN_EVERY = 3  # training-time recording at global steps 0, 3, 6


# --------------------------------------------------------------------------- reference


@dataclass
class Samples:
    """The counted queries of one layer: one entry per (sequence, head, query)."""

    normalized: Tensor  # float64, H / ln(n)
    nats: Tensor  # float64, H
    head: Tensor  # long
    sequence: Tensor  # long, unique across batches

    @staticmethod
    def concat(parts: list[Samples]) -> Samples:
        return Samples(*(torch.cat([getattr(p, f) for p in parts]) for f in ("normalized", "nats", "head", "sequence")))


def _layer_samples(entropy: Tensor, support: Tensor, real: Tensor, first_sequence: int) -> Samples:
    """Counted queries of one attention call; ``entropy`` (B, H, Nq) in nats from the reference."""
    batch, heads, num_q = entropy.shape
    counts = reference.num_valid(support.expand(batch, heads, num_q, support.shape[-1]))
    counted = real[:, None, :].expand(batch, heads, num_q) & (counts > 1)
    normalized = reference.normalize(entropy, counts)
    head = torch.arange(heads)[None, :, None].expand(batch, heads, num_q)
    sequence = (first_sequence + torch.arange(batch))[:, None, None].expand(batch, heads, num_q)
    return Samples(normalized[counted], entropy[counted], head[counted], sequence[counted])


def gpt_reference(state: dict[str, Tensor], batches: list[dict[str, Tensor]]) -> dict[str, Samples]:
    """Per-layer counted queries of :class:`TinyGPT` with ``state``, recomputed in float64.

    q and k come from the module's own projections on the inputs of a float64
    forward pass (attention written out with an explicit softmax, no SDPA);
    entropy comes from tests/reference.py over the support the batch implies.
    """
    model = lm.TinyGPT()
    model.load_state_dict(state)
    model = model.double().eval()
    parts: dict[str, list[Samples]] = {name: [] for name in lm.GPT_LAYERS}
    with torch.no_grad():
        for index, batch in enumerate(batches):
            ids, real = batch["input_ids"], batch["attention_mask"].bool()
            b, n = ids.shape
            spec = reference.MaskSpec(b, lm.HEADS, n, n, padding=real.tolist(), causal=True)
            support = reference.dense_support(spec)
            x = model.embed(ids)
            for name, block in zip(lm.GPT_LAYERS, model.blocks, strict=True):
                q, k, v = block.attn.qkv(block.ln_1(x))
                entropy = reference.entropy_from_qk(q, k, support)
                parts[name].append(_layer_samples(entropy, support, real, index * b))
                scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~support, -math.inf)
                y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)
                x = x + block.attn.c_proj(y)
                x = x + block.mlp(block.ln_2(x))
    return {name: Samples.concat(p) for name, p in parts.items()}


def hf_reference(state: dict[str, Tensor], batches: list[dict[str, Tensor]]) -> dict[str, Samples]:
    """Per-layer counted queries of :class:`HFLM` with ``state``: an eager twin with ``output_attentions=True``."""
    twin = models.hf_model("gpt2", "eager")
    twin.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    twin.eval()
    parts: dict[str, list[Samples]] = {name: [] for name in lm.HF_LAYERS}
    with torch.no_grad():
        for index, batch in enumerate(batches):
            ids, real = batch["input_ids"], batch["attention_mask"].bool()
            b, n = ids.shape
            support = reference.dense_support(reference.MaskSpec(b, lm.HEADS, n, n, padding=real.tolist(), causal=True))
            attentions = twin(**batch, output_attentions=True).attentions
            assert len(attentions) == len(lm.HF_LAYERS)
            for name, probs in zip(lm.HF_LAYERS, attentions, strict=True):
                entropy = reference.attention_entropy(probs, support)
                parts[name].append(_layer_samples(entropy, support, real, index * b))
    return {name: Samples.concat(p) for name, p in parts.items()}


def _order_statistic_bounds(values: Tensor, q: float) -> tuple[float, float]:
    """The exact ``q`` quantile lies between these two order statistics."""
    ordered = values.sort().values
    position = q * (len(ordered) - 1)
    return float(ordered[math.floor(position)]), float(ordered[math.ceil(position)])


def _quantile_close(got: float, values: Tensor, q: float) -> bool:
    low, high = _order_statistic_bounds(values, q)
    return low - QUANTILE_TOL <= got <= high + QUANTILE_TOL


def expected_names(
    layers: list[str], heads: int = lm.HEADS, prefix: str = PREFIX, *, per_head: bool = False
) -> set[str]:
    """The scalar names of the naming contract for ``layers`` (``per_head``: with ``LogOptions(per_head=True)``)."""
    names = {f"{prefix}/mean"}
    for layer in layers:
        base = f"{prefix}/{layer}"
        names |= {f"{base}/mean", f"{base}/mean_seq", f"{base}/nats_mean"}
        names |= {f"{base}/{q}" for q in QUANTILES}
        if per_head:
            names |= {f"{prefix}_heads/{layer}/head_{h}/{s}" for h in range(heads) for s in ("mean", "q50")}
    return names


def check_against_reference(scalars: dict[str, float], samples: dict[str, Samples], prefix: str = PREFIX) -> None:
    """Every contract scalar of ``scalars`` equals the reference ``samples`` (mean 1e-4, quantiles one bin).

    Per-head values are checked, every one of them, when ``scalars`` holds any
    (``LogOptions(per_head=True)``; off by default).
    """
    problems = []
    per_head = any(name.startswith(f"{prefix}_heads/") for name in scalars)

    def close(name: str, want: float) -> None:
        if not abs(scalars[name] - want) <= MEAN_TOL:
            problems.append(f"{name}: logged {scalars[name]!r}, reference {want!r}")

    def quantile(name: str, values: Tensor, q: float) -> None:
        if not _quantile_close(scalars[name], values, q):
            problems.append(f"{name}: logged {scalars[name]!r}, exact between {_order_statistic_bounds(values, q)}")

    for layer, s in samples.items():
        base = f"{prefix}/{layer}"
        close(f"{base}/mean", float(s.normalized.mean()))
        close(f"{base}/nats_mean", float(s.nats.mean()))
        pair_means = [
            float(s.normalized[(s.head == h) & (s.sequence == seq)].mean())
            for h in range(lm.HEADS)
            for seq in s.sequence.unique().tolist()
            if ((s.head == h) & (s.sequence == seq)).any()
        ]
        close(f"{base}/mean_seq", sum(pair_means) / len(pair_means))
        for name, q in QUANTILES.items():
            quantile(f"{base}/{name}", s.normalized, q)
        for h in range(lm.HEADS) if per_head else ():
            values = s.normalized[s.head == h]
            close(f"{prefix}_heads/{layer}/head_{h}/mean", float(values.mean()))
            quantile(f"{prefix}_heads/{layer}/head_{h}/q50", values, 0.5)
    everything = torch.cat([s.normalized for s in samples.values()])
    close(f"{prefix}/mean", float(everything.mean()))
    assert not problems, "\n".join(problems)


def reference_histogram(values: Tensor, bins: int = 100) -> Tensor:
    return torch.bincount((values * bins).floor().clamp(0, bins - 1).long(), minlength=bins).double()


def check_histogram(counts: list[float], values: Tensor) -> None:
    """Logged bucket counts equal the reference's, up to queries a float32 rounding moves across an edge."""
    got, want = torch.tensor(counts, dtype=torch.float64), reference_histogram(values)
    assert got.shape == want.shape
    assert got.sum() == want.sum() == len(values)
    assert (got - want).abs().sum() <= 4, f"logged {got.tolist()}\nreference {want.tolist()}"


def assert_spread(samples: dict[str, Samples]) -> None:
    """The reference is far from uniform and far from one-hot in every layer: a wrong count moves its numbers."""
    for layer, s in samples.items():
        assert 0.2 < float(s.normalized.mean()) < 0.9, layer
        assert float(s.normalized.std()) > 0.05, layer


def count_queries(samples: dict[str, Samples]) -> int:
    return sum(len(s.normalized) for s in samples.values())


# --------------------------------------------------------------------------- running fit


def make_trainer(root: Path, *, loggers: Any = False, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "num_sanity_val_steps": 0,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "log_every_n_steps": 1,
        "default_root_dir": str(root),
    }
    options.update(kwargs)
    return pl.Trainer(logger=loggers, callbacks=callbacks, **options)


def total_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def function_modes() -> list[Any]:
    """Torch function modes active now (no public accessor exists; this one is stable since torch 2.0)."""
    return list(torch.overrides._get_current_function_mode_stack())


def wandb_settings() -> Any:
    import wandb

    return wandb.Settings(console="off", x_disable_stats=True, disable_git=True, save_code=False, silent=True)


@dataclass
class Run:
    root: Path
    trainer: pl.Trainer
    monitor: AttentionEntropyMonitor
    recorder: lm.BatchRecorder
    tensorboard_dir: str
    csv_path: str
    wandb_file: str | None
    references: list[dict[str, Samples]]  # one per validation run: the first `batches` validation batches
    train_references: list[dict[str, Samples]]  # one per recorded training step


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """nanoGPT module, 2 epochs of 4 training batches, 3 validation batches, TensorBoard + CSV + W&B at once."""
    root = tmp_path_factory.mktemp("gpt_run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        loggers: list[Any] = [TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")]
        wandb = None
        try:
            import wandb
            from lightning.pytorch.loggers import WandbLogger
        except ImportError:
            pass
        else:
            loggers.append(
                WandbLogger(save_dir=str(root), offline=True, project="attn-monitor-tests", settings=wandb_settings())
            )
        monitor = AttentionEntropyMonitor(  # batches=2 by default; per-head values on, to check them too
            batches=Batches(train_every_n_steps=TRAIN_EVERY), log=LogOptions(per_head=True)
        )
        recorder = lm.BatchRecorder(train_every=TRAIN_EVERY)
        trainer = make_trainer(root, loggers=loggers, callbacks=[monitor, recorder])
        try:
            trainer.fit(
                lm.TinyGPT(), lm.loader(lm.make_batches(TRAIN_BATCHES, seed=1)), lm.loader(lm.make_batches(3, seed=2))
            )
        finally:
            if wandb is not None:
                wandb.finish()
    wandb_files = glob.glob(str(root / "wandb" / "*run-*" / "run-*.wandb"))
    return Run(
        root=root,
        trainer=trainer,
        monitor=monitor,
        recorder=recorder,
        tensorboard_dir=loggers[0].log_dir,
        csv_path=os.path.join(loggers[1].log_dir, "metrics.csv"),
        wandb_file=wandb_files[0] if wandb_files else None,
        references=[gpt_reference(v["state"], v["batches"][:2]) for v in recorder.validations],
        train_references=[gpt_reference(t["state"], [t["batch"]]) for t in recorder.train],
    )


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Tiny GPT-2 (sdpa) in a LightningModule, TensorBoard + CSV, batches=3 of 4 validation batches."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf_run")
    loggers = [TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")]
    monitor = AttentionEntropyMonitor(batches=3)
    recorder = lm.BatchRecorder()
    trainer = make_trainer(root, loggers=loggers, callbacks=[monitor, recorder], limit_train_batches=2)
    trainer.fit(lm.HFLM(), lm.loader(lm.make_batches(2, seed=3)), lm.loader(lm.make_batches(4, seed=4)))
    return Run(
        root=root,
        trainer=trainer,
        monitor=monitor,
        recorder=recorder,
        tensorboard_dir=loggers[0].log_dir,
        csv_path=os.path.join(loggers[1].log_dir, "metrics.csv"),
        wandb_file=None,
        references=[hf_reference(v["state"], v["batches"][:3]) for v in recorder.validations],
        train_references=[],
    )


# --------------------------------------------------------------------------- reading loggers back


def read_tensorboard(log_dir: str) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
    assert len(events) == 1, events
    accumulator = EventAccumulator(
        events[0], size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0, "compressedHistograms": 0}
    )
    accumulator.Reload()
    return accumulator


def in_family(name: str, prefix: str = PREFIX) -> bool:
    """``name`` is one of ``prefix``'s scalars: its per-layer group or its per-head group."""
    return name.startswith((prefix + "/", prefix + "_heads/"))


def logged_step(validation: dict[str, Any]) -> int:
    """The step Lightning logs a validation's metrics at: the batches stepped before the last one."""
    return int(validation["step"]) - 1


def tb_scalars_at(accumulator: Any, step: int, prefix: str = PREFIX) -> dict[str, float]:
    out = {}
    for tag in accumulator.Tags()["scalars"]:
        if in_family(tag, prefix):
            values = [e.value for e in accumulator.Scalars(tag) if e.step == step]
            if values:
                assert len(values) == 1, (tag, step, values)
                out[tag] = values[0]
    return out


def read_csv(path: str) -> tuple[list[str], list[dict[str, str]]]:
    """Columns and rows; consecutive rows of one step merged (Lightning and the monitor each write part of it)."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        rows: list[dict[str, str]] = []
        for row in reader:
            if rows and rows[-1]["step"] == row["step"]:
                rows[-1].update({column: value for column, value in row.items() if value != ""})
            else:
                rows.append(row)
        return list(reader.fieldnames or []), rows


def read_wandb_records(path: str) -> list[Any]:
    """Decode a W&B transaction log (``run-*.wandb``) into ``wandb_internal_pb2.Record`` messages.

    The file is a leveldb log (github.com/google/leveldb/blob/main/doc/log_format.md)
    behind a 7-byte header (``:W&B``, magic 0xBEE1 little-endian, version 0):
    32 KiB blocks of chunks, each with a 7-byte header (CRC-32 of type byte and
    data, uint16 length, uint8 type FULL=1/FIRST=2/MIDDLE=3/LAST=4); a block
    tail shorter than a header is zero padding. wandb >= 0.18 has no public
    Python reader any more (``wandb.sdk.internal.datastore`` went with the Go
    core), so this decodes the framing and leaves the payload to the public
    protobuf classes. Every chunk's CRC is checked, so a wrong guess at the
    framing fails loudly instead of yielding garbage.
    """
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, hex(magic), version)
    block, pos, chunks, records = 32768, 7, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding / preallocated tail
            pos += left
            continue
        body = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, f"bad CRC at byte {pos}"
        pos += 7 + length
        chunks.append(body)
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def finished_wandb_records(path: str, timeout: float = 30.0) -> list[Any]:
    """The records of a finished run: W&B's service may still be writing the file when ``finish()`` returns.

    Read again until the run's ``exit`` record is there, so that the last
    history rows are not missed.
    """
    deadline = time.monotonic() + timeout
    while True:
        records = read_wandb_records(path)
        if any(record.WhichOneof("record_type") == "exit" for record in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def read_wandb_history(path: str) -> list[dict[str, Any]]:
    """History rows of a W&B run file: name -> JSON-decoded value; nested keys (histograms, images) as dicts."""
    import json

    rows = []
    for record in finished_wandb_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict[str, Any] = {}
        for item in record.history.item:
            path_ = list(item.nested_key) or [item.key]
            value = json.loads(item.value_json)
            target = row
            for part in path_[:-1]:
                target = target.setdefault(part, {})
            target[path_[-1]] = value
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- TensorBoard


def test_validation_steps_are_global_step_at_each_validation_end(gpt_run: Run) -> None:
    assert [v["step"] for v in gpt_run.recorder.validations] == [TRAIN_BATCHES, 2 * TRAIN_BATCHES]
    assert gpt_run.trainer.global_step == 2 * TRAIN_BATCHES


def test_tensorboard_scalar_names_and_steps(gpt_run: Run) -> None:
    accumulator = read_tensorboard(gpt_run.tensorboard_dir)
    tags = {t for t in accumulator.Tags()["scalars"] if in_family(t)}
    assert tags == expected_names(lm.GPT_LAYERS, per_head=True)
    steps = [logged_step(v) for v in gpt_run.recorder.validations]
    assert [e.step for e in accumulator.Scalars("val_loss")] == steps  # the module's own metric
    for tag in tags:
        assert [e.step for e in accumulator.Scalars(tag)] == steps, tag


def test_tensorboard_values_match_reference(gpt_run: Run) -> None:
    accumulator = read_tensorboard(gpt_run.tensorboard_dir)
    for validation, samples in zip(gpt_run.recorder.validations, gpt_run.references, strict=True):
        check_against_reference(tb_scalars_at(accumulator, logged_step(validation)), samples)


def test_tensorboard_histograms_one_per_layer(gpt_run: Run) -> None:
    accumulator = read_tensorboard(gpt_run.tensorboard_dir)
    tags = {t for t in accumulator.Tags()["histograms"] if t.startswith(PREFIX + "/")}
    assert tags == {f"{PREFIX}/{layer}/hist" for layer in lm.GPT_LAYERS}
    for validation, samples in zip(gpt_run.recorder.validations, gpt_run.references, strict=True):
        for layer in lm.GPT_LAYERS:
            events = [e for e in accumulator.Histograms(f"{PREFIX}/{layer}/hist") if e.step == logged_step(validation)]
            assert len(events) == 1
            histogram = events[0].histogram_value
            values = samples[layer].normalized
            assert histogram.num == len(values)
            assert histogram.bucket_limit == pytest.approx([(i + 1) / 100 for i in range(100)])
            check_histogram(list(histogram.bucket), values)
            assert histogram.sum == pytest.approx(float(values.sum()), abs=1e-3)
            assert histogram.min <= float(values.min()) + 1e-5 and histogram.max >= float(values.max()) - 1e-5


def test_tensorboard_heatmap_image(gpt_run: Run) -> None:
    accumulator = read_tensorboard(gpt_run.tensorboard_dir)
    assert f"{PREFIX}/heatmap" in accumulator.Tags()["images"]
    events = accumulator.Images(f"{PREFIX}/heatmap")
    assert [e.step for e in events] == [logged_step(v) for v in gpt_run.recorder.validations]
    for event in events:
        assert event.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"
        assert event.width > 50 and event.height > 50


def test_only_the_first_batches_are_recorded(gpt_run: Run) -> None:
    """batches=2 (the default) of 3 validation batches: the summary counts exactly the first two."""
    summary = gpt_run.monitor.last_summary
    assert summary is not None
    assert summary.layers == lm.GPT_LAYERS
    assert int(summary.count.sum()) == count_queries(gpt_run.references[-1])
    all_three = gpt_reference(gpt_run.recorder.validations[-1]["state"], gpt_run.recorder.validations[-1]["batches"])
    assert int(summary.count.sum()) < count_queries(all_three)
    for index, layer in enumerate(lm.GPT_LAYERS):
        counts = summary.count[index]
        want = torch.bincount(gpt_run.references[-1][layer].head, minlength=lm.HEADS).double()
        assert torch.equal(counts, want), layer


# --------------------------------------------------------------------------- training-time recording


def test_train_every_n_steps_values_match_reference(gpt_run: Run) -> None:
    """The k-th logged ``attn_entropy_train`` entry is the batch recorded at the k-th multiple of n."""
    accumulator = read_tensorboard(gpt_run.tensorboard_dir)
    tags = {t for t in accumulator.Tags()["scalars"] if in_family(t, TRAIN_PREFIX)}
    assert tags == expected_names(lm.GPT_LAYERS, prefix=TRAIN_PREFIX, per_head=True)
    histograms = {t for t in accumulator.Tags()["histograms"] if t.startswith(TRAIN_PREFIX + "/")}
    assert histograms == {f"{TRAIN_PREFIX}/{layer}/hist" for layer in lm.GPT_LAYERS}
    assert [t["step"] for t in gpt_run.recorder.train] == [0, 3, 6]
    steps = [e.step for e in accumulator.Scalars(f"{TRAIN_PREFIX}/mean")]
    assert len(steps) == len(gpt_run.train_references) == 3
    for step, samples in zip(steps, gpt_run.train_references, strict=True):
        check_against_reference(tb_scalars_at(accumulator, step, TRAIN_PREFIX), samples, TRAIN_PREFIX)


def test_train_every_n_steps_logging_steps(gpt_run: Run) -> None:
    """Batches recorded at global steps 0, 3, 6 are logged at 0, 3, 6: the step of their own ``train_loss``."""
    _, rows = read_csv(gpt_run.csv_path)
    assert [int(r["step"]) for r in rows if r.get("train_loss")] == list(range(2 * TRAIN_BATCHES))
    entropy_steps = [int(r["step"]) for r in rows if r.get(f"{TRAIN_PREFIX}/mean")]
    assert entropy_steps == [t["step"] for t in gpt_run.recorder.train] == [0, 3, 6]
    accumulator = read_tensorboard(gpt_run.tensorboard_dir)
    for tag in expected_names(lm.GPT_LAYERS, prefix=TRAIN_PREFIX, per_head=True):
        assert [e.step for e in accumulator.Scalars(tag)] == [0, 3, 6], tag


# --------------------------------------------------------------------------- CSV and several loggers at once


def test_csv_logger_gets_the_scalars(gpt_run: Run) -> None:
    columns, rows = read_csv(gpt_run.csv_path)
    assert expected_names(lm.GPT_LAYERS, per_head=True) <= set(columns)
    assert not any(c.endswith("/hist") or c.endswith("/heatmap") for c in columns)
    accumulator = read_tensorboard(gpt_run.tensorboard_dir)
    for validation, samples in zip(gpt_run.recorder.validations, gpt_run.references, strict=True):
        matching = [r for r in rows if r.get(f"{PREFIX}/mean") and int(r["step"]) == logged_step(validation)]
        assert len(matching) == 1
        scalars = {name: float(matching[0][name]) for name in expected_names(lm.GPT_LAYERS, per_head=True)}
        check_against_reference(scalars, samples)
        tensorboard = tb_scalars_at(accumulator, logged_step(validation))
        assert scalars == pytest.approx(tensorboard, rel=1e-6, abs=1e-7)  # TB stores float32


# --------------------------------------------------------------------------- W&B offline


#: Per layer, what W&B gets of the heads over training.
HISTORY_VIEWS = ("over_training", "chart_table")


def test_wandb_offline_run_history(gpt_run: Run) -> None:
    pytest.importorskip("wandb")
    assert gpt_run.wandb_file is not None, f"no .wandb file under {gpt_run.root}"
    rows = read_wandb_history(gpt_run.wandb_file)
    steps = [logged_step(v) for v in gpt_run.recorder.validations]
    scalar_names = expected_names(lm.GPT_LAYERS, per_head=True)
    hist_names = {f"{PREFIX}/{layer}/hist" for layer in lm.GPT_LAYERS}

    # Every entropy row carries Lightning's step axis, and it is the global step of a validation run.
    entropy_rows = [r for r in rows if any(in_family(k) for k in r)]
    assert entropy_rows
    assert {r["trainer/global_step"] for r in entropy_rows} == set(steps)

    run_dir = Path(gpt_run.wandb_file).parent
    for validation, samples in zip(gpt_run.recorder.validations, gpt_run.references, strict=True):
        at_step = [r for r in entropy_rows if r["trainer/global_step"] == logged_step(validation)]
        merged: dict[str, Any] = {}
        for row in at_step:
            assert not (set(row) & set(merged)) - {"trainer/global_step", "_step", "_runtime", "_timestamp"}
            merged.update(row)
        names = {k for k in merged if in_family(k)}
        # The heads over training and the digest: at every validation, so a live or crashed run has them.
        history = {f"{PREFIX}_heads/{layer}/{view}" for layer in lm.GPT_LAYERS for view in HISTORY_VIEWS}
        assert names == scalar_names | hist_names | {f"{PREFIX}/heatmap", f"{PREFIX}/digest"} | history
        check_against_reference({k: merged[k] for k in scalar_names}, samples)
        for layer in lm.GPT_LAYERS:
            histogram = merged[f"{PREFIX}/{layer}/hist"]
            assert histogram["_type"] == "histogram"
            assert histogram["bins"] == pytest.approx([i / 100 for i in range(101)])
            check_histogram(histogram["values"], samples[layer].normalized)
        image = merged[f"{PREFIX}/heatmap"]
        assert image["_type"] == "image-file"
        assert (run_dir / "files" / image["path"]).is_file()
    # The training-time entries share the axis too.
    train_steps = sorted({r["trainer/global_step"] for r in rows if f"{TRAIN_PREFIX}/mean" in r})
    assert len(train_steps) == len(gpt_run.recorder.train)


def test_wandb_too_many_bins_raises_at_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    model = lm.TinyGPT()
    hooks = total_hooks(model)
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="attn-monitor-tests", settings=wandb_settings())
    trainer = make_trainer(
        tmp_path, loggers=[logger], callbacks=[AttentionEntropyMonitor(log=LogOptions(histogram_bins=1000))]
    )
    try:
        with pytest.raises(ValueError, match="histogram_bins"):
            trainer.fit(model, lm.loader(lm.make_batches(1, seed=0)), lm.loader(lm.make_batches(1, seed=1)))
    finally:
        wandb.finish()
    assert total_hooks(model) == hooks


# --------------------------------------------------------------------------- Hugging Face


def test_hf_model_logged_values_match_eager_reference(hf_run: Run) -> None:
    accumulator = read_tensorboard(hf_run.tensorboard_dir)
    tags = {t for t in accumulator.Tags()["scalars"] if in_family(t)}
    assert tags == expected_names(lm.HF_LAYERS)
    assert {t for t in accumulator.Tags()["histograms"] if t.startswith(PREFIX)} == {
        f"{PREFIX}/{layer}/hist" for layer in lm.HF_LAYERS
    }
    steps = [v["step"] for v in hf_run.recorder.validations]
    assert steps == [2, 4]
    assert [e.step for e in accumulator.Images(f"{PREFIX}/heatmap")] == [step - 1 for step in steps]
    for validation, samples in zip(hf_run.recorder.validations, hf_run.references, strict=True):
        check_against_reference(tb_scalars_at(accumulator, logged_step(validation)), samples)
    summary = hf_run.monitor.last_summary
    assert summary is not None and int(summary.count.sum()) == count_queries(hf_run.references[-1])


def test_hf_eager_model_inside_lightning_module_is_monitored(tmp_path: Path) -> None:
    """BUG: an HF model running eager attention, wrapped in a LightningModule, is not monitored by default.

    AttentionCapture gives HF eager attention its ``probabilities_at(1)``
    adapter only when the *root* module has ``config._attn_implementation ==
    "eager"``; the monitor watches the LightningModule, which has no config,
    so nothing is captured and the run only warns "captured no attention call".
    """
    pytest.importorskip("transformers")
    monitor = AttentionEntropyMonitor(batches=2, log=LogOptions(histogram_bins=None, heatmap=False))
    model = lm.HFLM(implementation="eager", lr=0.0)
    val = lm.make_batches(2, seed=4)
    trainer = make_trainer(tmp_path, callbacks=[monitor], max_epochs=1, limit_train_batches=1)
    trainer.fit(model, lm.loader(lm.make_batches(1, seed=3)), lm.loader(val))
    assert monitor.last_summary is not None, "nothing was captured from the eager HF model"
    assert monitor.last_summary.layers == lm.HF_LAYERS
    samples = hf_reference(model.state_dict(), val)
    check_against_reference(monitor.core.options.scalars(monitor.last_summary), samples)


def test_hf_eager_model_with_module_option(tmp_path: Path) -> None:
    """``module=`` points the monitor at the HF model itself: eager attention is then found, names relative to it."""
    pytest.importorskip("transformers")
    monitor = AttentionEntropyMonitor(
        batches=2, log=LogOptions(histogram_bins=None, heatmap=False), module=lambda m: m.model
    )
    model = lm.HFLM(implementation="eager", lr=0.0)
    val = lm.make_batches(2, seed=4)
    trainer = make_trainer(tmp_path, callbacks=[monitor], max_epochs=1, limit_train_batches=1)
    trainer.fit(model, lm.loader(lm.make_batches(1, seed=3)), lm.loader(val))
    summary = monitor.last_summary
    assert summary is not None
    names = [name.removeprefix("model.") for name in lm.HF_LAYERS]
    assert summary.layers == names
    samples = hf_reference(model.state_dict(), val)
    check_against_reference(monitor.core.options.scalars(summary), {n: samples[f"model.{n}"] for n in names})


# --------------------------------------------------------------------------- which batches


def _fit_memory(
    root: Path,
    monitor: AttentionEntropyMonitor,
    *,
    val_batches: int = 6,
    lr: float = 0.0,
    extra_callbacks: tuple[pl.Callback, ...] | list[pl.Callback] = (),
    **kwargs: Any,
) -> tuple[lm.MemoryLogger, pl.Trainer, lm.TinyGPT, list[dict[str, Tensor]]]:
    """Fit TinyGPT on 2 training batches per epoch with a MemoryLogger (lr 0 by default: weights stay initial)."""
    logger = lm.MemoryLogger()
    model = lm.TinyGPT(lr=lr)
    val = lm.make_batches(val_batches, seed=11)
    options = {"limit_train_batches": 2, **kwargs}
    trainer = make_trainer(root, loggers=[logger], callbacks=[monitor, *extra_callbacks], **options)
    trainer.fit(model, lm.loader(lm.make_batches(2, seed=10)), lm.loader(val))
    return logger, trainer, model, val


def _layer_means(logger: lm.MemoryLogger) -> list[list[float]]:
    """Per logged validation run: the per-layer means."""
    return [
        [m[f"{PREFIX}/{layer}/mean"] for layer in lm.GPT_LAYERS] for _, m in logger.records if f"{PREFIX}/mean" in m
    ]


def _reference_means(model: lm.TinyGPT, batches: list[dict[str, Tensor]]) -> list[float]:
    samples = gpt_reference(model.state_dict(), batches)
    return [float(samples[layer].normalized.mean()) for layer in lm.GPT_LAYERS]


def test_explicit_batch_indices(tmp_path: Path) -> None:
    monitor = AttentionEntropyMonitor(batches=[4, 1], log=LogOptions(histogram_bins=None, heatmap=False))
    logger, _, model, val = _fit_memory(tmp_path, monitor, max_epochs=1)
    assert monitor.sampled_indices(len(val)) == (1, 4)
    chosen = [val[1], val[4]]
    means = _layer_means(logger)
    assert len(means) == 1
    assert means[0] == pytest.approx(_reference_means(model, chosen), abs=MEAN_TOL)
    summary = monitor.last_summary
    assert summary is not None
    assert int(summary.count.sum()) == count_queries(gpt_reference(model.state_dict(), chosen))


def test_trainer_validate_under_inference_mode(tmp_path: Path) -> None:
    """``trainer.validate`` runs under torch.inference_mode (fit's validation under no_grad): same numbers."""
    monitor = AttentionEntropyMonitor(batches=2, log=LogOptions(histogram_bins=None, heatmap=False))
    logger = lm.MemoryLogger()
    model, val = lm.TinyGPT(), lm.make_batches(3, seed=12)
    trainer = make_trainer(tmp_path, loggers=[logger], callbacks=[monitor])
    assert trainer.validate_loop.inference_mode
    trainer.validate(model, lm.loader(val))
    assert _layer_means(logger) == [pytest.approx(_reference_means(model, val[:2]), abs=MEAN_TOL)]
    summary = monitor.last_summary
    assert summary is not None
    assert int(summary.count.sum()) == count_queries(gpt_reference(model.state_dict(), val[:2]))


def test_sanity_check_sets_no_alert_baseline_and_stops_nothing(tmp_path: Path) -> None:
    """The sanity check is recorded when asked for, but it is no monitored epoch for the alerts."""
    monitor = AttentionEntropyMonitor(
        batches=Batches(1, skip_sanity_check=False),
        log=LogOptions(histogram_bins=None),
        alerts=[CollapseAlert(threshold=1.0, stop=True)],
    )
    trainer = make_trainer(
        tmp_path, loggers=[lm.MemoryLogger()], callbacks=[monitor], max_epochs=1, num_sanity_val_steps=1
    )
    trainer.fit(lm.TinyGPT(), lm.loader(lm.make_batches(2, seed=1)), lm.loader(lm.make_batches(2, seed=2)))
    assert trainer.global_step == 2  # the first epoch trained; the collapse flagged after it stops the run
    summary = monitor.last_summary
    assert summary is not None and torch.equal(monitor.core.alerts[0].baselines[0], summary.quantile(0.5))


def _draw(seed: int, population: int, count: int) -> tuple[int, ...]:
    """The documented draw, computed here: ``random.Random(seed + dataloader_idx)``, dataloader 0."""
    return tuple(sorted(random.Random(seed).sample(range(population), count)))


def test_random_sample_same_indices_every_epoch_and_after_reload(tmp_path: Path) -> None:
    # A seed whose draw is neither the first batches nor the draw of seed 0, so that a draw
    # ignoring `seed` (or not drawing at all) records other batches and logs other means.
    seed = next(s for s in range(1, 100) if _draw(s, 6, 2) not in {(0, 1), _draw(0, 6, 2)})
    indices = _draw(seed, 6, 2)
    monitor = AttentionEntropyMonitor(
        batches=Batches(2, random_sample=True, seed=seed), log=LogOptions(histogram_bins=None, heatmap=False)
    )
    logger, trainer, model, val = _fit_memory(tmp_path, monitor, max_epochs=2, enable_checkpointing=True)
    want = _reference_means(model, [val[i] for i in indices])
    assert want != pytest.approx(_reference_means(model, [val[i] for i in _draw(0, 6, 2)]), abs=MEAN_TOL)
    means = _layer_means(logger)
    assert len(means) == 2
    for epoch_means in means:  # the same draw in both epochs
        assert epoch_means == pytest.approx(want, abs=MEAN_TOL)
    summary = monitor.last_summary
    assert summary is not None
    assert int(summary.count.sum()) == count_queries(gpt_reference(model.state_dict(), [val[i] for i in indices]))

    # state_dict round trip: a monitor with another seed that loads the state uses the same batches.
    other = AttentionEntropyMonitor(batches=Batches(2, random_sample=True, seed=seed + 1))
    other.load_state_dict(copy.deepcopy(monitor.state_dict()))
    assert other.sampled_indices(len(val)) == indices

    # ... and through a Lightning checkpoint: resume for one more epoch with a differently seeded monitor.
    checkpoint = tmp_path / "resume.ckpt"
    trainer.save_checkpoint(checkpoint)
    resumed = AttentionEntropyMonitor(
        batches=Batches(2, random_sample=True, seed=seed + 7), log=LogOptions(histogram_bins=None, heatmap=False)
    )
    logger2 = lm.MemoryLogger()
    trainer2 = make_trainer(tmp_path, loggers=[logger2], callbacks=[resumed], max_epochs=3, limit_train_batches=2)
    trainer2.fit(lm.TinyGPT(lr=0.0), lm.loader(lm.make_batches(2, seed=10)), lm.loader(val), ckpt_path=str(checkpoint))
    resumed_means = _layer_means(logger2)
    assert len(resumed_means) == 1
    assert resumed_means[0] == pytest.approx(want, abs=MEAN_TOL)


def test_every_n_epochs_counts_epochs_as_lightning_does(tmp_path: Path) -> None:
    """every_n_epochs=2 monitors epochs 1, 3, ...: those ``ModelCheckpoint(every_n_epochs=2)`` saves at."""
    monitor = AttentionEntropyMonitor(
        batches=Batches(every_n_epochs=2), log=LogOptions(histogram_bins=None, heatmap=False)
    )
    recorder = lm.BatchRecorder()
    logger, trainer, _, _ = _fit_memory(tmp_path, monitor, max_epochs=4, val_batches=2, extra_callbacks=[recorder])
    # 2 training batches per epoch: validation ends at global steps 2 (epoch 0), 4 (epoch 1), 6 (epoch 2), 8.
    assert [(v["epoch"], v["step"]) for v in recorder.validations] == [(0, 2), (1, 4), (2, 6), (3, 8)]
    assert logger.steps_of(f"{PREFIX}/mean") == [3, 7]  # Lightning's step: one less than global_step
    assert trainer.current_epoch == 4


@pytest.mark.parametrize("skip", [True, False], ids=["skip_sanity", "monitor_sanity"])
def test_sanity_check(tmp_path: Path, skip: bool) -> None:
    kwargs: dict[str, Any] = {} if skip else {"batches": Batches(skip_sanity_check=False)}
    monitor = AttentionEntropyMonitor(log=LogOptions(histogram_bins=None, heatmap=False), **kwargs)
    logger, _, model, val = _fit_memory(tmp_path, monitor, max_epochs=1, val_batches=3, num_sanity_val_steps=2)
    steps = logger.steps_of(f"{PREFIX}/mean")
    assert steps == ([1] if skip else [0, 1])
    want = _reference_means(model, val[:2])
    for means in _layer_means(logger):
        assert means == pytest.approx(want, abs=MEAN_TOL)


def test_train_every_n_steps_with_gradient_accumulation(tmp_path: Path) -> None:
    """BUG: with accumulate_grad_batches=2, train_every_n_steps=2 logs at every optimizer step.

    8 batches make 4 optimizer steps (global steps 0-3); steps 0 and 2 are
    recorded, so 2 entries are expected. ``on_train_batch_start`` tests
    ``global_step % n`` per *batch*, and global_step only moves once per
    accumulation window, so both micro-batches of steps 0 and 2 are recorded
    and logged separately: 4 entries, at steps 0, 1, 2, 3.
    """
    monitor = AttentionEntropyMonitor(
        batches=Batches(0, train_every_n_steps=2), log=LogOptions(histogram_bins=None, heatmap=False)
    )
    logger = lm.MemoryLogger()
    trainer = make_trainer(tmp_path, loggers=[logger], callbacks=[monitor], max_epochs=1, accumulate_grad_batches=2)
    trainer.fit(lm.TinyGPT(), lm.loader(lm.make_batches(8, seed=0)), lm.loader(lm.make_batches(1, seed=1)))
    assert trainer.global_step == 4
    steps = logger.steps_of(f"{TRAIN_PREFIX}/mean")
    assert len(steps) == 2, f"expected one entry per recorded optimizer step (global steps 0 and 2), got steps {steps}"


def test_no_sampled_batch_reached_does_not_claim_attention_is_invisible(tmp_path: Path) -> None:
    """BUG: sampled indices past the end of the validation data give a misleading warning.

    With ``batches=[10]`` and 3 validation batches nothing is monitored (right),
    but ``_collect`` warns "captured no attention call ... Fused kernels ...
    cannot be seen", because it tests ``capture.num_calls == 0``, which is
    also 0 when no batch was recorded at all. The model's SDPA attention is
    perfectly visible.
    """
    monitor = AttentionEntropyMonitor(batches=[10], log=LogOptions(histogram_bins=None, heatmap=False))
    logger = lm.MemoryLogger()
    trainer = make_trainer(tmp_path, loggers=[logger], callbacks=[monitor], max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lm.TinyGPT(), lm.loader(lm.make_batches(1, seed=0)), lm.loader(lm.make_batches(3, seed=1)))
    assert logger.steps_of(f"{PREFIX}/mean") == []
    messages = [str(w.message) for w in caught if "captured no attention call" in str(w.message)]
    assert messages == [], messages[0][:200]


# --------------------------------------------------------------------------- configuration errors


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batches": -1}, ValueError, "batches"),
        ({"batches": [0, -2]}, ValueError, "batches"),
        ({"batches": "2"}, TypeError, "batches"),
        ({"padding_mask": "attention_mask"}, TypeError, "padding_mask"),
        ({"layers": "blocks.*"}, TypeError, "layers"),
        ({"log": {"prefix": "attn"}}, TypeError, "`log` to be a LogOptions"),
        ({"statistics": True}, TypeError, "`statistics` to be a Statistics"),
        ({"alerts": [0.1]}, TypeError, "entry of `alerts`"),
        ({"alerts": [CollapseAlert(0.1), CollapseAlert(drop=0.5)]}, ValueError, "two CollapseAlerts"),
        ({"alerts": [CollapseAlert()]}, ValueError, "nothing to check"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else None,
)
def test_bad_configuration_raises_at_construction(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        AttentionEntropyMonitor(**kwargs)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: Batches(every_n_epochs=0), ValueError, "every_n_epochs"),
        (lambda: Batches(train_every_n_steps=0), ValueError, "train_every_n_steps"),
        (lambda: Batches([1, 2], random_sample=True), ValueError, "random_sample"),
        (lambda: Batches(seed=-1), ValueError, "seed"),
        (lambda: LogOptions(quantiles=(0.5, 1.5)), ValueError, "quantile"),
        (lambda: LogOptions(quantiles=(-0.1,)), ValueError, "quantile"),
        (lambda: LogOptions(histogram_bins=0), ValueError, "histogram_bins"),
        (lambda: LogOptions(prefix="attn/"), ValueError, "prefix"),
        (lambda: CollapseAlert(threshold=1.5), ValueError, "`threshold` of CollapseAlert"),
    ],
    ids=["every_n_epochs", "train_every_n_steps", "random_sample", "seed", "quantile", "negative_quantile",
         "histogram_bins", "prefix", "collapse_threshold"],
)  # fmt: skip
def test_bad_options_raise_at_construction(make: Callable[[], object], error: type, match: str) -> None:
    """Each option object checks its own fields, eagerly, naming the field."""
    with pytest.raises(error, match=match):
        make()


def test_layer_pattern_matching_nothing_raises_during_fit(tmp_path: Path) -> None:
    monitor = AttentionEntropyMonitor(layers=["blocks.*.attn", "decoder.*"])  # fine until setup
    model = lm.TinyGPT()
    hooks = total_hooks(model)
    trainer = make_trainer(tmp_path, callbacks=[monitor])
    with pytest.raises(ValueError, match=r"decoder\.\*"):
        trainer.fit(model, lm.loader(lm.make_batches(1, seed=0)), lm.loader(lm.make_batches(1, seed=1)))
    assert total_hooks(model) == hooks
    assert function_modes() == []


# --------------------------------------------------------------------------- clean-up after exceptions


@pytest.mark.parametrize("where", ["validation", "training"])
def test_exception_in_monitored_batch_leaves_nothing_behind(tmp_path: Path, where: str) -> None:
    model = lm.TinyGPT()
    if where == "validation":
        model.fail_on_val_batch = 0
        monitor = AttentionEntropyMonitor()
    else:
        model.fail_on_train_batch = 1
        monitor = AttentionEntropyMonitor(batches=Batches(train_every_n_steps=1))
    hooks, modes = total_hooks(model), function_modes()
    assert modes == []
    inside: dict[str, int] = {}

    class Spy(pl.Callback):  # sees the state while the monitor is attached (and recording)
        def on_validation_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            inside["hooks"], inside["modes"] = total_hooks(pl_module), len(function_modes())

        def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            inside["hooks"], inside["modes"] = total_hooks(pl_module), len(function_modes())

    trainer = make_trainer(tmp_path, callbacks=[monitor, Spy()])
    with pytest.raises(RuntimeError, match="failed on purpose"):
        trainer.fit(model, lm.loader(lm.make_batches(2, seed=0)), lm.loader(lm.make_batches(2, seed=1)))
    assert inside["hooks"] > hooks and inside["modes"] == 1  # the test saw the capture at work
    assert total_hooks(model) == hooks
    assert function_modes() == []
    assert monitor.capture is None
    # The model runs normally afterwards and nothing records.
    with torch.no_grad():
        model(**lm.make_batches(1, seed=2)[0])
    assert function_modes() == []


# --------------------------------------------------------------------------- DDP


def test_ddp_two_processes_equal_reference_on_union(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 CPU processes (gloo, ``ddp_fork``), batches=2 per rank; rank 0 logs the union of what both ranks saw.

    Lightning gives each rank a DistributedSampler over the validation
    "batches" (dataset items, ``batch_size=None``): without shuffling rank r
    gets items r, r + 2, ..., so with ``batches=2`` rank 0 monitors items 0 and
    2 and rank 1 items 1 and 3: the union is items 0-3, i.e. what one process
    with ``batches=4`` monitors. lr is 0, so the weights are the initial ones
    in every run.
    """
    if not torch.distributed.is_available() or "fork" not in torch.multiprocessing.get_all_start_methods():
        pytest.skip("needs torch.distributed and the fork start method")
    # Lightning's launcher writes MASTER_PORT into this process's environment: set it here so it is restored.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(sock.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    val = lm.make_batches(8, seed=21)
    train = lm.make_batches(4, seed=20)
    model = lm.TinyGPT(lr=0.0, seed=5)
    state = copy.deepcopy(model.state_dict())

    monitor = AttentionEntropyMonitor(batches=2, log=LogOptions(heatmap=False, per_head=True), save_summaries=True)
    logger = CSVLogger(tmp_path, name="ddp")
    trainer = make_trainer(
        tmp_path,
        loggers=[logger],
        callbacks=[monitor, lm.WarningsToFile(str(tmp_path))],
        devices=2,
        strategy="ddp_fork",
        max_epochs=1,
    )
    trainer.fit(model, lm.loader(train), lm.loader(val))
    # The parent's logger object never wrote (rank 0 in the child did), so find the file rather than ask it.
    (path,) = glob.glob(str(tmp_path / "ddp" / "version_*" / "metrics.csv"))
    _, rows = read_csv(path)
    logged = [r for r in rows if r.get(f"{PREFIX}/mean")]
    assert len(logged) == 1
    assert int(logged[0]["step"]) == 1  # 4 training items over 2 ranks: 2 steps, logged at the last one's
    scalars = {name: float(logged[0][name]) for name in expected_names(lm.GPT_LAYERS, per_head=True)}
    union = gpt_reference(state, val[:4])
    check_against_reference(scalars, union)
    # The saved summary (trainer.log_dir is a collective: every rank must ask for it) is the union's too.
    (saved,) = glob.glob(str(tmp_path / "ddp" / "version_*" / "attn_entropy" / "*.pt"))
    saved_scalars = load_summary(saved).to_dict()
    assert {f"{PREFIX}/{layer}/mean" for layer in lm.GPT_LAYERS} <= set(saved_scalars)
    for name in set(saved_scalars) & set(scalars):
        assert saved_scalars[name] == pytest.approx(scalars[name], abs=1e-6), name
    # Lightning hands rank 0's callback_metrics back: every per-layer statistic, as logged.
    for name in expected_names(lm.GPT_LAYERS):
        assert float(trainer.callback_metrics[name]) == pytest.approx(scalars[name], abs=1e-6), name
    # Lightning's sync_dist advice: still given for the module's own val_loss, never for the monitor's means.
    advice = (tmp_path / "warnings_rank0.txt").read_text().splitlines()
    advice = [line for line in advice if line.startswith("It is recommended to use `self.log(")]
    assert [line for line in advice if "'val_loss'" in line], advice
    assert not [line for line in advice if PREFIX in line], advice
    # Not just one rank's share: rank 0's own batches give other means.
    rank0 = gpt_reference(state, [val[0], val[2]])
    assert any(
        abs(scalars[f"{PREFIX}/{layer}/mean"] - float(rank0[layer].normalized.mean())) > 1e-3 for layer in lm.GPT_LAYERS
    )

    # One process with batches=4 over the same data logs the same numbers (histograms are exact sums).
    single_logger = lm.MemoryLogger()
    single = make_trainer(
        tmp_path,
        loggers=[single_logger],
        callbacks=[AttentionEntropyMonitor(batches=4, log=LogOptions(heatmap=False, per_head=True))],
        max_epochs=1,
    )
    single_model = lm.TinyGPT(lr=0.0, seed=5)
    single.fit(single_model, lm.loader(train), lm.loader(val))
    ((_, single_scalars),) = [(s, m) for s, m in single_logger.merged_records() if f"{PREFIX}/mean" in m]
    for name, value in scalars.items():
        assert value == pytest.approx(single_scalars[name], abs=1e-9), name


# --------------------------------------------------------------------------- two monitors, several dataloaders


def test_two_monitors_in_one_trainer_fit_save_and_resume(tmp_path: Path) -> None:
    """One monitor per layer under its own prefix; each keeps its own checkpoint state through a resume."""
    val = lm.make_batches(6, seed=11)
    seeds = {"attn_a": 3, "attn_b": 4}  # different draws, so a mixed-up state shows

    def monitors(seed_offset: int) -> list[AttentionEntropyMonitor]:
        return [
            AttentionEntropyMonitor(
                batches=Batches(2, random_sample=True, seed=seeds[prefix] + seed_offset),
                log=LogOptions(prefix=prefix, histogram_bins=None, heatmap=False),
                layers=[layer],
            )
            for prefix, layer in zip(seeds, lm.GPT_LAYERS, strict=True)
        ]

    draws = {prefix: _draw(seed, len(val), 2) for prefix, seed in seeds.items()}
    assert draws["attn_a"] != draws["attn_b"]
    first = monitors(0)
    assert first[0].state_key != first[1].state_key
    logger, trainer, model, _ = _fit_memory(tmp_path, first[0], extra_callbacks=[first[1]], max_epochs=1)

    def check(records: list[tuple[int | None, dict[str, float]]]) -> None:
        for (prefix, indices), layer in zip(draws.items(), lm.GPT_LAYERS, strict=True):
            logged = [m for _, m in records if f"{prefix}/mean" in m]
            assert len(logged) == 1, prefix
            assert {name.split("/")[1] for name in logged[0] if name.startswith(prefix)} <= {layer, "mean"}
            samples = gpt_reference(model.state_dict(), [val[i] for i in indices])[layer]
            assert logged[0][f"{prefix}/{layer}/mean"] == pytest.approx(float(samples.normalized.mean()), abs=MEAN_TOL)

    check(logger.records)
    checkpoint = tmp_path / "two.ckpt"
    trainer.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=False)["callbacks"]
    assert {first[0].state_key, first[1].state_key} <= set(saved)

    resumed = monitors(50)  # other seeds: only the loaded states can give the saved draws
    logger2 = lm.MemoryLogger()
    trainer2 = make_trainer(tmp_path, loggers=[logger2], callbacks=resumed, max_epochs=2, limit_train_batches=2)
    trainer2.fit(lm.TinyGPT(lr=0.0), lm.loader(lm.make_batches(2, seed=10)), lm.loader(val), ckpt_path=str(checkpoint))
    check(logger2.records)
    # The same prefix twice would write the same names and states: Lightning refuses it, naming state_key.
    with pytest.raises(RuntimeError, match="state_key"):
        make_trainer(tmp_path, callbacks=[AttentionEntropyMonitor(), AttentionEntropyMonitor()])


def test_two_validation_dataloaders_are_kept_apart(tmp_path: Path) -> None:
    """Every logged name ends in /dataloader_idx_{i}; each value is its own loader's reference."""
    in_domain = lm.make_batches(2, seed=11)
    # Other domain: full-length rows of a few repeated tokens (different attention from the random ids).
    out_domain = [
        {
            "input_ids": (torch.arange(lm.SEQ) % 3 + 1).repeat(lm.BATCH, 1),
            "attention_mask": torch.ones(lm.BATCH, lm.SEQ),
        }
        for _ in range(2)
    ]
    monitor = AttentionEntropyMonitor(batches=2)
    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    model = lm.TinyGPT(lr=0.0)
    with torch.no_grad():  # larger logits: spread attention that depends on the input
        for block in model.blocks:
            block.attn.c_attn.weight.mul_(3.0)
    trainer = make_trainer(tmp_path, loggers=[tensorboard], callbacks=[monitor], max_epochs=1, limit_train_batches=1)
    trainer.fit(model, lm.loader(lm.make_batches(1, seed=10)), [lm.loader(in_domain), lm.loader(out_domain)])

    accumulator = read_tensorboard(tensorboard.log_dir)
    scalars = {t for t in accumulator.Tags()["scalars"] if in_family(t)}
    want = {f"{name}/dataloader_idx_{i}" for name in expected_names(lm.GPT_LAYERS) for i in (0, 1)}
    assert scalars == want
    assert {t for t in accumulator.Tags()["histograms"] if t.startswith(PREFIX)} == {
        f"{PREFIX}/{layer}/hist/dataloader_idx_{i}" for layer in lm.GPT_LAYERS for i in (0, 1)
    }
    assert set(accumulator.Tags()["images"]) == {
        f"{family}/dataloader_idx_{i}"
        for family in [f"{PREFIX}/heatmap", *(f"{PREFIX}_heads/{layer}/over_training" for layer in lm.GPT_LAYERS)]
        for i in (0, 1)
    }
    references = [gpt_reference(model.state_dict(), batches) for batches in (in_domain, out_domain)]
    for index, samples in enumerate(references):
        logged = {
            name.removesuffix(f"/dataloader_idx_{index}"): accumulator.Scalars(name)[0].value
            for name in scalars
            if name.endswith(f"/dataloader_idx_{index}")
        }
        check_against_reference(logged, samples)
    layer_means = [[float(samples[layer].normalized.mean()) for layer in lm.GPT_LAYERS] for samples in references]
    gap = max(abs(a - b) for a, b in zip(*layer_means, strict=True))
    assert gap > 0.03, "the two loaders must differ in attention for this test to mean anything"
    assert set(monitor.last_summaries) == {0, 1}


# --------------------------------------------------------------------------- a diverging model


def test_nan_in_validation_warns_once_per_layer_and_training_goes_on(tmp_path: Path) -> None:
    """Validation batch 1 of 2 turns every activation into NaN: the monitor skips and reports it, never raises."""
    monitor = AttentionEntropyMonitor(batches=2, log=LogOptions(histogram_bins=None, heatmap=False))
    model = lm.TinyGPT(lr=0.0)
    model.nan_on_val_batch = 1
    val = lm.make_batches(2, seed=11)
    logger = lm.MemoryLogger()
    trainer = make_trainer(tmp_path, loggers=[logger], callbacks=[monitor], max_epochs=2, limit_train_batches=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, lm.loader(lm.make_batches(1, seed=10)), lm.loader(val))
    assert trainer.current_epoch == 2 and trainer.global_step == 2  # both epochs ran
    reports = [str(w.message) for w in caught if "NaN or inf" in str(w.message)]
    real_queries = int(val[1]["attention_mask"].sum()) * lm.HEADS
    assert sorted(reports) == sorted(
        f"attn_monitor: {layer!r}: {real_queries} queries met NaN or inf in their queries, keys or "
        "attention weights (a diverging model?); they are left out of the entropy statistics, counted "
        "in `nonfinite`, and training goes on."
        for layer in lm.GPT_LAYERS
    )
    # What is logged is the finite batch alone, both epochs.
    want = _reference_means(model, val[:1])
    assert _layer_means(logger) == [pytest.approx(want, abs=MEAN_TOL)] * 2
    summary = monitor.last_summary
    assert summary is not None
    assert int(summary.count.sum()) == count_queries(gpt_reference(model.state_dict(), val[:1]))
    # ... and the NaN batch's counted queries are logged as nonfinite, per layer and epoch.
    per_layer = {layer: len(s.normalized) for layer, s in gpt_reference(model.state_dict(), val[1:]).items()}
    logged = [
        {layer: m[f"{PREFIX}/{layer}/nonfinite"] for layer in lm.GPT_LAYERS}
        for _, m in logger.merged_records()
        if f"{PREFIX}/mean" in m
    ]
    assert logged == [per_layer] * 2


# --------------------------------------------------------------------------- memory


def test_memory_stays_flat_over_100_validation_epochs(tmp_path: Path) -> None:
    """Live tensors and Python objects after validation epoch 10 and epoch 100 are the same."""
    import gc

    counts: dict[int, tuple[int, int]] = {}

    class Probe(pl.Callback):  # runs after the monitor's epoch end (callback order)
        def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.current_epoch in (9, 99):
                gc.collect()
                objects = gc.get_objects()
                counts[trainer.current_epoch] = (sum(isinstance(o, Tensor) for o in objects), len(objects))

    class LastRecord(lm.MemoryLogger):  # keeps one record, so the logger itself does not grow
        def log_metrics(self, metrics: Any, step: int | None = None) -> None:
            self.records[:] = [(step, dict(metrics))]

    monitor = AttentionEntropyMonitor(
        batches=Batches(1, train_every_n_steps=1), log=LogOptions(histogram_bins=None, heatmap=False)
    )
    trainer = make_trainer(
        tmp_path,
        loggers=[LastRecord()],
        callbacks=[monitor, Probe()],
        max_epochs=100,
        limit_train_batches=1,
        limit_val_batches=1,
    )
    trainer.fit(lm.TinyGPT(lr=0.0), lm.loader(lm.make_batches(1, seed=0)), lm.loader(lm.make_batches(1, seed=1)))
    assert monitor.last_summary is not None
    tensors_10, objects_10 = counts[9]
    tensors_100, objects_100 = counts[99]
    assert tensors_100 <= tensors_10, counts  # fewer is fine (caches settle); one more per epoch is not
    assert objects_100 - objects_10 < 500, counts  # no growth per epoch (90 epochs in between)


# --------------------------------------------------------------------------- real runs: gradient checkpointing


def test_gradient_checkpointing_records_each_training_query_once(tmp_path: Path) -> None:
    """HF GPT-2 with ``gradient_checkpointing_enable()``: backward() reruns every layer's forward.

    A training record covers the forward pass only, so the training
    histogram of each recorded step holds the batch's counted queries once
    (it held each twice while the recording stayed open through backward()).
    Read back from TensorBoard; values against the eager float64 reference.
    """
    pytest.importorskip("transformers")
    model = lm.HFLM(lr=0.0, gradient_checkpointing=True)
    assert model.model.is_gradient_checkpointing
    recorder = lm.BatchRecorder(train_every=1)
    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    monitor = AttentionEntropyMonitor(batches=Batches(0, train_every_n_steps=1))
    trainer = make_trainer(tmp_path, loggers=[tensorboard], callbacks=[monitor, recorder], max_epochs=1)
    trainer.fit(model, lm.loader(lm.make_batches(2, seed=3)), lm.loader(lm.make_batches(1, seed=4)))
    accumulator = read_tensorboard(tensorboard.log_dir)
    assert [t["step"] for t in recorder.train] == [0, 1]
    for entry in recorder.train:
        samples = hf_reference(entry["state"], [entry["batch"]])
        check_against_reference(tb_scalars_at(accumulator, entry["step"], TRAIN_PREFIX), samples, TRAIN_PREFIX)
        for layer in lm.HF_LAYERS:
            (event,) = [e for e in accumulator.Histograms(f"{TRAIN_PREFIX}/{layer}/hist") if e.step == entry["step"]]
            assert event.histogram_value.num == len(samples[layer].normalized), layer


# --------------------------------------------------------------------------- real runs: validation cadences


def test_every_n_epochs_meets_check_val_every_n_epoch(tmp_path: Path) -> None:
    """``every_n_epochs=2``, ``check_val_every_n_epoch=2``: Lightning validates at epochs 1 and 3, both monitored."""
    monitor = AttentionEntropyMonitor(
        batches=Batches(every_n_epochs=2), log=LogOptions(histogram_bins=None, heatmap=False)
    )
    recorder = lm.BatchRecorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger, _, _, _ = _fit_memory(
            tmp_path, monitor, lr=0.05, max_epochs=4, check_val_every_n_epoch=2, extra_callbacks=[recorder]
        )
    assert [v["epoch"] for v in recorder.validations] == [1, 3]
    logged = [m for _, m in logger.merged_records() if f"{PREFIX}/mean" in m]
    assert len(logged) == 2
    for metrics, validation in zip(logged, recorder.validations, strict=True):
        check_against_reference(metrics, gpt_reference(validation["state"], validation["batches"][:2]))
    assert not [w for w in caught if "none was monitored" in str(w.message)]


@pytest.mark.parametrize(
    ("kwargs", "fit_kwargs", "named"),
    [
        ({"batches": Batches(every_n_epochs=3)}, {"check_val_every_n_epoch": 2}, "`every_n_epochs=3`"),
        ({"batches": [10]}, {}, "`batches=(10,)`"),
    ],
    ids=["cadence", "batches_not_reached"],
)
def test_validations_none_monitored_warn_once_at_fit_end(
    tmp_path: Path, kwargs: dict[str, Any], fit_kwargs: dict[str, Any], named: str
) -> None:
    monitor = AttentionEntropyMonitor(log=LogOptions(histogram_bins=None, heatmap=False), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger, _, _, _ = _fit_memory(tmp_path, monitor, max_epochs=4, **fit_kwargs)
    assert logger.steps_of(f"{PREFIX}/mean") == []
    (message,) = [str(w.message) for w in caught if "none was monitored" in str(w.message)]
    assert named in message and message.startswith("attn_monitor: ")


# --------------------------------------------------------------------------- real runs: resume


def _history_run(root: Path, max_epochs: int, loggers: list[Any], ckpt_path: str | None = None) -> tuple[Any, ...]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    monitor = AttentionEntropyMonitor(log=LogOptions(histogram_bins=None))
    recorder = lm.BatchRecorder()
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", save_last=True)
    trainer = make_trainer(
        root,
        loggers=loggers,
        callbacks=[monitor, recorder, checkpoint],
        max_epochs=max_epochs,
        limit_train_batches=2,
        enable_checkpointing=True,
    )
    trainer.fit(
        lm.TinyGPT(lr=0.05),
        lm.loader(lm.make_batches(2, seed=1)),
        lm.loader(lm.make_batches(2, seed=2)),
        ckpt_path=ckpt_path,
    )
    return monitor, recorder


def test_resumed_run_draws_the_same_history_as_an_uninterrupted_one(tmp_path: Path) -> None:
    """fit 2 epochs, resume with ``ckpt_path="last"`` to 4; against one uninterrupted 4-epoch fit.

    The heads-over-training pictures (TensorBoard, read back) and the W&B
    per-head charts (offline run file) of the resumed run hold all 4
    validations, as the uninterrupted run's do; their medians are each
    validation's per-head medians of the float64 reference.
    """
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    def loggers(root: Path) -> list[Any]:
        return [
            TensorBoardLogger(root, name="tb"),
            WandbLogger(save_dir=str(root), offline=True, project="attn-monitor-tests", settings=wandb_settings()),
        ]

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        _history_run(tmp_path / "resumed", 2, [TensorBoardLogger(tmp_path / "resumed", name="first")])
        runs = {}
        for name, ckpt in (("resumed", "last"), ("whole", None)):
            try:
                runs[name] = (*_history_run(tmp_path / name, 4, loggers(tmp_path / name), ckpt), tmp_path / name)
            finally:
                wandb.finish()
    pictures, charts = {}, {}
    for name, (_, _, root) in runs.items():
        accumulator = read_tensorboard(glob.glob(str(root / "tb" / "version_*"))[0])
        pictures[name] = {  # PNG bytes: equal bytes, equal pixels
            layer: accumulator.Images(f"{PREFIX}_heads/{layer}/over_training")[-1].encoded_image_string
            for layer in lm.GPT_LAYERS
        }
        (wandb_file,) = glob.glob(str(root / "wandb" / "*run-*" / "run-*.wandb"))
        rows = read_wandb_history(wandb_file)
        charts[name] = {}
        for layer in lm.GPT_LAYERS:
            row = [r for r in rows if f"{PREFIX}_heads/{layer}/chart_table" in r][-1]  # the last holds all steps
            path = Path(wandb_file).parent / "files" / row[f"{PREFIX}_heads/{layer}/chart_table"]["path"]
            charts[name][layer] = json.loads(path.read_text())["data"]
    whole_recorder = runs["whole"][1]
    assert len(whole_recorder.validations) == 4
    for layer in lm.GPT_LAYERS:
        assert pictures["resumed"][layer] == pictures["whole"][layer], layer
        assert len(charts["whole"][layer]) == 4 * lm.HEADS  # (step, head, median) rows: 4 validations
        resumed, whole = charts["resumed"][layer], charts["whole"][layer]
        assert [row[:2] for row in resumed] == [row[:2] for row in whole]
        assert [row[2] for row in resumed] == pytest.approx([row[2] for row in whole], abs=1e-6)
        steps, medians = runs["resumed"][0].core.dashboards.medians_over_time(layer, prefix=PREFIX)
        assert steps == [logged_step(v) for v in whole_recorder.validations]
        for column, validation in enumerate(whole_recorder.validations):
            samples = gpt_reference(validation["state"], validation["batches"][:2])[layer]
            for head in range(lm.HEADS):
                assert _quantile_close(medians[head, column], samples.normalized[samples.head == head], 0.5)
    assert not np.allclose(medians[:, 0], medians[:, -1]), "the model must learn for this test to mean anything"
    # The monitor's checkpoint state loads without unpickling code (torch.load's default since torch 2.6).
    buffer = io.BytesIO()
    torch.save(runs["whole"][0].state_dict(), buffer)
    buffer.seek(0)
    assert len(torch.load(buffer, weights_only=True)["history"]) == 4


# --------------------------------------------------------------------------- real runs: reuse after a failure


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt], ids=["exception", "ctrl_c"])
def test_monitor_reused_after_a_failed_fit_starts_from_zero(tmp_path: Path, failure: type[BaseException]) -> None:
    """The notebook retry: a fit fails inside sampled validation batch 1, the same monitor goes into a new Trainer.

    Its next summary holds the new run's queries only, as a fresh monitor's does.
    """
    import signal

    monitor = AttentionEntropyMonitor(
        batches=Batches(2, train_every_n_steps=1), log=LogOptions(histogram_bins=None, heatmap=False)
    )
    val = lm.make_batches(2, seed=11)
    failing = lm.TinyGPT(lr=0.0)
    failing.fail_on_val_batch, failing.fail_with = 1, failure
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises((RuntimeError, SystemExit)):  # Lightning turns Ctrl-C into exit(1)
            make_trainer(tmp_path, callbacks=[monitor], max_epochs=1, limit_train_batches=1).fit(
                failing, lm.loader(lm.make_batches(1, seed=10)), lm.loader(val)
            )
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT after a Ctrl-C
    logger = lm.MemoryLogger()
    model = lm.TinyGPT(lr=0.0)
    trainer = make_trainer(tmp_path, loggers=[logger], callbacks=[monitor], max_epochs=1, limit_train_batches=1)
    trainer.fit(model, lm.loader(lm.make_batches(1, seed=10)), lm.loader(val))
    summary = monitor.last_summary
    assert summary is not None
    assert int(summary.count.sum()) == count_queries(gpt_reference(model.state_dict(), val))
    assert _layer_means(logger) == [pytest.approx(_reference_means(model, val), abs=MEAN_TOL)]
    assert len(logger.steps_of(f"{TRAIN_PREFIX}/mean")) == 1  # step 0 of the new run is recorded again


# --------------------------------------------------------------------------- real runs: names whatever wraps the model


def test_compiled_model_logs_its_own_layer_names(tmp_path: Path) -> None:
    """``torch.compile`` (``aot_eager``) before fit: no ``_orig_mod.`` in names, pictures, saved summaries, patterns."""

    names = ["model.blocks.0.attn", "model.blocks.1.attn"]
    model = lm.CompiledGPT()
    assert "model._orig_mod.blocks.0.attn" in dict(model.named_modules())
    monitor = AttentionEntropyMonitor(layers=["model.blocks.*.attn"], save_summaries=True)
    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    val = lm.make_batches(2, seed=11)
    trainer = make_trainer(tmp_path, loggers=[tensorboard], callbacks=[monitor], max_epochs=1, limit_train_batches=1)
    trainer.fit(model, lm.loader(lm.make_batches(1, seed=10)), lm.loader(val))
    accumulator = read_tensorboard(tensorboard.log_dir)
    assert {t for t in accumulator.Tags()["scalars"] if in_family(t)} == expected_names(names)
    assert set(accumulator.Tags()["images"]) == {
        f"{PREFIX}/heatmap",
        *(f"{PREFIX}_heads/{layer}/over_training" for layer in names),
    }
    (saved,) = glob.glob(os.path.join(tensorboard.log_dir, "attn_entropy", "epoch0.pt"))
    assert load_summary(saved).layers == names
    samples = gpt_reference(model.inner[0].state_dict(), val)
    check_against_reference(tb_scalars_at(accumulator, 0), {f"model.{k}": v for k, v in samples.items()})


def test_peft_lora_model_logs_the_base_models_layer_names(tmp_path: Path) -> None:
    """PEFT LoRA on GPT-2: the names of the plain :class:`HFLM`, values of the merged weights' eager reference."""
    pytest.importorskip("peft")
    model = lm.LoraLM()
    assert "model.base_model.model.transformer.h.0.attn" in dict(model.named_modules())
    monitor = AttentionEntropyMonitor(
        log=LogOptions(histogram_bins=None, heatmap=False), layers=["model.transformer.h.*.attn"]
    )
    logger = lm.MemoryLogger()
    val = lm.make_batches(2, seed=4)
    trainer = make_trainer(tmp_path, loggers=[logger], callbacks=[monitor], max_epochs=1, limit_train_batches=1)
    trainer.fit(model, lm.loader(lm.make_batches(1, seed=3)), lm.loader(val))
    ((_, scalars),) = [(s, m) for s, m in logger.merged_records() if f"{PREFIX}/mean" in m]
    assert {name for name in scalars if in_family(name)} == expected_names(lm.HF_LAYERS)
    merged = hf_reference(model.merged_state(), val)
    check_against_reference(scalars, merged)
    unadapted = copy.deepcopy(model.model).unload()  # the adapters removed, not merged
    base = hf_reference({f"model.{k}": v for k, v in unadapted.state_dict().items()}, val)
    assert any(  # the adapters change attention: the values are the adapted model's
        abs(float(merged[layer].normalized.mean()) - float(base[layer].normalized.mean())) > 1e-3
        for layer in lm.HF_LAYERS
    )


def test_fabric_module_is_named_as_the_model(tmp_path: Path) -> None:
    """``Fabric.setup`` wraps the model in ``_FabricModule``: ``evaluate_attention`` names the layers without it."""
    from lightning.fabric import Fabric

    from attn_monitor import evaluate_attention

    model = lm.TinyGPT(lr=0.0)
    fabric = Fabric(accelerator="cpu", devices=1)
    wrapped = fabric.setup_module(model)
    assert "_forward_module.blocks.0.attn" in dict(wrapped.named_modules())
    val = lm.make_batches(2, seed=11)
    summary = evaluate_attention(wrapped, val, layers=["blocks.*.attn"])
    assert summary.layers == lm.GPT_LAYERS
    samples = gpt_reference(model.state_dict(), val)
    check_against_reference(AttentionEntropyMonitor().core.options.scalars(summary), samples)


def _ddp_names_worker(rank: int, port: int, out_dir: str) -> None:
    """One rank: wrap TinyGPT in torch DDP (gloo), evaluate its own two batches; the summary is over both ranks'."""
    from torch.nn.parallel import DistributedDataParallel

    from attn_monitor import evaluate_attention

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        wrapped = DistributedDataParallel(lm.TinyGPT(lr=0.0, seed=5))
        batches = lm.make_batches(4, seed=21)[rank::2]
        summary = evaluate_attention(wrapped, batches, layers=["blocks.*.attn"])
        torch.save({"layers": summary.layers, "scalars": summary.to_dict(PREFIX)}, f"{out_dir}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_ddp_wrapped_model_is_named_as_the_model(tmp_path: Path) -> None:
    """torch DDP in 2 CPU gloo processes: no ``module.`` segment; each rank's summary is the union's reference."""
    if not torch.distributed.is_available() or "fork" not in torch.multiprocessing.get_all_start_methods():
        pytest.skip("needs torch.distributed and the fork start method")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.start_processes(
        _ddp_names_worker, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="fork"
    )
    union = gpt_reference(lm.TinyGPT(lr=0.0, seed=5).state_dict(), lm.make_batches(4, seed=21))
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["layers"] == lm.GPT_LAYERS
        scalars = {name: value for name, value in saved["scalars"].items() if "head_" not in name}
        for layer in lm.GPT_LAYERS:
            assert scalars[f"{PREFIX}/{layer}/mean"] == pytest.approx(
                float(union[layer].normalized.mean()), abs=MEAN_TOL
            )


# --------------------------------------------------------------------------- real runs: what callbacks can watch


def test_early_stopping_and_checkpoint_watch_per_layer_statistics(tmp_path: Path) -> None:
    """EarlyStopping on a layer's median, ModelCheckpoint on its sequence mean: both read ``callback_metrics``.

    lr 0: nothing improves, so EarlyStopping(patience=1) stops after the second epoch; the values it and
    ModelCheckpoint saw are the float64 reference's. No per-head value is there.
    """
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    layer = lm.GPT_LAYERS[1]
    monitor = AttentionEntropyMonitor(log=LogOptions(histogram_bins=None, heatmap=False))
    stopper = EarlyStopping(monitor=f"{PREFIX}/{layer}/q50", mode="min", patience=1, min_delta=1e-3)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor=f"{PREFIX}/{layer}/mean_seq", save_top_k=1)
    logger, trainer, model, val = _fit_memory(
        tmp_path, monitor, max_epochs=10, extra_callbacks=[stopper, checkpoint], enable_checkpointing=True
    )
    assert trainer.current_epoch == 2 and stopper.stopped_epoch == 1
    samples = gpt_reference(model.state_dict(), val[:2])
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items() if in_family(name)}
    assert set(metrics) == {name for name in expected_names(lm.GPT_LAYERS) if not name.startswith(f"{PREFIX}_heads")}
    (*_, (_, logged)) = [(step, m) for step, m in logger.merged_records() if f"{PREFIX}/mean" in m]
    check_against_reference({**logged, **metrics}, samples)  # the per-layer values as callback_metrics hold them
    assert float(stopper.best_score) == pytest.approx(metrics[f"{PREFIX}/{layer}/q50"])
    assert float(checkpoint.best_model_score) == pytest.approx(metrics[f"{PREFIX}/{layer}/mean_seq"])
